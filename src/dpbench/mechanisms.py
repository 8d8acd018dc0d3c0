"""Privacy mechanisms: how a run's batches are drawn, where its noise comes from, and how its
sigma and epsilon are computed. An optimizer's spec names its mechanism; the training loop
only calls the interface below, so sampling, noise and accounting always belong together.
"""

from __future__ import annotations

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

    def sampler(self, plan: Plan, n_train: int, seed: int, device) -> Sampler: ...

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


class PoissonSubsampledGaussian:
    """Poisson sampling at q = L/N for T = round(E N / L) steps, i.i.d. Gaussian noise with
    multiplier sigma * schedule(k) at step k (schedule = 1 unless an optimizer decays it), and
    sigma calibrated so that the composition meets the target epsilon (PRV by default)."""

    name = "poisson-subsampled-gaussian"

    def __init__(self, schedule: Callable[[int], float] | None = None, schedule_name: str = "constant",
                 bucket_rel: float = 0.01):
        self.schedule, self.schedule_name, self.bucket_rel = schedule, schedule_name, bucket_rel

    def plan(self, n_train: int, batch_size: int, epochs: int, run_config: Any = None) -> Plan:
        if batch_size > n_train:
            raise ValueError(f"batch_size {batch_size} exceeds the number of training examples {n_train}")
        return Plan(batch_size, max(1, round(epochs * n_train / batch_size)), batch_size / n_train)

    def history(self, plan: Plan, noise_multiplier: float, steps: int) -> accounting.History:
        if self.schedule is None:
            return [(noise_multiplier, plan.sample_rate, steps)]
        return [(noise_multiplier * f, plan.sample_rate, n)
                for f, n in geometric_buckets(steps, self.schedule, self.bucket_rel)]

    def calibrate(self, plan: Plan, target_epsilon: float, delta: float, accountant: str) -> float:
        return accounting.calibrate(
            lambda s: accounting.epsilon(self.history(plan, s, plan.steps), delta, accountant), target_epsilon)

    def report(self, plan: Plan, noise_multiplier: float, steps: int, delta: float, accountant: str) -> dict:
        planned = accounting.epsilon(self.history(plan, noise_multiplier, plan.steps), delta, accountant)
        done = planned if steps == plan.steps else accounting.epsilon(
            self.history(plan, noise_multiplier, steps), delta, accountant)
        rdp = accounting.epsilon(self.history(plan, noise_multiplier, steps), delta, "rdp")
        return {"epsilon": done, "epsilon_planned": planned, "epsilon_rdp": rdp,
                "noise_schedule": self.schedule_name}

    def sampler(self, plan: Plan, n_train: int, seed: int, device) -> PoissonSampler:
        return PoissonSampler(n_train, plan.sample_rate, seed, device)

    def noise(self, plan: Plan, seed: int, device) -> GaussianNoise:
        return GaussianNoise(seed, device)


def inverse_sqrt_schedule(k: int) -> float:
    """sigma_k = sigma / sqrt(k) (D2P2-SGD's dynamic noise)."""
    return 1.0 / math.sqrt(k)
