"""Privacy accounting: the accountants, and the smallest sigma meeting a target.

Non-matrix optimizers compose T Poisson-subsampled Gaussian mechanisms with sample rate q
and noise multiplier sigma. We calibrate sigma as the smallest value whose PRV epsilon
(Gopi et al. 2021, Opacus's implementation, reported as its upper bound) is at most the
target, and report the RDP epsilon as a cross-check. Each accountant is an object of
``REGISTRY`` (``Accountant``: ``name``, ``epsilon(history, delta)``, ``noise_multiplier``),
one name each: a run names one of ``ACCOUNTANTS`` (``get_accountant``), ``DEFAULT_ACCOUNTANT``
unless it says otherwise; a mechanism may account with its own (``RDP_INTEGER``, D2P2's;
``ANALYTIC_GAUSSIAN``, the releases without subsampling), and its run's record names it. The
exact Gaussian-mechanism curve (Balle & Wang 2018, thesis eq. 2.4) is here too: it is the
ground truth for q = 1, where T compositions are one Gaussian mechanism with sensitivity sqrt(T).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

# The defaults of every run, audit and command (a config's train.delta and train.accountant,
# whose schema defaults a test holds equal to these: DELTA here, DEFAULT_ACCOUNTANT with the
# registry below). Standard library only at import: the command line reads them in
# environments without scipy (envs/data.yaml).
DELTA = 1e-5
# Opacus's default orders stop at 63; large sigma needs larger orders for a tight bound.
RDP_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [80, 100, 128, 160, 200, 256, 512, 1024]
MAX_NOISE_MULTIPLIER = 1e4
# The smallest sigma > 0 a run may be given (--noise-multiplier; 0 is no noise, epsilon infinite):
# below it one step's Gaussian has mu = 1/sigma > 100, whose epsilon the exact Gaussian accountant
# overflows on (exp(epsilon)) and RDP divides by zero near 0 (sigma 1e-300). Above
# MAX_NOISE_MULTIPLIER the noise overflows float32 gradients' range (sigma 1e300 in add_noise).
MIN_NOISE_MULTIPLIER = 1e-2
# Steps beyond which the PRV accountant is refused at once: its discretised domain grows with
# the compositions (10^9 steps ask numpy for 14 TiB); the thesis's longest runs take ~10^5.
PRV_MAX_STEPS = 10**8

# A history is a list of (noise_multiplier, sample_rate, steps) segments, as in Opacus.
History = list[tuple[float, float, int]]


def check_target(target_epsilon: float, delta: float | None = None) -> None:
    """Raises ValueError unless 0 < target_epsilon < inf (and 0 < delta < 1 when given): every
    sigma calibration calls this first, so that no search starts on a target it cannot meet
    (epsilon = inf would drive sigma to 0 and the PRV accountant's grid without bound)."""
    if not (isinstance(target_epsilon, (int, float)) and 0 < target_epsilon < math.inf):
        raise ValueError(f"target epsilon must be a finite positive number, got {target_epsilon}")
    if delta is not None and not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta}")


# -- the accountants: objects in one registry, a run names one (train.accountant, --accountant) --


def _segments(history: History) -> History:
    """A history as plain numbers, its empty segments dropped."""
    return [(float(s), float(q), int(n)) for s, q, n in history if n > 0]


class Accountant:
    """An accountant of Poisson-subsampled Gaussian compositions (a history of segments): its
    ``name`` (what a run names), ``epsilon(history, delta)`` and ``noise_multiplier``, the
    smallest sigma meeting a target. One object per name in ``REGISTRY``; a subclass gives
    ``_epsilon`` for a non-empty history of positive sigmas (empty: epsilon 0; sigma 0: inf)."""

    name: str
    description: str

    def epsilon(self, history: History, delta: float = DELTA) -> float:
        """The epsilon spent at ``delta`` by the composition of the history's segments."""
        history = _segments(history)
        if not history:
            return 0.0
        if any(s <= 0 for s, _, _ in history):
            return math.inf
        return self._epsilon(history, delta)

    def _epsilon(self, history: History, delta: float) -> float:
        raise NotImplementedError

    def noise_multiplier(self, history_of: Callable[[float], History], target_epsilon: float,
                         delta: float = DELTA, rel_tol: float = 1e-3) -> float:
        """The smallest sigma (to relative precision rel_tol, from above) whose history
        ``history_of(sigma)`` spends at most ``target_epsilon`` at ``delta`` (``smallest_sigma``)."""
        return smallest_sigma(lambda s: self.epsilon(history_of(s), delta), target_epsilon, rel_tol)

    def __repr__(self) -> str:
        return f"<accountant {self.name}>"


