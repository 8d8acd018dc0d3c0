"""A candidate of a hyperparameter search: its noise multiplier, calibrated so that the *whole
search* meets the run's target (epsilon, delta), and the record of the search it belongs to.

A grid block with ``tuning`` (dpbench.pipeline.grid) expands into candidate runs, each told the
search's distribution, its mean and shape, the number of candidates K drawn and its own index
(``RunConfig.tuning``). The candidate's mechanism gives the history its accountant composes:
DP-SGD's family and amplified BandMF their Poisson-subsampled Gaussian steps, a matrix
mechanism one Gaussian release of sensitivity sens(C) (history [(sigma / sens, 1, 1)]). Other
mechanisms have no such event, and a search over them is refused: among them a mechanism that
inherits a history but accounts itself otherwise (dpdice-strict's unamplified composition).
Papernot & Steinke bound the search of a base algorithm "draw a setting, train with it", whose
RDP is at most the pointwise maximum of the settings' curves; each candidate is calibrated on
its own curve, so every setting of a search must give the same accounted event: a search whose
settings differ in a hyperparameter the mechanism plans with (``bands``, ``buffers``, ``tau``,
D2P2's ``projection``) is refused (``shared_event_refusal``).
``check_search`` holds every refusal, for the config check (dpbench.pipeline.searches) and for
a run (``RunConfig.validate``) alike, in the same words; and a search's epsilon is never below
its candidate's own (``check_not_below_candidate``). The accounting itself is
dpbench.privacy.tuning.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from dpbench.mechanisms.base import Plan, PrivacyClaim, Target
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.privacy import accounting
from dpbench.privacy.tuning import Candidate, Tuning, candidate_noise_multiplier, procedure_epsilon

SOURCE_TUNED = "calibrated for the whole search"


def search(tuning: Mapping[str, Any]) -> Tuning:
    """The ``Tuning`` of a run's ``tuning`` setting (its distribution, mean and shape: ``Candidate``)."""
    return Candidate.parse(tuning).search


def _owner(mechanism, name: str):
    """The class of the mechanism's MRO that defines ``name`` (None: none does)."""
    return next((c for c in type(mechanism).__mro__ if name in vars(c)), None)


def search_refusal(spec: OptimizerSpec) -> str | None:
    """Why a search over this optimizer cannot be accounted, None where it can: it must be
    private with a valid claim, and its mechanism accounted as the event its history (or its one
    Gaussian release) describes: the class that defines ``history`` (or ``strategy_sensitivity``)
    also calibrates the mechanism and gives its privacy profile, so that a subclass accounting
    itself otherwise (dpdice-strict: T Gaussian releases without amplification, on DP-SGD's
    Poisson batches) is not accounted as its parent."""
    if not spec.private:
        return f"optimizer {spec.name!r} is not private: there is no search privacy to account"
    if spec.caveat:
        return f"optimizer {spec.name!r} has no valid privacy claim ({spec.caveat}): a search over it cannot be made private"
    mechanism = spec.mechanism
    for event in ("history", "strategy_sensitivity"):
        defined = _owner(mechanism, event)
        if defined is not None and all(_owner(mechanism, m) is defined for m in ("calibrate", "privacy_profile")):
            return None
    return (f"optimizer {spec.name!r}: private tuning accounts Poisson-subsampled Gaussian steps or one Gaussian "
            f"release, and mechanism {mechanism.name!r} accounts itself otherwise")


def event_hyperparameters(mechanism) -> tuple[str, ...] | None:
    """The hyperparameters that change the mechanism's accounted event, as its class declares
    them (``event_hyperparameters``); None where it declares none: no class does, or the one
    that does sits above the class that plans (``plan``, ``key``: where the request's
    hyperparameters are read), so that a subclass planning otherwise is not taken at its
    parent's word."""
    declared = _owner(mechanism, "event_hyperparameters")
    if declared is None:
        return None
    planners = [c for c in (_owner(mechanism, m) for m in ("plan", "key")) if c is not None]
    if not all(issubclass(declared, c) for c in planners):
        return None
    return tuple(mechanism.event_hyperparameters)


