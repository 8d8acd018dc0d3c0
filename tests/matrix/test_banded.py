"""Banded Toeplitz BandMF (dpbench.matrix.banded): the closed-form errors of the square-root
coefficients, the optimised losses of McKenna (2024) reached or beaten, the analytic gradient,
and the VecSens sensitivity against brute force and the dense oracles of matrix/sensitivity.py."""

import itertools

import numpy as np
import pytest

from dpbench.matrix import banded, sensitivity

N = 1875

# n = 1875, k = 1, square-root coefficients truncated to b and normalised, no column
# normalisation: (err_mean, err_max)
SQRT_ORACLES = {1: (938.0, 1875.0), 4: (292.858228, 584.284321), 16: (93.345889, 184.162458),
                64: (31.678631, 59.257631), 1875: (10.905906, 12.007144)}
# optimised banded Toeplitz, mean loss at n = 1875 (plain, column-normalised), to 4 decimals
OPTIMISED_ORACLES = {4: (241.2736, 241.2698), 16: (68.7076, 68.6884), 64: (25.0599, 25.0004),
                     256: (13.4318, 13.2842), 1875: (10.5556, 10.1985)}


def dense_errors(coef, n, column_normalize):
    c = banded.strategy_matrix(coef, n, column_normalize)
    b = np.tri(n) @ np.linalg.inv(c)
    return (b * b).sum(axis=1)


@pytest.mark.parametrize("bands", sorted(SQRT_ORACLES))
def test_square_root_coefficients_errors(bands):
    coef = banded.sqrt_coefficients(bands)
    coef = coef / np.linalg.norm(coef)
    mean, worst = SQRT_ORACLES[bands]
    assert banded.error_mean(coef, N) == pytest.approx(mean, abs=1e-6)
    assert banded.error_max(coef, N) == pytest.approx(worst, abs=1e-6)


def test_sqrt_coefficients_square_to_the_prefix_sum():
    c = banded.strategy_matrix(banded.sqrt_coefficients(30), 30)
    np.testing.assert_allclose(c @ c, np.tri(30), atol=1e-12)


@pytest.mark.parametrize("bands,column_normalize", [(1, True), (3, False), (3, True), (7, True), (40, True),
                                                    (40, False)])
def test_per_step_error_equals_dense(bands, column_normalize):
    n = 40
    coef = np.sort(np.random.default_rng(bands).uniform(0.05, 1.0, bands))[::-1]  # positive, decreasing
    np.testing.assert_allclose(banded.per_step_error(coef, n, column_normalize),
                               dense_errors(coef, n, column_normalize), rtol=1e-10)


def test_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    coef = np.sort(rng.uniform(0.1, 1.0, 6))[::-1]
    f, g = banded.objective_and_gradient(coef, 200)
    h = 1e-6
    num = [(banded.objective_and_gradient(coef + h * e, 200)[0] - banded.objective_and_gradient(coef - h * e, 200)[0])
           / (2 * h) for e in np.eye(6)]
    np.testing.assert_allclose(g, num, rtol=1e-6)
    assert f == pytest.approx((coef @ coef) * banded.error_mean(coef, 200))


@pytest.mark.parametrize("bands", [4, 16, 64, pytest.param(256, marks=pytest.mark.slow),
                                   pytest.param(1875, marks=pytest.mark.slow)])
def test_optimised_losses_reach_the_oracles(bands):
    fact = banded.optimize(N, bands, column_normalize=False)
    plain, normalised = OPTIMISED_ORACLES[bands]
    assert np.linalg.norm(fact.coef) == pytest.approx(1.0)
    # loss = sens^2 err_mean with sens = max column norm = ||c|| = 1
    assert fact.error_mean() <= plain + 5e-5
    assert banded.BandedToeplitz(fact.coef, N, True).error_mean() <= normalised + 5e-5
    if bands == 64:
        np.testing.assert_allclose(fact.coef[:4], [0.465543, 0.256448, 0.206089, 0.181558], atol=2e-6)
    assert fact.report["active_bounds"] == 0


