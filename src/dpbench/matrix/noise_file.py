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
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

BLOCK = 1024  # columns per canonical block of Z
FORMAT_VERSION = 1


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


_HOST = socket.gethostname().replace(".", "_")


def _remove_stale_partials(path: Path) -> None:
    """Delete temporary files of writers of ``path`` on this host that died (a killed job
    would otherwise leave up to T x d x 4 bytes behind); live writers' files are kept."""
    for tmp in path.parent.glob(f".{path.name}.{_HOST}.*.tmp"):
        try:
            pid = int(tmp.name[len(f".{path.name}.{_HOST}."):].split(".")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass


def write_noise(path: str | Path, noising: np.ndarray, dim: int, seed: int, *, chunk_blocks: int | None = None,
                meta: dict[str, Any] | None = None, log: Callable[[str], None] | None = None,
                chunk_bytes: int = 256 * 2**20) -> dict[str, Any]:
    """Write (C^-1 Z) in float32 to ``path`` atomically; returns the sidecar metadata.
    A chunk holds T x (chunk_blocks x 1024) floats twice (Z and C^-1 Z); by default as many
    blocks (at most 16) as fit in ``chunk_bytes``, so memory does not grow with d."""
    path = Path(path)
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{_HOST}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")), "fortran_order": False,
                    "shape": (steps, dim)})
            offset = f.tell()
            f.truncate(offset + steps * dim * 4)
            f.flush()
            n_blocks = -(-dim // BLOCK)
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
                    os.pwrite(f.fileno(), out[t].data, offset + (t * dim + c0) * 4)
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
            **(meta or {}),
        }
        mp = meta_path(path)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{mp.name}.", suffix=".tmp",
                                         delete=False) as m:
            m.write(json.dumps(info, indent=2, sort_keys=True) + "\n")
        os.replace(m.name, mp)
        os.replace(tmp, path)  # last: the final name appears only when everything is in place
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return info


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads(meta_path(path).read_text())


class NoiseFile:
    """Reads row t of a noise file with one positioned read (no mapping of the whole file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            self.offset = f.tell()
        if fortran or dtype != np.dtype("<f4") or len(shape) != 2:
            raise ValueError(f"{self.path}: not a C-order float32 (T, d) noise file")
        self.steps, self.dim = shape
        if self.path.stat().st_size != self.offset + self.steps * self.dim * 4:
            raise ValueError(f"{self.path}: truncated noise file")
        self.fd = os.open(self.path, os.O_RDONLY)

    def row(self, t: int, out: np.ndarray | None = None) -> np.ndarray:
        """Row t as a float32 array of length d (read into ``out`` if given)."""
        if not 0 <= t < self.steps:
            raise IndexError(f"step {t} is outside the {self.steps} rows of {self.path}")
        out = np.empty(self.dim, dtype="<f4") if out is None else out
        n = self.dim * 4
        if os.preadv(self.fd, [memoryview(out).cast("B")], self.offset + t * n) != n:
            raise OSError(f"{self.path}: short read at row {t}")
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def log_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
