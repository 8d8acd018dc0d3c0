"""Resuming a killed run: its ``Trace`` (what it has recorded so far), the ``Checkpoint`` file
(verified, atomically written, private where it holds secret noise state), the state saved
(``checkpoint_state``) and put back (``restore``)."""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dpbench import log
from dpbench.files import atomic_write, is_no_space, no_space, remove_stale_partials
from dpbench.mechanisms.base import PrivacyClaim
from dpbench.training.config import RunConfig
from dpbench.training.harness import Assembly

_LOG = log.get(__name__)


# Settings that do not change a run's result: a checkpoint made under other values still applies.
VOLATILE = ("progress_every_s", "data_dir", "cache_dir", "factorization", "noise_file", "eval_batch_size")


@dataclass
class Trace:
    """What a run has recorded so far: per-step training metrics (kept on the device until an
    epoch ends, so no sync per step), evaluation rows, optimizer diagnostics summed over
    steps, and the seconds spent. Checkpointed, so a resumed run continues it."""

    train_loss: torch.Tensor  # (steps,) float64; NaN where the batch was empty
    train_correct: torch.Tensor  # (steps,) float64; mean correctness of each batch
    batch_sizes: torch.Tensor  # (steps,) int64; the realised batch sizes
    step: int = 0  # steps done
    eval_rows: list[dict] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    eval_s: float = 0.0
    train_s: float = 0.0  # training seconds of the earlier sessions (before a resume)
    resumes: int = 0
    test_correct: dict[int, str] = field(default_factory=dict)  # epoch -> packed per-record outcomes

    @classmethod
    def empty(cls, steps: int, device) -> Trace:
        return cls(torch.full((steps,), math.nan, dtype=torch.float64, device=device),
                   torch.zeros(steps, dtype=torch.float64, device=device),
                   torch.zeros(steps, dtype=torch.int64, device=device))

    def record(self, batch_size: int, out) -> None:
        """One step's output (``StepOutput``) at index ``self.step``; then the step is done."""
        self.batch_sizes[self.step] = batch_size
        for key, value in out.stats.items():
            self.stats[key] = self.stats.get(key, 0.0) + value
        if out.losses.numel():
            self.train_loss[self.step] = out.losses.double().mean()
            if out.correct is not None:
                self.train_correct[self.step] = out.correct.double().mean()
        self.step += 1

    def start_session(self) -> None:
        self._session_t0, self._eval_s0 = time.perf_counter(), self.eval_s

    def train_time(self) -> float:
        """Training seconds so far, over every session of this run, evaluation excluded."""
        return self.train_s + time.perf_counter() - self._session_t0 - (self.eval_s - self._eval_s0)

    def state_dict(self) -> dict:
        return {"train_loss": self.train_loss.cpu(), "train_correct": self.train_correct.cpu(),
                "batch_sizes": self.batch_sizes.cpu(),
                "progress": {"step": self.step, "eval_rows": self.eval_rows, "stats": self.stats,
                             "eval_s": self.eval_s, "train_s": self.train_time(), "resumes": self.resumes,
                             "test_correct": self.test_correct}}

    def load_state_dict(self, state: dict) -> None:
        for name in ("train_loss", "train_correct", "batch_sizes"):
            getattr(self, name).copy_(state[name])
        progress = state["progress"]
        self.step, self.eval_rows, self.stats = progress["step"], progress["eval_rows"], progress["stats"]
        self.eval_s, self.train_s, self.resumes = progress["eval_s"], progress["train_s"], progress["resumes"] + 1
        self.test_correct = dict(progress.get("test_correct", {}))  # (older checkpoints: none)


