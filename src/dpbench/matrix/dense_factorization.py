"""From a Gram matrix X to the factorization A = B C and its report.

Names and symbols (as in jax_privacy): workload = A (prefix sums), objective workload = W
(A, or Lambda_tau A for the convergence-aware variants), strategy (encoder) = C with
C^T C = X, noising matrix = C^-1, decoder = B = A C^-1. C is lower triangular (causal: the
release at step t depends on gradients up to t only, which is what makes the adaptive-stream
privacy argument of Denisov et al. go through); B is always A C^-1 for the TRUE workload A.

A factorization is identified by its key (kind, k, b, tau): ``se-k1-b1875``,
``me-lambda-k30-b48-tau1440``, ... (store/keys.py); its files and what loading them verifies
are store/dense_files.py.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from scipy import linalg

from dpbench.matrix import sensitivity as sens
from dpbench.matrix.dual import dual_ascent
from dpbench.matrix.fixed_point import fixed_point
from dpbench.matrix.store.keys import parse_dense_key
from dpbench.matrix.workload import objective_workload, prefix_sum

FORMAT_VERSION = 1  # of the report (and so of the files, store/dense_files.py)
# relative duality gap at which the solvers stop (the optimum is certified to this precision)
DEFAULT_TOL = {"se": 1e-6, "me": 1e-4}


def strategy_from_gram(gram: np.ndarray) -> np.ndarray:
    """The lower-triangular C with C^T C = X: the Cholesky factor of X with its index order
    reversed (X = J L L^T J, C = J L^T J)."""
    flipped = np.linalg.cholesky(gram[::-1, ::-1])
    return np.ascontiguousarray(flipped.T[::-1, ::-1])


@dataclass
class Factorization:
    key: str
    strategy: np.ndarray  # C, lower triangular
    noising: np.ndarray  # C^-1, lower triangular
    decoder: np.ndarray  # B = A C^-1
    report: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.report["kind"]

    @property
    def epochs(self) -> int:
        return self.report["epochs"]

    @property
    def batches(self) -> int:
        return self.report["batches"]

    @property
    def steps(self) -> int:
        return self.report["steps"]

    @property
    def sensitivity(self) -> float:
        return self.report["sensitivity"]

    @property
    def digest(self) -> str:
        return self.report["digest"]


def digest(strategy: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(strategy, dtype=np.float64).tobytes()).hexdigest()


def from_strategy(key: str, strategy: np.ndarray, report: dict[str, Any] | None = None) -> Factorization:
    """B, C^-1 and the invariants of a given lower-triangular C (the report is completed)."""
    kind, k, b, tau = parse_dense_key(key)
    steps = k * b
    if strategy.shape != (steps, steps):
        raise ValueError(f"strategy is {strategy.shape}, expected {steps} x {steps}")
    if np.abs(np.triu(strategy, 1)).max(initial=0.0) != 0.0:
        raise ValueError("the strategy matrix C must be lower triangular (causal)")
    a = prefix_sum(steps)
    noising = linalg.solve_triangular(strategy, np.eye(steps), lower=True, check_finite=False)
    decoder = a @ noising  # B = A C^-1: the true workload, also for the lambda variants
    weighted = objective_workload(steps, tau) @ noising
    s2 = sens.sensitivity(strategy, k, b) ** 2
    report = dict(report or {})
    report.update({
        "format_version": FORMAT_VERSION,
        "key": key, "kind": kind, "epochs": k, "batches": b, "steps": steps, "tau": tau,
        "sensitivity": float(np.sqrt(s2)),
        "max_participation_norm": float(sens.participation_norms(strategy, k, b).max()),
        # the quantity the factorization minimises (per unit noise variance, sensitivity 1):
        "objective": float((weighted * weighted).sum()) * s2,
        "objective_workload": "prefix sums A" if tau is None else f"Lambda_tau A, tau = {tau}",
        # total squared error of the released prefix sums, ||B||_F^2 (per unit sigma, sens 1)
        "prefix_sum_error": float((decoder * decoder).sum()) * s2,
        "reconstruction_residual": float(np.abs(decoder @ strategy - a).max()),
        "digest": digest(strategy),
    })
    return Factorization(key, np.ascontiguousarray(strategy), noising, decoder, report)


def factorize(key: str, *, tol: float | None = None, log: Callable[[str], None] | None = None) -> Factorization:
    """Solve the factorization problem named by ``key``."""
    kind, k, b, tau = parse_dense_key(key)
    steps = k * b
    t0 = time.perf_counter()
    if kind == "identity":  # B = A, C = I: DP-SGD with the same batches and noise, no amplification
        return from_strategy(key, np.eye(steps), {"method": "identity (DP-SGD without amplification)",
                                                  "seconds": 0.0, "solver_seconds": 0.0})
    workload = objective_workload(steps, tau)
    if kind.startswith("se"):
        tol = DEFAULT_TOL["se"] if tol is None else tol
        solution = fixed_point(workload, tol=tol, log=log)
    else:
        tol = DEFAULT_TOL["me"] if tol is None else tol
        solution = dual_ascent(workload, k, b, tol=tol, log=log)
    strategy = strategy_from_gram(solution.gram)
    report = {
        "method": solution.method, "tol": tol, "iterations": solution.iterations,
        "converged": solution.converged, "primal_value": solution.primal_value,
        "dual_value": solution.dual_value, "solver_seconds": solution.seconds,
    }
    fact = from_strategy(key, strategy, report)
    # the certificate of the delivered C: its objective (computed from C alone) minus the
    # dual lower bound on the optimum
    gap = fact.report["objective"] - solution.dual_value
    fact.report.update({"duality_gap": gap, "relative_duality_gap": gap / fact.report["objective"],
                        "seconds": time.perf_counter() - t0})
    return fact
