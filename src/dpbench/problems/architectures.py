"""The model families a problem's public start can have, as torch-free tables of their
parameters: what a fine-tuning mode (``dpbench.problems.modes``) selects from and counts.

An ``Architecture`` lists the built model's parameters by name and size, in the model's order
(``named_parameters``), and says where its blocks are, what trains with the last block, which
Linear layers of a block LoRA adapts (with their widths) and whether the head is new (a
classifier's: nothing pretrained to keep). A mode's trained parameter count d is then a sum over
this table, and the same predicate over the built model's parameter names freezes the others, so
the count (the grid's, which sizes a matrix mechanism's noise rows) and the surgery (the run's)
cannot disagree; the tests hold each family's table equal to the model it describes.

Families (``FAMILIES``: name -> a function of the model's dimensions and its head's classes):

* ``transformer-lm``: P4's ``TransformerLM`` (``dpbench.problems.transformer``) as pretrained
  here (P5 with its own language-model head; P6 with a new head of ``classes`` classes).
  ``DEFAULT_DIMS`` restates the class's defaults (tested).
* ``bert-encoder``: a BERT-family encoder of Hugging Face files without its pooler, mean-pooled,
  with a new head (``dpbench.problems.encoders``; P7): ``encoder.embeddings.*`` (word, position
  and token-type embeddings and their LayerNorm; a RoBERTa registers the same parameters with
  its position embeddings last: the dimensions' ``model_type`` orders them by
  ``encoders.EncoderType.embeddings``), ``encoder.encoder.layer.<i>.*`` (post-LN
  blocks: self-attention query/key/value, its output dense and LayerNorm, the intermediate and
  output dense layers and the output LayerNorm), ``head.*``. Its dimensions are config.json's
  (``vocab_size``, ``max_position_embeddings``, ``type_vocab_size``, ``hidden_size``,
  ``num_hidden_layers``, ``intermediate_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# TransformerLM's defaults (P4's model; tests/problems/test_finetune.py checks them against the class)
DEFAULT_DIMS = {"vocab_size": 258, "context": 128, "d_model": 128, "n_layers": 4, "n_heads": 4, "d_mlp": 512}
BERT_DIMS = ("vocab_size", "max_position_embeddings", "type_vocab_size", "hidden_size", "num_hidden_layers",
             "intermediate_size")


@dataclass(frozen=True)
class Architecture:
    """A model's parameters as a table (module docstring). ``parameters``: (name, size) in the
    model's order; ``blocks``: each block's name prefix, in order; ``with_last_block``: the
    prefixes that train with the last block (a final LayerNorm); ``head``: the head's prefix;
    ``adapted``: per block, LoRA's Linear layers as (name within the block, d_in, d_out);
    ``new_head``: the head is new (it trains in every mode)."""

    family: str
    parameters: tuple[tuple[str, int], ...]
    blocks: tuple[str, ...]
    with_last_block: tuple[str, ...]
    head: str
    adapted: tuple[tuple[str, int, int], ...]
    new_head: bool

    @property
    def total(self) -> int:
        return sum(size for _, size in self.parameters)

    def in_head(self, name: str) -> bool:
        return name.startswith(self.head)

    def in_last_block(self, name: str) -> bool:
        return name.startswith((self.blocks[-1], *self.with_last_block, self.head))

    def narrowest_adapted(self) -> tuple[str, int, int]:
        """The adapted layer of least width min(d_in, d_out) (the first of them): LoRA's bound on r."""
        return min(self.adapted, key=lambda a: min(a[1], a[2]))


def _linear(name: str, d_in: int, d_out: int) -> list[tuple[str, int]]:
    return [(f"{name}.weight", d_in * d_out), (f"{name}.bias", d_out)]


def _norm(name: str, d: int) -> list[tuple[str, int]]:
    return [(f"{name}.weight", d), (f"{name}.bias", d)]


def dims_of(model_dims: dict | None) -> dict:
    """A checkpoint's TransformerLM dimensions over the defaults; an unknown key is refused, naming it."""
    unknown = sorted(set(model_dims or {}) - set(DEFAULT_DIMS))
    if unknown:
        raise ValueError(f"model dimension {unknown[0]!r} is not a TransformerLM argument ({', '.join(DEFAULT_DIMS)})")
    return {**DEFAULT_DIMS, **(model_dims or {})}


