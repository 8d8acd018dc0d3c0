"""A run's settings: ``RunConfig`` (one grid cell, validated against its optimizer's spec) and
the torch device it names (``resolve_device``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dpbench.optimizers.spec import OptimizerSpec
from dpbench.privacy import accounting
from dpbench.problems import get_problem


@dataclass(frozen=True)
class RunConfig:
    problem: str
    optimizer: str
    lr: float
    batch_size: int  # expected batch size L; sample rate q = L / N
    epochs: int  # E; T = round(E * N / L)
    seed: int
    epsilon: float | None = None  # target epsilon (private optimizers); not with noise_multiplier
    noise_multiplier: float | None = None  # use this sigma instead of calibrating; not with epsilon
    delta: float = accounting.DELTA
    clip_norm: float = 1.0
    normalize_clipping: bool = True
    accountant: str = accounting.DEFAULT_ACCOUNTANT
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    max_steps: int | None = None
    train_subset: int | None = None
    test_subset: int | None = None
    validation_size: int = 0  # examples held out of the training set for model selection
    # a candidate of a hyperparameter search (training.tuning): distribution, mean, shape,
    # repetitions (K), candidate; sigma is then calibrated for the whole search
    tuning: dict[str, Any] | None = None
    data_dir: str | None = None
    # matrix mechanisms: the factorization and noise files (computed into cache_dir if absent)
    factorization: str | None = None
    noise_file: str | None = None
    cache_dir: str | None = None
    device: str = "auto"
    eval_batch_size: int = 1000
    progress_every_s: float = 10.0
    # replay each step as a CUDA graph on Poisson batches padded to a few sizes (training.capture);
    # off until measured on a GPU; a no-op, with a message, on a CPU
    cuda_graphs: bool = False

    def validate(self, spec: OptimizerSpec) -> None:
        """Raises ValueError naming the first bad setting; ``spec`` is this run's optimizer."""
        if spec.name != self.optimizer:
            raise ValueError(f"optimizer {self.optimizer!r} was given the spec of {spec.name!r}")
        get_problem(self.problem)
        for name in ("lr", "batch_size", "epochs", "clip_norm") + (("epsilon",) if self.epsilon is not None else ()):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be positive and finite, got {getattr(self, name)}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if self.noise_multiplier is not None and self.epsilon is not None:
            # sigma given is used as is: the run would carry a target it may not meet
            raise ValueError("give --epsilon (sigma calibrated to it) or --noise-multiplier (epsilon accounted "
                             "for it), not both")
        if spec.private and self.noise_multiplier is None and self.epsilon is None:
            raise ValueError(f"optimizer {self.optimizer!r} is private: give --epsilon or --noise-multiplier")
        if self.noise_multiplier is not None and not 0 <= self.noise_multiplier < math.inf:
            raise ValueError(f"noise_multiplier must be >= 0 and finite, got {self.noise_multiplier}")
        if self.validation_size < 0:
            raise ValueError(f"validation_size must be >= 0, got {self.validation_size}")
        spec.hyperparameters(self.hyperparameters)
        if self.tuning is not None:  # refused as the config check refuses it, in the same words
            from dpbench.training.tuning import check_search

            try:
                check_search(self.tuning, spec, self.validation_size)
            except ValueError as exc:
                raise ValueError(f"tuning: {exc}") from None



def resolve_device(device: str) -> torch.device:
    """The torch device of ``device`` (auto: the GPU where there is one); a CUDA device this
    machine does not have is an error saying so (not a failure after the data is loaded)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
            raise ValueError(f"{device}: no CUDA GPU is available (torch {torch.__version__}, built {build}); "
                             "use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev
