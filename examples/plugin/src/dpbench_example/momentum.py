"""DP-SGD with heavy-ball momentum, applied as post-processing of the privatised gradient.

DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016, arXiv:1607.00133)
releases at each step t the noisy mean of the clipped per-sample gradients, g_t. Heavy-ball
momentum (Polyak, "Some methods of speeding up the convergence of iteration methods", USSR
Computational Mathematics and Mathematical Physics 4(5), 1964) then steps along

    v_t = mu v_{t-1} + g_t,    theta_t = theta_{t-1} - lr v_t,    v_0 = 0

(PyTorch's SGD momentum without dampening). The update reads nothing but g_1, ..., g_t, so it is
post-processing of DP-SGD's releases: sampling, clipping, noise and accounting are dpbench's
own DP-SGD ones (the spec keeps the default mechanism, ``PoissonSubsampledGaussian``), and so
is the privacy claim. With mu = 0 it is DP-SGD, step for step.
"""

from __future__ import annotations

import torch

from dpbench.plugin import DPStep, OptimizerSpec


class HeavyBall:
    """v <- mu v + g;  theta <- theta - lr v (the update rule; it owns the velocity v)."""

    def __init__(self, lr: float, momentum: float):
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.lr, self.momentum = lr, momentum
        self.velocity: list[torch.Tensor] | None = None

    @torch.no_grad()
    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        # grads are views into the step's buffer, overwritten by the next step: the velocity is a
        # tensor of its own (zeros_like), into which they are added, never grads kept as they are
        if self.velocity is None:
            self.velocity = [torch.zeros_like(g) for g in grads]
        torch._foreach_mul_(self.velocity, self.momentum)
        torch._foreach_add_(self.velocity, grads)
        torch._foreach_add_(params, self.velocity, alpha=-self.lr)

    def state_dict(self) -> dict:
        return {"velocity": self.velocity}

    def load_state_dict(self, state: dict) -> None:
        self.velocity = state["velocity"]


DPSGD_MOMENTUM = OptimizerSpec(
    name="dpsgd-momentum",
    build=lambda ctx: DPStep(ctx, HeavyBall(ctx.lr, ctx.hyperparameters["momentum"])),
    private=True,
    description="DP-SGD with heavy-ball momentum on the privatised gradient (post-processing)",
    reference="Polyak 1964 (heavy ball) on DP-SGD, Abadi et al. 2016",
    defaults={"momentum": 0.9},
)
