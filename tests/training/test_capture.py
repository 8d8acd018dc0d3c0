"""Captured steps (dpbench.training.capture): bucket sizes from the binomial tails, padded
batches that change nothing (the padded step's update is the eager step's to 1e-12 in float64,
with the same noise; recorded metrics, sigma, epsilon and the sensitivity equal), batches past
the largest bucket run the eager step uncut, and steps that cannot be captured are named. The
graph replays themselves are compared with eager steps on a GPU (``pytest -m cuda``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import binom

from conftest import run_cell
from dpbench.mechanisms.noise import BandedNoise, CorrelatedNoise, GaussianNoise
from dpbench.mechanisms.sampling import CyclicPoissonSampler, FixedBatchSampler, PoissonSampler
from dpbench.optimizers import get_optimizer
from dpbench.optimizers.base import Context
from dpbench.privacy.clipping import Clipping, NoClipping
from dpbench.problems import get_problem
from dpbench.training import capture, cuda
from dpbench.training.config import RunConfig

pytestmark = pytest.mark.usefixtures("one_thread")

P2 = get_problem("P2")
SIGMA = 0.7


class RowFile:
    """A noise file's reading interface over rows held in memory (CorrelatedNoise reads row t)."""

    path = Path("in-memory")

    def __init__(self, dim: int, steps: int = 64):
        self.dim = dim
        self.rows = np.random.default_rng(5).standard_normal((steps, dim)).astype(np.float32)

    def row(self, t: int, out: np.ndarray) -> np.ndarray:
        out[:] = self.rows[t]
        return out


def make_step(optimizer: str = "dpsgd", noise: str = "gaussian", device="cpu", dtype=torch.float64):
    """(step, model) of ``optimizer`` on P2's model in ``dtype``, built as the harness builds it."""
    spec = get_optimizer(optimizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = P2.build().to(device=device, dtype=dtype).train()
    d = sum(p.numel() for p in model.parameters())
    source = {"gaussian": lambda: GaussianNoise(11, device),
              "banded": lambda: BandedNoise([1.0, -0.4, 0.1], np.ones(64), 11, device),
              "file": lambda: CorrelatedNoise(lambda dim: RowFile(dim), device)}[noise]()
    assert d == sum(p.numel() for p in model.parameters())
    ctx = Context(model=model, loss_fn=lambda m, x, y: P2.per_sample_loss(m, x, y), lr=0.3, expected_batch_size=24,
                  noise_multiplier=SIGMA if spec.private else 0.0,
                  clipping=Clipping(0.5) if spec.private else NoClipping(), noise=source, steps=64,
                  hyperparameters=spec.hyperparameters(None))
    return spec.build(ctx), model


def batches(sizes, device="cpu", dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, 1, 28, 28, generator=gen, dtype=dtype).to(device),
             torch.randint(0, 10, (n,), generator=gen).to(device)) for n in sizes]


# batch sizes: replays of both buckets (32, 64), an empty batch and two past the largest
SIZES = [20, 30, 50, 0, 17, 64, 70, 33, 1, 45, 29, 90, 63, 24]


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


# -- bucket sizes ---------------------------------------------------------------------------------

def test_binomial_bounds_are_the_tightest_that_hold():
    N, q, tail = 60_000, 256 / 60_000, 1e-6
    lo, hi = capture.binomial_bounds(N, q, tail)
    assert binom.sf(hi, N, q) <= tail < binom.sf(hi - 1, N, q)  # P(X > hi) <= 1e-6, and hi is the least such
    assert binom.cdf(lo - 1, N, q) <= tail < binom.cdf(lo, N, q)
    assert 256 + 4 * 16 < hi < 256 + 6 * 16 and 256 - 6 * 16 < lo < 256 - 4 * 16  # about 4.9 sd each side


