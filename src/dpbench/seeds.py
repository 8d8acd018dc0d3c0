"""The independent random streams of one run, derived from its seed.

A run's seed (a grid cell's, ``dpbench.pipeline.grid.seeds_from_root``) is split with numpy's
SeedSequence into one child per stream, so that model initialisation, batch sampling, noise,
the VAE's sampling, data subsets and evaluation never share random numbers: runs that differ
only in optimizer share initialisation and batches, and the correlated-noise files of the
matrix mechanisms are keyed by the noise stream's seed alone.
"""

from __future__ import annotations

import numpy as np

# A new stream goes at the end: SeedSequence children depend on their index only, so the
# earlier streams (and every existing result) stay as they were.
STREAMS = ("init", "sampler", "noise", "loss", "subset", "eval", "canary")


def stream_seeds(seed: int) -> dict[str, int]:
    """Independent 63-bit seeds for each random stream of a run (numpy SeedSequence)."""
    children = np.random.SeedSequence(seed).spawn(len(STREAMS))
    return {name: int(c.generate_state(1, np.uint64)[0] >> np.uint64(1)) for name, c in zip(STREAMS, children)}
