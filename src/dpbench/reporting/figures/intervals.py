"""Intervals over seeds: every comparison with at least two seeds shows the mean over seeds and
a 95 % Student-t interval, mean ± t_{0.975, n-1} s / sqrt(n) (s: the sample standard deviation,
ddof = 1; seeds as independent draws of the run's randomness: sampling, noise, initialisation).
The t interval rather than a bootstrap: with 3-5 seeds a bootstrap's resamples take a handful of
values and its interval is too narrow. A ranking marks an entry as tied with the one ranked
above it when their intervals overlap. A difference between two configurations (``contrast_interval``)
is paired by seed where both have the same seeds (runs of one seed share their data order and
noise draws across optimizers), else Welch's. ``record_contrast_interval`` counts the test
records' noise too, and ``seeds_needed``/``records_needed`` size a study from a pilot's variance
components (below)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

LEVEL = 0.95
INTERVAL = "95 % t interval over seeds"
RECORD_INTERVAL = "95 % interval over seeds and test records"


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


# --- A paired difference with test-record noise (finetune_claims) ------------------------------
#
# Two configurations evaluated on the same test records differ by d_sj = sum_i w_i c_i,sj on
# record j of seed s (c: 1 where the model is right, 0 where wrong), and their difference in test
# accuracy is D_s = mean_j d_sj. Its mean over S seeds has two sources of noise: the seeds' (data
# order, noise, initialisation) and the test records' (the n records are a sample of the task's).
# The t interval over the D_s counts the second only where each seed draws its own records, and
# with three seeds it is often of width 0 (three equal differences). Here the variance of the mean
# difference is that of a random-effects model of the S x n table d (the law of total variance;
# the decomposition of benchmark variance into seeds and data sampling of Bouthillier et al. 2021,
# the paired, clustered standard errors of Miller 2024):
#
# * records drawn per seed (``test_subset``: each seed its own draw; the records two draws share
#   are ignored): d_sj = mu + a_s + e_sj, Var(mean) = s2_a / S + s2_e / (n S), estimated with
#   s2_e = the pooled within-seed variance of d and s2_a = max(0, var(D_s) - s2_e / n): the
#   between-seed variance, never less than the record noise it contains;
# * records shared by every seed (the whole test split): d_sj = mu + a_s + b_j + e_sj, Var(mean)
#   = s2_a / S + s2_b / n + s2_e / (n S), each component from the two-way ANOVA's mean squares
#   (clipped at 0).
#
# t quantile at Welch-Satterthwaite's degrees of freedom over the mean squares used (Satterthwaite
# 1946; one mean square: its own, S - 1 where the seeds' spread exceeds the records'), and two
# floors: the seeds' own t interval, and the exact (Clopper-Pearson) 95 % upper bound on the share
# of records on which the two differ when none is seen, 1 - (0.025)^(1/N) over N record draws
# (scaled by sum |w| / 2), which bounds |P(A right, B wrong) - P(A wrong, B right)|: an interval is
# never of width 0, and never narrower than the t interval over seeds. Run files without
# per-record outcomes (made before ``test_outcomes``) fall back to the least record noise their
# accuracies allow: an integer-valued d with mean D_s has variance at least f (1 - f), f the
# fractional part of |D_s| (a lower bound, said so in ``how``).


def zero_discordance_bound(records: int, level: float = LEVEL) -> float:
    """The exact upper confidence bound (two-sided ``level``) on a share p when 0 of ``records``
    draws show it: 1 - ((1 - level) / 2)^(1 / records) (Clopper-Pearson; 3.69 / records for a
    large count, the "rule of three" at 97.5 %)."""
    return 1.0 - ((1.0 - level) / 2.0) ** (1.0 / records)


@dataclass(frozen=True)
class Components:
    """A paired difference's variance components per seed and record (module comment): ``seed``
    s2_a, ``record`` s2_b (records shared by every seed; 0 where each seed draws its own),
    ``residual`` s2_e; ``shared``: whether the seeds share their test records."""

    seed: float
    record: float
    residual: float
    shared: bool

    def mean_squares(self, seeds: int, records: int) -> list[tuple[float, float, int]]:
        """The ANOVA mean squares the variance of the mean is estimated from at ``seeds`` x
        ``records``, [(sign, expected mean square, degrees of freedom)], their signed sum over
        seeds x records the variance: the seeds' (n s2_a + s2_e, S - 1) where s2_a > 0, the
        records' (S s2_b + s2_e, n - 1) where s2_b > 0 (shared records), the residual (s2_e)
        subtracted where both are there, alone where neither is."""
        s, n = seeds, records
        residual_df = (s - 1) * (n - 1) if self.shared else s * (n - 1)
        out = []
        if self.seed > 0:
            out.append((1.0, n * self.seed + self.residual, s - 1))
        if self.shared and self.record > 0:
            out.append((1.0, s * self.record + self.residual, n - 1))
        if len(out) == 2:
            out.append((-1.0, self.residual, residual_df))
        elif not out:
            out.append((1.0, self.residual, residual_df))
        return out

    def variance(self, seeds: int, records: int) -> float:
        """Var(mean difference) = s2_a / S + s2_b / n + s2_e / (n S)."""
        return self.seed / seeds + (self.record / records if self.shared else 0.0) + self.residual / (records * seeds)

    def df(self, seeds: int, records: int) -> float:
        """Welch-Satterthwaite's degrees of freedom of ``variance`` over its mean squares (one
        mean square: its own, S - 1 where the seeds' spread exceeds the record noise, as the t
        interval over seeds)."""
        ms = [(c * m, d) for c, m, d in self.mean_squares(seeds, records) if m > 0 and d > 0]
        if not ms:
            return math.inf
        total = sum(t for t, _ in ms)
        return total ** 2 / sum(t * t / d for t, d in ms) if total > 0 else math.inf

    def half_width(self, seeds: int, records: int, level: float = LEVEL, scale: float = 1.0) -> float:
        """The interval's half-width at ``seeds`` x ``records``: t * sqrt(variance), floored at
        ``zero_discordance_bound`` over the record draws (times ``scale``, sum |w| / 2)."""
        from scipy import stats

        draws = records if self.shared else records * seeds
        floor = scale * zero_discordance_bound(draws, level)
        v = self.variance(seeds, records)
        if v <= 0:
            return floor
        df = self.df(seeds, records)
        q = float(stats.norm.ppf(0.5 + level / 2) if math.isinf(df) else stats.t.ppf(0.5 + level / 2, df))
        return max(q * math.sqrt(v), floor)


@dataclass(frozen=True)
class Contrast:
    """A difference's mean and interval over ``n`` seeds; ``how`` says which interval (the
    claims table's seeds column); ``components`` the variances it came from (None: seeds only);
    ``records`` the test records per seed (0: unknown)."""

    mean: float
    low: float
    high: float
    n: int
    how: str
    components: Components | None = None
    records: int = 0
    scale: float = 1.0


def _components_nested(d_by_seed: np.ndarray, within: np.ndarray, records: int) -> Components:
    """Records drawn per seed: s2_e the mean within-seed variance, s2_a what the between-seed
    variance of the seeds' differences has beyond the record noise it contains."""
    residual = float(np.mean(within))
    seed = max(0.0, float(np.var(d_by_seed, ddof=1)) - residual / records)
    return Components(seed, 0.0, residual, shared=False)