def test_capacities_are_a_few_multiples_of_64_covering_the_upper_tail():
    N = 60_000
    caps = capture.capacities(PoissonSampler(N, 256 / N, seed=0))
    assert caps == (192, 256, 320, 384)
    for L in (32, 64, 256, 1024, 2048):
        caps = capture.capacities(PoissonSampler(N, L / N, seed=0))
        lo, hi = capture.binomial_bounds(N, L / N)
        assert all(c % 64 == 0 for c in caps) and 1 <= len(caps) <= capture.MAX_BUCKETS
        assert caps[-1] >= hi and caps[-1] - 64 < hi  # the largest: hi rounded up
        assert caps[0] >= lo  # no bucket below the lower tail
        assert binom.sf(caps[-1], N, L / N) <= capture.OVERFLOW_PROBABILITY
    assert capture.capacities(PoissonSampler(N, 2048 / N, seed=0)) == (1920, 2048, 2176, 2304)  # steps of 128
    assert capture.capacities(FixedBatchSampler(1000, 100, seed=0)) == (100,)  # exact batches: no padding
    cyclic = CyclicPoissonSampler(6000, 4, 4 * 64 / 6000, seed=0)
    groups = [len(m) for m in cyclic.members]
    hi = max(capture.binomial_bounds(g, cyclic.sample_rate)[1] for g in groups)
    assert capture.capacities(cyclic)[-1] == -(-hi // 64) * 64
    assert capture.capacities(object()) is None


# -- the padded step is the eager step --------------------------------------------------------------

@pytest.mark.parametrize("optimizer,noise", [("dpsgd", "gaussian"), ("sgd", "gaussian"), ("dpmatrix-band", "banded"),
                                             ("dpmatrix-se", "file")])
def test_padded_steps_update_as_the_eager_step_to_1e12_in_float64(optimizer, noise):
    eager, eager_model = make_step(optimizer, noise)
    padded, padded_model = make_step(optimizer, noise)
    runner = capture.CapturedStep(padded, (32, 64), graphs=False, warmup=1)
    for i, (x, y) in enumerate(batches(SIZES)):
        a, b = eager(x, y), runner(x, y)
        for p, q in zip(eager_model.parameters(), padded_model.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=1e-12), (optimizer, i, (p - q).abs().max().item())
        assert a.losses.shape == b.losses.shape == (x.shape[0],)
        assert torch.allclose(a.losses, b.losses, rtol=0, atol=1e-12)  # the recorded metrics
        assert (a.correct is None and b.correct is None) or torch.equal(a.correct, b.correct)
        assert a.stats == b.stats
    moved = max((p - q).abs().max().item() for p, q in zip(params_of(eager_model), params_of(make_step(optimizer, noise)[1])))
    assert moved > 1e-3  # the steps did move the parameters
    # the noise stream is the eager step's, draw for draw (never frozen, never skipped)
    assert torch.equal(torch.as_tensor(eager.ctx.noise.state_dict().get("step", 0)),
                       torch.as_tensor(padded.ctx.noise.state_dict().get("step", 0)))
    if hasattr(eager.ctx.noise, "generator"):
        assert torch.equal(eager.ctx.noise.generator.get_state(), padded.ctx.noise.generator.get_state())
    assert runner.counts == {"captured_steps": 11, "warmup_steps": 2, "eager_steps": 3, "overflow_steps": 2,
                             "empty_steps": 1, "captures": 0}
    assert eager.ctx.noise is not padded.ctx.noise and isinstance(padded.ctx.noise, type(eager.ctx.noise))


def test_what_padding_rows_hold_changes_nothing_bit_for_bit(monkeypatch):
    """Padding rows get weight 0 in the loss and the clipped sum: whatever they hold (here large
    random images and labels instead of zeros), the update is the same to the bit."""
    results = []
    for garbage in (False, True):
        step, model = make_step("dpsgd")
        runner = capture.CapturedStep(step, (64,), graphs=False, warmup=1)
        if garbage:
            load = capture._Bucket.load

            def noisy_load(self, x, y, n):
                load(self, x, y, n)
                self.x[n:].normal_(0, 100)
                self.y[n:].random_(0, 10)

            monkeypatch.setattr(capture._Bucket, "load", noisy_load)
        outs = [runner(x, y) for x, y in batches([10, 40, 25, 61])]
        results.append((params_of(model), [o.losses for o in outs]))
    (p0, l0), (p1, l1) = results
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))


def test_warm_up_steps_leave_no_trace():
    """The throwaway steps before a capture put the parameters back bit for bit and draw no noise."""
    results = []
    for warmup in (1, 3):
        step, model = make_step("dpsgd")
        runner = capture.CapturedStep(step, (64,), graphs=False, warmup=warmup)
        for x, y in batches([10, 40, 25]):
            runner(x, y)
        assert runner.counts["warmup_steps"] == warmup and runner.counts["captured_steps"] == 3
        results.append((params_of(model), step.ctx.noise.generator.get_state()))
    (p0, g0), (p1, g1) = results
    assert all(torch.equal(a, b) for a, b in zip(p0, p1)) and torch.equal(g0, g1)