def test_column_normalised_strategy_has_unit_columns_and_noise_scale():
    fact = banded.optimize(50, 8, column_normalize=True)
    c = fact.matrix()
    np.testing.assert_allclose(np.linalg.norm(c, axis=0), 1.0, rtol=1e-12)
    np.testing.assert_allclose(np.linalg.inv(c), fact.scale()[:, None] * np.linalg.inv(
        banded.strategy_matrix(fact.coef, 50)), atol=1e-12)
    assert fact.scale()[:50 - 7].tolist() == pytest.approx([1.0] * 43)


# -- sensitivity ---------------------------------------------------------------------------


def min_sep_patterns(n, min_sep, k):
    """Every index set of size 1..k with any two members >= min_sep apart."""
    for size in range(1, k + 1):
        for pi in itertools.combinations(range(n), size):
            if all(b - a >= min_sep for a, b in zip(pi, pi[1:])):
                yield pi


def brute_force_sensitivity(c, min_sep, k):
    """max over every pattern and every sign vector of ||C sum_i s_i e_i||."""
    worst = 0.0
    for pi in min_sep_patterns(c.shape[0], min_sep, k):
        cols = c[:, pi]
        for signs in itertools.product((1.0, -1.0), repeat=len(pi) - 1):
            worst = max(worst, float(np.linalg.norm(cols @ np.array((1.0, *signs)))))
    return worst


@pytest.mark.parametrize("bands,min_sep,k", [(1, 1, 4), (2, 4, 3), (2, 2, 3), (3, 3, 4), (3, 4, 3), (3, 5, 2), (4, 6, 2),
                                             (2, 3, 1), (12, 12, 1)])
@pytest.mark.parametrize("column_normalize", [False, True])
def test_vecsens_equals_brute_force_over_every_pattern(bands, min_sep, k, column_normalize):
    n = 12
    coef = banded.sqrt_coefficients(bands) * np.linspace(1.0, 0.6, bands)
    fact = banded.BandedToeplitz(coef / np.linalg.norm(coef), n, column_normalize)
    got = banded.sensitivity(fact, min_sep, k)
    assert got == pytest.approx(brute_force_sensitivity(fact.matrix(), min_sep, k), rel=1e-12)
    if column_normalize:
        assert got == pytest.approx(np.sqrt(banded.max_participations(n, min_sep, k)), rel=1e-12)
    if n % min_sep == 0 and k == n // min_sep:
        # fixed epoch order (k epochs of b' = n / k batches): the dense sign-robust oracle agrees
        assert got == pytest.approx(sensitivity.sensitivity(fact.matrix(), k, min_sep), rel=1e-12)
    # a run stopped after t steps: the sensitivity of C[:t, :t]
    t = 7
    assert banded.sensitivity(fact, min_sep, k, steps=t) == pytest.approx(
        brute_force_sensitivity(fact.matrix()[:t, :t], min_sep, k), rel=1e-12)


def test_fixed_epoch_patterns_of_the_loader_are_covered():
    """FixedBatchSampler's patterns {j, j + b', ...}: the dense (k, b) oracle on C equals
    VecSens for every band count b <= b'."""
    k, b_prime = 3, 5
    n = k * b_prime
    for bands in range(1, b_prime + 1):
        fact = banded.optimize(n, bands, column_normalize=False)
        dense = sensitivity.sensitivity(fact.matrix(), k, b_prime)
        assert banded.sensitivity(fact, b_prime, k) == pytest.approx(dense, rel=1e-12)


def test_refuses_min_separation_below_the_bands():
    fact = banded.optimize(20, 5)
    with pytest.raises(ValueError, match="b' = 4 .* b = 5"):
        banded.sensitivity(fact, 4, 2)


def test_vecsens_dynamic_programme_small_cases():
    v = np.array([5.0, 1.0, 4.0, 4.0, 1.0])
    assert banded.vecsens(v, 2, 2) == 9.0  # {0, 2} or {0, 3}
    assert banded.vecsens(v, 2, None) == 10.0  # {0, 2, 4}
    assert banded.vecsens(v, 1, 1) == 5.0
    assert banded.max_participations(10, 3, None) == 4 and banded.max_participations(10, 3, 2) == 2
