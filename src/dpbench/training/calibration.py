"""A run's privacy setting: what it asks of its mechanism (``plan_request``) and its noise
multiplier (``timed_noise_multiplier``, via ``harness.choose_noise_multiplier``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from dpbench.mechanisms.base import Plan, PlanRequest
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.training.config import RunConfig
from dpbench.training.harness import choose_noise_multiplier


@dataclass(frozen=True)
class Calibration:
    """The run's noise multiplier, where it came from, and the seconds its calibration took."""

    sigma: float
    source: str
    seconds: float


def plan_request(cfg: RunConfig, n_train: int) -> PlanRequest:
    """What the run asks of its mechanism, its files resolved: the given factorization and noise
    file, the cache directory (the default one unless given)."""
    return PlanRequest(n_train, cfg.batch_size, cfg.epochs, hyperparameters=cfg.hyperparameters,
                       target_epsilon=cfg.epsilon, delta=cfg.delta, cache_dir=cfg.cache_dir,
                       factorization=cfg.factorization, noise_file=cfg.noise_file)


def timed_noise_multiplier(cfg: RunConfig, spec: OptimizerSpec, plan: Plan) -> Calibration:
    """sigma for the run's plan (``harness.choose_noise_multiplier``; a search's candidate: for the
    whole search, ``training.tuning``), timed."""
    t0 = time.perf_counter()
    if cfg.tuning and spec.private and cfg.noise_multiplier is None:
        from dpbench.training import tuning

        sigma = tuning.noise_multiplier(spec, plan, cfg.tuning, cfg.epsilon, cfg.delta, cfg.accountant)
        return Calibration(sigma, tuning.SOURCE_TUNED, time.perf_counter() - t0)
    sigma, source = choose_noise_multiplier(spec, plan, target_epsilon=cfg.epsilon, noise_multiplier=cfg.noise_multiplier,
                                    delta=cfg.delta, accountant=cfg.accountant)
    return Calibration(sigma, source, time.perf_counter() - t0)