def shared_event_refusal(spec: OptimizerSpec, settings: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the settings of one search (each its hyperparameters; the learning rate is no
    mechanism's) would not share one accounted event, None where they do. The search's bound
    (Papernot & Steinke 2022) holds for the pointwise maximum of the settings' RDP curves, and
    each candidate is calibrated on its own: settings that differ in a hyperparameter the
    mechanism plans with (``event_hyperparameters``; every one where it declares none) are
    refused, naming the first."""
    full = [spec.hyperparameters(dict(s)) for s in settings]
    differ = sorted(k for k in spec.defaults if any(f[k] != full[0][k] for f in full[1:]))
    read = event_hyperparameters(spec.mechanism)
    changes = [k for k in differ if read is None or k in read]
    if not changes:
        return None
    advice = "candidates must share one: sweep it across separate searches"
    if read is None:
        return (f"hyperparameter {changes[0]!r} may change the accounted privacy event: mechanism "
                f"{spec.mechanism.name!r} does not declare the hyperparameters it reads (event_hyperparameters), "
                f"and {advice}")
    return f"hyperparameter {changes[0]!r} changes the accounted privacy event ({advice})"


def check_search(tuning: dict[str, Any], spec: OptimizerSpec, validation_size: int,
                 settings: Sequence[Mapping[str, Any]] = ()) -> Tuning:
    """Every refusal of a search, one place for the config check (a grid block's ``tuning``,
    where the candidates are not drawn yet: no ``repetitions``) and a run (``--tuning``): the
    keys, the distribution, mean and shape (``Tuning``: shape only for negative_binomial, the
    bounds on the mean), a composition's k, the candidate's index, the validation split the
    release is chosen on, the optimizer (``search_refusal``) and the settings searched, each
    its hyperparameters (``shared_event_refusal``). Only the config check sees the settings: a
    run is one candidate and cannot see the others, so a search whose settings do not share one
    event is refused where the grid block is checked. Returns the ``Tuning``; raises ValueError
    with the reason."""
    how = Candidate.parse(tuning).search  # the keys, the search, K and j (dpbench.privacy.tuning.Candidate)
    if not validation_size:
        raise ValueError("a search releases the candidate best on the validation split, and there is none "
                         "(validation_size is 0)")
    refusal = search_refusal(spec) or shared_event_refusal(spec, settings)
    if refusal:
        raise ValueError(refusal)
    return how


def candidate_history(spec: OptimizerSpec, plan: Plan) -> tuple[Callable[[float], accounting.History], float]:
    """(sigma -> the history one candidate's mechanism accounts, delta_fail: the share of delta
    its sensitivity bound may fail with, accounted apart)."""
    mechanism = spec.mechanism
    refusal = search_refusal(spec)
    if refusal:
        raise ValueError(refusal)
    if hasattr(mechanism, "history"):  # Poisson-subsampled Gaussian steps (DP-SGD's family, amplified BandMF)
        fail = mechanism.delta_fail(plan) if hasattr(mechanism, "delta_fail") else 0.0
        return (lambda sigma: mechanism.history(plan, sigma, plan.steps)), fail
    if hasattr(mechanism, "strategy_sensitivity"):  # one Gaussian release C G + sigma s Z
        sensitivity = float(mechanism.strategy_sensitivity(plan))
        return (lambda sigma: [(sigma / sensitivity, 1.0, 1)]), 0.0
    raise ValueError(f"optimizer {spec.name!r}: private tuning accounts Poisson-subsampled Gaussian steps or one "
                     f"Gaussian release, and mechanism {mechanism.name!r} is neither")


def _accounted_delta(fail: float, delta: float) -> float:
    if not fail < delta:
        raise ValueError(f"the sensitivity bound's failure probability {fail:g} is not below delta {delta:g}")
    return delta - fail


def calibrate_search(spec: OptimizerSpec, plan: Plan, tuning: dict[str, Any], target: Target) -> float:
    """The smallest candidate sigma with which the search is (target epsilon, delta)-DP, by the
    target's accountant (``dpbench.training.calibration.calibrate`` asks it for a candidate)."""
    history_of, fail = candidate_history(spec, plan)
    sigma = candidate_noise_multiplier(history_of, search(tuning), target.epsilon, _accounted_delta(fail, target.delta),
                                       target.accountant.name)
    search_epsilon(spec, PrivacyClaim(spec.mechanism, plan, sigma, target.delta, target.accountant), tuning)
    return sigma


def search_epsilon(spec: OptimizerSpec, claim: PrivacyClaim, tuning: dict[str, Any]) -> float:
    """The epsilon of the whole search at the candidate's claim (its sigma, delta, accountant),
    never below the candidate's own (``check_not_below_candidate``)."""
    history_of, fail = candidate_history(spec, claim.plan)
    total = procedure_epsilon(history_of(claim.noise_multiplier), search(tuning), _accounted_delta(fail, claim.delta),
                              claim.accountant.name)
    check_not_below_candidate(spec, claim, total)
    return total


def check_not_below_candidate(spec: OptimizerSpec, claim: PrivacyClaim, total: float) -> None:
    """A search can never cost less than one of its runs: its epsilon ``total`` is refused where
    it is below the candidate's own planned epsilon by its claim (the two are one accountant's
    numbers for k = 1, equal up to rounding; above for any search)."""
    own = float(claim.spent().epsilon_planned)
    if total < own * (1 - 1e-9):
        raise ValueError(f"optimizer {spec.name!r}: the search's epsilon {total:.6g} is below its candidate's own "
                         f"{own:.6g}: the search accounting does not describe mechanism {spec.mechanism.name!r}")


def record(spec: OptimizerSpec, claim: PrivacyClaim, tuning: dict[str, Any]) -> dict[str, Any]:
    """What a candidate's run file says of its search: the distribution, mean and shape, K and
    this candidate's index, and the (epsilon, delta) of the whole search at this sigma."""
    candidate = Candidate.parse(tuning, drawn=True)
    how = candidate.search
    return {**how.record(), "repetitions": candidate.repetitions, "candidate": candidate.candidate,
            "epsilon": search_epsilon(spec, claim, tuning), "delta": claim.delta,
            "accountant": (f"{claim.accountant.name} (k runs composed)" if how.distribution == "composition"
                           else "rdp (dp_accounting RepeatAndSelectDpEvent, Papernot & Steinke 2022)")}
