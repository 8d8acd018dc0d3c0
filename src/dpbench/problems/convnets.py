"""The image models of problems P1-P3 (thesis Table 4.1) and their fixed preprocessing constants.

Architectures follow the thesis authors' released code; the parameter counts
(258,762 / 225,034 / 1,875,265) are checked by the tests.
"""

from __future__ import annotations

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
