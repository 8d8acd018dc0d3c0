"""A fine-tuning model: a problem's transformer loaded from a public checkpoint, with the
parameters its mode trains (``dpbench.problems.modes``: which, how many, and the refusals).

* ``from_checkpoint(problem, checkpoint, finetune)``: the problem's model of the checkpoint's
  dimensions (``Problem.build_pretrained``), the checkpoint's parameters loaded into it (every
  one the model has: a classifier drops the checkpoint's language-model head and keeps its own
  new one, initialised from the global RNG, which the harness seeds with the run's init stream),
  then ``apply_mode``.
* ``apply_mode(model, finetune, new_head)``: frozen = ``requires_grad`` False, so the per-sample
  engine (``dpbench.privacy.per_sample``), Opacus and every update rule see only the trained
  parameters (``Context.params``); LoRA wraps each adapted Linear in ``LoRALinear``, whose
  adapters are plain ``nn.Linear`` layers (the per-sample rules and Opacus's grad samplers
  apply to them unchanged).
* ``start_record``: what a run records about its public start (the checkpoint's file, SHA-256
  and recipe; pretraining read public data only and spent no privacy) and its mode.

A checkpoint is any object with ``state_dict`` (a TransformerLM state dict) and ``model_dims``
(TransformerLM keyword arguments); ``path``, ``sha256`` and ``recipe`` are recorded where it has
them, as ``PublicCheckpoint`` (what ``dpbench train --pretrained`` loads) has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dpbench.problems import modes
from dpbench.problems.modes import Finetune
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


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))`` (Hu et al. 2021): ``base`` the pretrained Linear (frozen),
    A = ``lora_a`` (d_in -> r) initialised as an ``nn.Linear`` is (Kaiming-uniform, from the
    global RNG), B = ``lora_b`` (r -> d_out) zero, so the adapted layer starts as the
    pretrained one; scale = alpha / r."""

    per_sample_forward = True  # a sum of three Linear layers' outputs, sample by sample

    def __init__(self, base: nn.Linear, rank: int, scale: float):
        super().__init__()
        if not 1 <= rank <= min(base.in_features, base.out_features):
            raise ValueError(f"finetune lora_rank={rank} must be between 1 and the layer's width "
                             f"{min(base.in_features, base.out_features)}")
        self.base, self.scale = base, scale
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device,
                                dtype=base.weight.dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device,
                                dtype=base.weight.dtype)
        nn.init.zeros_(self.lora_b.weight)
        base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale


def _adapted(block: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers of a block that LoRA adapts (``modes.adapted_widths``'s names)."""
    return {name: block.get_submodule(name) for name in modes.adapted_widths(None)}


def apply_mode(model: nn.Module, finetune: Finetune, new_head: bool) -> nn.Module:
    """``model`` (a TransformerLM, or a model with its ``blocks``, ``ln_f`` and ``head``) with
    the parameters of ``finetune``'s mode trainable and the others frozen; LoRA's adapters are
    added in place (drawn from the global RNG, block by block). ``new_head``: the head is new (a
    classifier's), so it trains whole in every mode."""
    modes.check(finetune, {"d_model": model.ln_f.normalized_shape[0],
                           "d_mlp": model.blocks[0].mlp[0].out_features})
    mode = finetune.mode
    model.requires_grad_(mode == "full")
    if mode == "last-block":
        for module in (model.blocks[-1], model.ln_f, model.head):
            module.requires_grad_(True)
    elif mode == "lora":
        for block in model.blocks:
            for name, linear in _adapted(block).items():
                parent, _, leaf = name.rpartition(".")
                setattr(block.get_submodule(parent), leaf, LoRALinear(linear, finetune.lora_rank, finetune.lora_scale))
    elif mode == "bias":
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[-1] == "bias":
                p.requires_grad_(True)
    if new_head:
        model.head.requires_grad_(True)
    return model


def from_checkpoint(problem: Problem, checkpoint, finetune: Finetune | None) -> nn.Module:
    """The problem's model from ``checkpoint`` under ``finetune`` (None: ``full``). A classifier
    (its facts name classes) keeps its own new head, initialised from the global RNG, in place of
    the checkpoint's language-model head; every other parameter comes from the checkpoint, which
    must hold exactly the model's (refused otherwise, naming the first that differs)."""
    finetune = finetune or Finetune()
    if problem.facts.pretrained is None or problem.build_pretrained is None:
        modes.check(finetune, pretrained=None, problem=problem.id)
    dims = modes.dims_of(checkpoint.model_dims)
    modes.check(finetune, dims)
    model = problem.build_pretrained(dims)
    new_head = problem.facts.classes is not None
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
    return apply_mode(model, finetune, new_head)


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def start_record(checkpoint, finetune: Finetune | None, model: nn.Module) -> dict:
    """The run's record of its start: public (a checkpoint pretrained without privacy on public
    text: it spent none of the run's budget) or from scratch (``checkpoint`` None), the mode and
    the trained parameter count (d: the matrix mechanisms' noise width)."""
    trained, total = trainable_count(model), sum(p.numel() for p in model.parameters())
    if checkpoint is None:
        return {"kind": "scratch", "checkpoint": None, "checkpoint_sha256": None, "recipe": None,
                "pretraining_epsilon": None, "mode": None, "lora_rank": None, "lora_alpha": None,
                "trainable_parameters": trained, "parameters": total}
    recipe = getattr(checkpoint, "recipe", None)
    path = getattr(checkpoint, "path", None)
    return {
        "kind": "public checkpoint",
        "checkpoint": None if path is None else str(path),
        "checkpoint_sha256": getattr(checkpoint, "sha256", None),
        "recipe": recipe,
        # pretraining read only public text (no private record): it spends no privacy
        "pretraining_epsilon": 0.0,
        "model_dims": modes.dims_of(checkpoint.model_dims),
        **(finetune or Finetune()).record(),
        "trainable_parameters": trained,
        "parameters": total,
        "trainable_share": trained / total if total else math.nan,
    }
