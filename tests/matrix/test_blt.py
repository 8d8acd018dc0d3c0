"""Buffered linear Toeplitz strategies (dpbench.matrix.blt): the (theta, theta_hat)
parametrisation against dense inverses, the closed-form errors and sensitivities against
dense oracles and brute force, and the derivative-free optimiser."""

import itertools

import numpy as np
import pytest

from dpbench.matrix import banded, blt, sensitivity


def random_blt(m, n, seed=0):
    x = blt.random_start(m, np.random.default_rng(seed))
    return blt.BLT.from_pair(x[0::2], x[1::2], n)


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_pair_parametrisation_inverts_and_is_interlaced(m):
    f = random_blt(m, 30, seed=m)
    assert f.in_class()
    assert (f.omega > 0).all() and (f.omega_hat < 0).all()
    assert f.omega.sum() < 1 and (f.omega / f.theta).sum() < 1
    from scipy.linalg import toeplitz

    c = f.matrix()
    c_inv = toeplitz(f.noising_coefficients(), np.zeros(30))
    np.testing.assert_allclose(c @ c_inv, np.eye(30), atol=1e-12)
    coef = f.coefficients()
    assert coef[0] == 1.0 and (np.diff(coef) <= 0).all() and (coef > 0).all()  # non-increasing, positive


def test_coefficients_definition():
    f = blt.BLT.from_pair([0.9, 0.4], [0.7, 0.2], 6)
    omega = f.omega
    # omega_1 = (0.9 - 0.7)(0.9 - 0.2) / (0.9 - 0.4), omega_2 = (0.4 - 0.7)(0.4 - 0.2) / (0.4 - 0.9)
    np.testing.assert_allclose(omega, [0.2 * 0.7 / 0.5, -0.3 * 0.2 / -0.5])
    expected = [1.0] + [omega[0] * 0.9 ** (k - 1) + omega[1] * 0.4 ** (k - 1) for k in range(1, 6)]
    np.testing.assert_allclose(f.coefficients(), expected)


def test_out_of_class_pairs_are_rejected():
    assert not blt.in_class(np.array([0.5, 0.9]), np.array([0.4, 0.1]))  # not interlaced
    assert not blt.in_class(np.array([1.0]), np.array([0.5]))
    assert blt.loss(np.array([0.5]), np.array([0.6]), 10, 10, 1) == np.inf
    with pytest.raises(ValueError, match="interlaced"):
        blt.BLT.from_pair([0.5], [0.6], 10).sensitivity()


@pytest.mark.parametrize("m", [1, 3])
def test_error_and_single_sensitivity_equal_dense(m):
    n = 40
    f = random_blt(m, n, seed=10 + m)
    c = f.matrix()
    b = np.tri(n) @ np.linalg.inv(c)
    np.testing.assert_allclose(f.per_step_error(), (b * b).sum(axis=1), rtol=1e-10)
    assert f.error_mean() == pytest.approx((b * b).sum() / n, rel=1e-10)
    assert f.sensitivity() == pytest.approx(sensitivity.single_epoch_sensitivity(c), rel=1e-12)
    assert f.sensitivity(steps=17) == pytest.approx(sensitivity.single_epoch_sensitivity(c[:17, :17]), rel=1e-12)
    assert blt.loss(f.theta, f.theta_hat, n, n, 1) == pytest.approx(f.sensitivity() ** 2 * f.error_mean(), rel=1e-12)


def brute_force_sensitivity(c, min_sep, k):
    worst = 0.0
    n = c.shape[0]
    for size in range(1, k + 1):
        for pi in itertools.combinations(range(n), size):
            if any(b - a < min_sep for a, b in zip(pi, pi[1:])):
                continue
            for signs in itertools.product((1.0, -1.0), repeat=size - 1):
                worst = max(worst, float(np.linalg.norm(c[:, pi] @ np.array((1.0, *signs)))))
    return worst


@pytest.mark.parametrize("min_sep,k", [(1, 3), (2, 3), (3, 4), (4, 3), (5, 2), (6, 2), (3, 2)])
def test_min_separation_sensitivity_equals_brute_force(min_sep, k):
    n = 12
    f = random_blt(2, n, seed=min_sep)
    got = f.sensitivity(min_sep, k)
    assert got == pytest.approx(brute_force_sensitivity(f.matrix(), min_sep, k), rel=1e-12)
    if n % min_sep == 0 and k == n // min_sep:  # fixed epoch order: the dense (k, b) oracle
        assert got == pytest.approx(sensitivity.sensitivity(f.matrix(), k, min_sep), rel=1e-12)
    assert blt.loss(f.theta, f.theta_hat, n, min_sep, banded.max_participations(n, min_sep, k)) == pytest.approx(
        got ** 2 * f.error_mean(), rel=1e-12)


@pytest.mark.parametrize("k,b_prime", [(2, 12), (3, 8), (6, 4), (24, 1)])
def test_min_separation_sensitivity_equals_dense_fixed_epoch_oracle(k, b_prime):
    f = random_blt(3, k * b_prime, seed=k)
    assert f.sensitivity(b_prime, k) == pytest.approx(sensitivity.sensitivity(f.matrix(), k, b_prime), rel=1e-12)


@pytest.mark.slow
def test_optimised_single_participation_blt_is_near_the_best_toeplitz():
    """A BLT is a Toeplitz strategy: it cannot beat the optimal (unnormalised) Toeplitz
    strategy, and with a few buffers it comes within 1%."""
    n = 120
    f = blt.optimize(n)
    toeplitz_best = banded.optimize(n, n, column_normalize=False).error_mean()
    loss = f.sensitivity() ** 2 * f.error_mean()
    assert loss == pytest.approx(f.report["loss"], rel=1e-9)
    assert toeplitz_best * (1 - 1e-9) <= loss <= 1.01 * toeplitz_best
    assert f.in_class() and 2 <= f.buffers <= blt.MAX_BUFFERS
    tried = [r["loss"] for r in f.report["tried"]]
    assert all(b < 0.99 * a for a, b in zip(tried[:f.buffers], tried[1:f.buffers]))  # grew while it helped


@pytest.mark.slow
def test_optimised_multi_participation_blt_and_determinism():
    n, b_prime, k = 60, 12, 5
    f = blt.optimize(n, b_prime, k, buffers=2)
    g = blt.optimize(n, b_prime, k, buffers=2)
    np.testing.assert_array_equal(f.theta, g.theta)
    assert f.sensitivity(b_prime, k) ** 2 * f.error_mean() == pytest.approx(f.report["loss"], rel=1e-9)
    # better than DP-SGD on the same participation (C = I: sens^2 = k, err_mean = (n + 1) / 2)
    assert f.report["loss"] < k * (n + 1) / 2


def test_degenerate_optima_are_recognised():
    assert blt.degenerate(np.array([1 - 1e-9, 0.5]), np.array([0.9, 0.1]))
    assert not blt.degenerate(np.array([0.9, 0.5]), np.array([0.7, 0.1]))
