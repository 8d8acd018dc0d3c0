"""From per-trial scores to statements about epsilon that hold with probability >= 1 - beta.

An audit runs n1 in-trials (canary present) and n0 out-trials (canary absent), each with fresh
randomness, and computes pre-registered statistics H (``statistics``; the primary one first,
then S_diff) of each trial's releases. Any test "guess in iff score >= tau" of the mechanism's
output has a false-positive rate FPR = P_out[score >= tau] and false-negative rate
FNR = P_in[score < tau], and if the mechanism is (eps, delta)-DP with respect to the canary
(Kairouz, Oh & Viswanath 2015, arXiv 1311.0776, Thm. 2.1)
    e^eps FPR + FNR >= 1 - delta   and   e^eps FNR + FPR >= 1 - delta.
The audit bounds FPR and FNR from above at a few thresholds, simultaneously:

- Thresholds at quantile levels of the out-scores, pre-registered before any score is seen:
  J = {1, 2, 4, ..., 2^floor(log2(n0/2))}, tau_j = the j-th largest out-score.
- For continuous scores (``statistics.random_ranks`` breaks ties) FPR(tau_j) = 1 - F_out(tau_j) is
  the j-th smallest of n0 uniforms, Beta(j, n0 - j + 1), so
      FPR_u = BetaInv(1 - a; j, n0 - j + 1)
  is exceeded with probability exactly a. The in-scores are independent of tau_j, so given
  tau_j the number of in-scores below it is Binomial(n1, FNR(tau_j)) and the one-sided
  Clopper-Pearson bound FNR_u = CP(k, n1; a) = BetaInv(1 - a; k + 1, n1 - k) (1 if k = n1)
  is exceeded with probability <= a.
- a = beta / (2 |H| |J|): a union bound over the 2 |H| |J| bounds makes them all hold together
  with probability >= 1 - beta (the Bonferroni choice of Nasr et al. 2023, arXiv 2302.07956,
  and of jax_privacy's ``auditing.py``; here over a few quantile levels instead of every
  threshold, which costs far less than a factor n0).

On that event:
(A) ``epsilon_lower``: eps_lb = max over (h, j) of
    max{ln((1 - delta - FNR_u)/FPR_u), ln((1 - delta - FPR_u)/FNR_u), 0}
    is below the true epsilon at delta (Jagielski, Ullman & Oprea 2020, arXiv 2006.07709,
    with Clopper-Pearson intervals; keeping the 1 - delta term).
(B) ``violation``: if the mechanism meets its claimed profile delta*(eps)
    (``dpbench.privacy.profiles``) then for every (h, j) and every eps,
    e^eps FPR_u + FNR_u >= 1 - delta*(eps) and
    e^eps FNR_u + FPR_u >= 1 - delta*(eps); the audit flags a violation when either fails at
    some eps of the grid {0, 0.02, ..., 30}, so a correct mechanism is flagged with probability
    <= beta. Thresholds are never fixed from a simulation of the claimed mechanism: a bug that
    shifts the scores would then remove all power.
(C) ``mu_lower`` and ``epsilon_gdp``: a mu-GDP mechanism (Dong, Roth & Su, arXiv 1905.02383)
    has FNR >= Phi(Phi^-1(1 - FPR) - mu), so mu_lb = max over (h, j) of
    Phi^-1(1 - FPR_u) - Phi^-1(FNR_u) (clamped at 0) bounds mu from below, and eps_GDP is the
    epsilon of mu_lb-GDP at delta (Dong et al., Cor. 2.13: ``accounting.gaussian_epsilon``).
    Sound only for exactly Gaussian mechanisms (matrix mechanisms, q = 1); under subsampling it
    is a tightness estimate (Nasr et al. 2023), reported and never flagged on.

The one-run audit of Steinke, Nasr & Jagielski 2023 (arXiv 2305.08846, App. D) is
``one_run_epsilon``: m canaries each included with probability 1/2 in one run, r guesses of
which v are correct; if the run is (eps, delta)-DP then P[v or more correct] <= p(eps) with
    p(eps) = P[Bin(r, p_eps) >= v] + 2 m delta max_{1<=i<=v} (1/i) P[v - i <= Bin(r, p_eps) < v],
p_eps = 1/(1 + e^-eps), and eps_lb = sup{eps : p(eps) < beta}.

Choices left open above, made here: the statistics' order in the ``scores`` mapping is H's
order (the primary first) and every statistic must come from the same trials (one n1, n0, so
one J); a test guesses "in" at score >= tau, trials compared by their ranks (``random_ranks``:
(score, U) lexicographically, so no two tie); the violation reported is the largest grid
epsilon at which the profile fails, with its (h, j).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike
from scipy.special import betaincinv, expit, ndtri
from scipy.stats import binom

from dpbench.privacy import accounting
from dpbench.audit.statistics import random_ranks

EPSILON_GRID = np.arange(1501) * 0.02  # {0, 0.02, ..., 30}


# -- confidence bounds -----------------------------------------------------------------------


def beta_inv(p: ArrayLike, a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """BetaInv(p; a, b): the p-quantile of Beta(a, b) (what scipy.stats.beta.ppf computes,
    without its per-call overhead: an audit evaluates it thousands of times)."""
    return betaincinv(np.asarray(a, float), np.asarray(b, float), np.asarray(p, float))


def clopper_pearson_upper(k: ArrayLike, n: int, a: float) -> np.ndarray:
    """CP(k, n; a) = BetaInv(1 - a; k + 1, n - k), 1 where k = n: P[p > CP(K, n; a)] <= a for
    K ~ Binomial(n, p)."""
    k = np.asarray(k)
    if np.any((k < 0) | (k > n)):
        raise ValueError(f"counts must be in [0, {n}]")
    inner = k < n
    return np.where(inner, beta_inv(1 - a, k + 1, np.where(inner, n - k, 1)), 1.0)


def levels(n_out: int) -> np.ndarray:
    """J = {1, 2, 4, ..., 2^floor(log2(n0/2))}: quantile levels counted from the top out-score."""
    if n_out < 2:
        raise ValueError(f"an audit needs at least 2 out-trials, got {n_out}")
    return 2 ** np.arange((n_out // 2).bit_length())  # floor(log2(n0/2)) = floor(log2(n0 // 2))


def per_bound_level(beta: float, n_statistics: int, n_levels: int) -> float:
    """a = beta / (2 |H| |J|): the failure probability of each of the 2 |H| |J| bounds."""
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    return beta / (2 * n_statistics * n_levels)


def fpr_upper(level: ArrayLike, n_out: int, a: float) -> np.ndarray:
    """FPR_u = BetaInv(1 - a; j, n0 - j + 1): the false-positive rate at the j-th largest of n0
    continuous out-scores is Beta(j, n0 - j + 1)."""
    j = np.asarray(level)
    return beta_inv(1 - a, j, n_out - j + 1)


def threshold_bounds(in_scores: ArrayLike, out_scores: ArrayLike, level: ArrayLike, a: float):
    """At each level j: tau = the j-th largest out-score, k = #{in-scores < tau}, FPR_u, FNR_u.
    Scores must be tie-free (ranked by ``random_ranks``)."""
    s_in, s_out = np.sort(np.asarray(in_scores, float)), np.sort(np.asarray(out_scores, float))
    j = np.asarray(level)
    tau = s_out[::-1][j - 1]
    misses = np.searchsorted(s_in, tau, side="left")
    return tau, misses, fpr_upper(j, s_out.size, a), clopper_pearson_upper(misses, s_in.size, a)


# -- (A), (B), (C) ---------------------------------------------------------------------------


def epsilon_lower(fpr_u: ArrayLike, fnr_u: ArrayLike, delta: float) -> np.ndarray:
    """max{ln((1 - delta - FNR_u)/FPR_u), ln((1 - delta - FPR_u)/FNR_u), 0}, elementwise."""
    fpr, fnr = np.asarray(fpr_u, float), np.asarray(fnr_u, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        e1 = np.log(np.maximum(1 - delta - fnr, 0.0)) - np.log(fpr)
        e2 = np.log(np.maximum(1 - delta - fpr, 0.0)) - np.log(fnr)
    return np.maximum(np.nan_to_num(np.maximum(e1, e2), nan=0.0, neginf=0.0), 0.0)


def violation_margin(fpr_u: ArrayLike, fnr_u: ArrayLike, profile_delta: ArrayLike,
                     eps: ArrayLike = EPSILON_GRID) -> np.ndarray:
    """(1 - delta*(eps)) - min(e^eps FPR_u + FNR_u, e^eps FNR_u + FPR_u), shape (pairs, eps):
    positive where the claimed profile is violated."""
    fpr, fnr = np.asarray(fpr_u, float)[:, None], np.asarray(fnr_u, float)[:, None]
    g = np.exp(np.asarray(eps, float))[None, :]
    lhs = np.minimum(g * fpr + fnr, g * fnr + fpr)
    return (1.0 - np.asarray(profile_delta, float))[None, :] - lhs


def mu_lower(fpr_u: ArrayLike, fnr_u: ArrayLike) -> np.ndarray:
    """Phi^-1(1 - FPR_u) - Phi^-1(FNR_u), clamped at 0, elementwise."""
    return np.maximum(-ndtri(np.asarray(fpr_u, float)) - ndtri(np.asarray(fnr_u, float)), 0.0)


def epsilon_gdp(mu: float, delta: float) -> float:
    """The epsilon of mu-GDP at delta: solves Phi(-e/mu + mu/2) - e^e Phi(-e/mu - mu/2) = delta."""
    return 0.0 if mu <= 0 else accounting.gaussian_epsilon(mu, delta)


def max_certifiable_epsilon(trials: int, beta: float = 0.05, delta: float = accounting.DELTA,
                            n_statistics: int = 2) -> float:
    """The largest eps_lb an audit of R = ``trials`` (R/2 in, R/2 out) can report: perfect
    separation (every in-score above every out-score, so k = 0 at every level)."""
    n = trials // 2
    j = levels(n)
    a = per_bound_level(beta, n_statistics, j.size)
    return float(epsilon_lower(fpr_upper(j, n, a), clopper_pearson_upper(np.zeros_like(j), n, a), delta).max())


# -- one-run mode ----------------------------------------------------------------------------


def one_run_p_value(eps: float, canaries: int, guesses: int, correct: int, delta: float) -> float:
    """p(eps) of Steinke, Nasr & Jagielski 2023, App. D."""
    p = expit(eps)
    tail = binom.sf(correct - 1, guesses, p)  # P[Bin >= v]
    if delta == 0 or correct == 0:
        return float(min(tail, 1.0))
    i = np.arange(1, correct + 1)
    window = binom.sf(correct - i - 1, guesses, p) - tail  # P[v - i <= Bin < v]
    return float(min(tail + 2 * canaries * delta * np.max(window / i), 1.0))


def one_run_epsilon(canaries: int, guesses: int, correct: int, delta: float, beta: float = 0.05,
                    tol: float = 1e-9) -> float:
    """eps_lb = sup{eps : p(eps) < beta}: bracket by doubling, then bisect (p increases in eps)."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}")

    def below(e: float) -> bool:
        return one_run_p_value(e, canaries, guesses, correct, delta) < beta

    if not below(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while below(hi):
        lo, hi = hi, 2 * hi
        if hi > 1e4:
            return math.inf
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if below(mid) else (lo, mid)
    return lo


# -- the audit ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditResult:
    """(A) epsilon_lower, (B) violation, (C) epsilon_gdp of one audit, with the (statistic,
    level) behind each and the per-(h, j) table (columns: statistic, level, threshold, misses,
    fpr_upper, fnr_upper, epsilon_lower, mu_lower, violation, violation_epsilon)."""

    epsilon_lower: float
    epsilon_lower_at: tuple[str, int] | None
    violation: bool
    violation_at: tuple[str, int, float] | None  # the largest grid epsilon violated, and where
    mu_lower: float
    mu_lower_at: tuple[str, int] | None
    epsilon_gdp: float
    statistics: tuple[str, ...]
    levels: tuple[int, ...]
    beta: float
    delta: float
    per_bound_level: float
    n_in: int
    n_out: int
    table: pd.DataFrame = field(repr=False, compare=False)

    def summary(self) -> dict[str, Any]:
        """Everything but the table, JSON-serialisable."""
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in self.__dict__.items() if k != "table"}


