"""The rows of a labelled text file, read by its extension (``READERS``): CSV, JSON Lines,
Parquet, and GLUE's TSV layouts (``GLUE_LAYOUTS``); a file that is empty, not UTF-8, binary or
not what its extension says, or lacks a named column, is refused in one line naming it and the
column or row. What the rows mean (labels, duplicates, the split) is
``dpbench.data.labelled_text``'s. No torch or pandas; pyarrow is imported for Parquet only."""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from dpbench.data.dataset import DataError

@dataclass(frozen=True)
class Rows:
    """A file's rows as read, before the labels are checked: texts, the pairs' second texts (None
    for single texts) and the raw labels, aligned; ``where(i)`` names row i in a message."""

    texts: tuple[str, ...]
    pairs: tuple[str, ...] | None
    labels: tuple[object, ...]
    unit: str = "row"  # "row" (counted after the header) or "line" (JSON Lines)

    def where(self, i: int) -> str:
        return f"{self.unit} {i + 1}"


@dataclass(frozen=True)
class GlueLayout:
    """A GLUE task's TSV: its header and which of its columns are the text, pair and label."""

    task: str
    header: tuple[str, ...]
    text: str
    label: str
    text_pair: str | None = None


GLUE_LAYOUTS: tuple[GlueLayout, ...] = (
    GlueLayout("SST-2", ("sentence", "label"), "sentence", "label"),
    GlueLayout("QNLI", ("index", "question", "sentence", "label"), "question", "label", "sentence"),
)

PARQUET_MAGIC = b"PAR1"


def _decode(path: Path, data: bytes, what: str) -> str:
    """``data`` as UTF-8 text (a byte-order mark dropped), or refused: binary, not UTF-8."""
    if data.startswith(PARQUET_MAGIC):
        raise DataError(f"{path}: a Parquet file, not {what} (it starts with Parquet's magic bytes PAR1); "
                        "name it .parquet")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}, line {line}: {data[e.start:e.start + 1]!r})") from None
    if "\x00" in text:
        raise DataError(f"{path}: not {what} (binary: a NUL byte on line {text[:text.index(chr(0))].count(chr(10)) + 1})")
    return text.removeprefix("\ufeff")


@dataclass(frozen=True)
class Table:
    """A text file's cells as read, every one a string: its header and rows (no pandas: the
    workflow's data environment reads the catalogued CSV with numpy and the standard library only)."""

    columns: tuple[str, ...]
    cells: tuple[tuple[str, ...], ...]

    def __len__(self) -> int:
        return len(self.cells)

    def column(self, name: str) -> tuple[str, ...]:
        k = self.columns.index(name)
        return tuple(row[k] for row in self.cells)

    def where(self, name: str, value: str) -> "Table":
        k = self.columns.index(name)
        return Table(self.columns, tuple(row for row in self.cells if row[k] == value))


def frame_rows(path: Path, frame: Table, text: str, label: str, text_pair: str | None) -> Rows:
    """Rows of a table: the named columns, each present or refused."""
    for role, column in (("text", text), ("text_pair", text_pair), ("label", label)):
        if column is not None and column not in frame.columns:
            raise DataError(f"{path}: no column {column!r} (the {role} column; the file has "
                            f"{', '.join(map(repr, frame.columns))})")
    if len(frame) == 0:
        raise DataError(f"{path}: no rows (only a header)")
    return Rows(frame.column(text), None if text_pair is None else frame.column(text_pair), frame.column(label))


def csv_frame(path: Path, data: bytes) -> Table:
    """The CSV file's cells as written (RFC 4180 quoting; a quoted cell may span lines), each row
    as wide as the header or refused."""
    body = _decode(path, data, "a CSV file")
    try:
        lines = list(csv.reader(io.StringIO(body, newline=""), strict=True))
    except csv.Error as e:
        raise DataError(f"{path}: not a readable CSV file ({e})") from None
    lines = [line for line in lines if line]  # blank lines hold no row
    if not lines:
        raise DataError(f"{path}: no header")
    header = tuple(lines[0])
    for i, cells in enumerate(lines[1:]):
        if len(cells) != len(header):
            raise DataError(f"{path}: row {i + 1} has {len(cells)} fields, the header {len(header)}")
    return Table(header, tuple(tuple(cells) for cells in lines[1:]))


