"""The tasks a problem can pose: what its raw data becomes as model inputs, its per-sample loss,
what it reports, and what a run plants in its training split.

A task object owns the part of a problem that depends on the kind of learning, so that no
caller asks which task it has: ``preprocess`` (raw arrays -> the model's input tensor, fixed
public constants only, so preprocessing spends no privacy), ``per_sample_loss`` (per-sample
losses and, where the task counts them, per-sample correctness), ``make_canaries`` and
``canary_records`` (what a run plants: nothing here) and ``memorisation`` (what a run measures
about them). Its ``facts`` (``dpbench.problems.catalog.TaskFacts``, torch-free) say which metric
it reports and selects on. ``Classification`` (images), ``TabularClassification`` (feature
vectors) and ``VAE`` are here; the language model's task,
which plants canaries, is ``dpbench.problems.language.LanguageModel``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import dpbench.problems.catalog as catalog


class Task:
    """The base: subclasses set ``facts`` and implement ``preprocess`` and ``per_sample_loss``.
    ``per_sample_loss(model, x, y, generator)`` returns ``(losses, correct)``: per-sample
    losses (B,) and per-sample correctness (B,), or None where the task counts none."""

    facts: catalog.TaskFacts

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def metric(self) -> str:
        return self.facts.metric

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    def per_sample_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor | None,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def groups(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Disjoint index sets covering the rows of ``x`` that a step or an evaluation on the CPU
        runs as separate passes, because they cost less than one pass over all the rows (a token
        batch in groups of similar length sheds its padding); None: one pass. A row's loss and
        gradient are its own in any pass (the per-sample contract), so groups change the cost of
        a step, not the step: the same numbers up to floating-point order."""
        return None

    # Why a captured step (dpbench.training.capture: one CUDA graph replaying fixed shapes)
    # cannot run this task's loss, or None where ``fixed_shape_loss`` runs on the batch's full
    # shape with no host sync and no random draw. Read from the task's own class only: a task
    # class that does not declare it (a subclass may change the loss) is not captured.
    capture_refusal: str | None

    def fixed_shape_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor | None,
                         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``per_sample_loss`` as a captured step runs it, on the batch's full shape: the same
        losses and gradients (a task that trims its batches for speed trims nothing here)."""
        return self.per_sample_loss(model, x, y, generator)

    def make_canaries(self, seed: int) -> list:
        """The canaries a run with the ``seed``'s canary stream plants: none."""
        return []

    def canary_records(self, canaries: Sequence) -> np.ndarray:
        """The raw training records the canaries add (k copies of each)."""
        raise ValueError(f"task {self.name!r} plants no canaries")

    def memorisation(self, model: nn.Module, canaries: Sequence, device) -> dict:
        """The trained model's memorisation of the planted canaries."""
        raise ValueError(f"task {self.name!r} plants no canaries")


def scaled(images: np.ndarray, scale: float) -> torch.Tensor:
    """Integer pixels (N, C, H, W) as float32 in [0, 1]: divided by their largest possible value."""
    return torch.from_numpy(np.ascontiguousarray(images)).float().div_(scale)


class Classification(Task):
    """Images -> class labels. Inputs (N, C, H, W) are the pixels scaled to [0, 1] by ``scale``
    (the largest pixel value) and, with ``mean`` and ``std`` (per channel, fixed published
    constants, not recomputed from the data), normalised; the loss is the per-sample
    cross-entropy of the logits, and a prediction is correct where the largest logit is the
    label's. Input of another rank (feature vectors: use ``TabularClassification``), or with
    another number of channels than ``mean`` has, is refused, never broadcast."""

    facts = catalog.CLASSIFICATION
    capture_refusal = None  # one forward pass over the batch as given

    def __init__(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 scale: float = 255.0):
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std (per channel), or neither")
        self.mean, self.std, self.scale = mean, std, scale

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        if np.ndim(raw) != 4:
            raise ValueError(f"Classification takes images (N, C, H, W), got an array of shape {np.shape(raw)}"
                             + (" (feature vectors: use TabularClassification)" if np.ndim(raw) == 2 else ""))
        if self.mean is not None and np.shape(raw)[1] != len(self.mean):
            raise ValueError(f"Classification has mean and std for {len(self.mean)} channels, the images have "
                             f"{np.shape(raw)[1]} (shape {np.shape(raw)})")
        x = scaled(raw, self.scale)
        if self.mean is not None:
            x = (x - torch.tensor(self.mean).view(1, -1, 1, 1)) / torch.tensor(self.std).view(1, -1, 1, 1)
        return x

    def per_sample_loss(self, model, x, y, generator=None):
        logits = model(x)
        losses = F.cross_entropy(logits, y, reduction="none")
        return losses, (logits.argmax(1) == y)


class TabularClassification(Classification):
    """Feature vectors -> class labels. Inputs (N, F) are the raw features, each standardised as
    (x_f - mean_f) / std_f with ``mean`` and ``std`` per feature: fixed public constants (a
    documented range or unit of each measurement), never computed from the private data, so
    preprocessing spends no privacy. The loss and correctness are ``Classification``'s. Input of
    another rank or width than ``mean`` is refused."""

    capture_refusal = None  # one forward pass over the batch as given

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        mean, std = [float(m) for m in mean], [float(s) for s in std]
        if not mean or len(mean) != len(std):
            raise ValueError(f"give one mean and one std per feature, got {len(mean)} and {len(std)}")
        if not all(np.isfinite(mean)) or not all(np.isfinite(s) and s > 0 for s in std):
            raise ValueError("each feature's mean must be finite and its std positive")
        super().__init__(mean, std, scale=1.0)

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        if np.ndim(raw) != 2 or np.shape(raw)[1] != len(self.mean):
            raise ValueError(f"TabularClassification takes feature vectors (N, {len(self.mean)}), "
                             f"got an array of shape {np.shape(raw)}")
        x = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.float32))
        return (x - torch.tensor(self.mean)) / torch.tensor(self.std)


class VAE(Task):
    """Images -> their reconstruction by a variational autoencoder whose forward takes
    ``(x, noise)`` and returns ``(reconstruction, mu, logvar)``, the latent width being
    ``model.mu.out_features``. Inputs are the pixels in [0, 1], not normalised: the Sigmoid
    output is compared with them. Per-sample loss: reconstruction (binary cross-entropy summed
    over pixels) + KL summed over latent dimensions; the latent noise comes from ``generator``."""

    facts = catalog.VAE
    capture_refusal = "draws its latent noise from the run's loss generator at every step"

    def __init__(self, scale: float = 255.0):
        self.scale = scale

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        return scaled(raw, self.scale)

    def per_sample_loss(self, model, x, y=None, generator=None):
        noise = torch.randn(x.shape[0], model.mu.out_features, generator=generator, device=x.device)
        recon, mu, logvar = model(x, noise)
        rec = F.binary_cross_entropy(recon, x, reduction="none").flatten(1).sum(1)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1)
        return rec + kl, None
