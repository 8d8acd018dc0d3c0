"""A fine-tuning model: a problem's transformer loaded from a public checkpoint, with the
parameters its mode trains (``dpbench.problems.modes``: which, how many, and the refusals).

* ``from_checkpoint(problem, checkpoint, mode)``: the problem's model of the checkpoint's
  dimensions (``Problem.build_pretrained``), the checkpoint's parameters loaded into it (every
  one the model has: a classifier drops the checkpoint's language-model head and keeps its own
  new one, initialised from the global RNG, which the harness seeds with the run's init stream),
  then the mode applied (``Mode.apply``).
* ``from_public(problem, start, mode)``: a start that builds its own model (an encoder,
  ``dpbench.problems.encoder_classification``), else ``from_checkpoint``. What a mode does to
  the built model (freezing, LoRA's adapters) is ``dpbench.problems.surgery``.
* ``start_record``: what a run records about its public start (the checkpoint's file, SHA-256
  and recipe; pretraining read public data only and spent no privacy) and its mode.

A checkpoint is any object with ``state_dict`` (a TransformerLM state dict) and ``model_dims``
(TransformerLM keyword arguments); ``path``, ``sha256`` and ``recipe`` are recorded where it has
them, as ``PublicCheckpoint`` (what ``dpbench train --pretrained`` loads) has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from dpbench.problems.architectures import dims_of
from dpbench.problems.surgery import LoRALinear, add_adapters, freeze  # noqa: F401 (the modes' surgery)

if TYPE_CHECKING:
    from dpbench.problems.spec import Problem


@dataclass(frozen=True)
class PublicCheckpoint:
    """A verified public checkpoint as a run starts from it: its weights and model dimensions,
    the file it was read from, its SHA-256 (the sidecar's, checked against the bytes) and the
    name of the recipe that made it; ``record``: the whole sidecar."""

    state_dict: dict = field(repr=False)
    model_dims: dict
    path: str
    sha256: str
    recipe: str | None
    record: dict = field(default_factory=dict, repr=False)


def from_checkpoint(problem: Problem, checkpoint, mode) -> nn.Module:
    """The problem's model from ``checkpoint`` under ``mode`` (a ``dpbench.problems.modes.Mode``). A classifier
    (its facts name classes) keeps its own new head, initialised from the global RNG, in place of
    the checkpoint's language-model head; every other parameter comes from the checkpoint, which
    must hold exactly the model's (refused otherwise, naming the first that differs)."""
    if problem.facts.pretrained is None or problem.build_pretrained is None:
        raise ValueError(f"finetune mode {mode.name!r}: problem {problem.id} trains from scratch (no pretrained "
                         "checkpoint); fine-tuning modes apply to problems that start from one")
    dims = dims_of(checkpoint.model_dims)
    arch = problem.facts.architecture(dims)
    mode.check(arch)
    model = problem.build_pretrained(dims)
    new_head = arch.new_head
    kept = lambda key: not (new_head and key.startswith("head."))  # noqa: E731
    state = {k: v for k, v in checkpoint.state_dict.items() if kept(k)}
    own = {k: v for k, v in model.state_dict().items() if kept(k)}
    for key in sorted(set(own) ^ set(state)):
        raise ValueError(f"checkpoint parameter {key!r} is {'missing' if key in own else 'not in the model'}: "
                         f"the checkpoint is not a TransformerLM of dims {dims}")
    for key, value in own.items():
        if tuple(state[key].shape) != tuple(value.shape):
            raise ValueError(f"checkpoint parameter {key!r} has shape {tuple(state[key].shape)}, "
                             f"the model's is {tuple(value.shape)}")
    model.load_state_dict(state, strict=not new_head)
    return mode.apply(model, arch)


def from_public(problem: Problem, start, mode) -> nn.Module:
    """The problem's model from a loaded public start under ``mode``: a start that builds its
    own model (``build_model(problem, mode)``: an encoder, ``dpbench.problems.encoders``), else a
    pretrained checkpoint's weights (``from_checkpoint``)."""
    build = getattr(start, "build_model", None)
    return build(problem, mode) if build is not None else from_checkpoint(problem, start, mode)


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def start_record(checkpoint, mode, model: nn.Module) -> dict:
    """The run's record of its start: public (a checkpoint pretrained without privacy on public
    text: it spent none of the run's budget) or from scratch (``checkpoint`` None), the mode and
    the trained parameter count (d: the matrix mechanisms' noise width). ``checkpoint`` may add
    its own facts (``start_facts``: an encoder's directory and file hashes)."""
    trained, total = trainable_count(model), sum(p.numel() for p in model.parameters())
    if checkpoint is None:
        return {"kind": "scratch", "checkpoint": None, "checkpoint_sha256": None, "recipe": None,
                "pretraining_epsilon": None, "mode": None, "lora_rank": None, "lora_alpha": None,
                "trainable_parameters": trained, "parameters": total}
    recipe = getattr(checkpoint, "recipe", None)
    path = getattr(checkpoint, "path", None)
    facts = checkpoint.start_facts() if hasattr(checkpoint, "start_facts") else {
        "model_dims": dims_of(checkpoint.model_dims)}
    return {
        "kind": "public checkpoint",
        "checkpoint": None if path is None else str(path),
        "checkpoint_sha256": getattr(checkpoint, "sha256", None),
        "recipe": recipe,
        # pretraining read only public text (no private record): it spends no privacy
        "pretraining_epsilon": 0.0,
        **facts,
        **mode.record(),
        "trainable_parameters": trained,
        "parameters": total,
        "trainable_share": trained / total if total else math.nan,
    }
