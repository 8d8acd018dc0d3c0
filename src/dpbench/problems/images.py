"""P1-P3, the thesis's image problems (Table 4.1): CIFAR-10 and Fashion-MNIST read by
``dpbench.data.image_datasets``, the networks of ``convnets``, classification or a VAE."""

from __future__ import annotations

from typing import Callable

from dpbench.data import image_datasets
from dpbench.data.dataset import Dataset
from dpbench.problems.catalog import FACTS
from dpbench.problems.convnets import CHANNEL_STATS, CNN2c2d, CNN3c3d, ConvVAE
from dpbench.problems.spec import Problem
from dpbench.problems.tasks import VAE, Classification


def official(dataset: str) -> Callable[[str | None], Dataset]:
    """The loader of an image dataset from its official files (verified)."""
    def load(data_dir: str | None = None) -> Dataset:
        return image_datasets.load(dataset, data_dir)

    return load


P1 = Problem(FACTS["P1"], Classification(*CHANNEL_STATS["cifar10"]), CNN3c3d, official("cifar10"))
P2 = Problem(FACTS["P2"], Classification(*CHANNEL_STATS["fashion-mnist"]), CNN2c2d, official("fashion-mnist"))
P3 = Problem(FACTS["P3"], VAE(), ConvVAE, official("fashion-mnist"))
