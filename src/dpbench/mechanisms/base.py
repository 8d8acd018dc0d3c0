"""What every privacy mechanism is: the interface the training loop and the audit call, and
the plan a mechanism fixes for a run.

A mechanism ties together how a run's batches are drawn (a ``Sampler``), where its noise
comes from (a ``NoiseSource``) and how its sigma and epsilon are computed (an accountant of
dpbench.privacy), so that the three always belong together; an optimizer's spec names its
mechanism. A run asks for its plan with a ``PlanRequest`` (the setting, the optimizer's
hyperparameters, the target, every file path resolved by the caller) and gets a frozen
``Plan``: the common fields below, and each mechanism's own typed fields in a subclass
(``DenseMatrixPlan``, ``ProjectionPlan``, ...). The mechanisms, one module per idea:
poisson_gaussian (DP-SGD's), unamplified, projection, dense_matrix, streamed and
amplified_banded; their samplers are in sampling, their noise sources in noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from dpbench.matrix.store.cache import default_cache_dir
from dpbench.privacy import accounting

if TYPE_CHECKING:  # annotations only: the workflow reads PlanRequest without torch
    import torch


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
class PlanRequest:
    """What a run asks of its mechanism: N, L and E; the optimizer's hyperparameters (a
    mechanism reads the few it plans with: ``tau``, ``bands``, ``buffers``, ``projection``,
    ``paper_sensitivity``); the target (epsilon, delta), which amplified BandMF's band search
    needs; and the files, every path resolved by the caller: the cache directory where a
    missing factorization or noise file is made, and a given factorization or noise file that
    replaces the cache's (``dpbench train --factorization``, ``--noise-file``)."""

    n_train: int
    batch_size: int
    epochs: int
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    target_epsilon: float | None = None
    delta: float = accounting.DELTA
    cache_dir: Path | None = None  # None: matrix.store.cache.default_cache_dir()
    factorization: Path | None = None
    noise_file: Path | None = None

    def __post_init__(self):
        object.__setattr__(self, "hyperparameters", MappingProxyType(dict(self.hyperparameters or {})))
        for name in ("cache_dir", "factorization", "noise_file"):  # a path given as text ("": none)
            value = getattr(self, name)
            if not isinstance(value, Path | None):
                object.__setattr__(self, name, Path(value) if value else None)
        if self.cache_dir is None:
            object.__setattr__(self, "cache_dir", default_cache_dir())


@dataclass(frozen=True)
class Plan:
    """The privacy setting of one run, fixed before training starts and never changed after.
    A mechanism with constants of its own plans a frozen subclass with typed fields. What a
    run fixes later (e.g. the parameter count d) reaches its privacy record through
    ``DPStep.privacy_record``."""

    batch_size: int  # L: expected (Poisson) or exact (fixed batches)
    steps: int  # planned T
    sample_rate: float | None  # q, where sampling amplifies privacy


class Sampler(Protocol):
    """A run's batches: ``sample()`` is the next step's batch as a 1-D int64 tensor of indices
    into the training set (any length, 0 included: Poisson batches vary; lane-major blocks of
    ``n_train`` with ``lanes`` > 1), drawn from the sampler's own seeded stream; its
    ``state_dict``/``load_state_dict`` resume the stream exactly. Its draws must be the ones
    the mechanism's accountant assumes (the audit checks that empirically)."""

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
    """How a run's batches are drawn, where its noise comes from and how its sigma and epsilon
    are computed, as one object an ``OptimizerSpec`` names. The harness calls ``plan`` once
    (a frozen ``Plan`` from the run's ``PlanRequest``), then ``calibrate`` (sigma for a target
    epsilon) or ``report`` (the epsilons for a sigma and the steps taken: a dict with
    ``epsilon``, ``epsilon_planned``, ``epsilon_rdp`` and any facts of its own), ``sampler``
    and ``noise``; the audit also calls ``privacy_profile`` and reads ``audit``. All of these
    members are required of a plugin's mechanism (``dpbench.optimizers.MECHANISM_METHODS``);
    a mechanism of a plugin's own class makes the privacy claim the plugin's. Optional:
    ``event_hyperparameters``, the names of the optimizer's hyperparameters its ``plan`` reads
    that change the accounted event (``bands``, ``tau``, ...; () for none): a private search
    over settings that differ in one is refused (dpbench.training.tuning.shared_event_refusal),
    and a mechanism whose class does not declare them is taken to read every one; ``files``
    (absent or None: none) declares the cached files its runs read, which the workflow makes
    before them (``dpbench.mechanisms.files``: ``DenseFiles``, ``StreamedFiles``)."""

    name: str
    audit: AuditSpec  # how the empirical audit (dpbench.audit) attacks the mechanism

    def plan(self, request: PlanRequest) -> Plan: ...

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


def recorded_history(mechanism: Any, plan: Plan, noise_multiplier: float, steps: int) -> list[list[float]] | None:
    """The event a run of ``steps`` steps is accounted as, for its record and for composing runs
    without torch (``dpbench.reporting.figures.spent``): the mechanism's own ``history`` (segments
    [sigma, q, n] of Poisson-subsampled Gaussian steps) as plain numbers; None where the mechanism
    has none (one Gaussian release: the matrix mechanisms, whose epsilon gives mu), or where its
    sensitivity bound may fail (``delta_fail`` > 0: composing k runs would need k of them)."""
    history = getattr(mechanism, "history", None)
    fail = getattr(mechanism, "delta_fail", None)
    if not callable(history) or (callable(fail) and fail(plan) > 0):
        return None
    return [[float(s), float(q), int(n)] for s, q, n in history(plan, noise_multiplier, steps)]


def one_release_epsilons(noise_multiplier: float, planned_sensitivity: float, done_sensitivity: float,
                         delta: float) -> dict:
    """The epsilons of a matrix mechanism, one Gaussian release C G + sigma s Z of sensitivity
    s = sens(C) (zero-out neighbours): exactly (Balle & Wang 2018) for the steps taken and the
    planned ones, and the RDP bound for the steps taken. No sensitivity (no step taken) is
    epsilon 0; no noise with a sensitivity is epsilon infinite."""
    def eps(s: float) -> float:
        if s == 0:
            return 0.0
        return math.inf if noise_multiplier <= 0 else accounting.gaussian_epsilon(s / noise_multiplier, delta)

    rdp = (0.0 if done_sensitivity == 0 else math.inf if noise_multiplier <= 0 else
           accounting.epsilon([(noise_multiplier / done_sensitivity, 1.0, 1)], delta, "rdp"))
    return {"epsilon": eps(done_sensitivity), "epsilon_planned": eps(planned_sensitivity), "epsilon_rdp": rdp,
            "accountant": "analytic-gaussian (one release, Balle & Wang 2018)"}
