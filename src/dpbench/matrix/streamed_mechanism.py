"""Streaming correlated-noise mechanisms: BandMF, amplified BandMF and BLT, with no noise file.

The three ``Mechanism`` objects (dpbench.privacy.mechanisms) behind ``dpmatrix-band``,
``dpmatrix-band-amp`` and ``dpmatrix-blt``. Their noise is generated step by step from
O(b d) or O(m d) state (streaming_noise.py); their factorizations are a few hundred numbers
computed by ``factorize``, a pure function of (kind, n, b', k, bands or buffers). Each
mechanism names the factorization a run needs by a key (``key``; streaming_file.py lists
what each kind of key holds), ``compute`` makes the factorization of a key (the workflow's
factorize stage, ``dpbench factorize --key``), and ``plan`` reads it from its file
(``--factorization``, or the cache directory, where a missing file is computed once under a
lock) and verifies it: a run never re-optimises a factorization the workflow has cached, and
its sensitivity is recomputed from the loaded coefficients and its own participation.

* ``dpmatrix-band`` (BandedMechanism): fixed epoch order (participation.FixedBatchSampler:
  one shuffle, S = N // L batches of exactly L, same order every epoch), so every example
  participates k = E times, S steps apart: Pi(b' = S, k). A column-normalised banded Toeplitz
  C with b <= b' bands has sens = sqrt(k) exactly (banded.py); sigma is the analytic-Gaussian
  noise multiplier of ONE release C G + sigma Z of that sensitivity (Balle & Wang 2018), as
  for the dense matrix mechanisms (matrix/dense_mechanism.py has the full argument). No
  amplification. ``bands`` = "auto" takes b = min(64, b', n): more bands lower the error but
  cost (b - 1) d floats of state and a (b - 1)-term GEMV per step.
* ``dpmatrix-band-amp`` (AmplifiedBandedMechanism): cyclic Poisson sampling over b groups at
  p = b L / N, accounted as DP-SGD with ceil(T / b) steps, rate p and noise multiplier
  sigma_Z / max_j ||C e_j|| (cyclic_poisson.py, Choquette-Choo et al. 2023, Thm. 4), with the
  run's accountant (PRV by default) and RDP as a cross-check. ``bands`` = "auto" picks b
  minimising the RMSE proxy sigma_b sqrt(err_mean(c_b)) over b in {1, ..., floor(N / L)}
  (``choose_bands``); b = 1 is DP-SGD exactly.
* ``dpmatrix-blt`` (BLTMechanism): fixed epoch order as ``dpmatrix-band``; a BLT optimised for
  the run's (n, b' = S, k) with the exact min-separation sensitivity (blt.py); analytic
  Gaussian sigma. Not banded, so not amplifiable.

Adjacency: zero-out in a batch slot for the fixed-order mechanisms (as the dense ones: under
replace-one the sensitivity doubles); add/remove for the cyclic Poisson one (each example's
group drawn independently). Noise state is secret: checkpoints holding it are private files.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpbench.privacy import accounting, pld, profiles
from dpbench.matrix import banded, blt, cache, cyclic_poisson, streamed_factorization
from dpbench.matrix.participation import FixedBatchSampler
from dpbench.matrix.streamed_factorization import StreamingFactorization
from dpbench.matrix.streamed_noise import BandedNoise, BLTNoise
from dpbench.privacy.mechanisms import AuditSpec, Plan

KINDS = ("band", "blt")
DEFAULT_BANDS = 64  # dpmatrix-band's "auto": min(64, b', n)


def factorize(kind: str, steps: int, min_separation: int, participations: int, size: int | None):
    """The factorization of a streaming mechanism: a pure function of its arguments (the
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
    raise ValueError(f"unknown streaming factorization kind {kind!r}; choose one of {KINDS}")


def compute(key: str) -> StreamingFactorization:
    """The factorization a streaming key names (streaming_file.py), computed."""
    kind, p = streamed_factorization.parse_key(key)
    if kind == "band":  # C depends on (n, b) only: any b' >= b admits it
        return StreamingFactorization(key, factorize("band", p["n"], p["bands"], 1, p["bands"]))
    if kind == "blt":
        return StreamingFactorization(key, factorize("blt", p["n"], p["min_separation"], p["participations"],
                                                     p["buffers"]))
    bands, search = choose_bands(p["n_train"], p["batch_size"], p["n"], p["epsilon"], p["delta"])
    return StreamingFactorization(key, factorize("band", p["n"], bands, 1, bands), search)


def _log(message: str) -> None:
    print(f"[streaming] {message}", file=sys.stderr, flush=True)


class StreamingMechanism:
    """What the three mechanisms share: a run's factorization comes from a file (module docstring)."""

    def factorization(self, key: str, run_config: Any) -> tuple[StreamingFactorization, Path]:
        """The verified factorization of ``key`` and its file: the run's ``factorization`` file if
        given (refused unless it is this key's), else the cache directory's (computed if missing)."""
        given = getattr(run_config, "factorization", None)
        if given:
            path = Path(given)
        else:
            cache_dir = getattr(run_config, "cache_dir", None) or cache.default_cache_dir()
            path = cache.streaming_path(cache_dir, key)
            cache.ensure_file(path, lambda p: streamed_factorization.save(compute(key), p), _log,
                              f"making factorization {key} into {path}")
        try:
            return streamed_factorization.load(path, key), path
        except FileNotFoundError:
            raise ValueError(f"factorization file {path} does not exist (make it with `dpbench factorize --key {key} "
                             f"--out {path}`, or leave --factorization out to compute it into the cache)") from None


def _size(hyper: dict, name: str) -> int | None:
    value = hyper.get(name, "auto")
    if value in ("auto", None):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"hyperparameter {name!r} must be a positive integer or 'auto', got {value!r}")
    return int(value)


