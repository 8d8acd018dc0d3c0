"""Noise sources: where the Gaussian noise of a DP step comes from.

A noise source returns unit-variance noise shaped like the gradients; the optimizer scales
it by sigma times the sensitivity. I.i.d. noise comes from a seeded generator of its own, so
the noise stream does not depend on anything else the run draws (model init, sampling).
"""

from __future__ import annotations

import torch


class GaussianNoise:
    """I.i.d. N(0, 1) noise from a dedicated, seeded generator."""

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.randn(t.shape, generator=self.generator, device=t.device, dtype=t.dtype) for t in like]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
