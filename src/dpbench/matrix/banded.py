"""Banded Toeplitz BandMF: the strategy C with b bands and Toeplitz coefficients c.

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix
Factorization: A unified approach to private training", NeurIPS 2023 (arXiv 2306.08153);
McKenna, "Scaling up the Banded Matrix Factorization Mechanism for Differentially Private
ML" (arXiv 2405.15913). Cross-checked against google-deepmind/jax_privacy
``matrix_factorization/toeplitz.py`` and ``sensitivity.py``.

Notation: n steps, A the n x n prefix-sum workload, C lower triangular Toeplitz with
C[i, j] = c_{i-j} for 0 <= i - j < b and 0 otherwise (b = 1 is DP-SGD, b = n dense Toeplitz).

* Error. C^-1 is lower triangular Toeplitz too, and so is B = A C^-1; its coefficients are
  beta = C^-1 1 (forward substitution, ``scipy.signal.lfilter([1], c, ones(n))``). Row t of B
  is (beta_t, ..., beta_0), so the squared error of the t-th prefix sum at unit noise is
  e_t = sum_{j <= t} beta_j^2, err_max = e_{n-1} and err_mean = sum_j ((n - j) / n) beta_j^2.
* Sensitivity. Column i of C is supported on rows i .. i + b - 1, so columns b or more apart
  are orthogonal. Under Pi(b', k) participation (at most k participations, any two >= b'
  steps apart) with b' >= b, one example's contribution C sum_{i in pi} e_i g_i^T has squared
  Frobenius norm sum_{i in pi} ||C e_i||^2 ||g_i||^2 whatever the directions g_i, so
  sens^2 = max_pi sum_{i in pi} v_i with v_i = ||C e_i||^2: the VecSens dynamic programme
  (Alg. 3 of the BandMF paper). If b' < b, columns of one pattern overlap and that formula
  is not an upper bound: we refuse.
* Column normalisation. C D^-1 with D = diag(||C e_i||) has unit columns (only the last b - 1
  differ from ||c||); its inverse is D C^-1, so the noise of step t is scaled by d_t, and
  sens^2 = k' = min(k, ceil(n / b')) exactly.
* Optimisation (single participation, which also serves Pi(b', k) with b' >= b: there
  sens^2 = k' ||c||^2 for every c, a constant factor). Minimise f(c) = ||c||^2 E(c),
  E = sum_j w_j beta_j^2, w_j = (n - j) / n, with the analytic gradient
  lambda = C^-T (2 w . beta) (lfilter on the reversed vector, reversed back) and
  df/dc_r = 2 c_r E - ||c||^2 sum_{j >= r} lambda_j beta_{j-r}, by L-BFGS-B from the
  square-root coefficients (c_0 = 1, c_j = c_{j-1} (2j - 1) / (2j): the Toeplitz square root
  of A, Fichtenberger, Henzinger & Upadhyay 2022), truncated to b. f is invariant to scaling
  c, so the result is returned as c / ||c||.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import optimize as sp_optimize
from scipy import signal


def sqrt_coefficients(bands: int) -> np.ndarray:
    """c_0 = 1, c_j = c_{j-1} (2j - 1) / (2j): the first ``bands`` coefficients of A^(1/2)."""
    if bands < 1:
        raise ValueError(f"the number of bands must be >= 1, got {bands}")
    j = np.arange(1, bands)
    return np.concatenate([[1.0], np.cumprod((2 * j - 1) / (2 * j))])


def _check(coef: np.ndarray, n: int) -> np.ndarray:
    coef = np.asarray(coef, dtype=np.float64)
    if coef.ndim != 1 or coef.size < 1:
        raise ValueError(f"Toeplitz coefficients must be a non-empty vector, got shape {coef.shape}")
    if coef[0] == 0:
        raise ValueError("c_0 must be non-zero (C must be invertible)")
    if coef.size > n:
        raise ValueError(f"{coef.size} bands for n = {n} steps: at most n bands")
    return coef


def decoder_coefficients(coef: np.ndarray, n: int) -> np.ndarray:
    """beta = C^-1 1: the Toeplitz coefficients of B = A C^-1."""
    coef = _check(coef, n)
    return signal.lfilter([1.0], coef, np.ones(n))


def noising_coefficients(coef: np.ndarray, n: int) -> np.ndarray:
    """h = C^-1 e_0: the Toeplitz coefficients of C^-1."""
    coef = _check(coef, n)
    impulse = np.zeros(n)
    impulse[0] = 1.0
    return signal.lfilter([1.0], coef, impulse)


def column_norms(coef: np.ndarray, n: int, rows: int | None = None) -> np.ndarray:
    """||C[:rows, i]|| for i < rows (rows = n by default): sqrt(sum_{r < min(b, rows - i)} c_r^2)."""
    coef = _check(coef, n)
    rows = n if rows is None else rows
    cum = np.cumsum(coef ** 2)
    i = np.arange(rows)
    return np.sqrt(cum[np.minimum(coef.size, rows - i) - 1])


def normalisation(coef: np.ndarray, n: int, column_normalize: bool) -> np.ndarray:
    """d with C_used = C D^-1: the column norms of C if ``column_normalize`` else ones."""
    return column_norms(coef, n) if column_normalize else np.ones(n)


def strategy_matrix(coef: np.ndarray, n: int, column_normalize: bool = False) -> np.ndarray:
    """The dense n x n strategy matrix (for tests and small n)."""
    coef = _check(coef, n)
    col = np.zeros(n)
    col[:coef.size] = coef
    from scipy.linalg import toeplitz

    c = toeplitz(col, np.zeros(n))
    return c / normalisation(coef, n, column_normalize)[None, :]


def per_step_error(coef: np.ndarray, n: int, column_normalize: bool = False) -> np.ndarray:
    """e_t = ||(A C_used^-1)[t, :]||^2, t = 0..n-1 (squared error of the t-th prefix sum at
    unit noise). Without normalisation e = cumsum(beta^2). With it, C_used^-1 = D C^-1 where
    d_s = ||c|| except for the last b - 1 rows, so e_t = ||c||^2 cumsum(beta^2)_t for
    t < n - b + 1 and the last b - 1 rows are accumulated directly (O(b n))."""
    coef = _check(coef, n)
    beta = decoder_coefficients(coef, n)
    err = np.cumsum(beta ** 2)
    if not column_normalize:
        return err
    d = column_norms(coef, n)
    b, first = coef.size, n - coef.size + 1
    out = err * d[0] ** 2
    if b == 1:
        return out
    h = noising_coefficients(coef, n)
    j = np.arange(n)
    lag = np.arange(first, n)[:, None] - j[None, :]  # s - j for the last b - 1 rows s
    rows = np.where(lag >= 0, h[np.clip(lag, 0, None)], 0.0) * d[first:, None]
    base = np.where(j <= first - 1, beta[np.clip(first - 1 - j, 0, None)], 0.0) * d[0]
    acc = base[None, :] + np.cumsum(rows, axis=0)
    out[first:] = np.einsum("ij,ij->i", acc, acc)
    return out


def error_mean(coef: np.ndarray, n: int, column_normalize: bool = False) -> float:
    return float(per_step_error(coef, n, column_normalize).mean())


def error_max(coef: np.ndarray, n: int, column_normalize: bool = False) -> float:
    return float(per_step_error(coef, n, column_normalize).max())


# -- optimisation --------------------------------------------------------------------------


def objective_and_gradient(coef: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """f(c) = ||c||^2 sum_j w_j beta_j^2 (w_j = (n - j) / n) and its gradient."""
    coef = np.asarray(coef, dtype=np.float64)
    b = coef.size
    beta = signal.lfilter([1.0], coef, np.ones(n))
    w = (n - np.arange(n)) / n
    energy = float(w @ (beta * beta))
    norm2 = float(coef @ coef)
    lam = signal.lfilter([1.0], coef, (2.0 * w * beta)[::-1])[::-1]
    # sum_{j >= r} lam_j beta_{j - r} for r = 0 .. b - 1
    corr = signal.correlate(lam, beta, mode="full", method="auto")[n - 1: n - 1 + b]
    grad = 2.0 * coef * energy - norm2 * corr
    return norm2 * energy, grad


@dataclass(frozen=True)
class BandedToeplitz:
    """A banded Toeplitz strategy: coefficients c (||c|| = 1), the number of steps n it is
    used for, and whether its columns are normalised."""

    coef: np.ndarray
    n: int
    column_normalize: bool
    report: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def bands(self) -> int:
        return int(self.coef.size)

    def scale(self) -> np.ndarray:
        """d_t: step t's noise x_t (C x = z) is multiplied by d_t (1 / column scaling of C)."""
        return normalisation(self.coef, self.n, self.column_normalize)

    def column_norms(self, rows: int | None = None) -> np.ndarray:
        """||C_used[:rows, i]||, i < rows: the columns of the (prefix of the) used strategy."""
        rows = self.n if rows is None else rows
        return column_norms(self.coef, self.n, rows) / self.scale()[:rows]

    def error_mean(self) -> float:
        return error_mean(self.coef, self.n, self.column_normalize)

    def error_max(self) -> float:
        return error_max(self.coef, self.n, self.column_normalize)

    def matrix(self) -> np.ndarray:
        return strategy_matrix(self.coef, self.n, self.column_normalize)


