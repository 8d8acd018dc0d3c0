"""P6: a fortunes record's file (its category) from its text, by a classification head on the
transformer pretrained on public text (Li et al. 2022; the DP-AdamW and DiSK papers fine-tune
text classifiers the same way).

Data. P4's records and hash split (``dpbench.data.fortunes``: one record = one example = the
privacy unit), each labelled with the file it came from. The classes are public facts, not
counted from the records: the files of the fortunes package of the version the checksums pin
(``dpbench.problems.catalog.FORTUNE_FILES``, class c the c-th name). A text that occurs in two
files is two records, each with its own file (``dpbench.data.fortunes``: a per-record rule, so
the guarantee stays per record; such a text's two test records cannot both be right). Tokens
are P4's bytes, ``[BOS] + bytes + [EOS]`` cut to ``CONTEXT`` positions, right-padded with PAD.

Model (``TransformerClassifier``): P4's TransformerLM body (embeddings, blocks, final
LayerNorm) and a new Linear head from the mean of the final LayerNorm's outputs over the
record's real (non-PAD) tokens to one logit per class. Per sample: the pooling averages over one
record's own positions, never across records; the body is causal, so a record's real positions
never see its padding, and a batch cut to its longest record (``per_sample_loss``) gives every
record the same logits as the full width. Loss: per-record cross-entropy; accuracy reported.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import dpbench.problems.catalog as catalog
import dpbench.problems.tokenizer as tokenizer
from dpbench.data import fortunes
from dpbench.data.dataset import DataError, Dataset
from dpbench.problems.language import CONTEXT, preprocess
from dpbench.problems.spec import Problem
from dpbench.problems.tasks import Task
from dpbench.problems.transformer import TransformerLM

CLASSES = catalog.FORTUNE_FILES


class TransformerClassifier(TransformerLM):
    """Tokens (B, T) -> class logits (B, classes): the mean of ``hidden`` over the real tokens,
    then ``head`` (a Linear of ``classes`` outputs in place of the language model's)."""

    per_sample_forward = True  # the pooling averages each sample's own positions (module docstring)

    def __init__(self, classes: int = len(CLASSES), **dims):
        super().__init__(**dims)
        self.head = torch.nn.Linear(self.ln_f.normalized_shape[0], classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        real = (tokens != tokenizer.PAD).unsqueeze(-1).to(self.ln_f.weight.dtype)  # (B, T, 1)
        pooled = (self.hidden(tokens) * real).sum(1) / real.sum(1).clamp(min=1)
        return self.head(pooled)


def labels(files) -> np.ndarray:
    """Class indices of the records' files; a file that is not one of the classes is refused."""
    index = {name: c for c, name in enumerate(CLASSES)}
    unknown = sorted(set(files) - set(index))
    if unknown:
        raise DataError(f"fortunes file {unknown[0]!r} is not one of P6's classes (the files of fortunes "
                        f"{catalog.FORTUNES_VERSION}: {', '.join(CLASSES)})")
    return np.array([index[f] for f in files], dtype=np.int64)


def load(data_dir: str | None = None) -> Dataset:
    """P4's records and split as token rows (N, CONTEXT), labelled with their files' classes."""
    corpus = fortunes.load(data_dir)
    return Dataset(fortunes.NAME, tokenizer.encode_records(corpus.train, CONTEXT - 1), labels(corpus.train_files),
                   tokenizer.encode_records(corpus.validation, CONTEXT - 1), labels(corpus.validation_files),
                   corpus.source)


def fixed_shape_loss(model, x, y, generator=None):
    logits = model(x)
    return F.cross_entropy(logits, y, reduction="none"), logits.argmax(1) == y


class TextClassification(Task):
    """Token records -> class labels: per-record cross-entropy, accuracy."""

    facts = catalog.CLASSIFICATION
    capture_refusal = None  # captured steps run the uncut batch (fixed_shape_loss)

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        return preprocess(raw)

    def per_sample_loss(self, model, x, y, generator=None):
        """The batch cut to its longest record first (the same logits: module docstring)."""
        length = int((x != tokenizer.PAD).sum(1).max().item()) if x.shape[0] else 1
        return fixed_shape_loss(model, x[:, :max(length, 1)], y)

    def fixed_shape_loss(self, model, x, y, generator=None):
        return fixed_shape_loss(model, x, y)


# P6: the fortunes file of a record, 40 classes; build() the from-scratch twin (847,912 parameters)
P6 = Problem(catalog.FACTS["P6"], TextClassification(), TransformerClassifier, load,
             build_pretrained=lambda dims: TransformerClassifier(len(CLASSES), **dims))
