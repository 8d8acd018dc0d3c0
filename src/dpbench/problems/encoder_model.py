"""A public BERT-family encoder (a BERT or a RoBERTa: ``encoders.ENCODER_TYPES``) as a
classifier: loaded with ``transformers`` from local files only, pooled as it was trained to
pool, with a new linear head; its layers declared to the per-sample engine.

* ``load_encoder(directory)``: the directory checked (``encoders.check_directory``), then its
  type's model class (``BertModel``, ``RobertaModel``) and its tokenizer read from it with
  ``local_files_only=True``, the hub switched
  off in-process (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``) before transformers is
  imported, the weights from safetensors only (``use_safetensors=True``), without the pooler
  (``add_pooling_layer=False``: it would hold parameters that get no gradient) and without
  dropout (below). A weight the model needs and the file lacks is refused (transformers would
  initialise it at random).
* ``EncoderClassifier``: tokens (B, T), right-padded with the tokenizer's pad id -> the
  encoder with the attention mask derived from them and the position and token type ids passed
  explicitly with the batch's shape (Opacus's hooks and ghost clipping see (1, T) position ids
  otherwise: Opacus issue #841): positions 0..T-1 for a BERT, pad_id + 1 .. pad_id + T for a
  RoBERTa (a real token's position is transformers' own; a pad's is masked out) -> pooled
  (``encoders.pooling``) -> ``head``, a new ``nn.Linear(hidden, classes)``. ``features(tokens)``
  is the pooled vector, which a frozen encoder's runs may compute once per record.
* ``check_encoder(model)``: the per-sample engine's checks on the whole model (every trainable
  layer of a registered type; no module that may mix samples), run before any data is read.

Dropout: none. The config's dropout (0.1 for all-MiniLM-L6-v2) is set to 0 when the model is
built, for training and evaluation alike. With dropout a forward pass is random: a run would
need one more seeded stream, and its trained model would depend on the order in which kernels
draw random numbers; DiSK's two gradient evaluations at one step would see two different
networks; and the Gaussian noise of DP training already regularises. With dropout off, a run
is a deterministic function of its seeds, and training and evaluation compute one function.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dpbench.privacy.per_sample import check_per_sample, declare_per_sample, trainable_layers
from dpbench.problems.encoders import (ENCODER_TYPES, SAFETENSORS, EncoderError, EncoderFacts, EncoderType,
                                       Pooling, check_directory, config_facts, pooling, weight_tensors)

# hidden_act activations (transformers.activations): elementwise functions
_ACTIVATIONS = ("GELUActivation", "NewGELUActivation", "FastGELUActivation", "QuickGELUActivation", "GELUTanh")


def _transformers():
    """transformers, imported with the hub switched off: nothing at run time is downloaded."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import transformers
    from transformers import activations

    # transformers' load report lists the pooler's weights as unused (we build without it) and its
    # progress bars write to stderr; what matters (a missing weight) load_encoder refuses itself
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for kind in ENCODER_TYPES.values():  # each type's classes, read per-sample (encoders.ENCODER_TYPES)
        modeling = importlib.import_module(kind.module)
        for name, buffers in kind.per_sample.items():
            declare_per_sample(getattr(modeling, name), buffers)
    for name in _ACTIVATIONS:
        if hasattr(activations, name):
            declare_per_sample(getattr(activations, name))
    return transformers


@dataclass
class LoadedEncoder:
    """An encoder read from ``directory``: ``model`` (its type's model class without pooler, in
    eval mode, no dropout), ``tokenizer``, ``pooling``, ``facts`` (config.json's dimensions)."""

    directory: Path
    model: nn.Module = field(repr=False)
    tokenizer: object = field(repr=False)
    pooling: Pooling
    facts: EncoderFacts

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)


