"""Batch sampling. Poisson sampling (each example independently with probability q = L/N)
is what the accountant's subsampled-Gaussian analysis assumes; it is drawn in one vectorised
call per step from a dedicated generator."""

from __future__ import annotations

import torch


class PoissonSampler:
    def __init__(self, num_examples: int, sample_rate: float, seed: int, device: torch.device | str = "cpu"):
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        self.num_examples = num_examples
        self.sample_rate = sample_rate
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def sample(self) -> torch.Tensor:
        """Indices of one batch; its size is Binomial(N, q) and may be 0."""
        mask = torch.rand(self.num_examples, generator=self.generator, device=self.device) < self.sample_rate
        return mask.nonzero().squeeze(1)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
