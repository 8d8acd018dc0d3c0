"""The prefix store (dpbench.problems.prefix_store) and the step layout (dpbench.problems.layout),
on the tiny BERT and tiny RoBERTa fixtures: with the store, the same per-record losses, per-sample
gradients and DP steps as the whole model, in modes head and last-block (float64: round-off of the
order 1e-15; float32 stated where used); the store's refusal when damaged, swapped or of another
key; its key changing with the encoder, the records, the limit and the cut; and the layout chosen
once."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from dpbench.optimizers import OPTIMIZERS
from dpbench.privacy.clipping import Clipping
from dpbench.privacy.per_sample import Tape
from dpbench.problems import facts, get_problem, modes
from dpbench.problems.encoder_classification import PublicEncoder
from dpbench.problems.layout import StepLayout
from dpbench.problems.prefix_store import (PrefixStore, PrefixStoreError, StoreKey, build_store, cut_of, key_for,
                                           records_sha256, store_files, stored_classifier)
from dpbench.training.harness import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

STORED = [modes.Head(), modes.LastBlock()]
IDS = [m.name for m in STORED]


@pytest.fixture(scope="module", params=["tiny_bert_dir", "tiny_roberta_dir"], ids=["bert", "roberta"])
def start(request):
    return PublicEncoder.load(request.getfixturevalue(request.param))


def tokens(start, n=8, width=10, seed=1):
    """Records of different lengths: [CLS] words [SEP] then padding (two of them equal)."""
    gen = torch.Generator().manual_seed(seed)
    pad = start.loaded.pad_id
    x = torch.full((n, width), pad, dtype=torch.int64)
    for i in range(n):
        length = 3 + (i * 3) % (width - 3)
        x[i, :length] = torch.randint(5, 40, (length,), generator=gen)
        x[i, 0], x[i, length - 1] = start.loaded.tokenizer.cls_token_id, start.loaded.tokenizer.sep_token_id
    x[n - 1] = x[2]  # a duplicate record
    return x


def layers(start):
    return start.loaded.facts.num_hidden_layers


def pair(start, mode, path, rows, dtype=torch.float64):
    """The whole classifier under ``mode`` and the classifier reading its prefix from a store made
    at ``path`` from ``rows``: the same parameters, in ``dtype``."""
    full = build_model(get_problem("P7"), 0, "cpu", start, mode).to(dtype)
    with torch.random.fork_rng(devices=[]):
        stored = stored_classifier()(copy.deepcopy(start.loaded.model), start.loaded.pooling,
                                     len(facts("P7").classes), start.loaded.pad_id)
    stored = mode.apply(stored, facts("P7").architecture(start.model_dims))
    stored.load_state_dict(full.state_dict())
    stored = stored.to(dtype).train()
    name = str(dtype).removeprefix("torch.")
    key = key_for(start, rows.numpy(), mode, name)
    build_store(path, full, rows.numpy(), start.loaded.pad_id, key)
    stored.attach(PrefixStore.open(path, encoder_sha256=start.sha256, max_tokens=start.max_tokens,
                                   cut=key.cut, dtype=name))
    return full, stored


def per_record(model, task, x, y):
    """Per-record losses and per-sample gradients ({parameter name: (B, ...)}) by the per-sample engine."""
    tape = Tape(model)
    with tape:
        losses, _ = task.per_sample_loss(model, x, y)
    psg = tape.per_sample_gradients(losses)
    names = {p: n for n, p in model.named_parameters()}
    rows = []
    for i in range(x.shape[0]):
        coef = torch.zeros(x.shape[0], dtype=losses.dtype)
        coef[i] = 1
        rows.append({names[p]: g.clone() for p, g in psg.weighted_sum(coef).items()})
    return losses.detach(), {n: torch.stack([r[n] for r in rows]) for n in rows[0]}


@pytest.mark.parametrize("mode", STORED, ids=IDS)
def test_the_store_gives_the_whole_models_losses_and_per_sample_gradients(start, mode, tmp_path):
    """Float64: each record's loss and gradient of every trained parameter from the stored prefix
    equal the whole model's up to round-off (the prefix computed alone against in a batch),
    in several batches, a duplicate record and a width cut to the longest record included."""
    x, y = tokens(start), torch.arange(8) % 40
    full, stored = pair(start, mode, tmp_path / "s.npy", x)
    assert type(stored).__name__ == "StoredPrefixClassifier"
    task = get_problem("P7").task
    for batch in (slice(0, 8), slice(2, 5), [7, 0, 2]):
        (l0, g0), (l1, g1) = per_record(full, task, x[batch], y[batch]), per_record(stored, task, x[batch], y[batch])
        torch.testing.assert_close(l1, l0, rtol=1e-10, atol=1e-12)
        assert g0.keys() == g1.keys() and g0  # the same trained parameters
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-9, atol=1e-12, msg=name)
    trained = {n for n, p in full.named_parameters() if p.requires_grad}
    assert trained == set(g0) and (mode.name == "head") == all(n.startswith("head.") for n in trained)


@pytest.mark.parametrize("mode", STORED, ids=IDS)
def test_a_dp_step_with_the_store_is_the_step_without_it(start, mode, tmp_path):
    """Two DP-SGD steps (clipping C = 0.02, noise on, the same noise seed) on the whole model and on
    the stored prefix, in groups of similar length where the layout has them (last-block on the
    CPU): the same parameters after, float64."""
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers.base import Context

    x, y = tokens(start), torch.arange(8) % 40
    spec = OPTIMIZERS["dpsgd"]
    plan = spec.mechanism.plan(PlanRequest(32, 8, 1, target_epsilon=4.0))
    task = start.bind(get_problem("P7"), mode, StepLayout.choose(mode, "cpu", str(tmp_path / "s.npy"))).task
    task.GROUP_TOKENS = 12  # several groups in a batch of eight
    assert (task.groups(x) is not None) == (mode.name == "last-block")
    before, after = None, []
    for model in pair(start, mode, tmp_path / "s.npy", x):
        before = [p.detach().clone() for p in model.parameters()]
        ctx = Context(model=model, loss_fn=lambda m, xb, yb: task.per_sample_loss(m, xb, yb), lr=0.5,
                      expected_batch_size=8, noise_multiplier=0.7, clipping=Clipping(0.02, normalize=False),
                      noise=spec.mechanism.noise(plan, 5, "cpu"), steps=plan.steps,
                      hyperparameters=spec.hyperparameters(None), groups=task.groups)
        step = spec.build(ctx)
        for _ in range(2):
            step(x, y)
        after.append([p.detach().clone() for p in model.parameters()])
    moved = max((a - b).abs().max().item() for a, b in zip(after[0], before))
    assert moved > 1e-3
    for a, b in zip(after[1], after[0]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", STORED, ids=IDS)
def test_a_run_reads_a_float32_store_through_the_layout(start, mode, tmp_path):
    """The run's path: bind with a layout naming the store, build_model opens and verifies it.
    Float32 (runs' dtype): the losses within float32 round-off of the whole model's (rtol 1e-5);
    in mode head the stored features are the in-memory cache's bits (both compute each record alone)."""
    from dpbench.problems.prefix_store import make_store

    x, y = tokens(start), torch.arange(8) % 40
    path = tmp_path / "s.npy"
    bound = start.bind(get_problem("P7"), mode, StepLayout.choose(mode, "cpu", str(path)))
    bound = type(bound)(**{**bound.__dict__, "load": lambda data_dir=None: _dataset(x)})
    make_store(path, start, bound, mode)
    stored = build_model(bound, 0, "cpu", start, mode)
    full = build_model(start.bind(get_problem("P7"), modes.Full()), 0, "cpu", start, mode)
    with torch.no_grad():
        torch.testing.assert_close(stored(x), full(x), rtol=1e-5, atol=1e-6)
    if mode.name == "head":
        cached = build_model(start.bind(get_problem("P7"), mode), 0, "cpu", start, mode)
        assert type(cached).__name__ == "CachedFeatureClassifier"
        with torch.no_grad():
            assert torch.equal(stored.features(x), cached.features(x))
    meta = json.loads(store_files(path)[2].read_text())
    hidden = start.loaded.facts.hidden_size
    real = int((x != start.loaded.pad_id).sum())
    assert meta["rows"] == (8 if mode.name == "head" else real)
    assert path.stat().st_size == 128 + meta["rows"] * hidden * 4  # a .npy header of 128 bytes, then float32 rows


def _dataset(x):
    from dpbench.data.dataset import Dataset

    rows = x.numpy()
    return Dataset("t", rows[:6], np.zeros(6, dtype=np.int64), rows[6:], np.zeros(2, dtype=np.int64), "t")


def test_a_damaged_swapped_or_foreign_store_is_refused_in_one_line(start, tmp_path):
    x = tokens(start)
    path = tmp_path / "s.npy"
    pair(start, modes.LastBlock(), path, x)
    cut = cut_of(modes.LastBlock(), layers(start))
    good = dict(encoder_sha256=start.sha256, max_tokens=start.max_tokens, cut=cut, dtype="float64")
    PrefixStore.open(path, **good)

    def refused(match, **changed):
        with pytest.raises(PrefixStoreError, match=match) as info:
            PrefixStore.open(path, **{**good, **changed})
        assert "\n" not in str(info.value) and str(path) in str(info.value)

    refused("encoder_sha256", encoder_sha256="0" * 64)
    refused("max_tokens", max_tokens=start.max_tokens - 1)
    refused("cut", cut="pooled")
    refused("dtype", dtype="float32")
    keep = tmp_path / "keep"
    keep.mkdir()
    for f in store_files(path):
        shutil.copy(f, keep / f.name)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # one bit of the last stored value
    path.write_bytes(bytes(data))
    refused(f"{path.name} is damaged or swapped: its SHA-256 is")
    shutil.copy(keep / path.name, path)
    records = store_files(path)[1]
    other = tmp_path / "other.npy"
    pair(start, modes.LastBlock(), other, tokens(start, seed=2))
    shutil.copy(store_files(other)[1], records)  # another store's records
    refused(f"{records.name} is damaged or swapped")
    shutil.copy(keep / records.name, records)
    store_files(path)[2].write_text("{not json")
    refused("sidecar s.json is unreadable")
    store_files(path)[2].unlink()
    refused("s.json is missing")


def test_a_record_the_store_lacks_is_refused(start, tmp_path):
    x = tokens(start)
    _, stored = pair(start, modes.Head(), tmp_path / "s.npy", x[:4])
    with pytest.raises(PrefixStoreError, match="does not hold the record"):
        stored(x[4:6])


def test_the_key_changes_with_the_encoder_the_records_the_limit_and_the_cut(tiny_bert_dir, tiny_roberta_dir):
    bert, roberta = PublicEncoder.load(tiny_bert_dir), PublicEncoder.load(tiny_roberta_dir)
    rows = tokens(bert).numpy()
    base = key_for(bert, rows, modes.LastBlock())
    assert base.cut == f"block{layers(bert) - 1}" and key_for(bert, rows, modes.Head()).cut == "pooled"
    other_rows = rows.copy()
    other_rows[0, 1] += 1
    variants = [key_for(roberta, rows, modes.LastBlock()), key_for(bert, other_rows, modes.LastBlock()),
                StoreKey(base.encoder_sha256, base.records_sha256, base.max_tokens - 1, base.cut),
                key_for(bert, rows, modes.Head()), key_for(bert, rows, modes.LastBlock(), "float64")]
    assert len({base.name, *(v.name for v in variants)}) == 6
    assert base.name == f"prefix-{bert.sha256[:16]}-{records_sha256(rows)[:16]}-T{bert.max_tokens}-{base.cut}"
    assert records_sha256(rows[:, :-1]) != records_sha256(rows)  # the shape is hashed too
    with pytest.raises(ValueError, match="no frozen prefix"):
        cut_of(modes.Full(), 6)


def test_the_layout_is_chosen_once():
    """Groups on the CPU, not in mode head (one vector per record) nor on a GPU (one padded pass);
    the prefix from memory (head), a store where given, else computed; a store for a mode that
    trains the prefix is refused."""
    choose = StepLayout.choose
    assert choose(modes.Full()) == StepLayout(groups=True, prefix="none")
    assert choose(modes.Full(), "cuda:0") == StepLayout(groups=False, prefix="none")
    assert choose(modes.Head()) == StepLayout(groups=False, prefix="memory")
    assert choose(modes.Head(), "cpu", "s.npy") == StepLayout(groups=False, prefix="store", store="s.npy")
    assert choose(modes.LastBlock(), "cpu", "s.npy") == StepLayout(groups=True, prefix="store", store="s.npy")
    assert choose(modes.LastBlock(), "cuda", "s.npy").groups is False
    for mode in (modes.Full(), modes.LoRA(4), modes.Bias(), None):
        with pytest.raises(ValueError, match="a prefix store serves the modes head and last-block"):
            choose(mode, "cpu", "s.npy")


def test_a_run_with_the_store_is_the_run_without_it(tiny_bert_dir, labelled_corpus, tmp_path):
    """`dpbench prefix-store` makes the store once; `dpbench train --prefix-store` reads it (and makes
    it where absent): the run's metrics are the run's without the store (float32 round-off), its
    privacy the same numbers, its layout recorded; an existing store is verified and kept. Mode
    last-block (mode head's store is read through the same layout above)."""
    from dpbench.cli import main
    from dpbench.reporting.results import read_meta, read_run

    mode, store = "last-block", tmp_path / "store" / "s.npy"
    assert main(["prefix-store", "--problem", "P7", "--finetune", mode, "--pretrained-dir", str(tiny_bert_dir),
                 "--data-dir", str(labelled_corpus), "--out", str(store)]) == 0
    written = store.stat().st_mtime_ns
    assert main(["prefix-store", "--problem", "P7", "--finetune", mode, "--pretrained-dir", str(tiny_bert_dir),
                 "--data-dir", str(labelled_corpus), "--out", str(store)]) == 0
    assert store.stat().st_mtime_ns == written  # verified, kept
    runs = {}
    for name, extra in (("without", []), ("with", ["--prefix-store", str(store)]),
                        ("made", ["--prefix-store", str(tmp_path / "made.npy")])):
        out = tmp_path / f"{name}.parquet"
        assert main(["train", "--problem", "P7", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "8",
                     "--epochs", "1", "--seed", "0", "--epsilon", "3", "--finetune", mode, "--pretrained-dir",
                     str(tiny_bert_dir), "--data-dir", str(labelled_corpus), "--max-steps", "3", *extra,
                     "--out", str(out)]) == 0
        runs[name] = (read_run(out)[0], read_meta(out))
    assert (tmp_path / "made.npy").is_file()
    for name in ("with", "made"):
        metrics, meta = runs[name]
        path = str(tmp_path / "made.npy") if name == "made" else str(store)
        assert meta["layout"] == {"groups": True, "prefix": "store", "store": path}
        assert meta["privacy"]["noise_multiplier"] == runs["without"][1]["privacy"]["noise_multiplier"]
        assert list(metrics["split"]) == list(runs["without"][0]["split"]) and len(metrics) >= 4
        np.testing.assert_allclose(metrics["loss"], runs["without"][0]["loss"], rtol=1e-4)
        np.testing.assert_array_equal(metrics["accuracy"].isna(), runs["without"][0]["accuracy"].isna())
    assert runs["without"][1]["layout"] == {"groups": True, "prefix": "none", "store": None}


def test_a_store_for_a_mode_that_trains_the_prefix_is_refused(tiny_bert_dir, tmp_path, capsys):
    from dpbench.cli import main

    assert main(["train", "--problem", "P7", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "8", "--epochs",
                 "1", "--seed", "0", "--epsilon", "3", "--finetune", "full", "--pretrained-dir", str(tiny_bert_dir),
                 "--prefix-store", str(tmp_path / "s.npy"), "--out", str(tmp_path / "r.parquet")]) == 2
    assert "--prefix-store: a prefix store serves --finetune head or last-block" in capsys.readouterr().err
