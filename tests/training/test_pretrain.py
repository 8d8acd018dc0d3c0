"""Public pretraining: the WordNet loader, the removal of the private text from the public corpus,
and the pretrained checkpoint (deterministic bytes, resumption, verification against its sidecar),
on small files generated in the official formats, plus the real corpora when they are installed."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from dpbench.data import fortunes, overlap, wordnet
from dpbench.data.dataset import DataError
from dpbench.pipeline.fingerprint import pretrain_fingerprint
from dpbench.problems.transformer import TransformerLM
from dpbench.training import pretrain as pt
from dpbench.training.recipes import RECIPES, Recipe, checkpoint_name, from_json, get_recipe

CODE = pretrain_fingerprint()

WORDNET_DIR, FORTUNES_DIR = wordnet.SYSTEM_DIRS[0], fortunes.SYSTEM_DIRS[0]
REAL = pytest.mark.skipif(
    not all((WORDNET_DIR / f).is_file() for f in wordnet.SHA256) or not all((FORTUNES_DIR / f).is_file()
                                                                           for f in fortunes.SHA256),
    reason="needs Debian's wordnet-base and fortunes (apt-get install wordnet-base fortunes)")
LICENCE = "  1 This software and database is being provided to you, the LICENSEE, by  \n  2   \n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_wordnet(directory: Path, files: dict[str, list[str]]) -> dict[str, str]:
    """Data files in the wndb(5WN) layout: the licence on lines starting with spaces, then one
    synset a line, ``offset lex_filenum ss_type w_cnt word lex_id p_cnt | gloss`` (two trailing
    spaces, as WordNet writes them); returns the manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, glosses in files.items():
        lines = [f"{1000 + i:08d} 00 n 01 word{i} 0 000 | {g}  \n" for i, g in enumerate(glosses)]
        data = (LICENCE + "".join(lines)).encode()
        (directory / name).write_bytes(data)
        manifest[name] = sha256(data)
    return manifest


def write_fortunes(directory: Path, files: dict[str, list[str]]) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, records in files.items():
        data = "".join(f"{r}\n%\n" for r in records).encode()
        (directory / name).write_bytes(data)
        manifest[name] = sha256(data)
    return manifest


PLANTED = "The secret of success is to know something nobody else knows."  # a private record, 62 bytes


