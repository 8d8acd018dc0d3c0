"""A problem spec: everything dpbench needs to train and evaluate on a problem, as one frozen
object. A built-in problem's spec is a module-level ``Problem`` (``dpbench.problems.images``,
``dpbench.problems.language``) listed in ``dpbench.problems.registry``; a plugin's is the object
its ``dpbench.problems`` entry point names, found by ``dpbench.plugins``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from dpbench.data.dataset import Dataset
from dpbench.problems.catalog import ProblemFacts
from dpbench.problems.tasks import Task


@dataclass(frozen=True)
class Problem:
    """``facts``: its torch-free facts (id, dataset, task name, sizes, parameter count, cost
    constants); ``task``: the task object that preprocesses, computes per-sample losses and plants
    canaries; ``build()``: a new model, its parameters initialised from the global torch RNG
    (the harness seeds it); ``load(data_dir)``: the dataset, train and test splits in a fixed
    order, from verified files (``data_dir`` may be None: the problem's own default places);
    ``build_pretrained(model_dims)``, for a problem that starts from a public checkpoint
    (``facts.pretrained``): its model of the checkpoint's dimensions, to be loaded from it
    (``dpbench.problems.finetune.from_checkpoint``); ``build()`` is then its from-scratch twin."""

    facts: ProblemFacts
    task: Task
    build: Callable[[], nn.Module]
    load: Callable[[str | None], Dataset]
    build_pretrained: Callable[[dict], nn.Module] | None = None

    @property
    def id(self) -> str:
        return self.facts.id

    @property
    def dataset(self) -> str:
        return self.facts.dataset

    @property
    def metric(self) -> str:
        return self.facts.metric

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        """Raw arrays of the dataset (images as integers, P4's token ids) -> model inputs."""
        return self.task.preprocess(raw)

    def per_sample_loss(self, model: nn.Module, x, y, generator: torch.Generator | None = None):
        """``(losses, correct)``: per-sample losses (B,) and correctness (B,) or None."""
        return self.task.per_sample_loss(model, x, y, generator)
