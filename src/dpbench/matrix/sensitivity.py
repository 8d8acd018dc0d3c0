"""L2 sensitivity of a strategy matrix C under the two participation schemes.

A user (here: one fixed batch slot, i.e. one example) contributes clipped vectors g_t with
||g_t|| <= 1 at the steps of its participation pattern pi; the mechanism releases C G + Z.
Its sensitivity is max over users and over such g of ||sum_{t in pi} C[:, t] g_t^T||_F, and
with X = C^T C,

    ||C G_pi||_F^2 = sum_{s,t in pi} X_st <g_s, g_t>.

* single epoch (each user once): the largest column norm of C (thesis eq. 2.22), exact.
* (k, b) participation, pi_j = {j, j+b, ..., j+(k-1)b}: since |<g_s, g_t>| <= 1,
  sens^2 <= max_j sum_{s,t in pi_j} |X_st|. This bound is exact (attained by g_t all equal)
  when X is non-negative on each pattern, where it equals max_j ||C u_j||^2 (u_j the 0/1
  indicator of pi_j, thesis eq. 2.42); and it is exact for every sign pattern when X vanishes
  between distinct steps of a pattern (the factorizations of dual.py have that structure).
  ``participation_norms`` (||C u_j||) alone is a lower bound: it misses users whose
  gradients flip sign between epochs whenever X has negative entries on a pattern.

These functions are the oracles the tests check every factorization against.
"""

from __future__ import annotations

import numpy as np


def patterns(epochs: int, batches: int) -> np.ndarray:
    """The (k, b) participation matrix: column j is u_j, the indicator of {j, j+b, ...}."""
    steps = epochs * batches
    u = np.zeros((steps, batches))
    u[np.arange(steps), np.arange(steps) % batches] = 1.0
    return u


def column_norms(strategy: np.ndarray) -> np.ndarray:
    return np.linalg.norm(strategy, axis=0)


def single_epoch_sensitivity(strategy: np.ndarray) -> float:
    """max_i ||C[:, i]||: each user contributes to exactly one step."""
    return float(column_norms(strategy).max())


def participation_norms(strategy: np.ndarray, epochs: int, batches: int) -> np.ndarray:
    """||C u_j|| for each of the b participation patterns (all contributions of equal sign)."""
    return np.linalg.norm(strategy @ patterns(epochs, batches), axis=0)


def multi_epoch_sensitivity(strategy: np.ndarray, epochs: int, batches: int) -> float:
    """sqrt(max_j sum_{s,t in pi_j} |X_st|): valid for any signs and directions of the g_t."""
    steps = strategy.shape[1]
    if steps != epochs * batches:
        raise ValueError(f"C has {steps} columns, not k*b = {epochs}*{batches}")
    return _pattern_bound(strategy, batches)


def _pattern_bound(strategy: np.ndarray, batches: int) -> float:
    """sqrt(max_j sum_{s,t in pi_j} |X_st|) over the patterns pi_j = {j, j+b, ...} among C's columns."""
    worst = 0.0
    for j in range(min(batches, strategy.shape[1])):
        cols = strategy[:, j::batches]
        worst = max(worst, float(np.abs(cols.T @ cols).sum()))
    return float(np.sqrt(worst))


def sensitivity(strategy: np.ndarray, epochs: int = 1, batches: int | None = None) -> float:
    """The L2 sensitivity of C for (k, b) participation; k = 1 is the single-epoch case."""
    if epochs == 1:
        return single_epoch_sensitivity(strategy)
    return multi_epoch_sensitivity(strategy, epochs, batches or strategy.shape[1] // epochs)


def prefix_sensitivity(strategy: np.ndarray, epochs: int, batches: int, steps: int) -> float:
    """Sensitivity of the first ``steps`` releases: a run stopped after t steps has released
    (C G + Z)[:t], a function of C[:t, :t] G[:t] + Z[:t] because C is lower triangular."""
    c = strategy[:steps, :steps]
    return single_epoch_sensitivity(c) if epochs == 1 else _pattern_bound(c, batches)
