"""The public corpus of pretraining: the glosses of WordNet 3.0 (Miller, 1995; Fellbaum, 1998).

Source. Debian's ``wordnet-base`` package (``apt-get install wordnet-base``, version
``PACKAGE_VERSION``) installs the WordNet 3.0 database in ``/usr/share/wordnet/``; the four
data files ``data.adj``, ``data.adv``, ``data.noun`` and ``data.verb`` are read, nothing else
(the index, exception and sentence-frame files hold no prose). Files are located in
``data_dir/wordnet`` first, then in ``SYSTEM_DIRS``, and each is verified against the SHA-256
in ``SHA256`` before it is parsed (``dpbench.data.debian``, shared with ``fortunes``); a missing
or changed file is a DataError naming it. Nothing is downloaded and nothing is replaced by
synthetic text.

Licence (WordNet 3.0, Princeton University): "Permission to use, copy, modify and distribute
this software and database and its documentation for any purpose and without fee or royalty is
hereby granted, provided that you agree to comply with the following copyright notice and
statements, including the disclaimer, and that the same appear on ALL copies of the software,
database and documentation, including modifications that you make for internal use or for
distribution. WordNet 3.0 Copyright 2006 by Princeton University. All rights reserved."
(``/usr/share/doc/wordnet-base/copyright``; docs/finetune.md quotes it whole, disclaimer included.)

Format (wndb(5WN)). Each data file opens with the licence, on lines that start with two spaces;
every other line is one synset: ``offset lex_filenum ss_type w_cnt word lex_id ... p_cnt
[pointers] [frames] | gloss``. The gloss, after the first ``" | "``, is the synset's definition
followed by its example sentences in double quotes, separated by ``"; "``, e.g.
``giving birth; "a parturient heifer"``. Lemmas never contain ``|``, so the first ``" | "``
ends the fields.

Records. One record = one synset's gloss, with surrounding whitespace stripped, as plain text
(definition and examples as WordNet writes them); empty glosses dropped. Order: the files in
name order, then their lines in file order (a pure function of the files' bytes). A text shared
by several synsets occurs once per synset.

Split. A record is held out for validation iff ``int(sha256(text)[:8], 16) % 100 <
VALIDATION_PERCENT``, a function of its text alone (as for fortunes): every copy of a text lands
on the same side.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from dpbench.data.debian import Package

NAME = "wordnet"
SYSTEM_DIRS: list[Path] = [Path("/usr/share/wordnet")]
VALIDATION_PERCENT = 2
PACKAGE_VERSION = "1:3.0-37"  # the Debian version whose files SHA256 holds
HOW_TO_GET = (
    "To obtain the corpus: `apt-get install wordnet-base` (Debian/Ubuntu; installs /usr/share/wordnet/), "
    "or copy the package's data.adj, data.adv, data.noun and data.verb into DATA_DIR/wordnet/."
)
PACKAGE = Package(NAME, "wordnet-base", HOW_TO_GET)  # where the files are found and how they are verified

# SHA-256 of the data files of Debian's `wordnet-base` 1:3.0-37 (the installed files also match
# the package's own md5sums).
SHA256: dict[str, str] = {
    "data.adj": "c89120dfc1f046ddff4a631bf9b7e9fa1a36b5e86565a23bf82dbe14f30b88a7",
    "data.adv": "444a63bf3955080ab7524f5079cfc07ff9bc682cb98bdb1db73b0fb9829f1139",
    "data.noun": "fea17d2f9656611334eac790e5d69e47645fa180c4aa481fb4cd9b3520754ca2",
    "data.verb": "adcf43e35b581e8036d8b5a52d63d9cd3d3b4870b2720d3c03c799df44777bc2",
}


@dataclass(frozen=True)
class Corpus:
    train: tuple[str, ...]
    validation: tuple[str, ...]
    source: str  # the directory the files were read from


def parse(text: str) -> list[str]:
    """The glosses of one data file, in line order: the text after the first ``" | "`` of each
    synset line, stripped; licence lines (starting with a space) and empty glosses dropped."""
    records = []
    for line in text.split("\n"):
        if not line or line[0] == " ":
            continue
        _, sep, gloss = line.partition(" | ")
        gloss = gloss.strip()
        if sep and gloss:
            records.append(gloss)
    return records


def is_validation(record: str) -> bool:
    digest = hashlib.sha256(record.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < VALIDATION_PERCENT


def split(records: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(train, validation), each in the order of ``records``."""
    train, validation = [], []
    for r in records:
        (validation if is_validation(r) else train).append(r)
    return tuple(train), tuple(validation)


def load(data_dir: str | Path | None = None, *, manifest: Mapping[str, str] | None = None) -> Corpus:
    """Locate, verify and parse the corpus. ``manifest`` ({file: SHA-256 hex}) replaces
    ``SHA256``, file set included; tests use it to load generated files."""
    manifest = SHA256 if manifest is None else manifest
    directory, texts = PACKAGE.texts(data_dir, SYSTEM_DIRS, manifest)
    train, validation = split([r for name in sorted(texts) for r in parse(texts[name])])
    return Corpus(train, validation, str(directory))


def stats(corpus: Corpus) -> dict:
    """Record and byte counts (UTF-8) of the corpus."""
    records = corpus.train + corpus.validation
    return {"records": len(records), "distinct_records": len(set(records)), "train": len(corpus.train),
            "validation": len(corpus.validation), "bytes": sum(len(r.encode("utf-8")) for r in records)}
