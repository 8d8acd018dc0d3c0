"""T Gaussian releases composed without amplification (``dpdice-strict``'s mechanism).

Batches are Poisson-sampled as DP-SGD draws them and the noise is i.i.d. Gaussian, but the
claim does not use the sampling: when every step after an example's first participation
depends on it (DP-Dice's error feedback, dpbench.optimizers.dice_strict has the proof), the
T steps are T adaptive Gaussian mechanisms of sensitivity Delta with noise std sigma Delta,
which compose to exactly one Gaussian mechanism of sensitivity sqrt(T) at noise multiplier
sigma: mu-GDP with mu = sqrt(T) / sigma (Dong, Roth & Su 2022, Cor. 3.3). sigma is the
smallest noise multiplier making that release (epsilon, delta)-DP
(``accounting.gaussian_noise_multiplier``, Balle & Wang 2018); a run stopped after t steps
reports the epsilon of sqrt(t) / sigma, and the RDP epsilon of T Gaussian mechanisms (q = 1)
as a cross-check.
"""

from __future__ import annotations

import math

from dpbench.mechanisms.base import Plan, PrivacyClaim, Spent, Target
from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian
from dpbench.privacy import accounting, profiles


class UnamplifiedGaussian(PoissonSubsampledGaussian):
    """Poisson batches as DP-SGD draws them, i.i.d. Gaussian noise, and the T steps accounted
    as T adaptive Gaussian mechanisms without amplification: exactly one Gaussian mechanism of
    sensitivity sqrt(T) (module docstring). ``--accountant`` does not apply."""

    name = "gaussian-composition-without-amplification"

    def history(self, plan: Plan, noise_multiplier: float, steps: int) -> accounting.History:
        """The accounted event: ``steps`` Gaussian mechanisms at sigma without amplification (q = 1),
        which compose exactly to the one release of mu = sqrt(steps) / sigma that ``calibrate``
        and ``report`` use (the inherited, amplified history would not be this mechanism's claim)."""
        return [(noise_multiplier, 1.0, steps)]

    def calibrate(self, plan: Plan, target: Target) -> float:
        return accounting.gaussian_noise_multiplier(target.epsilon, target.delta, sensitivity=math.sqrt(plan.steps))

    def privacy_profile(self, claim: PrivacyClaim):
        """The claim at every epsilon: one Gaussian release with mu = sqrt(T) / sigma."""
        return profiles.gaussian_profile(math.sqrt(claim.plan.steps) / claim.noise_multiplier)

    def report(self, claim: PrivacyClaim, steps: int) -> Spent:
        plan, sigma, delta = claim.plan, claim.noise_multiplier, claim.delta

        def eps(t: int) -> float:
            if t == 0:
                return 0.0
            if sigma <= 0:
                return math.inf
            return accounting.ANALYTIC_GAUSSIAN.release_epsilon(math.sqrt(t) / sigma, delta)

        return Spent(eps(steps), eps(plan.steps), accounting.RDP.epsilon([(sigma, 1.0, steps)], delta), {
            "sampling": (f"Poisson at q = {plan.sample_rate:.6g}, not used for amplification: every step "
                         "after an example's first participation depends on it"),
        }, accounting.ANALYTIC_GAUSSIAN,
            "analytic-gaussian composition of T steps, no amplification (Balle & Wang 2018)")
