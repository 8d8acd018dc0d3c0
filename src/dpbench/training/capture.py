"""Captured steps on a GPU: Poisson batches padded to a few fixed capacities, each capacity's
step replayed as one CUDA graph (``torch.cuda.CUDAGraph``) instead of ~1,000 kernel launches
from Python.

A graph replays fixed kernels on fixed memory, so a captured step needs fixed shapes and no
host-side state that changes between steps. Three things make a DP step so:

* **Buckets.** A Poisson batch has Binomial(N, q) rows. ``capacities`` gives a few bucket
  sizes, multiples of 64 (``GRANULARITY``) from the lower to the upper binomial tail bound
  (``OVERFLOW_PROBABILITY`` = 1e-6 per step each side; at most ``MAX_BUCKETS`` buckets, wider
  steps where the tails span more): a batch of n rows runs in the smallest bucket >= n. A batch
  above the largest bucket (probability <= 1e-6 per step, so about one step in a million) or an
  empty one runs the ordinary eager step: never cut, never dropped.
* **The mask.** The batch is copied into the bucket's static input buffers and the rows past n
  are zeros; a boolean mask marks the real rows. A padding row gets weight zero three times:
  its loss is replaced by 0 (``torch.where``, so its output gradients, hence its per-sample
  gradients, are exactly zero), its clipping coefficient is multiplied by 0
  (``DPStep.sample_weights``), and every statistic the step returns (per-sample losses and
  correctness) is cut to the first n rows. So σ, ε and the sensitivity (fixed by the plan before
  any batch) and every recorded metric are those of the unpadded step; the update differs from
  the eager step's only by the rounding of sums over a different shape (float64: < 1e-12,
  tests/test_capture.py).
* **Noise outside the graph.** The step's noise source is swapped, while the step runs padded,
  for ``StaticNoise``: before each replay the real source draws (a seeded generator, a row of a
  memory-mapped noise file, a streamed recurrence) eagerly, as the eager step would, into
  static buffers that the graph reads. A graph therefore never freezes the noise, the noise
  stream is the eager step's draw for draw, and the source's state (checkpoints) stays its own.

Which steps are captured (``refusal`` says why not, and the run records it): ``DPStep`` and
``NonPrivateStep`` with the ``SGD`` rule exactly (dpsgd, sgd, the dense and streamed matrix
mechanisms), noise from the built-in sources, on classification problems, one lane. The others
keep host-side state that changes every step, which a graph would freeze: the Adam family's step
count t in its bias correction, DiSK's first step and direction, Dice's residual allocation,
D2P2's projection seed per step, Opacus's hooks; the VAE draws its latent noise from the run's
loss generator per step, and the language model cuts each batch to its longest record (a host
sync and a data-dependent shape). They run eagerly, unchanged.

Capture: per bucket, ``WARMUP_STEPS`` real steps run the padded step eagerly on a side stream
(lazy initialisation: cuBLAS handles, the noise file, autograd's buffers), then the next step of
that bucket is captured and replayed. All buckets' graphs share one memory pool: replays are
never concurrent (one stream) and each replay's outputs are copied out before the next one.
Numerics stay as configured (``dpbench.training.cuda``: no TF32, deterministic kernels). A
capture that fails (an operation that syncs with the host) stops capture for the run with the
reason, and the eager step runs from then on.

On a CPU there are no graphs: ``CapturedStep(..., graphs=False)`` runs the same padded step and
the same static noise buffers eagerly (the tests compare it with the eager step there), and the
run option ``cuda_graphs`` is a no-op with a message (``for_run``).
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import torch

from dpbench.mechanisms.noise import BandedNoise, BLTNoise, CorrelatedNoise, GaussianNoise
from dpbench.mechanisms.sampling import CyclicPoissonSampler, FixedBatchSampler, PoissonSampler
from dpbench.optimizers.base import SGD, DPStep, NonPrivateStep, StepOutput
from dpbench.problems.tasks import Classification

GRANULARITY = 64  # bucket sizes are multiples of this
OVERFLOW_PROBABILITY = 1e-6  # per step: a batch above the largest bucket (runs eagerly)
MAX_BUCKETS = 4  # graphs per run
WARMUP_STEPS = 3  # eager padded steps per bucket before its capture
CAPTURED_STEPS = (DPStep, NonPrivateStep)  # exact types: their host state is fixed between steps
SHAPE_ONLY_NOISE = (GaussianNoise, CorrelatedNoise, BandedNoise, BLTNoise)  # sample(like) reads shapes only


def binomial_bounds(trials: int, p: float, tail: float = OVERFLOW_PROBABILITY) -> tuple[int, int]:
    """(lo, hi) with P(X < lo) <= tail and P(X > hi) <= tail for X ~ Binomial(trials, p)."""
    from scipy.stats import binom

    hi = int(binom.isf(tail, trials, p))
    while binom.sf(hi, trials, p) > tail:  # isf is a float inverse: make the bound hold exactly
        hi += 1
    lo = int(binom.ppf(tail, trials, p))
    while lo > 0 and binom.cdf(lo - 1, trials, p) > tail:
        lo -= 1
    return lo, hi


def capacities_between(lo: int, hi: int, granularity: int = GRANULARITY,
                       max_buckets: int = MAX_BUCKETS) -> tuple[int, ...]:
    """Bucket sizes serving every batch size in [1, hi]: the largest is hi rounded up to a
    multiple of ``granularity``, then steps of a multiple of it down to ``lo``, at most
    ``max_buckets`` of them (batches below the smallest pad to it)."""
    top = max(granularity, math.ceil(hi / granularity) * granularity)
    bottom = min(top, max(granularity, math.ceil(lo / granularity) * granularity))
    levels = (top - bottom) // granularity + 1
    width = granularity * math.ceil(levels / max_buckets)
    caps = [c for c in range(top, bottom - 1, -width)][:max_buckets]
    return tuple(sorted(caps))


def capacities(sampler, granularity: int = GRANULARITY, tail: float = OVERFLOW_PROBABILITY,
               max_buckets: int = MAX_BUCKETS) -> tuple[int, ...] | None:
    """The bucket sizes for the batches of ``sampler``: Poisson (Binomial(N, q) rows), cyclic
    Poisson (Binomial(group size, p), the tails over every group), fixed batches (exactly their
    size, no padding); None for a sampler whose batch sizes are unknown."""
    if isinstance(sampler, FixedBatchSampler):
        return (int(sampler.batches.shape[1]),)
    if isinstance(sampler, PoissonSampler):
        lo, hi = binomial_bounds(sampler.num_examples, sampler.sample_rate, tail)
    elif isinstance(sampler, CyclicPoissonSampler):
        bounds = [binomial_bounds(len(m), sampler.sample_rate, tail) for m in sampler.members if len(m)]
        lo, hi = min(b[0] for b in bounds), max(b[1] for b in bounds)
    else:
        return None
    return capacities_between(lo, hi, granularity, max_buckets)


def refusal(step, problem=None, sampler=None) -> str | None:
    """Why ``step`` (of ``problem``, fed by ``sampler``) cannot be captured, or None."""
    name = type(step).__name__
    if type(step) not in CAPTURED_STEPS:
        return (f"its step {name} keeps host-side state that may change between steps (only DPStep and "
                "NonPrivateStep with the SGD rule are captured)")
    if type(step.rule) is not SGD:
        return (f"its update rule {type(step.rule).__name__} keeps host-side state that changes every step "
                "(e.g. Adam's step count in the bias correction): a graph would freeze it")
    if step.ctx.lanes != 1:
        return f"it runs {step.ctx.lanes} lanes (the audit's replicas)"
    if step.private and step.noise_std != 0 and type(step.ctx.noise) not in SHAPE_ONLY_NOISE:
        return f"its noise source {type(step.ctx.noise).__name__} is not one known to draw from shapes alone"
    if problem is not None and type(problem.task) is not Classification:
        why = {"vae": "draws its latent noise from the run's loss generator at every step",
               "language-model": "cuts each batch to its longest record (a host sync and a data-dependent shape)"}
        task = problem.task.facts.name
        return f"its problem's task ({task}) {why.get(task, 'is not a classification task')}"
    if sampler is not None and capacities(sampler) is None:
        return f"its sampler {type(sampler).__name__} has batch sizes of unknown distribution"
    return None


class StaticNoise:
    """A noise source standing in for ``source`` while the step runs padded. ``live``: each
    ``sample`` draws from the source (as the eager step would); otherwise ``sample`` returns
    the static buffers, which ``fill`` loads from the source before the step (a replay) runs.
    ``draws``: how many times the last live step drew (0 without noise: sigma = 0)."""

    def __init__(self, source, like: list[torch.Tensor]):
        self.source = source
        self.buffers = [torch.empty_like(t) for t in like]
        self.live = True
        self.calls = 0  # sample() calls of the step running now
        self.draws: int | None = None

    def sample(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        if [t.shape for t in like] != [b.shape for b in self.buffers]:
            raise ValueError("the step asked for noise of other shapes than its parameters'")
        self.calls += 1
        return self.source.sample(like) if self.live else self.buffers

    def fill(self) -> None:
        """The next step's noise, drawn eagerly by the real source into the buffers."""
        if self.draws:
            torch._foreach_copy_(self.buffers, self.source.sample(self.buffers))


