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
  tests/training/test_capture.py).
* **Noise outside the graph.** The step's noise source is swapped, while the step runs padded,
  for ``StaticNoise``: before each replay the real source draws (a seeded generator, a row of a
  memory-mapped noise file, a streamed recurrence) eagerly, as the eager step would, into
  static buffers that the graph reads. A graph therefore never freezes the noise, the noise
  stream is the eager step's draw for draw, and the source's state (checkpoints) stays its own.

Which steps are captured (``refusal`` says why not, and the run records it): ``DPStep`` and
``NonPrivateStep`` with the ``SGD`` rule exactly (dpsgd, sgd, the dense and streamed matrix
mechanisms), noise from the built-in sources, one lane, on a problem whose task declares that
its loss runs on fixed shapes (``Task.capture_refusal`` None: classification; the language model,
whose padded steps run the uncut batch, ``Task.fixed_shape_loss``, where its eager steps cut each
batch to its longest record, a host sync and a data-dependent shape). The others keep host-side
state that changes every step, which a graph would freeze: the Adam family's step count t in its
bias correction, DiSK's first step and direction, Dice's residual allocation, D2P2's projection
seed per step, Opacus's hooks; the VAE draws its latent noise from the run's loss generator per
step. They run eagerly, unchanged.

Capture: per bucket, ``WARMUP_STEPS`` throwaway padded steps run on a side stream (lazy
initialisation: cuBLAS handles, autograd's buffers), reading zero noise buffers (the noise source
is not drawn) and with the parameters put back bit for bit afterwards; then the step is captured,
and every real step of that bucket, the first included, is a replay (so a run resumed from a
checkpoint computes exactly what the uninterrupted run computed). All buckets' graphs share one
memory pool: replays are never concurrent (one stream) and each replay's outputs are copied out
before the next one. Numerics stay as configured (``dpbench.training.cuda``: no TF32,
deterministic kernels). A capture that fails (an operation that syncs with the host, a step that
returns host-side statistics) stops capture for the run with the reason, and the eager step runs
from then on.