def test_padding_rows_have_zero_weight_in_the_clipped_sum():
    step, _ = make_step("dpsgd")
    seen = {}
    clip_and_sum = step.clip_and_sum

    def spy(psg):
        seen["norms"], seen["weights"] = psg.norms(), step.sample_weights.clone()
        return clip_and_sum(psg)

    step.clip_and_sum = spy
    runner = capture.CapturedStep(step, (64,), graphs=False, warmup=1)
    runner(*batches([23])[0])
    assert torch.equal(seen["weights"], torch.cat([torch.ones(23), torch.zeros(41)]).double())
    assert torch.all(seen["norms"][:23] > 0) and torch.all(seen["norms"][23:] == 0)  # exact zeros: masked loss
    assert step.sample_weights is None  # the eager step is left as it was


def test_a_batch_past_the_largest_bucket_runs_the_eager_step_uncut():
    eager, eager_model = make_step("dpsgd")
    padded, padded_model = make_step("dpsgd")
    runner = capture.CapturedStep(padded, (16,), graphs=False, warmup=1)
    x, y = batches([40])[0]
    a, b = eager(x, y), runner(x, y)
    assert b.losses.shape == (40,) and torch.equal(a.losses, b.losses)  # every row, none cut
    assert all(torch.equal(p, q) for p, q in zip(eager_model.parameters(), padded_model.parameters()))
    assert runner.counts["overflow_steps"] == runner.counts["eager_steps"] == 1
    assert runner.counts["captured_steps"] == runner.counts["warmup_steps"] == 0


def test_a_failed_capture_falls_back_to_the_eager_step_for_the_rest_of_the_run(capsys):
    """A step found not capturable only when it runs (here: it returns a host-side statistic)
    stops capture with the reason; the warm-up's effect is undone and the eager step runs."""
    eager, eager_model = make_step("dpsgd")
    padded, padded_model = make_step("dpsgd")
    for step in (eager, padded):
        update = step.rule.update
        step.rule.update = lambda params, grads, update=update: update(params, grads) or {"norm": 1.0}
    runner = capture.CapturedStep(padded, (64,), graphs=False, warmup=2)
    for x, y in batches([30, 40]):
        a, b = eager(x, y), runner(x, y)
        assert torch.equal(a.losses, b.losses) and a.stats == b.stats == {"norm": 1.0}
    assert all(torch.equal(p, q) for p, q in zip(eager_model.parameters(), padded_model.parameters()))
    assert runner.stopped.startswith("capture failed (RuntimeError: the step returns host-side statistics (norm))")
    assert runner.counts["eager_steps"] == 2 and runner.counts["captured_steps"] == 0
    assert "the eager step runs from now on" in capsys.readouterr().err
    assert torch.equal(eager.ctx.noise.generator.get_state(), padded.ctx.noise.generator.get_state())


# -- what is captured, and the option on a CPU ------------------------------------------------------

@pytest.mark.parametrize("optimizer,why", [("dpadambc", "Adam"), ("dpdisk", "DiskStep"), ("dpdice", "DiceStep"),
                                           ("d2psgd", "ProjectedStep"), ("adam", "Adam")])
def test_steps_with_host_state_that_changes_are_not_captured(optimizer, why):
    step, _ = make_step(optimizer)
    reason = capture.refusal(step, P2, PoissonSampler(1000, 0.05, 0))
    assert reason is not None and why in reason
    with pytest.raises(ValueError, match="cannot be captured"):
        capture.CapturedStep(step, (64,), graphs=False)


def test_problems_whose_loss_draws_are_not_captured():
    step, _ = make_step("dpsgd")
    assert capture.refusal(step, P2, PoissonSampler(1000, 0.05, 0)) is None
    assert "latent noise" in capture.refusal(step, get_problem("P3"))
    assert capture.refusal(step, get_problem("P4")) is None  # its padded steps run the uncut batch
    assert "unknown" in capture.refusal(step, P2, object())


