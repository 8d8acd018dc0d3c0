"""Per-sample gradient rules of the convolutions (``nn.Conv2d``, ``nn.ConvTranspose2d``): factors
from the unfolded inputs, registered by type in ``dpbench.privacy.per_sample_layers.LAYER_GRADS``
when this module is imported (``dpbench.privacy.per_sample`` imports it)."""

from __future__ import annotations

import math
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_weight

from dpbench.privacy.per_sample_layers import FactorGrads, register_per_sample


def unfold(x: torch.Tensor, kernel_size, dilation, padding, stride) -> torch.Tensor:
    """``F.unfold(x, ...)``, (B, C kh kw, L), as strided views and one copy: CUDA's im2col
    launches one kernel per sample (2048 launches per layer at L = 2048), this launches a
    few whatever the batch. Values are identical (pure data movement)."""
    if tuple(dilation) != (1, 1):
        return F.unfold(x, kernel_size, dilation, padding, stride)
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    patches = x.unfold(2, kh, sh).unfold(3, kw, sw)  # (B, C, H', W', kh, kw), a view
    B, C, Ho, Wo = patches.shape[:4]
    return patches.permute(0, 1, 4, 5, 2, 3).reshape(B, C * kh * kw, Ho * Wo)


@register_per_sample(nn.Conv2d)
class Conv2dGrads(FactorGrads):
    """``nn.Conv2d``: A the unfolded input patches, G the output gradients at each output pixel."""

    transposed = False

    @staticmethod
    def unsupported_option(module: nn.Module) -> str | None:
        if module.groups != 1 or isinstance(module.padding, str):
            return "only groups=1 and numeric padding are supported"
        return None

    def _roles(self, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output gradient) of the weight gradient as a Conv2d's."""
        return (gy, self.x) if self.transposed else (self.x, gy)

    @cached_property
    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.module
        inp, out = self._roles(self.gy)
        U = unfold(inp, m.kernel_size, m.dilation, m.padding, m.stride)
        return U.transpose(1, 2), out.flatten(2).transpose(1, 2)

    @property
    def _positions(self) -> int:
        return math.prod(self._roles(self.gy)[1].shape[2:])

    def _materialise(self) -> torch.Tensor:
        if self.x.device.type != "cpu":
            # on a GPU, cuDNN runs a grouped weight gradient as one kernel per group (per sample)
            return super()._materialise()
        # On the CPU: one grouped weight-gradient call (groups = B).
        m, B = self.module, self.batch_size
        inp, out = self._roles(self.gy)
        cin, cout = inp.shape[1], out.shape[1]
        w = conv2d_weight(
            inp.reshape(1, B * cin, *inp.shape[2:]), (B * cout, cin, *m.kernel_size),
            out.reshape(1, B * cout, *out.shape[2:]), m.stride, m.padding, m.dilation, groups=B,
        )
        return w.view(B, *m.weight.shape)

    @cached_property
    def bias(self) -> torch.Tensor | None:
        return None if self.module.bias is None else self.gy.sum((2, 3))

    def _native_weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        m = self.module
        inp, out = self._roles(self.gy * coef.view(-1, 1, 1, 1))
        return conv2d_weight(inp, m.weight.shape, out, m.stride, m.padding, m.dilation)


@register_per_sample(nn.ConvTranspose2d)
class ConvTranspose2dGrads(Conv2dGrads):
    """``nn.ConvTranspose2d``, the adjoint of a Conv2d from gy's space to x's space:
    dW[ci, co, kh, kw] = sum_p x[ci, p] * unfold(gy)[co, kh, kw, p], p over input pixels."""

    transposed = True
