"""Test statistics of the audit: one score per trial from the canary coordinate of the releases.

Each mechanism family's primary statistic is an ``AuditStatistic`` object registered by name in
``STATISTICS`` (``register_statistic`` adds one); a mechanism's ``AuditSpec.statistic`` names
it, and the audit looks the name up when it starts (``get_statistic``). Built in: ``lr`` (S_LR),
``sum`` (S_sum), ``projected-lr`` (S_LR on the release projected on P_k^T e_c), ``matrix``
(S_MF) and ``banded-lr`` (S_LR per round of the whitened releases). The functions below are the
maths they use.

Every function takes the observed releases of many trials at once, ``y`` of shape
(trials, T), with y_t = L <r_t, e_c> the release in the canary's coordinate c in sum units (the
release r_t is in mean units, L the expected batch size), and returns one score per trial,
larger meaning "the canary was in". The claim fixes the per-step canary signal a_t and noise
std s_t (DP-SGD family: a_t = s, s_t = sigma s with s the clipped-sum sensitivity; D2P2: the
projected a_k = s ||P_k^T e_c||, s_k = sigma_k s s_P, per trial where the projection is).

- ``s_lr``: the log-likelihood ratio of the Poisson families, Nasr et al. 2023 (arXiv
  2302.07956), "Dirac canary": with every other example 0 in coordinate c the y_t are
  independent, y_t ~ (1 - q) N(0, s_t^2) + q N(a_t, s_t^2) in in-trials and N(0, s_t^2) in
  out-trials, so by Neyman-Pearson the most powerful test thresholds
      S_LR = sum_t log(1 - q + q exp((2 a_t y_t - a_t^2) / (2 s_t^2))),
  computed as logaddexp(log(1 - q), log q + ...) (no overflow when a release is far out).
- ``s_sum``: S_sum = sum_t y_t (DP-Dice, whose clipped-away canary mass returns in later
  steps through its error feedback, so the total, not the per-step pattern, carries it).
- ``s_mf``: matrix mechanisms, one release C G + sigma s Z with C known: C y is the canary's
  contribution s C v plus white noise, so the projection on C v,
      S_MF = <C y, C v> / ||C v||  ~  N(s ||C v|| 1[in], sigma^2 s^2),
  is the Neyman-Pearson statistic (v the canary's signed participation vector, 0 where the
  canary is not in the batch).
- ``s_diff``: the secondary statistic S_diff = sum_t |w_t - w_{t-1}| (w = y, or C y for
  matrix mechanisms): a mechanism that reuses one noise draw gives constant out-trial
  releases, which S_LR does not see (S_LR only weighs each release by its own likelihood
  ratio, and a constant release is as likely as any single one).

Any function of the releases and public quantities is a sound statistic (post-processing);
reading hidden state (Dice's residual e) is not. ``random_ranks`` breaks ties: the bounds
assume a continuous score distribution (the j-th largest of n0 continuous out-scores has an
exact Beta law), and a score with atoms, e.g. S_diff = 0 for every reused-noise out-trial, would
make the false-positive bound wrong. Ranking the trials by (score, U) lexicographically, U an
independent uniform per trial, is ranking by a randomised statistic with a continuous law (the
randomised probability integral transform F(s-) + U (F(s) - F(s-)) orders them alike), so the
out-trials' ranks are exchangeable and the Beta law holds; the order of distinct scores is kept
exactly. (Adding U(0, 1e-9 range) to the scores does not: at scores of large
magnitude, 1e8 with atoms one apart, that is below one ulp, the ties survive and a correct
mechanism is flagged.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike


def _releases(y: ArrayLike) -> np.ndarray:
    y = np.asarray(y, dtype=np.float64)
    if y.ndim != 2:
        raise ValueError(f"releases must have shape (trials, T), got {y.shape}")
    return y


def s_lr(y: ArrayLike, signal: ArrayLike, noise: ArrayLike, sample_rate: float) -> np.ndarray:
    """S_LR per trial. ``signal`` (a_t) and ``noise`` (s_t > 0) broadcast against y: scalars,
    shape (T,), or (trials, T); ``sample_rate`` is q in (0, 1]."""
    y = _releases(y)
    a, s = np.asarray(signal, dtype=np.float64), np.asarray(noise, dtype=np.float64)
    if np.any(s <= 0):
        raise ValueError("the claimed noise std s_t must be positive")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
    log_ratio = (2 * a * y - a * a) / (2 * s * s)
    with np.errstate(divide="ignore"):  # log(1 - q) = -inf at q = 1: logaddexp gives log_ratio
        return np.logaddexp(np.log1p(-sample_rate), np.log(sample_rate) + log_ratio).sum(axis=1)


def s_sum(y: ArrayLike) -> np.ndarray:
    """S_sum = sum_t y_t per trial."""
    return _releases(y).sum(axis=1)


def s_mf(y: ArrayLike, strategy: ArrayLike, signs: ArrayLike) -> np.ndarray:
    """S_MF = <C y, C v> / ||C v|| per trial, y in sum units, C the T x T strategy matrix and
    v the canary's (T,) signed participation (entries in {-1, 0, 1})."""
    y = _releases(y)
    c = np.asarray(strategy, dtype=np.float64)
    v = np.asarray(signs, dtype=np.float64)
    if c.shape != (y.shape[1], y.shape[1]) or v.shape != (y.shape[1],):
        raise ValueError(f"strategy must be T x T and signs (T,) for T = {y.shape[1]}, "
                         f"got {c.shape} and {v.shape}")
    cv = c @ v
    norm = np.linalg.norm(cv)
    if norm == 0:
        raise ValueError("C v = 0: the canary never participates")
    return y @ (c.T @ (cv / norm))  # <C y, u> = <y, C^T u>