class Checkpoint:
    """Everything needed to continue a run exactly where it stopped: the calibration, model,
    optimizer and noise state, sampler and loss RNGs, and the trace so far. Written
    atomically (temporary name, fsync, rename) with a SHA-256 of its payload, verified on
    load: a damaged checkpoint (truncated, zeroed, bytes changed) is moved aside with a
    message naming it and the run starts afresh, never resumes from it. It is read with
    ``weights_only=True`` (tensors and plain data): a crafted file whose pickle would run code
    (``__reduce__``) is refused as damaged and runs nothing. A checkpoint of
    another configuration, or made by other code (``code_key``, e.g.
    ``fingerprint.optimizer_fingerprint``), is ignored with a message, never reused. A failed
    write (a full disk) removes its temporary file and stops the run naming the file.

    ``private``: the state holds secret noise state (the streamed mechanisms' recurrence
    memory, from which, with the releases, the noise can be subtracted): the file is then
    created with mode 0600 (readable by its owner only, whatever the umask). The CLI deletes
    the checkpoint once the run file is written; the run file never holds noise state."""

    MAGIC = b"dpbench checkpoint 2\n"  # then the payload's SHA-256 (32 bytes), then torch.save's bytes

    def __init__(self, path: str | Path | None, cfg: RunConfig, code_key: str | None = None, private: bool = False):
        self.path = Path(path) if path else None
        self.key = {k: v for k, v in asdict(cfg).items() if k not in VOLATILE}
        self.key["code"] = code_key
        self.private = private

    def _read(self) -> dict:
        raw = self.path.read_bytes()
        head = len(self.MAGIC)
        if not raw.startswith(self.MAGIC):
            raise ValueError("it does not start as a dpbench checkpoint")
        digest, payload = raw[head:head + 32], raw[head + 32:]
        if hashlib.sha256(payload).digest() != digest:
            raise ValueError("its SHA-256 does not match its contents")
        # tensors and plain data only: its SHA-256 header is no key (anyone who can write the file
        # can write a matching header), so a pickle that would run code is refused, never run
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)

    def load(self) -> dict | None:
        if self.path is None:
            return None
        remove_stale_partials(self.path)
        if not self.path.exists():
            return None
        try:
            state = self._read()
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, it is not resumed from
            if isinstance(exc, pickle.UnpicklingError):  # torch's message is many lines
                exc = "it holds objects other than tensors and plain data, which could run code when loaded"
            aside = self.path.with_name(f"{self.path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
            os.replace(self.path, aside)
            _LOG.warning(f"checkpoint {self.path} is damaged ({exc}); moved it to {aside}, starting afresh")
            return None
        if state.get("key") != self.key:
            _LOG.warning(f"checkpoint {self.path} belongs to another configuration; starting afresh")
            return None
        return state

    def save(self, state: dict) -> None:
        if self.path is None:
            return
        try:
            buffer = io.BytesIO()
            torch.save({"key": self.key, **state}, buffer)
            payload = buffer.getbuffer()

            def write(f) -> None:
                f.write(self.MAGIC)
                f.write(hashlib.sha256(payload).digest())
                f.write(payload)

            # mode as open() gives it (the umask's), or 0600 for secret noise state
            atomic_write(self.path, write, private=self.private)
        except OSError as exc:
            if is_no_space(exc):
                raise no_space(exc, "the checkpoint", self.path,
                               "free space and run again; the run resumes from its last checkpoint") from exc
            raise


def checkpoint_state(claim: PrivacyClaim, parts: Assembly, loss_gen: torch.Generator, trace: Trace) -> dict:
    return {"sigma": claim.noise_multiplier, "sigma_source": claim.source, "calibration_s": claim.seconds,
            "model": parts.context.model.state_dict(), "step_fn": parts.step.state_dict(),
            "sampler": parts.sampler.state_dict(), "loss_gen": loss_gen.get_state(), **trace.state_dict()}


def _to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def step_state_on(state: dict, device) -> dict:
    """A checkpointed step's state (read to the CPU) with its optimizer state (moments,
    residuals, filter state) on ``device``, next to the parameters; the noise source's state
    stays on the CPU (generator states are CPU byte tensors, as ``set_state`` takes them)."""
    return {k: v if k == "noise" else _to_device(v, device) for k, v in state.items()}


def restore(saved: dict, parts: Assembly, loss_gen: torch.Generator, trace: Trace) -> None:
    """Puts a checkpoint's state back into a freshly assembled run."""
    parts.context.model.load_state_dict(saved["model"])
    parts.step.load_state_dict(step_state_on(saved["step_fn"], next(parts.context.model.parameters()).device))
    parts.sampler.load_state_dict(saved["sampler"])
    loss_gen.set_state(saved["loss_gen"])
    trace.load_state_dict(saved)
