"""Workload matrices: what the released noisy gradients are used for.

SGD without momentum releases the prefix sums of the (privatised) gradients, so the workload
is A = the T x T lower-triangular matrix of ones (thesis section 2.2.5). The convergence-aware
variants (Koloskova et al. 2023, thesis eq. 2.57) optimise the factorization for Lambda_tau A
instead; the mechanism still releases A G_hat (decoding with Lambda_tau A C^-1, as the thesis
authors' released code did, adds noise about sqrt(T) too small before the last step and breaks the
privacy guarantee).

Both workloads are lower triangular and invertible, and (W^T W)^-1 is tridiagonal for both:
A^-1 is the difference operator, and Lambda_tau A is block diagonal with tau x tau blocks of
row-scaled prefix sums. The solvers use that for an O(T^2) iteration.
"""

from __future__ import annotations

import math

import numpy as np


def prefix_sum(steps: int) -> np.ndarray:
    """A: the T x T lower-triangular matrix of ones, (A G)_t = g_1 + ... + g_t."""
    if steps < 1:
        raise ValueError(f"the number of steps must be positive, got {steps}")
    return np.tri(steps, dtype=np.float64)


def restart_weights(steps: int, tau: int) -> np.ndarray:
    """Lambda_tau of thesis eq. 2.57 (1-based t, j):

    lambda_tj = 1/sqrt(tau)   if j = t, t != 0 mod tau
              = -1/sqrt(tau)  if j = floor(t/tau) tau, t != 0 mod tau, t > tau
              = 1             if j = t, t = 0 mod tau
              = -1            if j = t - tau, t = 0 mod tau, t > tau
    """
    if not 1 <= tau <= steps:
        raise ValueError(f"tau must be in [1, T] = [1, {steps}], got {tau}")
    lam = np.zeros((steps, steps))
    r = 1.0 / math.sqrt(tau)
    for t in range(1, steps + 1):
        if t % tau:
            lam[t - 1, t - 1] = r
            if t > tau:
                lam[t - 1, (t // tau) * tau - 1] = -r
        else:
            lam[t - 1, t - 1] = 1.0
            if t > tau:
                lam[t - 1, t - tau - 1] = -1.0
    return lam


def objective_workload(steps: int, tau: int | None = None) -> np.ndarray:
    """The matrix whose error the factorization minimises: A, or Lambda_tau A if tau is given."""
    a = prefix_sum(steps)
    return a if tau is None else restart_weights(steps, tau) @ a


def gram_inverse_tridiagonal(workload: np.ndarray, rtol: float = 1e-10) -> tuple[np.ndarray, np.ndarray] | None:
    """(diagonal, off-diagonal) of M^-1 = (W^T W)^-1 if it is tridiagonal (to rtol), else None.

    W is lower triangular, so M^-1 = W^-1 W^-T with W^-1 from one triangular solve."""
    from scipy.linalg import solve_triangular

    n = workload.shape[0]
    if not np.allclose(workload, np.tril(workload)):
        return None
    w_inv = solve_triangular(workload, np.eye(n), lower=True)
    m_inv = w_inv @ w_inv.T
    diag, off = np.diag(m_inv).copy(), np.diag(m_inv, -1).copy()
    rest = m_inv - np.diag(diag) - np.diag(off, -1) - np.diag(off, 1)
    if np.abs(rest).max(initial=0.0) > rtol * np.abs(diag).max():
        return None
    return diag, off


def gram_inverse(workload: np.ndarray) -> np.ndarray:
    """M^-1 = (W^T W)^-1 as a dense matrix."""
    from scipy.linalg import solve_triangular

    w_inv = solve_triangular(workload, np.eye(workload.shape[0]), lower=True) \
        if np.allclose(workload, np.tril(workload)) else np.linalg.inv(workload)
    return w_inv @ w_inv.T