def s_diff(y: ArrayLike, strategy: ArrayLike | None = None) -> np.ndarray:
    """S_diff = sum_t |w_t - w_{t-1}| per trial, w = y, or w = C y given the strategy C."""
    w = _releases(y)
    if strategy is not None:
        w = w @ np.asarray(strategy, dtype=np.float64).T
    return np.abs(np.diff(w, axis=1)).sum(axis=1)


def random_ranks(scores: ArrayLike, rng: np.random.Generator) -> np.ndarray:
    """Each score's rank (0: the smallest) among all of ``scores`` (all trials of one statistic,
    in and out together) ordered by (score, U), U ~ U(0, 1) drawn from ``rng`` per score: the
    order of the scores, ties in random order. A float array, a permutation of 0, ..., n - 1."""
    x = np.asarray(scores, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{np.count_nonzero(~np.isfinite(x))} scores are not finite")
    u = rng.random(x.shape)
    order = np.lexsort((u.ravel(), x.ravel()))  # the last key sorts first: score, then U
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.arange(x.size, dtype=np.float64)
    return ranks.reshape(x.shape)


# -- the statistics of the mechanism families, registered by name ------------------------------

@dataclass(frozen=True)
class AuditStatistic:
    """A family's primary statistic: ``score`` maps the adversary's view of R trials
    (``dpbench.audit.trials.Trials``: releases y (T, R), claim, noise std, participation...) to
    one score per trial, larger meaning "the canary was in"."""

    name: str  # what AuditSpec.statistic says
    label: str  # the score's name in the audit file ("S_LR")
    whitened: bool = False  # S_diff reads the releases whitened by the strategy, w = C y
    projected: bool = False  # the trials read each release along P_t^T e_c and record the signal
    grouped: bool = False  # the trials record each canary's group (cyclic Poisson sampling)

    def score(self, trials: Any) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class LikelihoodRatio(AuditStatistic):
    """S_LR (``s_lr``) with a_t = s, or the recorded projected signal s ||P_t^T e_c||."""

    def score(self, trials: Any) -> np.ndarray:
        claim = trials.claim
        signal = trials.signal.T if trials.signal is not None else claim.clip_sensitivity  # (R, T) where projected
        return s_lr(trials.y.T, signal, trials.noise_std, claim.plan.sample_rate)


@dataclass(frozen=True)
class Sum(AuditStatistic):
    """S_sum (``s_sum``)."""

    def score(self, trials: Any) -> np.ndarray:
        return s_sum(trials.y.T)


@dataclass(frozen=True)
class MatrixProjection(AuditStatistic):
    """S_MF per trial with each trial's own participation v (the columns of ``trials.pattern``):
    <C y, C v> / ||C v||."""

    def score(self, trials: Any) -> np.ndarray:
        cy, cv = trials.claim.strategy @ trials.y, trials.claim.strategy @ trials.pattern
        norms = np.linalg.norm(cv, axis=0)
        if np.any(norms == 0):
            raise ValueError("a canary never participated (C v = 0)")
        return (cy * cv).sum(axis=0) / norms


@dataclass(frozen=True)
class BandedLikelihoodRatio(AuditStatistic):
    """Amplified BandMF (cyclic Poisson over b groups, banded C): whitened, w = C y = C G +
    sigma s Z. The canary (group g, public partition) may join at the steps t = g mod b, each
    with probability p, adding s C e_t; with b bands the columns of different such steps do
    not overlap, so the rounds are independent and the Neyman-Pearson statistic is
        S = sum_{t = g mod b} log(1 - p + p exp((2 s (C^T w)_t - s^2 ||C e_t||^2) / (2 sigma^2 s^2))),
    since <s C e_t, w> = s (C^T w)_t."""

    def score(self, trials: Any) -> np.ndarray:
        claim, strategy = trials.claim, trials.claim.strategy
        sensitivity, rate, bands = claim.clip_sensitivity, claim.plan.sample_rate, claim.plan.bands
        steps = strategy.shape[0]
        ctw = strategy.T @ (strategy @ trials.y)  # (T, R)
        col2 = (strategy ** 2).sum(axis=0)[:, None]
        var = (np.asarray(trials.noise_std, float) ** 2)[:, None]
        log_ratio = (2 * sensitivity * ctw - sensitivity ** 2 * col2) / (2 * var)
        terms = np.logaddexp(np.log1p(-rate), np.log(rate) + log_ratio)
        mine = (np.arange(steps)[:, None] % bands) == (np.asarray(trials.extras["groups"])[None, :] % bands)
        return (terms * mine).sum(axis=0)


STATISTICS: dict[str, AuditStatistic] = {}
"""The registry: AuditSpec.statistic -> its AuditStatistic (filled by ``register_statistic``)."""


def register_statistic(statistic: AuditStatistic) -> AuditStatistic:
    """Make ``statistic`` available to mechanisms under ``statistic.name`` (once)."""
    if not isinstance(statistic, AuditStatistic):
        raise TypeError(f"register_statistic takes an AuditStatistic, got {statistic!r}")
    if statistic.name in STATISTICS:
        raise ValueError(f"audit statistic {statistic.name!r} is already registered")
    STATISTICS[statistic.name] = statistic
    return statistic


def get_statistic(name: str) -> AuditStatistic:
    """The registered statistic called ``name``; an unknown name is an error that names it."""
    try:
        return STATISTICS[name]
    except KeyError:
        raise ValueError(f"unknown audit statistic {name!r} (registered: {', '.join(STATISTICS)}; add one with "
                         "dpbench.audit.statistics.register_statistic)") from None


register_statistic(LikelihoodRatio("lr", "S_LR"))
register_statistic(Sum("sum", "S_sum"))
register_statistic(LikelihoodRatio("projected-lr", "S_LR", projected=True))
register_statistic(MatrixProjection("matrix", "S_MF", whitened=True))
register_statistic(BandedLikelihoodRatio("banded-lr", "S_LR", whitened=True, grouped=True))