def _read_csv(path: Path, data: bytes, text: str, label: str, text_pair: str | None) -> Rows:
    return frame_rows(path, csv_frame(path, data), text, label, text_pair)


def read_glue_tsv(path: Path, data: bytes, text: str | None, label: str | None, text_pair: str | None) -> Rows:
    body = _decode(path, data, "a TSV file")
    lines = body.splitlines()
    header = tuple(lines[0].split("\t")) if lines else ()
    layout = next((g for g in GLUE_LAYOUTS if g.header == header), None)
    if layout is None:
        known = "; ".join(f"{g.task}: {chr(9).join(g.header)!r}" for g in GLUE_LAYOUTS)
        raise DataError(f"{path}: header {chr(9).join(header)!r} is not a GLUE layout ({known})")
    named = {"text": text, "label": label, "text_pair": text_pair}
    for role, column in named.items():
        if column is not None and column != getattr(layout, role):
            raise DataError(f"{path}: a GLUE {layout.task} file's {role} column is {getattr(layout, role)!r}, "
                            f"not {column!r}")
    rows = [line.split("\t") for line in lines[1:]]  # GLUE's TSVs are unquoted: a tab never occurs in a text
    for i, cells in enumerate(rows):
        if len(cells) != len(header):
            raise DataError(f"{path}: row {i + 1} has {len(cells)} tab-separated fields, the {layout.task} "
                            f"header {len(header)}")
    if not rows:
        raise DataError(f"{path}: no rows (only a header)")
    column = {name: k for k, name in enumerate(header)}

    def values(name):
        return tuple(cells[column[name]] for cells in rows)

    return Rows(values(layout.text), None if layout.text_pair is None else values(layout.text_pair),
                values(layout.label))


def _read_jsonl(path: Path, data: bytes, text: str, label: str, text_pair: str | None) -> Rows:
    body = _decode(path, data, "a JSON Lines file")
    texts, pairs, labels, numbers = [], [], [], []
    for n, line in enumerate(body.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {n} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}: line {n} is not a JSON object")
        for role, column in (("text", text), ("text_pair", text_pair), ("label", label)):
            if column is not None and column not in obj:
                raise DataError(f"{path}: line {n} has no key {column!r} (the {role} column)")
        texts.append(obj[text])
        pairs.append(obj[text_pair] if text_pair is not None else None)
        labels.append(obj[label])
        numbers.append(n)
    if not texts:
        raise DataError(f"{path}: no rows (no JSON object on any line)")
    return _Lines(tuple(texts), None if text_pair is None else tuple(pairs), tuple(labels), "line", tuple(numbers))


@dataclass(frozen=True)
class _Lines(Rows):
    """Rows of a JSON Lines file, named by their line numbers (blank lines are skipped)."""

    numbers: tuple[int, ...] = ()

    def where(self, i: int) -> str:
        return f"line {self.numbers[i]}"


def _read_parquet(path: Path, data: bytes, text: str, label: str, text_pair: str | None) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not (len(data) >= 8 and data[:4] == PARQUET_MAGIC and data[-4:] == PARQUET_MAGIC):
        looks = "UTF-8 text" if _is_text(data) else "binary"
        raise DataError(f"{path}: not a Parquet file (no PAR1 magic bytes at its start and end; it is {looks})")
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    for role, column in (("text", text), ("text_pair", text_pair), ("label", label)):
        if column is not None and column not in table.column_names:
            raise DataError(f"{path}: no column {column!r} (the {role} column; the file has "
                            f"{', '.join(map(repr, table.column_names))})")
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows")
    kind = table.schema.field(label).type
    if pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        raise DataError(f"{path}: column {label!r} holds {kind} values, not classes (store integers or names)")
    return Rows(tuple(table.column(text).to_pylist()),
                None if text_pair is None else tuple(table.column(text_pair).to_pylist()),
                tuple(table.column(label).to_pylist()))


def _is_text(data: bytes) -> bool:
    try:
        return b"\x00" not in data and bool(data.decode("utf-8"))
    except UnicodeDecodeError:
        return False


# extension -> reader(path, bytes, text, label, text_pair)
READERS = MappingProxyType({".csv": _read_csv, ".jsonl": _read_jsonl, ".parquet": _read_parquet,
                            ".tsv": read_glue_tsv})


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bytes(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if not data:
        raise DataError(f"{path}: empty file")
    return data
