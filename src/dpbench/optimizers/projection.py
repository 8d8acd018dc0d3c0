"""Gaussian random projection, never stored: P = A / sqrt(p), A in R^{d x p} i.i.d. N(0, 1).

``project_back(g, p, seed, e)`` returns P (P^T g + e) for a d-vector g and a p-vector e in one
pass over A: column block J of A gives both (P^T g)_J = P_J^T g and its contribution
P_J (P_J^T g + e_J) to the result, so each block is drawn once and used twice. Blocks hold
``block_columns(d)`` columns (at most 2^24 floats, 64 MiB in float32); block j is drawn from its
own generator seeded with a hash of (step seed, j), so A depends only on (seed, d, p, the
device's generator), and on a CPU the blocks are drawn by a few threads ahead of their use
(torch's CPU generator is serial; the draws dominate the cost). Memory: O(d * block * threads).

The cost is d p Gaussian draws and 2 d p multiply-adds per step.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

BLOCK_ELEMENTS = 1 << 24
_MASK = (1 << 64) - 1


def block_columns(dimension: int) -> int:
    return max(1, BLOCK_ELEMENTS // dimension)


def block_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, block index): well-separated seeds for the blocks of one step."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def _blocks(seed: int, dimension: int, projection_dim: int, device, dtype,
            workers: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(first column j, A[:, j:j+n]^T) for consecutive column blocks of A, in order."""
    device = torch.device(device)
    c = block_columns(dimension)
    starts = list(range(0, projection_dim, c))
    if workers is None:
        workers = torch.get_num_threads() if device.type == "cpu" else 1
    workers = max(1, min(workers, len(starts)))
    buffers = [torch.empty(min(c, projection_dim), dimension, device=device, dtype=dtype)
               for _ in range(min(workers + 2, len(starts)))]

    def draw(k: int) -> torch.Tensor:
        gen = torch.Generator(device=device)
        gen.manual_seed(block_seed(seed, k))
        block = buffers[k % len(buffers)][: min(c, projection_dim - starts[k])]
        return block.normal_(generator=gen)

    if workers == 1:
        for k, j in enumerate(starts):
            yield j, draw(k)
        return
    # Blocks k+1 .. k+workers+1 are drawn while block k is used: workers + 2 buffers suffice.
    with ThreadPoolExecutor(workers) as pool:
        pending = deque((k, pool.submit(draw, k)) for k in range(min(workers + 1, len(starts))))
        nxt = len(pending)
        while pending:
            k, future = pending.popleft()
            block = future.result()
            if nxt < len(starts):
                pending.append((nxt, pool.submit(draw, nxt)))
                nxt += 1
            yield starts[k], block


def project_back(g: torch.Tensor, projection_dim: int, seed: int, e: torch.Tensor | None = None,
                 workers: int | None = None) -> torch.Tensor:
    """P (P^T g + e), P = A / sqrt(p) with A drawn from ``seed``; g is (d,), e is (p,) or None.
    ``workers``: threads drawing blocks (default: torch's thread count on a CPU, else 1); the
    result does not depend on it."""
    scale = 1.0 / math.sqrt(projection_dim)
    out = torch.zeros_like(g)
    for j, block in _blocks(seed, g.numel(), projection_dim, g.device, g.dtype, workers):
        w = torch.mv(block, g).mul_(scale)  # P_J^T g
        if e is not None:
            w.add_(e[j: j + block.shape[0]])
        out.addmv_(block.t(), w, alpha=scale)  # + P_J w
    return out


def projection_matrix(seed: int, dimension: int, projection_dim: int, device="cpu",
                      dtype=torch.float32) -> torch.Tensor:
    """P itself, (d, p), drawn exactly as ``project_back`` draws it (for tests on small d)."""
    cols = [block.t().clone() for _, block in _blocks(seed, dimension, projection_dim, device, dtype)]
    return torch.cat(cols, dim=1) / math.sqrt(projection_dim)


def step_seed(generator: torch.Generator) -> int:
    """A fresh seed for one step's projection, drawn from the noise generator's stream (so it is
    reproducible from the run's seed and restored with the noise source's checkpoint)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
