"""DP-SGD's mechanism: Poisson sampling at q = L/N, i.i.d. Gaussian noise (optionally on a
decaying schedule sigma_k = sigma * schedule(k)), sigma calibrated so that the composition of
the T subsampled Gaussian steps meets the target epsilon (PRV by default, RDP on request).
The random projection mechanism (projection.py) and the unamplified one (unamplified.py)
share its sampler and noise and change what is accounted.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Callable

from dpbench.mechanisms.base import AuditSpec, Plan, PlanRequest, PrivacyClaim, Spent, Target
from dpbench.privacy import accounting, profiles

if TYPE_CHECKING:  # annotations only: a mechanism is declared and accounted without torch (the workflow)
    from dpbench.mechanisms.noise import GaussianNoise
    from dpbench.mechanisms.sampling import PoissonSampler


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

    ``accountant`` (a registered ``accounting.Accountant``; None: the run's) is the one this
    mechanism always accounts with, whatever the run asks for: D2P2's ``accounting.RDP_INTEGER``
    (integer-order RDP, vectorised), as long decaying schedules are accounted as hundreds of
    segments, too slow for Opacus's accountants; the run's record names it (``Spent.accountant``;
    ``RDP_INTEGER``'s record says ``rdp``, as run files always have, with ``rdp_orders``)."""

    name = "poisson-subsampled-gaussian"
    audit = AuditSpec("lr")
    event_hyperparameters = ()  # the plan reads none of the optimizer's hyperparameters

    def __init__(self, schedule: Callable[[int], float] | None = None, schedule_name: str = "constant",
                 bucket_rel: float = 0.01, accountant: accounting.Accountant | None = None):
        self.schedule, self.schedule_name, self.bucket_rel = schedule, schedule_name, bucket_rel
        if accountant is not None and accounting.REGISTRY.get(getattr(accountant, "name", None)) is not accountant:
            # a name would be ambiguous here (D2P2's was once "rdp"): the registered object itself
            raise ValueError(f"accountant must be None (the run's) or a registered accounting.Accountant, "
                             f"got {accountant!r}")
        self.accountant = accountant

    def plan(self, request: PlanRequest) -> Plan:
        n_train, batch_size = request.n_train, request.batch_size
        if batch_size > n_train:
            raise ValueError(f"batch_size {batch_size} exceeds the number of training examples {n_train}")
        return Plan(batch_size, max(1, round(request.epochs * n_train / batch_size)), batch_size / n_train)

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

    def _accountant(self, claimed: accounting.Accountant) -> accounting.Accountant:
        """The accountant this mechanism accounts with: its own where it was built with one,
        else the one the run names."""
        return claimed if self.accountant is None else self.accountant

    def calibrate(self, plan: Plan, target: Target) -> float:
        delta = self._delta(plan, target.delta)
        return self._accountant(target.accountant).noise_multiplier(
            lambda s: self.history(plan, s, plan.steps), target.epsilon, delta)

    def privacy_profile(self, claim: PrivacyClaim):
        """The claim at every epsilon at once, delta*(eps) (an upper bound, from the accountant
        the run uses), which the empirical audit tests: the PRV profile of the history, or
        the RDP one where this mechanism or the run accounts with RDP; plus delta_fail."""
        plan = claim.plan
        history = self.history(plan, claim.noise_multiplier, plan.steps)
        fail = self.delta_fail(plan)
        return profiles.accounted_profile(self._accountant(claim.accountant), history, delta=claim.delta,
                                          delta_fail=fail)

    def report(self, claim: PrivacyClaim, steps: int) -> Spent:
        plan, sigma = claim.plan, claim.noise_multiplier
        acc_delta = self._delta(plan, claim.delta)
        accountant = self._accountant(claim.accountant)
        planned = accountant.epsilon(self.history(plan, sigma, plan.steps), acc_delta)
        history = self.history(plan, sigma, steps)
        done = planned if steps == plan.steps else accountant.epsilon(history, acc_delta)
        own = accountant is accounting.RDP_INTEGER  # D2P2's: its RDP cross-check at the same orders
        rdp = (accounting.RDP_INTEGER if own else accounting.RDP).epsilon(history, acc_delta)
        facts = {"noise_schedule": self.schedule_name}
        if own:
            facts["rdp_orders"] = ("integer orders 2-63, 80, 100, 128, 160, 200, 256, 512, 1024 "
                                   "(accounting.fast_rdp_epsilon)")
        if self.schedule is not None:
            facts["noise_schedule_segments"] = len(self.history(plan, sigma, plan.steps))
        if self.delta_fail(plan) > 0:
            facts["delta_fail"] = self.delta_fail(plan)
            facts["delta_accounted"] = acc_delta
        # the record's name of RDP_INTEGER stays the "rdp" run files have always written (with rdp_orders)
        return Spent(done, planned, rdp, facts, self.accountant, "rdp" if own else None)

    def sampler(self, plan: Plan, n_train: int, seed: int, device, lanes: int = 1) -> PoissonSampler:
        from dpbench.mechanisms.sampling import PoissonSampler  # torch: only where a run draws
        # each example is drawn independently: one sampler over all lanes' examples is already
        # `lanes` independent Poisson samplers
        return PoissonSampler(lanes * n_train, plan.sample_rate, seed, device)

    def noise(self, plan: Plan, seed: int, device) -> GaussianNoise:
        from dpbench.mechanisms.noise import GaussianNoise  # torch: only where a run draws
        return GaussianNoise(seed, device)


def inverse_sqrt_schedule(k: int) -> float:
    """sigma_k = sigma / sqrt(k) (D2P2-SGD's dynamic noise)."""
    return 1.0 / math.sqrt(k)
