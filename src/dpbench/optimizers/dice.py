"""DP-Dice: DP-SGD with clipped error feedback (Zhang et al. 2024; thesis Alg. 3).

Per step, on the mean-gradient scale (the thesis authors' released code mixed a mean-scale
gradient with a sum-scale clipped gradient in the residual; README, defect 5)::

    g     = (1/L) sum_i g_i                       raw per-sample gradients, unclipped
    g_bar = (1/L) sum_i clip(g_i) + clip(e, C2)   the residual e clipped to norm C2
    theta <- theta - lr (g_bar + noise)
    e     <- e + g - g_bar

Only the clipped sum changes (``clip_and_sum`` adds L clip(e, C2) and updates e) and the noise
std on the sum is sigma s sqrt(1 + 2 C2 / C), as in the authors' reference code.

That calibration is not a valid (epsilon, delta) guarantee for C2 > 0, and every run says so
(its ``caveat``, recorded as ``privacy.caveat``, printed by ``dpbench train``, marked in the
figures' legends). The released sum is sum_i clip(g_i) + L clip(e, C2) + noise, and e carries
every earlier *raw* gradient: one changed example with a large gradient moves e arbitrarily,
so L clip(e, C2) can move by up to 2 L C2 / C (in units of s) at every later step, sampled or
not. The release's sensitivity is s (1 + 2 L C2 / C), not s sqrt(1 + 2 C2 / C): with one
example (taking part once) removed, the sum moved by 64 to 94 at each of the next 11 steps at
L = 64, C2 = C = 1, where the noise is calibrated for 1.73 (tests/privacy/test_integrity.py), and since
every later step depends on the example, subsampling amplification does not apply to the
residual term either. ``dpdice-strict`` (dice_strict.py) runs the same algorithm with noise
calibrated to a bound that holds.

Units: under normalised clipping every clipped vector is divided by C, so the residual lives
in those units too (raw gradients enter as g / C and clip(e, C2) bounds e's norm by C2 / C);
with C = 1, the benchmark's setting, this is the algorithm as written.
"""

from __future__ import annotations

import math

import torch

from dpbench.optimizers.base import SGD, Context, DPStep



class DiceStep(DPStep):
    """A DP step whose clipped sum carries the clipped error-feedback residual."""

    def __init__(self, ctx: Context, rule, c2: float):
        super().__init__(ctx, rule)
        if c2 < 0:
            raise ValueError(f"DP-Dice needs C2 >= 0, got {c2}")
        self.c2 = c2
        self.units = ctx.clipping.sensitivity / ctx.clipping.clip_norm  # raw gradient -> clipped units
        self.residual: list[torch.Tensor] | None = None  # e, on the mean-gradient scale

    @property
    def noise_std(self) -> float:
        clip_norm = self.ctx.clipping.clip_norm
        return super().noise_std * math.sqrt(1 + 2 * self.c2 / clip_norm)

    @torch.no_grad()
    def clip_and_sum(self, psg) -> list[torch.Tensor]:
        clipped = super().clip_and_sum(psg)  # sum_i clip(g_i)
        if psg is None:
            raw = [torch.zeros_like(p) for p in self.params]
        else:
            summed = psg.weighted_sum(self.params[0].new_full((psg.batch_size,), self.units))
            raw = [summed[p] for p in self.params]  # sum_i g_i, in clipped units
        return self._feed_back(clipped, raw)

    @torch.no_grad()
    def sum_pass(self, psg, first: bool) -> None:
        """One pass's part of both sums ``clip_and_sum`` needs, sum_i clip(g_i) (into the buffer)
        and sum_i g_i (raw, into ``_raw``): a step in pieces holds one pass's layer records."""
        super().sum_pass(psg, first)
        summed = psg.weighted_sum(self.params[0].new_full((psg.batch_size,), self.units))
        if first:
            self._raw = [summed[p] for p in self.params]
        else:
            torch._foreach_add_(self._raw, [summed[p] for p in self.params])

    @torch.no_grad()
    def finish_sum(self) -> list[torch.Tensor]:
        raw, self._raw = self._raw, None
        return self._feed_back(super().finish_sum(), raw)

    def _feed_back(self, clipped: list[torch.Tensor], raw: list[torch.Tensor]) -> list[torch.Tensor]:
        """L clip(e, C2) added to the clipped sum, and e <- e + g - g_bar (``raw``: sum_i g_i)."""
        L = self.ctx.expected_batch_size
        if self.residual is None:
            self.residual = [torch.zeros_like(p) for p in self.params]
        e = self.residual
        if self.c2 > 0:
            lanes = self.ctx.lanes  # ||e|| per lane (one lane in training)
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(t.reshape(lanes, -1), dim=1) for t in e]), dim=0)
            factor = torch.clamp(self.c2 * self.units / norm.clamp_min(1e-30), max=1.0)
            e_clipped = [t * factor.view(lanes, *([1] * (t.dim() - 1))) for t in e]
            torch._foreach_add_(clipped, e_clipped, alpha=L)  # L g_bar
        # e <- e + g - g_bar, with g = raw / L and g_bar = clipped / L (before the noise)
        torch._foreach_add_(e, torch._foreach_sub(raw, clipped), alpha=1 / L)
        return clipped

    def state_dict(self) -> dict:
        return {**super().state_dict(), "residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.residual = state["residual"]


def dpdice(ctx: Context) -> DiceStep:
    return DiceStep(ctx, SGD(ctx.lr), float(ctx.hyperparameters["c2"]))
