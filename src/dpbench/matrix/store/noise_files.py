"""The correlated noise of a run, C^-1 Z, as one memory-mappable file per
(factorization, d, seed).

Z in R^{T x d} is i.i.d. N(0, 1), defined column block by column block: block i (columns
[1024 i, 1024 (i+1))) is drawn from numpy's PCG64 seeded with SeedSequence(seed,
spawn_key=(i,)), so Z does not depend on how the writer chunks its work, and two runs with
the same seed and d share Z whatever their factorization (common random numbers). Row t of
the file, (C^-1 Z)_t, is the unit-variance noise of step t; the step multiplies it by
sigma * s (s the clipping sensitivity) and divides by L with the clipped sum.

The file is a standard ``.npy`` (float32, shape (T, d), C order: row t is contiguous), so
``np.load(path, mmap_mode="r")`` maps it. It is written column chunk by column chunk with
positioned writes into a temporary file in the same directory, fsync'ed, and renamed into
place (os.replace): the final name only ever names a complete file, and the writer holds
O(T x chunk) floats, never T x d. A JSON sidecar (same stem) records what the file is.

Integrity. Atomic writes rule out partial files, not files damaged afterwards (a disk or
copy error, a file system that zero-fills, a hand edit): a zero-filled payload would train
like a run with sigma = 0 while recording the sigma and epsilon of the private run. So

* the writer computes the CRC-32 of every row while it writes (the column chunks come in
  column order, so each row's CRC is continued chunk by chunk: ``zlib.crc32(segment, crc)``)
  and stores them in the sidecar (``row_crc32``); ``NoiseFile.verify`` reads the file once,
  row block by row block (O(64 MiB) in memory, never T x d), and refuses it at the first
  row whose CRC differs;
* every row read is also checked against the factorization itself, independently of the
  sidecar: row t of C^-1 Z is N(0, r_t^2 I_d) with r_t = ||row t of C^-1||, so
  ||row||^2 / r_t^2 is chi-square with d degrees of freedom, and by Laurent & Massart (2000,
  Ann. Statist. 28(5), Lemma 1) P(X >= d + 2 sqrt(d x) + 2 x) <= e^-x and P(X <= d - 2 sqrt(d x)) <= e^-x. With
  x = ROW_CHECK_X = 50 a correct row fails with probability below 2 e^-50 < 4e-22, i.e.
  below 1e-16 over a run of 100,000 rows (a false alarm is negligible), while for d = 225,034
  (P2) the band is ||row||^2 / (d r_t^2) in [0.970, 1.030]: a zeroed, halved or duplicated
  row is far outside it. The check costs one dot product per step.

A failed check raises ``NoiseFileError`` naming the file and the fix: delete it (and its
sidecar); the workflow, or ``dpbench train`` with a cache directory, writes it again.
A run opens its file with ``open_verified``: the sidecar must name the run's factorization (its
digest), d and seed, and the whole file is read once and checked before the first step.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import resource
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dpbench.files import HOST as _HOST
from dpbench.files import chmod_like_open, is_no_space, no_space, partial_prefix, refuse_special
from dpbench.files import remove_stale_partials as _remove_stale_partials

BLOCK = 1024  # columns per canonical block of Z
FORMAT_VERSION = 2  # 2: the sidecar carries row_crc32
ROW_CHECK_X = 50.0  # chi-square tail parameter of the per-row norm check (module docstring)
VERIFY_BYTES = 64 * 2**20  # rows read at a time by NoiseFile.verify


class NoiseFileError(ValueError):
    """A noise file (or its sidecar) that must not be used; the message names the file and the fix."""


def _fix(path: Path) -> str:
    return (f"delete {path} and {meta_path(path)}; the workflow (or `dpbench train` with a cache "
            "directory) writes them again")


def standard_normal_block(seed: int, steps: int, block: int) -> np.ndarray:
    """Z[:, BLOCK*block : BLOCK*(block+1)] (all BLOCK columns, even past d)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(block,))))
    return rng.standard_normal((steps, BLOCK), dtype=np.float32)


