"""The benchmark problems P1-P3 (thesis Table 4.1): model, preprocessing, loss and metric.

Architectures follow the thesis authors' released code; the parameter counts
(258,762 / 225,034 / 1,875,265) are checked by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# Normalisation constants for the classifiers: the published per-channel mean/std of each
# training set. They are fixed public constants, not recomputed from the data, so
# preprocessing spends no privacy budget.
CHANNEL_STATS = {
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


class CNN3c3d(nn.Module):
    """P1: three conv layers (each conv -> maxpool 2 -> ReLU), three dense layers."""

    per_sample_forward = True  # forward treats each sample on its own (per_sample.check_per_sample)

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.conv3 = nn.Conv2d(64, 128, 3)
        self.fc1 = nn.Linear(512, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(F.max_pool2d(self.conv3(x), 2))
        x = x.flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class CNN2c2d(nn.Module):
    """P2: two conv layers (each conv -> maxpool 2 -> ReLU), two dense layers."""

    per_sample_forward = True  # forward treats each sample on its own (per_sample.check_per_sample)

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(1600, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class ConvVAE(nn.Module):
    """P3: convolutional VAE with a 32-dimensional latent space, pixels in [0, 1]."""

    per_sample_forward = True  # forward treats each sample on its own (per_sample.check_per_sample)

    def __init__(self, latent_dim: int = 32):
        super().__init__()
        chans = [1, 32, 64, 128, 256]
        self.encoder = nn.Sequential(
            *[m for a, b in zip(chans, chans[1:]) for m in (nn.Conv2d(a, b, 3, 2, 1), nn.ReLU())]
        )
        self.enc_fc = nn.Linear(1024, 512)
        self.mu = nn.Linear(512, latent_dim)
        self.logvar = nn.Linear(512, latent_dim)
        self.dec_fc1 = nn.Linear(latent_dim, 512)
        self.dec_fc2 = nn.Linear(512, 1024)
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(256, 128, 3, 2, 1, output_padding=1), nn.ReLU(),
            nn.ConvTranspose2d(128, 64, 3, 2, 1, output_padding=0), nn.ReLU(),
            nn.ConvTranspose2d(64, 32, 3, 2, 1, output_padding=1), nn.ReLU(),
            nn.ConvTranspose2d(32, 1, 3, 2, 1, output_padding=1), nn.Sigmoid(),
        )

    def encode(self, x):
        h = F.relu(self.enc_fc(self.encoder(x).flatten(1)))
        return self.mu(h), self.logvar(h)

    def decode(self, z):
        h = F.relu(self.dec_fc2(F.relu(self.dec_fc1(z))))
        return self.decoder(h.view(-1, 256, 2, 2))

    def forward(self, x, noise: torch.Tensor):
        mu, logvar = self.encode(x)
        z = mu + noise * torch.exp(0.5 * logvar)
        return self.decode(z), mu, logvar


@dataclass(frozen=True)
class Problem:
    """A benchmark problem. ``per_sample_loss(model, x, y, generator)`` returns
    ``(losses, correct)``: per-sample losses (B,) and per-sample correctness (B,) or None."""

    id: str
    dataset: str
    task: str  # "classification" or "vae"
    build: Callable[[], nn.Module]
    metric: str  # "accuracy" or "loss"

    def preprocess(self, images: np.ndarray) -> torch.Tensor:
        """uint8 images (N, C, H, W) -> float32 model inputs."""
        x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
        if self.task == "classification":
            mean, std = CHANNEL_STATS[self.dataset]
            x = (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)
        return x

    def per_sample_loss(self, model: nn.Module, x, y, generator: torch.Generator | None = None):
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


PROBLEMS: dict[str, Problem] = {
    "P1": Problem("P1", "cifar10", "classification", CNN3c3d, "accuracy"),
    "P2": Problem("P2", "fashion-mnist", "classification", CNN2c2d, "accuracy"),
    "P3": Problem("P3", "fashion-mnist", "vae", ConvVAE, "loss"),
}


def get_problem(problem_id: str) -> Problem:
    try:
        return PROBLEMS[problem_id]
    except KeyError:
        raise KeyError(f"unknown problem {problem_id!r}; choose one of {sorted(PROBLEMS)}") from None
