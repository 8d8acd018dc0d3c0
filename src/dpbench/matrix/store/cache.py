"""Where factorizations and noise files live, and how a run finds (or makes) them.

Cache layout (the workflow's rules write the same paths under ``<results_dir>/cache``):

    <cache>/matrix/<key>/factorization.npz, factorization.json   key = (kind, k, b, tau): keys.py
    <cache>/matrix/<key>/noise-d<d>-seed<seed>.npy, .json         seed = the run's noise stream
    <cache>/streaming/<key>.json                                   streamed mechanisms (streamed_files.py)

A factorization is shared by every run with the same (kind, T = k b, k, b, tau); a noise file
by every run that also has the same parameter count d and run seed: runs that differ only in
learning rate or epsilon see exactly the same noise (common random numbers). The streamed
mechanisms (BandMF, amplified BandMF, BLT) have a factorization file and no noise file.

Without Snakemake (``dpbench train`` on its own), the ensure_* functions compute missing files
under an exclusive lock (fcntl) so concurrent runs compute each file once, and write them
atomically; with Snakemake, each file is the output of exactly one job.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path
from typing import Callable

from dpbench.seeds import stream_seeds


def default_cache_dir() -> Path:
    return Path(os.environ.get("DPBENCH_CACHE_DIR") or Path(tempfile.gettempdir()) / "dpbench-cache")


def factorization_path(cache_dir: str | Path, key: str) -> Path:
    return Path(cache_dir) / "matrix" / key / "factorization.npz"


def streamed_path(cache_dir: str | Path, key: str) -> Path:
    # the folder keeps its first name, "streaming": every run records this path (factorization_file)
    return Path(cache_dir) / "streaming" / f"{key}.json"


def noise_path(cache_dir: str | Path, key: str, dim: int, seed: int) -> Path:
    return Path(cache_dir) / "matrix" / key / f"noise-d{dim}-seed{seed}.npy"


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_factorization(cache_dir: str | Path, key: str, log: Callable[[str], None] | None = None) -> Path:
    from dpbench.matrix import dense_factorization
    from dpbench.matrix.store import dense_files

    path = factorization_path(cache_dir, key)
    return ensure_file(path, lambda p: dense_files.save(dense_factorization.factorize(key, log=log), p), log,
                       f"factorizing {key} into {path}")


def ensure_file(path: Path, make: Callable[[Path], None], log: Callable[[str], None] | None = None,
                message: str | None = None) -> Path:
    """``path``, made by ``make(path)`` if missing, under an exclusive lock (concurrent runs make
    each file once; ``make`` writes atomically); ``message`` is logged before making it. Dense
    factorizations, noise files and the streamed mechanisms' factorizations (dpbench.mechanisms.streamed)
    are made this way."""
    if path.exists():
        return path
    with _locked(path):
        if not path.exists():  # another process may have made it while we waited
            if log:
                log(message or f"making {path}")
            make(path)
    return path


def ensure_noise(cache_dir: str | Path, fact, dim: int, seed: int,
                 log: Callable[[str], None] | None = None) -> Path:
    """The noise file of a loaded factorization (``dense_factorization.Factorization``), d and seed."""
    from dpbench.matrix.store import noise_files

    path = noise_path(cache_dir, fact.key, dim, seed)
    meta = {"factorization_key": fact.key, "factorization_digest": fact.digest}
    return ensure_file(path, lambda p: noise_files.write_noise(p, fact.noising, dim, seed, log=log, meta=meta), log,
                       f"writing correlated noise {path} ({fact.steps} x {dim} float32)")


def run_files(cache_dir: str | Path, key: str, parameters: int, seed: int) -> tuple[Path, Path]:
    """The factorization and noise files of a run (for the workflow: no computing here); the
    noise rows are as wide as the model's parameter count d (the caller reads it from the
    problem's facts)."""
    return factorization_path(cache_dir, key), noise_path(cache_dir, key, parameters, stream_seeds(seed)["noise"])
