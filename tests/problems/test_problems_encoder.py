"""P7 (dpbench.problems.encoder_classification): P6's task from a public encoder, on the tiny
BERT and tiny RoBERTa fixtures (tests/tiny_bert.py, tests/tiny_roberta.py) and, where installed, the real all-MiniLM-L6-v2: the
bert-encoder architecture table against the built model, every mode's trained set and count,
every optimizer in every mode moving exactly the trained parameters (the frozen ones bit for
bit), per-sample gradients against autograd, Opacus's DP-SGD as a peer, the cached features of
mode head against the full model, and runs of `dpbench train` with `--pretrained-dir`."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_moves_exactly_the_trained
from dpbench.optimizers import OPTIMIZERS
from dpbench.privacy.clipping import Clipping
from dpbench.privacy.per_sample import Tape
from dpbench.problems import architectures, encoders, facts, get_problem, modes
from dpbench.problems.encoder_classification import PublicEncoder
from dpbench.problems.layout import StepLayout
from dpbench.problems.finetune import LoRALinear
from dpbench.training.harness import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = [modes.Full(), modes.LastBlock(), modes.LoRA(4), modes.Bias(), modes.Head()]
IDS = [m.name for m in MODES]


@pytest.fixture(scope="module", params=["tiny_bert_dir", "tiny_roberta_dir"], ids=["bert", "roberta"])
def start(request):
    """Each encoder type's tiny fixture (tests/tiny_bert.py, tests/tiny_roberta.py): every test of a
    start holds both types to it."""
    return PublicEncoder.load(request.getfixturevalue(request.param))


def tokens(start, n=6, width=10, seed=1):
    """Records of different lengths: [CLS] words [SEP] then padding."""
    gen = torch.Generator().manual_seed(seed)
    pad = start.loaded.pad_id
    x = torch.full((n, width), pad, dtype=torch.int64)
    for i in range(n):
        length = 3 + (i * 2) % (width - 3)
        x[i, :length] = torch.randint(5, 40, (length,), generator=gen)
        x[i, 0], x[i, length - 1] = start.loaded.tokenizer.cls_token_id, start.loaded.tokenizer.sep_token_id
    return x


def built(start, mode, seed=0):
    return build_model(get_problem("P7"), seed, "cpu", start, mode)


def uncached(start, mode, seed=0):
    """The whole classifier under ``mode`` without a feature cache (what a run in mode head caches)."""
    from dpbench.problems.encoder_model import EncoderClassifier

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = EncoderClassifier(copy.deepcopy(start.loaded.model), start.loaded.pooling, len(facts("P7").classes),
                                  start.loaded.pad_id)
    return mode.apply(model, facts("P7").architecture(start.model_dims))


def trained(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


# -- the table, the counts and the trained sets -----------------------------------------------------

def test_the_table_is_the_built_models(start):
    model = built(start, modes.Full())
    arch = facts("P7").architecture(start.model_dims)
    assert list(arch.parameters) == [(n, p.numel()) for n, p in model.named_parameters()]
    for prefix in arch.blocks:
        for name, d_in, d_out in arch.adapted:
            layer = model.get_submodule(prefix + name)
            assert (layer.in_features, layer.out_features) == (d_in, d_out)


def test_p7s_catalogued_dims_and_count_are_minilms(minilm_dir):
    f = encoders.config_facts(minilm_dir)
    assert dict(encoders.MINILM.dims) == {k: getattr(f, k) for k in architectures.BERT_DIMS}
    # 22,713,216 upstream, less the pooler (384 x 384 + 384), plus the head (384 x 40 + 40)
    assert facts("P7").parameters == 22_713_216 - 147_840 + 15_400 == facts("P7").architecture(None).total


def test_minilm_mode_counts_pinned():
    """d of every mode at all-MiniLM-L6-v2's dimensions, from the table (no files read)."""
    got = {m.label: facts("P7").trainable(None, m) for m in [*MODES[:2], modes.LoRA(), *MODES[3:]]}
    # last block: 4 (384^2 + 384) + 2 (384 x 1536) + 1536 + 384 + 4 x 384 (two LayerNorms) + head
    # LoRA r = 16 per block: 16 (4 (384 + 384) + (384 + 1536) + (1536 + 384)) = 110,592, 6 blocks + head
    # bias: embeddings' LayerNorm beta 384; per block 4 x 384 + 1536 + 384 + 2 x 384 = 4,224; head
    assert got == {"full": 22_580_776, "last-block": 1_774_464 + 15_400, "lora-r16": 6 * 110_592 + 15_400,
                   "bias": 384 + 6 * 4_224 + 15_400, "head": 15_400}


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_each_mode_trains_its_set_and_the_count_is_the_built_models(start, mode):
    model = built(start, mode)
    everything = {n for n, _ in built(start, modes.Full()).named_parameters()}
    head = {"head.weight", "head.bias"}
    want = {
        "full": everything,
        "last-block": {n for n in everything if n.startswith(("encoder.encoder.layer.1.", "head."))},
        "lora": {f"encoder.encoder.layer.{b}.{layer}.lora_{ab}.weight" for b in range(2) for ab in "ab"
                 for layer in ("attention.self.query", "attention.self.key", "attention.self.value",
                               "attention.output.dense", "intermediate.dense", "output.dense")} | head,
        "bias": {n for n in everything if n.endswith(".bias")} | head,
        "head": head,
    }[mode.name]
    assert trained(model) == want
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == \
        facts("P7").trainable(start.model_dims, mode)
    if mode.name == "lora":
        assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 12