class _FixedOrderMechanism(StreamingMechanism):
    """The part the two unamplified mechanisms share: fixed epoch order, one Gaussian release."""

    kind: str
    audit = AuditSpec("matrix", neighbours="zero-out")

    def key(self, n_train: int, batch_size: int, epochs: int, run_config: Any = None) -> str:
        """The factorization a run needs (streaming_file.py): from (N, L, E) and its ``bands`` or
        ``buffers``."""
        if not 1 <= batch_size <= n_train:
            raise ValueError(f"batch_size {batch_size} must be between 1 and the number of training examples {n_train}")
        hyper = dict(getattr(run_config, "hyperparameters", None) or {})
        batches = n_train // batch_size  # b' = S: steps per epoch, the separation of participations
        steps = epochs * batches
        return self._key(steps, batches, epochs, self._size(hyper, batches, steps))

    def plan(self, n_train: int, batch_size: int, epochs: int, run_config: Any = None) -> Plan:
        key = self.key(n_train, batch_size, epochs, run_config)
        record, path = self.factorization(key, run_config)
        fact = record.strategy
        batches = n_train // batch_size
        steps = epochs * batches
        extras = {"factorization": fact, "factorization_key": key, "factorization_file": str(path),
                  "epochs": epochs, "batches": batches,
                  "unused_examples": n_train - batches * batch_size,
                  "sensitivity": self.sensitivity(fact, batches, epochs)}
        return Plan(batch_size=batch_size, steps=steps, sample_rate=None, extras=extras)

    def calibrate(self, plan: Plan, target_epsilon: float, delta: float, accountant: str) -> float:
        """Exact: the smallest sigma making one Gaussian release of sensitivity sens(C)
        (epsilon, delta)-DP (Balle & Wang; the accountant argument does not apply)."""
        accounting.check_target(target_epsilon, delta)
        return accounting.gaussian_noise_multiplier(target_epsilon, delta, sensitivity=plan.extras["sensitivity"])

    def privacy_profile(self, plan: Plan, noise_multiplier: float, delta: float, accountant: str):
        """delta(eps) of the one Gaussian release (the claim the audit tests), mu = sens / sigma."""
        return profiles.gaussian_profile(plan.extras["sensitivity"] / noise_multiplier)

    def strategy_matrix(self, plan: Plan) -> np.ndarray:
        """The dense T x T strategy C the release C G + sigma s Z uses (small T: the audit)."""
        return plan.extras["factorization"].matrix()

    def strategy_sensitivity(self, plan: Plan) -> float:
        return plan.extras["sensitivity"]

    def report(self, plan: Plan, noise_multiplier: float, steps: int, delta: float, accountant: str) -> dict:
        fact, k, b = plan.extras["factorization"], plan.extras["epochs"], plan.extras["batches"]
        planned = plan.extras["sensitivity"]
        done = planned if steps >= plan.steps else (self.sensitivity(fact, b, k, steps) if steps > 0 else 0.0)

        def eps(s: float) -> float:
            if s == 0:
                return 0.0
            return math.inf if noise_multiplier <= 0 else accounting.gaussian_epsilon(s / noise_multiplier, delta)

        rdp = (0.0 if done == 0 else math.inf if noise_multiplier <= 0 else
               accounting.epsilon([(noise_multiplier / done, 1.0, 1)], delta, "rdp"))
        return {
            "epsilon": eps(done), "epsilon_planned": eps(planned), "epsilon_rdp": rdp,
            "accountant": "analytic-gaussian (one release, Balle & Wang 2018)",
            "strategy_sensitivity": planned, "strategy_sensitivity_steps_taken": done,
            "sampling": (f"fixed batches: one shuffle per run, b' = {b} batches of exactly L = {plan.batch_size} "
                         f"({plan.extras['unused_examples']} examples unused), same order every epoch; "
                         "no amplification"),
            "adjacency": "zero-out (one example's gradients replaced by 0 in its batch slot)",
            "matrix": {"kind": self.kind, "steps": plan.steps, "min_separation": b, "participations": k,
                       "key": plan.extras["factorization_key"], "factorization_file": plan.extras["factorization_file"],
                       "noise": "streamed (no noise file); its state is in checkpoints, which are private files",
                       **self._describe(fact)},
        }

    def sampler(self, plan: Plan, n_train: int, seed: int, device, lanes: int = 1):
        """Fixed epoch order; with ``lanes`` > 1, one independent schedule per lane of n_train
        examples (lane-major indices)."""
        return FixedBatchSampler(n_train, plan.batch_size, seed, device, lanes)


