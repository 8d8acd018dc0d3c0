"""Expected power of the empirical privacy audit, by simulating the canary coordinate of a
correct mechanism (no training harness: this measures the statistics, not the optimizers).

- DP-SGD: Poisson rate q = 0.05, T = 200 steps, sigma calibrated by the PRV accountant
  (``accounting.noise_multiplier_for``) for eps* at delta = 1e-5; per trial the canary
  coordinate is y_t = B_t + sigma xi_t (sum units, sensitivity 1, B_t ~ Bernoulli(q) in
  in-trials, 0 in out-trials); statistics H = (S_LR, S_diff); the claim is the PRV profile.
- Matrix: the me-k4-b50 factorization (T = 200, 4 participations), sigma calibrated exactly
  for sens(C), the canary in the sign-worst pattern v; y = v 1[in] + sigma C^-1 z;
  statistics H = (S_MF, S_diff with w = C y); the claim is the Gaussian profile mu = sens/sigma.

Each cell runs ``--reps`` audits of R trials (R/2 in, R/2 out) at beta = 0.05 and reports the
medians of eps_lb (A) and eps_GDP (C), and how many audits flagged a violation (B) (0 expected).
``--deficit`` adds the detection rate of a matrix mechanism whose noise is 1.5x and 1.7x too
small (eps* = 2, R = 2000).

Usage:  python benchmarks/audit_power.py [--reps 50] [--seed 0] [--deficit]
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
from scipy.linalg import solve_triangular

from dpbench.privacy import accounting, profiles
from dpbench.audit import bounds, statistics
from dpbench.matrix import dense_factorization, sensitivity

Q, T, DELTA, BETA = 0.05, 200, accounting.DELTA, 0.05
MATRIX_KEY = "me-k4-b50"


def dpsgd_scores(rng, trials: int, sigma: float) -> dict:
    n = trials // 2
    inside = np.arange(trials) < n
    y = sigma * rng.standard_normal((trials, T)) + inside[:, None] * (rng.random((trials, T)) < Q)
    scores = {"S_LR": statistics.s_lr(y, 1.0, sigma, Q), "S_diff": statistics.s_diff(y)}
    return {k: (v[:n], v[n:]) for k, v in scores.items()}


def sign_worst_pattern(strategy: np.ndarray, epochs: int, batches: int) -> np.ndarray:
    """The signed participation v maximising ||C v|| over the (k, b) patterns and sign choices."""
    best, best_norm = None, -1.0
    for j in range(batches):
        steps = np.arange(j, epochs * batches, batches)
        for signs in itertools.product([1.0, -1.0], repeat=epochs - 1):
            v = np.zeros(epochs * batches)
            v[steps] = (1.0,) + signs
            norm = np.linalg.norm(strategy @ v)
            if norm > best_norm:
                best, best_norm = v, norm
    return best


def matrix_scores(rng, trials: int, sigma: float, strategy: np.ndarray, v: np.ndarray) -> dict:
    n = trials // 2
    inside = np.arange(trials) < n
    w = sigma * rng.standard_normal((trials, T)) + inside[:, None] * (strategy @ v)  # C y
    y = solve_triangular(strategy, w.T, lower=True).T
    scores = {"S_MF": statistics.s_mf(y, strategy, v), "S_diff": statistics.s_diff(y, strategy)}
    return {k: (s[:n], s[n:]) for k, s in scores.items()}


def run_cell(rng, reps: int, make_scores, profile) -> tuple[float, float, int, float]:
    eps_lb, eps_gdp, flagged = [], [], 0
    t = time.perf_counter()
    for _ in range(reps):
        result = bounds.analyse(make_scores(), profile, beta=BETA, delta=DELTA, rng=rng)
        eps_lb.append(result.epsilon_lower)
        eps_gdp.append(result.epsilon_gdp)
        flagged += result.violation
    return float(np.median(eps_lb)), float(np.median(eps_gdp)), flagged, (time.perf_counter() - t) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deficit", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)

    fact = dense_factorization.factorize(MATRIX_KEY)
    k, b = fact.epochs, fact.batches
    v = sign_worst_pattern(fact.strategy, k, b)
    sens = sensitivity.sensitivity(fact.strategy, k, b)
    print(f"matrix {MATRIX_KEY}: sens(C) = {sens:.4f}, sign-worst ||C v|| = {np.linalg.norm(fact.strategy @ v):.4f}")

    print(f"\nR/2 in- and R/2 out-trials, beta = {BETA}, delta = {DELTA}, {args.reps} audits per cell, "
          f"seed {args.seed}; medians eps_lb / eps_GDP (violations flagged / audits)\n")
    print("| eps* | sigma (DP-SGD, PRV) | R = 2000 | R = 10^4 | sigma (matrix) | matrix, R = 10^4 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for eps in (2.0, 8.0):
        sigma = accounting.noise_multiplier_for(eps, Q, T, DELTA)
        profile = profiles.prv_profile([(sigma, Q, T)])
        cells = []
        for trials in (2000, 10_000):
            lb, gdp, flagged, sec = run_cell(rng, args.reps, lambda: dpsgd_scores(rng, trials, sigma), profile)
            cells.append(f"{lb:.2f} / {gdp:.2f} ({flagged}/{args.reps}; {sec:.2f} s/audit)")
        m_sigma = accounting.gaussian_noise_multiplier(eps, DELTA, sens)
        lb, gdp, flagged, sec = run_cell(rng, args.reps, lambda: matrix_scores(rng, 10_000, m_sigma, fact.strategy, v),
                                         profiles.gaussian_profile(sens / m_sigma))
        cells.append(f"{lb:.2f} / {gdp:.2f} ({flagged}/{args.reps}; {sec:.2f} s/audit)")
        print(f"| {eps:g} | {sigma:.4f} | {cells[0]} | {cells[1]} | {m_sigma:.4f} | {cells[2]} |")

    print("\n| trials R | max certifiable eps, |H| = 1 | |H| = 2 |")
    print("| --- | --- | --- |")
    for trials in (1000, 2000, 5000, 10_000, 20_000):
        print(f"| {trials} | {bounds.max_certifiable_epsilon(trials, BETA, DELTA, 1):.2f} | "
              f"{bounds.max_certifiable_epsilon(trials, BETA, DELTA, 2):.2f} |")

    if args.deficit:
        m_sigma = accounting.gaussian_noise_multiplier(2.0, DELTA, sens)
        claim = profiles.gaussian_profile(sens / m_sigma)
        print("\nmatrix, eps* = 2, R = 2000: noise std divided by a factor, violation rate")
        for factor in (1.0, 1.5, 1.7):
            _, _, flagged, _ = run_cell(rng, args.reps, lambda: matrix_scores(rng, 2000, m_sigma / factor,
                                                                              fact.strategy, v), claim)
            print(f"  noise / {factor:g}: {flagged}/{args.reps} flagged")


if __name__ == "__main__":
    main()
