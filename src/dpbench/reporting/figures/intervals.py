"""Intervals over seeds: every comparison with at least two seeds shows the mean over seeds and
a 95 % Student-t interval, mean ± t_{0.975, n-1} s / sqrt(n) (s: the sample standard deviation,
ddof = 1; seeds as independent draws of the run's randomness: sampling, noise, initialisation).
The t interval rather than a bootstrap: with 3-5 seeds a bootstrap's resamples take a handful of
values and its interval is too narrow. A ranking marks an entry as tied with the one ranked
above it when their intervals overlap."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

LEVEL = 0.95
INTERVAL = "95 % t interval over seeds"


def t_interval(values, level: float = LEVEL) -> tuple[float, float, float, int]:
    """(mean, low, high, n) over the finite values; low = high = mean for one value, all NaN
    for none."""
    from scipy import stats

    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if not len(v):
        return math.nan, math.nan, math.nan, 0
    mean = float(v.mean())
    if len(v) == 1:
        return mean, mean, mean, 1
    half = float(stats.t.ppf(0.5 + level / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
    return mean, mean - half, mean + half, len(v)


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two intervals (low, high) overlap, both finite."""
    return bool(np.isfinite([*a, *b]).all() and a[0] <= b[1] and b[0] <= a[1])


def tied_with_above(ranked: pd.DataFrame, low: str = "ci_low", high: str = "ci_high") -> list[bool]:
    """For rows in rank order: whether each row's interval overlaps the one ranked just above
    (the first row: False; a row without an interval, one seed, is never marked)."""
    lows, highs = ranked[low].to_numpy(dtype=float), ranked[high].to_numpy(dtype=float)
    out = [False]
    for i in range(1, len(ranked)):
        a, b = (lows[i - 1], highs[i - 1]), (lows[i], highs[i])
        out.append((a[0] < a[1] or b[0] < b[1]) and overlap(a, b))
    return out


def draw_intervals(ax, x, value, low, high) -> None:
    """Error bars from ``low`` to ``high`` around ``value`` at ``x`` (scalars or arrays), in the one
    style every comparison figure uses (gid "interval", which the tests look for)."""
    value, low, high = (np.atleast_1d(np.asarray(v, dtype=float)) for v in (value, low, high))
    ax.errorbar(x, value, yerr=[value - low, high - value], fmt="none", ecolor="black", elinewidth=0.8,
                capsize=2, gid="interval")
