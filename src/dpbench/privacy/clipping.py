"""Per-sample clipping as per-sample coefficients c_i, so that the clipped sum is sum_i c_i g_i.

Normalised clipping (De et al. 2022, thesis eq. 2.8): clip(g) = g / max(1, ||g||/C) / C, so
every clipped vector has norm <= 1 whatever C; the L2 sensitivity of the clipped sum is 1.
Flat clipping (normalize=False): g / max(1, ||g||/C), sensitivity C.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Clipping:
    """Per-sample clipping at norm C (``clip_norm``), normalised (De et al.) or flat:
    ``coefficients(norms)`` maps the per-sample norms (B,) of whole per-sample gradients to the
    c_i (B,) of the clipped sum sum_i c_i g_i, each ||c_i g_i|| <= ``sensitivity`` (1
    normalised, C flat): the L2 sensitivity the noise is calibrated for."""

    clip_norm: float = 1.0  # C
    normalize: bool = True

    def __post_init__(self):
        if not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be positive, got {self.clip_norm}")

    @property
    def sensitivity(self) -> float:
        """Largest norm of one clipped per-sample vector: the L2 sensitivity of the sum."""
        return 1.0 if self.normalize else self.clip_norm

    def coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        # 1 / max(1, ||g||/C) (/ C), in place on one new tensor: the floats of
        # ``1.0 / torch.clamp(norms / C, min=1.0) / C`` from four operators instead of six
        c = (norms / self.clip_norm).clamp_(min=1.0).reciprocal_()
        return c.div_(self.clip_norm) if self.normalize else c


@dataclass(frozen=True)
class NoClipping:
    """The non-private reference: every per-sample gradient enters unchanged."""

    sensitivity = float("inf")

    def coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(norms)
