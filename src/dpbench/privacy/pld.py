"""Privacy loss distributions (PLD) of the Poisson-subsampled Gaussian mechanism, composed.

An accountant independent of Opacus's PRV code, used to cross-check it and to give the
privacy profile delta(epsilon) of amplified BandMF to the audit. Method: Meiser & Mohammadi,
"Tight on Budget?" (CCS 2018) and Koskela, Jaelkoe & Honkela (AISTATS 2020), as in
google/differential-privacy's ``dp_accounting.pld``.

One step at sampling rate q and noise multiplier sigma under add/remove adjacency compares
P = (1 - q) N(0, sigma^2) + q N(1, sigma^2) (the example present) with Q = N(0, sigma^2):

* remove direction: L(x) = log(P(x) / Q(x)) = log(1 - q + q exp((2x - 1) / (2 sigma^2))), x ~ P;
* add direction: L'(x) = -L(x), x ~ Q.

L is monotone in x, so its distribution function is exact: P(L <= l) = F_P(x(l)) with
x(l) = sigma^2 log((e^l - 1 + q) / q) + 1/2. The loss is discretised on a grid of spacing h
(default min(1e-4, 0.01 / T)), each interval's mass moved to its upper end (pessimistic: the
discrete loss dominates the true one, and delta(eps) = E[(1 - e^(eps - L))_+] is increasing in
L, so every delta computed is an upper bound), with the far upper tail (probability < 1e-16)
put at +infinity. The T-fold composition is binary exponentiation of FFT convolutions (tails
below 1e-12 cut pessimistically after each); delta(eps) = E[(1 - e^(eps - sum L))_+] +
P(some L = +inf), and the
mechanism's profile is the larger of the two directions. ``pessimistic=False`` moves mass to
the lower ends instead (and drops the infinite tail), a lower bound that brackets the truth.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import signal
from scipy.special import ndtr


def _x_of_loss(loss, q: float, sigma: float):
    """x with log(1 - q + q exp((2x - 1) / (2 sigma^2))) = loss (loss > log(1 - q))."""
    return sigma * sigma * (np.log(np.expm1(loss) + q) - math.log(q)) + 0.5


def _one_step(q: float, sigma: float, direction: str, h: float, tail: float, pessimistic: bool):
    """(first grid index k0, pmf over losses (k0 + i) h, mass at +inf) of one step."""
    if direction == "remove":
        lo = math.log1p(-q)  # L > log(1 - q)
        # upper end: where P's survival function drops below tail
        x_hi = 1.0 + sigma * 9.0
        while (1 - q) * ndtr(-x_hi / sigma) + q * ndtr(-(x_hi - 1) / sigma) > tail:
            x_hi += sigma
        hi = math.log(1 - q + q * math.exp((2 * x_hi - 1) / (2 * sigma * sigma)))
        k0, k1 = math.floor(lo / h), math.ceil(hi / h)
        losses = np.arange(k0, k1 + 1) * h
        x = np.where(losses > lo, _x_of_loss(np.maximum(losses, lo + 1e-300), q, sigma), -np.inf)
        surv = (1 - q) * ndtr(-x / sigma) + q * ndtr(-(x - 1) / sigma)  # P(L > l_k)
        cdf_mass = -np.diff(surv, prepend=1.0)  # P(l_{k-1} < L <= l_k), k0's entry P(L <= l_k0) = 0
        inf_mass = float(surv[-1])
    elif direction == "add":
        hi = -math.log1p(-q)  # L' < -log(1 - q)
        x_hi = sigma * 9.0  # L' -> -inf as x -> +inf: truncate where Q's survival < tail
        while ndtr(-x_hi / sigma) > tail:
            x_hi += sigma
        lo = -math.log(1 - q + q * math.exp((2 * x_hi - 1) / (2 * sigma * sigma)))
        k0, k1 = math.floor(lo / h), math.ceil(hi / h)
        losses = np.arange(k0, k1 + 1) * h
        # P(L' <= l) = P(x >= x(-l)) = ndtr(-x(-l) / sigma) for l < -log(1 - q), else 1
        inside = losses < hi
        x = np.where(inside, _x_of_loss(np.where(inside, -losses, 0.0), q, sigma), -np.inf)
        cdf = np.where(inside, ndtr(-x / sigma), 1.0)
        cdf_mass = np.diff(cdf, prepend=0.0)  # the truncated lower tail is in the first entry
        inf_mass = 0.0
    else:
        raise ValueError(f"direction must be 'add' or 'remove', got {direction!r}")
    pmf = np.clip(cdf_mass, 0.0, None)
    if not pessimistic:  # mass of (l_{k-1}, l_k] to l_{k-1}; the infinite tail dropped
        pmf = np.append(pmf[1:], 0.0)
        inf_mass = 0.0
    return k0, pmf, inf_mass


def _truncate(k0: int, pmf: np.ndarray, inf_mass: float, tail: float, pessimistic: bool):
    """Drop the outer tails of mass < tail: pessimistically the lower tail moves up to the
    first kept loss and the upper tail to +inf; optimistically the lower tail is dropped and
    the upper tail moves down to the last kept loss."""
    lower = np.cumsum(pmf)
    first = int(np.searchsorted(lower, tail, side="right"))
    upper = np.cumsum(pmf[::-1])
    last = pmf.size - 1 - int(np.searchsorted(upper, tail, side="right"))
    if first >= last:
        return k0, pmf, inf_mass
    low_mass, high_mass = (lower[first - 1] if first else 0.0), (upper[pmf.size - 2 - last] if last < pmf.size - 1 else 0.0)
    kept = pmf[first:last + 1].copy()
    if pessimistic:
        kept[0] += low_mass
        inf_mass = 1.0 - (1.0 - inf_mass) * (1.0 - high_mass)
    else:
        kept[-1] += high_mass
    return k0 + first, kept, inf_mass


def _convolve(a, b, tail: float, pessimistic: bool):
    (ka, pa, ia), (kb, pb, ib) = a, b
    out = np.clip(signal.fftconvolve(pa, pb), 0.0, None)
    return _truncate(ka + kb, out, 1.0 - (1.0 - ia) * (1.0 - ib), tail, pessimistic)


def grid(steps: int) -> float:
    """The default loss grid h = min(1e-4, 0.01 / T): each step's rounding moves the loss by at
    most h, so the pessimistic and optimistic epsilons stay within about T h <= 0.01."""
    return min(1e-4, 0.01 / steps)


def composed(q: float, sigma: float, steps: int, direction: str, h: float | None = None, tail: float = 1e-12,
             pessimistic: bool = True):
    """(losses, pmf, mass at +inf) of the sum of ``steps`` i.i.d. discretised losses, by
    binary exponentiation of FFT convolutions; after each, tails of mass < ``tail`` are cut
    (pessimistically: to +inf or up to the first kept loss; the at most 2 log2(T) cuts add at
    most 2 log2(T) ``tail`` to delta), so the arrays grow like sqrt(T). The single step's own
    tail is cut at 1e-16.)"""
    if not (0 < q <= 1 and sigma > 0 and steps >= 1):
        raise ValueError(f"need 0 < q <= 1, sigma > 0, steps >= 1; got q={q}, sigma={sigma}, steps={steps}")
    if q == 1:
        q = 1 - 1e-15  # the full-batch Gaussian: the formulas above at their limit
    h = grid(steps) if h is None else h
    with np.errstate(divide="ignore"):
        base = _one_step(q, sigma, direction, h, 1e-16, pessimistic)
    result = None
    n = int(steps)
    while n:
        if n & 1:
            result = base if result is None else _convolve(result, base, tail, pessimistic)
        n >>= 1
        if n:
            base = _convolve(base, base, tail, pessimistic)
    k0, pmf, inf_mass = result
    return (k0 + np.arange(pmf.size)) * h, pmf, inf_mass


class _Profile:
    """delta(eps) = sum_{l > eps} p_l (1 - e^(eps - l)) + P(inf), in O(log n) per eps from
    reverse cumulative sums over the positive losses."""

    def __init__(self, losses, pmf, inf_mass):
        keep = (losses > 0) & (pmf > 0)
        self.losses, pmf = losses[keep], pmf[keep]
        self.mass = np.cumsum(pmf[::-1])[::-1]  # sum_{j >= i} p_j
        self.weighted = np.cumsum((pmf * np.exp(-self.losses))[::-1])[::-1]  # sum_{j >= i} p_j e^-l_j
        self.inf_mass = inf_mass

    def __call__(self, eps: float) -> float:
        i = int(np.searchsorted(self.losses, eps, side="right"))
        if i >= self.losses.size:
            return self.inf_mass
        return float(self.mass[i] - math.exp(eps) * self.weighted[i]) + self.inf_mass


def _profiles(q, sigma, steps, h, pessimistic):
    return [_Profile(*composed(q, sigma, steps, d, h, pessimistic=pessimistic)) for d in ("remove", "add")]


def delta(epsilons, q: float, sigma: float, steps: int, h: float | None = None, pessimistic: bool = True) -> np.ndarray:
    """delta(eps) of ``steps`` compositions under add/remove adjacency: the larger direction."""
    profiles = _profiles(q, sigma, steps, h, pessimistic)
    return np.array([max(p(float(e)) for p in profiles) for e in np.atleast_1d(epsilons)])


def epsilon(target_delta: float, q: float, sigma: float, steps: int, h: float | None = None,
            pessimistic: bool = True) -> float:
    """The smallest eps with delta(eps) <= target_delta (bisection to 1e-6)."""
    profiles = _profiles(q, sigma, steps, h, pessimistic)

    def d(e):
        return max(p(e) for p in profiles)

    if any(p.inf_mass >= target_delta for p in profiles):
        return math.inf
    if d(0.0) <= target_delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while d(hi) > target_delta:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if d(mid) <= target_delta else (mid, hi)
    return hi