class BandedMechanism(_FixedOrderMechanism):
    """``dpmatrix-band``: unamplified banded Toeplitz BandMF (module docstring)."""

    name = "banded-matrix-factorization"
    kind = "band"

    @staticmethod
    def _key(steps: int, batches: int, epochs: int, bands: int) -> str:
        return streamed_factorization.band_key(steps, bands)

    @staticmethod
    def _size(hyper: dict, batches: int, steps: int) -> int:
        bands = _size(hyper, "bands")
        if bands is None:
            return min(DEFAULT_BANDS, batches, steps)
        if bands > batches:
            raise ValueError(f"bands = {bands} exceeds the steps per epoch b' = N // L = {batches}: with fixed epoch "
                             "order an example's participations are b' steps apart, and b > b' bands would make "
                             "its columns overlap (use bands <= b', or dpmatrix-blt)")
        return bands

    @staticmethod
    def sensitivity(fact, batches: int, epochs: int, steps: int | None = None) -> float:
        return banded.sensitivity(fact, batches, epochs, steps=steps)

    @staticmethod
    def _describe(fact) -> dict:
        return {"bands": fact.bands, "column_normalized": fact.column_normalize,
                "coefficients": [float(c) for c in fact.coef], **fact.report}

    def noise(self, plan: Plan, seed: int, device) -> BandedNoise:
        fact = plan.extras["factorization"]
        return BandedNoise(fact.coef, fact.scale(), seed, device)