def test_the_option_on_a_cpu_is_a_no_op_that_says_so():
    step, _ = make_step("dpsgd")
    said = []
    stepper, record = capture.for_run(True, step, P2, PoissonSampler(1000, 0.05, 0), torch.device("cpu"), said.append)
    assert stepper is step and record() == {"enabled": False, "reason": "device cpu is not a CUDA GPU (CUDA graphs need one)"}
    assert said == ["[cuda graphs] off: device cpu is not a CUDA GPU (CUDA graphs need one); the eager step runs"]
    stepper, record = capture.for_run(False, step, P2, None, torch.device("cpu"))
    assert stepper is step and record() is None


def _cell(**kw):
    return RunConfig(problem="P2", optimizer="dpsgd", lr=0.5, batch_size=32, epochs=1, seed=1, epsilon=4.0,
                     train_subset=300, test_subset=64, max_steps=8, device="cpu", progress_every_s=1e9, **kw)


def _privacy(result) -> dict:
    """The run's privacy record, less the seconds its calibration took."""
    return {k: v for k, v in result.meta["privacy"].items() if k != "calibration_time_s"}


def test_a_run_with_the_option_on_a_cpu_is_the_run_without_it(tiny_fmnist):
    off, on = run_cell(_cell()), run_cell(_cell(cuda_graphs=True))
    assert off.metrics.equals(on.metrics) and _privacy(off) == _privacy(on)
    assert on.meta["timing"]["cuda_graphs"]["enabled"] is False and "cuda_graphs" not in off.meta["timing"]


def test_a_padded_run_records_the_same_privacy_and_metrics(tiny_fmnist, monkeypatch):
    """The whole run with its steps padded (the CPU runs what a replay runs, eagerly): sigma,
    epsilon, the sensitivity and the noise std are the same numbers, the realised batch sizes the
    same, the losses the same up to float32 rounding of sums over another shape."""
    real = capture.CapturedStep
    monkeypatch.setattr(capture, "CapturedStep", lambda step, caps, graphs, **kw: real(step, caps, graphs=False, **kw))
    monkeypatch.setattr(capture, "_graph_device", lambda device: True)
    off, on = run_cell(_cell()), run_cell(_cell(cuda_graphs=True))
    assert _privacy(off) == _privacy(on)
    assert on.meta["privacy"]["sensitivity"] == 1.0 and on.meta["privacy"]["noise_multiplier"] > 0
    record = on.meta["timing"]["cuda_graphs"]
    assert record["captured_steps"] + record["eager_steps"] == 8
    assert record["captured_steps"] >= 4 and record["capacities"] == [64]
    a, b = off.metrics, on.metrics
    assert a[["split", "step", "epoch", "batch_size"]].equals(b[["split", "step", "epoch", "batch_size"]])
    assert np.allclose(a["loss"], b["loss"], rtol=1e-4, atol=0) and np.allclose(a["accuracy"], b["accuracy"], equal_nan=True)


def _killed_and_resumed_is_uninterrupted(tmp_path, monkeypatch, device: str):
    """A captured run interrupted twice mid-epoch (after checkpoints) and resumed ends with the
    metrics of the uninterrupted captured run: capture keeps no state a checkpoint must hold
    (graphs are captured again after a resume; the noise source's state is its own)."""
    import pandas as pd
    from test_train import FlakySampler, Interrupt

    from dpbench.optimizers import get_optimizer

    cfg = RunConfig(problem="P2", optimizer="dpsgd", lr=0.05, batch_size=60, epochs=2, seed=4, epsilon=3.0,
                    progress_every_s=1e9, device=device, cuda_graphs=True)
    reference = run_cell(cfg)
    mechanism = get_optimizer("dpsgd").mechanism
    original = type(mechanism).sampler
    monkeypatch.setattr(type(mechanism), "sampler", lambda self, *a, **k: FlakySampler(original(self, *a, **k)))
    monkeypatch.setattr(FlakySampler, "calls", 0)
    monkeypatch.setattr(FlakySampler, "fail_at", (7, 14))
    ckpt = tmp_path / "run.ckpt"
    for _ in range(2):
        with pytest.raises(Interrupt):
            run_cell(cfg, checkpoint=ckpt, checkpoint_every_s=0.0)
    resumed = run_cell(cfg, checkpoint=ckpt, checkpoint_every_s=0.0)
    pd.testing.assert_frame_equal(resumed.metrics, reference.metrics)
    assert _privacy(resumed) == _privacy(reference) and resumed.meta["timing"]["resumes"] == 2
    return reference.meta["timing"]["cuda_graphs"]