def standard_normal(seed: int, steps: int, dim: int) -> np.ndarray:
    """Z itself, for tests and small problems (holds T x d in memory)."""
    blocks = [standard_normal_block(seed, steps, i) for i in range(-(-dim // BLOCK))]
    return np.concatenate(blocks, axis=1)[:, :dim]


def meta_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def file_bytes(steps: int, dim: int) -> int:
    """The size of the .npy noise file of T x d float32 (header included; its JSON sidecar adds
    about 8 bytes per row)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (steps, dim)})
    return header.tell() + steps * dim * 4


def write_noise(path: str | Path, noising: np.ndarray, dim: int, seed: int, *, chunk_blocks: int | None = None,
                meta: dict[str, Any] | None = None, log: Callable[[str], None] | None = None,
                chunk_bytes: int = 256 * 2**20) -> dict[str, Any]:
    """Write (C^-1 Z) in float32 to ``path`` atomically; returns the sidecar metadata.
    A chunk holds T x (chunk_blocks x 1024) floats twice (Z and C^-1 Z); by default as many
    blocks (at most 16) as fit in ``chunk_bytes``, so memory does not grow with d."""
    path = Path(path)
    refuse_special(path)
    refuse_special(meta_path(path))
    steps = noising.shape[0]
    if chunk_blocks is None:
        chunk_blocks = int(min(16, max(1, chunk_bytes // (2 * 4 * steps * BLOCK))))
    if noising.shape != (steps, steps) or dim < 1:
        raise ValueError(f"need a square noising matrix and d >= 1, got {noising.shape} and d = {dim}")
    path.parent.mkdir(parents=True, exist_ok=True)
    c_inv = np.ascontiguousarray(noising, dtype=np.float32)
    # C^-1 is lower triangular: row block [r0, r1) needs only Z[:r1] (about half the flops)
    row_edges = np.linspace(0, steps, min(8, steps) + 1).astype(int)
    t0 = time.perf_counter()
    _remove_stale_partials(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=partial_prefix(path), suffix=".tmp")
    meta_tmp = None
    try:
        chmod_like_open(fd)
        with os.fdopen(fd, "wb") as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")), "fortran_order": False,
                    "shape": (steps, dim)})
            offset = f.tell()
            f.truncate(offset + steps * dim * 4)
            f.flush()
            n_blocks = -(-dim // BLOCK)
            crc = [0] * steps  # CRC-32 of each row, continued chunk by chunk in column order
            last_log = time.perf_counter()
            for first in range(0, n_blocks, chunk_blocks):
                blocks = range(first, min(first + chunk_blocks, n_blocks))
                c0 = first * BLOCK
                width = min(dim - c0, len(blocks) * BLOCK)
                z = np.empty((steps, width), dtype=np.float32)
                for j, i in enumerate(blocks):
                    w = min(BLOCK, width - j * BLOCK)
                    z[:, j * BLOCK: j * BLOCK + w] = standard_normal_block(seed, steps, i)[:, :w]
                out = np.empty_like(z)
                for r0, r1 in zip(row_edges[:-1], row_edges[1:]):
                    np.matmul(c_inv[r0:r1, :r1], z[:r1], out=out[r0:r1])
                for t in range(steps):  # positioned writes: no mapping, so RSS stays O(chunk)
                    _pwrite_all(f.fileno(), out[t].data, offset + (t * dim + c0) * 4, path)
                    crc[t] = zlib.crc32(out[t].data, crc[t])
                if log and time.perf_counter() - last_log > 10:
                    last_log = time.perf_counter()
                    log(f"noise: columns {c0 + width}/{dim} ({100 * (c0 + width) / dim:.0f}%)")
            os.fsync(f.fileno())
        seconds = time.perf_counter() - t0
        info = {
            "format_version": FORMAT_VERSION, "steps": steps, "dim": dim, "seed": int(seed), "dtype": "float32",
            "block_columns": BLOCK, "bytes": offset + steps * dim * 4, "seconds": seconds,
            "throughput_gb_per_min": (steps * dim * 4 / 1e9) / (seconds / 60) if seconds > 0 else None,
            "peak_rss_mb": _peak_rss_mb(),
            "what": "unit-variance correlated noise C^-1 Z, Z i.i.d. N(0,1); row t is step t's noise",
            # CRC-32 of the bytes of row t, as 8 hex digits per row (NoiseFile.verify)
            "row_crc32": "".join(f"{c:08x}" for c in crc),
            **(meta or {}),
        }
        mp = meta_path(path)
        mfd, meta_tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{mp.name}.", suffix=".tmp")
        chmod_like_open(mfd)
        with os.fdopen(mfd, "w") as m:
            m.write(json.dumps(info, indent=2, sort_keys=True) + "\n")
        os.replace(meta_tmp, mp)
        os.replace(tmp, path)  # last: the final name appears only when everything is in place
    except BaseException as exc:
        for partial in (tmp, meta_tmp):
            if partial and os.path.exists(partial):
                os.unlink(partial)
        if is_no_space(exc):
            raise no_space(exc, "the noise file", path, f"it needs {steps} x {dim} float32 = "
                                                        f"{steps * dim * 4 / 1e9:.2f} GB; free space (or choose "
                                                        "another cache directory) and run again") from exc
        raise
    return info


def _pwrite_all(fd: int, data, offset: int, path: Path) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"{path}: positioned write returned {written}")
        view, offset = view[written:], offset + written


def read_meta(path: str | Path) -> dict[str, Any]:
    mp = meta_path(path)
    try:
        return json.loads(mp.read_text())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise NoiseFileError(f"the sidecar {mp} of noise file {path} is unreadable ({exc}): {_fix(Path(path))}") \
            from None


def row_variances(noising: np.ndarray) -> np.ndarray:
    """r_t^2 = ||row t of C^-1||^2: the variance of every entry of row t of C^-1 Z."""
    return np.einsum("ij,ij->i", noising, noising, dtype=np.float64)


def chi_square_band(dim: int, x: float = ROW_CHECK_X) -> tuple[float, float]:
    """(lo, hi) with P(chi2_d < lo) <= e^-x and P(chi2_d > hi) <= e^-x (Laurent & Massart 2000)."""
    return max(0.0, dim - 2.0 * math.sqrt(dim * x)), dim + 2.0 * math.sqrt(dim * x) + 2.0 * x


class NoiseFile:
    """Reads row t of a noise file with one positioned read (no mapping of the whole file).

    With ``row_variances`` (r_t^2 of the factorization the file was made from), every row read
    is checked to have ||row||^2 / r_t^2 inside the chi-square band (module docstring)."""

    def __init__(self, path: str | Path, row_variances: np.ndarray | None = None):
        self.path = Path(path)
        self.fd = None
        try:
            with open(self.path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(f)
                self.offset = f.tell()
        except (ValueError, EOFError, SyntaxError) as exc:  # numpy's errors for a damaged header
            raise NoiseFileError(f"noise file {self.path} has no valid .npy header ({exc}): {_fix(self.path)}") \
                from None
        if fortran or dtype != np.dtype("<f4") or len(shape) != 2:
            raise NoiseFileError(f"{self.path}: not a C-order float32 (T, d) noise file: {_fix(self.path)}")
        self.steps, self.dim = shape
        if self.path.stat().st_size != self.offset + self.steps * self.dim * 4:
            raise NoiseFileError(f"{self.path}: truncated noise file ({self.path.stat().st_size} bytes, expected "
                                 f"{self.offset + self.steps * self.dim * 4}): {_fix(self.path)}")
        self.bounds = None
        if row_variances is not None:
            if len(row_variances) != self.steps:
                raise NoiseFileError(f"{self.path} has {self.steps} rows, its factorization {len(row_variances)}")
            lo, hi = chi_square_band(self.dim)
            self.bounds = (np.asarray(row_variances) * lo, np.asarray(row_variances) * hi)
        self.fd = os.open(self.path, os.O_RDONLY)

    def row(self, t: int, out: np.ndarray | None = None) -> np.ndarray:
        """Row t as a float32 array of length d (read into ``out`` if given)."""
        if not 0 <= t < self.steps:
            raise IndexError(f"step {t} is outside the {self.steps} rows of {self.path}")
        out = np.empty(self.dim, dtype="<f4") if out is None else out
        n = self.dim * 4
        if os.preadv(self.fd, [memoryview(out).cast("B")], self.offset + t * n) != n:
            raise OSError(f"{self.path}: short read at row {t}")
        self.check_row(t, out)
        return out

    def check_row(self, t: int, row: np.ndarray) -> None:
        """Refuses row t if its squared norm is outside [r_t^2 lo, r_t^2 hi] (or not finite)."""
        if self.bounds is None:
            return
        sq = float(np.dot(row, row))
        lo, hi = self.bounds[0][t], self.bounds[1][t]
        if not lo <= sq <= hi:  # also catches NaN
            raise NoiseFileError(
                f"noise file {self.path}: row {t} has squared norm {sq:.6g}, outside [{lo:.6g}, {hi:.6g}], the range "
                f"of a row of C^-1 Z with d = {self.dim} (chi-square tail e^-{ROW_CHECK_X:g}): the file is damaged; "
                f"{_fix(self.path)}")

    def verify(self, meta: dict[str, Any]) -> None:
        """Reads the whole file once, a block of rows at a time, and refuses it at the first row
        whose CRC-32 differs from the sidecar's (and, with row variances, whose norm is off)."""
        crcs = meta.get("row_crc32")
        if not isinstance(crcs, str) or len(crcs) != 8 * self.steps:
            raise NoiseFileError(f"the sidecar of noise file {self.path} carries no row checksums (format "
                                 f"{meta.get('format_version')}, written before checksums): {_fix(self.path)}")
        expected = np.frombuffer(bytes.fromhex(crcs), dtype=">u4")
        rows = max(1, VERIFY_BYTES // (4 * self.dim))
        buf = np.empty((rows, self.dim), dtype="<f4")
        for t0 in range(0, self.steps, rows):
            block = buf[: min(rows, self.steps - t0)]
            n = block.nbytes
            if os.preadv(self.fd, [memoryview(block).cast("B")], self.offset + t0 * self.dim * 4) != n:
                raise OSError(f"{self.path}: short read at row {t0}")
            for i, row in enumerate(block):
                if zlib.crc32(row.data) != expected[t0 + i]:
                    raise NoiseFileError(f"noise file {self.path}: row {t0 + i} does not match the checksum its "
                                         f"writer recorded in {meta_path(self.path)}: the file is damaged; "
                                         f"{_fix(self.path)}")
                self.check_row(t0 + i, row)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def open_verified(path: Path, fact, dim: int, seed: int, log: Callable[[str], None] | None = None) -> NoiseFile:
    """The noise file at ``path``, open, after checking that its sidecar names the loaded
    factorization ``fact`` (dense_factorization.Factorization: steps, digest), d and seed, and
    that every row matches its checksum and its chi-square range: a damaged file stops the run
    before the first noisy update."""
    try:
        meta = read_meta(path)
    except FileNotFoundError:
        raise ValueError(f"noise file {path} has no metadata sidecar {path.with_suffix('.json')}") from None
    expected = {"steps": fact.steps, "dim": dim, "seed": seed, "factorization_digest": fact.digest}
    for name, value in expected.items():
        if meta.get(name) != value:
            raise ValueError(f"noise file {path} has {name} = {meta.get(name)!r}, this run needs {value!r} "
                             f"(factorization {fact.key}, d = {dim}, noise seed {seed})")
    t0 = time.perf_counter()
    file = NoiseFile(path, row_variances(fact.noising))
    file.verify(meta)
    if log:
        log(f"verified {path} ({file.steps} rows x {file.dim}: checksums and norms) in "
            f"{time.perf_counter() - t0:.1f} s")
    return file

