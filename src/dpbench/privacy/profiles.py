"""Claimed privacy profiles delta*(epsilon): what a run promises at every epsilon at once, the
accountants' claims in the form the empirical audit (``dpbench.audit``) tests them.

A mechanism M is (epsilon, delta*(epsilon))-DP for every epsilon >= 0, where for neighbouring
output distributions P, Q the tight profile is the hockey-stick divergence
    delta*(epsilon) = max{H_{e^eps}(P || Q), H_{e^eps}(Q || P)},  H_g(P || Q) = E_Q[(dP/dQ - g)_+].
The audit's violation test (``dpbench.audit.bounds.analyse``) flags a run whose measured
false-positive and false-negative rates leave this region at some epsilon, so a profile here
must never be smaller than what the run's own accountant certifies; every function returns an
UPPER bound of the claim, built from the accountant the runs use (``dpbench.privacy.accounting``):

- ``prv_profile``: T Poisson-subsampled Gaussian steps (any history of (sigma, q, steps)
  segments), the numerical composition of privacy loss random variables of Gopi, Lee &
  Wutschitz 2021 (arXiv 2106.02848) with Opacus 1.6's discretisation and composition
  (``opacus.accountants.analysis.prv``), built exactly as ``PRVAccountant`` builds it. Opacus
  composes one direction only, the "remove" loss log(mixture/base) under the mixture
  (1-q) N(0, sigma^2) + q N(1, sigma^2). We also compose the "add" direction, the loss
  log(base/mixture) under the base N(0, sigma^2) (its cdf is ``_AddPRV``), on the same
  domain, and take the larger delta: under add/remove neighbours an in-trial (canary present)
  against an out-trial is the remove direction in one inequality of the test and the add
  direction in the other. Both directions are bounded by Gopi et al.'s error bound for the
  discretised composition Ytilde of the loss Y,
      delta_Ytilde(eps + eps_error) - delta_error <= delta_Y(eps) <= delta_Ytilde(eps - eps_error) + delta_error,
  whose right side is the bound Opacus's ``eps_upper`` inverts, so this profile evaluated at the epsilon that
  ``accounting.PRV.epsilon(history, delta)`` reports gives delta back (the tests check it).
  The domain (Opacus's ``compute_safe_domain_size``) is sized from the RDP of the remove
  direction, which bounds the add direction's (Mironov, Talwar & Zhang 2019, arXiv 1908.10530), and the
  add direction's left tail is lighter than the remove direction's right tail
  (P_base[L_rem >= t] <= e^-t P_mix[L_rem >= t]), so the same domain is safe for both.
  A mechanism whose sensitivity bound fails with probability delta_fail (DP2-SGD's projection)
  is accounted at delta - delta_fail; its profile adds delta_fail.
- ``gaussian_profile``: one Gaussian release with sensitivity/std ratio mu, exactly
  (Balle & Wang 2018, Thm. 8): delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2);
  symmetric in the two directions. Matrix mechanisms (one release C G + sigma s Z with
  sensitivity sens(C)) and q = 1 histories (mu = sqrt(T)/sigma) are this.
- ``rdp_profile``: the RDP curve of a history at a set of orders, converted at each epsilon by
  the conversion ``accounting.rdp_to_epsilon`` uses (Balle et al. 2020, Thm. 21, as Opacus),
  solved for delta and minimised over the orders:
      delta(eps) = min_alpha exp((alpha - 1)(rho_alpha - eps + log(1 - 1/alpha))) / alpha,
  plus ``delta_fail`` (the probability that a sensitivity bound fails, e.g. D2P2's
  projection norm). The RDP of the subsampled Gaussian bounds both directions
  (Mironov et al. 2019). Integer orders use ``accounting.rdp_subsampled_gaussian``
  (the ``fast_rdp_epsilon`` path); other orders Opacus's ``compute_rdp``.

A profile is a function from an array of epsilons to an array of deltas in [0, 1]. Each
mechanism says which of these is its claim (its ``privacy_profile``: the modules of
``dpbench.mechanisms``), from the accountant it was calibrated with and its sigma.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import log_ndtr, ndtr

from dpbench.privacy import accounting

Profile = Callable[[ArrayLike], np.ndarray]

# Opacus's PRVAccountant.get_epsilon default; its delta_error is delta / 1000.
EPS_ERROR = 0.01


# -- one Gaussian release --------------------------------------------------------------------


def gaussian_delta(eps: ArrayLike, mu: float) -> np.ndarray:
    """delta(eps) of the Gaussian mechanism with sensitivity/std ratio mu (Balle & Wang 2018),
    vectorised over eps and evaluated in the log domain (no cancellation at large eps)."""
    eps = np.asarray(eps, dtype=np.float64)
    if not mu >= 0:
        raise ValueError(f"mu must be non-negative, got {mu}")
    if mu == 0:
        return np.zeros_like(eps)
    if math.isinf(mu):
        return np.ones_like(eps)
    log_a = log_ndtr(-eps / mu + mu / 2)
    log_b = eps + log_ndtr(-eps / mu - mu / 2)
    # delta = a - b with b <= a; log_b - log_a <= 0 up to rounding
    return np.clip(np.exp(log_a) * -np.expm1(np.minimum(log_b - log_a, 0.0)), 0.0, 1.0)


def gaussian_profile(mu: float) -> Profile:
    """The exact profile of one Gaussian release with sensitivity/std ratio mu (a matrix
    mechanism calibrated by ``MatrixMechanism.calibrate``: mu = sens(C) / noise_multiplier)."""
    mu = float(mu)
    if not mu >= 0:
        raise ValueError(f"mu must be non-negative, got {mu}")
    return lambda eps: gaussian_delta(eps, mu)


# -- Poisson-subsampled Gaussian, numerically composed (PRV) -------------------------------


class _AddPRV:
    """The "add" privacy loss L = log(base/mixture)(o), o ~ base = N(0, sigma^2), of the
    Poisson-subsampled Gaussian (sensitivity 1), mixture = (1-q) N(0, sigma^2) + q N(1, sigma^2).
    L = -log(1 - q + q exp((2o - 1)/(2 sigma^2))) < -log(1 - q), and for t < -log(1 - q)
        P[L <= t] = Phi(-sigma z - 1/(2 sigma)),  z = log((e^-t - 1 + q)/q),
    written as z = -t + log1p((q - 1) e^t) - log q to avoid overflow. Opacus's discretisation
    only needs cdf, and the domain sizing reads sample_rate and noise_multiplier."""

    def __init__(self, sample_rate: float, noise_multiplier: float):
        self.sample_rate, self.noise_multiplier = sample_rate, noise_multiplier

    def cdf(self, t):
        t = np.asarray(t, dtype=np.float64)
        q, sigma = self.sample_rate, self.noise_multiplier
        if q == 1.0:  # L ~ N(1/(2 sigma^2), 1/sigma^2)
            return ndtr(sigma * t - 1.0 / (2.0 * sigma))
        top = -math.log1p(-q)
        inside = t < top
        tt = np.where(inside, t, 0.0)
        with np.errstate(divide="ignore"):
            z = -tt + np.log1p((q - 1.0) * np.exp(tt)) - math.log(q)
        return np.where(inside, ndtr(-sigma * z - 1.0 / (2.0 * sigma)), 1.0)


def _composed(history: accounting.History, directions: tuple[str, ...], eps_error: float, delta_error: float):
    """The composed discrete PRV of a history in each direction, built as Opacus 1.6's
    ``PRVAccountant._get_dprv`` builds it (same domain, mesh, truncation and composition)."""
    from opacus.accountants.analysis.prv import (Domain, PoissonSubsampledGaussianPRV,
                                                 TruncatedPrivacyRandomVariable, compose_heterogeneous,
                                                 compute_safe_domain_size, discretize)

    remove = [PoissonSubsampledGaussianPRV(q, s) for s, q, _ in history]
    steps = [n for _, _, n in history]
    with warnings.catch_warnings():
        # as in accounting.epsilon: log(0) at q = 1, and the RDP order range used for sizing
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", UserWarning)
        size = compute_safe_domain_size(remove, steps, eps_error=eps_error, delta_error=delta_error)
        mesh = eps_error / np.sqrt(sum(steps) * np.log(12 / delta_error) / 2)
        domain = Domain.create_aligned(-size, size, mesh)
        out = []
        for direction in directions:
            prvs = remove if direction == "remove" else [_AddPRV(q, s) for s, q, _ in history]
            dprvs = [discretize(TruncatedPrivacyRandomVariable(p, domain.t_min, domain.t_max), domain)
                     for p in prvs]
            out.append(compose_heterogeneous(dprvs=dprvs, num_self_compositions=steps))
        return out


def _discrete_delta(dprv) -> Callable[[np.ndarray], np.ndarray]:
    """delta of a discrete PRV Y as a function of eps: E[(1 - e^(eps - Y))_+] =
    sum_{t_i >= eps} p_i (1 - e^(eps - t_i)), the function Opacus's ``compute_epsilon``
    inverts (its tail sums computed once)."""
    t, p = dprv.domain.ts, dprv.pmf
    tail = np.append(np.cumsum(p[::-1])[::-1], 0.0)
    tail_weighted = np.append(np.cumsum((p * np.exp(-t))[::-1])[::-1], 0.0)

    def delta(eps: np.ndarray) -> np.ndarray:
        i = np.searchsorted(t, eps, side="left")
        return np.maximum(tail[i] - np.exp(eps) * tail_weighted[i], 0.0)

    return delta


PRV_DIRECTIONS = ("worst", "remove", "add")


def prv_profile(history: accounting.History, *, delta_fail: float = 0.0, accountant_delta: float = accounting.DELTA,
                direction: str = "worst", eps_error: float = EPS_ERROR) -> Profile:
    """The PRV profile of a composition of Poisson-subsampled Gaussian mechanisms, as an upper
    bound: delta_Ytilde(eps - eps_error) + delta_error (Gopi et al. 2021), in the
    worse of the add and remove directions (``direction`` selects one, for tests), plus
    ``delta_fail``.

    ``history`` is a list of (noise_multiplier, sample_rate, steps) segments as in
    ``accounting.epsilon``; ``accountant_delta`` is the delta the run's accountant was asked
    for (delta - delta_fail), which fixes delta_error = accountant_delta / 1000 as in
    ``accounting.epsilon`` (Opacus's default), so that the profile at the epsilon the run
    records is the run's delta."""
    if direction not in PRV_DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; choose one of {PRV_DIRECTIONS}")
    if not 0 <= delta_fail < 1:
        raise ValueError(f"delta_fail must be in [0, 1), got {delta_fail}")
    delta_error = accountant_delta / 1000
    history = [(float(s), float(q), int(n)) for s, q, n in history if n > 0]
    if not history or all(q == 0 for _, q, _ in history):
        return lambda eps: np.full(np.shape(eps), delta_fail)
    if any(s <= 0 or not 0 < q <= 1 for s, q, _ in history):
        raise ValueError(f"every segment needs sigma > 0 and q in (0, 1], got {history}")
    dprvs = _composed(history, ("remove", "add") if direction == "worst" else (direction,), eps_error, delta_error)
    deltas = [_discrete_delta(d) for d in dprvs]

    def profile(eps: ArrayLike) -> np.ndarray:
        shifted = np.asarray(eps, dtype=np.float64) - eps_error
        delta = np.max([d(shifted) for d in deltas], axis=0)
        return np.minimum(delta + delta_error + delta_fail, 1.0)

    return profile


# -- RDP ----------------------------------------------------------------------------------


def rdp_curve(history: accounting.History, orders=accounting.RDP_INTEGER_ORDERS) -> np.ndarray:
    """The RDP of a history at each order: the vectorised closed form at integer orders (as
    ``accounting.fast_rdp_epsilon``), Opacus's ``compute_rdp`` when an order is fractional."""
    history = [(float(s), float(q), int(n)) for s, q, n in history if n > 0]
    if not history:
        return np.zeros(len(orders))
    if any(s <= 0 for s, _, _ in history):
        return np.full(len(orders), np.inf)
    if all(float(a) == int(a) and a >= 2 for a in orders):
        sigma, q, n = (np.array(c) for c in zip(*history))
        return (accounting.rdp_subsampled_gaussian(q, sigma, orders) * n[:, None]).sum(0)
    from opacus.accountants.analysis.rdp import compute_rdp

    return np.sum([compute_rdp(q=q, noise_multiplier=s, steps=n, orders=list(orders)) for s, q, n in history],
                  axis=0)


def rdp_delta(eps: ArrayLike, rdp: ArrayLike, orders) -> np.ndarray:
    """delta(eps) from RDP rho at several orders: the conversion of ``accounting.rdp_to_epsilon``
    (Balle et al. 2020, Thm. 21) solved for delta, minimised over the orders."""
    eps = np.asarray(eps, dtype=np.float64)
    a = np.asarray(orders, dtype=np.float64)[:, None]
    rho = np.asarray(rdp, dtype=np.float64)[:, None]
    if np.any(a <= 1):
        raise ValueError("RDP orders must exceed 1")
    with np.errstate(over="ignore", invalid="ignore"):
        log_delta = (a - 1) * (rho - eps[None] + np.log1p(-1 / a)) - np.log(a)
    log_delta = np.where(np.isnan(log_delta), np.inf, log_delta)
    return np.minimum(np.exp(np.minimum(log_delta.min(axis=0), 0.0)), 1.0)


def rdp_profile(history: accounting.History, *, orders=accounting.RDP_INTEGER_ORDERS,
                delta_fail: float = 0.0) -> Profile:
    """The RDP profile of a history plus ``delta_fail``: the claim of a run accounted with
    ``accounting.fast_rdp_epsilon`` (the default orders) or Opacus's RDP accountant
    (``orders=accounting.RDP_ORDERS``) at delta - delta_fail."""
    if not 0 <= delta_fail < 1:
        raise ValueError(f"delta_fail must be in [0, 1), got {delta_fail}")
    rho = rdp_curve(history, orders)
    orders = tuple(orders)
    return lambda eps: np.minimum(rdp_delta(eps, rho, orders) + delta_fail, 1.0)


# -- the claim of a run ----------------------------------------------------------------------


def accounted_profile(accountant: accounting.Accountant | str, history: accounting.History, *, delta: float,
                      delta_fail: float = 0.0) -> Profile:
    """The claim of a run whose history the registry's ``accountant`` accounted at delta -
    delta_fail, at every epsilon: ``prv_profile`` for the PRV accountant, ``rdp_profile`` at
    Opacus's orders (``accounting.RDP_ORDERS``) for the RDP one and at the integer orders for
    ``RDP_INTEGER`` (D2P2's); plus delta_fail."""
    name = accounting.get_accountant(accountant).name
    if name == accounting.PRV.name:
        return prv_profile(history, delta_fail=delta_fail, accountant_delta=delta - delta_fail)
    if name == accounting.RDP.name:
        return rdp_profile(history, orders=accounting.RDP_ORDERS, delta_fail=delta_fail)
    if name == accounting.RDP_INTEGER.name:
        return rdp_profile(history, orders=accounting.RDP_INTEGER_ORDERS, delta_fail=delta_fail)
    raise ValueError(f"accountant {name!r} has no privacy profile of a history here (profiles: "
                     f"{accounting.PRV.name}, {accounting.RDP.name}, {accounting.RDP_INTEGER.name})")