def optimize(n: int, bands: int, *, column_normalize: bool = True, max_iterations: int = 5000) -> BandedToeplitz:
    """The banded Toeplitz strategy minimising the mean squared prefix-sum error at
    single-participation sensitivity (see the module docstring), as c / ||c||.

    f is invariant to scaling c, so c_0 = 1 is fixed and c_1 .. c_{b-1} are optimised in the
    box [0, 1] (the optimum for prefix sums has positive, decreasing coefficients; the box
    also keeps C^-1 from overflowing during line searches; ``report["active_bounds"]``
    counts coefficients that end on it). With ``column_normalize`` the returned strategy's
    columns are rescaled to norm 1; the coefficients themselves are optimised without it
    (McKenna 2024 finds the general column-normalised optimum within ~0.5% for n >= 1000)."""
    if not 1 <= bands <= n:
        raise ValueError(f"bands must be in [1, n] = [1, {n}], got {bands}")
    t0 = time.perf_counter()
    start = sqrt_coefficients(bands)
    message, iterations = "b = 1: nothing to optimise", 0
    coef = start
    if bands > 1:
        f0 = objective_and_gradient(start, n)[0]  # f scaled to 1 at the start

        def scaled(tail):
            with np.errstate(over="ignore", invalid="ignore"):
                f, g = objective_and_gradient(np.concatenate([[1.0], tail]), n)
            if not (np.isfinite(f) and np.isfinite(g).all()):
                return 1e30, np.zeros_like(tail)  # an overshooting line-search step: backtrack
            return f / f0, g[1:] / f0

        res = sp_optimize.minimize(scaled, start[1:], jac=True, method="L-BFGS-B", bounds=[(0.0, 1.0)] * (bands - 1),
                                   options={"maxiter": max_iterations, "maxcor": 30, "ftol": 1e-15, "gtol": 1e-11})
        # "ABNORMAL" is L-BFGS-B's line search failing to improve at the optimum's precision
        if not (np.isfinite(res.x).all() and res.fun <= 1.0):
            raise RuntimeError(f"banded Toeplitz optimisation failed for n = {n}, b = {bands}: {res.message}")
        coef, iterations, message = np.concatenate([[1.0], res.x]), int(res.nit), str(res.message)
    coef = coef / np.linalg.norm(coef)
    fact = BandedToeplitz(coef, n, column_normalize)
    fact.report.update({
        "method": "L-BFGS-B on ||c||^2 sum_j w_j beta_j^2 from the square-root coefficients (McKenna 2024)",
        "iterations": iterations, "message": message, "seconds": time.perf_counter() - t0,
        "active_bounds": int(((coef[1:] <= 0) | (coef[1:] >= coef[0])).sum()),
        "error_mean": fact.error_mean(), "error_max": fact.error_max(),
    })
    return fact


