"""A fine-tuning model: a problem's transformer loaded from a public checkpoint, with the
parameters its mode trains (``dpbench.problems.modes``: which, how many, and the refusals).

* ``from_checkpoint(problem, checkpoint, mode)``: the problem's model of the checkpoint's
  dimensions (``Problem.build_pretrained``), the checkpoint's parameters loaded into it (every
  one the model has: a classifier drops the checkpoint's language-model head and keeps its own
  new one, initialised from the global RNG, which the harness seeds with the run's init stream),
  then the mode applied (``Mode.apply``).
* ``freeze(model, arch, trains)``: what every mode's ``apply`` does: frozen = ``requires_grad``
  False, so the per-sample engine (``dpbench.privacy.per_sample``), Opacus and every update rule
  see only the trained parameters (``Context.params``), after checking that the model's
  parameters are the architecture's table (the count's source). ``add_adapters``: LoRA's,
  wrapping each adapted Linear in ``LoRALinear``, whose adapters are plain ``nn.Linear`` layers
  (the per-sample rules and Opacus's grad samplers apply to them unchanged).
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

from dpbench.problems.architectures import Architecture, dims_of
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


def freeze(model: nn.Module, arch: Architecture, trains) -> nn.Module:
    """``model`` with the parameters whose names ``trains`` accepts trainable and the others
    frozen; refused if the model's parameters are not ``arch``'s table (names and sizes)."""
    table = [(name, p.numel()) for name, p in model.named_parameters()]
    if table != list(arch.parameters):
        theirs, ours = dict(table), dict(arch.parameters)
        name = next((n for n in [*ours, *theirs] if ours.get(n) != theirs.get(n)), table[0][0] if table else "")
        raise ValueError(f"model parameter {name!r} is not as the {arch.family} table has it "
                         f"(model: {theirs.get(name)}, table: {ours.get(name)})")
    for name, p in model.named_parameters():
        p.requires_grad_(bool(trains(name)))
    return model


def add_adapters(model: nn.Module, arch: Architecture, rank: int, scale: float) -> nn.Module:
    """LoRA's adapters (``LoRALinear``) in place of every block's adapted Linear layers
    (``arch.adapted``), drawn from the global RNG block by block, in the table's order."""
    for prefix in arch.blocks:
        block = model.get_submodule(prefix.rstrip("."))
        for name, _, _ in arch.adapted:
            parent, _, leaf = name.rpartition(".")
            owner = block.get_submodule(parent) if parent else block
            setattr(owner, leaf, LoRALinear(getattr(owner, leaf), rank, scale))
    return model


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
