"""Intervals over seeds: every comparison with at least two seeds shows the mean over seeds and
a 95 % Student-t interval, mean ± t_{0.975, n-1} s / sqrt(n) (s: the sample standard deviation,
ddof = 1; seeds as independent draws of the run's randomness: sampling, noise, initialisation).
The t interval rather than a bootstrap: with 3-5 seeds a bootstrap's resamples take a handful of
values and its interval is too narrow. A ranking marks an entry as tied with the one ranked
above it when their intervals overlap. A difference between two configurations (``contrast_interval``)
is paired by seed where both have the same seeds (runs of one seed share their data order and
noise draws across optimizers), else Welch's."""

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


def contrast_interval(terms, level: float = LEVEL) -> tuple[float, float, float, int, str]:
    """(mean, low, high, n, how) of sum_i w_i mean(x_i) for ``terms`` [(w_i, x_i)], each x_i a
    ``pd.Series`` of one configuration's values indexed by seed (non-finite values dropped): a
    difference A - B is ``[(1, a), (-1, b)]``. Where every term has the same seeds (two or more),
    ``how`` is "paired" and the interval the t interval over the per-seed contrasts sum_i w_i
    x_i(s), n the seeds; else "Welch": standard error sqrt(sum_i w_i^2 s_i^2 / n_i) with
    Welch-Satterthwaite's degrees of freedom, n the fewest seeds of a term, low = high = NaN where
    a term has fewer than two (the mean alone). All NaN, n = 0, where a term has no value."""
    from scipy import stats

    series = [(float(w), pd.Series(x, dtype=float)) for w, x in terms]
    series = [(w, x[np.isfinite(x.to_numpy())]) for w, x in series]
    if any(x.empty for _, x in series):
        return math.nan, math.nan, math.nan, 0, ""
    seeds = set(series[0][1].index)
    if len(seeds) >= 2 and all(set(x.index) == seeds and x.index.is_unique for _, x in series):
        order = sorted(seeds)
        per_seed = sum(w * x.loc[order].to_numpy() for w, x in series)
        mean, low, high, n = t_interval(per_seed, level)
        return mean, low, high, n, "paired"
    mean = float(sum(w * x.mean() for w, x in series))
    n = min(len(x) for _, x in series)
    if n < 2:
        return mean, math.nan, math.nan, n, "Welch"
    parts = np.array([w ** 2 * x.var(ddof=1) / len(x) for w, x in series])
    se2 = float(parts.sum())
    if se2 == 0.0:
        return mean, mean, mean, n, "Welch"
    df = se2 ** 2 / float(sum(p ** 2 / (len(x) - 1) for p, (_, x) in zip(parts, series)))
    half = float(stats.t.ppf(0.5 + level / 2, df) * math.sqrt(se2))
    return mean, mean - half, mean + half, n, "Welch"


def difference_interval(a, b, level: float = LEVEL) -> tuple[float, float, float, int, str]:
    """``contrast_interval`` of A - B: ``a``, ``b`` values indexed by seed."""
    return contrast_interval([(1.0, a), (-1.0, b)], level)


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
