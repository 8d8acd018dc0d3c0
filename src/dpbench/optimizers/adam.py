"""The Adam family on DP-SGD's privatised gradient: one update rule, five optimizers.

The papers differ only in the denominator of the step and in weight decay::

    m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2,   m^ = m / (1 - b1^t),   v^ = v / (1 - b2^t)
    theta <- theta - lr * ( m^ / (sqrt(max(v^ - Phi, floor) + eps_in) + eps_out) + wd * theta )

=============  ==============================  =====  ==========  =======  =======  ====
id             paper                           Phi    floor       eps_in   eps_out  wd
=============  ==============================  =====  ==========  =======  =======  ====
adam, dpadam   Kingma & Ba 2015                0      --          0        eps      0
adamw          Loshchilov & Hutter 2019        0      --          0        eps      lam
dpadambc       Tang et al. 2024; thesis Alg. 2 Phi    zeta'       0        0        0
dpadamw        Chooi et al. 2025 Alg. 1        0      --          eps0     0        lam
dpadamw-bc     Chooi et al. 2025 Alg. 2        Phi    gamma       0        0        lam
=============  ==============================  =====  ==========  =======  =======  ====

Kingma & Ba, "Adam", ICLR 2015 (arXiv:1412.6980); Loshchilov & Hutter, "Decoupled Weight
Decay Regularization", ICLR 2019 (arXiv:1711.05101); Tang, Shpilevskiy, Lécuyer, "DP-AdamBC",
AAAI 2024 (arXiv:2312.14334); Chooi, Cong, Li, Sun, "DP-AdamW: Investigating Decoupled Weight
Decay and Bias Correction in Private Deep Learning", 2025 (arXiv:2511.07843).

``adam`` and ``adamw`` are the non-private references (no clipping, no noise); ``adamw`` is
Loshchilov & Hutter's Alg. 2 with the schedule multiplier eta_t = lr and alpha = lr, i.e.
PyTorch's ``AdamW`` (theta <- theta (1 - lr wd), then the Adam step), the non-private baseline
of Gong, Pavliv & Peng's language-model comparison.

Phi = (sigma * s / L)^2 is the variance of the noise on each coordinate of the privatised mean
gradient (s the sensitivity: 1 under normalised clipping, C under flat clipping), i.e. the
bias that the noise adds to E[v^]. How often the floor is hit is counted per step
(``floor_hits`` out of ``floor_coordinates``, summed over the run in the run's stats).
"""

from __future__ import annotations

import torch

from dpbench.optimizers.base import Context, DPStep, NonPrivateStep


class Adam:
    """Adam with the variants' knobs: bias subtraction ``phi``, a ``floor`` under the corrected
    second moment, eps inside (``eps_in``) or outside (``eps_out``) the square root, and
    decoupled weight decay ``weight_decay`` (multiplied by lr, as in Chooi et al. 2025, Alg. 1)."""

    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps_out: float = 0.0,
                 eps_in: float = 0.0, phi: float = 0.0, floor: float | None = None, weight_decay: float = 0.0):
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"Adam needs 0 <= beta1, beta2 < 1, got {beta1}, {beta2}")
        if min(eps_out, eps_in, phi, weight_decay) < 0 or (floor is not None and floor <= 0):
            raise ValueError("Adam's eps, phi and weight decay must be >= 0 and its floor > 0")
        self.lr, self.beta1, self.beta2 = lr, beta1, beta2
        self.eps_out, self.eps_in, self.phi, self.floor, self.weight_decay = eps_out, eps_in, phi, floor, weight_decay
        self.t, self.m, self.v = 0, None, None

    @torch.no_grad()
    def update(self, params, grads) -> dict[str, float] | None:
        if self.m is None:
            self.m = [torch.zeros_like(p) for p in params]
            self.v = [torch.zeros_like(p) for p in params]
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        torch._foreach_lerp_(self.m, grads, 1 - b1)  # m <- b1 m + (1 - b1) g
        torch._foreach_mul_(self.v, b2)
        torch._foreach_addcmul_(self.v, grads, grads, value=1 - b2)
        # denominator sqrt(max(v^ - Phi, floor) + eps_in) + eps_out
        denom = torch._foreach_div(self.v, 1 - b2 ** self.t)
        hits = None
        if self.phi:
            torch._foreach_sub_(denom, self.phi)
        if self.floor is not None:
            hits = sum((d < self.floor).sum() for d in denom)
            torch._foreach_clamp_min_(denom, self.floor)
        if self.eps_in:
            torch._foreach_add_(denom, self.eps_in)
        torch._foreach_sqrt_(denom)
        if self.eps_out:
            torch._foreach_add_(denom, self.eps_out)
        if self.weight_decay:  # theta_{t-1} - lr * wd * theta_{t-1}, then the adaptive step
            torch._foreach_mul_(params, 1 - self.lr * self.weight_decay)
        torch._foreach_addcdiv_(params, self.m, denom, value=-self.lr / (1 - b1 ** self.t))
        if hits is None:
            return None
        return {"floor_hits": float(hits), "floor_coordinates": float(sum(p.numel() for p in params))}

    def state_dict(self) -> dict:
        return {"t": self.t, "m": self.m, "v": self.v}

    def load_state_dict(self, state: dict) -> None:
        self.t, self.m, self.v = state["t"], state["m"], state["v"]


def noise_variance(step: DPStep) -> float:
    """Phi: the per-coordinate variance of the noise on the privatised mean gradient."""
    return (step.noise_std / step.ctx.expected_batch_size) ** 2


def _betas(h: dict) -> dict:
    return {"beta1": float(h["beta1"]), "beta2": float(h["beta2"])}


def _dp_adam(ctx: Context, floor_key: str | None = None, **rule) -> DPStep:
    """DP-SGD's privatised gradient into ``Adam``; with a floor (the bias-corrected variants),
    Phi is subtracted and the hyperparameter ``floor_key`` is the floor."""
    h = ctx.hyperparameters
    step = DPStep(ctx, Adam(ctx.lr, **_betas(h), floor=float(h[floor_key]) if floor_key else None, **rule))
    if floor_key:
        step.rule.phi = noise_variance(step)
    return step


def adam(ctx: Context) -> NonPrivateStep:
    h = ctx.hyperparameters
    return NonPrivateStep(ctx, Adam(ctx.lr, **_betas(h), eps_out=float(h["eps"])))


def adamw(ctx: Context) -> NonPrivateStep:
    h = ctx.hyperparameters
    return NonPrivateStep(ctx, Adam(ctx.lr, **_betas(h), eps_out=float(h["eps"]), weight_decay=float(h["weight_decay"])))


def dpadam(ctx: Context) -> DPStep:
    return _dp_adam(ctx, eps_out=float(ctx.hyperparameters["eps"]))


def dpadambc(ctx: Context) -> DPStep:
    return _dp_adam(ctx, "zeta")


def dpadamw(ctx: Context) -> DPStep:
    h = ctx.hyperparameters
    return _dp_adam(ctx, eps_in=float(h["eps0"]), weight_decay=float(h["weight_decay"]))


def dpadamw_bc(ctx: Context) -> DPStep:
    return _dp_adam(ctx, "gamma", weight_decay=float(ctx.hyperparameters["weight_decay"]))