def load_encoder(directory: str | Path) -> LoadedEncoder:
    """The encoder in ``directory`` (checked by ``encoders.check_directory``; a catalogued one
    is verified by ``encoders.locate`` first), read from local files only."""
    root = check_directory(directory)
    facts = config_facts(root)
    how = pooling(root)
    transformers = _transformers()
    model_class = getattr(importlib.import_module(facts.encoder_type.module), facts.encoder_type.model_class)
    weights = next(root / name for name in SAFETENSORS if (root / name).is_file())
    _check_activation(root, transformers)
    _check_shapes(root, model_class)
    try:
        # dtype float32 whatever config.json's torch_dtype says: half-precision weights (F16, BF16) are
        # cast to float32 deliberately (exactly), so that every run computes in float32 (docs/encoders.md)
        model, info = model_class.from_pretrained(
            root, local_files_only=True, use_safetensors=True, add_pooling_layer=False, output_loading_info=True,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager",
            dtype=torch.float32)
    except Exception as exc:  # safetensors' and transformers' own errors: a damaged file, named
        first = (str(exc).strip().splitlines() or [""])[0]
        raise EncoderError(f"{weights}: not readable weights ({type(exc).__name__}: {first})") from None
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():  # a start of NaN or infinite weights would train nothing real
            raise EncoderError(f"{weights}: parameter {name} holds non-finite values")
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise EncoderError(f"{root}: the weights lack {len(missing)} of the model's parameters "
                           f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(root, local_files_only=True)
    except Exception as exc:  # a damaged tokenizer file: the files it is read from, named
        first = (str(exc).strip().splitlines() or [""])[0]
        files = tokenizer_files(root, facts)
        others = ", ".join(files[1:]) or "no other file"
        raise EncoderError(f"{root / files[0]}: not a readable tokenizer (with {others}; {type(exc).__name__}: "
                           f"{first})") from None
    if tokenizer.pad_token_id is None:
        raise EncoderError(f"{root}: the tokenizer has no pad token")
    vocabulary = tokenizer.get_vocab()
    if not vocabulary:
        raise EncoderError(f"{root / tokenizer_files(root, facts)[0]}: the tokenizer has no token")
    largest = max(vocabulary.values())
    if largest >= facts.vocab_size:  # its ids index the embedding table: one past it is an IndexError mid-run
        token = next(t for t, i in vocabulary.items() if i == largest)
        raise EncoderError(f"{root / tokenizer_files(root, facts)[0]}: token {token!r} has id {largest}, past "
                           f"config.json's vocab_size {facts.vocab_size} (the embedding table's rows)")
    if facts.encoder_type.positions_after_pad and tokenizer.pad_token_id != facts.pad_token_id:
        raise EncoderError(f"{root}: the tokenizer's pad id {tokenizer.pad_token_id} is not config.json's "
                           f"pad_token_id {facts.pad_token_id}, after which a {facts.model_type} numbers positions")
    if tokenizer.padding_side != "right":
        tokenizer.padding_side = "right"
    model.eval()
    return LoadedEncoder(root, model, tokenizer, how, facts)


def tokenizer_files(root: Path, facts: EncoderFacts) -> list[str]:
    """The tokenizer files of ``root`` that its type reads, in its groups' order."""
    return [name for group in facts.encoder_type.tokenizers for name in group if (root / name).is_file()]


def _check_activation(root: Path, transformers) -> None:
    """config.json's hidden_act, one of transformers' activations (a bogus one is a KeyError while
    the model is built, which named no file)."""
    from transformers.activations import ACT2CLS

    config = root / "config.json"
    act = json.loads(config.read_text()).get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in ACT2CLS:
        raise EncoderError(f"{config}: hidden_act {act!r} is not one of transformers' activations "
                           f"({', '.join(sorted(ACT2CLS))})")


def _check_shapes(root: Path, model_class) -> None:
    """Every weight in the safetensors files of the shape the model of config.json has there, read
    from the files' headers against the model built on the meta device (nothing allocated); a
    mismatch is one line naming the file, the parameter and both shapes."""
    from dpbench.problems.encoders import start_files

    config = model_class.config_class.from_pretrained(root, local_files_only=True)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in model_class(config, add_pooling_layer=False).state_dict().items()}
    prefix = f"{model_class.base_model_prefix}."
    for name in start_files(root):
        if not name.endswith(".safetensors"):
            continue
        for key, (_, shape) in weight_tensors(root / name).items():
            key = key[len(prefix):] if key.startswith(prefix) else key
            if key in expected and shape != expected[key]:
                raise EncoderError(f"{root / name}: parameter {key} has shape {list(shape)}, the model of "
                                   f"config.json has {list(expected[key])}")


