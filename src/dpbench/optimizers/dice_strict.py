"""dpdice-strict: DP-Dice (dice.py) with its noise calibrated to a sensitivity that holds.

The algorithm is DP-Dice's, step for step: per step, on the sum scale, with s the clipping
sensitivity (1 under normalised clipping), C the clipping norm, L the expected batch size and
c = C2 s / C the residual's clipping radius in clipped units,

    y_t     = sum_{i in B_t} clip(g_i(theta_t)) + L clip(e_t, c) + N(0, (sigma Delta)^2 I)
    theta_{t+1} = theta_t - lr y_t / L
    e_{t+1} = e_t - clip(e_t, c) + (1/L) sum_{i in B_t} (g_i(theta_t) - clip(g_i(theta_t)))

(e_1 = 0; the g_i are raw, unclipped). Only the noise differs: Delta = s (1 + 2 L C2 / C).

Claim. With Poisson batches B_t (rate q) and T steps, the sequence (y_1, ..., y_T), hence
every theta_t, is mu-GDP with mu = sqrt(T) / sigma under add/remove adjacency, i.e.
(epsilon, delta)-DP with delta = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2)
(the Gaussian mechanism's exact curve, Balle & Wang 2018; Dong, Roth & Su 2022, Cor. 2.13).

Proof. Let D' = D plus one example x. Draw the sampling coins for every example, x's
included, before training; call them S. S has the same distribution under D and D' (under D,
x's coins are drawn and unused). Fix S. Then theta_t is a function of y_1..y_{t-1} (and the
public initialisation), and e_t is a deterministic function of the data, S and y_1..y_{t-1},
so y_t = f_t(data; S, y_<t) + N(0, (sigma Delta)^2 I) with f_t deterministic. For every
history y_<t:

    ||f_t(D') - f_t(D)|| <= ||clip(g_x)|| + L ||clip(e_t(D'), c) - clip(e_t(D), c)||
                         <= s + L * 2c = s (1 + 2 L C2 / C) = Delta,

because the clipped sums differ at most by x's own clipped gradient (norm <= s) and both
clipped residuals lie in the ball of radius c, whatever e_t(D) and e_t(D') are. No bound on
raw gradients is needed: the residual enters the release only through clip(e, c). So, given
S, the run is an adaptive composition of T Gaussian mechanisms each of sensitivity <= Delta
and noise std sigma Delta, which is sqrt(T)/sigma-GDP (Dong, Roth & Su 2022, Cor. 3.3). The
run with S hidden is the mixture over S of these mechanisms, with the same mixing weights
under D and D'; the hockey-stick divergence is jointly convex, so the mixture's delta(epsilon)
is at most the average of the per-S ones, each at most the Gaussian curve above. QED.

Why no amplification: x changes e_t at every step after it is first sampled, whether or not
it is sampled at step t, so the release at an unsampled step still depends on x (by up to
2 L c); the subsampled-Gaussian analysis of DP-SGD, where unsampled steps are independent of
x, does not apply. The bound above is the worst case over when x is first sampled (step 1).
The residual term is tight: an example with a huge gradient can swing clip(e, c) across the
ball (tests/privacy/test_integrity.py measures the movement of the release against Delta). With
C2 = 0 this is DP-SGD accounted without amplification (valid, but looser than dpsgd's).

References: Zhang, Bu, Wu & Hong 2024, "Differentially private SGD without clipping bias: an
error-feedback approach" (ICLR 2024, arXiv:2311.14632); Balle & Wang 2018, "Improving the
Gaussian mechanism for differential privacy" (ICML 2018, arXiv:1805.06530); Dong, Roth & Su
2022, "Gaussian differential privacy" (JRSS-B, arXiv:1905.02383).

Accounting is exact (``dpbench.mechanisms.unamplified.UnamplifiedGaussian``): sigma is the smallest noise multiplier for
which one Gaussian release of sensitivity sqrt(T) is (epsilon, delta)-DP
(``accounting.gaussian_noise_multiplier``); a run stopped after t steps reports the epsilon of
sqrt(t)/sigma, and the RDP epsilon of T Gaussian mechanisms (q = 1) as a cross-check.
"""

from __future__ import annotations

from dpbench.optimizers.base import SGD, Context
from dpbench.optimizers.dice import DiceStep


def release_sensitivity(sensitivity: float, batch_size: int, c2: float, clip_norm: float) -> float:
    """Delta = s (1 + 2 L C2 / C): the L2 sensitivity of one released sum of DP-Dice."""
    return sensitivity * (1.0 + 2.0 * batch_size * c2 / clip_norm)


class StrictDiceStep(DiceStep):
    """DP-Dice with noise std sigma Delta on the sum, Delta = ``release_sensitivity``."""

    @property
    def noise_std(self) -> float:
        c = self.ctx.clipping
        return self.ctx.noise_multiplier * release_sensitivity(c.sensitivity, self.ctx.expected_batch_size,
                                                               self.c2, c.clip_norm)


def dpdice_strict(ctx: Context) -> StrictDiceStep:
    return StrictDiceStep(ctx, SGD(ctx.lr), float(ctx.hyperparameters["c2"]))
