"""A candidate of a hyperparameter search: its noise multiplier, calibrated so that the *whole
search* meets the run's target (epsilon, delta), and the record of the search it belongs to.

A grid block with ``tuning`` (dpbench.pipeline.grid) expands into candidate runs, each told the
search's distribution, its mean and shape, the number of candidates K drawn and its own index
(``RunConfig.tuning``). The candidate's mechanism gives the history its accountant composes:
DP-SGD's family and amplified BandMF their Poisson-subsampled Gaussian steps, a matrix
mechanism one Gaussian release of sensitivity sens(C) (history [(sigma / sens, 1, 1)]). Other
mechanisms have no such event, and a search over them is refused. The accounting itself is
dpbench.privacy.tuning.
"""

from __future__ import annotations

from typing import Any, Callable

from dpbench.mechanisms.base import Plan
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.privacy import accounting
from dpbench.privacy.tuning import Tuning, candidate_noise_multiplier, procedure_epsilon

SOURCE_TUNED = "calibrated for the whole search"


def search(tuning: dict[str, Any]) -> Tuning:
    """The ``Tuning`` of a run's ``tuning`` setting (its distribution, mean and shape)."""
    return Tuning(tuning["distribution"], float(tuning["mean"]), float(tuning.get("shape") or 1.0))


def candidate_history(spec: OptimizerSpec, plan: Plan) -> tuple[Callable[[float], accounting.History], float]:
    """(sigma -> the history one candidate's mechanism accounts, delta_fail: the share of delta
    its sensitivity bound may fail with, accounted apart)."""
    mechanism = spec.mechanism
    if spec.caveat:
        raise ValueError(f"optimizer {spec.name!r} has no valid privacy claim ({spec.caveat}): a search over it "
                         "cannot be made private")
    if hasattr(mechanism, "history"):  # Poisson-subsampled Gaussian steps (DP-SGD's family, amplified BandMF)
        fail = mechanism.delta_fail(plan) if hasattr(mechanism, "delta_fail") else 0.0
        return (lambda sigma: mechanism.history(plan, sigma, plan.steps)), fail
    if hasattr(mechanism, "strategy_sensitivity"):  # one Gaussian release C G + sigma s Z
        sensitivity = float(mechanism.strategy_sensitivity(plan))
        return (lambda sigma: [(sigma / sensitivity, 1.0, 1)]), 0.0
    raise ValueError(f"optimizer {spec.name!r}: private tuning accounts Poisson-subsampled Gaussian steps or one "
                     f"Gaussian release, and mechanism {mechanism.name!r} is neither")


def noise_multiplier(spec: OptimizerSpec, plan: Plan, tuning: dict[str, Any], target_epsilon: float,
                     delta: float, accountant: str) -> float:
    """The smallest candidate sigma with which the search is (target_epsilon, delta)-DP."""
    history_of, fail = candidate_history(spec, plan)
    if not fail < delta:
        raise ValueError(f"the sensitivity bound's failure probability {fail:g} is not below delta {delta:g}")
    return candidate_noise_multiplier(history_of, search(tuning), target_epsilon, delta - fail, accountant)


def record(spec: OptimizerSpec, plan: Plan, tuning: dict[str, Any], sigma: float, delta: float,
           accountant: str) -> dict[str, Any]:
    """What a candidate's run file says of its search: the distribution, mean and shape, K and
    this candidate's index, and the (epsilon, delta) of the whole search at this sigma."""
    history_of, fail = candidate_history(spec, plan)
    how = search(tuning)
    total = procedure_epsilon(history_of(sigma), how, delta - fail, accountant)
    return {**how.record(), "repetitions": int(tuning["repetitions"]), "candidate": int(tuning["candidate"]),
            "epsilon": total, "delta": delta,
            "accountant": (f"{accountant} (k runs composed)" if how.distribution == "composition"
                           else "rdp (dp_accounting RepeatAndSelectDpEvent, Papernot & Steinke 2022)")}
