"""Single-epoch factorization: the fixed-point iteration of Denisov et al. (2022).

    min_X tr(M X^-1)  subject to  X = C^T C > 0,  max_i X_ii <= 1      (thesis eq. 2.29)

with M = W^T W for the objective workload W (A, or Lambda_tau A). For a diagonal matrix of
multipliers V = diag(v) the Lagrangian is minimised by

    X(v) = V^-1/2 (V^1/2 M V^1/2)^1/2 V^-1/2                           (eq. 2.36)

and the iteration is v <- omega(v) = diag((V^1/2 M V^1/2)^1/2) = v * diag(X(v))  (eq. 2.34).
That is multiplicative ascent on the concave dual

    g(v) = 2 tr((V^1/2 M V^1/2)^1/2) - sum(v),   dg/dv_i = X(v)_ii - 1,

so every iterate gives a lower bound g(v) on the optimum and a feasible point
X(v) / max_i X(v)_ii (eq. 2.37) whose objective max_i X(v)_ii * tr((V^1/2 M V^1/2)^1/2) is an
upper bound: the iteration stops when the relative duality gap is below ``tol``.

Fast path: when M^-1 is tridiagonal (both of our workloads), V^-1/2 M^-1 V^-1/2 is tridiagonal
and its eigendecomposition (scipy.linalg.eigh_tridiagonal, MRRR) costs O(T^2), not O(T^3).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from scipy import linalg

from dpbench.matrix.workload import gram_inverse, gram_inverse_tridiagonal


@dataclass
class Solution:
    """A feasible Gram matrix X = C^T C with sensitivity exactly 1, and its certificate."""

    gram: np.ndarray
    primal_value: float  # tr(W^T W X^-1) at the returned X (an upper bound on the optimum)
    dual_value: float  # a lower bound on the optimum
    iterations: int
    converged: bool
    seconds: float
    method: str
    multipliers: np.ndarray = field(repr=False, default=None)
    history: list = field(repr=False, default_factory=list)

    @property
    def duality_gap(self) -> float:
        return self.primal_value - self.dual_value

    @property
    def relative_gap(self) -> float:
        return self.duality_gap / self.primal_value


class DiagonalDual:
    """h(u) = tr((U^1/2 M U^1/2)^1/2) and diag X(u) for a diagonal U = diag(u)."""

    def __init__(self, workload: np.ndarray, force_dense: bool = False):
        tri = None if force_dense else gram_inverse_tridiagonal(workload)
        self.tridiagonal = tri is not None
        if self.tridiagonal:
            self.diag, self.off = tri
        else:
            self.m_inv = gram_inverse(workload)

    def _eig(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = 1.0 / np.sqrt(u)
        if self.tridiagonal:  # eigenpairs of U^-1/2 M^-1 U^-1/2 = (U^1/2 M U^1/2)^-1
            mu, q = linalg.eigh_tridiagonal(self.diag * s * s, self.off * s[:-1] * s[1:], check_finite=False)
        else:
            mu, q = linalg.eigh(self.m_inv * np.outer(s, s), driver="evd", check_finite=False)
        if mu.min() <= 0:
            raise FloatingPointError("U^1/2 M U^1/2 is not numerically positive definite")
        return mu, q

    def __call__(self, u: np.ndarray) -> tuple[float, np.ndarray]:
        mu, q = self._eig(u)
        r = mu ** -0.5
        return float(r.sum()), (q * q) @ r / u

    def gram(self, u: np.ndarray) -> np.ndarray:
        """X(u) = U^-1/2 (U^1/2 M U^1/2)^1/2 U^-1/2."""
        mu, q = self._eig(u)
        f = (q * mu ** -0.25) / np.sqrt(u)[:, None]
        x = f @ f.T
        return (x + x.T) / 2


def fixed_point(workload: np.ndarray, *, tol: float = 1e-6, max_iter: int = 20000,
                log: Callable[[str], None] | None = None, log_every: int = 25,
                force_dense: bool = False) -> Solution:
    """Denisov et al.'s fixed point for min tr(W^T W X^-1) s.t. max_i X_ii <= 1."""
    t0 = time.perf_counter()
    dual_fn = DiagonalDual(workload, force_dense)
    v = np.ones(workload.shape[0])
    history = []
    best = None  # (primal, v, max diag) of the best feasible point seen
    dual = -np.inf
    it = 0
    while True:
        h, xdiag = dual_fn(v)
        dual = max(dual, 2 * h - v.sum())
        primal = float(xdiag.max() * h)
        if best is None or primal < best[0]:
            best = (primal, v.copy(), float(xdiag.max()))
        gap = (best[0] - dual) / best[0]
        history.append((it, best[0], dual))
        if log and (it % log_every == 0 or gap <= tol):
            log(f"fixed point {it:5d}: primal {best[0]:.8g} dual {dual:.8g} relative gap {gap:.2e} "
                f"({time.perf_counter() - t0:.1f}s)")
        if gap <= tol or it >= max_iter:
            break
        v = v * xdiag  # v <- omega(v), thesis eq. 2.34
        it += 1
    primal, v, scale = best
    x = dual_fn.gram(v) / scale  # eq. 2.37: max_i X_ii = 1
    return Solution(gram=x, primal_value=primal, dual_value=float(dual), iterations=it,
                    converged=bool((primal - dual) / primal <= tol), seconds=time.perf_counter() - t0,
                    method="fixed point (Denisov et al. 2022)" + ("" if dual_fn.tridiagonal else ", dense"),
                    multipliers=v, history=history)
