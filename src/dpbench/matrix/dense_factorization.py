"""From a Gram matrix X to the factorization A = B C, its report, and its file.

Names and symbols (as in jax_privacy): workload = A (prefix sums), objective workload = W
(A, or Lambda_tau A for the convergence-aware variants), strategy (encoder) = C with
C^T C = X, noising matrix = C^-1, decoder = B = A C^-1. C is lower triangular (causal: the
release at step t depends on gradients up to t only, which is what makes the adaptive-stream
privacy argument of Denisov et al. go through); B is always A C^-1 for the TRUE workload A.

A factorization is identified by its key (kind, k, b, tau): ``se-k1-b1875``,
``me-lambda-k30-b48-tau1440``, ... and stored as one ``.npz`` (C, C^-1, B, the report as
JSON) plus the report as ``.json``, both written atomically (temporary name + os.replace).

Loading trusts nothing in the file that privacy depends on (``verify``): C must be lower
triangular, finite, the shape its key says and hash to the recorded digest (the digest also
names the noise files made from it); C^-1 C = I and B C = A must hold to RESIDUAL_TOL (1e-9
in the largest entry; the solvers deliver about 1e-15: 2.2e-15 measured for every key up to
T = 960); and the sensitivity is recomputed from C and the participation pattern of the key
(sensitivity.py, O(T^2 k)), must agree with the stored one to 1e-9 relative, and is the value
the run uses. A file failing any check is refused with ``FactorizationError`` naming the
file, the check and the fix (delete it; the workflow computes it again). Cost, one core:
1.3 s at T = 1740 (k = 30), 1.6 s at T = 1875, almost all in the two T x T products; the
sensitivity alone takes 54 ms and 12 ms.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from scipy import linalg

from dpbench.files import atomic_write
from dpbench.matrix import sensitivity as sens
from dpbench.matrix.dual import dual_ascent
from dpbench.matrix.fixed_point import fixed_point
from dpbench.matrix.workload import objective_workload, prefix_sum

FORMAT_VERSION = 1
RESIDUAL_TOL = 1e-9  # largest entry of |C^-1 C - I| and |B C - A| accepted on load
SENSITIVITY_RTOL = 1e-9  # stored vs recomputed sensitivity
KINDS = ("se", "se-lambda", "me", "me-lambda", "identity")
# relative duality gap at which the solvers stop (the optimum is certified to this precision)
DEFAULT_TOL = {"se": 1e-6, "me": 1e-4}
_KEY = re.compile(r"^(?P<kind>se-lambda|me-lambda|se|me|identity)-k(?P<k>\d+)-b(?P<b>\d+)(?:-tau(?P<tau>\d+))?$")


def make_key(kind: str, epochs: int, batches: int, tau: int | None = None) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown factorization kind {kind!r}; choose one of {KINDS}")
    if epochs < 1 or batches < 1:
        raise ValueError(f"need k >= 1 and b >= 1, got k={epochs}, b={batches}")
    if kind.startswith("se") and epochs != 1:
        raise ValueError(f"single-epoch factorization {kind!r} needs k = 1 epoch, got k = {epochs}")
    if kind.endswith("lambda"):
        tau = epochs * batches if tau is None else int(tau)
        if not 1 <= tau <= epochs * batches:
            raise ValueError(f"tau must be in [1, T] = [1, {epochs * batches}], got {tau}")
        return f"{kind}-k{epochs}-b{batches}-tau{tau}"
    if tau is not None:
        raise ValueError(f"factorization {kind!r} takes no tau")
    return f"{kind}-k{epochs}-b{batches}"


def parse_key(key: str) -> tuple[str, int, int, int | None]:
    """(kind, k, b, tau) from a key; checks it is canonical."""
    m = _KEY.match(key)
    if not m:
        raise ValueError(f"not a factorization key: {key!r} (expected e.g. se-k1-b1875 or me-lambda-k30-b48-tau1440)")
    kind, k, b = m["kind"], int(m["k"]), int(m["b"])
    tau = int(m["tau"]) if m["tau"] else None
    if make_key(kind, k, b, tau) != key:
        raise ValueError(f"factorization key {key!r} is not canonical (expected {make_key(kind, k, b, tau)!r})")
    return kind, k, b, tau


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


def _digest(strategy: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(strategy, dtype=np.float64).tobytes()).hexdigest()


def from_strategy(key: str, strategy: np.ndarray, report: dict[str, Any] | None = None) -> Factorization:
    """B, C^-1 and the invariants of a given lower-triangular C (the report is completed)."""
    kind, k, b, tau = parse_key(key)
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
        "digest": _digest(strategy),
    })
    return Factorization(key, np.ascontiguousarray(strategy), noising, decoder, report)


def factorize(key: str, *, tol: float | None = None, log: Callable[[str], None] | None = None) -> Factorization:
    """Solve the factorization problem named by ``key``."""
    kind, k, b, tau = parse_key(key)
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


def report_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, sort_keys=True, default=float) + "\n"


def save(fact: Factorization, path: str | Path, report_path: str | Path | None = None) -> None:
    """Write the .npz (and the report as JSON next to it, or at report_path), atomically."""
    path = Path(path)
    report_path = Path(report_path) if report_path else path.with_suffix(".json")
    atomic_write(report_path, lambda f: f.write(report_json(fact.report)), mode="w")
    atomic_write(path, lambda f: np.savez(f, strategy=fact.strategy, noising=fact.noising,
                                           decoder=fact.decoder, report=np.array(json.dumps(fact.report, default=float))))


class FactorizationError(ValueError):
    """A factorization file that must not be used; the message names the file and the fix."""


def load(path: str | Path) -> Factorization:
    """The factorization stored at ``path``, verified (``verify``)."""
    path = Path(path)
    try:
        with np.load(path) as z:
            report = json.loads(str(z["report"]))
            fact = Factorization(report["key"], z["strategy"], z["noising"], z["decoder"], report)
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated, zeroed or foreign file: zip, pickle, key, JSON errors
        raise FactorizationError(f"factorization file {path} is unreadable ({type(exc).__name__}: {exc}); "
                                 f"{_fix(path)}") from None
    return verify(fact, path)


def _fix(path: Path) -> str:
    return (f"delete {path} (and {path.with_suffix('.json')}); the workflow, or `dpbench train` with a cache "
            "directory, computes it again")


def verify(fact: Factorization, source: str | Path = "factorization") -> Factorization:
    """Checks what the privacy of a run rests on (module docstring) and returns the
    factorization with its sensitivity recomputed from C; refuses it otherwise."""
    def refuse(why: str) -> FactorizationError:
        return FactorizationError(f"factorization file {source} is refused: {why}; {_fix(Path(source))}")

    r = fact.report
    try:
        kind, k, b, tau = parse_key(fact.key)
    except ValueError as exc:
        raise refuse(str(exc)) from None
    recorded = {n: r.get(n) for n in ("kind", "epochs", "batches", "steps", "tau")}
    if recorded != {"kind": kind, "epochs": k, "batches": b, "steps": k * b, "tau": tau}:
        raise refuse(f"its report {recorded} does not match its key {fact.key!r}")
    steps = k * b
    for name, m in (("C", fact.strategy), ("C^-1", fact.noising), ("B", fact.decoder)):
        if m.shape != (steps, steps) or not np.isfinite(m).all():
            raise refuse(f"{name} is not a finite {steps} x {steps} matrix (shape {m.shape})")
    if np.triu(fact.strategy, 1).any():
        raise refuse("C is not lower triangular (the mechanism would not be causal)")
    if _digest(fact.strategy) != r.get("digest"):
        raise refuse("C does not match the digest recorded when it was computed")
    eye = np.abs(fact.noising @ fact.strategy - np.eye(steps)).max()
    if not eye <= RESIDUAL_TOL:
        raise refuse(f"C^-1 C differs from I by {eye:.3g} (tolerance {RESIDUAL_TOL:g})")
    rec = np.abs(fact.decoder @ fact.strategy - prefix_sum(steps)).max()
    if not rec <= RESIDUAL_TOL:
        raise refuse(f"B C differs from the prefix-sum workload A by {rec:.3g} (tolerance {RESIDUAL_TOL:g})")
    computed = sens.sensitivity(fact.strategy, k, b)
    stored = r.get("sensitivity")
    if not isinstance(stored, (int, float)) or not abs(stored - computed) <= SENSITIVITY_RTOL * computed:
        raise refuse(f"its recorded sensitivity {stored!r} is not the sensitivity of C for (k, b) = ({k}, {b}) "
                     f"participation, {computed!r}")
    return Factorization(fact.key, fact.strategy, fact.noising, fact.decoder, {**r, "sensitivity": computed})
