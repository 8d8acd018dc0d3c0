"""What a public pretraining trains (``Recipe``), its stable key, and the named recipes.

A recipe fixes everything the checkpoint's bytes depend on besides the code: the public corpus
(by name and the SHA-256 of each of its files), the private corpus whose text is removed from it
(``dpbench.data.overlap``; again by its files' SHA-256) and the span that counts as shared, the
model's dimensions, the optimisation (AdamW, steps, batch size, learning rate with linear
warm-up then cosine decay, weight decay), the seed, and the torch CPU threads (a matrix product's
sums may be split differently on another thread count, so the bytes are reproducible for a given
count, on one machine and torch build). No torch here: the workflow reads recipes when it builds its job list.

Named recipes (``RECIPES``):

* ``wordnet-lm``: P4's model (``dpbench.problems.transformer.TransformerLM`` at its defaults:
  d_model 128, 4 layers, 4 heads, MLP 512, context 128; 876,034 parameters) on every WordNet
  gloss left after the removal: 6,000 steps of 64 records (about 3.3 epochs), one thread,
  sized to about 60 CPU-minutes by a measured 0.6 CPU-seconds per step (docs/finetune.md);
* ``tiny``: a tiny model on the first 2,000 glosses, a few seconds, for tests and CI.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Mapping

from dpbench.data import fortunes, overlap, wordnet

CORPORA = {wordnet.NAME: wordnet}


def _manifest(files: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v).lower().removeprefix("sha256:")) for k, v in files.items()))


@dataclass(frozen=True)
class Recipe:
    name: str
    steps: int = 6000
    batch_size: int = 64
    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 200
    final_lr_fraction: float = 0.1  # the cosine decays to lr * this at the last step
    weight_decay: float = 0.01
    seed: int = 0
    context: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_mlp: int = 512
    records: int | None = None  # train on the first n training records (after the removal); None: all
    validation_records: int | None = None  # evaluate on the first n held-out records; None: all
    overlap_span: int = overlap.SPAN
    threads: int = 1
    corpus: str = wordnet.NAME
    corpus_manifest: tuple[tuple[str, str], ...] = _manifest(wordnet.SHA256)
    private_manifest: tuple[tuple[str, str], ...] = _manifest(fortunes.SHA256)

    def __post_init__(self):
        if self.corpus not in CORPORA:
            raise ValueError(f"recipe {self.name}: corpus {self.corpus!r} is not one of {sorted(CORPORA)}")
        for key in ("steps", "batch_size", "context", "d_model", "n_layers", "n_heads", "d_mlp", "overlap_span",
                    "threads"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"recipe {self.name}: {key} must be a positive integer, got {value!r}")
        for key in ("records", "validation_records"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"recipe {self.name}: {key} must be a positive integer or null, got {value!r}")
        for key in ("lr", "final_lr_fraction", "weight_decay"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"recipe {self.name}: {key} must be a number, got {value!r}")
        for key in ("warmup_steps", "seed"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"recipe {self.name}: {key} must be a non-negative integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"recipe {self.name}: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        for key, ok, rule in (("lr", self.lr > 0, "> 0"), ("final_lr_fraction", 0 <= self.final_lr_fraction <= 1,
                                                           "in [0, 1]"),
                              ("weight_decay", self.weight_decay >= 0, ">= 0"),
                              ("warmup_steps", self.warmup_steps <= self.steps, f"<= steps ({self.steps})")):
            if not ok:
                raise ValueError(f"recipe {self.name}: {key} must be {rule}, got {getattr(self, key)!r}")

        need, have = self.step_bytes, physical_memory()
        if have is not None and need > have:
            raise ValueError(f"recipe {self.name}: context {self.context} needs about {need / 2**30:,.1f} GiB per "
                             f"training step (batch_size x n_layers x n_heads x context^2 attention weights, "
                             f"float32, kept for the backward pass), more than this machine's "
                             f"{have / 2**30:,.1f} GiB of memory: lower context or batch_size")

    @property
    def step_bytes(self) -> int:
        """A lower bound on the memory of one training step: the attention weights of every layer
        and head, batch_size x context^2 float32 each, kept for the backward pass (what grows
        fastest with the context)."""
        return 4 * self.batch_size * self.n_layers * self.n_heads * self.context ** 2

    @property
    def model_dims(self) -> dict:
        """The keyword arguments of ``TransformerLM`` (vocabulary: the byte tokenizer's 258)."""
        return {"vocab_size": 258, "context": self.context, "d_model": self.d_model, "n_layers": self.n_layers,
                "n_heads": self.n_heads, "d_mlp": self.d_mlp}

    def to_json(self) -> dict:
        out = asdict(self)
        out["corpus_manifest"], out["private_manifest"] = dict(self.corpus_manifest), dict(self.private_manifest)
        return out

    @property
    def key(self) -> str:
        """16 hex digits of the SHA-256 of everything but the name: two recipes that train the
        same thing share a key."""
        content = {k: v for k, v in self.to_json().items() if k != "name"}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


def physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


RECIPES: dict[str, Recipe] = {
    "wordnet-lm": Recipe(name="wordnet-lm"),
    "tiny": Recipe(name="tiny", steps=60, batch_size=16, lr=3e-3, warmup_steps=5, context=64, d_model=32,
                   n_layers=1, n_heads=2, d_mlp=64, records=2000, validation_records=200, threads=1),
}


def checkpoint_name(recipe: Recipe, code: str) -> str:
    """The workflow's file name of a recipe's checkpoint made by code of fingerprint ``code``:
    ``<name>-<recipe key>-<code>.pt`` (``dpbench pretrain --expect`` checks the last two)."""
    return f"{recipe.name}-{recipe.key}-{code}.pt"


def from_json(obj: Mapping) -> Recipe:
    """A recipe from a JSON object of its fields (the manifests as {file: sha256}); unset fields
    take the defaults (``wordnet-lm``'s); an unknown field is refused naming it."""
    known = {f.name for f in fields(Recipe)}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"recipe: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    values = dict(obj)
    values.setdefault("name", "custom")
    for key in ("corpus_manifest", "private_manifest"):
        if key in values:
            if not isinstance(values[key], Mapping):
                raise ValueError(f"recipe: {key} must be an object {{file: sha256}}")
            values[key] = _manifest(values[key])
    return Recipe(**values)


def get_recipe(text: str) -> Recipe:
    """A named recipe, or a JSON object of fields (``from_json``)."""
    if text in RECIPES:
        return RECIPES[text]
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"recipe: not valid JSON ({exc})") from None
        return from_json(obj)
    raise ValueError(f"unknown recipe {text!r}: name one of {', '.join(sorted(RECIPES))} or give a JSON object")

