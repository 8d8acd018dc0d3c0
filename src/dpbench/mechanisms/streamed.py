"""Streamed correlated-noise mechanisms: BandMF, amplified BandMF and BLT, with no noise file.

The three ``Mechanism`` objects (dpbench.mechanisms.base) behind ``dpmatrix-band``,
``dpmatrix-band-amp`` (amplified_banded.py) and ``dpmatrix-blt``. Their noise is generated
step by step from O(b d) or O(m d) state (noise.BandedNoise, noise.BLTNoise); their
factorizations are a few hundred numbers computed by ``factorize``, a pure function of
(kind, n, b', k, bands or buffers). Each mechanism names the factorization a run needs by a
key (``key``; dpbench.matrix.store.keys lists
what each kind of key holds), ``compute`` makes the factorization of a key (the workflow's
factorize stage, ``dpbench factorize --key``), and ``plan`` reads it from its file
(``--factorization``, or the cache directory, where a missing file is computed once under a
lock) and verifies it: a run never re-optimises a factorization the workflow has cached, and
its sensitivity is recomputed from the loaded coefficients and its own participation.

* ``dpmatrix-band`` (BandedMechanism): fixed epoch order (sampling.FixedBatchSampler:
  one shuffle, S = N // L batches of exactly L, same order every epoch), so every example
  participates k = E times, S steps apart: Pi(b' = S, k). A column-normalised banded Toeplitz
  C with b <= b' bands has sens = sqrt(k) exactly (banded.py); sigma is the analytic-Gaussian
  noise multiplier of ONE release C G + sigma Z of that sensitivity (Balle & Wang 2018), as
  for the dense matrix mechanisms (dense_matrix.py has the full argument). No
  amplification. ``bands`` = "auto" takes b = min(64, b', n): more bands lower the error but
  cost (b - 1) d floats of state and a (b - 1)-term GEMV per step.
* ``dpmatrix-band-amp`` (AmplifiedBandedMechanism): cyclic Poisson sampling over b groups at
  p = b L / N, accounted as DP-SGD with ceil(T / b) steps, rate p and noise multiplier
  sigma_Z / max_j ||C e_j|| (cyclic_poisson.py, Choquette-Choo et al. 2023, Thm. 4), with the
  run's accountant (PRV by default) and RDP as a cross-check. ``bands`` = "auto" picks b
  minimising the RMSE proxy sigma_b sqrt(err_mean(c_b)) over b in {1, ..., floor(N / L)}
  (``cyclic_poisson.choose_bands``); b = 1 is DP-SGD exactly.
* ``dpmatrix-blt`` (BLTMechanism): fixed epoch order as ``dpmatrix-band``; a BLT optimised for
  the run's (n, b' = S, k) with the exact min-separation sensitivity (blt.py); analytic
  Gaussian sigma. Not banded, so not amplifiable.

Adjacency: zero-out in a batch slot for the fixed-order mechanisms (as the dense ones: under
replace-one the sensitivity doubles); add/remove for the cyclic Poisson one (each example's
group drawn independently). Noise state is secret: checkpoints holding it are private files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dpbench import log
from dpbench.matrix import banded, blt
from dpbench.matrix.store import cache, keys, streamed_files
from dpbench.matrix.store.streamed_files import StreamedFactorization
from dpbench.mechanisms import cyclic_poisson
from dpbench.mechanisms.base import AuditSpec, Plan, PlanRequest, PrivacyClaim, Spent, Target, one_release_spent
from dpbench.mechanisms.files import StreamedFiles
from dpbench.privacy import accounting, profiles

if TYPE_CHECKING:  # annotations only: a mechanism is declared and accounted without torch (the workflow)
    from dpbench.mechanisms.noise import BandedNoise, BLTNoise
    from dpbench.mechanisms.sampling import FixedBatchSampler

_LOG = log.get(__name__)

KINDS = ("band", "blt")


def factorize(kind: str, steps: int, min_separation: int, participations: int, size: int | None):
    """The factorization of a streamed mechanism: a pure function of its arguments (the
    workflow may cache it on them). ``kind`` "band": banded Toeplitz with ``size`` = b bands,
    column-normalised (its coefficients depend on (n, b) only; b' and k only have to admit
    it: b <= b'). "blt": a BLT for Pi(b', k) with ``size`` = m buffers (None: grown while it
    helps)."""
    if kind == "band":
        if size is None or not 1 <= size <= min(min_separation, steps):
            raise ValueError(f"a banded factorization needs 1 <= b <= min(b', n) = {min(min_separation, steps)} "
                             f"bands, got b = {size}")
        return banded.optimize(steps, int(size), column_normalize=True)
    if kind == "blt":
        return blt.optimize(steps, min_separation, participations, buffers=size)
    raise ValueError(f"unknown streamed factorization kind {kind!r}; choose one of {KINDS}")


def compute(key: str) -> StreamedFactorization:
    """The factorization a streamed key names (dpbench.matrix.store.keys), computed."""
    kind, p = keys.parse_streamed_key(key)
    if kind == "band":  # C depends on (n, b) only: any b' >= b admits it
        return StreamedFactorization(key, factorize("band", p["n"], p["bands"], 1, p["bands"]))
    if kind == "blt":
        return StreamedFactorization(key, factorize("blt", p["n"], p["min_separation"], p["participations"],
                                                    p["buffers"]))
    bands, search = cyclic_poisson.choose_bands(p["n_train"], p["batch_size"], p["n"], p["epsilon"], p["delta"])
    return StreamedFactorization(key, factorize("band", p["n"], bands, 1, bands), search)


def _log(message: str) -> None:
    _LOG.info(f"[streamed] {message}")


@dataclass(frozen=True, kw_only=True)
class StreamedPlan(Plan):
    """What the three streamed mechanisms' plans share: the verified strategy C
    (banded.BandedToeplitz or blt.BLT), its key and its file."""

    factorization: banded.BandedToeplitz | blt.BLT
    factorization_key: str
    factorization_file: Path


class StreamedMechanism:
    """What the three mechanisms share: a run's factorization comes from a file (module docstring)."""

    def factorization(self, key: str, request: PlanRequest) -> tuple[StreamedFactorization, Path]:
        """The verified factorization of ``key`` and its file: the request's ``factorization`` file
        if given (refused unless it is this key's), else the cache directory's (computed if missing)."""
        if request.factorization:
            path = request.factorization
        else:
            path = cache.streamed_path(request.cache_dir, key)
            cache.ensure_file(path, lambda p: streamed_files.save(compute(key), p), _log,
                              f"making factorization {key} into {path}")
        try:
            return streamed_files.load(path, key), path
        except FileNotFoundError:
            raise ValueError(f"factorization file {path} does not exist (make it with `dpbench factorize --key {key} "
                             f"--out {path}`, or leave --factorization out to compute it into the cache)") from None


