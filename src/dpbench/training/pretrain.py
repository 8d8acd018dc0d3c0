"""Public pretraining: a language model trained without privacy on a public corpus, from which
the private fine-tuning problems start.

``pretrain(recipe, out)`` reads the public corpus (``recipe.corpus``, verified against the
recipe's manifest), removes every record sharing text with the private corpus
(``dpbench.data.overlap``, against all of fortunes, training and held-out records), trains
``TransformerLM(**recipe.model_dims)`` on the rest with AdamW (next-token cross-entropy per real
token, each record ``[BOS] + bytes + [EOS]`` as P4 encodes it) and writes

* ``out``: the model's ``state_dict``, serialised by ``torch.save`` into memory and written as
  those bytes (a fixed archive name), so that the same recipe and code give the same SHA-256;
* ``out.json`` (the sidecar): that SHA-256, the recipe and its key, the code fingerprint
  (``dpbench.pipeline.fingerprint.pretrain_fingerprint``, handed in), the corpora's manifests, the removal
  report, the held-out loss before and after, and the privacy statement.

Determinism. The initialisation and the batches come from the recipe's seed
(``dpbench.seeds.stream_seeds``: "init" and "sampler"); the batch of step t is a pure function
of t (the positions t*B ... t*B + B - 1 of a stream of epochs, each a permutation drawn from
(sampler seed, epoch)); the learning rate is a function of t; torch uses ``recipe.threads``
CPU threads. So a run killed and resumed from its ``out.resume`` file (model, AdamW state, step,
written atomically every ``checkpoint_every_s``) ends with the same bytes as an uninterrupted run.

Privacy. Pretraining reads the private corpus only to remove its text from the public one, and
it reads the whole fortunes package, a fixed constant of the benchmark: neighbouring training
sets of the accountant (which differ in one training record or canary) see the same package,
hence the same filtered public corpus and the same checkpoint. So the checkpoint spends no
privacy of the training records. (Where the private data were secret, the filter itself would
be a release: which public records it removes depends on the private text.)

``load_pretrained(path, expected, code)`` verifies a checkpoint against its sidecar before
anyone uses it: a missing sidecar, bytes whose SHA-256 differs from the sidecar's (damaged, or
another checkpoint's file), and, where given, another recipe than the one expected or other code
than the current, are refused with a ValueError naming the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dpbench.data import fortunes, overlap
from dpbench.files import atomic_write, remove_stale_partials, special_kind
import dpbench.problems.tokenizer as tokenizer
from dpbench.problems.transformer import TransformerLM
from dpbench.seeds import stream_seeds
from dpbench.training.recipes import CORPORA, RECIPES, Recipe

PRIVACY = "public data only; spends no privacy of the private records"
EVAL_BATCH = 256


# --------------------------------------------------------------------------- data


def public_records(recipe: Recipe, data_dir=None) -> tuple[list[str], list[str], dict]:
    """(training records, held-out records, a description of the corpora and the removal): the
    recipe's slice of the public corpus (its first ``records`` training and ``validation_records``
    held-out records), without the records that share text with the private corpus."""
    corpus_module = CORPORA[recipe.corpus]
    corpus = corpus_module.load(data_dir, manifest=dict(recipe.corpus_manifest))
    private = fortunes.load(data_dir, manifest=dict(recipe.private_manifest))
    train = list(corpus.train[:recipe.records])
    validation = list(corpus.validation[:recipe.validation_records])
    kept, report = overlap.remove_overlap(train + validation, private.train + private.validation,
                                          span=recipe.overlap_span)
    removed, n_train = set(report["removed_indices"]), len(train)  # indices into train + validation
    train = [r for i, r in enumerate(train) if i not in removed]
    validation = [r for i, r in enumerate(validation, start=n_train) if i not in removed]
    stats = corpus_module.stats(corpus)
    info = {
        "corpus": {"name": recipe.corpus, "directory": corpus.source, "files": dict(recipe.corpus_manifest),
                   "package": f"wordnet-base {corpus_module.PACKAGE_VERSION}" if dict(recipe.corpus_manifest)
                   == corpus_module.SHA256 else None,
                   "records": stats["records"], "bytes": stats["bytes"],
                   "used": {"train": len(train), "validation": len(validation),
                            "train_bytes": sum(len(r.encode()) for r in train)}},
        "private_corpus": {"name": fortunes.NAME, "directory": private.source, "files": dict(recipe.private_manifest),
                           "records": len(private.train) + len(private.validation)},
        "overlap": report,
    }
    return train, validation, info


def batch_rows(n: int, batch_size: int, sampler_seed: int, step: int) -> np.ndarray:
    """The records of step ``step``: positions step*B ... step*B + B - 1 of the stream of epochs,
    epoch e being the permutation drawn from (sampler_seed, e)."""
    positions = step * batch_size + np.arange(batch_size)
    epochs, within = np.divmod(positions, n)
    rows = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        permutation = np.random.default_rng([sampler_seed, int(epoch)]).permutation(n)
        rows[epochs == epoch] = permutation[within[epochs == epoch]]
    return rows


def learning_rate(recipe: Recipe, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then a cosine decay to ``lr *
    final_lr_fraction`` at the last step."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(recipe.steps - recipe.warmup_steps - 1, 1)
    floor = recipe.final_lr_fraction
    return recipe.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _cut(tokens: torch.Tensor) -> torch.Tensor:
    """The batch cut to its longest record (padding changes no loss: the model is causal)."""
    length = int((tokens != tokenizer.PAD).sum(1).max().item())
    return tokens[:, :max(length, 2)]


def _loss_sum(model: TransformerLM, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy over real targets, their number)."""
    x = _cut(tokens)
    logits = model(x[:, :-1])
    targets = x[:, 1:]
    loss = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=tokenizer.PAD, reduction="sum")
    return loss, int((targets != tokenizer.PAD).sum().item())