class BLTMechanism(_FixedOrderMechanism):
    """``dpmatrix-blt``: unamplified buffered linear Toeplitz (module docstring)."""

    name = "buffered-linear-toeplitz"
    kind = "blt"

    @staticmethod
    def _key(steps: int, batches: int, epochs: int, buffers: int | None) -> str:
        return streamed_factorization.blt_key(steps, batches, epochs, buffers)

    @staticmethod
    def _size(hyper: dict, batches: int, steps: int) -> int | None:
        buffers = _size(hyper, "buffers")
        if buffers is not None and buffers > blt.MAX_BUFFERS:
            raise ValueError(f"buffers = {buffers}: at most {blt.MAX_BUFFERS} (optimisation is unstable beyond)")
        return buffers

    @staticmethod
    def sensitivity(fact, batches: int, epochs: int, steps: int | None = None) -> float:
        return fact.sensitivity(batches, epochs, steps=steps)

    @staticmethod
    def _describe(fact) -> dict:
        report = {k: v for k, v in fact.report.items()}
        return {"buffers": fact.buffers, "theta": fact.theta.tolist(), "theta_hat": fact.theta_hat.tolist(),
                "omega": fact.omega.tolist(), "omega_hat": fact.omega_hat.tolist(), **report}

    def noise(self, plan: Plan, seed: int, device) -> BLTNoise:
        fact = plan.extras["factorization"]
        return BLTNoise(fact.theta, fact.omega, plan.steps, seed, device)


# -- amplified BandMF ------------------------------------------------------------------------


def _candidates(most: int) -> list[int]:
    """A geometric grid of ratio ~sqrt(2): 1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, ... up to
    ``most``, and ``most`` itself."""
    out, x = {1, most}, 1.0
    while x <= most:
        out.add(int(round(x)))
        x *= math.sqrt(2)
    return sorted(b for b in out if b <= most)


def rdp_noise_multipliers(rates, rounds, target_epsilon: float, delta: float, rel_tol: float = 1e-3) -> np.ndarray:
    """For each (p_i, k_i): the smallest sigma (to relative ``rel_tol``, from above) whose
    k_i-fold Poisson-subsampled Gaussian at rate p_i is (target_epsilon, delta)-DP by the
    integer-order RDP bound (accounting.rdp_subsampled_gaussian / rdp_to_epsilon), all
    candidates bisected together in log sigma: one vectorised RDP evaluation per iteration."""
    rates, rounds = np.asarray(rates, dtype=np.float64), np.asarray(rounds, dtype=np.float64)

    def epsilons(sigmas):
        rdp = accounting.rdp_subsampled_gaussian(rates, sigmas) * rounds[:, None]
        return np.array([accounting.rdp_to_epsilon(row, delta) for row in rdp])

    lo, hi = np.full(rates.size, 1e-2), np.full(rates.size, accounting.MAX_NOISE_MULTIPLIER)
    if (epsilons(hi) > target_epsilon).any():
        raise ValueError(f"epsilon = {target_epsilon} is not reachable with sigma <= {accounting.MAX_NOISE_MULTIPLIER}")
    while (hi > (1 + rel_tol) * lo).any():
        mid = np.sqrt(lo * hi)
        ok = epsilons(mid) <= target_epsilon
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return hi


