"""D2P2's random projection: the two projections and their sensitivity; the privacy mechanism
(planned and accounted without torch) is projected_gaussian.RandomProjectionGaussian, its noise
source noise.ProjectionNoise (Jiang, Hasan, Saadati, Balu, Liu & Sarkar 2025,
"Balancing Utility and Privacy: Dynamically Private SGD with Random Projection",
arXiv:2509.09485; earlier the ICLR 2025 submission "D2P2-SGD: Dynamically Differentially
Private Projected Stochastic Gradient Descent").

**What is released.** Step k releases r_k = P_k^T g + e_k in R^p for the clipped gradient sum g
(a d-vector), P_k in R^{d x p} public randomness drawn fresh each step from a seed taken from
the run's noise stream, e_k ~ N(0, (sigma_k s_clip s_P)^2 I_p); the update uses P_k r_k,
post-processing. Both projections below have E[P P^T] = I, so the update is unbiased.

**Sensitivity.** One changed example moves g by at most s_clip, so r_k moves by at most
||P_k^T||_op s_clip; s_P bounds ||P_k^T||_op:

* ``srht`` (the default): a subsampled randomized Hartley transform. Pad g with zeros to
  d' = ``fast_size(d)`` (the smallest integer >= d with no prime factor above 7, where FFTs are
  fast: d' / d = 1.0034 for P2's d = 225,034) and take
  P^T = sqrt(d'/p) S H D: D a random +-1 diagonal (d' x d'), H the orthonormal discrete Hartley
  transform, (H x)_k = sum_j x_j cas(2 pi j k / d') / sqrt(d'), cas = cos + sin (real, symmetric,
  H H = I, computed with one real FFT), S the selection of p of the d' coordinates without
  replacement. S H D has orthonormal rows, so ||P^T||_op <= s_P = sqrt(d'/p), with equality
  whenever d + p > d' (always here: d' - d is tiny); E_S[S^T S] = (p/d') I gives E[P P^T] = I.
  The bound holds for every draw: no failure probability, the accountant runs at the full delta.
  Cost O(d' log d') per step (two FFTs). The randomized Hadamard transform (Ailon & Chazelle
  2009, "The fast Johnson-Lindenstrauss transform and approximate nearest neighbors", SIAM J.
  Comput. 39(1)) with subsampling is analysed by Tropp 2011 ("Improved analysis of the subsampled
  randomized Hadamard transform", arXiv:1011.1595); the Hartley transform is the real FFT-based
  orthonormal mixing used by Blendenpik (Avron, Maymounkov & Toledo 2010, SIAM J. Sci. Comput.
  32(3)). We use Hartley, not Walsh-Hadamard, because Hadamard needs d' a power of two: 262,144 for
  P2, s_P = 1.290 instead of 1.197 (8% more noise) at the same speed (one 225,792-point real
  FFT and an 18-stage butterfly over 262,144 points both take about 8 ms on one core here).
  D and S are drawn on the CPU from a generator seeded with the step's seed (so the projection
  is the same on every device; torch's CPU generator keeps the seed's low 32 bits, so a long run
  may repeat a projection: harmless, P_k being public and its bound deterministic) and moved to
  the gradient's device.
* ``gaussian`` (the paper's): P = A / sqrt(p), A in R^{d x p} i.i.d. N(0, 1). ||A||_op <=
  sqrt(d) + sqrt(p) + t except with probability 2 exp(-t^2/2) (Vershynin 2012, "Introduction to
  the non-asymptotic analysis of random matrices", arXiv:1011.3027, Cor. 5.35), so s_P =
  1 + sqrt(d/p) + t/sqrt(p), with t chosen so that the bound fails at some step with probability
  at most delta_fail = delta / 10 over the run (``gaussian_tail``); the run is accounted at
  delta - delta_fail. s_P = 2.21 for P2. A is never stored: ``GaussianProjection`` draws it in
  column blocks (``block_columns``) from per-block generators seeded with a hash of the step's
  seed and the block index, on the gradient's device, a few CPU threads drawing ahead; each
  block J gives (P^T g)_J and its contribution P_J (P_J^T g + e_J), so each block is drawn once.
  Cost d p draws and 2 d p multiply-adds per step (87 s for P2 on 2 cores).

The hyperparameter ``paper_sensitivity=true`` sets s_P = 1 as the paper's analysis does; such
runs are accounted at the full delta and marked "not a valid DP guarantee".

**Lanes.** A step may hold several independent replicas side by side (the audit's trials):
every lane has its own seed, hence its own projection, and its own noise.

**For the auditor** (public randomness): ``ProjectedStep.last_seeds`` (one seed per lane),
``transpose(kind, seed, v, p)`` = P^T v for that step's P, and ``ProjectedStep.noise_std_at(k)``,
the std of e_k on the released sum.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import torch

from dpbench.mechanisms.projected_gaussian import KINDS

# -- sensitivity -------------------------------------------------------------------------------

def sensitivity_factor(kind: str, dimension: int, projection_dim: int, tail_t: float | None = None) -> float:
    """s_P, the bound on ||P^T||_op: sqrt(d'/p) for srht (exact), 1 + sqrt(d/p) + t/sqrt(p) for
    the Gaussian projection (fails with probability 2 exp(-t^2/2) per step)."""
    if kind == "srht":
        return math.sqrt(fast_size(dimension) / projection_dim)
    if kind == "gaussian":
        if tail_t is None:
            raise ValueError("the Gaussian projection's bound needs its tail parameter t")
        return 1.0 + math.sqrt(dimension / projection_dim) + tail_t / math.sqrt(projection_dim)
    raise ValueError(f"projection must be one of {', '.join(KINDS)}, got {kind!r}")


# -- srht: subsampled randomized Hartley transform ---------------------------------------------

def fast_size(n: int) -> int:
    """The smallest integer >= n whose prime factors are all <= 7 (a fast FFT length)."""
    while True:
        m = n
        for prime in (2, 3, 5, 7):
            while m % prime == 0:
                m //= prime
        if m == 1:
            return n
        n += 1


def hartley(x: torch.Tensor) -> torch.Tensor:
    """The orthonormal discrete Hartley transform along the last axis: (H x)_k = sum_j x_j
    (cos + sin)(2 pi j k / n) / sqrt(n) = Re F_k - Im F_k (F the orthonormal DFT); for real x,
    F_{n-k} = conj(F_k), so one real FFT gives all n outputs. H is symmetric and H H = I."""
    n = x.shape[-1]
    f = torch.fft.rfft(x, norm="ortho")
    re, im = f.real, f.imag
    m = f.shape[-1]  # outputs 0 .. n//2 from f directly; n - j for j = 1 .. n - m from f_j
    out = torch.empty_like(x)
    torch.sub(re, im, out=out[..., :m])
    out[..., m:] = torch.add(re[..., 1:n - m + 1], im[..., 1:n - m + 1]).flip(-1)
    return out


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device):
    """The srht's work is a dozen memory-bound O(d) passes and two 1-D FFTs, which a second CPU
    thread barely speeds up; on a shared machine each parallel pass can instead wait a scheduler
    quantum for the other thread (measured for P2's draw + back-projection on this project's
    loaded 2-core machine: 110-290 ms median with 2 threads, 42-47 ms with one). So it runs on one."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SRHT:
    """P^T = sqrt(d'/p) S H D for each of ``len(seeds)`` lanes (one seed per lane); vectors are
    (lanes, d) on the projection's side and (lanes, p) on the released side. ``signs`` (D, +-1,
    (lanes, d')) and ``index`` (S, the p selected coordinates, (lanes, p)) are the draws."""

    kind = "srht"

    def __init__(self, seeds: Sequence[int], dimension: int, projection_dim: int, device="cpu",
                 dtype=torch.float32):
        n = fast_size(dimension)
        signs, index = [], []
        with _one_cpu_thread(torch.device("cpu")):
            for seed in seeds:
                gen = torch.Generator().manual_seed(int(seed))  # CPU: the same projection on every device
                signs.append(torch.randint(0, 2, (n,), generator=gen, dtype=torch.int8))
                index.append(torch.randperm(n, generator=gen)[:projection_dim])
            signs = torch.stack(signs).to(dtype).mul_(2).sub_(1)
        self.dimension, self.padded_dimension, self.projection_dim = dimension, n, projection_dim
        self.signs = signs.to(device)
        self.index = torch.stack(index).to(device)
        self.scale = math.sqrt(n / projection_dim)

    def _mix(self, v: torch.Tensor) -> torch.Tensor:
        """S H D (v padded with zeros): (lanes, d) -> (lanes, p)."""
        d = self.dimension
        x = v.new_empty(v.shape[0], self.padded_dimension)
        x[:, d:] = 0
        torch.mul(v, self.signs[:, :d], out=x[:, :d])
        return hartley(x).gather(1, self.index)

    def _unmix(self, w: torch.Tensor) -> torch.Tensor:
        """(S H D)^T w, its first d coordinates: (lanes, p) -> (lanes, d)."""
        x = w.new_zeros(w.shape[0], self.padded_dimension).scatter_(1, self.index, w)
        d = self.dimension
        return hartley(x)[:, :d].mul_(self.signs[:, :d])

    def t(self, v: torch.Tensor) -> torch.Tensor:
        """P^T v: (lanes, d) -> (lanes, p)."""
        with _one_cpu_thread(v.device):
            return self._mix(v).mul_(self.scale)

    def apply(self, w: torch.Tensor) -> torch.Tensor:
        """P w: (lanes, p) -> (lanes, d)."""
        with _one_cpu_thread(w.device):
            return self._unmix(w * self.scale)

    def back(self, g: torch.Tensor, e: torch.Tensor | None = None) -> torch.Tensor:
        """P (P^T g + e) = (S H D)^T (c^2 S H D g + c e), c = sqrt(d'/p), lane by lane."""
        with _one_cpu_thread(g.device):
            w = self._mix(g).mul_(self.scale ** 2)
            if e is not None:
                w.add_(e, alpha=self.scale)
            return self._unmix(w)

    def matrix(self, lane: int = 0) -> torch.Tensor:
        """Lane's P, (d, p), from the fast path applied to every basis vector (small d only)."""
        k = self.projection_dim
        eye = torch.eye(k, dtype=self.signs.dtype, device=self.signs.device)
        x = eye.new_zeros(k, self.padded_dimension).scatter_(1, self.index[lane].expand(k, -1), eye)
        return (hartley(x)[:, :self.dimension] * self.signs[lane, :self.dimension] * self.scale).t()


# -- gaussian: A / sqrt(p), drawn in column blocks, never stored --------------------------------

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
    """(first column j, A[:, j:j+n]^T) for consecutive column blocks of A, in order. On a CPU,
    ``workers`` threads (default torch's thread count) draw blocks ahead of their use (torch's
    CPU generator is serial; the draws dominate the cost); the blocks do not depend on it."""
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


class GaussianProjection:
    """P = A / sqrt(p) for each of ``len(seeds)`` lanes, A drawn from the lane's seed in blocks
    whenever it is used (same interface as ``SRHT``). ``workers``: see ``_blocks``."""

    kind = "gaussian"

    def __init__(self, seeds: Sequence[int], dimension: int, projection_dim: int, device="cpu",
                 dtype=torch.float32, workers: int | None = None):
        self.seeds, self.dimension, self.projection_dim = [int(s) for s in seeds], dimension, projection_dim
        self.device, self.dtype, self.workers = device, dtype, workers
        self.scale = 1.0 / math.sqrt(projection_dim)

    def _blocks(self, seed: int):
        return _blocks(seed, self.dimension, self.projection_dim, self.device, self.dtype, self.workers)

    def t(self, v: torch.Tensor) -> torch.Tensor:
        out = v.new_empty(v.shape[0], self.projection_dim)
        for lane, seed in enumerate(self.seeds):
            for j, block in self._blocks(seed):
                torch.mv(block, v[lane], out=out[lane, j: j + block.shape[0]])
        return out.mul_(self.scale)

    def apply(self, w: torch.Tensor) -> torch.Tensor:
        out = w.new_zeros(w.shape[0], self.dimension)
        for lane, seed in enumerate(self.seeds):
            for j, block in self._blocks(seed):
                out[lane].addmv_(block.t(), w[lane, j: j + block.shape[0]], alpha=self.scale)
        return out

    def back(self, g: torch.Tensor, e: torch.Tensor | None = None) -> torch.Tensor:
        """P (P^T g + e) in one pass over A per lane: block J gives P_J^T g and P_J (P_J^T g + e_J)."""
        out = torch.zeros_like(g)
        for lane, seed in enumerate(self.seeds):
            for j, block in self._blocks(seed):
                w = torch.mv(block, g[lane]).mul_(self.scale)  # P_J^T g
                if e is not None:
                    w.add_(e[lane, j: j + block.shape[0]])
                out[lane].addmv_(block.t(), w, alpha=self.scale)  # + P_J w
        return out

    def matrix(self, lane: int = 0) -> torch.Tensor:
        """Lane's P, (d, p), block by block (small d only)."""
        a = torch.cat([block.t().clone() for _, block in self._blocks(self.seeds[lane])], dim=1)
        return a / math.sqrt(self.projection_dim)


# -- one entry point for both ----------------------------------------------------------------------

def draw(kind: str, seeds: Sequence[int], dimension: int, projection_dim: int, device="cpu",
         dtype=torch.float32) -> SRHT | GaussianProjection:
    """The projections P_k of one step, one per lane (seed)."""
    if not 1 <= projection_dim <= dimension:
        raise ValueError(f"projection dimension p = {projection_dim} must be in [1, d = {dimension}]")
    if kind == "srht":
        return SRHT(seeds, dimension, projection_dim, device, dtype)
    if kind == "gaussian":
        return GaussianProjection(seeds, dimension, projection_dim, device, dtype)
    raise ValueError(f"projection must be one of {', '.join(KINDS)}, got {kind!r}")


def transpose(kind: str, seed: int, v: torch.Tensor, projection_dim: int) -> torch.Tensor:
    """P^T v for the projection drawn from ``seed`` (a step's entry of ``last_seeds``), v a
    d-vector: what the auditor needs for ||P_k^T e_c||. Same device and dtype as v (the
    Gaussian projection's draws depend on the device's generator, srht's do not)."""
    return draw(kind, [seed], v.numel(), projection_dim, v.device, v.dtype).t(v.reshape(1, -1))[0]


def matrix(kind: str, seed: int, dimension: int, projection_dim: int, dtype=torch.float64,
           device="cpu") -> torch.Tensor:
    """P itself, (d, p), as a step on ``device`` uses it (for tests on small d; the Gaussian
    projection's draws depend on the device's generator, srht's do not)."""
    return draw(kind, [seed], dimension, projection_dim, device, dtype).matrix()


def step_seeds(generator: torch.Generator, lanes: int = 1) -> list[int]:
    """Fresh seeds for one step's projections (one per lane), drawn from the noise generator's
    stream: reproducible from the run's seed and restored with the noise source's checkpoint."""
    return torch.randint(0, 2**62, (lanes,), generator=generator, device=generator.device).tolist()