def _components_crossed(d: np.ndarray) -> Components:
    """Records shared by every seed: the two-way random-effects ANOVA of the S x n table ``d``."""
    s, n = d.shape
    grand, rows, cols = d.mean(), d.mean(axis=1), d.mean(axis=0)
    ms_seed = n * float(((rows - grand) ** 2).sum()) / (s - 1)
    ms_record = s * float(((cols - grand) ** 2).sum()) / (n - 1)
    residual = d - rows[:, None] - cols[None, :] + grand
    ms_residual = float((residual ** 2).sum()) / ((s - 1) * (n - 1))
    return Components(max(0.0, (ms_seed - ms_residual) / n), max(0.0, (ms_record - ms_residual) / s), ms_residual,
                      shared=True)


def record_contrast_interval(terms, shared_records: bool, level: float = LEVEL) -> Contrast:
    """The interval of sum_i w_i mean(x_i) counting seeds and test records (module comment).
    ``terms``: [(w_i, x_i, outcomes_i, n_test_i)], x_i a ``pd.Series`` of one configuration's test
    accuracies by seed, outcomes_i a ``pd.Series`` by seed of its runs' per-record correctness
    (0/1 arrays in the test split's order; None or a missing seed: not recorded) and n_test_i
    the test records by seed (None: unknown). ``shared_records``: every seed tests on the same
    records in the same order. Paired by seed where every term has the same two or more seeds,
    then ``how``: "seeds × records" (shared records) or "seeds + records" (drawn per seed) from
    the outcomes; "seeds + record floor" where a run lacks them (the accuracies' least record
    noise); "paired" (seeds alone, as ``contrast_interval``) where the records are unknown or the
    weights not integers. Else ``contrast_interval``'s Welch interval. A seed whose outcomes do
    not give its recorded accuracy is refused in one line."""
    from scipy import stats

    weights = [float(t[0]) for t in terms]
    xs = [pd.Series(t[1], dtype=float) for t in terms]
    xs = [x[np.isfinite(x.to_numpy())] for x in xs]
    if any(x.empty for x in xs):
        return Contrast(math.nan, math.nan, math.nan, 0, "")
    seeds = set(xs[0].index)
    if not (len(seeds) >= 2 and all(set(x.index) == seeds and x.index.is_unique for x in xs)):
        return Contrast(*contrast_interval(list(zip(weights, xs)), level))
    order = sorted(seeds)
    per_seed = sum(w * x.loc[order].to_numpy() for w, x in zip(weights, xs))
    s, mean = len(order), float(np.mean(per_seed))
    counts = [t[3] for t in terms]
    records = set()
    for n_test in counts:
        if n_test is None:
            records = {0}
            break
        records |= {int(v) if pd.notna(v) else 0 for v in pd.Series(n_test).reindex(order)}
    n = records.pop() if len(records) == 1 else 0  # (seeds of different sizes: none counted)
    integer = all(float(w).is_integer() for w in weights)
    if n < 2 or not integer:
        m, low, high, k = t_interval(per_seed, level)
        return Contrast(m, low, high, k, "paired")
    scale = sum(abs(w) for w in weights) / 2.0
    outcomes = [None if t[2] is None else pd.Series(t[2], dtype=object).reindex(order) for t in terms]
    if all(o is not None and all(isinstance(v, np.ndarray) for v in o) for o in outcomes):
        d = np.zeros((s, n))
        for w, x, o in zip(weights, xs, outcomes):
            for k, seed in enumerate(order):
                c = np.asarray(o.loc[seed], dtype=float)
                if len(c) != n or abs(c.mean() - float(x.loc[seed])) > 1e-9:
                    raise ValueError(f"seed {seed}: the per-record test outcomes ({len(c)} records, accuracy "
                                     f"{c.mean():.6g}) do not give the recorded test accuracy {float(x.loc[seed]):.6g} "
                                     f"of {n} records")
                d[k] += w * c
        if shared_records:
            comp, how = _components_crossed(d), "seeds × records"
        else:
            comp, how = _components_nested(d.mean(axis=1), d.var(axis=1, ddof=1), n), "seeds + records"
    else:
        frac = np.abs(per_seed) - np.floor(np.abs(per_seed))
        within = frac * (1.0 - frac) * n / (n - 1)  # the least variance of an integer d with that mean
        comp, how = _components_nested(per_seed, within, n), "seeds + record floor"
    # never narrower than the seeds' own t interval (a pooled record variance with many degrees of
    # freedom, or the fallback's lower bound, could otherwise shrink it): the records only widen it
    _, seeds_low, seeds_high, _ = t_interval(per_seed, level)
    half = max(comp.half_width(s, n, level, scale), (seeds_high - seeds_low) / 2)
    return Contrast(mean, mean - half, mean + half, s, how, comp, n, scale)


def seeds_needed(components: Components, records: int, target: float = 0.02, level: float = LEVEL,
                 most: int = 10_000, scale: float = 1.0) -> int | None:
    """The fewest seeds (two or more) at ``records`` test records per seed for which a paired
    difference with these variance ``components`` (a pilot's, ``Contrast.components``) has a
    ``level`` interval of half-width at most ``target``; None where no count up to ``most`` does
    (the shared records' term s2_b / n alone is too wide: more records are needed)."""
    for seeds in range(2, most + 1):
        if components.half_width(seeds, records, level, scale) <= target:
            return seeds
    return None


def records_needed(components: Components, seeds: int, target: float = 0.02, level: float = LEVEL,
                   most: int = 10 ** 8, scale: float = 1.0) -> int | None:
    """The fewest test records per seed (two or more) at ``seeds`` seeds for the half-width
    ``target`` (as ``seeds_needed``); None where none up to ``most`` does (the seeds' term
    s2_a / S alone is too wide: more seeds are needed)."""
    if components.half_width(seeds, most, level, scale) > target:
        return None
    lo, hi = 2, most
    while lo < hi:  # the half-width falls as records grow
        mid = (lo + hi) // 2
        if components.half_width(seeds, mid, level, scale) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo
