"""The text corpus of the private language model (P4): Debian's ``fortunes`` quotations.

Source. The plain-text fortune files of Debian's ``fortunes`` package (``apt-get install
fortunes``), installed in ``/usr/share/games/fortunes/``: one file per topic (``art``,
``computers``, ... ``zippy``), each a sequence of records separated by lines holding only
``%``. The package also installs ``<file>.dat`` (random-access indexes built by ``strfile``) and
``<file>.u8`` (symlinks to the same text); neither is read. The three files of the
``fortunes-min`` package in the same directory (``fortunes``, ``literature``, ``riddles``) are
not part of this corpus. Files are located in ``data_dir/fortunes`` first, then in
``SYSTEM_DIRS``, and each is verified against the SHA-256 in ``SHA256`` before it is parsed
(``dpbench.data.debian``, shared with ``wordnet``); a missing or changed file is a DataError
naming it, the places searched and how to get it. Nothing is replaced by synthetic text.

Records. A record is the text between two ``%`` lines, with surrounding whitespace stripped;
empty records are dropped. Inner line breaks and spacing are kept (some records are ASCII art).

Privacy unit (record-level DP). One record is one training example and the unit of privacy:
neighbouring datasets differ in one record, and the accountant's N is the number of training
records (canaries inserted by ``dpbench.problems.canaries.insert`` included). The guarantee is per
record, not per author or per quotation: a text that occurs r times (the corpus has exact
duplicates across files) is protected only at group size r, with the usual group-privacy
degradation.

Files. Each record keeps the name of the file it came from (``Corpus.train_files``,
``Corpus.validation_files``, aligned with the records): P6's label. A text that occurs in two
files (78 texts of the package, 156 records) is two records with their own files: a record's
example depends on that record alone, so the guarantee stays per record (merging or dropping
such texts would make one record's presence change another's example).

Split. A record goes to validation iff ``int(sha256(text.encode()).hexdigest()[:8], 16) % 100 <
VALIDATION_PERCENT``, a function of its text alone: not of its position, so adding or
reordering files moves no existing record, and every copy of a duplicated text lands on the same
side (no validation record is also a training record). The split is public and data-independent
per record; choosing it spends no privacy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from dpbench.data.debian import Package

NAME = "fortunes"
SYSTEM_DIRS: list[Path] = [Path("/usr/share/games/fortunes")]
VALIDATION_PERCENT = 10
CONTEXT = 128  # the context length at which `dpbench data` reports truncation
PACKAGE_VERSION = "1:1.99.1-7.3"  # the Debian version whose files SHA256 holds
HOW_TO_GET = (
    "To obtain the corpus: `apt-get install fortunes` (Debian/Ubuntu; installs "
    "/usr/share/games/fortunes/), or copy the package's plain-text files into DATA_DIR/fortunes/."
)
PACKAGE = Package(NAME, "fortunes", HOW_TO_GET)  # where the files are found and how they are verified

# SHA-256 of the plain-text files of Debian's `fortunes` package, version 1:1.99.1-7.3
# (Debian 12 "bookworm"; the installed files also match the package's own md5sums).
SHA256: dict[str, str] = {
    "art": "600b8197bc994fd4fcbb623aa5e700629540af44f044d4907886bd1031f160ce",
    "ascii-art": "818d0967629e0cd48b69c4b7e93645a7f80bba99ed4f1cd668f42b3d174b7431",
    "computers": "a86be224d9f733b88eeaf8a46ea0427e05cc69c69edcf5f6db47ddf561ca37fd",
    "cookie": "5dc97eee96dcc5287c373be629482730d45f77b59da1287933c9c5f482a055eb",
    "debian": "491dd04bf909b64152bcb554b9bc88df0ca50c0dc676d74d10742bf38aaa50de",
    "definitions": "57be4744c353d931fa2ca95f50215d4b67539f5a527ae628a6441fb4a1258caa",
    "disclaimer": "c085d66ea68686d5e28852cef77c3eeb3640895c5647b148deeaaada2c07fa7b",
    "drugs": "a5a59ee8b0e1fd3085a38dfa29149fe9a2c8d7f256b74aea71aa2cc08a9990c1",
    "education": "ba13321d6d6beb7a6e65296a47450bfc87b24a319fff2e94762011b59a31aa35",
    "ethnic": "61695cb9b60dbee91755027da1fa4f850f4c6386ff38197a48e4ff1696385e19",
    "food": "78077a65b9288df71e7b2a8e8258cd3b1005d1282f7c7e57ad53927f374df45d",
    "goedel": "9d447862c803f22cdf7bb26cb70cca1a7f8a2a7992f2793ddcb43cfcf3302ab0",
    "humorists": "ffdf67e1f4049133bf904b769c364de45e5ae0abfb3ea7c9afb54b87b89acfc4",
    "kids": "82e51834990afd36f2ea2f25864b368e2f44f9c761aba034035b26061de6d5be",
    "knghtbrd": "c25e8373b38a6f159a7b1d336f363d5c962224a6ddcc86279dec47aad3c869b3",
    "law": "f04141f94e788b7899e0adb0490d182ce711f8fdbb8252343a5257e717e9279d",
    "linux": "85b0e5eadf7adeea77da4e1fbd456c962ce3bd1dabbd053098ecf37de9169cf3",
    "linuxcookie": "4f75959924ae5bb1955c30a5c985e641ec17cd5ebb7453d839f94b1988331202",
    "love": "4d4fb7c540e5500e44643524dae41dd7d2b21b80be184253fd9f8541f6029fc5",
    "magic": "b9553a1d84d966db55a24a779206cc4565bf3686c9ecbc31215f654129e3166e",
    "medicine": "18b8c7b098e649024159c9d9f3e37a0832bbd2d5cf3e2317b313134761afd487",
    "men-women": "8fc4eb68a8d16826372d9bfdc910c8ab917b8aa59e2aac533f3ec2b49a1314ba",
    "miscellaneous": "e3d81fd016f9f84a70ecb9aa197c4911aca01a8034e49345b81093f6751bba9c",
    "news": "4b8eebae510353d6f628dfdaf52bf8cbdafb891a122b146421c805b74f389617",
    "paradoxum": "85228975016fe975065eaf0baf55980d32d26f9e2fa99f69da4696d11ac02036",
    "people": "2afb4b9f577be114d2dca279bc5590ee8415e1405295d7d7626c888d82f338e8",
    "perl": "b19145eadf97c31add2e0a199d93ffa0eb92e00275c2724b7ad6b4e412113536",
    "pets": "084472564bc55df566733a224f8a737d78717132ec43628be0c2af466ac41ecc",
    "platitudes": "88448274efec3d2c0908cc11525c9b065b95a32c232a2c58c67a87dd88545ee5",
    "politics": "b56ca45a046edd5c459090a5c6b335332661b436e814b41ac87bb58065ad6131",
    "pratchett": "48410754f1b2091f418ac27421d2764628b23c91427b12809031cf2b39be5b0e",
    "science": "7ab350b142ee6c70c1d8517c5a1b3790c09b190a62859427cad98e6e35a19fcc",
    "songs-poems": "eb714d297b468da91b6ca32baefb000279a3e3740b09f8a87db24fe58e010b1a",
    "sports": "b71dd524d7bca888ec1014fb849a8a15cf58017c59127e572d393ef7632c35c8",
    "startrek": "7b2e4c235b99452b2de4c47d67aae0faac2ea508a2d644609e4ef5db7653c39c",
    "tao": "4adddc35a122bb233a16c076abc0be0326ea3a68594146a6baee3b5f6489e12b",
    "translate-me": "a183879cf46ee4a6176f6b9f0f31adb6abfc6333b64f8fbebeba57017c81e12e",
    "wisdom": "9b0bd6b9331a68c9172219784a411c417c055ed69734edc7b4406795b87d4e94",
    "work": "ad8a0e104160e2c4782fa86e143cd60ffab2872985d4293ffd0af6df19dbfa28",
    "zippy": "b996a112c99a2d61782e1a9a1f3c5445122f18ac312485f2c78279e82ca33932",
}


@dataclass(frozen=True)
class Corpus:
    train: tuple[str, ...]
    validation: tuple[str, ...]
    source: str  # the directory the files were read from
    train_files: tuple[str, ...] = ()  # the file of each training record (the same order)
    validation_files: tuple[str, ...] = ()


def verify(directory: str | Path, *, manifest: Mapping[str, str] | None = None) -> dict[str, str]:
    """Verify the files in ``directory``; return {file: "sha256:<hex>"} of what was checked."""
    manifest = SHA256 if manifest is None else manifest
    PACKAGE.read_verified(directory, manifest)
    return {name: f"sha256:{manifest[name].lower().removeprefix('sha256:')}" for name in sorted(manifest)}


# --------------------------------------------------------------------------- parsing and split


def parse(text: str) -> list[str]:
    """The records of one fortune file: the text between lines holding only ``%``, stripped of
    surrounding whitespace, empty ones dropped."""
    records, lines = [], []
    for line in text.split("\n"):
        if line.rstrip("\r") == "%":
            records.append("\n".join(lines).strip())
            lines = []
        else:
            lines.append(line)
    records.append("\n".join(lines).strip())
    return [r for r in records if r]


def is_validation(record: str) -> bool:
    """Whether ``record`` belongs to the validation split (a function of its text only)."""
    digest = hashlib.sha256(record.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < VALIDATION_PERCENT


def split(records: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train, validation), each in the order of ``records``."""
    train, validation = [], []
    for r in records:
        (validation if is_validation(r) else train).append(r)
    return tuple(train), tuple(validation)


