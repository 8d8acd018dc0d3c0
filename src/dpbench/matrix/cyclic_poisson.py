"""Cyclic Poisson sampling and its privacy accounting (amplified BandMF).

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix
Factorization", NeurIPS 2023 (arXiv 2306.08153), Alg. 2 and Thm. 4; the event is
jax_privacy's ``accounting.amplified_bandmf_event``.

Sampler. The N examples are partitioned once into b groups, each example's group drawn
independently and uniformly (so that adding or removing one example leaves the others'
groups unchanged: add/remove adjacency). At step t (0-based) each example of group t mod b is
included independently with probability p = b L / N, so the expected batch size is L; the
step divides by L. Needs b <= N / L (p <= 1).

Privacy (Thm. 4). An example of group g can only appear at steps g, g + b, g + 2b, ...: at
most ceil(T / b) times, b apart. If C is b-banded, its columns b or more apart are orthogonal,
so the correlated-noise release C G + sigma_Z Z splits into ceil(T / b) rounds in which the
example's contribution is one Poisson-sampled (probability p) vector of norm at most
C_clip max_j ||C e_j||. The mechanism therefore has every (epsilon, delta) guarantee of DP-SGD
with ceil(T / b) steps, sampling probability p and noise multiplier
sigma = sigma_Z / (C_clip max_j ||C e_j||), which we account with the harness's accountant
(PRV by default, RDP as a cross-check). Pitfalls: the rounds are ceil(T / b) (T is
pessimistic), and the rate is p = b L / N, not L / N (that would claim b times too much
amplification).

Lanes. A training run may stack ``lanes`` independent replicas, with examples indexed
lane-major (lane l holds examples l N .. (l + 1) N - 1). Because each example's group and each
inclusion are drawn independently, one sampler over lanes N examples at rate p is exactly
``lanes`` independent cyclic Poisson samplers, one per lane, each with expected batch L.
"""

from __future__ import annotations

import numpy as np
import torch


def sample_rate(bands: int, batch_size: int, num_examples: int) -> float:
    """p = b L / N; refuses b > N / L."""
    if not 1 <= bands:
        raise ValueError(f"bands must be >= 1, got {bands}")
    if bands * batch_size > num_examples:
        raise ValueError(f"cyclic Poisson sampling with b = {bands} bands needs b <= N / L = {num_examples} / "
                         f"{batch_size} (sampling probability p = b L / N = {bands * batch_size / num_examples:g} > 1)")
    return bands * batch_size / num_examples


def rounds(steps: int, bands: int) -> int:
    """ceil(T / b): the most times one example can be sampled in T steps."""
    return -(-int(steps) // int(bands))


def history(noise_multiplier: float, rate: float, steps: int, bands: int) -> list[tuple[float, float, int]]:
    """The accounted event as an accounting.History: DP-SGD with ceil(T / b) steps at rate p
    and noise multiplier sigma = sigma_Z / (C_clip max_j ||C e_j||)."""
    return [(float(noise_multiplier), float(rate), rounds(steps, bands))]


def _seeds(seed: int) -> tuple[int, int]:
    """(inclusion seed, group seed): inclusion uses the run's sampler seed itself, so that with
    b = 1 the batches are those of sampling.PoissonSampler with the same seed."""
    group = int(np.random.SeedSequence(int(seed)).spawn(1)[0].generate_state(1, np.uint64)[0] >> np.uint64(1))
    return int(seed), group


class CyclicPoissonSampler:
    """``groups`` (N,) holds each example's group: the audit reads it."""

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