# -- every optimizer in every mode -----------------------------------------------------------------

N_TRAIN, L = 24, 6


def p7_loss(m, x, y):
    return get_problem("P7").task.per_sample_loss(m, x, y)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS.builtins))
def test_a_step_changes_exactly_the_trainable_parameters(start, name, mode, tmp_path_factory):
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers.base import Context
    from dpbench.privacy.clipping import NoClipping

    model = built(start, mode)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    spec = OPTIMIZERS[name]
    plan = spec.mechanism.plan(PlanRequest(N_TRAIN, L, 1 if "-se" in name else 2, target_epsilon=4.0,
                                           cache_dir=tmp_path_factory.getbasetemp() / "p7-cache"))
    ctx = Context(model=model, loss_fn=p7_loss, lr=0.05 if "adam" in name else 0.5, expected_batch_size=L,
                  noise_multiplier=0.7 if spec.private else 0.0,
                  clipping=Clipping(1.0) if spec.private else NoClipping(),
                  noise=spec.mechanism.noise(plan, 5, "cpu"), steps=plan.steps,
                  hyperparameters=spec.hyperparameters(None))
    step = spec.build(ctx)
    x, y = tokens(start), torch.arange(6) % 40
    for _ in range(2):  # LoRA's A has a zero gradient while B is still 0
        step(x, y)
    assert_moves_exactly_the_trained(model, before, f"{name} {mode.name}", "attention.self.key.bias", spec.private)
    assert sum(p.numel() for p in ctx.params) == facts("P7").trainable(start.model_dims, mode)


# -- per-sample gradients and the Opacus peer ------------------------------------------------------

@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_per_sample_gradients_match_autograd_in_every_mode(start, mode):
    model = built(start, mode).double()
    with torch.no_grad():  # B != 0, so LoRA's A gets gradients too
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.weight.normal_(0, 0.1)
    x, y = tokens(start), torch.arange(6) % 40
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        loss = p7_loss(model, x[i:i + 1], y[i:i + 1])[0].sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    want = torch.stack(rows)
    tape = Tape(model)
    with tape:
        losses, _ = p7_loss(model, x, y)
    psg = tape.per_sample_gradients(losses)
    torch.testing.assert_close(psg.norms(), want.norm(dim=1), rtol=1e-9, atol=1e-12)
    coef = torch.linspace(0.5, 1.5, x.shape[0], dtype=torch.float64)
    summed = psg.weighted_sum(coef)
    torch.testing.assert_close(torch.cat([summed[p].reshape(-1) for p in params]), coef @ want,
                               rtol=1e-9, atol=1e-12)
    if mode.name == "full":  # the position rows records use get gradients, those below the first none
        first = model.first_position  # 0 (BERT); the pad id + 1 (RoBERTa)
        g = summed[model.encoder.embeddings.position_embeddings.weight]
        assert g[:first].eq(0).all() and g[first].ne(0).any()