def test_a_padded_run_killed_and_resumed_ends_as_the_uninterrupted_one(tiny_fmnist, tmp_path, monkeypatch):
    real = capture.CapturedStep
    monkeypatch.setattr(capture, "CapturedStep", lambda step, caps, graphs, **kw: real(step, caps, graphs=False, **kw))
    monkeypatch.setattr(capture, "_graph_device", lambda device: True)
    record = _killed_and_resumed_is_uninterrupted(tmp_path, monkeypatch, "cpu")
    assert record["captured_steps"] > 0


# -- graphs on a GPU ----------------------------------------------------------------------------------

def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)")
    cuda.configure()
    return torch.device("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer,noise", [("dpsgd", "gaussian"), ("sgd", "gaussian"), ("dpmatrix-band", "banded"),
                                             ("dpmatrix-se", "file")])
def test_graph_replays_update_as_the_eager_step_on_a_gpu(optimizer, noise):
    device = _gpu()
    eager, eager_model = make_step(optimizer, noise, device)
    graphed, graphed_model = make_step(optimizer, noise, device)
    runner = capture.CapturedStep(graphed, (32, 64), graphs=True, warmup=1)
    for i, (x, y) in enumerate(batches(SIZES, device)):
        a, b = eager(x, y), runner(x, y)
        for p, q in zip(eager_model.parameters(), graphed_model.parameters()):
            assert torch.allclose(p, q, rtol=0, atol=1e-10), (optimizer, i, (p - q).abs().max().item())
        assert torch.allclose(a.losses, b.losses, rtol=0, atol=1e-10)
        assert (a.correct is None and b.correct is None) or torch.equal(a.correct, b.correct)
    assert runner.stopped is None, runner.stopped
    assert runner.counts["captures"] == 2 and runner.counts["captured_steps"] == 11
    if hasattr(eager.ctx.noise, "generator"):  # the graph drew no noise of its own: the stream is the eager one
        assert torch.equal(eager.ctx.noise.generator.get_state(), graphed.ctx.noise.generator.get_state())


@pytest.mark.cuda
def test_a_replayed_graph_draws_fresh_noise_every_step():
    device = _gpu()
    step, model = make_step("dpsgd", device=device)
    runner = capture.CapturedStep(step, (64,), graphs=True, warmup=1)
    x, y = batches([40], device)[0]
    updates = []
    for _ in range(4):
        before = params_of(model)
        runner(x, y)
        updates.append(torch.cat([(p - b).flatten() for p, b in zip(params_of(model), before)]))
    assert runner.counts["captured_steps"] == 4 and runner.stopped is None
    assert not torch.allclose(updates[2], updates[3])  # same batch, same parameters nearly: other noise


@pytest.mark.cuda
def test_a_captured_run_on_a_gpu_records_the_same_privacy_and_metrics(tiny_fmnist):
    _gpu()
    off, on = run_cell(_cell(device="cuda")), run_cell(_cell(device="cuda", cuda_graphs=True))
    assert _privacy(off) == _privacy(on)
    record = on.meta["timing"]["cuda_graphs"]
    assert record["enabled"] and record["stopped"] is None and record["captured_steps"] >= 4, record
    a, b = off.metrics, on.metrics
    assert a[["split", "step", "epoch", "batch_size"]].equals(b[["split", "step", "epoch", "batch_size"]])
    assert np.allclose(a["loss"], b["loss"], rtol=1e-4, atol=0)


def test_the_config_key_becomes_the_train_option():
    from dpbench import cli
    from dpbench.pipeline.grid import Cell

    cell = Cell("P2", "dpsgd", 256, 2, 1.0, 0.001, 0, 99, ())
    assert "--cuda-graphs" not in cell.train_args({}) and "--cuda-graphs" not in cell.train_args({"cuda_graphs": False})
    args = cell.train_args({"cuda_graphs": True})
    assert "--cuda-graphs" in args
    assert cli.build_parser().parse_args(["train", *args, "--out", "x.parquet"]).cuda_graphs is True


@pytest.mark.cuda
def test_a_captured_run_killed_and_resumed_ends_as_the_uninterrupted_one(tiny_fmnist, tmp_path, monkeypatch):
    """After a resume the graphs are captured again (fresh warm-ups, new memory): equal metrics
    need every replay to compute the same bits as the uninterrupted run's."""
    _gpu()
    record = _killed_and_resumed_is_uninterrupted(tmp_path, monkeypatch, "cuda")
    assert record["captures"] > 0 and record["stopped"] is None, record
