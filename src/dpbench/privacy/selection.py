"""The privacy of choosing among runs: k candidate runs trained on the same private data and the
best one published is the composition of the k runs, not one run (unless the choice itself is
made private: Papernot & Steinke 2022, arXiv:2110.03620). Every figure that picks the best of
several runs reports, beside each run's epsilon, the epsilon of the selection as it was done:
the k runs composed, at the runs' delta.

A run's privacy is its accounted event, a history of (noise_multiplier, sample_rate, steps)
segments as in ``accounting.epsilon``; one Gaussian release of sensitivity/std ratio mu (a
matrix mechanism, a composition without amplification) is the history [(1/mu, 1, 1)], since a
full-batch Gaussian step of noise multiplier sigma is the Gaussian mechanism with mu = 1/sigma.
Composing runs concatenates their histories; the epsilon of the composition comes from

* ``"prv"``: Opacus's PRV accountant, the one the runs are calibrated with (imports torch);
* ``"pld"``: this package's pessimistic PLD (``privacy.pld``, numpy only: the figures use it),
  on a loss grid h = eps_error / (total steps), so that its rounding adds at most eps_error;
* ``"rdp"``: the RDP closed form at integer orders (``accounting.fast_rdp_epsilon``), a looser
  upper bound for compositions too long for the other two.

Histories made only of full-batch steps (q = 1) compose exactly whatever the accountant:
mu^2 = sum_i n_i / sigma_i^2, one Gaussian release (Balle & Wang 2018). The composition is
never more than k times the run's epsilon (basic composition) and, by the same accountant,
k = 1 gives the run's own epsilon back.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from dpbench.privacy import accounting, pld

SELECTION_ACCOUNTANTS = (accounting.PRV.name, "pld", "rdp")  # "rdp": integer orders (fast_rdp_epsilon)


def gaussian_history(mu: float) -> accounting.History:
    """One Gaussian release with sensitivity/std ratio mu, as a history."""
    if not mu > 0:
        raise ValueError(f"mu must be positive, got {mu}")
    return [(1.0 / mu, 1.0, 1)]


def gaussian_mu(epsilon: float, delta: float = accounting.DELTA) -> float:
    """The mu of the Gaussian mechanism that is exactly (epsilon, delta)-DP, rounded up (a
    larger mu spends more: the composition computed from it is an upper bound)."""
    if not (0 < epsilon < math.inf and 0 < delta < 1):
        raise ValueError(f"need 0 < epsilon < inf and 0 < delta < 1, got epsilon={epsilon}, delta={delta}")
    lo, hi = 0.0, 1.0
    while accounting.gaussian_delta(epsilon, hi) <= delta:
        lo, hi = hi, 2 * hi
    for _ in range(200):  # delta(epsilon; mu) increases in mu: keep delta(lo) <= delta < delta(hi)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accounting.gaussian_delta(epsilon, mid) <= delta else (lo, mid)
        if hi - lo <= 1e-13 * hi:
            break
    return hi


def _merged(histories: Sequence[accounting.History]) -> accounting.History:
    """The concatenated histories, equal (sigma, q) segments summed (composition is commutative)."""
    steps: dict[tuple[float, float], int] = {}
    for history in histories:
        for s, q, n in history:
            if int(n) > 0:
                steps[(float(s), float(q))] = steps.get((float(s), float(q)), 0) + int(n)
    return [(s, q, n) for (s, q), n in steps.items()]


def _pld_epsilon(history: accounting.History, delta: float, eps_error: float) -> float:
    """The pessimistic PLD epsilon of a history (``privacy.pld``), segments composed on one grid."""
    h = eps_error / sum(n for _, _, n in history)
    if len(history) == 1:
        (s, q, n), = history
        return pld.epsilon(delta, q, s, n, h=h)
    profiles = []
    for direction in ("remove", "add"):
        total = None
        for s, q, n in history:
            losses, pmf, inf_mass = pld.composed(q, s, n, direction, h)
            part = (int(round(losses[0] / h)), pmf, inf_mass)
            total = part if total is None else pld._convolve(total, part, 1e-12, True)
        k0, pmf, inf_mass = total
        profiles.append(pld._Profile((k0 + np.arange(pmf.size)) * h, pmf, inf_mass))
    if any(p.inf_mass >= delta for p in profiles):
        return math.inf
    lo, hi = 0.0, 1.0
    while max(p(hi) for p in profiles) > delta:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if max(p(mid) for p in profiles) <= delta else (mid, hi)
    return hi


def composed_epsilon_of(histories: Sequence[accounting.History], delta: float = accounting.DELTA,
                        accountant: str = accounting.DEFAULT_ACCOUNTANT, eps_error: float = 0.01) -> float:
    """epsilon at ``delta`` of the runs with these histories, composed (any mix of runs)."""
    if accountant not in SELECTION_ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}; choose one of {SELECTION_ACCOUNTANTS}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    history = _merged(histories)
    if not history:
        return 0.0
    if any(s <= 0 for s, _, _ in history):
        return math.inf
    if all(q == 1.0 for _, q, _ in history):
        return accounting.gaussian_epsilon(math.sqrt(sum(n / s ** 2 for s, _, n in history)), delta)
    if accountant == accounting.PRV.name:
        return accounting.PRV.epsilon(history, delta)
    if accountant == "rdp":  # selection's "rdp": the registry's integer-order RDP
        return accounting.RDP_INTEGER.epsilon(history, delta)
    return _pld_epsilon(history, delta, eps_error)


def composed_epsilon(history: accounting.History, k: int, delta: float = accounting.DELTA,
                     accountant: str = accounting.DEFAULT_ACCOUNTANT, eps_error: float = 0.01) -> float:
    """epsilon at ``delta`` of k runs with the same history (k candidates of one setting, each
    (epsilon, delta)-DP on the same data), composed: the privacy of publishing the best of them."""
    if not (isinstance(k, (int, np.integer)) and k >= 1):
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return composed_epsilon_of([history] * int(k), delta, accountant, eps_error)