class PRVAccountant(Accountant):
    """Opacus's PRV accountant (Gopi et al. 2021), its upper bound: the runs' default."""

    name = "prv"
    description = "PRV (Gopi, Lee & Wutschitz 2021; Opacus's PRVAccountant, upper bound)"

    def _epsilon(self, history: History, delta: float) -> float:
        steps = sum(n for _, _, n in history)
        if steps > PRV_MAX_STEPS:  # its domain would need terabytes (a MemoryError, or thrashing first)
            raise ValueError(f"the PRV accountant cannot account {steps} steps (at most {PRV_MAX_STEPS:.0e}); "
                             "use fewer epochs or --accountant rdp (config: train.accountant: rdp)")
        from opacus.accountants import PRVAccountant as OpacusPRV

        acc = OpacusPRV()
        acc.history = history
        with warnings.catch_warnings():
            # log(0) at q = 1 is handled inside; the RDP bound used to size the PRV domain
            # warns about its order range, which does not affect the PRV result.
            warnings.simplefilter("ignore", RuntimeWarning)
            warnings.simplefilter("ignore", UserWarning)
            try:
                return float(acc.get_epsilon(delta))
            except (MemoryError, OverflowError) as exc:
                # its discretised domain grows with the compositions: absurd step counts
                raise ValueError(f"the PRV accountant cannot account {steps} steps "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); "
                                 "use fewer epochs or --accountant rdp (config: train.accountant: rdp)") from None


class RDPAccountant(Accountant):
    """Opacus's RDP accountant at ``RDP_ORDERS`` (Mironov 2017; Balle et al. 2020's conversion)."""

    name = "rdp"
    description = "RDP (Mironov 2017; Opacus's RDPAccountant at RDP_ORDERS)"

    def _epsilon(self, history: History, delta: float) -> float:
        from opacus.accountants import RDPAccountant as OpacusRDP

        acc = OpacusRDP()
        acc.history = history
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return float(acc.get_epsilon(delta, alphas=RDP_ORDERS))


class IntegerOrderRDP(Accountant):
    """RDP at the integer orders ``RDP_INTEGER_ORDERS``, vectorised over a history's segments
    (``fast_rdp_epsilon``): an upper bound of Opacus's RDP, equal to it at these orders, in
    milliseconds for the hundreds of segments of a decaying noise schedule (D2P2's). A
    mechanism's own accountant, not one a run names (``ACCOUNTANTS``)."""

    name = "rdp-integer-orders"
    description = "RDP at integer orders 2-63, 80, 100, 128, 160, 200, 256, 512, 1024 (fast_rdp_epsilon)"

    def _epsilon(self, history: History, delta: float) -> float:
        return fast_rdp_epsilon(history, delta)


class AnalyticGaussian(Accountant):
    """The Gaussian mechanism's exact curve (Balle & Wang 2018, thesis eq. 2.4) for releases
    without subsampling (q = 1): segments (sigma, 1, n) compose to one Gaussian mechanism with
    mu = sqrt(sum n / sigma^2) (``gaussian_epsilon``); a subsampled segment is refused. The
    accountant of the matrix mechanisms (one release C G + sigma s Z, sigma in units of s) and of
    dpdice-strict (T releases, no amplification): a mechanism's own, not one a run names."""

    name = "analytic-gaussian"
    description = "analytic Gaussian (Balle & Wang 2018), releases without subsampling"

    def _epsilon(self, history: History, delta: float) -> float:
        if any(q != 1.0 for _, q, _ in history):
            raise ValueError("the analytic Gaussian accountant accounts releases without subsampling (q = 1) only")
        return self.release_epsilon(math.sqrt(sum(n / s ** 2 for s, _, n in history)), delta)

    def release_epsilon(self, mu: float, delta: float = DELTA) -> float:
        """The epsilon of one Gaussian mechanism of sensitivity/std ratio ``mu`` at ``delta``."""
        return gaussian_epsilon(mu, delta)


