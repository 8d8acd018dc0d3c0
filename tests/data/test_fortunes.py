"""Tests of dpbench.data.fortunes on small fortune files generated in the official format (records
separated by lines holding only "%"), plus the real Debian corpus when it is installed."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from conftest import write_fortunes
from dpbench.data import fortunes
from dpbench.data.dataset import DataError
from dpbench.problems import tokenizer

SYSTEM_DIR = fortunes.SYSTEM_DIRS[0]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def no_system_dirs(monkeypatch, tmp_path):
    empty = tmp_path / "system"
    empty.mkdir()
    monkeypatch.setattr(fortunes, "SYSTEM_DIRS", [empty])
    return empty


def test_parse_official_format():
    text = "A penny saved.\n%\n  Two\n  lines  \n\n%\n%\n   \n%\n    /\\_/\\\n   ( o.o )\n%\nno final percent"
    assert fortunes.parse(text) == ["A penny saved.", "Two\n  lines", "/\\_/\\\n   ( o.o )", "no final percent"]
    # only a line that is exactly "%" separates; "%" inside a line or "%%" does not
    assert fortunes.parse("50% off\n%%\nsame record\n%\nnext\n") == ["50% off\n%%\nsame record", "next"]
    assert fortunes.parse("a\r\n%\r\nb\r\n") == ["a", "b"]
    assert fortunes.parse("") == [] and fortunes.parse("%\n%\n") == []


def test_load_round_trip(tmp_path, no_system_dirs):
    files = {"art": ["Art is long.", "Ünïcode — “quotes”"], "work": ["Work is short.", "Art is long."]}
    manifest = write_fortunes(tmp_path / "fortunes", files)
    corpus = fortunes.load(tmp_path, manifest=manifest)
    assert corpus.source == str(tmp_path / "fortunes")
    records = [r for name in sorted(files) for r in files[name]]
    assert sorted(corpus.train + corpus.validation) == sorted(records)
    assert corpus.validation == tuple(r for r in records if fortunes.is_validation(r))
    assert fortunes.verify(tmp_path / "fortunes", manifest=manifest) == {k: f"sha256:{v}" for k, v in manifest.items()}


def test_split_rule_is_the_documented_hash():
    # sha256("a") = ca978112... -> 3398926610 % 100 = 10: just outside the validation side (< 10);
    # sha256("c") = 2e7d2c03... -> 779955203 % 100 = 3: validation
    assert hashlib.sha256(b"a").hexdigest().startswith("ca978112") and int("ca978112", 16) == 3398926610
    assert hashlib.sha256(b"c").hexdigest().startswith("2e7d2c03") and int("2e7d2c03", 16) == 779955203
    assert not fortunes.is_validation("a") and fortunes.is_validation("c")
    texts = [f"record {i}" for i in range(2000)]
    share = sum(map(fortunes.is_validation, texts)) / len(texts)
    assert 0.08 < share < 0.12  # ~10% (binomial sd 0.7%)
    for t in texts[:50]:
        assert fortunes.is_validation(t) == (int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) % 100 < 10)


def test_split_stable_when_a_file_is_added(tmp_path, no_system_dirs):
    first = {"a": [f"alpha {i}" for i in range(150)], "m": [f"mu {i}" for i in range(150)]}
    manifest = write_fortunes(tmp_path / "fortunes", first)
    before = fortunes.load(tmp_path, manifest=manifest)
    assert len(before.validation) > 10 and len(before.train) > 200
    # a new file sorting between the two, holding new records and duplicates of old ones
    manifest |= write_fortunes(tmp_path / "fortunes", {"b": [f"beta {i}" for i in range(150)] + first["m"][:40]})
    after = fortunes.load(tmp_path, manifest=manifest)
    assert set(before.train) <= set(after.train) and set(before.validation) <= set(after.validation)
    assert not set(after.train) & set(after.validation)  # duplicates land on the same side
    assert len(after.train) + len(after.validation) == 490


def test_damaged_file_refused(tmp_path, no_system_dirs):
    manifest = write_fortunes(tmp_path / "fortunes", {"art": ["one", "two"], "law": ["three"]})
    path = tmp_path / "fortunes" / "law"
    path.write_bytes(path.read_bytes().replace(b"three", b"thr3e"))
    with pytest.raises(DataError, match=rf"checksum mismatch for {path}.*apt-get install"):
        fortunes.load(tmp_path, manifest=manifest)


def test_missing_file_names_it_and_where_it_looked(tmp_path, no_system_dirs):
    manifest = write_fortunes(tmp_path / "fortunes", {"art": ["one"], "law": ["two"]})
    (tmp_path / "fortunes" / "law").unlink()
    with pytest.raises(DataError) as e:
        fortunes.load(tmp_path, manifest=manifest)
    msg = str(e.value)
    assert f"{tmp_path / 'fortunes'}: missing law" in msg
    assert f"{no_system_dirs}: missing art, law" in msg and "apt-get install fortunes" in msg


def test_data_dir_searched_before_system_dir(tmp_path, monkeypatch):
    system = tmp_path / "system"
    manifest = write_fortunes(system, {"art": ["from system"]})
    monkeypatch.setattr(fortunes, "SYSTEM_DIRS", [system])
    assert fortunes.load(tmp_path / "nowhere", manifest=manifest).source == str(system)
    write_fortunes(tmp_path / "local" / "fortunes", {"art": ["from system"]})
    assert fortunes.load(tmp_path / "local", manifest=manifest).source == str(tmp_path / "local" / "fortunes")


def test_stats_counts_tokens_like_the_tokenizer():
    corpus = fortunes.Corpus(train=("ab", "é" * 5, "ab"), validation=("x" * 20,), source="-")
    s = fortunes.stats(corpus, context=8)
    # lengths [BOS]+bytes+[EOS]: 4, 12, 4, 22; truncated when > context + 1 = 9
    assert (s["records"], s["distinct_records"], s["train"], s["validation"]) == (4, 3, 3, 1)
    assert (s["tokens_total"], s["tokens_max"], s["truncated"]) == (42, 22, 2)
    assert s["tokens_mean"] == pytest.approx(10.5) and s["truncated_share"] == pytest.approx(0.5)
    records = corpus.train + corpus.validation
    rows = tokenizer.encode_records(records, 8)
    assert [tokenizer.sequence_length(r) for r in records] == [4, 12, 4, 22]
    assert sum(row[-1] != tokenizer.PAD for row in rows) == s["truncated"]


@pytest.mark.realdata
@pytest.mark.skipif(not all((SYSTEM_DIR / f).is_file() for f in fortunes.SHA256),
                    reason=f"Debian's fortunes not installed in {SYSTEM_DIR} (apt-get install fortunes)")
def test_real_corpus():
    corpus = fortunes.load()
    n = len(corpus.train) + len(corpus.validation)
    # strfile's own index (<file>.dat: version, number of strings, as big-endian u32) agrees
    indexed = sum(struct.unpack(">II", (SYSTEM_DIR / f"{f}.dat").read_bytes()[:8])[1] for f in fortunes.SHA256)
    assert n == indexed == 14396
    assert (len(corpus.train), len(corpus.validation)) == (12979, 1417)
    assert len(fortunes.SHA256) == 40


def test_cli_data_fortunes(tmp_path, monkeypatch, capsys, no_system_dirs):
    from dpbench.cli import main

    records = ["short", "x" * 20, "é" * 3]  # [BOS]+bytes+[EOS]: 7, 22, 8 tokens
    manifest = write_fortunes(tmp_path / "data" / "fortunes", {"art": records})
    monkeypatch.setattr(fortunes, "SHA256", manifest)
    out = tmp_path / "m.json"
    assert main(["data", "--dataset", "fortunes", "--data-dir", str(tmp_path / "data"), "--context", "6",
                 "--manifest", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["files"] == {"art": f"sha256:{manifest['art']}"}
    assert printed["directory"] == str(tmp_path / "data" / "fortunes") and printed["package"].startswith("fortunes 1:")
    assert (printed["records"], printed["train"] + printed["validation"]) == (3, 3)
    assert (printed["tokens_total"], printed["tokens_max"], printed["context"]) == (37, 22, 6)
    # truncated when longer than context + 1 = 7 tokens: 22 and 8, not 7
    assert printed["truncated"] == 2 and printed["truncated_share"] == pytest.approx(2 / 3)
    # damaged: one line naming the file, exit status 2
    (tmp_path / "data" / "fortunes" / "art").write_text("tampered\n%\n")
    assert main(["data", "--dataset", "fortunes", "--data-dir", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and str(tmp_path / "data" / "fortunes" / "art") in err
