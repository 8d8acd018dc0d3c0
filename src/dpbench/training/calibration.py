"""A run's privacy claim: what it asks of its mechanism (``plan_request``) and its calibrated
claim (``calibrate``: sigma, where it came from and how long finding it took), the one place a
run, a search's candidate and the empirical audit get sigma from."""

from __future__ import annotations

import time
from typing import Any

from dpbench.mechanisms.base import (SOURCE_CALIBRATED, SOURCE_GIVEN, SOURCE_NON_PRIVATE, Plan, PlanRequest,
                                     PrivacyClaim, Target)
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
    return PrivacyClaim(spec.mechanism, plan, sigma, delta, accountant, target_epsilon, source,
                        time.perf_counter() - t0, spec.private)
