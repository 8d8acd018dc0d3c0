"""How a run's batches are drawn: the three samplers of the mechanisms.

* ``PoissonSampler`` (DP-SGD and the mechanisms built on it): each example independently with
  probability q = L/N, what the accountant's subsampled-Gaussian analysis assumes; drawn in one
  vectorised call per step from a dedicated generator.
* ``FixedBatchSampler`` (the matrix mechanisms, dense and streamed, unamplified): (k, b)
  participation made real. The training set is shuffled once per run (seeded by the run's
  sampler stream), cut into b = N // L batches of exactly L examples (the N - bL left over
  never participate), and step t uses batch t mod b. So example i, in batch j, contributes to
  steps j, j+b, ..., j+(k-1)b and to no other: the participation pattern pi_j the multi-epoch
  sensitivity is computed for (and, with k = 1, the single-epoch one). No Poisson sampling, so
  no amplification: the privacy argument is the Gaussian mechanism alone.
* ``CyclicPoissonSampler`` (amplified BandMF, cyclic_poisson.py): the N examples are
  partitioned once into b groups, each example's group drawn independently and uniformly (so
  that adding or removing one example leaves the others' groups unchanged: add/remove
  adjacency); at step t (0-based) each example of group t mod b is included independently with
  probability p = b L / N.

Lanes (independent replicas, see ``optimizers.base.Context.lanes``): the examples are ``lanes``
blocks of ``num_examples``, indexed lane-major. Poisson and cyclic Poisson draw each example's
group and inclusion independently, so one sampler over lanes N examples is exactly ``lanes``
independent samplers, one per lane; fixed batches shuffle each lane once on its own, and a batch
is the union of every lane's batch t mod b (lane r's indices offset by r * num_examples).
"""

from __future__ import annotations

import numpy as np
import torch


class PoissonSampler:
    """Each of ``num_examples`` examples independently with probability ``sample_rate``."""

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


class FixedBatchSampler:
    """b = N // L batches of exactly L, shuffled once, visited in the same order every epoch."""

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


def _seeds(seed: int) -> tuple[int, int]:
    """(inclusion seed, group seed): inclusion uses the run's sampler seed itself, so that with
    b = 1 the batches are those of PoissonSampler with the same seed."""
    group = int(np.random.SeedSequence(int(seed)).spawn(1)[0].generate_state(1, np.uint64)[0] >> np.uint64(1))
    return int(seed), group


class CyclicPoissonSampler:
    """Group t mod b at step t, each member with probability p; ``groups`` (N,) holds each
    example's group: the audit reads it."""

    def __init__(self, num_examples: int, bands: int, sample_rate: float, seed: int,
                 device: torch.device | str = "cpu"):
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
        self.num_examples, self.bands, self.sample_rate = int(num_examples), int(bands), float(sample_rate)
        self.device = torch.device(device)
        inclusion_seed, group_seed = _seeds(seed)
        gen = torch.Generator()
        gen.manual_seed(group_seed)
        self.groups = torch.randint(0, self.bands, (self.num_examples,), generator=gen) if self.bands > 1 \
            else torch.zeros(self.num_examples, dtype=torch.int64)
        self._index()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(inclusion_seed)
        self.step = 0

    def _index(self) -> None:
        order = torch.argsort(self.groups, stable=True)
        counts = torch.bincount(self.groups, minlength=self.bands).tolist()
        self.members = [m.to(self.device) for m in torch.split(order, counts)]

    def sample(self) -> torch.Tensor:
        """Indices of step t's batch: members of group t mod b, each with probability p."""
        members = self.members[self.step % self.bands]
        self.step += 1
        mask = torch.rand(members.numel(), generator=self.generator, device=self.device) < self.sample_rate
        return members[mask]

    def state_dict(self) -> dict:
        return {"step": self.step, "generator": self.generator.get_state(), "groups": self.groups.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])
        self.groups = state["groups"].clone()
        self._index()

