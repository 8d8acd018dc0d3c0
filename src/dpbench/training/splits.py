"""A run's data: the training, validation and test splits as tensors on its device."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dpbench.problems.catalog import training_examples
from dpbench.training.config import RunConfig


def _subset(n: int, k: int | None, seed: int) -> np.ndarray | None:
    if k is None or k >= n:
        return None
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))



@dataclass
class Splits:
    """The run's data as tensors on its device; the validation split is held out of training."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor | None
    y_val: torch.Tensor | None
    x_test: torch.Tensor
    y_test: torch.Tensor
    source: str
    canaries: list = field(default_factory=list)  # planted in x_train (the task's; P4: dpbench.problems.language)


def load_splits(cfg: RunConfig, problem, seeds: dict[str, int], device) -> Splits:
    """The run's training, validation and test tensors. A problem whose task plants canaries (P4)
    gets them appended to the training split after the subset and validation split are drawn, so
    every run trains on them and they count in N. The training split has N examples as
    ``catalog.training_examples`` counts them, the count the grid keys matrix mechanisms by."""
    ds = problem.load(cfg.data_dir)
    train_idx = _subset(len(ds.y_train), cfg.train_subset, seeds["subset"])
    test_idx = _subset(len(ds.y_test), cfg.test_subset, seeds["subset"] + 1)
    val_idx = None
    if cfg.validation_size:
        pool = np.arange(len(ds.y_train)) if train_idx is None else train_idx
        if cfg.validation_size >= len(pool):
            raise ValueError(f"validation_size {cfg.validation_size} leaves no training examples "
                             f"(of {len(pool)})")
        held_out = np.zeros(len(pool), dtype=bool)
        held_out[np.random.default_rng(seeds["subset"] + 2).choice(len(pool), cfg.validation_size,
                                                                   replace=False)] = True
        train_idx, val_idx = pool[~held_out], pool[held_out]

    def tensors(images, labels, idx):
        if idx is None:
            return problem.preprocess(images).to(device), torch.from_numpy(labels).to(device)
        return problem.preprocess(images[idx]).to(device), torch.from_numpy(labels[idx]).to(device)

    x_train, y_train = tensors(ds.x_train, ds.y_train, train_idx)
    x_val, y_val = tensors(ds.x_train, ds.y_train, val_idx) if val_idx is not None else (None, None)
    x_test, y_test = tensors(ds.x_test, ds.y_test, test_idx)
    canaries = problem.task.make_canaries(seeds["canary"])
    if canaries:
        planted = problem.task.canary_records(canaries)
        x_train = torch.cat([x_train, problem.preprocess(planted).to(device)])
        y_train = torch.cat([y_train, torch.zeros(len(planted), dtype=y_train.dtype, device=device)])
    n_train = training_examples(len(ds.y_train), cfg.train_subset, cfg.validation_size, problem.facts.planted)
    if x_train.shape[0] != n_train:
        raise RuntimeError(f"problem {problem.id}: the training split has {x_train.shape[0]} examples where "
                           f"catalog.training_examples counts {n_train} (its facts' planted: {problem.facts.planted})")
    return Splits(x_train, y_train, x_val, y_val, x_test, y_test, ds.source, canaries)
