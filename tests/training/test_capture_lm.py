"""Captured steps of the language model (P4): its eager steps cut each batch to its longest
record (a host sync and a data-dependent shape), its padded steps run the uncut batch
(``Task.fixed_shape_loss``); the padded step updates as the eager step to 1e-12 in float64,
with the same noise, and a padded P4 run records the same privacy and metrics. Which tasks a
captured step may run is declared per task class (``Task.capture_refusal``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_cell
from dpbench.mechanisms.noise import GaussianNoise
from dpbench.optimizers import get_optimizer
from dpbench.optimizers.base import Context
from dpbench.privacy.clipping import Clipping, NoClipping
from dpbench.problems import get_problem, tokenizer
from dpbench.problems.tasks import Classification, Task
from dpbench.problems.transformer import TransformerLM
from dpbench.training import capture, cuda
from dpbench.training.config import RunConfig
from test_capture import make_step

pytestmark = pytest.mark.usefixtures("one_thread")

P4 = get_problem("P4")
WIDTH = 17  # context 16 + 1: a record's tokens and its next-token targets


def lm_step(optimizer: str, device="cpu"):
    """(step, model) of ``optimizer`` on a small P4 transformer in float64; eager steps run P4's
    loss (batches cut to their longest record)."""
    spec = get_optimizer(optimizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = TransformerLM(context=WIDTH - 1, d_model=16, n_layers=1, n_heads=2, d_mlp=32)
    model = model.to(device=device, dtype=torch.float64).train()
    ctx = Context(model=model, loss_fn=lambda m, x, y: P4.per_sample_loss(m, x, y), lr=0.5, expected_batch_size=24,
                  noise_multiplier=0.7 if spec.private else 0.0,
                  clipping=Clipping(0.5) if spec.private else NoClipping(), noise=GaussianNoise(11, device), steps=64,
                  hyperparameters=spec.hyperparameters(None))
    return spec.build(ctx), model


def records(sizes, longest=(WIDTH,), seed=0, device="cpu"):
    """Token batches encoded as P4 encodes its records ([BOS] bytes [EOS], PAD to WIDTH), the
    records of batch i at most ``longest[i % len(longest)]`` tokens (so eager steps cut)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    out = []
    for i, n in enumerate(sizes):
        lengths = rng.integers(1, longest[i % len(longest)] - 2, n, endpoint=True)  # + BOS and EOS
        x = tokenizer.encode_records(["".join(rng.choice(letters, k)) for k in lengths], WIDTH - 1)
        out.append((torch.from_numpy(x).to(device), None))
    return out


SIZES = [20, 30, 50, 0, 17, 64, 70, 33, 1, 45]  # both buckets (32, 64), an empty batch, one past the largest


@pytest.mark.parametrize("optimizer", ["dpsgd", "sgd"])
def test_padded_lm_steps_run_the_uncut_batch_and_update_as_the_eager_step(optimizer):
    eager, eager_model = lm_step(optimizer)
    padded, padded_model = lm_step(optimizer)
    widths = []
    loss = P4.task.fixed_shape_loss

    def spy(m, x, y):
        widths.append(x.shape[1])
        return loss(m, x, y)

    runner = capture.CapturedStep(padded, (32, 64), graphs=False, warmup=1, loss_fn=spy)
    start = [p.detach().clone() for p in eager_model.parameters()]
    for i, (x, y) in enumerate(records(SIZES, longest=(WIDTH, 6, 11))):
        a, b = eager(x, y), runner(x, y)
        for p, q in zip(eager_model.parameters(), padded_model.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=1e-12), (optimizer, i, (p - q).abs().max().item())
        assert a.losses.shape == b.losses.shape == (x.shape[0],) and b.correct is None
        assert torch.allclose(a.losses, b.losses, rtol=0, atol=1e-12)
    assert max((p - s).abs().max().item() for p, s in zip(eager_model.parameters(), start)) > 1e-3
    assert set(widths) == {WIDTH}  # every padded step (warm-ups included) ran the full width
    assert runner.counts == {"captured_steps": 8, "warmup_steps": 2, "eager_steps": 2, "overflow_steps": 1,
                             "empty_steps": 1, "captures": 0}
    assert torch.equal(eager.ctx.noise.generator.get_state(), padded.ctx.noise.generator.get_state())