def encode(tokenizer, texts: list[str], max_length: int, pairs: list[str] | None = None) -> torch.Tensor:
    """Token ids (N, T) of ``texts`` ([CLS] ... [SEP]; with ``pairs``, [CLS] a [SEP] b [SEP], the
    longer text cut first), truncated to ``max_length``, right-padded with the pad id to the
    longest of them."""
    extra = () if pairs is None else (list(pairs),)
    batch = tokenizer(list(texts), *extra, padding="longest", truncation=True, max_length=max_length,
                      return_attention_mask=False, return_token_type_ids=False, return_tensors="pt")
    return batch["input_ids"]


class EncoderClassifier(nn.Module):
    """``head(pool(encoder(tokens)))``: ``encoder`` a BertModel or RobertaModel without pooler
    (its config's model_type one of ``encoders.ENCODER_TYPES``), ``head`` a new
    ``nn.Linear(hidden, classes)`` (initialised from the global RNG, as every new head is)."""

    per_sample_forward = True  # masks, ids and pooling are computed record by record

    def __init__(self, encoder: nn.Module, how: Pooling, classes: int, pad_id: int):
        super().__init__()
        _transformers()  # the encoder types' classes declared per-sample
        self.encoder = encoder
        self.pooling = how
        self.pad_id = pad_id
        kind: EncoderType = ENCODER_TYPES[encoder.config.model_type]
        # the first token's position id: 0 (BERT), the embeddings' padding_idx + 1 (RoBERTa)
        self.first_position = kind.first_position(encoder.config.pad_token_id)
        self.head = nn.Linear(encoder.config.hidden_size, classes)

    @classmethod
    def from_loaded(cls, loaded: LoadedEncoder, classes: int) -> "EncoderClassifier":
        return cls(loaded.model, loaded.pooling, classes, loaded.pad_id)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """The pooled (and, where the model was trained so, L2-normalised) vector of each record, (B, hidden)."""
        B, T = tokens.shape
        mask = tokens != self.pad_id
        # ids with the batch's own shape (B, T): per-sample hooks see B records in every layer (Opacus #841);
        # a real token's position is transformers' own (right padding), a pad's is masked out
        first = self.first_position
        positions = torch.arange(first, first + T, device=tokens.device).expand(B, T).contiguous()  # Opacus views it
        token_types = torch.zeros_like(tokens)
        hidden = self.encoder(input_ids=tokens, attention_mask=mask.long(), position_ids=positions,
                              token_type_ids=token_types).last_hidden_state
        return self.pool(hidden, mask)

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden states (B, T, H) pooled over each record's tokens (``mask``)."""
        if self.pooling.mode == "cls":
            pooled = hidden[:, 0]
        else:  # mean over the record's tokens (sentence-transformers' clamp against an empty record)
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1) if self.pooling.normalize else pooled

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(tokens))


def check_encoder(model: nn.Module) -> None:
    """Refuses, in one line naming it, a layer the per-sample machinery does not support: a
    trainable layer of an unregistered type, or a module that may mix samples (unknown types,
    buffers of statistics). A run calls it once its mode is applied, before reading data."""
    _transformers()
    trainable_layers(model)
    check_per_sample(model)


__all__ = ["ENCODER_TYPES", "EncoderClassifier", "LoadedEncoder", "check_encoder", "encode", "load_encoder"]