@dataclass(frozen=True, kw_only=True)
class FixedOrderPlan(StreamedPlan):
    """BandMF's and BLT's plan: fixed epoch order over b' = N // L batches, k = E
    participations, and sens(C) recomputed from the loaded C for that participation."""

    epochs: int  # k
    batches: int  # b' = S = N // L: steps per epoch, the separation of participations
    unused_examples: int  # N - b' L: never in a batch
    sensitivity: float


class _FixedOrderMechanism(StreamedMechanism):
    """The part the two unamplified mechanisms share: fixed epoch order, one Gaussian release."""

    kind: str
    audit = AuditSpec("matrix", neighbours="zero-out")

    def key(self, request: PlanRequest) -> str:
        """The factorization a run needs (dpbench.matrix.store.keys): from (N, L, E) and its
        ``bands`` or ``buffers`` (``files``, which the workflow reads without torch)."""
        return self.files.key(request)

    def plan(self, request: PlanRequest) -> FixedOrderPlan:
        n_train, batch_size, epochs = request.n_train, request.batch_size, request.epochs
        key = self.key(request)
        record, path = self.factorization(key, request)
        fact = record.strategy
        batches = n_train // batch_size
        steps = epochs * batches
        return FixedOrderPlan(batch_size=batch_size, steps=steps, sample_rate=None, factorization=fact,
                              factorization_key=key, factorization_file=path, epochs=epochs, batches=batches,
                              unused_examples=n_train - batches * batch_size,
                              sensitivity=self.sensitivity(fact, batches, epochs))

    def calibrate(self, plan: FixedOrderPlan, target: Target) -> float:
        """Exact: the smallest sigma making one Gaussian release of sensitivity sens(C)
        (epsilon, delta)-DP (Balle & Wang; the target's accountant does not apply)."""
        return accounting.gaussian_noise_multiplier(target.epsilon, target.delta, sensitivity=plan.sensitivity)

    def privacy_profile(self, claim: PrivacyClaim):
        """delta(eps) of the one Gaussian release (the claim the audit tests), mu = sens / sigma."""
        return profiles.gaussian_profile(claim.plan.sensitivity / claim.noise_multiplier)

    def strategy_matrix(self, plan: FixedOrderPlan) -> np.ndarray:
        """The dense T x T strategy C the release C G + sigma s Z uses (small T: the audit)."""
        return plan.factorization.matrix()

    def strategy_sensitivity(self, plan: FixedOrderPlan) -> float:
        return plan.sensitivity

    def report(self, claim: PrivacyClaim, steps: int) -> Spent:
        plan = claim.plan
        fact, k, b = plan.factorization, plan.epochs, plan.batches
        return one_release_spent(claim, steps, plan.sensitivity, lambda t: self.sensitivity(fact, b, k, t),
                                 f"b' = {b}", {
            "kind": self.kind, "steps": plan.steps, "min_separation": b, "participations": k,
            "key": plan.factorization_key, "factorization_file": str(plan.factorization_file),
            "noise": "streamed (no noise file); its state is in checkpoints, which are private files",
            **self._describe(fact)})

    def sampler(self, plan: FixedOrderPlan, n_train: int, seed: int, device, lanes: int = 1):
        """Fixed epoch order; with ``lanes`` > 1, one independent schedule per lane of n_train
        examples (lane-major indices)."""
        from dpbench.mechanisms.sampling import FixedBatchSampler  # torch: only where a run draws
        return FixedBatchSampler(n_train, plan.batch_size, seed, device, lanes)