@pytest.mark.parametrize("mode", [modes.Full(), modes.LoRA(4)], ids=["full", "lora"])
def test_opacus_dpsgd_takes_dpsgds_step(start, mode, tmp_path_factory):
    """Opacus's hooks on the BERT classifier (position and token type ids passed with the batch's
    shape), clipped at C and summed, noise off: the same update as ours (Opacus divides by
    ||g|| + 1e-6, hence the tolerance)."""
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers.base import Context

    out = []
    for name in ("dpsgd", "opacus-dpsgd"):
        model = built(start, mode).double()
        spec = OPTIMIZERS[name]
        plan = spec.mechanism.plan(PlanRequest(N_TRAIN, L, 1, target_epsilon=4.0))
        ctx = Context(model=model, loss_fn=p7_loss, lr=0.5, expected_batch_size=L, noise_multiplier=0.0,
                      clipping=Clipping(0.05, normalize=False), noise=spec.mechanism.noise(plan, 5, "cpu"),
                      steps=plan.steps, hyperparameters=spec.hyperparameters(None))
        step = spec.build(ctx)
        if name == "opacus-dpsgd":
            step.optimizer.noise_multiplier, step.optimizer.max_grad_norm, step.scale = 0.0, 0.05, 1.0
        step(tokens(start), torch.arange(6) % 40)
        out.append(model)
    first = built(start, mode).double()
    for (n, p), q, p0 in zip(out[0].named_parameters(), out[1].parameters(), first.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7 * max(1.0, (p - p0).abs().max().item()), msg=n)
    assert max((p - p0).abs().max().item() for p, p0 in zip(out[0].parameters(), first.parameters())) > 1e-3


def test_opacus_hooks_give_the_same_per_sample_gradients(start):
    """Opacus 1.6's GradSampleModule on the classifier (position ids (B, T), from the pad id on in a
    RoBERTa), mode full: the same per-sample gradients as one backward pass per record."""
    from opacus.grad_sample import GradSampleModule

    model = built(start, modes.Full()).double()
    x, y = tokens(start), torch.arange(6) % 40
    params = list(model.parameters())
    rows = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum"), params)
            for i in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
        F.cross_entropy(gsm(x), y, reduction="sum").backward()
    for j, p in enumerate(params):
        torch.testing.assert_close(p.grad_sample, torch.stack([r[j] for r in rows]), rtol=1e-9, atol=1e-12)
    gsm._close()


# -- mode head: cached features -----------------------------------------------------------------------

def test_cached_features_give_the_full_models_losses_and_head_gradients(start):
    """A run in mode head computes each record's features once and keeps them: the same
    per-record losses and per-record head gradients as the whole model in mode head, at every
    step (the second from the cache), whatever batch a record comes in."""
    memory = [StepLayout.choose(m).prefix == "memory" for m in MODES[:4]]  # features cached in memory
    assert StepLayout.choose(modes.Head()).prefix == "memory" and not any(memory)
    cached, full = built(start, modes.Head(), seed=3), uncached(start, modes.Head(), seed=3)
    assert type(cached).__name__ == "CachedFeatureClassifier" and torch.equal(cached.head.weight, full.head.weight)
    x, y = tokens(start), torch.arange(6) % 40
    task = get_problem("P7").task
    for batch in (slice(0, 6), slice(0, 6), slice(2, 5)):
        out = []
        for model in (full, cached):
            tape = Tape(model)
            with tape:
                losses, _ = task.per_sample_loss(model, x[batch], y[batch])
            out.append((losses.detach(), tape.per_sample_gradients(losses).norms()))
        torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[0][1], out[1][1], rtol=1e-5, atol=1e-6)
    assert len(cached.cache) == len({tuple(r[r != start.loaded.pad_id].tolist()) for r in x})
    # a record's features are its own: computed alone, the same bits in any batch
    alone = cached.cache[x[3][x[3] != start.loaded.pad_id].numpy().tobytes()]
    with torch.no_grad():
        assert torch.equal(alone, full.features(x[3:4, :int((x[3] != start.loaded.pad_id).sum())])[0])


