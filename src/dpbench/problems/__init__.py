"""The benchmark problems: a dataset, a model, preprocessing, a per-sample loss and the metric
reported. P1-P3 are the thesis's (Table 4.1): image datasets read by ``dpbench.data``, the
networks of ``convnets``. P4 is a private transformer language model on the fortunes corpus
with planted canaries (``language``, ``transformer``, ``tokenizer``; ``canaries``: their
generation, planting and exposure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpbench.data import image_datasets
from dpbench.data.image_datasets import Dataset
from dpbench.plugins import Group, Registry
from dpbench.problems.convnets import CHANNEL_STATS, CNN2c2d, CNN3c3d, ConvVAE
from dpbench.problems.transformer import TransformerLM

LANGUAGE_MODEL = "language-model"


@dataclass(frozen=True)
class Problem:
    """A benchmark problem. ``per_sample_loss(model, x, y, generator)`` returns
    ``(losses, correct)``: per-sample losses (B,) and per-sample correctness (B,) or None."""

    id: str
    dataset: str
    task: str  # "classification", "vae" or "language-model"
    build: Callable[[], nn.Module]
    metric: str  # "accuracy" or "loss"

    @property
    def plants_canaries(self) -> bool:
        """Whether a run inserts canaries into its training split and measures their exposure."""
        return self.task == LANGUAGE_MODEL

    def load(self, data_dir: str | None = None) -> Dataset:
        """The problem's dataset, from its official files (verified)."""
        if self.task == LANGUAGE_MODEL:
            from dpbench.problems import language
            return language.load(data_dir)
        return image_datasets.load(self.dataset, data_dir)

    def preprocess(self, images: np.ndarray) -> torch.Tensor:
        """uint8 images (N, C, H, W) -> float32 model inputs; P4: token ids (N, T + 1), as they are."""
        if self.task == LANGUAGE_MODEL:
            from dpbench.problems import language
            return language.preprocess(images)
        x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
        if self.task == "classification":
            mean, std = CHANNEL_STATS[self.dataset]
            x = (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
        return x

    def per_sample_loss(self, model: nn.Module, x, y, generator: torch.Generator | None = None):
        if self.task == LANGUAGE_MODEL:
            from dpbench.problems import language
            return language.per_sample_loss(model, x, y, generator)
        if self.task == "classification":
            logits = model(x)
            losses = F.cross_entropy(logits, y, reduction="none")
            return losses, (logits.argmax(1) == y)
        # VAE: reconstruction (binary cross-entropy summed over pixels) + KL summed over
        # latent dims, per sample. The Sigmoid output is compared with inputs in [0, 1].
        noise = torch.randn(x.shape[0], model.mu.out_features, generator=generator, device=x.device)
        recon, mu, logvar = model(x, noise)
        rec = F.binary_cross_entropy(recon, x, reduction="none").flatten(1).sum(1)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
        return rec + kl, None


# plugins: entry points of the group ``dpbench.problems``, each naming a Problem (dpbench.plugins)
GROUP = Group("dpbench.problems", "problem", Problem, "id")

PROBLEMS: Registry = Registry(GROUP, {
    "P1": Problem("P1", "cifar10", "classification", CNN3c3d, "accuracy"),
    "P2": Problem("P2", "fashion-mnist", "classification", CNN2c2d, "accuracy"),
    "P3": Problem("P3", "fashion-mnist", "vae", ConvVAE, "loss"),
    # P4: byte-level transformer LM (876,034 parameters), one fortune = one record; loss = the
    # held-out records' mean per-record token cross-entropy (perplexity = exp(loss))
    "P4": Problem("P4", "fortunes", LANGUAGE_MODEL, TransformerLM, "loss"),
})


def get_problem(problem_id: str) -> Problem:
    """As ``dpbench.optimizers.get_optimizer``: KeyError for an unknown id, PluginError for a broken plugin's."""
    return PROBLEMS.lookup(problem_id)
