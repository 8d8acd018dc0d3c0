"""P4's data path: the fortunes corpus as token arrays, the canaries a run plants, and the
memorisation it measures after training.

Setting (Gong, Pavliv & Peng, "Evaluating Differentially Private Stochastic Gradient Descent
Optimizers for Training Transformer Language Models"): a small transformer LM trained with and
without DP, tested for memorisation of a planted secret. Here, record-level DP on Debian's
fortunes corpus: one quotation = one example = the privacy unit (``dpbench.data.fortunes``),
bytes as tokens (``tokenizer``: fitted on nothing, so it spends no privacy), the model of
``transformer``.

Splits. The corpus's hash split gives the training records and the held-out records; the
held-out ones are the run's *test* split (never trained on, whatever the seed). A config's
``validation_size`` carves a validation split out of the training records, as for the image
problems, and ``train_subset`` draws a subset of them first.

Canaries (Carlini et al. 2019, arXiv:1802.08232; ``canaries``). Every run plants
``CANARIES_PER_REPEAT`` canaries "the secret code is <s>" for each repetition count k in
``CANARY_REPEATS`` (``dpbench.problems.catalog``, where ``PLANTED`` counts their copies), the
secrets s drawn uniformly from the 10^``DIGITS`` digit strings by the run's "canary" random
stream. A canary with k = 0 is never inserted: its exposure is the baseline of a secret the
model never saw. The k copies of each planted canary are appended to the training split
*after* the subset and the validation split are drawn, so every run trains on them, and they
are part of the N that the accountant's sample rate q = L / N uses: the guarantee covers the
canary records like any other record (k copies of one canary are k records; as a group of k
they are protected at group privacy).

Memorisation (after the last step, on the trained model): per canary its log-perplexity, rank
among all 10^DIGITS candidates (exact enumeration), exposure = log2|R| - log2 rank, and
whether greedy decoding of 50 tokens after the prefix reproduces the secret. DIGITS = 5 keeps
the exact enumeration (11,111 batched forward rows of <= 25 tokens) to seconds on a CPU.

``LanguageModel`` is the task that does all this (preprocessing, loss, canaries, memorisation);
``P4`` the problem's spec, and ``P5`` the same task fine-tuned from a public checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dpbench.data import fortunes
from dpbench.data.dataset import Dataset
import dpbench.problems.canaries as canary_lib
import dpbench.problems.tokenizer as tokenizer
import dpbench.problems.catalog as catalog
from dpbench.problems.spec import Problem
from dpbench.problems.tasks import Task
from dpbench.problems.transformer import TransformerLM, token_losses

CONTEXT = 128  # tokens the model reads; a record is [BOS] + bytes + [EOS], cut to CONTEXT + 1
DIGITS = 5  # |R| = 10^5 candidate secrets


def load(data_dir: str | None = None) -> Dataset:
    """The corpus as token arrays (N, CONTEXT + 1): training records and held-out records
    (the test split); labels are unused zeros (the targets are the next tokens)."""
    corpus = fortunes.load(data_dir)
    train = tokenizer.encode_records(corpus.train, CONTEXT)
    test = tokenizer.encode_records(corpus.validation, CONTEXT)
    return Dataset(fortunes.NAME, train, np.zeros(len(train), np.int64), test, np.zeros(len(test), np.int64),
                   corpus.source)


def make_canaries(seed: int) -> list[canary_lib.Canary]:
    return canary_lib.make_canaries(seed, catalog.CANARY_REPEATS, catalog.CANARIES_PER_REPEAT, DIGITS)


def canary_records(canaries: list[canary_lib.Canary]) -> np.ndarray:
    """The token rows the training split gains: k copies of each canary (k = 0: none)."""
    return tokenizer.encode_records(canary_lib.insert([], canaries), CONTEXT)


def preprocess(tokens: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))


def per_sample_loss(model: nn.Module, x: torch.Tensor, y=None, generator=None):
    """Per-record mean next-token cross-entropy (``transformer.token_losses``), no correctness.
    The batch is cut to its longest record first: padding changes no record's loss or gradient
    (the model is causal and padded targets carry no loss), so this only saves compute."""
    length = int((x != tokenizer.PAD).sum(1).max().item()) if x.shape[0] else 2
    return fixed_shape_loss(model, x[:, :max(length, 2)])


def fixed_shape_loss(model: nn.Module, x: torch.Tensor, y=None, generator=None):
    """``per_sample_loss`` on the batch's full width, uncut: no host sync and a shape that does
    not depend on the data (what a captured step runs; the same losses and gradients)."""
    return token_losses(model(x[:, :-1]), x[:, 1:], tokenizer.PAD), None


@torch.no_grad()
def memorisation(model: nn.Module, canaries: list[canary_lib.Canary], device) -> dict:
    """The trained model's memorisation of the run's canaries (see the module docstring)."""
    was_training = model.training
    model.eval()
    try:
        rows = canary_lib.measure(lambda t: model(t), canaries, method="exact", device=device)
    finally:
        model.train(was_training)
    return {"space_size": 10**DIGITS, "method": "exact", "canaries": rows}


class LanguageModel(Task):
    """Next-token prediction on token records with planted canaries (see the module docstring)."""

    facts = catalog.LANGUAGE_MODEL
    capture_refusal = None  # captured steps run the uncut batch (fixed_shape_loss)

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        return preprocess(raw)

    def per_sample_loss(self, model, x, y=None, generator=None):
        return per_sample_loss(model, x, y, generator)

    def fixed_shape_loss(self, model, x, y=None, generator=None):
        return fixed_shape_loss(model, x, y, generator)

    def make_canaries(self, seed: int) -> list[canary_lib.Canary]:
        return make_canaries(seed)

    def canary_records(self, canaries) -> np.ndarray:
        return canary_records(canaries)

    def memorisation(self, model: nn.Module, canaries, device) -> dict:
        return memorisation(model, canaries, device)


# P4: byte-level transformer LM (876,034 parameters), one fortune = one record; loss = the
# held-out records' mean per-record token cross-entropy (perplexity = exp(loss))
P4 = Problem(catalog.FACTS["P4"], LanguageModel(), TransformerLM, load)
# P5: P4's task (data, canaries, exposure) started from the public checkpoint (the pretraining
# recipe catalog.PRETRAINED) and fine-tuned in a mode of dpbench.problems.modes; build() is its
# from-scratch twin, P4's model.
P5 = Problem(catalog.FACTS["P5"], LanguageModel(), TransformerLM, load,
             build_pretrained=lambda dims: TransformerLM(**dims))
