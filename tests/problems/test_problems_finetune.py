"""P5 and P6, the problems that start from a public checkpoint: their facts (the pretraining
recipe they depend on; P6's classes from the fortunes package's file list, not from the records),
P6's data (each record labelled with its file, P4's records and order unchanged) and its model
(per-sample gradients of the pooled classifier equal autograd's one example at a time in every
mode; padding changes no logit), and a P5 and a P6 run from a checkpoint end to end."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import WORDS, run_cell, write_fortunes
from dpbench.data import fortunes
from dpbench.data.dataset import DataError
from dpbench.privacy.per_sample import Tape
from dpbench.problems import catalog, facts, get_problem, language, text_classification, tokenizer
from dpbench.problems.finetune import LoRALinear
from dpbench.problems.modes import Bias, Full, LastBlock, LoRA
from dpbench.problems.text_classification import TransformerClassifier
from dpbench.problems.transformer import TransformerLM
from dpbench.training.config import RunConfig
from dpbench.training.harness import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

from conftest import stand_in_checkpoint  # noqa: E402

TINY = {"vocab_size": 258, "context": 128, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_mlp": 32}
MODES = [Full(), LastBlock(), LoRA(4), Bias()]


def checkpoint(dims=TINY, seed=0):
    """A stand-in for a loaded public checkpoint (conftest.stand_in_checkpoint)."""
    return stand_in_checkpoint(dims, seed, "cd" * 32)


# -- facts ----------------------------------------------------------------------------------------

def test_p6_classes_are_the_packages_files():
    """Public facts: the files (and version) whose checksums the loader pins, in sorted order."""
    assert catalog.FORTUNE_FILES == tuple(sorted(fortunes.SHA256)) and len(catalog.FORTUNE_FILES) == 40
    assert catalog.FORTUNES_VERSION == fortunes.PACKAGE_VERSION
    assert facts("P6").classes is catalog.FORTUNE_FILES and text_classification.CLASSES is catalog.FORTUNE_FILES


def test_only_p5_and_p6_start_from_the_public_checkpoint():
    assert {p: facts(p).pretrained for p in ("P1", "P2", "P3", "P4", "P5", "P6")} == {
        "P1": None, "P2": None, "P3": None, "P4": None, "P5": "wordnet-lm", "P6": "wordnet-lm"}
    p4, p5 = facts("P4"), facts("P5")
    assert {**vars(p5), "id": "P4", "pretrained": None} == vars(p4)  # P5 is P4 from a checkpoint
    assert facts("P6").task == "classification" and facts("P6").planted == 0 and p5.planted == catalog.PLANTED
    assert (facts("P6").train_size, facts("P6").test_size) == (p4.train_size, p4.test_size)  # every record kept
    p6 = get_problem("P6")
    assert sum(p.numel() for p in p6.build().parameters()) == facts("P6").parameters == 847_912


def test_p5_is_p4s_task_on_p4s_data():
    p4, p5 = get_problem("P4"), get_problem("P5")
    assert type(p5.task) is type(p4.task) and p5.load is p4.load and p5.build is p4.build
    model = build_model(p5, 0, "cpu", checkpoint(), Full())
    pretrained = TransformerLM(**TINY)
    pretrained.load_state_dict(checkpoint().state_dict)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), pretrained.state_dict().values()))


# -- P6's data --------------------------------------------------------------------------------------

@pytest.fixture
def files(monkeypatch, tmp_path):
    """Three files of the package's names in the official format; "Same words." is in two files."""
    rng = np.random.default_rng(0)
    content = {name: [" ".join(rng.choice(WORDS, rng.integers(3, 20))) + f" ({name} {i})" for i in range(60)]
               for name in ("art", "work", "zippy")}
    content["art"].insert(5, "Same words.")
    content["zippy"].insert(9, "Same words.")
    manifest = write_fortunes(tmp_path / "fortunes", content)
    monkeypatch.setattr(fortunes, "SHA256", manifest)
    empty = tmp_path / "system"
    empty.mkdir()
    monkeypatch.setattr(fortunes, "SYSTEM_DIRS", [empty])
    return tmp_path, content


def test_p6_labels_every_record_with_its_file_and_p4_is_unchanged(files):
    data_dir, content = files
    records = [(r, name) for name in sorted(content) for r in content[name]]
    corpus = fortunes.load(data_dir)
    # P4's records and their order: file-name order, then file order, split by the text's hash
    assert corpus.train == tuple(r for r, _ in records if not fortunes.is_validation(r))
    assert corpus.validation == tuple(r for r, _ in records if fortunes.is_validation(r))
    assert corpus.train_files == tuple(f for r, f in records if not fortunes.is_validation(r))
    assert corpus.validation_files == tuple(f for r, f in records if fortunes.is_validation(r))
    data = get_problem("P6").load(str(data_dir))
    assert data.x_train.shape == (len(corpus.train), language.CONTEXT)
    want = {"art": 0, "work": 38, "zippy": 39}
    assert want == {f: catalog.FORTUNE_FILES.index(f) for f in want}
    assert data.y_train.tolist() == [want[f] for f in corpus.train_files]
    assert data.y_test.tolist() == [want[f] for f in corpus.validation_files]
    assert [tokenizer.decode(row) for row in data.x_train[:3]] == list(corpus.train[:3])
    # a text in two files: two records, each with its own file, on the same side of the split
    same = [f for r, f in zip(corpus.train + corpus.validation, corpus.train_files + corpus.validation_files)
            if r == "Same words."]
    assert same == ["art", "zippy"]
    p4 = language.load(str(data_dir))
    assert np.array_equal(p4.x_train, tokenizer.encode_records(corpus.train, language.CONTEXT))


