"""Buffered linear Toeplitz (BLT) strategies: C Toeplitz with a rational generating function.

Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and Near-Optimal Noise
Generation for Streaming Differential Privacy" (arXiv 2404.16706, Lemmas 5.2-5.3); McMahan,
Xu, Zhang et al., "A Hassle-free Algorithm for Private Learning in Practice: Don't Use Tree
Aggregation, Use BLTs" (arXiv 2408.08868); Kalinin & Lampert (arXiv 2405.13763, Thm. 2) for
the min-separation sensitivity. Cross-checked against google-deepmind/jax_privacy
``matrix_factorization/buffered_toeplitz.py`` and ``toeplitz.py``.

A BLT with m buffers has decays theta in (0, 1)^m and output scales omega in R^m; C is lower
triangular Toeplitz with c_0 = 1, c_k = sum_i omega_i theta_i^(k-1) (k >= 1). Its inverse is
the BLT (theta_hat, omega_hat) with the roots theta_hat of the numerator of c's generating
function; both are fixed by the pair (theta, theta_hat):

    omega_i     = prod_j (theta_i - theta_hat_j) / prod_{j != i} (theta_i - theta_j),
    omega_hat_i = prod_j (theta_hat_i - theta_j) / prod_{j != i} (theta_hat_i - theta_hat_j).

We keep to the interlaced class 1 > theta_1 > theta_hat_1 > theta_2 > ... > theta_hat_m > 0,
where omega > 0 and omega_hat < 0, and also require sum omega < 1 and sum omega_i / theta_i < 1.
Then c is positive and non-increasing (c_1 = sum omega < 1 = c_0), which makes the closed-form
sensitivities below exact.

* Streamed C^-1 z (state m x d): x = z - sum_i omega_i S_i, then S_i <- theta_i S_i + x.
* Error: C^-1 has Toeplitz coefficients h_0 = 1, h_k = sum_i omega_hat_i theta_hat_i^(k-1);
  B = A C^-1 has beta = cumsum(h), e_t = sum_{j <= t} beta_j^2 and
  err_mean = sum_j ((n - j) / n) beta_j^2.
* Sensitivity, single participation: the largest column is the first,
  sens^2 = 1 + sum_{i,j} omega_i omega_j (1 - (theta_i theta_j)^(n-1)) / (1 - theta_i theta_j).
* Sensitivity, Pi(b', k) (at most k participations any two >= b' apart; k' = min(k, ceil(n/b'))):
  for c >= 0 non-increasing the worst pattern is {0, b', 2b', ...} with equal contributions
  (Kalinin & Lampert 2024, Thm. 2), so sens^2 = ||u||^2 with
  u_j = sum_{m <= min(k'-1, floor(j / b'))} c_{j - m b'} (exact, O(n)). Since C >= 0 entrywise,
  X = C^T C >= 0 and equal contributions are the worst signs too.
* Optimisation: minimise sens^2 * err_mean over (theta, theta_hat) for the run's (n, b', k),
  derivative-free (theta = sigmoid(u), loss +inf outside the class; Nelder-Mead from 8
  random interlaced starts, then Powell from the best two). The number of buffers m grows from 1 while the
  loss improves by more than 1% (at most 8). At m >= 3 with several participations the
  optimum can degenerate (theta_1 -> 1 with omega_1 ~ 0: a buffer that does nothing while
  its decay hugs the class boundary); such a solution is not accepted and m stops growing.
BLT is not banded: it runs unamplified. It must not be column-normalised (its sensitivity
formulas assume the Toeplitz structure).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import optimize as sp_optimize

from dpbench.matrix.banded import max_participations

MAX_BUFFERS = 8
IMPROVEMENT = 0.01  # grow m while the loss improves by more than this fraction
STARTS = 8
DEGENERATE_OMEGA = 1e-6  # a buffer with omega_i < this fraction of sum(omega) does nothing
DEGENERATE_THETA = 1 - 1e-7  # a decay this close to 1 sits on the class boundary


def output_scales(theta: np.ndarray, theta_hat: np.ndarray) -> np.ndarray:
    """omega_i = prod_j (theta_i - theta_hat_j) / prod_{j != i} (theta_i - theta_j)."""
    theta, theta_hat = np.asarray(theta, dtype=np.float64), np.asarray(theta_hat, dtype=np.float64)
    num = np.prod(theta[:, None] - theta_hat[None, :], axis=1)
    diff = theta[:, None] - theta[None, :]
    np.fill_diagonal(diff, 1.0)
    return num / np.prod(diff, axis=1)


@dataclass(frozen=True)
class BLT:
    """C = BLT(theta, omega) and C^-1 = BLT(theta_hat, omega_hat), used for n steps."""

    theta: np.ndarray
    theta_hat: np.ndarray
    n: int
    report: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_pair(cls, theta, theta_hat, n: int) -> "BLT":
        theta = np.atleast_1d(np.asarray(theta, dtype=np.float64))
        theta_hat = np.atleast_1d(np.asarray(theta_hat, dtype=np.float64))
        if theta.shape != theta_hat.shape or theta.ndim != 1:
            raise ValueError(f"theta and theta_hat must be vectors of one length, got {theta.shape}, "
                             f"{theta_hat.shape}")
        return cls(theta, theta_hat, int(n))

    @property
    def buffers(self) -> int:
        return int(self.theta.size)

    @property
    def omega(self) -> np.ndarray:
        return output_scales(self.theta, self.theta_hat)

    @property
    def omega_hat(self) -> np.ndarray:
        return output_scales(self.theta_hat, self.theta)

    def in_class(self) -> bool:
        """Interlaced, sum omega < 1 and sum omega / theta < 1 (module docstring)."""
        return in_class(self.theta, self.theta_hat)

    def coefficients(self, n: int | None = None) -> np.ndarray:
        """c_0 .. c_{n-1}, the Toeplitz coefficients of C."""
        return toeplitz_coefficients(self.theta, self.omega, self.n if n is None else n)

    def noising_coefficients(self, n: int | None = None) -> np.ndarray:
        """h_0 .. h_{n-1}, the Toeplitz coefficients of C^-1."""
        return toeplitz_coefficients(self.theta_hat, self.omega_hat, self.n if n is None else n)

    def per_step_error(self) -> np.ndarray:
        beta = np.cumsum(self.noising_coefficients())
        return np.cumsum(beta * beta)

    def error_mean(self) -> float:
        return error_mean(self.noising_coefficients())

    def error_max(self) -> float:
        return float(self.per_step_error()[-1])

    def sensitivity(self, min_separation: int | None = None, participations: int | None = 1,
                    steps: int | None = None) -> float:
        """sens of C (or of C[:steps, :steps]) under Pi(b', k); single participation by default."""
        n = self.n if steps is None else int(steps)
        if n <= 0:
            return 0.0
        if not self.in_class():
            raise ValueError("the closed-form BLT sensitivity needs the interlaced class (c >= 0, non-increasing)")
        k = 1 if participations == 1 else max_participations(n, min_separation, participations)
        if k == 1:
            return math.sqrt(single_sensitivity_squared(self.theta, self.omega, n))
        return math.sqrt(min_sep_sensitivity_squared(self.coefficients(n), min_separation, k))

    def matrix(self) -> np.ndarray:
        from scipy.linalg import toeplitz

        return toeplitz(self.coefficients(), np.zeros(self.n))


def in_class(theta: np.ndarray, theta_hat: np.ndarray) -> bool:
    m = theta.size
    inter = np.empty(2 * m)
    inter[0::2], inter[1::2] = theta, theta_hat
    if not (inter[0] < 1 and inter[-1] > 0 and np.all(np.diff(inter) < 0)):
        return False
    omega = output_scales(theta, theta_hat)
    return bool(omega.sum() < 1 and (omega / theta).sum() < 1)


def toeplitz_coefficients(theta: np.ndarray, omega: np.ndarray, n: int) -> np.ndarray:
    """(1, sum_i omega_i, sum_i omega_i theta_i, ..., sum_i omega_i theta_i^(n-2))."""
    out = np.empty(n)
    out[0] = 1.0
    if n > 1:
        powers = np.exp(np.arange(n - 1)[:, None] * np.log(theta)[None, :])
        out[1:] = powers @ omega
    return out


def error_mean(noising_coef: np.ndarray) -> float:
    """err_mean = sum_j ((n - j) / n) beta_j^2 with beta = cumsum(h)."""
    n = noising_coef.size
    beta = np.cumsum(noising_coef)
    return float(((n - np.arange(n)) / n) @ (beta * beta))


def single_sensitivity_squared(theta: np.ndarray, omega: np.ndarray, n: int) -> float:
    """||C e_0||^2 = 1 + sum_{i,j} omega_i omega_j (1 - (theta_i theta_j)^(n-1)) / (1 - theta_i theta_j)."""
    tt = theta[:, None] * theta[None, :]
    return float(1.0 + (np.outer(omega, omega) * (-np.expm1((n - 1) * np.log(tt))) / (1.0 - tt)).sum())


def min_sep_sensitivity_squared(coef: np.ndarray, min_separation: int, participations: int) -> float:
    """||u||^2, u_j = sum_{m <= min(k-1, floor(j / b'))} c_{j - m b'}: the column sum of C over
    the pattern {0, b', ..., (k-1) b'} (exact for c >= 0 non-increasing)."""
    n, b = coef.size, int(min_separation)
    rows = -(-n // b)
    padded = np.zeros(rows * b)
    padded[:n] = coef
    u = np.cumsum(padded.reshape(rows, b), axis=0).ravel()
    k = int(participations)
    if k * b < u.size:
        u[k * b:] -= u[:u.size - k * b].copy()
    u = u[:n]
    return float(u @ u)


# -- optimisation --------------------------------------------------------------------------


class Loss:
    """sens^2 err_mean of a BLT pair for n steps under Pi(b', k') (k' = ``participations``),
    +inf outside the class. Written for speed (the optimiser calls it ~10^5 times): the
    arrays that depend only on n are made once, and each call is one pass over n."""

    def __init__(self, n: int, min_separation: int, participations: int):
        self.n, self.min_separation, self.participations = int(n), int(min_separation), int(participations)
        self.weights = (n - np.arange(n)) / n
        self._powers = np.empty((0, n - 1))

    def powers(self, theta: np.ndarray) -> np.ndarray:
        """theta_i^k for k = 0 .. n-2, shape (m, n-1) (a running product: 3x faster than exp)."""
        if self._powers.shape[0] != theta.size:
            self._powers = np.empty((theta.size, self.n - 1))
        p = self._powers
        p[:, 0] = 1.0
        p[:, 1:] = theta[:, None]
        return np.cumprod(p, axis=1, out=p)

    def __call__(self, theta: np.ndarray, theta_hat: np.ndarray) -> float:
        m = theta.size
        inter = np.empty(2 * m)
        inter[0::2], inter[1::2] = theta, theta_hat
        if not (inter[0] < 1 and inter[-1] > 0 and (inter[1:] < inter[:-1]).all()):
            return math.inf
        omega, omega_hat = output_scales(theta, theta_hat), output_scales(theta_hat, theta)
        if not (omega.sum() < 1 and (omega / theta).sum() < 1):
            return math.inf
        # C^-1 coefficients h, beta = cumsum(h), err_mean = sum_j (n - j)/n beta_j^2
        beta = np.empty(self.n)
        beta[0] = 1.0
        np.cumsum(omega_hat @ self.powers(theta_hat), out=beta[1:])
        beta[1:] += 1.0
        err = float(self.weights @ (beta * beta))
        if self.participations == 1:
            return single_sensitivity_squared(theta, omega, self.n) * err
        c = np.empty(self.n)
        c[0] = 1.0
        c[1:] = omega @ self.powers(theta)
        return min_sep_sensitivity_squared(c, self.min_separation, self.participations) * err


def loss(theta: np.ndarray, theta_hat: np.ndarray, n: int, min_separation: int, participations: int) -> float:
    """sens^2 err_mean for Pi(b', k'), +inf outside the class (see ``Loss``)."""
    return Loss(n, min_separation, participations)(np.asarray(theta, float), np.asarray(theta_hat, float))


def _logit(x):
    return np.log(x) - np.log1p(-x)


def _sigmoid(u):
    return 0.5 * (1.0 + np.tanh(0.5 * u))


def _split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x[0::2], x[1::2]


def random_start(buffers: int, rng: np.random.Generator) -> np.ndarray:
    """A random interlaced (theta_1, theta_hat_1, ..., theta_hat_m) in the class: decays spread
    on a log scale towards 1, omega kept small enough."""
    for _ in range(1000):
        x = np.sort(1.0 - np.exp(-rng.uniform(0.0, 10.0, 2 * buffers)))[::-1]
        if np.all(np.diff(x) < 0) and in_class(*_split(x)):
            return x
    raise RuntimeError(f"no random interlaced start found for m = {buffers}")


def _optimize_buffers(n: int, min_separation: int, participations: int, buffers: int, seed: int,
                      starts: int = STARTS, polish: int = 2) -> tuple[float, np.ndarray]:
    """Nelder-Mead from ``starts`` random interlaced starts, then Powell from the ``polish``
    best of them; the best point found."""
    rng = np.random.default_rng([seed, buffers])

    objective = Loss(n, min_separation, participations)

    def f(u):
        x = _sigmoid(u)
        return objective(x[0::2], x[1::2])

    dim = 2 * buffers
    found = []
    with np.errstate(all="ignore"):  # +inf losses outside the class confuse nothing but warnings
        for _ in range(starts):
            u0 = _logit(random_start(buffers, rng))
            res = sp_optimize.minimize(f, u0, method="Nelder-Mead", options={
                "maxfev": 200 * dim, "xatol": 1e-6, "fatol": 1e-10, "adaptive": dim > 4})
            found.append((float(res.fun), res.x))
        found.sort(key=lambda r: r[0])
        for value, u in found[:polish]:
            res = sp_optimize.minimize(f, u, method="Powell", options={"maxfev": 200 * dim, "xtol": 1e-6,
                                                                      "ftol": 1e-10})
            if res.fun < value:
                found.append((float(res.fun), res.x))
    value, u = min(found, key=lambda r: r[0])
    return value, _sigmoid(u)


def degenerate(theta: np.ndarray, theta_hat: np.ndarray) -> bool:
    """A buffer that contributes nothing (omega_i ~ 0) or a decay on the class boundary."""
    omega = output_scales(theta, theta_hat)
    return bool(np.any(omega < DEGENERATE_OMEGA * omega.sum()) or theta[0] > DEGENERATE_THETA)


def optimize(n: int, min_separation: int | None = None, participations: int = 1, buffers: int | None = None,
             seed: int = 0, max_buffers: int = MAX_BUFFERS) -> BLT:
    """The BLT minimising sens^2 err_mean for n steps under Pi(b', k) (single participation by
    default). ``buffers`` fixes m; None grows m from 1 while the loss improves by more than 1%,
    up to ``max_buffers``, refusing degenerate optima (module docstring). Deterministic in
    (n, b', k, buffers, seed)."""
    if n < 2:
        raise ValueError(f"a BLT needs n >= 2 steps, got {n}")
    k = 1 if participations == 1 else max_participations(n, min_separation, participations)
    b = n if k == 1 else int(min_separation)
    t0 = time.perf_counter()
    tried = []
    if buffers is not None:
        if not 1 <= buffers <= max_buffers:
            raise ValueError(f"buffers must be in [1, {max_buffers}], got {buffers}")
        value, x = _optimize_buffers(n, b, k, buffers, seed)
        tried.append({"buffers": buffers, "loss": value, "degenerate": degenerate(*_split(x))})
    else:
        value, x = math.inf, None
        for m in range(1, max_buffers + 1):
            v, xm = _optimize_buffers(n, b, k, m, seed)
            bad = degenerate(*_split(xm))
            tried.append({"buffers": m, "loss": v, "degenerate": bad})
            if bad or not v < (1.0 - IMPROVEMENT) * value:
                if x is None:  # even m = 1 degenerate: keep it, it is still a valid BLT
                    value, x = v, xm
                break
            value, x = v, xm
    if x is None or not math.isfinite(value):
        raise RuntimeError(f"BLT optimisation found no strategy in the class for n = {n}, b' = {b}, k = {k}")
    fact = BLT.from_pair(*_split(x), n)
    fact.report.update({
        "method": f"Nelder-Mead from {STARTS} random interlaced starts per m, then Powell from the best two, "
                  "on sens^2 err_mean over (theta, theta_hat)",
        "loss": value, "tried": tried, "participations": k, "min_separation": b,
        "seconds": time.perf_counter() - t0, "error_mean": fact.error_mean(), "error_max": fact.error_max(),
    })
    return fact
