"""Fine-tuning modes of a problem that starts from a public checkpoint, without torch: which
parameters a mode trains, their count d (a matrix mechanism's noise rows are d wide, so the grid
sizes a noise file by it), and the refusals of a malformed mode.

The model is P4's ``TransformerLM`` (``dpbench.problems.transformer``) of the checkpoint's
dimensions (``DEFAULT_DIMS`` restates its defaults), with either its own language-model head
(``head=None``: P5) or a new classification head of ``head`` classes in its place (P6). Modes:

* ``full``: every parameter trained (the pretrained ones and the head).
* ``last-block``: the last transformer block, the final LayerNorm and the head; the embeddings
  and the other blocks frozen (DP-AdamW, Chooi et al.: BERT's last block, pooler and head).
* ``lora``: low-rank adapters (Hu et al. 2021, LoRA; DP-LoRA of Yu et al. 2022) on every
  block's attention q, k, v and output projections and both MLP Linear layers: W x + (alpha / r)
  B A x with A (r x d_in) and B (d_out x r), B initialised to zero (the adapted model starts as
  the pretrained one), the pretrained weights frozen. ``LORA_ALPHA`` = 16, a constant in r (Hu
  et al. set alpha to the first r they tried and do not tune it: with Adam, tuning alpha is
  tuning the learning rate), so the scale alpha / r is 1 at the default rank 16 (DiSK's DP-LoRA
  rank). Trainable: the adapters, and a new classification head (which has nothing pretrained to
  keep); a language model's pretrained head stays frozen, as in LoRA for generation (Hu et al.,
  GPT-2; Yu et al.).
* ``bias``: every bias (the Linear layers' and the LayerNorms' beta; embeddings have none) and a
  new classification head whole (BiTFiT, Ben Zaken et al. 2022; DP-BiTFiT, Bu et al. 2022); a
  language model's head trains its bias only.

Refusals (``Finetune``, ``check``), one line naming the key: an unknown mode, a LoRA rank below 1
or above the width of a layer it adapts, a rank given with another mode, a mode for a problem
that starts from no checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("full", "last-block", "lora", "bias")
LORA_ALPHA = 16  # alpha of the scale alpha / r (module docstring)
DEFAULT_LORA_RANK = 16
# TransformerLM's defaults (P4's model; tests/problems/test_finetune.py checks them against the class)
DEFAULT_DIMS = {"vocab_size": 258, "context": 128, "d_model": 128, "n_layers": 4, "n_heads": 4, "d_mlp": 512}


@dataclass(frozen=True)
class Finetune:
    """A fine-tuning mode and, for ``lora``, its rank r (None: ``DEFAULT_LORA_RANK``)."""

    mode: str = "full"
    rank: int | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"finetune mode {self.mode!r} is unknown; choose one of {', '.join(MODES)}")
        if self.rank is not None:
            if self.mode != "lora":
                raise ValueError(f"finetune lora_rank={self.rank!r} is given with mode {self.mode!r}; "
                                 "a rank belongs to mode 'lora' only")
            if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
                raise ValueError(f"finetune lora_rank must be an integer >= 1, got {self.rank!r}")

    @property
    def lora_rank(self) -> int | None:
        """r of mode ``lora`` (the default where none was given); None for the other modes."""
        if self.mode != "lora":
            return None
        return DEFAULT_LORA_RANK if self.rank is None else self.rank

    @property
    def lora_scale(self) -> float | None:
        return None if self.mode != "lora" else LORA_ALPHA / self.lora_rank

    def record(self) -> dict:
        alpha = LORA_ALPHA if self.mode == "lora" else None
        return {"mode": self.mode, "lora_rank": self.lora_rank, "lora_alpha": alpha}


def dims_of(model_dims: dict | None) -> dict:
    """A checkpoint's model dimensions (TransformerLM keyword arguments) over the defaults; an
    unknown key is refused, naming it."""
    unknown = sorted(set(model_dims or {}) - set(DEFAULT_DIMS))
    if unknown:
        raise ValueError(f"model dimension {unknown[0]!r} is not a TransformerLM argument ({', '.join(DEFAULT_DIMS)})")
    return {**DEFAULT_DIMS, **(model_dims or {})}


def adapted_widths(model_dims: dict | None) -> dict[str, tuple[int, int]]:
    """The Linear layers of one block that LoRA adapts: name -> (d_in, d_out)."""
    D, M = dims_of(model_dims)["d_model"], dims_of(model_dims)["d_mlp"]
    return {"attn.q": (D, D), "attn.k": (D, D), "attn.v": (D, D), "attn.out": (D, D), "mlp.0": (D, M), "mlp.2": (M, D)}


def check(finetune: Finetune, model_dims: dict | None = None, *, pretrained: str | None = "given",
          problem: str = "this problem") -> Finetune:
    """``finetune`` if it fits the model and the problem: a LoRA rank above the narrowest
    adapted layer's width is refused, and so is any mode where the problem starts from no
    checkpoint (``pretrained`` None)."""
    if pretrained is None:
        raise ValueError(f"finetune mode {finetune.mode!r}: problem {problem} trains from scratch (no pretrained "
                         "checkpoint); fine-tuning modes apply to problems that start from one (P5, P6)")
    r = finetune.lora_rank
    if r is not None:
        for name, (d_in, d_out) in adapted_widths(model_dims).items():
            if r > min(d_in, d_out):
                raise ValueError(f"finetune lora_rank={r} exceeds the width {min(d_in, d_out)} of layer "
                                 f"blocks.*.{name} ({d_in} -> {d_out})")
    return finetune


def _block(D: int, M: int) -> int:
    return 2 * 2 * D + 4 * (D * D + D) + (D * M + M) + (M * D + D)


def trainable_parameters(model_dims: dict | None, head: int | None, finetune: Finetune | None) -> int:
    """d, the number of trained parameters: of TransformerLM(**model_dims) with its language-model
    head (``head`` None) or with a new head of ``head`` classes, under ``finetune`` (None: the
    whole model, as from scratch). Equal to the built model's count (tests/problems/test_finetune.py)."""
    dims = dims_of(model_dims)
    V, T, D, n, M = dims["vocab_size"], dims["context"], dims["d_model"], dims["n_layers"], dims["d_mlp"]
    outputs = V if head is None else head
    head_weights, head_bias = D * outputs, outputs
    mode = "full" if finetune is None else check(finetune, dims).mode
    if mode == "full":
        return (V + T) * D + n * _block(D, M) + 2 * D + head_weights + head_bias
    if mode == "last-block":
        return _block(D, M) + 2 * D + head_weights + head_bias
    new_head = 0 if head is None else head_weights + head_bias
    if mode == "lora":
        r = finetune.lora_rank
        return n * sum(r * (d_in + d_out) for d_in, d_out in adapted_widths(dims).values()) + new_head
    # bias: per block two LayerNorm betas, four attention biases, the MLP's two; the final LayerNorm's
    return n * (2 * D + 4 * D + M + D) + D + (new_head or head_bias)
