"""What cached files a mechanism's run reads, declared without torch: the workflow builds its
DAG from these (``dpbench.pipeline.catalog``, ``Cell.cache_files``) and must not import the
mechanisms themselves.

A mechanism whose runs read a factorization made ahead of them carries one of these as its
``files`` (``Mechanism.files``; None or absent: it reads no cached file):

* ``DenseFiles``: a dense matrix mechanism's factorization and its noise file C^-1 Z, one per
  (factorization, d, seed) (dense_matrix.py; the workflow's rules factorize and noise);
* ``StreamedFiles``: a streamed mechanism's factorization (streamed.py, amplified_banded.py; it
  writes no noise file; the workflow's rule factorize_streamed).

``key(request)`` names the factorization a run needs (dpbench.matrix.store.keys), the one the
mechanism's ``plan`` reads, so the workflow and the run agree on it; ``paths(...)`` are the
files under a cache directory. A plugin's mechanism that needs a factorization of one of these
kinds says so by carrying the declaration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from dpbench.matrix.store import cache, keys

if TYPE_CHECKING:
    from dpbench.mechanisms.base import PlanRequest

DEFAULT_BANDS = 64  # dpmatrix-band's "auto": min(64, b', n)


def count_or_auto(hyper: Mapping[str, Any], name: str) -> int | None:
    value = hyper.get(name, "auto")
    if value in ("auto", None):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"hyperparameter {name!r} must be a positive integer or 'auto', got {value!r}")
    return int(value)


@dataclass(frozen=True)
class DenseFiles:
    """A dense matrix mechanism's files: the factorization of (kind, k = E, b = N // L, tau) and
    the noise file of (that factorization, d, the run's noise seed)."""

    kind: str  # "se", "me", "se-lambda", "me-lambda"

    @property
    def single_epoch(self) -> bool:
        return self.kind.startswith("se")

    @property
    def convergence_aware(self) -> bool:
        return self.kind.endswith("-lambda")

    def key(self, request: PlanRequest) -> str:
        """The factorization a run needs: (kind, k = E, b = N // L, tau)."""
        n_train, batch_size, epochs = request.n_train, request.batch_size, request.epochs
        tau = request.hyperparameters.get("tau")
        if batch_size > n_train:
            raise ValueError(f"batch_size {batch_size} exceeds the number of training examples {n_train}")
        if self.single_epoch and epochs > 1:
            raise ValueError(f"the single-epoch matrix mechanism ({self.kind}) lets each example participate once: "
                             f"it cannot train for E = {epochs} epochs (use dpmatrix-me{self.kind[2:]} for E > 1)")
        return keys.dense_key(self.kind, epochs, n_train // batch_size, tau if self.convergence_aware else None)

    def paths(self, request: PlanRequest, cache_dir: str | Path, parameters: int, seed: int) -> dict[str, Path]:
        factorization, noise = cache.run_files(cache_dir, self.key(request), parameters, seed)
        return {"factorization": factorization, "noise": noise}


@dataclass(frozen=True)
class StreamedFiles:
    """A streamed mechanism's factorization: ``kind`` "band" or "blt" (fixed epoch order,
    b' = N // L steps apart, k = E participations) or "band-amp" (cyclic Poisson sampling)."""

    kind: str

    def key(self, request: PlanRequest) -> str:
        """The factorization a run needs (dpbench.matrix.store.keys): from (N, L, E) and its
        ``bands`` or ``buffers``; amplified BandMF's ``bands`` = "auto" names the band search
        (N, L, T, target epsilon, delta)."""
        n_train, batch_size, epochs = request.n_train, request.batch_size, request.epochs
        if not 1 <= batch_size <= n_train:
            raise ValueError(f"batch_size {batch_size} must be between 1 and the number of training examples {n_train}")
        if self.kind == "band-amp":
            return self._amplified_key(request)
        batches = n_train // batch_size  # b' = S: steps per epoch, the separation of participations
        steps = epochs * batches
        if self.kind == "band":
            bands = count_or_auto(request.hyperparameters, "bands")
            if bands is None:
                return keys.band_key(steps, min(DEFAULT_BANDS, batches, steps))
            if bands > batches:
                raise ValueError(f"bands = {bands} exceeds the steps per epoch b' = N // L = {batches}: with fixed "
                                 "epoch order an example's participations are b' steps apart, and b > b' bands would "
                                 "make its columns overlap (use bands <= b', or dpmatrix-blt)")
            return keys.band_key(steps, bands)
        from dpbench.matrix import blt  # scipy: only for a BLT's key

        buffers = count_or_auto(request.hyperparameters, "buffers")
        if buffers is not None and buffers > blt.MAX_BUFFERS:
            raise ValueError(f"buffers = {buffers}: at most {blt.MAX_BUFFERS} (optimisation is unstable beyond)")
        return keys.blt_key(steps, batches, epochs, buffers)

    @staticmethod
    def _amplified_key(request: PlanRequest) -> str:
        from dpbench.mechanisms import cyclic_poisson

        n_train, batch_size, epochs = request.n_train, request.batch_size, request.epochs
        steps = max(1, round(epochs * n_train / batch_size))  # T as for DP-SGD (Poisson sampling)
        bands = count_or_auto(request.hyperparameters, "bands")
        if bands is None:
            if request.target_epsilon is None:
                raise ValueError("dpmatrix-band-amp with bands = 'auto' chooses b for the target epsilon: give "
                                 "--epsilon, or set the hyperparameter bands explicitly")
            return keys.band_search_key(n_train, batch_size, steps, request.target_epsilon, request.delta)
        if bands > steps:
            raise ValueError(f"bands = {bands} exceeds the number of steps T = {steps}")
        cyclic_poisson.sample_rate(bands, batch_size, n_train)  # refuses b > N / L
        return keys.band_key(steps, bands)

    def paths(self, request: PlanRequest, cache_dir: str | Path, parameters: int, seed: int) -> dict[str, Path]:
        return {"factorization": cache.streamed_path(cache_dir, self.key(request))}
