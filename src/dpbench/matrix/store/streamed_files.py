"""A streamed mechanism's factorization on disk: its file, and what loading verifies.

The strategies of ``dpmatrix-band``, ``dpmatrix-band-amp`` and ``dpmatrix-blt``
(dpbench.mechanisms.streamed) are a few hundred numbers, but computing them takes up to ~10 s
(a BLT's derivative-free search, amplified BandMF's band search), so the workflow computes each
once, as a stage of its own, and every training cell that needs it reads the file
(``dpbench train --factorization``), as the dense mechanisms' cells read theirs. Its key
(keys.py) names everything that determines the strategy, and nothing else, so cells share files.

The file is JSON (the coefficients as exact decimal float64), written atomically. Loading
(``load``) trusts nothing that the noise depends on: the format version (an older one is
stale), the key (the run's own: a file for another setting is refused), finite coefficients of
the key's shape, c_0 > 0 and ||c|| = 1 for a band, the interlaced class for a BLT (which the
closed-form sensitivity needs), a SHA-256 digest of the coefficients recorded when they were
computed, the error recorded against the one recomputed from the coefficients, and for the band
search that the chosen b is admissible (b <= min(N // L, T)) and the best candidate recorded.
The privacy of a run never rests on the file's word: the run recomputes its sensitivity from
the coefficients it loaded and its own participation (dpbench.mechanisms.streamed). A refused
file raises ``StreamedFactorizationError`` naming the file, the check and the fix (delete it;
the workflow computes it again).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpbench.files import atomic_write
from dpbench.matrix import banded, blt
from dpbench.matrix.store.keys import parse_streamed_key

FORMAT_VERSION = 1
ERROR_RTOL = 1e-9  # recorded vs recomputed err_mean
NORM_TOL = 1e-12  # | ||c|| - 1 | of a band's coefficients


class StreamedFactorizationError(ValueError):
    """A streamed factorization file that must not be used; the message names the file and the fix."""


@dataclass(frozen=True)
class StreamedFactorization:
    """A strategy (banded.BandedToeplitz or blt.BLT) under its key; ``band_search`` holds the
    band search's evaluations for a ``band-auto`` key (None otherwise)."""

    key: str
    strategy: Any
    band_search: list[dict] | None = None

    @property
    def kind(self) -> str:
        return "band" if isinstance(self.strategy, banded.BandedToeplitz) else "blt"


def _parameters(strategy) -> dict[str, list[float]]:
    if isinstance(strategy, banded.BandedToeplitz):
        return {"coef": [float(c) for c in strategy.coef]}
    return {"theta": [float(t) for t in strategy.theta], "theta_hat": [float(t) for t in strategy.theta_hat]}


def digest(parameters: dict[str, list[float]]) -> str:
    """SHA-256 of the float64 bytes of the parameters, in name order."""
    h = hashlib.sha256()
    for name in sorted(parameters):
        h.update(name.encode() + b"\0" + np.asarray(parameters[name], dtype="<f8").tobytes())
    return h.hexdigest()


def to_json(fact: StreamedFactorization) -> dict[str, Any]:
    kind, params = parse_streamed_key(fact.key)
    parameters = _parameters(fact.strategy)
    out = {"format_version": FORMAT_VERSION, "key": fact.key, "kind": fact.kind, "steps": fact.strategy.n,
           **parameters, "digest": digest(parameters), "error_mean": fact.strategy.error_mean(),
           "report": fact.strategy.report}
    if isinstance(fact.strategy, banded.BandedToeplitz):
        out.update({"bands": fact.strategy.bands, "column_normalized": fact.strategy.column_normalize})
    else:
        out["buffers"] = fact.strategy.buffers
    if kind == "band-auto":
        out["band_search"] = fact.band_search
    return out


