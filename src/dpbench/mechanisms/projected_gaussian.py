"""D2P2's privacy mechanism (Jiang et al. 2025, arXiv:2509.09485): the Poisson-subsampled
Gaussian releasing P_k^T g + e_k with a fresh public random projection P_k each step. What is
released, the projections and their sensitivity bound s_P are projection.py's (its docstring);
here is what is planned and accounted, without torch (the workflow checks a search over it):
the projection's kind and whether the paper's sensitivity is used (``PLAN_HYPERPARAMETERS``),
the Gaussian projection's failure probability delta_fail and its tail t (``gaussian_tail``).
Its noise source is noise.ProjectionNoise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dpbench.mechanisms.base import AuditSpec, Plan, PlanRequest, PrivacyClaim, Spent
from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian

if TYPE_CHECKING:  # annotations only: a mechanism is declared and accounted without torch (the workflow)
    from dpbench.mechanisms.noise import ProjectionNoise

KINDS = ("srht", "gaussian")
# the hyperparameters the mechanism reads when it plans a run, with their defaults
PLAN_HYPERPARAMETERS = {"projection": "srht", "paper_sensitivity": False}
DELTA_FAIL_FRACTION = 0.1  # share of delta given to the Gaussian projection's norm bound failing

PAPER_SENSITIVITY_CAVEAT = (
    "not a valid DP guarantee: paper_sensitivity=true scales the noise for sensitivity 1/L as the "
    "D2P2 paper does, but the released vector P_k^T g has sensitivity ||P_k||_op / L (about "
    "(1 + sqrt(d/p)) / L for the Gaussian projection, sqrt(d'/p) / L for srht); the recorded "
    "epsilon does not hold for this run")


def gaussian_tail(steps: int, failure_probability: float) -> float:
    """t with steps * 2 exp(-t^2/2) = failure_probability: then ||A_k||_op <= sqrt(d) + sqrt(p) + t
    at every one of the steps except with probability failure_probability in all."""
    return math.sqrt(2.0 * math.log(2.0 * steps / failure_probability))


# -- the mechanism ---------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ProjectionPlan(Plan):
    """The Poisson-subsampled Gaussian's plan and the projection's public constants: which
    projection, whether the paper's (invalid) sensitivity is used, the probability that the
    Gaussian projection's norm bound fails over the run, and that bound's tail t (Gaussian
    projection only)."""

    projection: str  # one of KINDS
    paper_sensitivity: bool
    delta_fail: float
    tail_t: float | None = None


class RandomProjectionGaussian(PoissonSubsampledGaussian):
    """The Poisson-subsampled Gaussian mechanism releasing P_k^T g + e_k with a fresh public
    projection each step. The hyperparameters ``projection`` (srht | gaussian) and
    ``paper_sensitivity`` are read from the plan request: the Gaussian
    projection's bound fails with probability delta_fail = delta / 10 over the run and the
    accountant runs at delta - delta_fail; srht's bound always holds (delta_fail = 0);
    ``paper_sensitivity`` drops the bound, accounts at delta and marks the run invalid."""

    name = "poisson-subsampled-gaussian-random-projection"
    audit = AuditSpec("projected-lr", others_zero=True)  # P_k mixes coordinates: the others are 0
    event_hyperparameters = tuple(PLAN_HYPERPARAMETERS)  # delta_fail and the claim's validity

    def plan(self, request: PlanRequest) -> ProjectionPlan:
        base = super().plan(request)
        hyper = {**PLAN_HYPERPARAMETERS, **request.hyperparameters}
        kind, paper = hyper["projection"], hyper["paper_sensitivity"]
        if kind not in KINDS:
            raise ValueError(f"projection must be one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(paper, bool):
            raise ValueError(f"paper_sensitivity must be true or false, got {paper!r}")
        tail_t, delta_fail = None, 0.0
        if kind == "gaussian":
            tail_t = gaussian_tail(base.steps, DELTA_FAIL_FRACTION * request.delta)
            if not paper:
                delta_fail = base.steps * 2.0 * math.exp(-tail_t * tail_t / 2.0)
        return ProjectionPlan(base.batch_size, base.steps, base.sample_rate, projection=kind,
                              paper_sensitivity=paper, delta_fail=delta_fail, tail_t=tail_t)

    def delta_fail(self, plan: ProjectionPlan) -> float:
        return plan.delta_fail

    def report(self, claim: PrivacyClaim, steps: int) -> Spent:
        spent = super().report(claim, steps)
        plan = claim.plan
        facts = {**spent.facts, "projection": plan.projection}
        if plan.tail_t is not None:
            facts["projection_tail_t"] = plan.tail_t
        return replace(spent, facts=facts, caveat=PAPER_SENSITIVITY_CAVEAT if plan.paper_sensitivity else spent.caveat)

    def noise(self, plan: ProjectionPlan, seed: int, device) -> ProjectionNoise:
        from dpbench.mechanisms.noise import ProjectionNoise  # torch: only where a run draws

        return ProjectionNoise(seed, device, plan.projection, plan.tail_t, plan.paper_sensitivity)
