"""The audit's statistical core: test statistics, simultaneous Clopper-Pearson bounds, the
violation test and the claimed privacy profiles, checked against scipy, closed forms,
published pins (Steinke, Nasr & Jagielski 2023, App. D) and simulations of correct and broken
Gaussian mechanisms with fixed seeds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import integrate, stats
from scipy.linalg import solve_triangular
from scipy.special import ndtr

from dpbench.privacy import accounting, profiles
from dpbench.audit import bounds, statistics

pytest.importorskip("opacus.accountants.analysis.prv")  # imported here, not inside the first timed test

DELTA = 1e-5


# -- Clopper-Pearson and Beta bounds ---------------------------------------------------------


@pytest.mark.parametrize("k, n, a", [(0, 10, 0.05), (3, 10, 0.01), (9, 10, 0.05), (10, 10, 0.05),
                                     (17, 500, 0.05 / 32), (250, 500, 1e-3), (0, 5000, 0.05 / 44)])
def test_clopper_pearson_matches_scipy_binomtest(k, n, a):
    # the one-sided bound at level a is the upper end of the two-sided exact interval at 1 - 2a
    expected = stats.binomtest(k, n).proportion_ci(confidence_level=1 - 2 * a, method="exact").high
    assert float(bounds.clopper_pearson_upper(k, n, a)) == pytest.approx(expected, rel=1e-9, abs=1e-15)
    if k < n:
        assert float(bounds.beta_inv(1 - a, k + 1, n - k)) == pytest.approx(stats.beta.ppf(1 - a, k + 1, n - k),
                                                                              rel=1e-12)


def test_fpr_bound_is_exceeded_with_probability_a():
    # the false-positive rate at the j-th largest of n0 continuous out-scores (uniforms: FPR = 1 - tau)
    # exceeds BetaInv(1 - a; j, n0 - j + 1) with probability exactly a; swapping the Beta's
    # parameters or taking the j-th smallest would be far off
    rng = np.random.default_rng(1)
    n0, j, a, reps = 40, 4, 0.1, 20000
    tau = np.sort(rng.random((reps, n0)), axis=1)[:, n0 - j]
    rate = np.mean(1 - tau > bounds.fpr_upper(j, n0, a))
    assert rate == pytest.approx(a, abs=0.007)  # 3.3 standard errors
    assert bounds.fpr_upper(j, n0, a) == pytest.approx(bounds.clopper_pearson_upper(j - 1, n0, a))


def test_clopper_pearson_covers():
    rng = np.random.default_rng(2)
    n, p, a = 50, 0.2, 0.05
    k = rng.binomial(n, p, size=20000)
    rate = np.mean(bounds.clopper_pearson_upper(k, n, a) < p)
    assert 0.01 < rate <= a + 0.004


@pytest.mark.parametrize("n_out, top", [(2, 1), (3, 1), (4, 2), (5, 2), (1000, 256), (1023, 256), (1024, 512)])
def test_levels(n_out, top):
    assert list(bounds.levels(n_out)) == [2 ** i for i in range(int(math.log2(top)) + 1)]


def test_levels_need_two_out_trials():
    with pytest.raises(ValueError, match="at least 2 out-trials"):
        bounds.levels(1)


def test_per_bound_level():
    # H = {primary, S_diff}, n0 = 1000: J = {1, ..., 256}, 9 levels, 36 bounds
    assert bounds.per_bound_level(0.05, 2, len(bounds.levels(1000))) == pytest.approx(0.05 / 36)


# -- maximum certifiable epsilon and the one-run bound (published pins) ---------------------


@pytest.mark.parametrize("trials, pin", [(1000, 4.46), (5000, 6.02), (20000, 7.38)])
def test_max_certifiable_epsilon_pins(trials, pin):
    # the pins are those of one pre-registered statistic (a = beta / (2 |J|))
    assert bounds.max_certifiable_epsilon(trials, 0.05, DELTA, n_statistics=1) == pytest.approx(pin, abs=0.005)


@pytest.mark.parametrize("trials", [1000, 5000, 20000])
def test_max_certifiable_epsilon_closed_form(trials):
    # perfect separation, level 1: FPR_u = FNR_u = 1 - a^(1/n), a = beta / (2 |H| |J|)
    n = trials // 2
    a = 0.05 / (2 * 2 * len(bounds.levels(n)))
    x = -math.expm1(math.log(a) / n)
    expected = math.log((1 - DELTA - x) / x)
    assert bounds.max_certifiable_epsilon(trials, 0.05, DELTA, n_statistics=2) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("m, r, v, delta, pin", [(1000, 100, 75, 1e-4, 0.673), (100000, 1510, 1439, 1e-5, 2.675)])
def test_one_run_pins(m, r, v, delta, pin):
    eps = bounds.one_run_epsilon(m, r, v, delta, 0.05)
    assert eps == pytest.approx(pin, abs=1e-3)
    # eps is where p(eps) crosses beta
    assert bounds.one_run_p_value(eps, m, r, v, delta) < 0.05 <= bounds.one_run_p_value(eps + 1e-6, m, r, v, delta)


def test_one_run_p_value_terms():
    # p(eps) by hand: tail + 2 m delta max_i P[v - i <= Bin < v] / i
    m, r, v, delta, eps = 1000, 100, 75, 1e-4, 0.5
    p = 1 / (1 + math.exp(-eps))
    pmf = stats.binom.pmf(np.arange(r + 1), r, p)
    window = max(pmf[v - i:v].sum() / i for i in range(1, v + 1))
    expected = pmf[v:].sum() + 2 * m * delta * window
    assert bounds.one_run_p_value(eps, m, r, v, delta) == pytest.approx(expected, rel=1e-9)
    assert bounds.one_run_epsilon(1000, 100, 50, 1e-4) == 0.0  # chance-level guessing proves nothing


# -- (A), (B), (C) by hand -----------------------------------------------------------------


def test_epsilon_lower_by_hand():
    got = bounds.epsilon_lower([0.01, 0.2, 0.6, 0.5], [0.2, 0.01, 0.6, 1.0], DELTA)
    assert got[0] == pytest.approx(math.log((1 - DELTA - 0.2) / 0.01))  # keeps the 1 - delta term
    assert got[1] == pytest.approx(math.log((1 - DELTA - 0.2) / 0.01))  # the other inequality
    assert got[2] == 0.0 and got[3] == 0.0


def test_violation_margin_by_hand():
    eps = np.array([0.0, 1.0, 4.38, 4.40])
    margin = bounds.violation_margin([0.01], [0.2], np.zeros(4), eps)[0]
    assert margin[1] == pytest.approx(1 - (math.e * 0.01 + 0.2))
    assert list(margin > 0) == [True, True, True, False]  # e^eps 0.01 + 0.2 < 1 iff eps < ln 80 = 4.382
    # a larger claimed delta* moves the boundary: 1 - delta* = 0.3 is met from eps = ln 10 = 2.30
    assert list(bounds.violation_margin([0.01], [0.2], np.full(4, 0.7), eps)[0] > 0) == [True, True, False, False]


def test_mu_lower_recovers_a_gaussian_tradeoff():
    # points on the exact mu-GDP trade-off curve FNR = Phi(Phi^-1(1 - FPR) - mu)
    mu, fpr = 1.3, np.array([1e-3, 0.05, 0.3])
    fnr = ndtr(stats.norm.isf(fpr) - mu)
    assert bounds.mu_lower(fpr, fnr) == pytest.approx(np.full(3, mu), rel=1e-9)
    assert bounds.mu_lower([0.5], [0.6])[0] == 0.0


@pytest.mark.parametrize("mu", [0.5, 1.0, 3.0])
def test_epsilon_gdp_solves_the_gdp_equation(mu):
    e = bounds.epsilon_gdp(mu, DELTA)
    assert ndtr(-e / mu + mu / 2) - math.exp(e) * ndtr(-e / mu - mu / 2) == pytest.approx(DELTA, rel=1e-6)
    assert bounds.epsilon_gdp(0.0, DELTA) == 0.0


# -- analyse ----------------------------------------------------------------------------------


def test_analyse_perfect_separation_reaches_the_maximum():
    s_out, s_in = np.arange(500.0), 1000.0 + np.arange(500.0)
    one = bounds.analyse({"S_LR": (s_in, s_out)}, lambda e: np.zeros_like(e))
    assert one.epsilon_lower == pytest.approx(4.456, abs=1e-3)
    two = bounds.analyse({"S_LR": (s_in, s_out), "S_diff": (s_in, s_out)}, lambda e: np.zeros_like(e))
    assert two.epsilon_lower == pytest.approx(bounds.max_certifiable_epsilon(1000, 0.05, DELTA, 2), rel=1e-12)
    assert two.epsilon_lower_at == ("S_LR", 1)
    assert two.levels == (1, 2, 4, 8, 16, 32, 64, 128)
    assert two.per_bound_level == pytest.approx(0.05 / 32)
    assert len(two.table) == 16 and (two.table.misses == 0).all()
    assert two.violation  # a pure-DP claim (delta* = 0) is refuted
    json.dumps(two.summary())


def test_violation_and_epsilon_lower_agree_under_a_constant_profile():
    # with delta*(eps) = delta for every eps, the profile is violated exactly below eps_lb, so the
    # largest violated grid point is the last grid point below eps_lb
    rng = np.random.default_rng(3)
    s_out, s_in = rng.standard_normal(1000), rng.standard_normal(1000) + 3.0
    r = bounds.analyse({"S": (s_in, s_out)}, lambda e: np.full_like(e, DELTA), rng=4)
    assert r.violation and r.violation_at[:2] == r.epsilon_lower_at
    assert r.violation_at[2] == pytest.approx(math.floor(r.epsilon_lower / 0.02) * 0.02)
    # (C) for this exactly Gaussian separation (mu = 3) is close below 3
    assert 2.3 < r.mu_lower < 3.0


def test_ties_need_random_ranks():
    # reused noise: every score equal. Raw, the threshold equals every in-score, no in-score is
    # below it and the "bound" certifies a large epsilon; ranked with random tie-breaks, in and
    # out are exchangeable
    zeros = np.zeros(500)
    j = bounds.levels(500)
    _, misses, fpr, fnr = bounds.threshold_bounds(zeros, zeros, j, 0.05 / 16)
    assert (misses == 0).all() and bounds.epsilon_lower(fpr, fnr, DELTA).max() > 4
    r = bounds.analyse({"S_diff": (zeros, zeros)}, lambda e: np.zeros_like(e), rng=0)
    assert not r.violation and r.epsilon_lower < 1


@pytest.mark.parametrize("atoms", [[0.0, 1.0], [0.0, 1.0, 2.0]])
def test_ties_at_large_magnitude_do_not_flag_a_correct_mechanism(atoms):
    # identical in and out laws (a 0-DP mechanism) with atoms one apart at 1e8, where one ulp is
    # 1.5e-8: noise of 1e-9 x range added to the scores was lost in rounding, the ties stayed and
    # this was flagged (epsilon_lower 4.4); random ranks keep in and out exchangeable
    rng = np.random.default_rng(0)
    s_in, s_out = 1e8 + rng.choice(atoms, 1000), 1e8 + rng.choice(atoms, 1000)
    r = bounds.analyse({"S": (s_in, s_out)}, lambda e: np.zeros_like(e), rng=0)
    assert not r.violation and r.epsilon_lower < 0.5
    # the table's thresholds are scores (the atoms), not ranks
    assert set(r.table["threshold"]) <= {1e8 + a for a in atoms}


def test_analyse_rejects_bad_input():
    with pytest.raises(ValueError, match="same trials"):
        bounds.analyse({"a": (np.ones(10), np.ones(10)), "b": (np.ones(10), np.ones(9))}, lambda e: 0 * e)
    with pytest.raises(ValueError, match="deltas in"):
        bounds.analyse({"a": (np.ones(10), np.ones(10))}, lambda e: np.ones(3))
    with pytest.raises(ValueError, match="not finite"):
        bounds.analyse({"a": (np.array([np.nan, 1.0]), np.ones(10))}, lambda e: 0 * e)


# -- statistics ------------------------------------------------------------------------------


def test_s_lr_is_the_log_likelihood_ratio():
    rng = np.random.default_rng(5)
    q, a, s = 0.1, np.array([1.0, 0.5, 2.0]), np.array([0.8, 1.0, 1.5])
    y = rng.standard_normal((4, 3)) * 2
    mixture = (1 - q) * stats.norm.pdf(y, 0, s) + q * stats.norm.pdf(y, a, s)
    expected = np.log(mixture / stats.norm.pdf(y, 0, s)).sum(1)
    assert statistics.s_lr(y, a, s, q) == pytest.approx(expected, rel=1e-10)
    per_trial = np.broadcast_to(a, (4, 3))  # D2P2: a signal per trial and step
    assert statistics.s_lr(y, per_trial, s, q) == pytest.approx(expected, rel=1e-10)
    # q = 1 is the Gaussian log-likelihood ratio; no overflow far out
    assert statistics.s_lr(y, a, s, 1.0) == pytest.approx(((2 * a * y - a * a) / (2 * s * s)).sum(1))
    far = statistics.s_lr(np.array([[1e6]]), 1.0, 1.0, q)
    assert far[0] == pytest.approx(math.log(q) + (2e6 - 1) / 2)


def test_s_mf_whitens_the_matrix_release():
    rng = np.random.default_rng(6)
    T, sigma = 6, 0.7
    strategy = np.tril(rng.random((T, T))) + np.eye(T)
    v = np.array([1.0, 0, -1.0, 0, 1.0, 0])
    y = rng.standard_normal((3, T))
    cv = strategy @ v
    assert statistics.s_mf(y, strategy, v) == pytest.approx((y @ strategy.T) @ cv / np.linalg.norm(cv))
    # in-trials: y = v + sigma C^-1 z, so S_MF ~ N(||C v||, sigma^2)
    z = rng.standard_normal((20000, T))
    released = v + sigma * solve_triangular(strategy, z.T, lower=True).T
    score = statistics.s_mf(released, strategy, v)
    assert score.mean() == pytest.approx(np.linalg.norm(cv), abs=4 * sigma / math.sqrt(20000))
    assert score.std() == pytest.approx(sigma, rel=0.02)


def test_s_sum_and_s_diff():
    y = np.array([[0.0, 1.0, 3.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    assert list(statistics.s_sum(y)) == [6.0, 4.0]
    assert list(statistics.s_diff(y)) == [4.0, 0.0]
    prefix = np.tri(4)  # w = C y: prefix sums [0, 1, 4, 6] and [1, 2, 3, 4]
    assert list(statistics.s_diff(y, prefix)) == [6.0, 3.0]


def test_random_ranks():
    x = np.array([5.0, 0.0, 10.0, 0.0, 5.0])
    r1 = statistics.random_ranks(x, np.random.default_rng(7))
    assert np.array_equal(r1, statistics.random_ranks(x, np.random.default_rng(7)))  # seeded
    assert sorted(r1) == [0, 1, 2, 3, 4] and r1[2] == 4  # a permutation, in the scores' order
    assert set(r1[[1, 3]]) == {0, 1} and set(r1[[0, 4]]) == {2, 3}
    # the tied pair's order is random: both orders occur, about equally often
    first = [statistics.random_ranks(np.zeros(2), np.random.default_rng(s))[0] for s in range(400)]
    assert 150 < sum(first) < 250
    # distinct scores closer than any noise of 1e-9 x range keep their order
    close = np.array([1e8, 1e8 + 1.5e-8, 1e8 - 1.5e-8, 2e8])
    assert list(statistics.random_ranks(close, np.random.default_rng(0))) == [1, 2, 0, 3]


# -- profiles -------------------------------------------------------------------------------


@pytest.mark.parametrize("mu", [0.3, 1.0, 3.0])
def test_gaussian_profile_is_the_closed_form(mu):
    eps = np.array([0.0, 0.5, 1.0, 2.0, 5.0])
    expected = [accounting.gaussian_delta(e, mu) for e in eps]
    assert profiles.gaussian_profile(mu)(eps) == pytest.approx(expected, rel=1e-9, abs=1e-300)
    e = accounting.gaussian_epsilon(mu, DELTA)
    assert profiles.gaussian_delta(e, mu) == pytest.approx(DELTA, rel=1e-6)
    tail = profiles.gaussian_delta(bounds.EPSILON_GRID, mu)
    assert np.all(np.isfinite(tail)) and np.all(np.diff(tail) <= 0) and tail[0] == pytest.approx(2 * ndtr(mu / 2) - 1)


def _exact_one_step(eps: float, q: float, sigma: float, direction: str) -> float:
    """delta of one Poisson-subsampled Gaussian step (sensitivity 1), from the monotone
    likelihood ratio: the set where one density exceeds e^eps times the other is a half-line."""
    if direction == "remove":  # H(mixture || base): o > o*
        o = sigma ** 2 * math.log((math.exp(eps) - 1 + q) / q) + 0.5
        sf = lambda m: stats.norm.sf(o, m, sigma)  # noqa: E731
        return (1 - q) * sf(0) + q * sf(1) - math.exp(eps) * sf(0)
    if math.exp(-eps) <= 1 - q:  # H(base || mixture) = 0 beyond -log(1 - q)
        return 0.0
    o = sigma ** 2 * math.log((math.exp(-eps) - 1 + q) / q) + 0.5
    cdf = lambda m: stats.norm.cdf(o, m, sigma)  # noqa: E731
    return cdf(0) - math.exp(eps) * ((1 - q) * cdf(0) + q * cdf(1))


def test_exact_one_step_matches_numerical_integration():
    q, sigma = 0.2, 0.8
    base = lambda o: stats.norm.pdf(o, 0, sigma)  # noqa: E731
    mix = lambda o: (1 - q) * base(o) + q * stats.norm.pdf(o, 1, sigma)  # noqa: E731
    for eps in (0.0, 0.7):
        rem = integrate.quad(lambda o: max(mix(o) - math.exp(eps) * base(o), 0), -12, 12, limit=400, points=[0.5])[0]
        add = integrate.quad(lambda o: max(base(o) - math.exp(eps) * mix(o), 0), -12, 12, limit=400, points=[0.5])[0]
        assert _exact_one_step(eps, q, sigma, "remove") == pytest.approx(rem, rel=1e-6)
        assert _exact_one_step(eps, q, sigma, "add") == pytest.approx(add, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("direction", ["remove", "add"])
def test_prv_profile_one_step_against_the_exact_delta(direction):
    # Gopi et al.'s error bound both ways: exact(eps) <= profile(eps) <= exact(eps - 2 eps_err) + 2 delta_err
    q, sigma = 0.2, 1.0
    prof = profiles.prv_profile([(sigma, q, 1)], direction=direction)
    eps = np.array([0.0, 0.1, 0.3, 0.7, 1.5, 3.0])
    got = prof(eps)
    err = profiles.EPS_ERROR
    for e, d in zip(eps, got):
        assert d >= _exact_one_step(e, q, sigma, direction)
        assert d <= _exact_one_step(e - 2 * err, q, sigma, direction) + 2 * (DELTA / 1000) + 1e-12


def test_prv_profile_composes_like_the_gaussian_at_q_one():
    # q = 1: T steps at noise sigma are one Gaussian release with mu = sqrt(T) / sigma
    steps, sigma = 10, 3.0
    exact = profiles.gaussian_profile(math.sqrt(steps) / sigma)
    eps = np.array([0.0, 0.5, 1.0, 2.0, 4.0])
    got = profiles.prv_profile([(sigma, 1.0, steps)])(eps)
    assert np.all(got >= exact(eps))
    assert np.all(got <= exact(eps - 2 * profiles.EPS_ERROR) + 2 * (DELTA / 1000))


@pytest.fixture(scope="module")
def dpsgd():
    history = [(1.2, 0.05, 200)]
    return history, accounting.epsilon(history, DELTA, "prv")


def test_prv_profile_inverts_the_accountant(dpsgd):
    # the profile at the epsilon the run records gives delta back (the same discrete PRV, the
    # same upper bound); just below it the claim spends more than delta
    history, eps = dpsgd
    remove = profiles.prv_profile(history, direction="remove")
    assert remove([eps])[0] == pytest.approx(DELTA, rel=1e-6)
    assert remove([eps - 0.02])[0] > 1.05 * DELTA
    # the add direction is smaller there, so the worst-case profile is the accountant's
    add = profiles.prv_profile(history, direction="add")
    assert add([eps])[0] < 0.1 * DELTA
    assert profiles.prv_profile(history)([eps])[0] == pytest.approx(DELTA, rel=1e-6)


def test_prv_profile_heterogeneous_history():
    history = [(1.5, 0.05, 50), (1.0, 0.02, 100)]
    eps = accounting.epsilon(history, DELTA, "prv")
    prof = profiles.prv_profile(history)
    assert prof([eps])[0] == pytest.approx(DELTA, rel=1e-6)
    grid = prof(bounds.EPSILON_GRID)
    assert np.all(np.diff(grid) <= 1e-15) and grid[0] < 1 and grid[-1] == pytest.approx((DELTA / 1000))


@pytest.mark.slow
def test_prv_profile_at_the_calibrated_sigma():
    sigma = accounting.noise_multiplier_for(2.0, 0.1, 20, DELTA)
    delta = profiles.prv_profile([(sigma, 0.1, 20)])([2.0])[0]
    # calibration finds the smallest sigma (to 0.1%) meeting eps = 2, so delta*(2) is just below 1e-5
    assert 0.9 * DELTA < delta <= DELTA


def test_rdp_profile_inverts_the_rdp_accountants():
    history = [(1.2, 0.05, 200)]
    fast = accounting.fast_rdp_epsilon(history, DELTA)
    assert profiles.rdp_profile(history)([fast])[0] == pytest.approx(DELTA, rel=1e-9)
    opacus = accounting.epsilon(history, DELTA, "rdp")
    assert profiles.rdp_profile(history, orders=accounting.RDP_ORDERS)([opacus])[0] == pytest.approx(DELTA, rel=1e-6)
    # RDP is looser than PRV: at the RDP epsilon the PRV profile is below delta
    assert profiles.prv_profile(history)([fast])[0] < DELTA


def test_rdp_profile_with_delta_fail():
    # D2P2: a decaying schedule accounted by fast RDP at delta - delta_fail; the claim at the
    # recorded epsilon is delta_RDP + delta_fail = delta
    history = [(2.0 / math.sqrt(k), 0.1, 1) for k in range(1, 51)]
    fail = DELTA / 10
    eps = accounting.fast_rdp_epsilon(history, DELTA - fail)
    with_fail = profiles.rdp_profile(history, delta_fail=fail)
    assert with_fail([eps])[0] == pytest.approx(DELTA, rel=1e-9)
    grid = np.array([0.5, 1.0, 2.0])
    assert with_fail(grid) == pytest.approx(np.minimum(profiles.rdp_profile(history)(grid) + fail, 1.0))


# -- simulated audits: false alarms and power -------------------------------------------------


def _matrix_audit(rng, trials: int, noise: float, claimed_sigma: float, strategy, v, beta=0.05):
    """One audit of a matrix mechanism's canary coordinate, y = v 1[in] + noise C^-1 z, against
    the Gaussian claim mu = ||C v|| / claimed_sigma."""
    n = trials // 2
    inside = np.arange(trials) < n
    w = noise * rng.standard_normal((trials, len(v))) + inside[:, None] * (strategy @ v)
    y = solve_triangular(strategy, w.T, lower=True).T
    scores = {"S_MF": statistics.s_mf(y, strategy, v), "S_diff": statistics.s_diff(y, strategy)}
    claim = profiles.gaussian_profile(np.linalg.norm(strategy @ v) / claimed_sigma)
    return bounds.analyse({k: (s[:n], s[n:]) for k, s in scores.items()}, claim, beta=beta, rng=rng)


def _dpsgd_audit(rng, trials: int, noise: float, profile, q: float, steps: int, claimed_sigma: float,
                 reuse_noise: bool = False):
    n = trials // 2
    inside = np.arange(trials) < n
    z = rng.standard_normal((trials, 1 if reuse_noise else steps))
    y = noise * np.broadcast_to(z, (trials, steps)) + inside[:, None] * (rng.random((trials, steps)) < q)
    scores = {"S_LR": statistics.s_lr(y, 1.0, claimed_sigma, q), "S_diff": statistics.s_diff(y)}
    return bounds.analyse({k: (s[:n], s[n:]) for k, s in scores.items()}, profile, rng=rng)


@pytest.fixture(scope="module")
def matrix_setup():
    strategy = np.tril(np.full((8, 8), 0.3)) + np.eye(8)
    v = np.zeros(8)
    v[0] = 1.0  # the column of largest norm: the canary in the worst slot, ||C v|| = sens(C)
    sigma = accounting.gaussian_noise_multiplier(2.0, DELTA, sensitivity=np.linalg.norm(strategy @ v))
    return strategy, v, sigma


def test_false_alarm_rate_gaussian(matrix_setup):
    strategy, v, sigma = matrix_setup
    rng = np.random.default_rng(10)
    flagged = sum(_matrix_audit(rng, 200, sigma, sigma, strategy, v).violation for _ in range(300))
    # 99% confident that the false-alarm rate is at most beta
    assert bounds.clopper_pearson_upper(flagged, 300, 0.01) <= 0.05


def test_false_alarm_rate_subsampled_gaussian():
    q, steps, sigma = 0.2, 10, 1.74  # eps ~ 2 at delta = 1e-5
    profile = profiles.prv_profile([(sigma, q, steps)])
    rng = np.random.default_rng(11)
    flagged = sum(_dpsgd_audit(rng, 200, sigma, profile, q, steps, sigma).violation for _ in range(250))
    assert bounds.clopper_pearson_upper(flagged, 250, 0.01) <= 0.05


def test_power_noise_deficit(matrix_setup):
    # the noise std 1.7x below the claim, eps* = 2, R = 2000: flagged (almost) always
    strategy, v, sigma = matrix_setup
    rng = np.random.default_rng(12)
    flagged = sum(_matrix_audit(rng, 2000, sigma / 1.7, sigma, strategy, v).violation for _ in range(20))
    assert flagged >= 18


def test_power_subsampled_noise_deficit_and_reused_noise():
    q, steps, sigma = 0.2, 10, 1.74
    profile = profiles.prv_profile([(sigma, q, steps)])
    rng = np.random.default_rng(13)
    flagged = sum(_dpsgd_audit(rng, 2000, sigma / 1.7, profile, q, steps, sigma).violation for _ in range(10))
    assert flagged >= 9
    # the same noise draw every step: out-trial releases are constant, S_diff sees it at once
    reused = _dpsgd_audit(rng, 200, sigma, profile, q, steps, sigma, reuse_noise=True)
    assert reused.violation and reused.violation_at[0] == "S_diff"


# -- the claim of a run, from its mechanism ------------------------------------------------------


def test_prv_profile_with_delta_fail():
    # DP2-SGD: the PRV accountant run at delta - delta_fail; the claim at the recorded epsilon is delta
    history, fail = [(1.2, 0.05, 200)], DELTA / 10
    eps = accounting.epsilon(history, DELTA - fail, "prv")
    prof = profiles.prv_profile(history, delta_fail=fail, accountant_delta=DELTA - fail)
    assert prof([eps])[0] == pytest.approx(DELTA, rel=1e-6)


def _mechanism(kind: str):
    from dpbench.mechanisms.dense_matrix import MatrixMechanism
    from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian, inverse_sqrt_schedule
    from dpbench.mechanisms.projected_gaussian import RandomProjectionGaussian

    return {"dpsgd": PoissonSubsampledGaussian(),
            "d2p2": RandomProjectionGaussian(inverse_sqrt_schedule, "inverse-sqrt", 0.05,
                                             accountant=accounting.RDP_INTEGER),
            "matrix": MatrixMechanism(single_epoch=True, convergence_aware=False)}[kind]


@pytest.mark.parametrize("kind, accountant, sigma", [("dpsgd", "prv", 1.2), ("dpsgd", "rdp", 1.2),
                                                     ("d2p2", "prv", 3.0), ("matrix", "prv", 2.0)])
def test_mechanism_privacy_profile_matches_the_mechanisms_report(tmp_path, kind, accountant, sigma):
    # the profile at the epsilon the run records is the run's delta, for each accountant
    from dpbench.mechanisms.base import PlanRequest, PrivacyClaim

    mechanism = _mechanism(kind)
    hyper = {"projection": "gaussian"} if kind == "d2p2" else {}  # the projection whose bound has delta_fail
    plan = mechanism.plan(PlanRequest(200, 10, 1, hyperparameters=hyper, delta=DELTA, cache_dir=tmp_path))
    claim = PrivacyClaim(mechanism, plan, sigma, DELTA, accountant)
    recorded = claim.epsilon(plan.steps)
    prof = claim.profile()
    assert prof([recorded])[0] == pytest.approx(DELTA, rel=1e-6)