def transformer_lm(model_dims: dict | None, classes: int | None) -> Architecture:
    """TransformerLM(**model_dims) with its language-model head (``classes`` None) or a new one."""
    dims = dims_of(model_dims)
    V, T, D, n, M = dims["vocab_size"], dims["context"], dims["d_model"], dims["n_layers"], dims["d_mlp"]
    table = [("tok_emb.weight", V * D), ("pos_emb.weight", T * D)]
    for i in range(n):
        b = f"blocks.{i}."
        table += _norm(b + "ln1", D)
        for proj in ("q", "k", "v", "out"):
            table += _linear(b + "attn." + proj, D, D)
        table += _norm(b + "ln2", D) + _linear(b + "mlp.0", D, M) + _linear(b + "mlp.2", M, D)
    table += _norm("ln_f", D) + _linear("head", D, V if classes is None else classes)
    adapted = (("attn.q", D, D), ("attn.k", D, D), ("attn.v", D, D), ("attn.out", D, D), ("mlp.0", D, M),
               ("mlp.2", M, D))
    return Architecture("transformer-lm", tuple(table), tuple(f"blocks.{i}." for i in range(n)), ("ln_f.",),
                        "head.", adapted, classes is not None)


def encoder_dims(facts) -> dict:
    """The ``bert-encoder`` dimensions of an encoder's config facts (``encoders.EncoderFacts``):
    ``BERT_DIMS``, and ``model_type`` where it is not ``bert`` (it orders the embeddings' rows)."""
    dims = {k: getattr(facts, k) for k in BERT_DIMS}
    return dims if facts.model_type == "bert" else {**dims, "model_type": facts.model_type}


def bert_encoder(model_dims: dict, classes: int | None) -> Architecture:
    """A BERT-family encoder of config.json's dimensions (``BERT_DIMS``; ``model_type``, ``bert``
    unless given, one of ``encoders.ENCODER_TYPES``), no pooler, a new head."""
    missing = [k for k in BERT_DIMS if k not in model_dims]
    if missing:
        raise ValueError(f"encoder dimension {missing[0]!r} is missing (a BERT config.json has {', '.join(BERT_DIMS)})")
    if classes is None:
        raise ValueError("a BERT encoder problem classifies: give its classes")
    # imported here: the problems of other families do not depend on the encoders' module (the
    # code fingerprints: dpbench.pipeline.fingerprint.harness_closure)
    from dpbench.problems.encoders import ENCODER_TYPES

    model_type = model_dims.get("model_type", "bert")
    if model_type not in ENCODER_TYPES:
        raise ValueError(f"encoder model_type {model_type!r} is not one of {', '.join(ENCODER_TYPES)}")
    from dpbench.problems.encoders import MAX_DIMS

    for key in BERT_DIMS:  # bounded before the table is built row by row (10^7 layers filled memory)
        if key in MAX_DIMS and model_dims[key] > MAX_DIMS[key]:
            raise ValueError(f"encoder dimension {key} {model_dims[key]} is above {MAX_DIMS[key]}")
    V, P, TV = model_dims["vocab_size"], model_dims["max_position_embeddings"], model_dims["type_vocab_size"]
    H, n, I = model_dims["hidden_size"], model_dims["num_hidden_layers"], model_dims["intermediate_size"]
    e = "encoder.embeddings."
    rows = {"word_embeddings": [(e + "word_embeddings.weight", V * H)],
            "position_embeddings": [(e + "position_embeddings.weight", P * H)],
            "token_type_embeddings": [(e + "token_type_embeddings.weight", TV * H)],
            "LayerNorm": _norm(e + "LayerNorm", H)}
    table = [row for layer in ENCODER_TYPES[model_type].embeddings for row in rows[layer]]
    for i in range(n):
        b = f"encoder.encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            table += _linear(b + "attention.self." + proj, H, H)
        table += _linear(b + "attention.output.dense", H, H) + _norm(b + "attention.output.LayerNorm", H)
        table += _linear(b + "intermediate.dense", H, I) + _linear(b + "output.dense", I, H)
        table += _norm(b + "output.LayerNorm", H)
    table += _linear("head", H, classes)
    adapted = (("attention.self.query", H, H), ("attention.self.key", H, H), ("attention.self.value", H, H),
               ("attention.output.dense", H, H), ("intermediate.dense", H, I), ("output.dense", I, H))
    return Architecture("bert-encoder", tuple(table), tuple(f"encoder.encoder.layer.{i}." for i in range(n)), (),
                        "head.", adapted, True)


FAMILIES: dict[str, Callable[[dict | None, int | None], Architecture]] = {
    "transformer-lm": transformer_lm,
    "bert-encoder": bert_encoder,
}