def test_a_file_that_is_not_a_class_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(fortunes, "SHA256", write_fortunes(tmp_path / "fortunes", {"art": ["a"], "recipes": ["b"]}))
    monkeypatch.setattr(fortunes, "SYSTEM_DIRS", [])
    with pytest.raises(DataError, match="fortunes file 'recipes' is not one of P6's classes"):
        text_classification.load(str(tmp_path))


# -- P6's model -------------------------------------------------------------------------------------

def batch(n=5, width=14, seed=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, width), generator=gen)
    for i in range(n):
        length = 3 + (i * 4) % (width - 3)
        x[i, 0], x[i, length - 1], x[i, length:] = tokenizer.BOS, tokenizer.EOS, tokenizer.PAD
    return x, torch.randint(0, 40, (n,), generator=gen)


def test_padding_changes_no_logit():
    model = TransformerClassifier(40, **TINY).double()
    x, y = batch()
    wide = torch.cat([x, torch.full((x.shape[0], 9), tokenizer.PAD)], 1)
    torch.testing.assert_close(model(wide), model(x), rtol=0, atol=1e-12)
    one = torch.stack([model(x[i:i + 1])[0] for i in range(x.shape[0])])
    torch.testing.assert_close(model(x), one, rtol=0, atol=1e-12)  # no sample sees another
    task = get_problem("P6").task
    torch.testing.assert_close(task.per_sample_loss(model, wide, y)[0], task.fixed_shape_loss(model, wide, y)[0],
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("finetune", MODES, ids=[f.name for f in MODES])
def test_p6_per_sample_gradients_match_autograd_one_by_one(finetune):
    problem = get_problem("P6")
    model = build_model(problem, 1, "cpu", checkpoint(), finetune).double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.weight.normal_(0, 0.1)
    x, y = batch()
    params = [p for p in model.parameters() if p.requires_grad]
    assert model.head.weight.requires_grad and model.head.bias.requires_grad  # the new head trains in every mode
    rows = []
    for i in range(x.shape[0]):
        loss = problem.per_sample_loss(model, x[i:i + 1], y[i:i + 1])[0].sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    want = torch.stack(rows)
    tape = Tape(model)
    with tape:
        losses, correct = problem.per_sample_loss(model, x, y)
    psg = tape.per_sample_gradients(losses)
    torch.testing.assert_close(psg.norms(), want.norm(dim=1), rtol=1e-10, atol=1e-12)
    coef = torch.linspace(0.2, 1.0, x.shape[0], dtype=torch.float64)
    summed = psg.weighted_sum(coef)
    assert set(summed) == set(params)
    torch.testing.assert_close(torch.cat([summed[p].reshape(-1) for p in params]), coef @ want, rtol=1e-10, atol=1e-12)
    assert correct.dtype == torch.bool and correct.shape == (x.shape[0],)


# -- runs from a checkpoint ------------------------------------------------------------------------

def test_a_p5_run_from_a_checkpoint_measures_exposure_as_p4(files, monkeypatch):
    monkeypatch.setattr(language, "DIGITS", 3)
    data_dir, _ = files
    cfg = RunConfig(problem="P5", optimizer="dpsgd", lr=0.5, batch_size=16, epochs=1, seed=0, epsilon=10.0,
                    data_dir=str(data_dir), max_steps=3, finetune="lora", lora_rank=4, pretrained="stand-in.pt")
    ck = checkpoint()
    meta = run_cell(cfg, pretrained=ck).meta
    start = meta["start"]
    assert start["kind"] == "public checkpoint" and start["checkpoint_sha256"] == "cd" * 32
    assert start["recipe"] == "wordnet-lm" and start["pretraining_epsilon"] == 0.0
    assert (start["mode"], start["lora_rank"]) == ("lora", 4)
    assert start["trainable_parameters"] == facts("P5").trainable(TINY, LoRA(4)) == 2 * 4 * 224
    assert meta["data"]["n_train"] == facts("P5").n_train() - facts("P5").train_size + len(
        fortunes.load(data_dir).train)  # canaries counted in N as for P4
    assert len(meta["memorisation"]["canaries"]) == 12 and meta["privacy"]["epsilon"] <= 10.0
    scratch = run_cell(RunConfig(**{**vars(cfg), "problem": "P4", "finetune": None, "lora_rank": None,
                                    "pretrained": None})).meta
    assert scratch["start"]["kind"] == "scratch" and scratch["start"]["trainable_parameters"] == 876_034


def test_a_p6_run_from_a_checkpoint_reports_accuracy(files):
    data_dir, _ = files
    cfg = RunConfig(problem="P6", optimizer="dpadamw", lr=1e-3, batch_size=16, epochs=1, seed=0, epsilon=3.0,
                    data_dir=str(data_dir), max_steps=3, finetune="bias", pretrained="stand-in.pt")
    res = run_cell(cfg, pretrained=checkpoint())
    test = res.metrics[res.metrics.split == "test"]
    assert len(test) == 1 and 0.0 <= test.accuracy.iloc[0] <= 1.0
    assert res.meta["start"]["trainable_parameters"] == facts("P6").trainable(TINY, Bias())
    assert res.meta["problem"]["task"] == "classification"
