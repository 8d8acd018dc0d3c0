"""The one results writer: a run is one Parquet file.

Rows are the metrics in long form (``split`` = "train" rows per step, "test" rows per
epoch); the run's metadata (every setting, the privacy promised and delivered, timing,
provenance) is JSON in the file's key-value metadata under ``dpbench``. Files are written
atomically: a crash never leaves a partial file under the final name. Every data page carries
a CRC-32, verified on reading: a damaged file is refused naming it, never read as wrong numbers.

What is private. A DP run releases its sequence of models; anything computed from those and
from public data (the test set) is post-processing and covered by the run's (epsilon, delta).
The training rows' loss, accuracy and realised batch size, and the validation rows (held-out
*training* examples), are computed from private data without noise: they are diagnostics,
NOT differentially private. Their columns carry Parquet field metadata ``private: false``
with a note saying which rows (``NOT_PRIVATE``), here and in the aggregated tables.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import math
import os
import platform
import subprocess
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dpbench.files import atomic_write, is_no_space, no_space, special_kind
from dpbench.machine import platform_record
from dpbench.privacy.accounting import meets_target

META_KEY = b"dpbench"
SCHEMA_VERSION = 1
METRIC_COLUMNS = {"split": "string", "step": "int64", "epoch": "int64", "loss": "float64",
                  "accuracy": "float64", "batch_size": "int64"}
PACKAGES = ("torch", "opacus", "numpy", "pandas", "pyarrow", "scipy")
# Columns of a run file holding values computed from private data without noise (not covered
# by the run's epsilon): Parquet field metadata {"private": "false", "note": ...}.
NOT_PRIVATE = {
    "loss": "not differentially private where split is train (the private batch, before the update) or val "
            "(held-out training examples); test rows are computed from the released model and the test set",
    "accuracy": "not differentially private where split is train or val (as loss)",
    "batch_size": "not differentially private where split is train: the realised (Poisson) batch sizes",
}
# A private run whose ``privacy.caveat`` starts with this does NOT have the (epsilon, delta) it
# records (DP-Dice's published calibration, D2P2's paper_sensitivity mode).
NO_GUARANTEE = "not a valid DP guarantee"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def claimed_private(meta: dict[str, Any], builtin: Any = None) -> bool:
    """The run's privacy claim, the one source every label and every check reads: for a built-in
    optimizer (``builtin``: its facts, ``dpbench.pipeline.catalog.OptimizerFacts``) the
    registry's ``private``, never the file's (an edited file can neither make ``sgd`` private
    nor take DP-SGD's numbers out of the checks); for another, the file's ``optimizer.private``."""
    return (builtin.private if builtin is not None else meta["optimizer"]["private"]) is True


def record_error(meta: Any, builtins: Mapping[str, Any] | None = None) -> str | None:
    """What in a run file's metadata no run writes (a damaged or edited file), as "<key>: <what>",
    or None: a key of the record missing or of the wrong type, a number out of its range, or a
    privacy section that contradicts itself. sigma is always a finite number >= 0 (no run's
    claim has another, ``PrivacyClaim``); for a run that claims privacy (``claimed_private``,
    the registry's claim for a built-in of ``builtins``, as ``aggregate_runs`` is given them)
    and a finite epsilon: delta in (0, 1), sigma > 0, and epsilon 0 only where nothing was
    released (``privacy.steps`` 0). A label is only as good as the record's numbers: such a
    file is refused, never labelled (``aggregate``)."""
    if not isinstance(meta, dict):
        return f"the metadata is a JSON {type(meta).__name__}, not an object"
    for section in ("config", "privacy", "result", "timing", "optimizer", "problem", "data", "environment"):
        if not isinstance(meta.get(section), dict):
            return f"{section}: missing" if section not in meta else f"{section}: not an object"
    cfg, priv = meta["config"], meta["privacy"]
    for key in ("problem", "optimizer"):
        if not isinstance(cfg.get(key), str):
            return f"config.{key}: {cfg.get(key)!r} is not a name"
    for key in ("batch_size", "epochs", "seed"):
        if not (_number(cfg.get(key)) and float(cfg[key]).is_integer() and 0 <= cfg[key] < 2**63):
            return f"config.{key}: {cfg.get(key)!r} is not an integer from 0 to 2**63 - 1"
    if not isinstance(meta["optimizer"].get("private"), bool):
        return f"optimizer.private: {meta['optimizer'].get('private')!r} is not true or false"
    builtin = (builtins or {}).get(cfg["optimizer"])
    epsilon, delta, sigma = priv.get("epsilon"), priv.get("delta"), priv.get("noise_multiplier")
    if not (_number(epsilon) and epsilon >= 0):  # NaN fails >= 0
        return f"privacy.epsilon: {epsilon!r} is not a number >= 0 (infinite where nothing is guaranteed)"
    if not (_number(sigma) and 0 <= sigma < math.inf):
        return f"privacy.noise_multiplier: {sigma!r} is not a finite number >= 0"
    steps = priv.get("steps")
    if not (_number(steps) and float(steps).is_integer() and 0 <= steps < 2**63):
        return f"privacy.steps: {steps!r} is not an integer from 0 to 2**63 - 1"
    if claimed_private(meta, builtin) and math.isfinite(epsilon):
        claim = (f"the registry's {cfg['optimizer']} is private" if builtin is not None
                 else "optimizer.private is true")
        if not (_number(delta) and 0 < delta < 1):
            return f"privacy.delta: {delta!r} is not in (0, 1), yet epsilon {epsilon} is finite ({claim})"
        if sigma <= 0:
            return f"privacy.noise_multiplier: {sigma!r}, no noise, yet epsilon {epsilon} is finite ({claim})"
        if epsilon == 0 and steps > 0:
            return (f"privacy.epsilon: 0 after {steps:g} noisy steps (sigma {sigma}): epsilon is 0 only where "
                    f"nothing was released ({claim})")
    target = priv.get("target_epsilon")
    if target is not None and not (_number(target) and 0 < target < math.inf):
        return f"privacy.target_epsilon: {target!r} is not a finite positive number"
    return None


def is_private(meta: dict[str, Any], builtin: Any = None) -> bool:
    """Whether a run is private at the epsilon it carries: trained by a private optimizer, to a
    finite achieved epsilon (a private optimizer given sigma = 0, ``--noise-multiplier 0``,
    records epsilon = inf: not private, whatever its optimizer), at most its target where it had
    one (``accounting.meets_target``: a run that exceeded its target is not labelled private at
    it, nor anywhere). ``builtin``: the facts of a built-in optimizer of that name
    (``dpbench.pipeline.catalog.OptimizerFacts``), whose ``private`` is taken over the file's
    (an edited file cannot make ``sgd`` private)."""
    epsilon, target = meta["privacy"].get("epsilon"), meta["privacy"].get("target_epsilon")
    return (claimed_private(meta, builtin) and _number(epsilon) and math.isfinite(epsilon) and epsilon >= 0
            and (target is None or meets_target(epsilon, target)))


def dp_guarantee(meta: dict[str, Any], builtin: Any = None) -> bool:
    """Whether a run's recorded (epsilon, delta) holds: private (its target met, where it had one),
    and no caveat voiding it: the file's, or for a built-in optimizer (``builtin``, as for
    ``is_private``) the registry's (``guarantees``: a file whose DP-Dice caveat was cut still
    has none)."""
    caveat = meta["privacy"].get("caveat") or ""
    return (is_private(meta, builtin) and not (isinstance(caveat, str) and caveat.startswith(NO_GUARANTEE))
            and (builtin is None or builtin.guarantees(meta["optimizer"].get("hyperparameters") or {})))


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def provenance() -> dict[str, Any]:
    versions = {}
    for name in ("dpbench",) + PACKAGES:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            versions[name] = None
    # platform: the CPU, its instruction sets and the kernels chosen for it (dpbench.machine): runs
    # on different platforms differ in their floats' last digits (docs/results.md, "What reproduces where")
    return {"python": platform.python_version(), "packages": versions, "git_commit": _git_commit(),
            "hostname": platform.node(), "platform": platform_record()}


def _jsonable(obj: Any) -> Any:
    """JSON with non-finite floats kept as strings ("inf", "nan") so they survive a round trip."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if hasattr(obj, "item"):  # numpy / torch scalars
        return _jsonable(obj.item())
    return obj


