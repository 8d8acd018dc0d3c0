"""Multi-epoch factorization: dual optimization (Choquette-Choo et al. 2023) for (k, b)
participation, T = k b, user j participating at pi_j = {j, j+b, ..., j+(k-1)b}.

The primal problem (thesis eq. 2.44, with the orthogonality constraints of Choquette-Choo et al. that make
the sensitivity exact for every sign pattern, as in jax_privacy's dense.optimize):

    min_X tr(M X^-1)  s.t.  X > 0,  sum_{t in pi_j} X_tt <= 1,  X_st = 0 for s != t in pi_j.

With only the b constraints u_j^T X u_j <= 1 (eq. 2.43) the multiplier matrix
U = sum_j v_j u_j u_j^T has rank b < T, eq. 2.49 is undefined, and the relaxed problem is
unbounded in the directions U does not see: X would blow up there, and the true sensitivity
with it (a user may flip the sign of its gradient between epochs). The orthogonality
constraints fix this: their multipliers O_j (free sign) join v_j in a block-diagonal

    U = blockdiag_j (v_j I_k + O_j)      (in user order; O_j symmetric, zero diagonal),

the Lagrangian is minimised by X(U) = U^-1/2 (U^1/2 M U^1/2)^1/2 U^-1/2 (eq. 2.49), and the
concave dual g(U) = 2 tr((U^1/2 M U^1/2)^1/2) - sum_j v_j (eq. 2.51) has the exact gradient

    dg/dv_j = tr(X_jj) - 1,   dg/d(O_j)_st = 2 (X_jj)_st,

where X_jj is the k x k block of X on pi_j: the gradient needs only these b blocks. Per
evaluation: b eigendecompositions of k x k blocks, one of the T x T matrix U^-1/2 M^-1 U^-1/2
and O(T^2 k) for the blocks. We maximise g with L-BFGS (exact gradients, Armijo backtracking
that also keeps U positive definite), in variables scaled by the natural metric at the start
(v_j / k for v_j, v_j / 2 for O_j entries), from the tied diagonal fixed point (O = 0).

Primal recovery: zero the same-user off-diagonal entries of X(U) (shifting by a multiple of
I if that leaves it indefinite) and scale it so that max_j sum_{t in pi_j} X_tt = 1. This X is
feasible, its sensitivity is exactly 1 for every sign pattern, and its objective minus the
dual value is the duality gap the solver reports and stops on.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
from scipy import linalg

from dpbench.matrix.fixed_point import DiagonalDual, Solution
from dpbench.matrix.workload import gram_inverse


class BlockDual:
    """Evaluates g(U), its gradient and X(U) for the block-diagonal U of (k, b) participation."""

    def __init__(self, workload: np.ndarray, epochs: int, batches: int):
        self.workload = workload
        self.k, self.b = epochs, batches
        self.T = epochs * batches
        if workload.shape != (self.T, self.T):
            raise ValueError(f"workload is {workload.shape}, expected T x T with T = k b = {self.T}")
        # user order: position j*k + e holds step e*b + j
        self.order = np.array([e * batches + j for j in range(batches) for e in range(epochs)])
        self.position = np.argsort(self.order)
        m_inv = gram_inverse(workload)
        self.m_inv_user = np.ascontiguousarray(m_inv[np.ix_(self.order, self.order)])
        self.iu = np.triu_indices(epochs, 1)
        self.n_off = len(self.iu[0])

    def blocks(self, x: np.ndarray) -> np.ndarray:
        """The b blocks v_j I + O_j from the flat variables [v, O_1 upper, ..., O_b upper]."""
        k, b = self.k, self.b
        w = np.zeros((b, k, k))
        w[:, self.iu[0], self.iu[1]] = x[b:].reshape(b, self.n_off)
        w = w + w.transpose(0, 2, 1)
        w[:, np.arange(k), np.arange(k)] = x[:b, None]
        return w

    def evaluate(self, x: np.ndarray) -> dict | None:
        """g, its gradient and the blocks X_jj at x; None outside the domain U > 0."""
        k, b, T = self.k, self.b, self.T
        w, p = np.linalg.eigh(self.blocks(x))
        if w.min() <= 0:
            return None
        r = (p * w[:, None, :] ** -0.5) @ p.transpose(0, 2, 1)  # W_j^-1/2
        # K = R M^-1 R in user order, R = blockdiag(W_j^-1/2); K = (U^1/2 M U^1/2)^-1
        y = (r @ self.m_inv_user.reshape(b, k, T)).reshape(T, T)
        kmat = (y.reshape(T, b, k).transpose(1, 0, 2) @ r).transpose(1, 0, 2).reshape(T, T)
        mu, q = linalg.eigh((kmat + kmat.T) / 2, driver="evd", overwrite_a=True, check_finite=False)
        if mu.min() <= 0:
            return None
        h = float((mu ** -0.5).sum())  # tr((U^1/2 M U^1/2)^1/2) = tr(M X^-1)
        f = (r @ (q * mu ** -0.25).reshape(b, k, T))  # R K^-1/4-factor, rows in user order
        x_blocks = f @ f.transpose(0, 2, 1)  # X_jj = W_j^-1/2 (K^-1/2)_jj W_j^-1/2
        grad = np.concatenate([np.trace(x_blocks, axis1=1, axis2=2) - 1.0,
                               2.0 * x_blocks[:, self.iu[0], self.iu[1]].ravel()])
        return {"g": 2 * h - float(x[:b].sum()), "h": h, "grad": grad, "x_blocks": x_blocks, "factor": f}

    def gram(self, evaluation: dict) -> np.ndarray:
        """X(U) in time order, from an evaluation: X = F F^T with F = R Q diag(mu^-1/4)."""
        f = evaluation["factor"].reshape(self.T, self.T)[self.position]
        return f @ f.T

    def feasible(self, gram: np.ndarray) -> tuple[np.ndarray, float]:
        """A primal feasible point near X(U), scaled to sensitivity 1, and its objective.

        Zero the entries between distinct steps of a user (if that leaves the matrix indefinite,
        shift it by a multiple of I), then scale each user's rows and columns by the same
        d_j > 0 so that its diagonal sums to exactly 1: X' = D X D keeps X' > 0 and the zeros,
        and uses every user's budget (scaling all of X by the largest sum would waste the others')."""
        x = gram.copy()
        k, b, T = self.k, self.b, self.T
        diag = np.diag(gram).copy()
        same_user = np.arange(T)[:, None] % b == np.arange(T)[None, :] % b
        x[same_user] = 0.0
        x[np.diag_indices(T)] = diag
        shift = 0.0
        while True:
            try:
                np.linalg.cholesky(x)
                break
            except np.linalg.LinAlgError:
                lam = linalg.eigvalsh(x, subset_by_index=[0, 0], check_finite=False)[0]
                shift = max(max(-lam, 0.0) * 1.01, 10 * shift, 1e-12 * np.abs(diag).max())
                x[np.diag_indices(T)] = diag + shift
        d = 1.0 / np.sqrt(np.diag(x).reshape(k, b).sum(axis=0))[np.arange(T) % b]
        x *= np.outer(d, d)
        chol = np.linalg.cholesky(x)
        hmat = linalg.solve_triangular(chol, self.workload.T, lower=True, check_finite=False)
        return x, float((hmat * hmat).sum())


def tied_fixed_point(workload: np.ndarray, epochs: int, batches: int, iterations: int) -> np.ndarray:
    """Multipliers v_j of the diagonal U = I_k (x) diag(v): v_j <- v_j sum_{t in pi_j} X_tt.
    Cheap (tridiagonal) and a good start for the scale of the dual variables."""
    dual_fn = DiagonalDual(workload)
    user = np.arange(epochs * batches) % batches
    v = np.ones(batches)
    for _ in range(iterations):
        _, xdiag = dual_fn(v[user])
        v = v * np.bincount(user, xdiag, minlength=batches)
    return v


def dual_ascent(workload: np.ndarray, epochs: int, batches: int, *, tol: float = 1e-4,
                max_iter: int = 5000, memory: int = 30, check_every: int = 5, init_iter: int = 30,
                log: Callable[[str], None] | None = None) -> Solution:
    """Maximise the concave dual with L-BFGS; stop when the relative duality gap <= tol."""
    t0 = time.perf_counter()
    dual_fn = BlockDual(workload, epochs, batches)
    b = batches
    v0 = tied_fixed_point(workload, epochs, batches, init_iter)
    x0 = np.concatenate([v0, np.zeros(b * dual_fn.n_off)])
    scale = np.concatenate([np.sqrt(v0 / epochs), np.repeat(np.sqrt(v0 / 2), dual_fn.n_off)])

    def evaluate(z):
        out = dual_fn.evaluate(scale * z)
        if out is not None:
            out["grad"] = out["grad"] * scale
        return out

    z = x0 / scale
    cur = evaluate(z)
    if cur is None:
        raise FloatingPointError("the initial dual point is not positive definite")
    s_mem: list[np.ndarray] = []
    y_mem: list[np.ndarray] = []
    best_primal, best_gram, history = np.inf, None, []
    it, stalled, last_check = 0, False, None
    while True:
        if it % check_every == 0 or it >= max_iter or stalled:
            gram, primal = dual_fn.feasible(dual_fn.gram(cur))
            if primal < best_primal:
                best_primal, best_gram = primal, gram
            gap = (best_primal - cur["g"]) / best_primal
            history.append((it, best_primal, cur["g"]))
            if log:
                log(f"dual L-BFGS {it:5d}: primal {best_primal:.8g} dual {cur['g']:.8g} relative gap {gap:.2e} "
                    f"({time.perf_counter() - t0:.1f}s)")
            # no progress since the last check: float precision reached
            stalled = stalled or (last_check is not None and best_primal >= last_check[0]
                                  and cur["g"] - last_check[1] <= 1e-12 * abs(cur["g"]))
            last_check = (best_primal, cur["g"])
            if gap <= tol or it >= max_iter or stalled:
                break
        # two-loop recursion for the ascent direction of g (descent of -g)
        q = cur["grad"].copy()
        alphas = []
        for s, y in zip(reversed(s_mem), reversed(y_mem)):
            rho = 1.0 / (y @ s)
            a = rho * (s @ q)
            q -= a * y
            alphas.append((rho, a))
        gamma = (s_mem[-1] @ y_mem[-1]) / (y_mem[-1] @ y_mem[-1]) if s_mem else \
            1e-3 * np.abs(z).max() / np.abs(cur["grad"]).max()
        d = gamma * q
        for (s, y), (rho, a) in zip(zip(s_mem, y_mem), reversed(alphas)):
            d += s * (a - rho * (y @ d))
        slope = cur["grad"] @ d
        if slope <= 0:  # not an ascent direction: restart from the gradient
            s_mem.clear(), y_mem.clear()
            d = gamma * cur["grad"]
            slope = cur["grad"] @ d
        step = 1.0
        while True:
            new = evaluate(z + step * d)
            if new is not None and new["g"] >= cur["g"] + 1e-4 * step * slope:
                break
            step *= 0.5
            if step < 1e-10:
                stalled = True  # no ascent at float precision: converged as far as it goes
                break
        if stalled:
            continue
        s = step * d
        y = cur["grad"] - new["grad"]  # curvature pair of -g
        if s @ y > 1e-12 * np.linalg.norm(s) * np.linalg.norm(y):
            s_mem.append(s), y_mem.append(y)
            if len(s_mem) > memory:
                s_mem.pop(0), y_mem.pop(0)
        z, cur = z + s, new
        it += 1
    return Solution(gram=best_gram, primal_value=float(best_primal), dual_value=float(cur["g"]),
                    iterations=it, converged=bool((best_primal - cur["g"]) / best_primal <= tol),
                    seconds=time.perf_counter() - t0, method="dual L-BFGS (Choquette-Choo et al. 2023)",
                    multipliers=dual_fn.blocks(scale * z), history=history)
