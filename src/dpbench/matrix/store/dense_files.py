"""A dense factorization on disk: one ``.npz`` (C, C^-1, B, the report as JSON) plus the report
as ``.json``, both written atomically (temporary name + os.replace).

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

import json
from pathlib import Path
from typing import Any

import numpy as np

from dpbench.files import atomic_write
from dpbench.matrix import sensitivity as sens
from dpbench.matrix.dense_factorization import Factorization, digest
from dpbench.matrix.store.keys import parse_dense_key
from dpbench.matrix.workload import prefix_sum

RESIDUAL_TOL = 1e-9  # largest entry of |C^-1 C - I| and |B C - A| accepted on load
SENSITIVITY_RTOL = 1e-9  # stored vs recomputed sensitivity


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
        kind, k, b, tau = parse_dense_key(fact.key)
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
    if digest(fact.strategy) != r.get("digest"):
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