def _restore(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _restore(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(v) for v in obj]
    if obj in ("inf", "-inf", "nan"):
        return float(obj)
    return obj


def write_run(path: str | Path, metrics: pd.DataFrame, meta: dict[str, Any]) -> Path:
    path = Path(path)
    missing = set(METRIC_COLUMNS) - set(metrics.columns)
    if missing:
        raise ValueError(f"metrics lack columns {sorted(missing)}")
    table = pa.Table.from_pandas(metrics[list(METRIC_COLUMNS)].astype(METRIC_COLUMNS), preserve_index=False)
    payload = json.dumps({"schema_version": SCHEMA_VERSION, **_jsonable(meta)}, sort_keys=True)
    table = _mark_not_private(table, NOT_PRIVATE)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: payload.encode()})
    return _atomic_write(table, path)


def write_table(df: pd.DataFrame, path: str | Path, not_private: dict[str, str] | None = None,
                meta: dict[str, Any] | None = None) -> Path:
    """Any table, atomically, as Parquet; columns named in ``not_private`` get the field
    metadata ``private: false`` and the note given; ``meta`` (JSON) goes under the
    ``dpbench`` key."""
    table = _mark_not_private(pa.Table.from_pandas(df, preserve_index=False), not_private or {})
    if meta is not None:
        payload = json.dumps({"schema_version": SCHEMA_VERSION, **_jsonable(meta)}, sort_keys=True)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), META_KEY: payload.encode()})
    return _atomic_write(table, Path(path))


