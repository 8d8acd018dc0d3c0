"""(k, b) participation made real: fixed batches, visited in the same order every epoch.

The training set is shuffled once per run (seeded by the run's sampler stream), cut into
b = N // L batches of exactly L examples (the N - bL left over never participate), and
step t uses batch t mod b. So example i, in batch j, contributes to steps
j, j+b, ..., j+(k-1)b and to no other: the participation pattern pi_j the multi-epoch
sensitivity is computed for (and, with k = 1, the single-epoch one). No Poisson sampling,
so no amplification: the privacy argument is the Gaussian mechanism alone.

With ``lanes`` > 1 (independent replicas, see ``optimizers.base.Context.lanes``) the examples
are ``lanes`` blocks of ``num_examples``; each lane is shuffled once on its own and a batch is
the union of every lane's batch t mod b (lane r's indices offset by r * num_examples).
"""

from __future__ import annotations

import torch


class FixedBatchSampler:
    def __init__(self, num_examples: int, batch_size: int, seed: int, device: torch.device | str = "cpu",
                 lanes: int = 1):
        if not 1 <= batch_size <= num_examples:
            raise ValueError(f"batch size {batch_size} must be between 1 and the number of examples {num_examples}")
        if lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        self.num_batches = num_examples // batch_size
        gen = torch.Generator()
        gen.manual_seed(seed)
        lane_batches = []
        for lane in range(lanes):
            perm = torch.randperm(num_examples, generator=gen) + lane * num_examples
            lane_batches.append(perm[: self.num_batches * batch_size].view(self.num_batches, batch_size))
        self.batches = torch.cat(lane_batches, dim=1).to(device)  # (b, lanes * L)
        self.step = 0

    def sample(self) -> torch.Tensor:
        idx = self.batches[self.step % self.num_batches]
        self.step += 1
        return idx

    def state_dict(self) -> dict:
        return {"step": self.step, "batches": self.batches.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.batches = state["batches"].to(self.batches.device)