class BandedMechanism(_FixedOrderMechanism):
    """``dpmatrix-band``: unamplified banded Toeplitz BandMF (module docstring)."""

    name = "banded-matrix-factorization"
    kind = "band"
    event_hyperparameters = ("bands",)  # C, hence sens(C)
    files = StreamedFiles("band")  # the factorization a run reads (the workflow's)

    @staticmethod
    def sensitivity(fact, batches: int, epochs: int, steps: int | None = None) -> float:
        return banded.sensitivity(fact, batches, epochs, steps=steps)

    @staticmethod
    def _describe(fact) -> dict:
        return {"bands": fact.bands, "column_normalized": fact.column_normalize,
                "coefficients": [float(c) for c in fact.coef], **fact.report}

    def noise(self, plan: FixedOrderPlan, seed: int, device) -> BandedNoise:
        from dpbench.mechanisms.noise import BandedNoise  # torch: only where a run draws
        fact = plan.factorization
        return BandedNoise(fact.coef, fact.scale(), seed, device)


class BLTMechanism(_FixedOrderMechanism):
    """``dpmatrix-blt``: unamplified buffered linear Toeplitz (module docstring)."""

    name = "buffered-linear-toeplitz"
    kind = "blt"
    event_hyperparameters = ("buffers",)  # C, hence sens(C)
    files = StreamedFiles("blt")  # the factorization a run reads (the workflow's)

    @staticmethod
    def sensitivity(fact, batches: int, epochs: int, steps: int | None = None) -> float:
        return fact.sensitivity(batches, epochs, steps=steps)

    @staticmethod
    def _describe(fact) -> dict:
        report = {k: v for k, v in fact.report.items()}
        return {"buffers": fact.buffers, "theta": fact.theta.tolist(), "theta_hat": fact.theta_hat.tolist(),
                "omega": fact.omega.tolist(), "omega_hat": fact.omega_hat.tolist(), **report}

    def noise(self, plan: FixedOrderPlan, seed: int, device) -> BLTNoise:
        from dpbench.mechanisms.noise import BLTNoise  # torch: only where a run draws
        fact = plan.factorization
        return BLTNoise(fact.theta, fact.omega, plan.steps, seed, device)