def _mark_not_private(table: pa.Table, notes: dict[str, str]) -> pa.Table:
    fields = [f.with_metadata({**(f.metadata or {}), b"private": b"false", b"note": notes[f.name].encode()})
              if f.name in notes else f for f in table.schema]
    return table.cast(pa.schema(fields, metadata=table.schema.metadata))


def not_private_columns(path: str | Path) -> dict[str, str]:
    """The columns of a Parquet file marked ``private: false``, with their notes."""
    return {f.name: f.metadata[b"note"].decode() for f in pq.read_schema(path)
            if f.metadata and f.metadata.get(b"private") == b"false"}


def _atomic_write(table: pa.Table, path: Path) -> Path:
    """Writes with a CRC-32 on every data page (verified by ``read_table``), atomically, with
    the mode ``open()`` would give (``files.atomic_write``); a full disk is one line naming it."""
    try:
        atomic_write(path, lambda f: pq.write_table(table, f, write_page_checksum=True))
    except OSError as exc:
        if is_no_space(exc):
            raise no_space(exc, "the table", path, "free space and run again") from exc
        raise
    return path


class DamagedFileError(ValueError):
    """A Parquet file that cannot be read back as written; the message names it and the fix."""


def _damaged(path: str | Path, exc: BaseException) -> DamagedFileError:
    return DamagedFileError(f"run file {path} is damaged ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                            "delete it and run the workflow again, which retrains that cell")


def _refuse_not_a_file(path: str | Path) -> None:
    """A directory (or a FIFO, a device) given for a run or audit file is named as what it is,
    not as a damaged file to delete; a missing file is a FileNotFoundError naming it."""
    kind = special_kind(path)
    if kind is not None:
        hint = f": give the files in it ({Path(path) / '*.parquet'})" if kind.endswith("directory") else ""
        raise ValueError(f"{path} is {kind}, not a .parquet file{hint}")
    if not Path(path).exists():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))


def read_table(path: str | Path) -> pd.DataFrame:
    """A Parquet file written here, its page checksums verified: a damaged file is an error
    naming it, never a table of wrong numbers. (Files written before checksums were stored
    are read unverified.)"""
    _refuse_not_a_file(path)
    try:
        return pd.read_parquet(path, page_checksum_verification=True)
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise _damaged(path, exc) from None


def read_meta(path: str | Path) -> dict[str, Any]:
    _refuse_not_a_file(path)
    try:
        raw = pq.read_schema(path).metadata or {}
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException) as exc:
        raise _damaged(path, exc) from None
    if META_KEY not in raw:
        raise ValueError(f"{path} is not a dpbench run file (no {META_KEY.decode()!r} metadata)")
    try:
        return _restore(json.loads(raw[META_KEY]))
    except ValueError as exc:
        raise _damaged(path, exc) from None


def read_run(path: str | Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    return read_table(path), read_meta(path)


def pack_outcomes(correct) -> str:
    """Per-record correctness (booleans, in the test split's order) as a run record keeps it:
    base64 of ``numpy.packbits(correct, bitorder="little")``, 1 bit a record (docs/results.md,
    ``test_outcomes``)."""
    bits = np.asarray(correct.cpu() if hasattr(correct, "cpu") else correct, dtype=bool)
    return base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode("ascii")


def unpack_outcomes(text: str, n: int):
    """``pack_outcomes``'s inverse: ``n`` records' correctness as a uint8 array of 0 and 1. A
    text of another length than ``n`` bits need is refused in one line."""
    try:
        raw = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise ValueError(f"test outcomes: not base64 ({exc})") from None
    if len(raw) != (n + 7) // 8:
        raise ValueError(f"test outcomes: {len(raw)} bytes hold {8 * len(raw)} bits, not the {n} records recorded")
    return np.unpackbits(raw, bitorder="little")[:n]
