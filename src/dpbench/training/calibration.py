"""A run's privacy claim: what it asks of its mechanism (``plan_request``) and its calibrated
claim (``calibrate``: sigma, where it came from and how long finding it took), the one place a
run, a search's candidate and the empirical audit get sigma from; and the run file's privacy
section (``PrivacySection``: the claim's record, the private step's, the search's)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from dpbench.mechanisms.base import (SOURCE_CALIBRATED, SOURCE_GIVEN, SOURCE_NON_PRIVATE, ClaimRecord, Plan,
                                     PlanRequest, PrivacyClaim, Target)
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.privacy import accounting
from dpbench.training.config import RunConfig


def plan_request(cfg: RunConfig, n_train: int) -> PlanRequest:
    """What the run asks of its mechanism, its files resolved: the given factorization and noise
    file, the cache directory (the default one unless given)."""
    return PlanRequest(n_train, cfg.batch_size, cfg.epochs, hyperparameters=cfg.hyperparameters,
                       target_epsilon=cfg.epsilon, delta=cfg.delta, cache_dir=cfg.cache_dir,
                       factorization=cfg.factorization, noise_file=cfg.noise_file)


def calibrate(spec: OptimizerSpec, plan: Plan, *, target_epsilon: float | None, noise_multiplier: float | None,
              delta: float, accountant: str | accounting.Accountant,
              tuning: dict[str, Any] | None = None) -> PrivacyClaim:
    """The privacy claim of a run of ``spec`` with ``plan``, timed. sigma is 0 for a non-private
    optimizer; ``noise_multiplier`` as given (the claim is then what the accountant reports for
    it, held to ``target_epsilon`` where one is given too); for a candidate of a private search
    (``tuning``: ``RunConfig.tuning``) the smallest sigma with which the *whole search* meets
    (target_epsilon, delta) (``dpbench.training.tuning``); otherwise the smallest sigma whose
    accounted epsilon for ``plan`` is at most ``target_epsilon`` (``Mechanism.calibrate``: PRV or
    RDP composition of the subsampled Gaussian, or one exact Gaussian release for the matrix
    mechanisms)."""
    t0 = time.perf_counter()
    accountant = accounting.get_accountant(accountant)
    if not spec.private:
        sigma, source = 0.0, SOURCE_NON_PRIVATE
    elif noise_multiplier is not None:
        sigma, source = float(noise_multiplier), SOURCE_GIVEN
    elif target_epsilon is None:
        raise ValueError(f"optimizer {spec.name!r} is private: give a target epsilon or a noise multiplier")
    elif tuning:
        from dpbench.training import tuning as searches

        sigma = searches.calibrate_search(spec, plan, tuning, Target(target_epsilon, delta, accountant))
        source = searches.SOURCE_TUNED
    else:
        sigma, source = spec.mechanism.calibrate(plan, Target(target_epsilon, delta, accountant)), SOURCE_CALIBRATED
    claim = PrivacyClaim(spec.mechanism, plan, sigma, delta, accountant, target_epsilon, source,
                         time.perf_counter() - t0, spec.private)
    if source == SOURCE_GIVEN and sigma > 0:
        # the run's record accounts it after the last step: one that cannot be accounted is
        # refused now, before any compute is spent on it
        try:
            claim.spent()
        except (ValueError, ArithmeticError) as exc:
            raise ValueError(f"noise multiplier {sigma:g} (--noise-multiplier): the epsilon of its "
                             f"{plan.steps} planned steps cannot be accounted by {accountant.name} "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None
    return claim


@dataclass(frozen=True)
class PrivacySection:
    """A run file's ``privacy`` section, one typed value written whole (``run_file``): the
    claim's record (``ClaimRecord``: what was promised and spent, by which accountant, and the
    mechanism's facts), what the private step fixed (clipping, the noise on the mean gradient,
    the stages its class defines, ``step``: the facts it fixed while training,
    ``DPStep.privacy_record``), the optimizer's caveat unless the mechanism's replaces it, and,
    for a candidate of a private search, the search's record (``tuning``). No part may name
    another's key: a collision is refused, never merged over."""

    claim: ClaimRecord
    mechanism_origin: str  # "plugin": sigma and epsilon come from a plugin's own mechanism class
    clip_norm: float | None
    normalize_clipping: bool | None
    sensitivity: float | None
    noise_std_mean_gradient: float
    caveat: str | None  # the optimizer's (OptimizerSpec.caveat); the claim's replaces it
    # the stages of the private step its class defines itself ({stage: "built-in" or "plugin"};
    # {}: all DPStep's), compared, not declared (dpbench.optimizers.stages); None: not private
    stages: dict[str, str] | None
    step_class: str | None
    step: Mapping[str, Any] = field(default_factory=dict)
    tuning: Mapping[str, Any] | None = None

    def run_file(self) -> dict[str, Any]:
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("claim", "step", "tuning")}
        own["caveat"] = self.claim.caveat if self.claim.caveat is not None else self.caveat
        parts = [self.claim.run_file(), own, dict(self.step)] + ([{"tuning": dict(self.tuning)}] if self.tuning else [])
        out: dict[str, Any] = {}
        for part in parts:
            taken = sorted(set(part) & set(out))
            if taken:
                raise ValueError(f"the privacy section's key {taken[0]!r} is given twice")
            out.update(part)
        return out
