"""A fixed byte-level tokenizer for the private language model (P4).

Tokens are the bytes of the UTF-8 encoding of the text: ids 0-255 are the byte values, then
two special tokens,

* ``PAD = 256``: right-padding of a record to the batch's fixed length (never a target),
* ``BOUNDARY = 257``: the record boundary, used both as beginning (``BOS``) and end
  (``EOS``) of sequence; one token suffices since a boundary ends one record and starts the
  next,

so ``VOCAB_SIZE = 258``. Every string has exactly one encoding and ``decode(encode(t)) == t``.

Why fixed and byte-level (the privacy argument). The vocabulary is a constant of this module: it
is fitted on nothing, so building it reads no private record and spends no privacy budget, and
the DP guarantee of training covers everything the released model depends on. A vocabulary built
from the training text, as the word-level tokenizer of Gong, Pavliv & Peng ("Evaluating
Differentially Private SGD Optimizers for Training Transformer Language Models") is, is itself a
non-private release: a word is in the vocabulary exactly when some training record contains it
(or contains it often enough to pass a frequency threshold), so the vocabulary (and the shape of
the embedding matrix it indexes) reveals whether a rare word, a name, or a canary's secret
occurs in the data, with certainty and with no noise; no accounting of the optimizer can make up
for that. A byte vocabulary has no such channel, at the price of longer sequences (one token per
byte).

Sequences for training: ``encode_records`` turns each record into ``[BOS] + bytes + [EOS]``,
truncated to ``context + 1`` tokens and right-padded with ``PAD``; the model reads
``tokens[:, :-1]`` (``context`` positions) and predicts ``tokens[:, 1:]``, with the loss masked
where the target is ``PAD``. A record fits without truncation iff its UTF-8 length is at most
``context - 1`` bytes (``sequence_length(text) <= context + 1``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

BYTES = 256
PAD = 256
BOUNDARY = 257
BOS = BOUNDARY
EOS = BOUNDARY
VOCAB_SIZE = 258


def encode(text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` as token ids (no special tokens)."""
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """The text of the byte tokens in ``ids``; PAD and BOUNDARY are dropped, and byte
    sequences that are not valid UTF-8 (e.g. a generation cut mid-character) become U+FFFD."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
    if bad:
        raise ValueError(f"token ids outside 0..{VOCAB_SIZE - 1}: {bad[:5]}")
    return bytes(i for i in ids if i < BYTES).decode("utf-8", errors="replace")


def sequence_length(text: str) -> int:
    """Untruncated length of ``[BOS] + bytes + [EOS]`` for one record."""
    return len(text.encode("utf-8")) + 2


def encode_records(texts: Sequence[str], context: int) -> np.ndarray:
    """int64 (N, context + 1): ``[BOS] + bytes + [EOS]`` per record, truncated to
    ``context + 1`` tokens (a truncated record loses its tail, EOS included), right-padded
    with PAD."""
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    out = np.full((len(texts), context + 1), PAD, dtype=np.int64)
    for row, text in enumerate(texts):
        seq = [BOS, *text.encode("utf-8"), EOS][: context + 1]
        out[row, : len(seq)] = seq
    return out