On a CPU there are no graphs: ``CapturedStep(..., graphs=False)`` runs the same padded step on
the same static noise buffers eagerly (the tests compare it with the eager step there), and the
run option ``cuda_graphs`` is a no-op with a message (``for_run``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from dpbench import log
from dpbench.mechanisms.noise import BandedNoise, BLTNoise, CorrelatedNoise, GaussianNoise
from dpbench.mechanisms.sampling import CyclicPoissonSampler, FixedBatchSampler, PoissonSampler
from dpbench.optimizers.base import SGD, DPStep, NonPrivateStep, StepOutput

_LOG = log.get(__name__)

GRANULARITY = 64  # bucket sizes are multiples of this
OVERFLOW_PROBABILITY = 1e-6  # per step: a batch above the largest bucket (runs eagerly)
MAX_BUCKETS = 4  # graphs per run
WARMUP_STEPS = 3  # throwaway padded steps per bucket before its capture
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
    if step.ctx.piece_size is not None:  # a graph replays one pass of fixed shapes
        return f"it runs each batch in pieces of at most {step.ctx.piece_size} records (physical_batch_size)"
    # a subclass that keeps its built-in parent's sample (e.g. another row store) reads shapes only too
    if step.private and step.noise_std != 0 and \
            getattr(type(step.ctx.noise), "sample", None) not in {c.sample for c in SHAPE_ONLY_NOISE}:
        return f"its noise source {type(step.ctx.noise).__name__} is not one known to draw from shapes alone"
    if problem is not None:
        why = task_refusal(problem.task)
        if why is not None:
            return f"its problem's task ({problem.task.name}) {why}"
    if sampler is not None and capacities(sampler) is None:
        return f"its sampler {type(sampler).__name__} has batch sizes of unknown distribution"
    return None


def task_refusal(task) -> str | None:
    """Why a captured step cannot run ``task``'s loss (``Task.capture_refusal``, read from the
    task's own class: a class that does not declare it is refused), or None."""
    if "capture_refusal" not in type(task).__dict__:
        return (f"does not declare whether its loss runs on fixed shapes ({type(task).__name__}.capture_refusal, "
                "see dpbench.problems.tasks.Task)")
    return type(task).__dict__["capture_refusal"]


class StaticNoise:
    """The noise source a padded step sees: ``sample`` returns static buffers (what a graph
    reads), which ``fill`` loads from the run's real source before the step runs. ``draws``:
    how many times the step draws (0 without noise: sigma = 0), known after its first run."""

    def __init__(self, source, like: list[torch.Tensor]):
        self.source = source
        self.buffers = [torch.zeros_like(t) for t in like]
        self.calls = 0  # sample() calls of the step running now
        self.draws: int | None = None

    def sample(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        if [t.shape for t in like] != [b.shape for b in self.buffers]:
            raise ValueError("the step asked for noise of other shapes than its parameters'")
        self.calls += 1
        return self.buffers

    def fill(self) -> None:
        """The next step's noise, drawn eagerly by the real source (as the eager step would)."""
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
        self.ready = False  # warmed up and captured (without graphs: warmed up)
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
    padded, as the bucket's CUDA graph where ``graphs`` (else the same padded step, eagerly);
    any other batch runs the step itself. ``counts`` says how many steps ran which way:
    ``captured_steps`` padded (graph replays), ``eager_steps`` the step itself (empty batches,
    batches past the largest bucket, every step after a failed capture); ``warmup_steps`` are
    the throwaway steps before each capture, whose effect on the parameters is undone."""

    def __init__(self, step, capacities: tuple[int, ...], *, graphs: bool, warmup: int = WARMUP_STEPS,
                 loss_fn: Callable | None = None):
        reason = refusal(step)
        if reason is not None:
            raise ValueError(f"this step cannot be captured: {reason}")
        if warmup < 1:  # a throwaway step tells whether the step draws noise at all (sigma = 0)
            raise ValueError(f"warmup must be >= 1, got {warmup}")
        self.step, self.capacities, self.graphs, self.warmup = step, tuple(sorted(capacities)), graphs, warmup
        # the loss of padded steps (the task's fixed_shape_loss); eager steps keep the step's own
        self.loss_fn = loss_fn
        self.buckets: dict[int, _Bucket] = {}
        self.stopped: str | None = None  # why capture stopped (a failed capture)
        self.pool = None
        self.counts = {"captured_steps": 0, "eager_steps": 0, "overflow_steps": 0, "empty_steps": 0,
                       "warmup_steps": 0, "captures": 0}

    def capacity(self, n: int) -> int | None:
        """The smallest bucket holding n rows (None: n = 0 or above every bucket)."""
        return next((c for c in self.capacities if c >= n), None) if n > 0 else None

    def __call__(self, x: torch.Tensor, y: torch.Tensor | None) -> StepOutput:
        n = x.shape[0]
        cap = self.capacity(n)
        if cap is not None and not self.stopped:
            bucket = self.buckets.get(cap)
            if bucket is None:
                bucket = self.buckets[cap] = _Bucket(cap, x, y, self.step)
            bucket.load(x, y, n)
            if bucket.ready or self._prepare(bucket):
                bucket.noise.fill()
                self.counts["captured_steps"] += 1
                if not self.graphs:
                    return _cut(self._padded(bucket), n)  # what a replay runs, eagerly (the CPU)
                bucket.graph.replay()
                return _cut(bucket.out, n)
        self.counts["eager_steps"] += 1
        self.counts["empty_steps"] += n == 0
        self.counts["overflow_steps"] += n > 0 and cap is None
        return self.step(x, y)

    def _padded(self, bucket: _Bucket) -> StepOutput:
        """The step on the bucket's static buffers: padding rows masked out of the loss and
        the clipped sum, the noise from the bucket's ``StaticNoise``."""
        step, ctx = self.step, self.step.ctx
        loss_fn, noise = ctx.loss_fn, ctx.noise
        padded_loss = self.loss_fn or loss_fn
        mask = bucket.mask

        def masked_loss(model, x, y):
            losses, correct = padded_loss(model, x, y)
            return torch.where(mask, losses, torch.zeros((), dtype=losses.dtype, device=losses.device)), correct

        bucket.noise.calls = 0
        ctx.loss_fn, ctx.noise, step.sample_weights = masked_loss, bucket.noise, bucket.weights
        try:
            out = step(bucket.x, bucket.y)
        finally:
            ctx.loss_fn, ctx.noise, step.sample_weights = loss_fn, noise, None
        if bucket.noise.draws is None:
            bucket.noise.draws = bucket.noise.calls
        elif bucket.noise.calls != bucket.noise.draws:
            raise RuntimeError(f"the step drew noise {bucket.noise.calls} times, {bucket.noise.draws} times before")
        if out.stats:
            raise RuntimeError(f"the step returns host-side statistics ({', '.join(out.stats)})")
        return out

    def _warm_up(self, bucket: _Bucket) -> None:
        """``warmup`` throwaway padded steps on the loaded batch, on a side stream on a GPU (lazy
        initialisation before a capture, as torch.cuda.graphs asks); the parameters are put
        back bit for bit, and the noise source is not drawn (the steps read zero buffers), so
        every real step of the bucket is a replay."""
        params = self.step.params
        with torch.no_grad():
            saved = [p.detach().clone() for p in params]
        side = torch.cuda.Stream() if self.graphs else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            try:
                for _ in range(self.warmup):
                    self._padded(bucket)
                    self.counts["warmup_steps"] += 1
            finally:
                with torch.no_grad():
                    torch._foreach_copy_(params, saved)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)

    def _prepare(self, bucket: _Bucket) -> bool:
        """Warms the bucket up and captures its step (without ``graphs``: warms up only); False
        (and capture stopped for the run, with the reason) where that fails. Capturing runs no
        kernel: the step runs when the graph is replayed."""
        try:
            self._warm_up(bucket)
            if (bucket.noise.draws or 0) > 1:
                raise RuntimeError(f"the step draws noise {bucket.noise.draws} times (one buffer per step)")
            if self.graphs:
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                bucket.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(bucket.graph, pool=self.pool):
                    bucket.out = self._padded(bucket)
                self.counts["captures"] += 1
        except Exception as exc:  # noqa: BLE001: any failure leaves the eager step, which is correct
            self.stopped = f"capture failed ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})"
            _LOG.warning(f"[cuda graphs] {self.stopped}; the eager step runs from now on")
            bucket.graph = bucket.out = None
            return False
        bucket.ready = True
        return True

    def record(self) -> dict:
        """What ran how, for the run's record."""
        return {"enabled": True, "graphs": self.graphs, "capacities": list(self.capacities),
                "stopped": self.stopped, **self.counts}


def _graph_device(device) -> bool:
    """Whether CUDA graphs can run on ``device`` (tests run the padded path on a CPU through this)."""
    return torch.device(device).type == "cuda"


def for_run(enabled: bool, step, problem, sampler, device: torch.device,
            log: Callable[[str], None] | None = None, loss_fn: Callable | None = None,
            ) -> tuple[Callable, Callable[[], dict | None]]:
    """(the callable a run steps with, a function giving what the run's record says about
    capture at its end): the step itself unless ``enabled`` (the run option ``cuda_graphs``),
    and also where the device is not a CUDA GPU or the step cannot be captured (``refusal``),
    which ``log`` is told (the record then holds the reason). ``loss_fn``: the loss padded
    steps run (the task's ``fixed_shape_loss`` with the run's loss generator), else the step's."""
    if not enabled:
        return step, lambda: None
    log = log or _LOG.info
    if not _graph_device(device):
        reason = f"device {device} is not a CUDA GPU (CUDA graphs need one)"
    else:
        reason = refusal(step, problem, sampler)
    if reason is not None:
        log(f"[cuda graphs] off: {reason}; the eager step runs")
        return step, lambda: {"enabled": False, "reason": reason}
    caps = capacities(sampler)
    log(f"[cuda graphs] on: batches padded to buckets of {', '.join(map(str, caps))} rows")
    captured = CapturedStep(step, caps, graphs=True, loss_fn=loss_fn)
    return captured, captured.record