PRV, RDP = PRVAccountant(), RDPAccountant()
RDP_INTEGER, ANALYTIC_GAUSSIAN = IntegerOrderRDP(), AnalyticGaussian()
# every accountant a run can be accounted with, under one name each: the two a run names, and
# the mechanisms' own (D2P2's, the one-release mechanisms')
REGISTRY: dict[str, Accountant] = {a.name: a for a in (PRV, RDP, RDP_INTEGER, ANALYTIC_GAUSSIAN)}
ACCOUNTANTS = (PRV.name, RDP.name)  # the names a run may give (the config schema's enum, a test holds it)
DEFAULT_ACCOUNTANT = PRV.name


def get_accountant(name: str | Accountant) -> Accountant:
    """The registry's accountant of this name (an ``Accountant`` is returned as it is); an
    unknown name is refused in one line naming it and the known ones."""
    if isinstance(name, Accountant):
        return name
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown accountant {name!r}; choose one of {', '.join(REGISTRY)}") from None


def epsilon(history: History, delta: float = DELTA, accountant: str | Accountant = DEFAULT_ACCOUNTANT) -> float:
    """The epsilon spent by a composition of Poisson-subsampled Gaussian mechanisms, by the
    named accountant (``get_accountant``)."""
    return get_accountant(accountant).epsilon(history, delta)


