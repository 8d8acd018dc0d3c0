"""What every privacy mechanism is: the interface the training loop and the audit call, the
plan a mechanism fixes for a run, and the privacy claim a calibrated run makes.

A mechanism ties together how a run's batches are drawn (a ``Sampler``), where its noise
comes from (a ``NoiseSource``) and how its sigma and epsilon are computed (an accountant of
dpbench.privacy), so that the three always belong together; an optimizer's spec names its
mechanism. A run asks for its plan with a ``PlanRequest`` (the setting, the optimizer's
hyperparameters, the target, every file path resolved by the caller) and gets a frozen
``Plan``: the common fields below, and each mechanism's own typed fields in a subclass
(``DenseMatrixPlan``, ``ProjectionPlan``, ...). The mechanisms, one module per idea:
poisson_gaussian (DP-SGD's), unamplified, projection, dense_matrix, streamed and
amplified_banded; their samplers are in sampling, their noise sources in noise.

A run's claim is one frozen ``PrivacyClaim`` (plan, sigma, delta, accountant, target epsilon),
made by ``dpbench.training.calibration.calibrate``: the mechanism calibrates sigma for a
``Target`` (epsilon, delta, accountant), reports what the claim has ``Spent`` after some steps,
and gives its privacy profile; the claim's ``record`` is the typed ``ClaimRecord`` the run file
writes. Named apart in code: ``target_epsilon`` (asked for) and ``epsilon_spent`` (the run
file's ``epsilon``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

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


@dataclass(frozen=True)
class Target:
    """What a run asks its mechanism's calibration for: a target epsilon at delta, by the named
    accountant of dpbench.privacy.accounting (``Mechanism.calibrate``). Refused at once unless
    0 < epsilon < inf and 0 < delta < 1, or the accountant is unknown."""

    epsilon: float  # the target epsilon
    delta: float = accounting.DELTA
    accountant: accounting.Accountant = accounting.PRV  # a registered name is taken too

    def __post_init__(self):
        accounting.check_target(self.epsilon, self.delta)
        object.__setattr__(self, "accountant", accounting.get_accountant(self.accountant))


@dataclass(frozen=True)
class Spent:
    """What a mechanism reports of its claim after some steps (``Mechanism.report``): the epsilon
    spent by the steps taken (the run file's ``privacy.epsilon``), by the planned T
    (``epsilon_planned``), the RDP epsilon of the steps taken as a cross-check (``epsilon_rdp``);
    where the mechanism accounts otherwise than its claim says, typed: ``accountant``, the
    registered accountant it accounted with (None: the claim's), ``accountant_record``, what the
    record's ``accountant`` says of it where run files have always said more or other than its
    name (the one-release mechanisms' ``analytic-gaussian (one release, ...)``, D2P2's ``rdp``),
    ``noise_multiplier``, the noise multiplier it accounted (None: the claim's sigma; amplified
    BandMF's sigma_Z / max_j ||C e_j||), ``caveat``, a limit of its guarantee that replaces the
    optimizer's (None: the optimizer's); and ``facts``, the mechanism's own public facts, none
    of which may name a key of the claim's record (refused: the record is written whole, never
    merged over)."""

    epsilon_spent: float
    epsilon_planned: float
    epsilon_rdp: float
    facts: dict[str, Any] = field(default_factory=dict)
    accountant: accounting.Accountant | None = None
    accountant_record: str | None = None
    noise_multiplier: float | None = None
    caveat: str | None = None

    def __post_init__(self):
        taken = [k for k in self.facts if k in RECORD_KEYS]
        if taken:
            raise ValueError(f"a mechanism's facts may not name a key of the claim's record: {', '.join(taken)} "
                             "(report it as Spent's typed field)")
        if self.accountant is not None:
            object.__setattr__(self, "accountant", accounting.get_accountant(self.accountant))


class Mechanism(Protocol):
    """How a run's batches are drawn, where its noise comes from and how its sigma and epsilon
    are computed, as one object an ``OptimizerSpec`` names. The harness calls ``plan`` once
    (a frozen ``Plan`` from the run's ``PlanRequest``), then ``calibrate`` (the smallest sigma
    meeting a ``Target``: epsilon, delta, accountant), ``sampler`` and ``noise``; the run's
    ``PrivacyClaim`` (plan, sigma, delta, accountant, target) asks ``report`` for what the claim
    has spent after some steps (a ``Spent``) and the audit asks ``privacy_profile`` for the
    claim at every epsilon, and reads ``audit``. All of these members are required of a
    plugin's mechanism (``dpbench.optimizers.MECHANISM_METHODS``); a mechanism of a plugin's
    own class makes the privacy claim the plugin's. Optional: ``event_hyperparameters``, the
    names of the optimizer's hyperparameters its ``plan`` reads that change the accounted event
    (``bands``, ``tau``, ...; () for none): a private search over settings that differ in one
    is refused (dpbench.training.tuning.shared_event_refusal), and a mechanism whose class does
    not declare them is taken to read every one; ``history(plan, sigma, steps)``, the event it
    accounts as Poisson-subsampled Gaussian segments [(sigma, q, n)] (recorded, and composed
    across runs); ``files`` (absent or None: none) declares the cached files its runs read,
    which the workflow makes before them (``dpbench.mechanisms.files``: ``DenseFiles``,
    ``StreamedFiles``)."""

    name: str
    audit: AuditSpec  # how the empirical audit (dpbench.audit) attacks the mechanism

    def plan(self, request: PlanRequest) -> Plan: ...

    def calibrate(self, plan: Plan, target: Target) -> float:
        """The smallest sigma with which ``plan`` meets ``target`` (by ``target.accountant``
        where the mechanism accounts with the run's accountant)."""
        ...

    def report(self, claim: PrivacyClaim, steps: int) -> Spent:
        """What ``claim`` has spent after ``steps`` steps (and after its planned T)."""
        ...

    def sampler(self, plan: Plan, n_train: int, seed: int, device, lanes: int = 1) -> Sampler:
        """Batches as indices into ``lanes`` blocks of ``n_train`` examples (lane-major), each
        lane drawn as an independent sampler would draw it (see ``Context.lanes``)."""
        ...

    def noise(self, plan: Plan, seed: int, device) -> NoiseSource: ...

    def privacy_profile(self, claim: PrivacyClaim):
        """delta*(eps) for an array of eps: the claim the empirical audit tests (dpbench.audit)."""
        ...


@dataclass(frozen=True)
class ClaimRecord:
    """What a run file says of its privacy claim (``PrivacyClaim.record``), written whole
    (``run_file``): each field is the ``privacy`` key of the same name, except ``epsilon_spent``,
    written as ``epsilon`` (the epsilon the steps taken spent; ``target_epsilon`` is the one
    asked for), ``facts``, the mechanism's own keys (``Spent.facts``, which name none of the
    others), and ``caveat``, the mechanism's limit of the guarantee (``Spent.caveat``), which the
    run's privacy section writes in place of the optimizer's (``caveat`` is its key there).
    ``accountant`` names the accountant that computed ``epsilon``: the claim's, or the
    mechanism's own (``Spent.accountant``, as ``Spent.accountant_record`` says where it gives one);
    ``noise_multiplier`` is the accounted one (``Spent.noise_multiplier``) where it differs from
    sigma."""

    mechanism: str | None
    noise_multiplier: float
    noise_multiplier_source: str
    sample_rate: float | None
    planned_steps: int
    steps: int
    delta: float | None
    target_epsilon: float | None
    epsilon_spent: float
    epsilon_planned: float
    epsilon_rdp: float
    accountant: str | None
    accounted_history: list[list[float]] | None
    calibration_time_s: float
    facts: dict[str, Any]
    caveat: str | None = None

    def run_file(self) -> dict[str, Any]:
        """The run file's keys of the claim: its fields in order, then the mechanism's facts."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("facts", "caveat")}
        out = {("epsilon" if k == "epsilon_spent" else k): v for k, v in out.items()}
        return {**out, **self.facts}  # Spent refuses a fact named like a key


# The keys of a claim's record in the run file (``ClaimRecord.run_file``, ``caveat`` with them):
# no mechanism fact may take one (``Spent``).
RECORD_KEYS = frozenset({"epsilon", "caveat"} | {f.name for f in fields(ClaimRecord)} - {"epsilon_spent", "facts"})


# where a run's sigma came from (recorded as privacy.noise_multiplier_source)
SOURCE_NON_PRIVATE, SOURCE_GIVEN, SOURCE_CALIBRATED = "none (non-private)", "given", "calibrated"


@dataclass(frozen=True)
class PrivacyClaim:
    """A run's privacy claim, fixed before its first step and never changed after: its
    mechanism's ``plan``, the noise multiplier sigma, delta, the accountant, the target epsilon
    asked for (None: none; a run may give sigma and a target, and is then held to it), where
    sigma came from (``source``) and the seconds its calibration took.
    ``dpbench.training.calibration.calibrate`` makes it. It answers what was spent
    (``spent(steps)``, ``epsilon(steps)``: the mechanism's ``report``), the claim at every
    epsilon (``profile()``: its ``privacy_profile``) and what the run file records (``record``).
    A non-private run's claim (``private`` False, sigma 0) spends nothing it can account:
    epsilon infinite, and its record names no mechanism, delta or accountant."""

    mechanism: Mechanism
    plan: Plan
    noise_multiplier: float
    delta: float = accounting.DELTA
    accountant: accounting.Accountant = accounting.PRV  # a registered name is taken too
    target_epsilon: float | None = None
    source: str = SOURCE_GIVEN
    seconds: float = 0.0
    private: bool = True

    def __post_init__(self):
        object.__setattr__(self, "accountant", accounting.get_accountant(self.accountant))
        if not 0 <= self.noise_multiplier < math.inf:
            raise ValueError(f"noise multiplier must be finite and >= 0, got {self.noise_multiplier}")

    def spent(self, steps: int | None = None) -> Spent:
        """What the claim has spent after ``steps`` steps (None: the planned T), by its mechanism."""
        spent = self.mechanism.report(self, self.plan.steps if steps is None else steps)
        if not isinstance(spent, Spent):
            raise TypeError(f"mechanism {self.mechanism.name!r}: report must return a Spent, "
                            f"got {type(spent).__name__}")
        for name in ("epsilon_spent", "epsilon_planned", "epsilon_rdp"):
            value = getattr(spent, name)
            # a label is only as good as the number: a plugin's negative, NaN or non-number
            # epsilon would be recorded and labelled private (infinity is allowed: no guarantee)
            if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"mechanism {self.mechanism.name!r}: report returned {name} = {value!r}; an "
                                 "epsilon is a number >= 0 (infinite where nothing is guaranteed)")
        return spent

    def epsilon(self, steps: int | None = None) -> float:
        """The epsilon spent after ``steps`` steps (None: the planned T)."""
        return self.spent(steps).epsilon_spent

    def profile(self):
        """delta*(eps) of the claim for an array of eps (the mechanism's ``privacy_profile``)."""
        return self.mechanism.privacy_profile(self)

    def record(self, steps: int) -> ClaimRecord:
        """The claim as the run file records it after ``steps`` steps."""
        private = self.private
        spent = self.spent(steps) if private else Spent(math.inf, math.inf, math.inf)
        accountant = (spent.accountant_record or (spent.accountant or self.accountant).name) if private else None
        return ClaimRecord(
            mechanism=self.mechanism.name if private else None,
            noise_multiplier=self.noise_multiplier if spent.noise_multiplier is None else spent.noise_multiplier,
            noise_multiplier_source=self.source, sample_rate=self.plan.sample_rate if private else None,
            planned_steps=self.plan.steps, steps=steps, delta=self.delta if private else None,
            target_epsilon=self.target_epsilon if private else None, epsilon_spent=spent.epsilon_spent,
            epsilon_planned=spent.epsilon_planned, epsilon_rdp=spent.epsilon_rdp,
            accountant=accountant,
            # the event the steps taken are accounted as ([[sigma, q, n], ...]; None: one Gaussian
            # release, or a bound that may fail): what composes runs (epsilon_sel)
            accounted_history=(recorded_history(self.mechanism, self.plan, self.noise_multiplier, steps)
                               if private else None),
            calibration_time_s=self.seconds, facts=dict(spent.facts), caveat=spent.caveat)


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


def one_release_spent(claim: PrivacyClaim, steps: int, planned_sensitivity: float,
                      sensitivity_at: Callable[[int], float], batches: str, matrix: dict[str, Any]) -> Spent:
    """What a matrix mechanism on fixed batches has spent (the dense and the streamed ones alike):
    one Gaussian release C G + sigma s Z of sensitivity s = sens(C) (zero-out neighbours), its
    epsilon exact (Balle & Wang 2018) for the steps taken, whose sensitivity is
    ``sensitivity_at(steps)`` (``planned_sensitivity`` at T or after), and for the planned
    ones, and the RDP bound for the steps taken. No sensitivity (no step taken) is epsilon 0; no
    noise with a sensitivity is epsilon infinite. ``batches`` names the batches per epoch in
    the paper's symbol ("b = 9"); ``matrix``: the strategy's facts."""
    plan, sigma, delta = claim.plan, claim.noise_multiplier, claim.delta
    done = planned_sensitivity if steps >= plan.steps else (sensitivity_at(steps) if steps > 0 else 0.0)

    def eps(s: float) -> float:
        if s == 0:
            return 0.0
        return math.inf if sigma <= 0 else accounting.ANALYTIC_GAUSSIAN.release_epsilon(s / sigma, delta)

    rdp = 0.0 if done == 0 else math.inf if sigma <= 0 else accounting.RDP.epsilon([(sigma / done, 1.0, 1)], delta)
    return Spent(eps(done), eps(planned_sensitivity), rdp, {
        "strategy_sensitivity": planned_sensitivity, "strategy_sensitivity_steps_taken": done,
        "sampling": (f"fixed batches: one shuffle per run, {batches} batches of exactly L = {plan.batch_size} "
                     f"({plan.unused_examples} examples unused), same order every epoch; no amplification"),
        "adjacency": "zero-out (one example's gradients replaced by 0 in its batch slot)",
        "matrix": matrix,
    }, accounting.ANALYTIC_GAUSSIAN, "analytic-gaussian (one release, Balle & Wang 2018)")
