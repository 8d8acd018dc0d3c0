"""DP-DiSK: DP optimizer with a simplified Kalman filter (Zhang, Bu, Balle, Hong, Razaviyayn,
Mirrokni, "DiSK", ICLR 2025, arXiv:2410.03883, Alg. 3; thesis Alg. 4).

Per step, with a = (1 - kappa) / (kappa gamma) and d the previous update direction::

    g_i     = a grad f(theta + gamma d; x_i) + (1 - a) grad f(theta; x_i)   per sample, clipped once
    g       = (1/L) (sum_i clip(g_i) + N(0, sigma^2 s^2 I))                  DP-SGD's noise, sigma unscaled
    g_tilde = (1 - kappa) g_tilde + kappa g                                  g_tilde starts at the first g
    theta  <- theta - lr g_tilde;   d = theta_new - theta

Only the per-sample gradients change: two passes (at theta + gamma d and at theta) whose
combination is never materialised. Its norm comes from per-sample inner products,
||a u + (1-a) v||^2 = a^2 ||u||^2 + 2a(1-a) <u, v> + (1-a)^2 ||v||^2, and its clipped sum
from weighted sums of both passes. One pass suffices when a = 0 (kappa = 1: DP-SGD exactly),
when d = 0 (the first step), and when a = 1 (gamma = (1-kappa)/kappa: only the shifted point;
the training loss at theta is then logged by a forward pass without gradients).

The thesis authors' code divided sigma by a norm factor (thesis Sec. 4.3); we do not.
"""

from __future__ import annotations

import torch

from dpbench.optimizers.base import SGD, Context, DPStep, StepOutput
from dpbench.privacy.per_sample import PerSampleGradients


class CombinedGradients:
    """Per-sample gradients a u_i + b v_i of two passes, b = 1 - a, without forming them."""

    def __init__(self, u: PerSampleGradients, v: PerSampleGradients, a: float):
        self.u, self.v, self.a, self.b = u, v, a, 1.0 - a
        self.batch_size = u.batch_size

    def norms(self) -> torch.Tensor:
        a, b = self.a, self.b
        sq = a * a * self.u.sq_norms() + 2 * a * b * self.u.inner(self.v) + b * b * self.v.sq_norms()
        return sq.clamp_min(0).sqrt()

    def weighted_sum(self, coef: torch.Tensor, out: dict | None = None) -> dict:
        su, sv = self.u.weighted_sum(coef * self.a, out), self.v.weighted_sum(coef * self.b)
        if out is None:
            return {p: su[p] + sv[p] for p in su}
        torch._foreach_add_(list(su.values()), [sv[p] for p in su])  # into out: the same sums
        return su


class KalmanFilter:
    """g_tilde <- (1 - kappa) g_tilde + kappa g, then the base rule's update with g_tilde;
    records the update direction d = theta_new - theta for the next step's shifted pass."""

    def __init__(self, base, kappa: float):
        self.base, self.kappa = base, kappa
        self.g_tilde: list[torch.Tensor] | None = None
        self.direction: list[torch.Tensor] | None = None  # None: d = 0

    @property
    def lr(self) -> float:
        """The base rule's learning rate (a schedule sets it: dpbench.training.schedules)."""
        return self.base.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.base.lr = value

    @torch.no_grad()
    def update(self, params, grads):
        if self.g_tilde is None:
            self.g_tilde = [g.clone() for g in grads]  # g_tilde_{-1} = g_0
        else:
            torch._foreach_mul_(self.g_tilde, 1 - self.kappa)
            torch._foreach_add_(self.g_tilde, grads, alpha=self.kappa)
        before = [p.detach().clone() for p in params]
        stats = self.base.update(params, self.g_tilde)
        self.direction = torch._foreach_sub([p.detach() for p in params], before)
        return stats

    def state_dict(self) -> dict:
        return {"base": self.base.state_dict(), "g_tilde": self.g_tilde, "direction": self.direction}

    def load_state_dict(self, state: dict) -> None:
        self.base.load_state_dict(state["base"])
        self.g_tilde, self.direction = state["g_tilde"], state["direction"]


class DiskStep(DPStep):
    """A DP step whose per-sample gradients are DiSK's two-point combination."""

    def __init__(self, ctx: Context, rule: KalmanFilter, gamma: float):
        super().__init__(ctx, rule)
        if not 0 < rule.kappa <= 1:
            raise ValueError(f"DiSK needs 0 < kappa <= 1, got {rule.kappa}")
        if gamma == 0:
            raise ValueError("DiSK needs gamma != 0 (a = (1 - kappa) / (kappa gamma))")
        self.gamma = gamma
        self.a = (1 - rule.kappa) / (rule.kappa * gamma)

    def per_sample_gradients(self, x, y):
        return self._two_points(x, y, super().per_sample_gradients)

    def pass_gradients(self, x, y):
        """``per_sample_gradients`` of the rows of one pass (a step in pieces,
        ``DPStep._clip_and_sum_by_pass``): both points' passes on these rows, so that a step
        holds one pass's layer records at each point, never the whole batch's."""
        return self._two_points(x, y, super().pass_gradients)

    def _two_points(self, x, y, gradients):
        """DiSK's per-sample gradients of the rows ``x``, each point's from ``gradients``
        (DPStep's held ``per_sample_gradients`` or its one-pass ``pass_gradients``)."""
        d = self.rule.direction
        if x.shape[0] == 0 or self.a == 0 or d is None:  # one pass at theta
            psg, out = gradients(x, y)
            out.stats["passes"] = float(x.shape[0] > 0)
            return psg, out
        saved = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                torch._foreach_add_(self.params, d, alpha=self.gamma)
            shifted, _ = gradients(x, y)
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, saved)  # theta restored bit for bit
        if self.a == 1:
            with torch.no_grad():
                losses, correct = self.ctx.loss_fn(self.model, x, y)
            return shifted, StepOutput(losses.detach(), correct, {"passes": 1.0, "loss_only_passes": 1.0})
        current, out = gradients(x, y)
        out.stats["passes"] = 2.0
        return CombinedGradients(shifted, current, self.a), out


def dpdisk(ctx: Context) -> DiskStep:
    h = ctx.hyperparameters
    return DiskStep(ctx, KalmanFilter(SGD(ctx.lr), float(h["kappa"])), float(h["gamma"]))
