"""D2P2-SGD and its two ablations, D2P-SGD (no projection) and DP2-SGD (static noise), from
Jiang, Hasan, Saadati, Balu, Liu & Sarkar 2025, "Balancing Utility and Privacy: Dynamically
Private SGD with Random Projection", arXiv:2509.09485 (Alg. 1; the ablations are Algs. 2 and 3
of its ICLR 2025 submission, "D2P2-SGD: Dynamically Differentially Private Projected
Stochastic Gradient Descent").

Per step k, with automatic clipping and the released vector in the projected space::

    g_hat_i = g_i / (||g_i|| + gamma)                          every per-sample norm < 1
    g_bar   = (1/L) sum_i g_hat_i
    e_k     ~ N(0, (sigma_k s_P / L)^2 I_p),  sigma_k = sigma / sqrt(k)   (static: sigma_k = sigma)
    theta  <- theta - lr P_k (P_k^T g_bar + e_k),  p = round(rate d)

P_k is fresh public randomness every step (its seed is drawn from the noise generator): the
subsampled randomized Hartley transform by default (``projection: srht``, s_P = sqrt(d'/p)
exactly) or the paper's Gaussian matrix (``projection: gaussian``, s_P a bound that fails with
probability delta/10 over the run, which is accounted); the release P_k^T g_bar + e_k has
sensitivity ||P_k||_op / L <= s_P / L. Everything about the projection, its sensitivity and its
mechanism is in ``dpbench.mechanisms.projection``. Without projection (D2P-SGD) s_P = 1. The
decaying schedule is accounted step by step with the fast integer-order RDP accountant; the
paper's setting without s_P is the explicit option ``paper_sensitivity=true``, whose runs are
marked "not a valid DP guarantee".

Only the noise stage changes (``add_noise``); automatic clipping is a clipping rule. With
``Context.lanes`` > 1, d is the parameter count per lane and each lane draws its own
projection and noise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from dpbench.mechanisms import projection
from dpbench.mechanisms.noise import ProjectionNoise
from dpbench.mechanisms.poisson_gaussian import inverse_sqrt_schedule
from dpbench.optimizers.base import SGD, Context, DPStep


@dataclass(frozen=True)
class AutomaticClipping:
    """Bu et al.'s automatic clipping g / (||g|| + gamma), times the harness's sensitivity s
    (1 under normalised clipping, C under flat clipping), so each clipped norm is < s."""

    gamma: float = 0.01
    sensitivity: float = 1.0

    def __post_init__(self):
        if not self.gamma > 0:
            raise ValueError(f"automatic clipping needs gamma > 0, got {self.gamma}")

    def coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        return self.sensitivity / (norms + self.gamma)


class ProjectedStep(DPStep):
    """A DP step whose noise stage projects: theta <- theta - lr P (P^T g_bar + e_k).

    For the auditor (public randomness): after each step, ``last_seeds`` holds one projection
    seed per lane (``projection.transpose(kind, seed, v, projection_dim)`` is P_k^T v), ``k`` the
    step number and ``noise_std_at(k)`` the std of e_k on the released sum."""

    def __init__(self, ctx: Context, rule, auto_clip_gamma: float, decay: bool,
                 projection_rate: float | None = None):
        ctx = replace(ctx, clipping=AutomaticClipping(auto_clip_gamma, ctx.clipping.sensitivity))
        super().__init__(ctx, rule)
        self.decay, self.k = decay, 0
        total = sum(p.numel() for p in self.params)
        if total % ctx.lanes:
            raise ValueError(f"{total} parameters do not split into {ctx.lanes} lanes")
        self.dimension = total // ctx.lanes  # d, per lane
        self.kind, self.projection_dim, self.factor = None, None, 1.0  # factor: s_P
        self.last_seeds: list[int] = []
        if projection_rate is not None:
            if not 0 < projection_rate <= 1:
                raise ValueError(f"projection_rate must be in (0, 1], got {projection_rate}")
            noise = ctx.noise
            if not isinstance(noise, ProjectionNoise):
                raise TypeError("a projected step needs its mechanism's noise source "
                                "(mechanisms.projected_gaussian.RandomProjectionGaussian.noise), which carries the plan's projection")
            given = ctx.hyperparameters.get("projection", noise.kind)
            if given != noise.kind:
                raise ValueError(f"projection {given!r} differs from the privacy plan's {noise.kind!r}: "
                                 "build the plan from the same run config")
            self.kind = noise.kind
            self.projection_dim = max(1, round(projection_rate * self.dimension))
            if not noise.paper_sensitivity:  # the privacy plan's setting (checked there)
                self.factor = projection.sensitivity_factor(self.kind, self.dimension, self.projection_dim,
                                                            noise.tail_t)

    @property
    def noise_std(self) -> float:
        """Std of the noise on the (projected) sum at step 1: sigma s_clip s_P."""
        return self.ctx.noise_multiplier * self.ctx.clipping.sensitivity * self.factor

    def noise_std_at(self, k: int) -> float:
        """Std of e_k, the noise on the released sum P_k^T sum_i g_hat_i + e_k at step k:
        sigma_k s_clip s_P (the mean's is this / L)."""
        return self.noise_std * (inverse_sqrt_schedule(k) if self.decay else 1.0)

    def privacy_record(self) -> dict:
        out = super().privacy_record()
        if self.kind is not None:
            out.update(dimension=self.dimension, projection_dim=self.projection_dim,
                       projection_sensitivity_factor=self.factor)
            if self.kind == "srht":
                out["padded_dimension"] = projection.fast_size(self.dimension)
        return out

    @torch.no_grad()
    def add_noise(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        self.k += 1
        std = self.noise_std_at(self.k)
        if self.projection_dim is None:
            if std == 0:
                return grads
            return [g.add_(z, alpha=std) for g, z in zip(grads, self.ctx.noise.sample(grads))]
        lanes = self.ctx.lanes
        self.last_seeds = projection.step_seeds(self.ctx.noise.generator, lanes)
        flat = self.ctx.per_lane(grads)  # (lanes, d)
        e = None
        if std != 0:
            e = self.ctx.noise.sample([flat.new_empty(lanes, self.projection_dim)])[0].mul_(std)
        p = projection.draw(self.kind, self.last_seeds, self.dimension, self.projection_dim, flat.device,
                            flat.dtype)
        self.last_projection = p  # public randomness, as last_seeds (the auditor reads P_k^T e_c from it)
        out = p.back(flat, e)
        return [t.reshape(g.shape) for t, g in zip(out.split([g.numel() // lanes for g in grads], dim=1), grads)]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "k": self.k}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.k = state["k"]


def _build(ctx: Context, decay: bool, projected: bool) -> ProjectedStep:
    h = ctx.hyperparameters
    return ProjectedStep(ctx, SGD(ctx.lr), float(h["auto_clip_gamma"]), decay,
                         float(h["projection_rate"]) if projected else None)


def d2p2sgd(ctx: Context) -> ProjectedStep:
    return _build(ctx, decay=True, projected=True)


def d2psgd(ctx: Context) -> ProjectedStep:
    return _build(ctx, decay=True, projected=False)


def dp2sgd(ctx: Context) -> ProjectedStep:
    return _build(ctx, decay=False, projected=True)