def choose_bands(n_train: int, batch_size: int, steps: int, target_epsilon: float, delta: float,
                 evaluate=None) -> tuple[int, list[dict]]:
    """b minimising the RMSE proxy sigma_b sqrt(err_mean(c_b)) over b in {1, ..., min(floor(N / L), T)}.

    sigma_b is calibrated for the amplified event with the integer-order RDP bound
    (``rdp_noise_multipliers``; jax_privacy's band search also uses RDP; the run itself is
    then calibrated with its own accountant) and c_b is banded.optimize's. The proxy is
    evaluated on a geometric grid of ratio ~sqrt(2) (b = 1 and floor(N / L) included), then
    refined around the best point by bisecting towards both neighbours until the bracket is
    narrow (at most max(2, b / 32) wide) or flat (both ends within 0.1% of the best). The
    proxy jumps where ceil(T / b) changes, so this is a search, not a proof of optimality;
    any b is private, the choice only affects utility. ``evaluate`` replaces the proxy
    (tests). Returns (b, the evaluations)."""
    most = min(n_train // batch_size, steps)
    if most < 1:
        raise ValueError(f"batch size {batch_size} exceeds the number of training examples {n_train}")
    cache: dict[int, dict] = {}

    def evaluate_all(bands: list[int]) -> None:
        new = [b for b in dict.fromkeys(bands) if b not in cache]
        if not new:
            return
        if evaluate is not None:
            cache.update({b: {"bands": b, "proxy": float(evaluate(b))} for b in new})
            return
        sigmas = rdp_noise_multipliers([cyclic_poisson.sample_rate(b, batch_size, n_train) for b in new],
                                       [cyclic_poisson.rounds(steps, b) for b in new], target_epsilon, delta)
        for b, sigma in zip(new, sigmas):
            err = banded.optimize(steps, b, column_normalize=True).error_mean()
            cache[b] = {"bands": b, "sigma_rdp": float(sigma), "error_mean": err,
                        "proxy": float(sigma) * math.sqrt(err)}

    def proxy(b: int) -> float:
        evaluate_all([b])
        return cache[b]["proxy"]

    grid = _candidates(most)
    evaluate_all(grid)
    best = min(grid, key=proxy)
    i = grid.index(best)
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    while hi - lo > max(2, best // 32) and max(proxy(lo), proxy(hi)) > (1 + 1e-3) * proxy(best):
        evaluate_all([b for b in ((lo + best) // 2, (best + hi + 1) // 2) if b not in (lo, best, hi)])
        points = sorted(b for b in cache if lo <= b <= hi)
        best = min(points, key=proxy)
        j = points.index(best)
        lo, hi = points[max(j - 1, 0)], points[min(j + 1, len(points) - 1)]
    return best, [cache[b] for b in sorted(cache)]


class AmplifiedBandedMechanism(StreamingMechanism):
    """``dpmatrix-band-amp``: BandMF with cyclic Poisson sampling (module docstring)."""

    name = "amplified-banded-matrix-factorization"
    audit = AuditSpec("banded-lr")

    def key(self, n_train: int, batch_size: int, epochs: int, run_config: Any = None) -> str:
        """The factorization a run needs: ``band-n<T>-b<b>`` for a given b; with ``bands`` = "auto"
        the band search's key, which names (N, L, T, target epsilon, delta)."""
        if not 1 <= batch_size <= n_train:
            raise ValueError(f"batch_size {batch_size} must be between 1 and the number of training examples {n_train}")
        hyper = dict(getattr(run_config, "hyperparameters", None) or {})
        steps = max(1, round(epochs * n_train / batch_size))  # T as for DP-SGD (Poisson sampling)
        bands = _size(hyper, "bands")
        if bands is None:
            target = getattr(run_config, "epsilon", None)
            if target is None:
                raise ValueError("dpmatrix-band-amp with bands = 'auto' chooses b for the target epsilon: give "
                                 "--epsilon, or set the hyperparameter bands explicitly")
            delta = getattr(run_config, "delta", accounting.DELTA)
            return streamed_factorization.band_search_key(n_train, batch_size, steps, target, delta)
        if bands > steps:
            raise ValueError(f"bands = {bands} exceeds the number of steps T = {steps}")
        cyclic_poisson.sample_rate(bands, batch_size, n_train)  # refuses b > N / L
        return streamed_factorization.band_key(steps, bands)

    def plan(self, n_train: int, batch_size: int, epochs: int, run_config: Any = None) -> Plan:
        key = self.key(n_train, batch_size, epochs, run_config)
        record, path = self.factorization(key, run_config)
        fact = record.strategy
        steps, bands = fact.n, fact.bands
        rate = cyclic_poisson.sample_rate(bands, batch_size, n_train)
        extras = {"factorization": fact, "factorization_key": key, "factorization_file": str(path), "bands": bands,
                  "rounds": cyclic_poisson.rounds(steps, bands), "max_column_norm": float(fact.column_norms().max()),
                  "band_search": record.band_search}
        return Plan(batch_size=batch_size, steps=steps, sample_rate=rate, extras=extras)

    def accounted_sigma(self, plan: Plan, noise_multiplier: float) -> float:
        """sigma of the accounted DP-SGD event: sigma_Z / (C_clip max_j ||C e_j||), in units
        of the clipping sensitivity (the step scales the noise by it)."""
        return noise_multiplier / plan.extras["max_column_norm"]

    def history(self, plan: Plan, noise_multiplier: float, steps: int) -> accounting.History:
        return cyclic_poisson.history(self.accounted_sigma(plan, noise_multiplier), plan.sample_rate, steps,
                                      plan.extras["bands"])

    def calibrate(self, plan: Plan, target_epsilon: float, delta: float, accountant: str) -> float:
        accounting.check_target(target_epsilon, delta)
        sigma = accounting.calibrate_noise_multiplier(target_epsilon, plan.sample_rate, plan.extras["rounds"], delta,
                                                      accountant)
        return sigma * plan.extras["max_column_norm"]

    def privacy_profile(self, plan: Plan, noise_multiplier: float, delta: float, accountant: str):
        """delta(eps) of the accounted event (DP-SGD with ceil(T / b) steps at rate p), from the
        accountant the run is calibrated with (PRV, both directions; or RDP): the claim the
        audit tests."""
        history = self.history(plan, noise_multiplier, plan.steps)
        if accountant == "rdp":
            return profiles.rdp_profile(history, orders=accounting.RDP_ORDERS)
        return profiles.prv_profile(history, accountant_delta=delta)

    def strategy_matrix(self, plan: Plan) -> np.ndarray:
        """The dense T x T (column-normalised, banded) strategy the release whitens by."""
        return plan.extras["factorization"].matrix()

    def report(self, plan: Plan, noise_multiplier: float, steps: int, delta: float, accountant: str) -> dict:
        fact, bands = plan.extras["factorization"], plan.extras["bands"]
        planned = accounting.epsilon(self.history(plan, noise_multiplier, plan.steps), delta, accountant)
        done_history = self.history(plan, noise_multiplier, steps)
        done = planned if steps == plan.steps else accounting.epsilon(done_history, delta, accountant)
        (sigma_acc, rate, rounds_done), = done_history or [(0.0, plan.sample_rate, 0)]
        return {
            "epsilon": done, "epsilon_planned": planned,
            "epsilon_rdp": accounting.epsilon(done_history, delta, "rdp"),
            # an independent cross-check: our own pessimistic PLD of the same event (dpbench.privacy.pld)
            "epsilon_pld": pld.epsilon(delta, rate, sigma_acc, rounds_done) if rounds_done else 0.0,
            "noise_multiplier": self.accounted_sigma(plan, noise_multiplier),
            "noise_multiplier_streamed": noise_multiplier,
            "sample_rate": plan.sample_rate, "planned_steps": plan.steps, "bands": bands,
            "rounds": plan.extras["rounds"], "rounds_taken": cyclic_poisson.rounds(steps, bands) if steps else 0,
            "accounted_event": (f"DP-SGD: {plan.extras['rounds']} = ceil(T / b) steps, Poisson rate p = b L / N = "
                                f"{plan.sample_rate:g}, noise multiplier sigma_Z / max_j ||C e_j|| "
                                "(Choquette-Choo et al. 2023, Thm. 4)"),
            "sampling": (f"cyclic Poisson: examples partitioned once into b = {bands} groups (each example's group "
                         f"drawn independently), step t samples group t mod b at rate p = {plan.sample_rate:g}"),
            "adjacency": "add/remove one example",
            "matrix": {"kind": "band", "steps": plan.steps, "bands": bands, "column_normalized": fact.column_normalize,
                       "max_column_norm": plan.extras["max_column_norm"],
                       "coefficients": [float(c) for c in fact.coef], "band_search": plan.extras["band_search"],
                       "key": plan.extras["factorization_key"], "factorization_file": plan.extras["factorization_file"],
                       "noise": "streamed (no noise file); its state is in checkpoints, which are private files",
                       **fact.report},
        }

    def sampler(self, plan: Plan, n_train: int, seed: int, device, lanes: int = 1):
        """Cyclic Poisson over lanes n_train examples: with independent groups and inclusions,
        that is ``lanes`` independent samplers, one per lane (cyclic_poisson.py)."""
        return cyclic_poisson.CyclicPoissonSampler(lanes * n_train, plan.extras["bands"], plan.sample_rate, seed,
                                                   device)

    def noise(self, plan: Plan, seed: int, device) -> BandedNoise:
        fact = plan.extras["factorization"]
        return BandedNoise(fact.coef, fact.scale(), seed, device)