class _Bucket:
    """One capacity's static buffers (inputs, mask, noise) and, once captured, its graph."""

    def __init__(self, capacity: int, x: torch.Tensor, y: torch.Tensor | None, step):
        self.capacity = capacity
        self.x = x.new_zeros((capacity, *x.shape[1:]))
        self.y = None if y is None else y.new_zeros((capacity, *y.shape[1:]))
        self.mask = torch.zeros(capacity, dtype=torch.bool, device=x.device)
        self.weights = torch.zeros(capacity, dtype=step.params[0].dtype, device=x.device)
        self.noise = StaticNoise(step.ctx.noise, step.params)
        self.warm = 0  # padded steps run so far
        self.ready = False  # captured (without graphs: checked)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: StepOutput | None = None  # the graph's static output

    def load(self, x: torch.Tensor, y: torch.Tensor | None, n: int) -> None:
        self.x[:n].copy_(x)
        self.x[n:].zero_()
        if self.y is not None:
            self.y[:n].copy_(y)
            self.y[n:].zero_()
        self.mask[:n].fill_(True)
        self.mask[n:].fill_(False)
        self.weights[:n].fill_(1.0)
        self.weights[n:].zero_()


def _cut(out: StepOutput, n: int) -> StepOutput:
    """The step's output for the real rows only (copied: a graph's outputs are overwritten)."""
    return StepOutput(out.losses[:n].clone(), None if out.correct is None else out.correct[:n].clone(),
                      dict(out.stats))


