"""What a fine-tuning mode does to a built model (``dpbench.problems.modes``: ``Mode.apply``):
``freeze`` leaves trainable exactly the parameters a mode's predicate accepts, after checking
that the model's parameters are the architecture's table (names and sizes: the source of the
count d); ``add_adapters`` puts LoRA's adapters (``LoRALinear``) in place of every block's
adapted Linear layers. Frozen = ``requires_grad`` False, so the per-sample engine
(``dpbench.privacy.per_sample``), Opacus and every update rule see only the trained parameters;
the adapters are plain ``nn.Linear`` layers (the per-sample rules and Opacus's grad samplers
apply to them unchanged)."""

from __future__ import annotations

import torch
from torch import nn

from dpbench.problems.architectures import Architecture


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