def load(data_dir: str | Path | None = None, *, manifest: Mapping[str, str] | None = None) -> Corpus:
    """Locate, verify and parse the corpus; records in file-name order, then file order, each
    with its file.

    ``manifest`` ({file: SHA-256 hex}) replaces ``SHA256``, file set included; tests use it to
    load generated files.
    """
    manifest = SHA256 if manifest is None else manifest
    directory, texts = PACKAGE.texts(data_dir, SYSTEM_DIRS, manifest)
    labelled = [(r, name) for name in sorted(texts) for r in parse(texts[name])]
    train, validation = split([r for r, _ in labelled])
    train_files = tuple(name for r, name in labelled if not is_validation(r))
    validation_files = tuple(name for r, name in labelled if is_validation(r))
    return Corpus(train, validation, str(directory), train_files, validation_files)


# --------------------------------------------------------------------------- statistics


def stats(corpus: Corpus, context: int) -> dict:
    """Record and token counts of the corpus under the byte-level tokenizer at ``context``.

    A record is ``[BOS] + UTF-8 bytes + [EOS]``, i.e. ``len(bytes) + 2`` tokens
    (``dpbench.problems.tokenizer.sequence_length``, restated here because ``dpbench.data``
    imports no torch); it is truncated when that exceeds ``context + 1`` (the model reads
    ``context`` tokens and predicts the next ``context``).
    """
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    records = corpus.train + corpus.validation
    lengths = [len(r.encode("utf-8")) + 2 for r in records]
    n = len(records)
    return {
        "records": n,
        "distinct_records": len(set(records)),
        "train": len(corpus.train),
        "validation": len(corpus.validation),
        "tokens_total": sum(lengths),
        "tokens_mean": sum(lengths) / n if n else 0.0,
        "tokens_max": max(lengths, default=0),
        "context": context,
        "truncated": sum(length > context + 1 for length in lengths),
        "truncated_share": sum(length > context + 1 for length in lengths) / n if n else 0.0,
    }


def prepare(data_dir: str | Path | None = None, context: int = CONTEXT, *,
            manifest: Mapping[str, str] | None = None) -> dict:
    """Locate, verify and parse the corpus; return a JSON manifest with its statistics
    (``dpbench data --dataset fortunes``). Nothing is downloaded: the files come from the
    Debian package."""
    manifest = SHA256 if manifest is None else manifest
    corpus = load(data_dir, manifest=manifest)
    return {
        "dataset": NAME,
        "directory": corpus.source,
        "package": f"fortunes {PACKAGE_VERSION}" if manifest is SHA256 else None,
        "files": {name: f"sha256:{manifest[name].lower().removeprefix('sha256:')}" for name in sorted(manifest)},
        **stats(corpus, context),
    }