class CapturedStep:
    """Calls like the step it wraps, ``(x, y) -> StepOutput``: a batch that fits a bucket runs
    padded (eagerly for its bucket's first ``warmup`` steps, then as the bucket's CUDA graph
    where ``graphs``), any other batch runs the step itself. ``counts`` says how many steps ran
    which way: ``captured_steps`` replayed a graph (without ``graphs``: ran what a replay runs,
    eagerly), ``padded_eager_steps`` were warm-ups, ``eager_steps`` the step itself (empty
    batches, batches past the largest bucket, every step after a failed capture)."""

    def __init__(self, step, capacities: tuple[int, ...], *, graphs: bool, warmup: int = WARMUP_STEPS):
        reason = refusal(step)
        if reason is not None:
            raise ValueError(f"this step cannot be captured: {reason}")
        self.step, self.capacities, self.graphs, self.warmup = step, tuple(sorted(capacities)), graphs, warmup
        self.buckets: dict[int, _Bucket] = {}
        self.stopped: str | None = None  # why capture stopped (a failed capture)
        self.pool = None
        self.counts = {"captured_steps": 0, "padded_eager_steps": 0, "eager_steps": 0, "overflow_steps": 0,
                       "empty_steps": 0, "captures": 0}

    def capacity(self, n: int) -> int | None:
        """The smallest bucket holding n rows (None: n = 0 or above every bucket)."""
        return next((c for c in self.capacities if c >= n), None) if n > 0 else None

    def __call__(self, x: torch.Tensor, y: torch.Tensor | None) -> StepOutput:
        n = x.shape[0]
        cap = self.capacity(n)
        if cap is None or self.stopped:
            self.counts["eager_steps"] += 1
            if n == 0:
                self.counts["empty_steps"] += 1
            elif cap is None:
                self.counts["overflow_steps"] += 1
            return self.step(x, y)
        bucket = self.buckets.get(cap)
        if bucket is None:
            bucket = self.buckets[cap] = _Bucket(cap, x, y, self.step)
        bucket.load(x, y, n)
        if bucket.warm < self.warmup:
            bucket.warm += 1
            self.counts["padded_eager_steps"] += 1
            return _cut(self._side_stream(lambda: self._padded(bucket)), n)
        if not bucket.ready and not self._capture(bucket):
            self.counts["padded_eager_steps"] += 1
            return _cut(self._padded(bucket), n)
        bucket.noise.fill()
        self.counts["captured_steps"] += 1
        if self.graphs:
            bucket.graph.replay()
            return _cut(bucket.out, n)
        return _cut(self._padded(bucket, live=False), n)  # what a replay runs, eagerly (the CPU)

    def _padded(self, bucket: _Bucket, live: bool = True) -> StepOutput:
        """The step on the bucket's static buffers: padding rows masked out of the loss and
        the clipped sum, the noise from the bucket's ``StaticNoise``."""
        step, ctx = self.step, self.step.ctx
        loss_fn, noise = ctx.loss_fn, ctx.noise
        mask = bucket.mask

        def masked_loss(model, x, y):
            losses, correct = loss_fn(model, x, y)
            return torch.where(mask, losses, torch.zeros((), dtype=losses.dtype, device=losses.device)), correct

        bucket.noise.live, bucket.noise.calls = live, 0
        ctx.loss_fn, ctx.noise, step.sample_weights = masked_loss, bucket.noise, bucket.weights
        try:
            out = step(bucket.x, bucket.y)
        finally:
            ctx.loss_fn, ctx.noise, step.sample_weights = loss_fn, noise, None
        if live:
            bucket.noise.draws = bucket.noise.calls
        elif bucket.noise.calls != bucket.noise.draws:
            raise RuntimeError(f"the step drew noise {bucket.noise.calls} times, {bucket.noise.draws} times before")
        return out

    def _side_stream(self, fn: Callable[[], StepOutput]) -> StepOutput:
        """``fn()`` on a side stream on a GPU (warm-up before a capture, as torch.cuda.graphs asks)."""
        if not (self.graphs and self.step.params[0].is_cuda):
            return fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn()
            out = StepOutput(out.losses.clone(), None if out.correct is None else out.correct.clone(), out.stats)
        torch.cuda.current_stream().wait_stream(side)
        return out

    def _capture(self, bucket: _Bucket) -> bool:
        """Captures the bucket's step (without ``graphs``: only checks that it could be); False
        (and capture stopped for the run, with the reason) where that fails. Capturing runs no
        kernel: the step runs when the graph is replayed."""
        graph = out = None
        try:
            if (bucket.noise.draws or 0) > 1:
                raise RuntimeError(f"the step draws noise {bucket.noise.draws} times (one buffer per step)")
            if self.graphs:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self._padded(bucket, live=False)
            if out is not None and out.stats:
                raise RuntimeError(f"the step returns host-side statistics ({', '.join(out.stats)})")
        except Exception as exc:  # noqa: BLE001: any failure leaves the eager step, which is correct
            self.stopped = f"capture failed ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})"
            print(f"[cuda graphs] {self.stopped}; the eager step runs from now on", file=sys.stderr, flush=True)
            return False
        bucket.graph, bucket.out, bucket.ready = graph, out, True
        self.counts["captures"] += int(self.graphs)
        return True

    def record(self) -> dict:
        """What ran how, for the run's record."""
        return {"enabled": True, "graphs": self.graphs, "capacities": list(self.capacities),
                "stopped": self.stopped, **self.counts}


def _graph_device(device) -> bool:
    """Whether CUDA graphs can run on ``device`` (tests run the padded path on a CPU through this)."""
    return torch.device(device).type == "cuda"


def for_run(enabled: bool, step, problem, sampler, device: torch.device,
            log: Callable[[str], None] | None = None) -> tuple[Callable, Callable[[], dict | None]]:
    """(the callable a run steps with, a function giving what the run's record says about
    capture at its end): the step itself unless ``enabled`` (the run option ``cuda_graphs``),
    and also where the device is not a CUDA GPU or the step cannot be captured (``refusal``),
    which ``log`` is told (the record then holds the reason)."""
    if not enabled:
        return step, lambda: None
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not _graph_device(device):
        reason = f"device {device} is not a CUDA GPU (CUDA graphs need one)"
    else:
        reason = refusal(step, problem, sampler)
    if reason is not None:
        log(f"[cuda graphs] off: {reason}; the eager step runs")
        return step, lambda: {"enabled": False, "reason": reason}
    caps = capacities(sampler)
    log(f"[cuda graphs] on: batches padded to buckets of {', '.join(map(str, caps))} rows")
    captured = CapturedStep(step, caps, graphs=True)
    return captured, captured.record