def save(fact: StreamedFactorization, path: str | Path) -> None:
    """Write the factorization as JSON, atomically (temporary name in the same directory, fsync,
    os.replace): a reader sees the complete file or none."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(to_json(fact), indent=1, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text), mode="w")


def _fix(path: Path) -> str:
    return f"delete {path}; the workflow (or `dpbench train` with a cache directory) computes it again"


def _vector(record: dict, name: str, size: int | None, refuse) -> np.ndarray:
    value = record.get(name)
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in value):
        raise refuse(f"{name!r} is not a list of numbers")
    array = np.asarray(value, dtype=np.float64)
    if array.ndim != 1 or array.size < 1 or (size is not None and array.size != size) or \
            not np.isfinite(array).all():
        raise refuse(f"{name!r} is not a finite vector of length {size if size is not None else '>= 1'} "
                     f"(got {array.size} entries)")
    return array


def load(path: str | Path, expected_key: str | None = None) -> StreamedFactorization:
    """The factorization stored at ``path``, verified (module docstring); with ``expected_key``,
    refused unless it is the factorization of that key."""
    path = Path(path)

    def refuse(why: str) -> StreamedFactorizationError:
        return StreamedFactorizationError(f"streamed factorization file {path} is refused: {why}; {_fix(path)}")

    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StreamedFactorizationError(f"streamed factorization file {path} is unreadable "
                                         f"({type(exc).__name__}: {exc}); {_fix(path)}") from None
    if not isinstance(record, dict):
        raise refuse("it is not a JSON object")
    if record.get("format_version") != FORMAT_VERSION:
        raise refuse(f"it is stale: format version {record.get('format_version')!r}, this code reads "
                     f"{FORMAT_VERSION}")
    key = record.get("key")
    try:
        kind, params = parse_streamed_key(str(key))
    except ValueError as exc:
        raise refuse(str(exc)) from None
    if expected_key is not None and key != expected_key:
        raise StreamedFactorizationError(
            f"streamed factorization file {path} is for {key!r}, but this run needs {expected_key!r}; give the "
            "run its own file (the workflow names it), or leave --factorization out to compute it into the cache")
    n = params["n"]
    if record.get("steps") != n:
        raise refuse(f"it records {record.get('steps')!r} steps, its key says n = {n}")
    if kind == "blt":
        if record.get("kind") != "blt":
            raise refuse(f"its kind {record.get('kind')!r} does not match its key")
        theta = _vector(record, "theta", params["buffers"], refuse)
        theta_hat = _vector(record, "theta_hat", theta.size, refuse)
        if theta.size > blt.MAX_BUFFERS:
            raise refuse(f"{theta.size} buffers (at most {blt.MAX_BUFFERS})")
        parameters = {"theta": theta.tolist(), "theta_hat": theta_hat.tolist()}
        strategy = blt.BLT.from_pair(theta, theta_hat, n)
        if not strategy.in_class():
            raise refuse("its (theta, theta_hat) is not in the interlaced class its sensitivity formula needs")
    else:
        if record.get("kind") != "band" or record.get("column_normalized") is not True:
            raise refuse(f"kind {record.get('kind')!r}, column_normalized {record.get('column_normalized')!r}: "
                         "expected a column-normalised band")
        coef = _vector(record, "coef", params.get("bands"), refuse)
        if not coef[0] > 0 or abs(np.linalg.norm(coef) - 1.0) > NORM_TOL or coef.size > n:
            raise refuse(f"its coefficients are not a band for n = {n} with c_0 > 0 and ||c|| = 1 "
                         f"(c_0 = {coef[0]:.6g}, ||c|| = {np.linalg.norm(coef):.15g}, b = {coef.size})")
        parameters = {"coef": coef.tolist()}
        strategy = banded.BandedToeplitz(coef, n, True, dict(record.get("report") or {}))
    if kind == "blt":
        strategy.report.update(record.get("report") or {})
    if digest(parameters) != record.get("digest"):
        raise refuse("its coefficients do not match the digest recorded when they were computed")
    recorded, computed = record.get("error_mean"), strategy.error_mean()
    if not isinstance(recorded, (int, float)) or not abs(recorded - computed) <= ERROR_RTOL * computed:
        raise refuse(f"its recorded err_mean {recorded!r} is not that of its coefficients ({computed!r})")
    search = None
    if kind == "band-auto":
        search = _verify_search(record.get("band_search"), strategy.bands, params, refuse)
    return StreamedFactorization(str(key), strategy, search)


def _verify_search(search, bands: int, params: dict, refuse) -> list[dict]:
    """The band search of a ``band-auto`` file: b admissible, and the best candidate recorded."""
    most = min(params["n_train"] // params["batch_size"], params["n"])
    if not 1 <= bands <= most:
        raise refuse(f"b = {bands} bands is not in [1, min(N // L, T)] = [1, {most}]")
    if not isinstance(search, list) or not search or not all(
            isinstance(e, dict) and isinstance(e.get("bands"), int) and isinstance(e.get("proxy"), (int, float))
            for e in search):
        raise refuse("its band search is missing or malformed")
    best = min(search, key=lambda e: e["proxy"])
    if best["bands"] != bands:
        raise refuse(f"it holds b = {bands} bands, but its band search's best candidate is b = {best['bands']}")
    return search