def analyse(scores: Mapping[str, tuple[ArrayLike, ArrayLike]], profile: Callable[[np.ndarray], np.ndarray],
            beta: float = 0.05, delta: float = accounting.DELTA,
            rng: np.random.Generator | int = 0, eps_grid: ArrayLike = EPSILON_GRID) -> AuditResult:
    """The audit of one mechanism at one claim.

    ``scores`` maps each pre-registered statistic (primary first) to (in_scores, out_scores)
    from the same trials; ``profile`` is the claim's delta*(eps) (``dpbench.privacy.profiles``), evaluated on
    ``eps_grid``; ``rng`` (a Generator or a seed) draws the uniforms that break ties
    (``statistics.random_ranks``). The table's thresholds are scores (the out-trial's at level j)."""
    if not scores:
        raise ValueError("no statistics given")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    sizes = {name: (np.size(s_in), np.size(s_out)) for name, (s_in, s_out) in scores.items()}
    n_in, n_out = next(iter(sizes.values()))
    if any(v != (n_in, n_out) for v in sizes.values()):
        raise ValueError(f"every statistic must come from the same trials; (in, out) counts: {sizes}")
    if n_in < 1:
        raise ValueError("an audit needs at least 1 in-trial")
    j = levels(n_out)
    a = per_bound_level(beta, len(scores), j.size)
    eps_grid = np.asarray(eps_grid, float)
    claimed = np.asarray(profile(eps_grid), float)
    if claimed.shape != eps_grid.shape or np.any((claimed < 0) | (claimed > 1)):
        raise ValueError("the profile must map the epsilon grid to deltas in [0, 1]")

    stats = tuple(scores)
    fpr = fpr_upper(j, n_out, a)  # the same for every statistic
    per_statistic = []
    for name in stats:
        s_in, s_out = scores[name]
        raw = np.concatenate([np.ravel(s_in), np.ravel(s_out)]).astype(float)
        ranks = random_ranks(raw, rng)
        tau, k, _, fnr = threshold_bounds(ranks[:n_in], ranks[n_in:], j, a)
        tau = np.sort(raw)[tau.astype(np.int64)]  # rank r holds the r-th smallest score
        violated = violation_margin(fpr, fnr, claimed, eps_grid) > 0
        last = violated.shape[1] - 1 - np.argmax(violated[:, ::-1], axis=1)  # the largest violated eps
        per_statistic.append((tau, k, fnr, np.where(violated.any(axis=1), eps_grid[last], np.nan)))
    threshold, misses, fnr, viol_eps = (np.concatenate(c) for c in zip(*per_statistic))
    names = np.repeat(np.array(stats, dtype=object), j.size)
    level, fpr = np.tile(j, len(stats)), np.tile(fpr, len(stats))
    eps_pairs, mu_pairs = epsilon_lower(fpr, fnr, delta), mu_lower(fpr, fnr)
    violation = ~np.isnan(viol_eps)

    def at(i: int) -> tuple[str, int]:
        return str(names[i]), int(level[i])

    i_eps, i_mu = int(eps_pairs.argmax()), int(mu_pairs.argmax())
    eps_lb, mu_lb = float(eps_pairs[i_eps]), float(mu_pairs[i_mu])
    violation_at = None
    if violation.any():
        i = int(np.nanargmax(viol_eps))
        violation_at = (*at(i), float(viol_eps[i]))
    table = pd.DataFrame({
        "statistic": names.astype(str), "level": level, "threshold": threshold, "misses": misses,
        "fpr_upper": fpr, "fnr_upper": fnr, "epsilon_lower": eps_pairs, "mu_lower": mu_pairs,
        "violation": violation, "violation_epsilon": viol_eps})
    return AuditResult(
        epsilon_lower=eps_lb, epsilon_lower_at=at(i_eps) if eps_lb > 0 else None,
        violation=bool(violation.any()), violation_at=violation_at,
        mu_lower=mu_lb, mu_lower_at=at(i_mu) if mu_lb > 0 else None, epsilon_gdp=epsilon_gdp(mu_lb, delta),
        statistics=stats, levels=tuple(int(x) for x in j), beta=beta, delta=delta, per_bound_level=a,
        n_in=n_in, n_out=n_out, table=table)
