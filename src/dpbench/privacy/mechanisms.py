"""Privacy mechanisms: how a run's batches are drawn, where its noise comes from, and how its
sigma and epsilon are computed. An optimizer's spec names its mechanism; the training loop
only calls the interface below, so sampling, noise and accounting always belong together.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Protocol

import torch

from dpbench.privacy import accounting, profiles
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.sampling import PoissonSampler


@dataclass(frozen=True)
class AuditSpec:
    """How the empirical audit (dpbench.audit) attacks a mechanism: which test statistic is
    the most powerful for its release, under which neighbour relation its claim holds, and the
    canary. A mechanism carries one; an optimizer whose step changes the release (DP-Dice)
    overrides it in its spec. ``statistic`` names a statistic registered in
    dpbench.audit.statistics, which the audit checks when it starts: ``lr`` (likelihood ratio
    of the Poisson-subsampled Gaussian, per step), ``sum`` (sum of the releases),
    ``projected-lr`` (``lr`` on the release projected on P_k^T e_c), ``matrix`` (the releases
    whitened by C: the mechanism gives ``strategy_matrix(plan)`` and
    ``strategy_sensitivity(plan)``), ``banded-lr`` (``lr`` per round of the releases whitened
    by a banded C, cyclic Poisson sampling), or one a plugin registers."""

    statistic: str
    neighbours: str = "add/remove"  # or "zero-out"
    others_zero: bool = False  # the other examples' gradients are 0 (projections mix coordinates)
    canary_factor: float = 10.0  # M / C: the canary's gradient norm

    def __post_init__(self):
        if not (isinstance(self.statistic, str) and self.statistic):
            raise ValueError(f"an audit statistic is named by a non-empty string, got {self.statistic!r}")
        if self.neighbours not in ("add/remove", "zero-out"):
            raise ValueError(f"unknown neighbour relation {self.neighbours!r}")


@dataclass(frozen=True)
class Plan:
    """The privacy setting of one run, fixed before training starts and never changed after:
    ``extras`` (a mechanism's own constants) is a read-only copy of the mapping given. What a
    run fixes later (e.g. the parameter count d) reaches its privacy record through
    ``DPStep.privacy_record``."""

    batch_size: int  # L: expected (Poisson) or exact (fixed batches)
    steps: int  # planned T
    sample_rate: float | None  # q, where sampling amplifies privacy
    extras: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "extras", MappingProxyType(dict(self.extras)))


class Sampler(Protocol):
    def sample(self) -> torch.Tensor: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class NoiseSource(Protocol):
    """Unit-variance noise shaped like ``like``. A source may also define ``record() -> dict``:
    public facts it fixed while training (e.g. the noise file it read), for the run's privacy
    record (``DPStep.privacy_record``)."""

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

    def privacy_profile(self, plan: Plan, noise_multiplier: float, delta: float, accountant: str):
        """delta*(eps) for an array of eps: the claim the empirical audit tests (dpbench.audit)."""
        ...

    # and an ``audit`` attribute: an AuditSpec saying how the audit attacks the mechanism


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
    audit = AuditSpec("lr")

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

    def privacy_profile(self, plan: Plan, noise_multiplier: float, delta: float, accountant: str):
        """The claim at every epsilon at once, delta*(eps) (an upper bound, from the accountant
        the run uses), which the empirical audit tests: the PRV profile of the history, or
        the RDP one where this mechanism or the run accounts with RDP; plus delta_fail."""
        history = self.history(plan, noise_multiplier, plan.steps)
        fail = self.delta_fail(plan)
        if self.accountant == "rdp":
            return profiles.rdp_profile(history, delta_fail=fail)
        if accountant == "rdp":
            return profiles.rdp_profile(history, orders=accounting.RDP_ORDERS, delta_fail=fail)
        if accountant != "prv":
            raise ValueError(f"unknown accountant {accountant!r}; choose one of {accounting.ACCOUNTANTS}")
        return profiles.prv_profile(history, delta_fail=fail, accountant_delta=delta - fail)

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