# -- sensitivity ---------------------------------------------------------------------------


def max_participations(n: int, min_separation: int, participations: int | None = None) -> int:
    """k' = min(k, ceil(n / b')): the most participations Pi(b', k) allows in n steps."""
    if min_separation < 1:
        raise ValueError(f"the minimum separation b' must be >= 1, got {min_separation}")
    most = -(-n // min_separation)
    return most if participations is None else min(int(participations), most)


def vecsens(values: np.ndarray, min_separation: int, participations: int | None = None) -> float:
    """max over index sets pi with |pi| <= k, any two indices >= b' apart, of sum_{i in pi} v_i
    (Alg. 3 of the BandMF paper): F_j(i) = max(v_i + F_{j-1}(i + b'), F_j(i + 1)), i.e.
    F_j = reverse running max of (v + F_{j-1} shifted by b')."""
    v = np.asarray(values, dtype=np.float64)
    n = v.size
    k = max_participations(n, min_separation, participations)
    prev = np.zeros(n + min_separation)
    for _ in range(k):
        cur = np.zeros(n + min_separation)
        cur[:n] = np.maximum.accumulate((v + prev[min_separation: min_separation + n])[::-1])[::-1]
        prev = cur
    return float(prev[0]) if n else 0.0


def sensitivity(fact: BandedToeplitz, min_separation: int, participations: int | None = None,
                steps: int | None = None) -> float:
    """L2 sensitivity of C_used (or of its first ``steps`` releases, C_used[:steps, :steps])
    under Pi(b', k). Valid only when b' >= b (refused otherwise)."""
    if min_separation < fact.bands:
        raise ValueError(
            f"banded sensitivity needs the minimum separation b' = {min_separation} to be at least the "
            f"number of bands b = {fact.bands}: with b' < b one example's columns overlap and "
            "sum_i ||C e_i||^2 is not an upper bound; use fewer bands (b <= steps per epoch)")
    rows = fact.n if steps is None else int(steps)
    if rows <= 0:
        return 0.0
    v = fact.column_norms(rows) ** 2
    return math.sqrt(vecsens(v, min_separation, participations))
