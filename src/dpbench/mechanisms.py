"""Privacy mechanisms: how a run's batches are drawn, where its noise comes from, and how its
sigma and epsilon are computed. An optimizer's spec names its mechanism; the training loop
only calls the interface below, so sampling, noise and accounting always belong together.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from dpbench import accounting
from dpbench.noise import GaussianNoise
from dpbench.sampling import PoissonSampler


@dataclass(frozen=True)
class Plan:
    """The privacy setting of one run, fixed before training starts."""

    batch_size: int  # L: expected (Poisson) or exact (fixed batches)
    steps: int  # planned T
    sample_rate: float | None  # q, where sampling amplifies privacy
    extras: dict[str, Any] = field(default_factory=dict)


class Sampler(Protocol):
    def sample(self) -> torch.Tensor: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class NoiseSource(Protocol):
    def sample(self, like: list[torch.Tensor]) -> list[torch.Tensor]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class Mechanism(Protocol):
    name: str

    def plan(self, n_train: int, batch_size: int, epochs: int, run_config: Any) -> Plan: ...

    def calibrate(self, plan: Plan, target_epsilon: float, delta: float, accountant: str) -> float: ...

    def report(self, plan: Plan, noise_multiplier: float, steps: int, delta: float, accountant: str) -> dict: ...

    def sampler(self, plan: Plan, n_train: int, seed: int, device, lanes: int = 1) -> Sampler:
        """Batches as indices into ``lanes`` blocks of ``n_train`` examples (lane-major), each
        lane drawn as an independent sampler would draw it (see ``Context.lanes``)."""
        ...

    def noise(self, plan: Plan, seed: int, device) -> NoiseSource: ...


def geometric_buckets(steps: int, factor: Callable[[int], float], rel: float = 0.01) -> list[tuple[float, int]]:
    """Group steps 1..T into runs where the noise factor varies by at most ``rel``; each run is
    (smallest factor in it, length). Accounting a run at its smallest noise is an upper bound:
    a Gaussian mechanism with more noise is a post-processing of one with less."""
    buckets: list[tuple[float, int]] = []
    k = 1
    while k <= steps:
        start_f = factor(k)
        end = k
        lo = start_f
        while end + 1 <= steps and abs(factor(end + 1) - start_f) <= rel * start_f:
            end += 1
            lo = min(lo, factor(end))
        buckets.append((lo, end - k + 1))
        k = end + 1
    return buckets


@functools.lru_cache(maxsize=32)
def _cached_buckets(steps: int, factor: Callable[[int], float], rel: float) -> list[tuple[float, int]]:
    return geometric_buckets(steps, factor, rel)


class PoissonSubsampledGaussian:
    """Poisson sampling at q = L/N for T = round(E N / L) steps, i.i.d. Gaussian noise with
    multiplier sigma * schedule(k) at step k (schedule = 1 unless an optimizer decays it), and
    sigma calibrated so that the composition meets the target epsilon (PRV by default).

    ``accountant="rdp"`` makes this mechanism always use ``accounting.fast_rdp_epsilon``
    (integer-order RDP, vectorised) whatever the run asks for: long decaying schedules are
    accounted as hundreds of segments, too slow for Opacus's accountants; the run records
    which accountant was used."""

    name = "poisson-subsampled-gaussian"

    def __init__(self, schedule: Callable[[int], float] | None = None, schedule_name: str = "constant",
                 bucket_rel: float = 0.01, accountant: str | None = None):
        self.schedule, self.schedule_name, self.bucket_rel = schedule, schedule_name, bucket_rel
        if accountant not in (None, "rdp"):
            raise ValueError(f"accountant must be None (the run's) or 'rdp', got {accountant!r}")
        self.accountant = accountant

    def plan(self, n_train: int, batch_size: int, epochs: int, run_config: Any = None) -> Plan:
        if batch_size > n_train:
            raise ValueError(f"batch_size {batch_size} exceeds the number of training examples {n_train}")
        return Plan(batch_size, max(1, round(epochs * n_train / batch_size)), batch_size / n_train)

    def history(self, plan: Plan, noise_multiplier: float, steps: int) -> accounting.History:
        if self.schedule is None:
            return [(noise_multiplier, plan.sample_rate, steps)]
        return [(noise_multiplier * f, plan.sample_rate, n) for f, n in self._buckets(steps)]

    def _buckets(self, steps: int) -> list[tuple[float, int]]:
        # the bucketing does not depend on sigma: computed once, not at every bisection step
        return _cached_buckets(steps, self.schedule, self.bucket_rel)

    def delta_fail(self, plan: Plan) -> float:
        """Probability that the mechanism's sensitivity bound fails (0 here); it is taken out
        of delta before accounting: the run is (epsilon, delta)-DP with the accountant run at
        delta - delta_fail."""
        return 0.0

    def _delta(self, plan: Plan, delta: float) -> float:
        fail = self.delta_fail(plan)
        if not fail < delta:
            raise ValueError(f"the sensitivity bound's failure probability {fail:g} is not below delta {delta:g}")
        return delta - fail

    def _epsilon(self, history: accounting.History, delta: float, accountant: str) -> float:
        if self.accountant == "rdp":
            return accounting.fast_rdp_epsilon(history, delta)
        return accounting.epsilon(history, delta, accountant)

    def calibrate(self, plan: Plan, target_epsilon: float, delta: float, accountant: str) -> float:
        accounting.check_target(target_epsilon, delta)
        delta = self._delta(plan, delta)
        return accounting.calibrate(
            lambda s: self._epsilon(self.history(plan, s, plan.steps), delta, accountant), target_epsilon)

    def report(self, plan: Plan, noise_multiplier: float, steps: int, delta: float, accountant: str) -> dict:
        acc_delta = self._delta(plan, delta)
        planned = self._epsilon(self.history(plan, noise_multiplier, plan.steps), acc_delta, accountant)
        done = planned if steps == plan.steps else self._epsilon(
            self.history(plan, noise_multiplier, steps), acc_delta, accountant)
        history = self.history(plan, noise_multiplier, steps)
        rdp = (accounting.fast_rdp_epsilon(history, acc_delta) if self.accountant == "rdp"
               else accounting.epsilon(history, acc_delta, "rdp"))
        out = {"epsilon": done, "epsilon_planned": planned, "epsilon_rdp": rdp,
               "noise_schedule": self.schedule_name}
        if self.accountant == "rdp":
            out["accountant"] = "rdp"
            out["rdp_orders"] = ("integer orders 2-63, 80, 100, 128, 160, 200, 256, 512, 1024 "
                                 "(accounting.fast_rdp_epsilon)")
        if self.schedule is not None:
            out["noise_schedule_segments"] = len(self.history(plan, noise_multiplier, plan.steps))
        if self.delta_fail(plan) > 0:
            out["delta_fail"] = self.delta_fail(plan)
            out["delta_accounted"] = acc_delta
        return out

    def sampler(self, plan: Plan, n_train: int, seed: int, device, lanes: int = 1) -> PoissonSampler:
        # each example is drawn independently: one sampler over all lanes' examples is already
        # `lanes` independent Poisson samplers
        return PoissonSampler(lanes * n_train, plan.sample_rate, seed, device)

    def noise(self, plan: Plan, seed: int, device) -> GaussianNoise:
        return GaussianNoise(seed, device)


def inverse_sqrt_schedule(k: int) -> float:
    """sigma_k = sigma / sqrt(k) (D2P2-SGD's dynamic noise)."""
    return 1.0 / math.sqrt(k)


# -- random projection (D2P2-SGD, DP2-SGD) --------------------------------------------------

DELTA_FAIL_FRACTION = 0.1  # share of delta given to the projection's norm bound failing

PAPER_SENSITIVITY_CAVEAT = (
    "not a valid DP guarantee: paper_sensitivity=true scales the noise for sensitivity 1/L as the "
    "D2P2 paper does, but the released vector P_k^T g has sensitivity ||P_k||_op / L, about "
    "(1 + sqrt(d/p)) / L; the recorded epsilon does not hold for this run")


def projection_tail(steps: int, failure_probability: float) -> float:
    """t with steps * 2 exp(-t^2/2) = failure_probability: a d x p matrix A of i.i.d. N(0, 1)
    has ||A||_op <= sqrt(d) + sqrt(p) + t except with probability 2 exp(-t^2/2) (Vershynin 2012,
    Cor. 5.35), so with P = A / sqrt(p), ||P||_op <= 1 + sqrt(d/p) + t/sqrt(p) at every one of
    the steps except with probability failure_probability in all."""
    return math.sqrt(2.0 * math.log(2.0 * steps / failure_probability))


def projection_sensitivity_factor(dimension: int, projection_dim: int, tail_t: float) -> float:
    """s = 1 + sqrt(d/p) + t/sqrt(p): the bound on ||P_k||_op, P_k = A_k / sqrt(p)."""
    return 1.0 + math.sqrt(dimension / projection_dim) + tail_t / math.sqrt(projection_dim)


class ProjectionNoise(GaussianNoise):
    """I.i.d. noise plus the public constants of the random projection fixed by the plan: the
    tail parameter t of the operator-norm bound and whether the paper's (invalid) setting is
    on. The step reports the projection it builds (d, p, s) back into the plan, so that the
    run's privacy record has it."""

    def __init__(self, seed: int, device, plan: Plan):
        super().__init__(seed, device)
        self.plan = plan
        self.tail_t = plan.extras["tail_t"]
        self.paper_sensitivity = plan.extras["paper_sensitivity"]

    def record(self, **values) -> None:
        self.plan.extras.setdefault("projection", {}).update(values)


class RandomProjectionGaussian(PoissonSubsampledGaussian):
    """The Poisson-subsampled Gaussian mechanism releasing P_k^T g + e_k with a fresh public
    Gaussian projection P_k = A_k / sqrt(p) each step (D2P2-SGD, seed 001). The release's
    sensitivity is ||P_k||_op / L; the step scales its noise by the bound s (see
    ``projection_tail``), which fails with probability delta_fail = delta / 10 over the run,
    and the accountant runs at delta - delta_fail.

    The hyperparameter ``paper_sensitivity`` (read from the run's config) turns the bound off,
    as in the paper; such runs are accounted at delta and marked "not a valid DP guarantee"."""

    name = "poisson-subsampled-gaussian-random-projection"

    def plan(self, n_train: int, batch_size: int, epochs: int, run_config: Any = None) -> Plan:
        base = super().plan(n_train, batch_size, epochs, run_config)
        delta = getattr(run_config, "delta", accounting.DELTA)
        paper = (getattr(run_config, "hyperparameters", None) or {}).get("paper_sensitivity", False)
        if not isinstance(paper, bool):
            raise ValueError(f"paper_sensitivity must be true or false, got {paper!r}")
        t = projection_tail(base.steps, DELTA_FAIL_FRACTION * delta)
        fail = 0.0 if paper else base.steps * 2.0 * math.exp(-t * t / 2.0)
        return Plan(base.batch_size, base.steps, base.sample_rate,
                    {"tail_t": t, "delta_fail": fail, "paper_sensitivity": paper})

    def delta_fail(self, plan: Plan) -> float:
        return plan.extras["delta_fail"]

    def report(self, plan: Plan, noise_multiplier: float, steps: int, delta: float, accountant: str) -> dict:
        out = super().report(plan, noise_multiplier, steps, delta, accountant)
        out["projection_tail_t"] = plan.extras["tail_t"]
        out.update(plan.extras.get("projection", {}))
        if plan.extras["paper_sensitivity"]:
            out["caveat"] = PAPER_SENSITIVITY_CAVEAT
        return out

    def noise(self, plan: Plan, seed: int, device) -> ProjectionNoise:
        return ProjectionNoise(seed, device, plan)