# -- runs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["lora", "head"])
def test_a_p7_run_from_a_local_encoder_records_its_files(mode, tiny_bert_dir, labelled_corpus, tmp_path):
    from dpbench.cli import main
    from dpbench.reporting.results import read_meta

    generated_corpus = labelled_corpus

    out = tmp_path / "run.parquet"
    args = ["train", "--problem", "P7", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "8", "--epochs", "1",
            "--seed", "0", "--epsilon", "3", "--finetune", mode, "--pretrained-dir", str(tiny_bert_dir),
            "--data-dir", str(generated_corpus), "--max-steps", "3", "--out", str(out)]
    if mode == "lora":
        args += ["--lora-rank", "4"]
    assert main(args) == 0
    meta = read_meta(out)
    s = meta["start"]
    assert s["kind"] == "public checkpoint" and s["encoder"] is None and s["pretraining_epsilon"] == 0.0
    assert s["encoder_files"] == encoders.file_hashes(tiny_bert_dir)
    assert s["checkpoint_sha256"] == PublicEncoder.load(tiny_bert_dir).sha256
    assert s["trainable_parameters"] == facts("P7").trainable(s["model_dims"], modes.parse(mode, lora_rank=s["lora_rank"]))
    assert meta["privacy"]["epsilon"] <= 3.0 and meta["result"]["status"] == "completed"
    assert 0.0 <= meta["result"]["best_test_accuracy"] <= 1.0