@torch.no_grad()
def evaluate(model: TransformerLM, tokens: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats per real target token) over ``tokens``."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    for start in range(0, len(tokens), EVAL_BATCH):
        loss, n = _loss_sum(model, tokens[start:start + EVAL_BATCH])
        total, count = total + float(loss), count + n
    model.train(was_training)
    return total / max(count, 1)


# --------------------------------------------------------------------------- files


def sha256_of(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def state_bytes(state_dict: dict) -> bytes:
    """``torch.save`` of a state dict into memory: the archive is named "archive" whatever the
    file's name (saved to a path it would take the file's), so equal weights give equal bytes."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()


def _write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def _load_resume(path: Path, recipe: Recipe, code: str) -> dict | None:
    remove_stale_partials(path)
    if not path.exists():
        return None
    try:
        state = torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, it is not resumed from
        print(f"pretrain: {path} is damaged ({exc}); starting afresh", file=sys.stderr, flush=True)
        return None
    if state.get("key") != recipe.key or state.get("code") != code:
        print(f"pretrain: {path} belongs to another recipe or other code; starting afresh", file=sys.stderr,
              flush=True)
        return None
    return state


# --------------------------------------------------------------------------- training


def pretrain(recipe: Recipe, out, data_dir=None, *, code: str, progress_every_s: float = 10.0,
             checkpoint_every_s: float = 60.0, stop_after: int | None = None) -> dict | None:
    """Train the recipe and write ``out`` and ``out.json``; returns the sidecar's record.
    ``code``: the fingerprint of the code that trains it (the CLI's
    ``dpbench.pipeline.fingerprint.pretrain_fingerprint()``), recorded, and a resume file of other
    code is not resumed from. ``stop_after``: stop after that many steps of this session, leaving
    only the resume file (returns None); what a killed job leaves, for tests of resumption."""
    out = Path(out)
    resume_path = out.with_name(out.name + ".resume")
    train, validation, info = public_records(recipe, data_dir)
    if not train:
        raise ValueError(f"recipe {recipe.name}: no training record is left after removing the private text")
    train_tokens = torch.from_numpy(tokenizer.encode_records(train, recipe.context).astype(np.int16))
    validation_tokens = torch.from_numpy(tokenizer.encode_records(validation, recipe.context))
    seeds = stream_seeds(recipe.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeds["init"])
            model = TransformerLM(**recipe.model_dims)
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        others = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": recipe.weight_decay},
                                       {"params": others, "weight_decay": 0.0}],
                                      lr=recipe.lr, betas=(0.9, 0.95), foreach=False)
        saved = _load_resume(resume_path, recipe, code)
        if saved is None:
            step, losses, seconds, resumes = 0, [], 0.0, 0
            initial_loss = evaluate(model, validation_tokens)
        else:
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            step, losses, seconds = saved["step"], list(saved["losses"]), saved["seconds"]
            initial_loss, resumes = saved["initial_validation_loss"], saved["resumes"] + 1
            print(f"pretrain {recipe.name}: resuming at step {step} from {resume_path}", file=sys.stderr, flush=True)

        def save_resume() -> None:
            _write_bytes(resume_path, state_bytes({
                "key": recipe.key, "code": code, "step": step, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "losses": losses, "seconds": seconds + time.perf_counter() - t0,
                "initial_validation_loss": initial_loss, "resumes": resumes}))

        t0 = last_progress = last_save = time.perf_counter()
        session_start = step
        model.train()
        while step < recipe.steps:
            if stop_after is not None and step - session_start >= stop_after:
                save_resume()
                return None
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(recipe, step)
            rows = torch.from_numpy(batch_rows(len(train_tokens), recipe.batch_size, seeds["sampler"], step))
            loss_sum, count = _loss_sum(model, train_tokens[rows].long())
            loss = loss_sum / max(count, 1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            step += 1
            now = time.perf_counter()
            if now - last_progress >= progress_every_s or step == recipe.steps:
                rate = (now - t0) / (step - session_start)
                recent = float(np.mean(losses[-50:]))
                print(f"pretrain {recipe.name}: step {step}/{recipe.steps} loss {recent:.4f} "
                      f"lr {learning_rate(recipe, step - 1):.2e} {rate:.3f} s/step "
                      f"eta {rate * (recipe.steps - step) / 60:.1f} min", file=sys.stderr, flush=True)
                last_progress = now
            if now - last_save >= checkpoint_every_s and step < recipe.steps:
                save_resume()
                last_save = time.perf_counter()
        seconds += time.perf_counter() - t0
        validation_loss = evaluate(model, validation_tokens)
        data = state_bytes(model.state_dict())
    finally:
        torch.set_num_threads(threads)
    chunks = np.array_split(np.array(losses), min(20, len(losses)))
    record = {
        "file": out.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
        "recipe": recipe.to_json(), "recipe_key": recipe.key, "code": code, "model_dims": recipe.model_dims,
        "parameters": sum(p.numel() for p in model.parameters()),
        **info,
        "validation": {"records": len(validation), "tokens": int((validation_tokens[:, 1:] != tokenizer.PAD).sum()),
                       "loss_initial": initial_loss, "loss": validation_loss, "unit": "nats per token"},
        "training": {"steps": recipe.steps, "epochs": recipe.steps * recipe.batch_size / len(train),
                     "train_loss_by_twentieth": [float(c.mean()) for c in chunks], "seconds": seconds,
                     "seconds_per_step": seconds / recipe.steps, "resumes": resumes, "threads": recipe.threads,
                     "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()},
        "privacy": PRIVACY,
        "privacy_note": "the private corpus is read only to remove its text from the public corpus; it is the "
                        "whole fortunes package, the same for every pair of neighbouring training sets",
    }
    _write_bytes(out, data)
    atomic_write(Path(f"{out}.json"), lambda f: f.write(json.dumps(record, indent=2, sort_keys=True) + "\n"), mode="w")
    resume_path.unlink(missing_ok=True)
    print(f"pretrain {recipe.name}: wrote {out} (sha256 {record['sha256'][:16]}...): held-out loss "
          f"{initial_loss:.4f} -> {validation_loss:.4f} nats/token in {seconds / 60:.1f} min", file=sys.stderr, flush=True)
    return record


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class Pretrained:
    state_dict: dict
    model_dims: dict
    record: dict  # the sidecar


def load_pretrained(path, expected: Recipe | None = None, code: str | None = None) -> Pretrained:
    """A checkpoint verified against its sidecar, and, where given, against the recipe expected and
    the fingerprint of the current code (``pretrain_fingerprint()``); refused with a ValueError
    naming the file otherwise."""
    path = Path(path)
    sidecar = Path(f"{path}.json")
    for file, what in ((path, "pretrained checkpoint"), (sidecar, f"sidecar of pretrained checkpoint {path}:")):
        kind = special_kind(file)  # a FIFO would block the read, /dev/zero never end it
        if kind is not None:
            raise ValueError(f"{what} {file} is {kind}, not a file (dpbench pretrain makes a checkpoint and its "
                             "sidecar .json)")
    if not path.is_file():
        raise ValueError(f"pretrained checkpoint {path} does not exist (dpbench pretrain makes it)")
    if not sidecar.is_file():
        raise ValueError(f"pretrained checkpoint {path} has no sidecar {sidecar}: its origin is unknown; refusing it")
    try:
        record = json.loads(sidecar.read_text())
        recorded = record["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"sidecar {sidecar} of pretrained checkpoint {path} is unreadable ({exc})") from None
    dims = record.get("model_dims")
    if not (isinstance(dims, dict) and set(dims) == set(MODEL_DIMS)
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in dims.values())):
        raise ValueError(f"sidecar {sidecar} of pretrained checkpoint {path} is damaged: its model_dims "
                         f"{_short(dims)} is not an object of positive integers {', '.join(MODEL_DIMS)}")
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded:
        raise ValueError(f"pretrained checkpoint {path} is damaged or swapped: its SHA-256 is {actual}, "
                         f"its sidecar {sidecar} records {recorded}")
    if expected is not None:
        if record.get("recipe_key") != expected.key:
            raise ValueError(f"pretrained checkpoint {path} was made by recipe key {record.get('recipe_key')} "
                             f"({record.get('recipe', {}).get('name')}), not {expected.key} ({expected.name})")
    if code is not None and record.get("code") != code:
        raise ValueError(f"pretrained checkpoint {path} was made by other code (fingerprint "
                         f"{record.get('code')}, now {code}): pretrain again")
    try:  # tensors and plain data only: a pickle that would run code is refused, never run
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - bytes torch cannot read as tensors are no checkpoint
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"pretrained checkpoint {path} is no checkpoint torch can read as tensors "
                         f"({type(exc).__name__}: {reason[:120]})") from None
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise ValueError(f"pretrained checkpoint {path} is no checkpoint: it holds a {type(state).__name__}, "
                         "not a state dict of tensors")
    return Pretrained(state, dict(dims), record)


# the sidecar's model_dims: TransformerLM's keyword arguments (Recipe.model_dims)
MODEL_DIMS = tuple(RECIPES["tiny"].model_dims)


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def build_pretrained_lm(path, expected: Recipe | None = None, code: str | None = None) -> TransformerLM:
    """The TransformerLM of a verified checkpoint (``load_pretrained``), its weights loaded (every
    one, strictly)."""
    loaded = load_pretrained(path, expected, code)
    model = TransformerLM(**loaded.model_dims)
    model.load_state_dict(loaded.state_dict, strict=True)
    return model