def test_the_fixed_shape_loss_is_the_loss_of_the_cut_batch():
    """Cutting a batch to its longest record changes no record's loss (the model is causal and
    PAD targets carry no loss), and the fixed-shape loss syncs nothing to the host."""
    _, model = lm_step("sgd")
    seen = []
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    x, _ = records([12], longest=(7,))[0]
    cut, _ = P4.per_sample_loss(model, x, None)
    full, correct = P4.task.fixed_shape_loss(model, x, None)
    assert seen == [6, WIDTH - 1]  # the eager loss read 7 tokens per record, the fixed-shape one all
    assert correct is None and torch.allclose(cut, full, rtol=0, atol=1e-12) and torch.all(full > 0)


def test_tasks_declare_whether_a_captured_step_may_run_their_loss():
    step, _ = make_step("dpsgd")
    assert capture.task_refusal(P4.task) is None and capture.task_refusal(get_problem("P2").task) is None
    assert "latent noise" in capture.task_refusal(get_problem("P3").task)

    class Mine(Task):  # a plugin's task that says nothing
        pass

    class MyClassification(Classification):  # may change the loss: must declare again
        pass

    class Declared(Classification):
        capture_refusal = None

    for task in (Mine(), MyClassification()):
        reason = capture.task_refusal(task)
        assert reason is not None and f"{type(task).__name__}.capture_refusal" in reason
    assert capture.task_refusal(Declared()) is None

    class Problem:
        task = MyClassification()

    assert "does not declare" in capture.refusal(step, Problem())


def test_a_padded_p4_run_records_the_same_privacy_and_metrics(generated_corpus, monkeypatch):  # noqa: F811
    """A whole P4 run with its steps padded (the CPU runs what a replay runs, eagerly, on the
    uncut batches): sigma, epsilon, the sensitivity and the batch sizes the same numbers, the
    losses and the canaries' exposures the same up to float32 rounding over another shape."""
    real = capture.CapturedStep
    monkeypatch.setattr(capture, "CapturedStep", lambda step, caps, graphs, **kw: real(step, caps, graphs=False, **kw))
    monkeypatch.setattr(capture, "_graph_device", lambda device: True)
    widths, fixed = [], type(P4.task).fixed_shape_loss
    monkeypatch.setattr(type(P4.task), "fixed_shape_loss",
                        lambda self, m, x, y, gen=None: widths.append(x.shape[1]) or fixed(self, m, x, y, gen))

    def cell(**kw):
        return RunConfig(problem="P4", optimizer="dpsgd", lr=1.0, batch_size=16, epochs=1, seed=0, epsilon=10.0,
                         data_dir=str(generated_corpus), train_subset=120, max_steps=4, validation_size=16, **kw)

    off, on = run_cell(cell()), run_cell(cell(cuda_graphs=True))
    record = on.meta["timing"]["cuda_graphs"]
    assert record["enabled"] and record["stopped"] is None and record["captured_steps"] >= 3, record
    # every padded step ran the task's fixed-shape loss, on the full width of P4's records
    assert len(widths) == record["captured_steps"] + record["warmup_steps"] and set(widths) == {129}
    for key in ("noise_multiplier", "epsilon", "target_epsilon", "sensitivity", "sample_rate", "steps"):
        assert off.meta["privacy"][key] == on.meta["privacy"][key], key
    a, b = off.metrics, on.metrics
    assert a[["split", "step", "epoch", "batch_size"]].equals(b[["split", "step", "epoch", "batch_size"]])
    assert np.allclose(a["loss"], b["loss"], rtol=1e-4, atol=0)
    ranks = [[c["rank"] for c in r.meta["memorisation"]["canaries"]] for r in (off, on)]
    assert len(ranks[0]) == 12 and ranks[0] == ranks[1]


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer", ["dpsgd", "sgd"])
def test_lm_graph_replays_update_as_the_eager_step_on_a_gpu(optimizer):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)")
    cuda.configure()
    eager, eager_model = lm_step(optimizer, "cuda")
    graphed, graphed_model = lm_step(optimizer, "cuda")
    runner = capture.CapturedStep(graphed, (32, 64), graphs=True, warmup=1, loss_fn=P4.task.fixed_shape_loss)
    for i, (x, y) in enumerate(records(SIZES, longest=(WIDTH, 6, 11), device="cuda")):
        a, b = eager(x, y), runner(x, y)
        for p, q in zip(eager_model.parameters(), graphed_model.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=1e-10), (optimizer, i, (p - q).abs().max().item())
        assert torch.allclose(a.losses, b.losses, rtol=0, atol=1e-10)
    assert runner.stopped is None, runner.stopped
    assert runner.counts["captures"] == 2 and runner.counts["captured_steps"] == 8
    assert torch.equal(eager.ctx.noise.generator.get_state(), graphed.ctx.noise.generator.get_state())
