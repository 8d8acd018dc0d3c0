"""Cyclic Poisson sampling's privacy accounting and band search (amplified BandMF).

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix
Factorization", NeurIPS 2023 (arXiv 2306.08153), Alg. 2 and Thm. 4; the event is
jax_privacy's ``accounting.amplified_bandmf_event``.

Sampling (sampling.CyclicPoissonSampler). The N examples are partitioned once into b groups;
at step t each example of group t mod b is included independently with probability
p = b L / N, so the expected batch size is L; the step divides by L. Needs b <= N / L (p <= 1).

Privacy (Thm. 4). An example of group g can only appear at steps g, g + b, g + 2b, ...: at
most ceil(T / b) times, b apart. If C is b-banded, its columns b or more apart are orthogonal,
so the correlated-noise release C G + sigma_Z Z splits into ceil(T / b) rounds in which the
example's contribution is one Poisson-sampled (probability p) vector of norm at most
C_clip max_j ||C e_j||. The mechanism therefore has every (epsilon, delta) guarantee of DP-SGD
with ceil(T / b) steps, sampling probability p and noise multiplier
sigma = sigma_Z / (C_clip max_j ||C e_j||), which we account with the harness's accountant
(PRV by default, RDP as a cross-check). Pitfalls: the rounds are ceil(T / b) (T is
pessimistic), and the rate is p = b L / N, not L / N (that would claim b times too much
amplification).

The band search. ``choose_bands`` picks the b of ``bands: auto``: any b is private, the
choice only affects utility (the RMSE proxy sigma_b sqrt(err_mean(c_b))).
"""

from __future__ import annotations

import math

import numpy as np

from dpbench.matrix import banded
from dpbench.privacy import accounting


def sample_rate(bands: int, batch_size: int, num_examples: int) -> float:
    """p = b L / N; refuses b > N / L."""
    if not 1 <= bands:
        raise ValueError(f"bands must be >= 1, got {bands}")
    if bands * batch_size > num_examples:
        raise ValueError(f"cyclic Poisson sampling with b = {bands} bands needs b <= N / L = {num_examples} / "
                         f"{batch_size} (sampling probability p = b L / N = {bands * batch_size / num_examples:g} > 1)")
    return bands * batch_size / num_examples


def rounds(steps: int, bands: int) -> int:
    """ceil(T / b): the most times one example can be sampled in T steps."""
    return -(-int(steps) // int(bands))


def history(noise_multiplier: float, rate: float, steps: int, bands: int) -> list[tuple[float, float, int]]:
    """The accounted event as an accounting.History: DP-SGD with ceil(T / b) steps at rate p
    and noise multiplier sigma = sigma_Z / (C_clip max_j ||C e_j||)."""
    return [(float(noise_multiplier), float(rate), rounds(steps, bands))]


def _candidates(most: int) -> list[int]:
    """A geometric grid of ratio ~sqrt(2): 1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, ... up to
    ``most``, and ``most`` itself."""
    out, x = {1, most}, 1.0
    while x <= most:
        out.add(int(round(x)))
        x *= math.sqrt(2)
    return sorted(b for b in out if b <= most)


def rdp_noise_multipliers(rates, rounds, target_epsilon: float, delta: float, rel_tol: float = 1e-3) -> np.ndarray:
    """For each (p_i, k_i): the smallest sigma (to relative ``rel_tol``, from above) whose
    k_i-fold Poisson-subsampled Gaussian at rate p_i is (target_epsilon, delta)-DP by the
    integer-order RDP bound (accounting.rdp_subsampled_gaussian / rdp_to_epsilon), all
    candidates bisected together in log sigma: one vectorised RDP evaluation per iteration."""
    rates, rounds = np.asarray(rates, dtype=np.float64), np.asarray(rounds, dtype=np.float64)

    def epsilons(sigmas):
        rdp = accounting.rdp_subsampled_gaussian(rates, sigmas) * rounds[:, None]
        return np.array([accounting.rdp_to_epsilon(row, delta) for row in rdp])

    lo, hi = np.full(rates.size, 1e-2), np.full(rates.size, accounting.MAX_NOISE_MULTIPLIER)
    if (epsilons(hi) > target_epsilon).any():
        raise ValueError(f"epsilon = {target_epsilon} is not reachable with sigma <= {accounting.MAX_NOISE_MULTIPLIER}")
    while (hi > (1 + rel_tol) * lo).any():
        mid = np.sqrt(lo * hi)
        ok = epsilons(mid) <= target_epsilon
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return hi


def choose_bands(n_train: int, batch_size: int, steps: int, target_epsilon: float, delta: float,
                 evaluate=None) -> tuple[int, list[dict]]:
    """b minimising the RMSE proxy sigma_b sqrt(err_mean(c_b)) over b in {1, ..., min(floor(N / L), T)}.

    sigma_b is calibrated for the amplified event with the integer-order RDP bound
    (``rdp_noise_multipliers``; jax_privacy's band search also uses RDP; the run itself is
    then calibrated with its own accountant) and c_b is banded.optimize's. The proxy is
    evaluated on a geometric grid of ratio ~sqrt(2) (b = 1 and floor(N / L) included), then
    refined around the best point by bisecting towards both neighbours until the bracket is
    narrow (at most max(2, b / 32) wide) or flat (both ends within 0.1% of the best). The
    proxy jumps where ceil(T / b) changes, so this is a search, not a proof of optimality;
    any b is private, the choice only affects utility. ``evaluate`` replaces the proxy
    (tests). Returns (b, the evaluations)."""
    most = min(n_train // batch_size, steps)
    if most < 1:
        raise ValueError(f"batch size {batch_size} exceeds the number of training examples {n_train}")
    cache: dict[int, dict] = {}

    def evaluate_all(bands: list[int]) -> None:
        new = [b for b in dict.fromkeys(bands) if b not in cache]
        if not new:
            return
        if evaluate is not None:
            cache.update({b: {"bands": b, "proxy": float(evaluate(b))} for b in new})
            return
        sigmas = rdp_noise_multipliers([sample_rate(b, batch_size, n_train) for b in new],
                                       [rounds(steps, b) for b in new], target_epsilon, delta)
        for b, sigma in zip(new, sigmas):
            err = banded.optimize(steps, b, column_normalize=True).error_mean()
            cache[b] = {"bands": b, "sigma_rdp": float(sigma), "error_mean": err,
                        "proxy": float(sigma) * math.sqrt(err)}

    def proxy(b: int) -> float:
        evaluate_all([b])
        return cache[b]["proxy"]

    grid = _candidates(most)
    evaluate_all(grid)
    best = min(grid, key=proxy)
    i = grid.index(best)
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    while hi - lo > max(2, best // 32) and max(proxy(lo), proxy(hi)) > (1 + 1e-3) * proxy(best):
        evaluate_all([b for b in ((lo + best) // 2, (best + hi + 1) // 2) if b not in (lo, best, hi)])
        points = sorted(b for b in cache if lo <= b <= hi)
        best = min(points, key=proxy)
        j = points.index(best)
        lo, hi = points[max(j - 1, 0)], points[min(j + 1, len(points) - 1)]
    return best, [cache[b] for b in sorted(cache)]