def smallest_sigma(epsilon_of: Callable[[float], float], target_epsilon: float, rel_tol: float = 1e-3) -> float:
    """The smallest sigma (to relative precision rel_tol) with epsilon_of(sigma) <= target,
    for any epsilon_of that decreases in sigma.

    Bisection keeps the invariant epsilon_of(hi) <= target < epsilon_of(lo), so the returned
    value always meets the target; sigma above MAX_NOISE_MULTIPLIER is an error.
    """
    check_target(target_epsilon)
    lo, hi = 0.0, 1.0
    while epsilon_of(hi) > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > MAX_NOISE_MULTIPLIER:
            raise ValueError(f"epsilon={target_epsilon} is not reachable with sigma <= {MAX_NOISE_MULTIPLIER}")
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if epsilon_of(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def meets_target(epsilon: float, target_epsilon: float) -> bool:
    """Whether an achieved epsilon meets its target: epsilon <= target, the test every calibration
    here keeps as its invariant (``smallest_sigma``, ``gaussian_noise_multiplier``). Their
    tolerance (rel_tol) is on sigma and taken from above, never on epsilon, and a run reports the
    epsilon of the accounting it was calibrated with, so a calibrated run meets its target with no
    slack; one that does not (sigma given with a target, a plugin's miscalibrated mechanism) was
    not private at that target."""
    return epsilon <= target_epsilon


def noise_multiplier_for(target_epsilon: float, sample_rate: float, steps: int, delta: float = DELTA,
                         accountant: str | Accountant = DEFAULT_ACCOUNTANT, rel_tol: float = 1e-3) -> float:
    """The smallest sigma meeting the target for T steps of the Poisson-subsampled Gaussian."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
    return get_accountant(accountant).noise_multiplier(lambda s: [(s, sample_rate, steps)], target_epsilon, delta,
                                                       rel_tol)


# -- the Gaussian mechanism, exactly (Balle & Wang 2018) -----------------------------------


def gaussian_delta(epsilon: float, mu: float) -> float:
    """delta(epsilon) of a Gaussian mechanism with sensitivity/std ratio mu (thesis eq. 2.4)."""
    from scipy.special import ndtr

    if mu == 0:
        return 0.0
    return float(ndtr(mu / 2 - epsilon / mu) - math.exp(epsilon) * ndtr(-mu / 2 - epsilon / mu))


def gaussian_epsilon(mu: float, delta: float = DELTA) -> float:
    """The smallest epsilon with gaussian_delta(epsilon, mu) <= delta (bisection)."""
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while gaussian_delta(hi, mu) > delta:
        lo, hi = hi, 2 * hi
    for _ in range(100):
        mid = (lo + hi) / 2
        if gaussian_delta(mid, mu) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def gaussian_noise_multiplier(target_epsilon: float, delta: float = DELTA, sensitivity: float = 1.0) -> float:
    """The smallest sigma (std / sensitivity units) making one Gaussian release (eps, delta)-DP.

    delta(eps) decreases as sigma grows, so bisection on sigma is exact to float precision. A
    target needing sigma > MAX_NOISE_MULTIPLIER * sensitivity is an error.
    """
    check_target(target_epsilon, delta)
    lo, hi = 0.0, 1.0
    while gaussian_delta(target_epsilon, sensitivity / hi) > delta:
        lo, hi = hi, 2 * hi
        if hi > MAX_NOISE_MULTIPLIER * max(sensitivity, 1.0):
            raise ValueError(f"epsilon={target_epsilon} at delta={delta} is not reachable with sigma <= "
                             f"{MAX_NOISE_MULTIPLIER:g} x sensitivity {sensitivity:g}")
    for _ in range(200):
        mid = (lo + hi) / 2
        if gaussian_delta(target_epsilon, sensitivity / mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return hi


# -- fast RDP for long histories (decaying noise schedules) --------------------------------
#
# Opacus's RDP accountant loops over its orders in Python (~60 ms per history entry, most of
# it in fractional orders), so a schedule accounted as hundreds of buckets takes minutes per
# epsilon and calibration needs dozens. At integer orders alpha the Poisson-subsampled
# Gaussian has the closed form (Mironov, Talwar & Zhang 2019, Sec. 3.3)
#     A_alpha = sum_{i=0}^{alpha} C(alpha, i) q^i (1-q)^(alpha-i) exp((i^2 - i) / (2 sigma^2)),
#     RDP(alpha) = log(A_alpha) / (alpha - 1),
# which we evaluate as one log-sum-exp per order, vectorised over all entries of a history.
# Leaving out Opacus's fractional orders only removes candidates from the minimum over
# orders, so the epsilon is an upper bound of Opacus's (and equal to it at these orders).

RDP_INTEGER_ORDERS = tuple(range(2, 64)) + (80, 100, 128, 160, 200, 256, 512, 1024)


def rdp_subsampled_gaussian(sample_rates, noise_multipliers, orders=RDP_INTEGER_ORDERS):
    """RDP of one step of the Poisson-subsampled Gaussian mechanism, at integer orders.

    ``sample_rates`` and ``noise_multipliers`` are arrays of equal length n (one entry per
    history segment); returns an (n, len(orders)) array, ``inf`` where sigma = 0.
    """
    import numpy as np
    from scipy.special import gammaln, logsumexp

    q = np.atleast_1d(np.asarray(sample_rates, dtype=np.float64))
    sigma = np.atleast_1d(np.asarray(noise_multipliers, dtype=np.float64))
    if any(float(a) != int(a) or a < 2 for a in orders):
        raise ValueError("rdp_subsampled_gaussian needs integer orders >= 2")
    out = np.zeros((q.size, len(orders)))
    sub = (q > 0) & (q < 1) & (sigma > 0)
    full = (q == 1) & (sigma > 0)
    with np.errstate(divide="ignore"):
        log_q, log_1mq = np.log(q[sub])[:, None], np.log1p(-q[sub])[:, None]
    inv_2s2 = 1.0 / (2.0 * sigma[sub] ** 2)[:, None]
    for j, alpha in enumerate(int(a) for a in orders):
        i = np.arange(alpha + 1, dtype=np.float64)
        log_binom = gammaln(alpha + 1) - gammaln(i + 1) - gammaln(alpha - i + 1)
        terms = log_binom + i * log_q + (alpha - i) * log_1mq + (i * i - i) * inv_2s2
        out[sub, j] = logsumexp(terms, axis=1) / (alpha - 1)
        out[full, j] = alpha / (2.0 * sigma[full] ** 2)
    out[(sigma <= 0) & (q > 0)] = np.inf
    return out


def rdp_to_epsilon(rdp, delta: float, orders=RDP_INTEGER_ORDERS) -> float:
    """(epsilon, delta)-DP from RDP at several orders: Balle et al. 2020, Thm. 21, exactly as
    Opacus's ``get_privacy_spent`` (the smallest bound over the orders)."""
    import numpy as np

    a = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        eps = rdp - (math.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    if np.isnan(eps).all():
        return math.inf
    return float(np.nanmin(eps))


def fast_rdp_epsilon(history: History, delta: float = DELTA, orders=RDP_INTEGER_ORDERS) -> float:
    """The RDP epsilon of a history at integer orders, vectorised over its segments: equal to
    Opacus's RDP accountant restricted to the same orders (checked by the tests), in
    milliseconds for histories of hundreds of segments."""
    import numpy as np

    history = [(float(s), float(q), int(n)) for s, q, n in history if n > 0]
    if not history:
        return 0.0
    if any(s <= 0 for s, _, _ in history):
        return math.inf
    sigma, q, n = (np.array(c) for c in zip(*history))
    rdp = (rdp_subsampled_gaussian(q, sigma, orders) * n[:, None]).sum(0)
    return rdp_to_epsilon(rdp, delta, orders)