def glosses(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    nouns, verbs = ["a cat", "the dog", "a small bird", "the river", "an old tree"], ["sees", "likes", "follows"]
    return [f"{rng.choice(nouns)} that {rng.choice(verbs)} {rng.choice(nouns)}; \"{rng.choice(nouns)} {i}\""
            for i in range(n)]


@pytest.fixture
def data_dir(tmp_path) -> tuple[Path, dict, dict]:
    """A generated public corpus (600 glosses; one of them holds a private record whole) and a
    generated private corpus: (data dir, public manifest, private manifest)."""
    public = glosses(600)
    public[7] = f"a saying; \"{PLANTED}\""
    d = tmp_path / "data"
    return (d, write_wordnet(d / "wordnet", {"data.test": public}),
            write_fortunes(d / "fortunes", {"wisdom": [PLANTED, "Huh?!", "Two\nlines of it"]}))


def small_recipe(manifests, **changes) -> Recipe:
    _, public, private = manifests
    fields = dict(name="test", steps=40, batch_size=16, lr=3e-3, warmup_steps=4, context=64, d_model=32,
                  n_layers=1, n_heads=2, d_mlp=64, threads=1, corpus_manifest=public, private_manifest=private)
    fields = {**fields, **changes}
    return from_json({**fields, "warmup_steps": min(4, fields["steps"])})


# --------------------------------------------------------------------------- the WordNet loader


def test_glosses_are_parsed_from_the_data_file_layout():
    text = LICENCE + ("00001740 02 r 01 a_cappella 0 000 | without musical accompaniment; \"they performed a "
                      "cappella\"  \n00001837 00 a 01 able 0 002 ! 00002098 a 0101 | (usually followed by `to') "
                      "having the means; \"able to swim\"  \n00002000 00 a 01 empty 0 000 |   \n")
    assert wordnet.parse(text) == ['without musical accompaniment; "they performed a cappella"',
                                   "(usually followed by `to') having the means; \"able to swim\""]


def test_load_verifies_each_file_and_names_a_missing_or_changed_one(tmp_path, monkeypatch):
    monkeypatch.setattr(wordnet, "SYSTEM_DIRS", [tmp_path / "system"])
    manifest = write_wordnet(tmp_path / "wordnet", {"data.b": ["beta gloss"], "data.a": ["alpha", "gamma"]})
    corpus = wordnet.load(tmp_path, manifest=manifest)
    assert sorted(corpus.train + corpus.validation) == ["alpha", "beta gloss", "gamma"]
    assert corpus.source == str(tmp_path / "wordnet")
    assert wordnet.stats(corpus)["bytes"] == len("alpha") + len("gamma") + len("beta gloss")
    (tmp_path / "wordnet" / "data.b").write_bytes(b"00000001 00 n 01 x 0 000 | changed  \n")
    with pytest.raises(DataError, match=r"checksum mismatch for .*data\.b"):
        wordnet.load(tmp_path, manifest=manifest)
    (tmp_path / "wordnet" / "data.b").unlink()
    with pytest.raises(DataError, match=r"(?s)not found.*wordnet: missing data\.b.*apt-get install wordnet-base"):
        wordnet.load(tmp_path, manifest=manifest)
    (tmp_path / "wordnet" / "data.b").write_bytes(b"\xff")
    with pytest.raises(DataError, match=r"checksum mismatch .*Debian's wordnet-base package; reinstall it "
                                        r"\(`apt-get install --reinstall wordnet-base`\)"):
        wordnet.load(tmp_path, manifest=manifest)


def test_the_checkpoints_code_is_the_corpora_not_the_image_loaders():
    """The two Debian corpora share one locate-and-verify (dpbench.data.debian) and DataError
    lives apart from the image loaders: the code that names a pretrained checkpoint holds both
    corpora's loaders and none of Fashion-MNIST's or CIFAR-10's (their downloader included)."""
    from dpbench.pipeline import fingerprint

    closure = fingerprint.module_closure(fingerprint.PRETRAIN)
    data = sorted(m for m in closure if m.startswith("dpbench.data."))
    assert data == ["dpbench.data.dataset", "dpbench.data.debian", "dpbench.data.fortunes", "dpbench.data.overlap",
                    "dpbench.data.wordnet"]
    assert wordnet.PACKAGE.package == "wordnet-base" and fortunes.PACKAGE.package == "fortunes"


@pytest.mark.realdata
@REAL
def test_real_wordnet_matches_its_manifest_and_size():
    corpus = wordnet.load()
    assert wordnet.stats(corpus) == {"records": 117659, "distinct_records": 117033, "train": 115376,
                                     "validation": 2283, "bytes": 8845632}
    # one gloss per synset line of the four data files
    lines = sum(1 for f in wordnet.SHA256 for line in (WORDNET_DIR / f).read_text().split("\n")
                if line and line[0] != " ")
    assert lines == 117659


# --------------------------------------------------------------------------- removing the private text


def naive_removal(public, private, span):
    """The definition, by brute force: a public record goes if it holds a private record whole, or
    any span of ``span`` bytes of one (both normalised)."""
    reasons = {}
    for i, text in enumerate(public):
        q = overlap.normalise(text).encode()
        for r in private:
            p = overlap.normalise(r).encode()
            if p and p in q:
                reasons[i] = "record"
                break
            if i not in reasons and any(p[j:j + span] in q for j in range(len(p) - span + 1)):
                reasons[i] = "span"
    return reasons


def test_planted_overlaps_are_removed_and_a_49_byte_span_is_not():
    private = ["Fortune favours the bold.", "x" * 10 + "abcdefghij" * 5 + "y" * 10, "zz"]
    shared50 = "abcdefghij" * 5  # 50 bytes shared with the second record
    public = [
        "a proverb; \"fortune   FAVOURS the bold.\" said he",  # the first record whole (spacing, case)
        "text " + shared50 + " text",  # a 50-byte span of the second
        "text " + shared50[:49] + " text",  # 49 bytes: kept
        "x" * 10 + shared50[:45] + " and more",  # 55 bytes shared (10 + 45): a span
        "nothing to see here",
        "a zz b",  # the third record ("zz") whole: removed, however short
    ]
    kept, report = overlap.remove_overlap(public, private, span=50)
    assert kept == [public[2], public[4]]
    assert report["removed_indices"] == [0, 1, 3, 5]
    assert (report["removed"], report["removed_containing_a_private_record"], report["removed_sharing_a_span"]) \
        == (4, 2, 2)
    # a span across two public records is not a span of either
    kept, report = overlap.remove_overlap([shared50[:25], shared50[25:]], private, span=50)
    assert report["removed"] == 0


def test_the_hashed_removal_equals_the_brute_force_definition():
    rng = random.Random(3)
    words = ["ab", "ba", "aab", "b", " ", "abba"]  # a tiny alphabet: many shared spans of every length
    text = lambda n: "".join(rng.choice(words) for _ in range(n))  # noqa: E731
    private = [text(rng.randint(1, 12)) for _ in range(30)]
    public = [text(rng.randint(1, 40)) for _ in range(300)]
    for span in (6, 9, 15):
        _, report = overlap.remove_overlap(public, private, span=span)
        reasons = naive_removal(public, private, span)
        assert report["removed_indices"] == sorted(reasons)
        assert report["removed_containing_a_private_record"] == list(reasons.values()).count("record")
        assert 0 < report["removed"] < len(public)


@pytest.mark.realdata
@REAL
def test_real_overlap_of_wordnet_with_fortunes():
    corpus, private = wordnet.load(), fortunes.load()
    public = corpus.train + corpus.validation
    kept, report = overlap.remove_overlap(public, private.train + private.validation)
    assert (report["public_records"], report["private_records"]) == (117659, 14396)
    assert (report["removed"], report["removed_containing_a_private_record"], report["removed_sharing_a_span"]) \
        == (113, 103, 10)
    # e.g. Emerson's "A foolish consistency is the hobgoblin of little minds" is a fortune, and
    # WordNet quotes it in the gloss of "bugbear"
    assert not any("hobgoblin of little minds" in r for r in kept)


# --------------------------------------------------------------------------- recipes


def test_recipes_name_p4s_model_and_keys_follow_the_content():
    real = RECIPES["wordnet-lm"]
    model = TransformerLM(**real.model_dims)
    assert sum(p.numel() for p in model.parameters()) == 876034 == sum(p.numel() for p in TransformerLM().parameters())
    assert real.key != RECIPES["tiny"].key and len(real.key) == 16
    renamed = from_json({**real.to_json(), "name": "other"})
    assert renamed.key == real.key and from_json({**real.to_json(), "seed": 1}).key != real.key
    assert get_recipe(json.dumps({"steps": 5, "warmup_steps": 0})).steps == 5
    with pytest.raises(ValueError, match=r"warmup_steps must be <= steps \(5\), got 200"):
        get_recipe('{"steps": 5}')
    with pytest.raises(ValueError, match="unknown field 'step'"):
        get_recipe('{"step": 5}')
    with pytest.raises(ValueError, match="d_model 30 is not divisible by n_heads 4"):
        from_json({"d_model": 30})


def test_a_recipe_refuses_records_true_and_a_context_no_memory_holds():
    """records: true is no record count (bool is an int to Python); a context whose attention
    weights alone exceed this machine's memory is refused before any array is allocated (a
    1.46 TiB allocation traceback before)."""
    with pytest.raises(ValueError, match="records must be a positive integer or null, got True"):
        from_json({"records": True})
    with pytest.raises(ValueError, match=r"^recipe custom: context 10000000 needs about [\d,.]+ GiB per training "
                                         r"step .* more than this machine's [\d,.]+ GiB of memory: lower context"):
        get_recipe(json.dumps({"context": 10_000_000}))
    real = RECIPES["wordnet-lm"]
    assert real.step_bytes == 4 * 64 * 4 * 4 * 128 ** 2  # 64 MiB: the committed recipe passes


# --------------------------------------------------------------------------- pretraining


def test_same_recipe_same_bytes_and_the_loss_decreases(data_dir, tmp_path):
    recipe = small_recipe(data_dir)
    first = pt.pretrain(recipe, tmp_path / "a" / "m.pt", data_dir[0], code=CODE)
    second = pt.pretrain(recipe, tmp_path / "b" / "m.pt", data_dir[0], code=CODE)
    assert (tmp_path / "a" / "m.pt").read_bytes() == (tmp_path / "b" / "m.pt").read_bytes()
    assert first["sha256"] == second["sha256"] == sha256((tmp_path / "a" / "m.pt").read_bytes())
    assert json.loads((tmp_path / "a" / "m.pt.json").read_text())["sha256"] == first["sha256"]
    # learns: from about ln(258) = 5.55 nats/token to well below it
    v = first["validation"]
    assert v["loss_initial"] == pytest.approx(5.55, abs=0.3) and v["loss"] < v["loss_initial"] - 1.5
    curve = first["training"]["train_loss_by_twentieth"]
    assert curve[-1] < curve[0] - 1.5
    # the sidecar says what it was made of
    assert first["recipe"] == recipe.to_json() and first["recipe_key"] == recipe.key
    assert first["code"] == CODE and first["privacy"] == pt.PRIVACY
    assert first["corpus"]["files"] == data_dir[1] and first["private_corpus"]["files"] == data_dir[2]
    assert first["overlap"]["removed_indices"] == [7]  # the gloss holding a fortune whole
    assert first["corpus"]["used"]["train"] + first["validation"]["records"] == 599
    # another seed, other weights
    other = pt.pretrain(small_recipe(data_dir, seed=1, steps=2), tmp_path / "c" / "m.pt", data_dir[0], code=CODE)
    assert other["sha256"] != first["sha256"]


def test_the_private_record_is_not_trained_on(data_dir):
    train, validation, info = pt.public_records(small_recipe(data_dir), data_dir[0])
    assert not any(PLANTED.lower() in r.lower() for r in train + validation)
    assert len(train) + len(validation) == 599 and info["overlap"]["removed"] == 1


def test_a_killed_run_resumes_to_the_same_bytes(data_dir, tmp_path):
    recipe = small_recipe(data_dir)
    whole = pt.pretrain(recipe, tmp_path / "whole.pt", data_dir[0], code=CODE)
    out = tmp_path / "killed.pt"
    assert pt.pretrain(recipe, out, data_dir[0], code=CODE, stop_after=17) is None
    assert not out.exists() and (tmp_path / "killed.pt.resume").is_file()
    resumed = pt.pretrain(recipe, out, data_dir[0], code=CODE)
    assert resumed["sha256"] == whole["sha256"] and resumed["training"]["resumes"] == 1
    assert not (tmp_path / "killed.pt.resume").exists()
    # a resume file of another recipe, or of other code, is not resumed from
    pt.pretrain(recipe, out, data_dir[0], code=CODE, stop_after=5)
    assert pt.pretrain(small_recipe(data_dir, lr=1e-3), out, data_dir[0], code=CODE)["training"]["resumes"] == 0
    pt.pretrain(recipe, out, data_dir[0], code=CODE, stop_after=5)
    assert pt.pretrain(recipe, out, data_dir[0], code="other")["training"]["resumes"] == 0


def test_load_refuses_damaged_swapped_unrecorded_and_stale_checkpoints(data_dir, tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    recipe = small_recipe(data_dir, steps=3)
    pt.pretrain(recipe, a, data_dir[0], code=CODE)
    pt.pretrain(small_recipe(data_dir, steps=3, seed=1), b, data_dir[0], code=CODE)
    loaded = pt.load_pretrained(a, recipe, CODE)
    assert loaded.model_dims == recipe.model_dims and loaded.record["recipe_key"] == recipe.key
    model = pt.build_pretrained_lm(a)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in loaded.state_dict.items())
    # swapped: b's weights under a's sidecar
    swapped = tmp_path / "swapped.pt"
    shutil.copy(b, swapped)
    shutil.copy(f"{a}.json", f"{swapped}.json")
    with pytest.raises(ValueError, match=r"swapped\.pt is damaged or swapped: its SHA-256 is"):
        pt.load_pretrained(swapped)
    # damaged: one byte changed
    damaged = tmp_path / "damaged.pt"
    data = bytearray(a.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    shutil.copy(f"{a}.json", f"{damaged}.json")
    with pytest.raises(ValueError, match=r"damaged\.pt is damaged or swapped"):
        pt.build_pretrained_lm(damaged)
    # no sidecar
    bare = tmp_path / "bare.pt"
    shutil.copy(a, bare)
    with pytest.raises(ValueError, match=r"bare\.pt has no sidecar"):
        pt.load_pretrained(bare)
    # another recipe expected; other code
    with pytest.raises(ValueError, match=r"a\.pt was made by recipe key"):
        pt.load_pretrained(a, small_recipe(data_dir, steps=4))
    with pytest.raises(ValueError, match=r"a\.pt was made by other code"):
        pt.load_pretrained(a, recipe, "0" * 16)


def test_cli_pretrain(data_dir, tmp_path, capsys):
    from dpbench.cli import main

    recipe = small_recipe(data_dir, steps=3)
    text = json.dumps(recipe.to_json())
    out = tmp_path / "cli.pt"
    assert main(["pretrain", "--recipe", text, "--out", str(out), "--data-dir", str(data_dir[0]),
                 "--expect", f"{recipe.key}-{CODE}"]) == 0
    assert pt.load_pretrained(out, recipe, CODE).record["overlap"]["removed"] == 1
    assert "removed 1 of 600 public records" in capsys.readouterr().err
    # the workflow's name for it carries the same key and code that --expect checks
    assert checkpoint_name(recipe, CODE) == f"test-{recipe.key}-{CODE}.pt"
    assert main(["pretrain", "--recipe", text, "--out", str(out), "--expect", "0" * 16 + "-" + "0" * 16]) == 2
    assert "argument --expect: recipe test with this code is" in capsys.readouterr().err


@pytest.mark.realdata
@REAL
def test_the_tiny_recipe_on_the_real_corpora(tmp_path):
    record = pt.pretrain(RECIPES["tiny"], tmp_path / "tiny.pt", code=CODE)
    assert record["corpus"]["package"] == "wordnet-base 1:3.0-37"
    assert record["corpus"]["used"]["train"] == 2000 and record["validation"]["records"] == 200
    assert record["validation"]["loss"] < record["validation"]["loss_initial"] - 2.0
    assert record["training"]["seconds"] < 30


def test_the_workflow_names_the_checkpoint_by_recipe_key_and_code(repo_copy):
    """The rule resolves pretrained_file's name for a named recipe and asks the command to check it."""
    import subprocess

    from conftest import snakemake_exe, tree_env

    target = f"results/cache/pretrain/{checkpoint_name(RECIPES['tiny'], CODE)}"
    proc = subprocess.run([snakemake_exe(), "-n", "-p", target], cwd=repo_copy, capture_output=True, text=True,
                          timeout=300, env=tree_env(repo_copy))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"pretrain --recipe tiny --expect {RECIPES['tiny'].key}-{CODE} --out {target}" in proc.stdout
    assert "OMP_NUM_THREADS=1 " in proc.stdout


class _RunsCode:
    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def _plant(path: Path, data: bytes, sidecar: dict) -> None:
    """``data`` as a checkpoint with a sidecar whose SHA-256 matches it (a sidecar is no key)."""
    path.write_bytes(data)
    Path(f"{path}.json").write_text(json.dumps({**sidecar, "sha256": hashlib.sha256(data).hexdigest()}))


def test_load_refuses_files_that_are_no_checkpoint_in_one_line(data_dir, tmp_path):
    """Bytes that are no checkpoint, a pickle that would run code, a sidecar without model_dims:
    each refused in one line naming the file (an UnpicklingError traceback, `error: model_dims`
    before), and nothing runs."""
    import io

    good = tmp_path / "good.pt"
    pt.pretrain(small_recipe(data_dir, steps=3), good, data_dir[0], code=CODE)
    record = json.loads(Path(f"{good}.json").read_text())
    cases = {"noise.pt": (bytes(range(256)) * 40, r"is no checkpoint torch can read as tensors")}
    payload = _RunsCode()
    payload.marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"weight": payload}, buffer)
    cases["code.pt"] = (buffer.getvalue(), r"is no checkpoint torch can read as tensors")
    for name, (data, match) in cases.items():
        _plant(tmp_path / name, data, record)
        with pytest.raises(ValueError, match=rf"^pretrained checkpoint {tmp_path / name} {match}") as info:
            pt.load_pretrained(tmp_path / name)
        assert "\n" not in str(info.value)
    assert not payload.marker.exists()
    no_dims = tmp_path / "nodims.pt"
    _plant(no_dims, good.read_bytes(), {k: v for k, v in record.items() if k != "model_dims"})
    with pytest.raises(ValueError, match=rf"sidecar {no_dims}\.json of pretrained checkpoint {no_dims} is "
                                         r"damaged: its model_dims None is not an object of positive integers"):
        pt.load_pretrained(no_dims)


@pytest.mark.parametrize("kind", ["fifo", "directory", "/dev/zero"])
def test_train_pretrained_names_a_fifo_a_directory_or_a_device(tmp_path, capsys, kind):
    """--pretrained on a FIFO, a directory or /dev/zero is named as what it is ("does not exist"
    before; a FIFO would block the read), in one line naming the flag."""
    import os

    from dpbench.cli import main

    path = "/dev/zero" if kind == "/dev/zero" else tmp_path / "start.pt"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    argv = ["train", "--problem", "P6", "--optimizer", "dpsgd", "--lr", "0.1", "--batch-size", "10", "--epochs", "1",
            "--seed", "0", "--epsilon", "1", "--pretrained", str(path), "--finetune", "full", "--out", str(tmp_path / "run.parquet")]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    what = {"fifo": "a FIFO", "directory": "a directory", "/dev/zero": "a character device"}[kind]
    assert code != 0 and len(err.splitlines()) == 1, err
    assert f"argument --pretrained: pretrained checkpoint {path} is {what}, not a file" in err, err