@pytest.mark.parametrize("args,line", [
    (["--problem", "P6", "--finetune", "full", "--pretrained-dir", "{dir}"],
     "argument --pretrained-dir: problem P6 starts from a pretrained checkpoint (--pretrained), not an encoder"),
    (["--problem", "P7", "--finetune", "full", "--pretrained", "{dir}/x.pt"],
     "argument --pretrained: problem P7 starts from a public encoder"),
    (["--problem", "P7", "--pretrained-dir", "{dir}"], "argument --pretrained-dir: a public start is fine-tuned in a mode"),
    (["--problem", "P7", "--finetune", "full", "--pretrained-dir", "{missing}"], "config.json: missing"),
])
def test_p7_refusals_name_the_flag(args, line, tiny_bert_dir, tmp_path, capsys):
    from dpbench.cli import main

    missing = tmp_path / "empty"
    missing.mkdir()
    files = {"dir": tiny_bert_dir, "missing": missing}
    argv = ["train", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "8", "--epochs", "1", "--seed", "0",
            "--epsilon", "3", *[a.format(**files) for a in args], "--out", str(tmp_path / "run.parquet")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert line.format(**files) in err[-1], err
    assert not (tmp_path / "run.parquet").exists()


# -- groups: a batch run in passes of similar length ----------------------------------------------

def grouped_task(start, budget):
    task = start.bind(get_problem("P7"), modes.Full()).task
    task.GROUP_TOKENS = budget  # an instance attribute: the class's 512 is untouched
    return task


def test_groups_sort_by_length_and_cut_at_the_token_budget(start):
    x = tokens(start)  # lengths 3, 5, 7, 9, 4, 6
    assert (x != start.loaded.pad_id).sum(1).tolist() == [3, 5, 7, 9, 4, 6]
    # sorted 3 4 | 5 6 | 7 | 9: a third row would take each pair past 12 tokens (3 x 5, 3 x 7)
    assert [g.tolist() for g in grouped_task(start, 12).groups(x)] == [[0, 4], [1, 5], [2], [3]]
    assert [g.tolist() for g in grouped_task(start, 60).groups(x)] == [[0, 4, 1, 5, 2, 3]]
    assert [g.tolist() for g in grouped_task(start, 1).groups(x)] == [[0], [4], [1], [5], [2], [3]]
    # mode head computes each record's features alone: nothing to group
    assert start.bind(get_problem("P7"), modes.Head()).task.groups(x) is None


@pytest.mark.parametrize("name", sorted(OPTIMIZERS.builtins))
def test_a_step_in_groups_is_the_one_pass_step(start, name, tmp_path_factory):
    """Every optimizer: two steps with the batch in four groups give the one-pass steps' parameters
    (float64, noise on, clipping active and unequal per row, so a row's norm or coefficient in the
    wrong place, or a group left out, shows), and the same per-row losses."""
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers.base import Context
    from dpbench.privacy.clipping import NoClipping

    spec = OPTIMIZERS[name]
    if name == "opacus-dpsgd":
        pytest.skip("Opacus's step runs its own pass over the batch")
    plan = spec.mechanism.plan(PlanRequest(N_TRAIN, L, 1 if "-se" in name else 2, target_epsilon=4.0,
                                           cache_dir=tmp_path_factory.getbasetemp() / "p7-cache"))
    x, y = tokens(start), torch.arange(6) % 40
    task = grouped_task(start, 12)
    out = {}
    for groups in (None, task.groups):
        model = built(start, modes.Full()).double()
        ctx = Context(model=model, loss_fn=p7_loss, lr=0.05 if "adam" in name else 0.5, expected_batch_size=L,
                      noise_multiplier=0.7 if spec.private else 0.0,
                      clipping=Clipping(0.02, normalize=False) if spec.private else NoClipping(),
                      noise=spec.mechanism.noise(plan, 5, "cpu"), steps=plan.steps,
                      hyperparameters=spec.hyperparameters(None), groups=groups)
        step = spec.build(ctx)
        losses = [step(x, y).losses for _ in range(2)]
        out[groups is None] = (losses, [p.detach().clone() for p in model.parameters()])
    first = built(start, modes.Full()).double()
    moved = max((p - p0).abs().max().item() for p, p0 in zip(out[True][1], first.parameters()))
    assert moved > 1e-3
    # 1e-9: far above float64 round-off (a gradient that is zero in exact arithmetic, the attention key
    # bias's, is round-off that Adam's first step scales up to 3e-13 here; another CPU may round
    # otherwise), far below a row's gradient in the wrong place or a group left out (>= 1e-3)
    for a, b in zip(out[True][0], out[False][0]):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
    for (n, _), a, b in zip(first.named_parameters(), out[True][1], out[False][1]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9 * max(1.0, moved), msg=n)


def test_grouped_gradients_hold_one_example_to_the_clipping_norm(start):
    """The privacy attack on the grouped path: removing any one record from the batch (which
    regroups the others) moves the clipped sum by at most C, and by more than half of it here
    (every row is clipped)."""
    from dpbench.optimizers.base import Context, DPStep, SGD
    from dpbench.mechanisms.noise import GaussianNoise

    x, y = tokens(start), torch.arange(6) % 40
    task, C = grouped_task(start, 12), 0.02
    model = built(start, modes.Full()).double()
    ctx = Context(model=model, loss_fn=p7_loss, lr=0.0, expected_batch_size=L, noise_multiplier=0.0,
                  clipping=Clipping(C, normalize=False), noise=GaussianNoise(0, "cpu"), steps=1, groups=task.groups)
    step = DPStep(ctx, SGD(0.0))

    def clipped_sum(rows):
        psg, _ = step.per_sample_gradients(x[rows], y[rows])
        return torch.cat([g.reshape(-1).clone() for g in step.clip_and_sum(psg)])

    everyone = clipped_sum(list(range(6)))
    moved = [float((everyone - clipped_sum([j for j in range(6) if j != i])).norm()) for i in range(6)]
    assert max(moved) <= C * (1 + 1e-9) and min(moved) > C / 2, moved


def test_a_grouped_batch_refuses_per_layer_access(start):
    from dpbench.privacy.per_sample import GroupedGradients

    model = built(start, modes.Bias()).double()
    x, y = tokens(start), torch.arange(6) % 40
    parts, index = [], grouped_task(start, 12).groups(x)
    for rows in index:
        tape = Tape(model)
        with tape:
            losses, _ = p7_loss(model, x[rows], y[rows])
        parts.append(tape.per_sample_gradients(losses))
    psg = GroupedGradients(parts, index, 6)
    with pytest.raises(TypeError, match="taken in groups"):
        psg.layers  # noqa: B018
    with pytest.raises(ValueError, match="disjoint and cover"):
        GroupedGradients(parts, index[:-1], 6)


@pytest.mark.parametrize("mode", [modes.Full(), modes.Head()], ids=["full", "head"])
def test_evaluation_in_groups_is_the_one_pass_evaluation(start, mode):
    from dpbench.training.train import evaluate

    problem = start.bind(get_problem("P7"), mode)
    problem.task.GROUP_TOKENS = 12
    model = built(start, mode).double()
    x, y = tokens(start, n=9), torch.arange(9) % 40
    one = evaluate(problem, model, x, y, batch_size=4, seed=0)
    grouped = evaluate(problem, model, x, y, batch_size=4, seed=0, grouped=True)
    assert one[0] > 0 and 0 <= one[1] <= 1
    assert grouped[0] == pytest.approx(one[0], rel=1e-12) and grouped[1] == one[1]
    # each record's correctness lands at its own row, whatever order the groups ran it in: labels
    # made right on the even rows and wrong on the odd ones
    with torch.no_grad():
        predicted = model(x).argmax(1)
    y = torch.where(torch.arange(9) % 2 == 0, predicted, (predicted + 1) % 40)
    for grouped in (False, True):
        outcomes = []
        _, accuracy = evaluate(problem, model, x, y, batch_size=4, seed=0, grouped=grouped, outcomes=outcomes)
        assert outcomes[0].tolist() == [True, False] * 4 + [True] and accuracy == pytest.approx(5 / 9)


def test_a_step_clips_group_by_group_as_the_held_groups_do(start, monkeypatch):
    """DP-SGD's step on a batch in groups sums each group's clipped sum as its pass ends, holding
    one group's records (``DPStep._clip_and_sum_by_pass``): the step that holds every group's
    until the last norm (``GroupedGradients``), float32, noise on."""
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers.base import Context, DPStep

    spec = OPTIMIZERS["dpsgd"]
    plan = spec.mechanism.plan(PlanRequest(N_TRAIN, L, 1, target_epsilon=4.0))
    x, y = tokens(start), torch.arange(6) % 40
    task, params, calls = grouped_task(start, 12), {}, []
    real = DPStep._clip_and_sum_by_pass
    monkeypatch.setattr(DPStep, "_clip_and_sum_by_pass", lambda *a: calls.append(1) or real(*a))
    for by_group in (True, False):
        model = built(start, modes.Full())
        ctx = Context(model=model, loss_fn=p7_loss, lr=0.5, expected_batch_size=L, noise_multiplier=0.7,
                      clipping=Clipping(0.02, normalize=False), noise=spec.mechanism.noise(plan, 5, "cpu"),
                      steps=plan.steps, hyperparameters=spec.hyperparameters(None), groups=task.groups)
        step = spec.build(ctx)
        if not by_group:
            monkeypatch.setattr(type(step), "_sums_by_pass", lambda self: False)
        for _ in range(2):
            step(x, y)
        params[by_group] = [p.detach().clone() for p in model.parameters()]
    assert len(calls) == 2  # the group-by-group path ran in the first model's two steps only
    # the same operations in the same order: bit for bit on this project's CPU; another CPU's kernels
    # may treat a result written into a buffer otherwise, so float32 round-off is allowed
    for a, b in zip(params[True], params[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
