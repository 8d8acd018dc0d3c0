"""One grid cell = one run: data -> model -> privacy calibration -> steps -> metrics.

``run`` reads as those stages, each a function of its own: ``load_splits`` (the data),
``timed_noise_multiplier`` (sigma, via ``harness.choose_noise_multiplier``), ``harness.assemble`` (the DP step and
its sampler, built exactly as the empirical audit builds them), ``Checkpoint``/``restore``
(resuming a killed run), ``train_loop`` (steps, evaluation at epoch ends, divergence) and
``run_record`` (the metadata every run file carries). The optimizer comes in as its
``OptimizerSpec``; looking it up by name is the caller's business (the CLI's).
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from torch import nn

from dpbench.privacy import accounting
from dpbench.training import cuda
from dpbench.files import atomic_write, is_no_space, no_space, remove_stale_partials
from dpbench.training.harness import Assembly, assemble, build_model, choose_noise_multiplier
from dpbench.mechanisms.base import Plan, PlanRequest
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.plugins import mechanism_origin, record_of
from dpbench.problems import Problem, get_problem
from dpbench.problems.catalog import TaskFacts, training_examples
from dpbench.reporting.results import provenance
from dpbench.seeds import stream_seeds


@dataclass(frozen=True)
class RunConfig:
    problem: str
    optimizer: str
    lr: float
    batch_size: int  # expected batch size L; sample rate q = L / N
    epochs: int  # E; T = round(E * N / L)
    seed: int
    epsilon: float | None = None  # target epsilon (private optimizers, unless noise_multiplier)
    noise_multiplier: float | None = None  # use this sigma instead of calibrating
    delta: float = accounting.DELTA
    clip_norm: float = 1.0
    normalize_clipping: bool = True
    accountant: str = accounting.DEFAULT_ACCOUNTANT
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    max_steps: int | None = None
    train_subset: int | None = None
    test_subset: int | None = None
    validation_size: int = 0  # examples held out of the training set for model selection
    data_dir: str | None = None
    # matrix mechanisms: the factorization and noise files (computed into cache_dir if absent)
    factorization: str | None = None
    noise_file: str | None = None
    cache_dir: str | None = None
    device: str = "auto"
    eval_batch_size: int = 1000
    progress_every_s: float = 10.0

    def validate(self, spec: OptimizerSpec) -> None:
        """Raises ValueError naming the first bad setting; ``spec`` is this run's optimizer."""
        if spec.name != self.optimizer:
            raise ValueError(f"optimizer {self.optimizer!r} was given the spec of {spec.name!r}")
        get_problem(self.problem)
        for name in ("lr", "batch_size", "epochs", "clip_norm") + (("epsilon",) if self.epsilon is not None else ()):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be positive and finite, got {getattr(self, name)}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if spec.private and self.noise_multiplier is None and self.epsilon is None:
            raise ValueError(f"optimizer {self.optimizer!r} is private: give --epsilon or --noise-multiplier")
        if self.noise_multiplier is not None and not 0 <= self.noise_multiplier < math.inf:
            raise ValueError(f"noise_multiplier must be >= 0 and finite, got {self.noise_multiplier}")
        if self.validation_size < 0:
            raise ValueError(f"validation_size must be >= 0, got {self.validation_size}")
        spec.hyperparameters(self.hyperparameters)


@dataclass
class RunResult:
    metrics: pd.DataFrame
    meta: dict[str, Any]


def resolve_device(device: str) -> torch.device:
    """The torch device of ``device`` (auto: the GPU where there is one); a CUDA device this
    machine does not have is an error saying so (not a failure after the data is loaded)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
            raise ValueError(f"{device}: no CUDA GPU is available (torch {torch.__version__}, built {build}); "
                             "use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev


def _subset(n: int, k: int | None, seed: int) -> np.ndarray | None:
    if k is None or k >= n:
        return None
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))


@torch.no_grad()
def evaluate(problem, model, x, y, batch_size: int, seed: int) -> tuple[float, float]:
    """Mean per-sample test loss and accuracy (NaN for the VAE). The VAE's sampling noise
    comes from a generator reseeded identically at every evaluation."""
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed)
    was_training = model.training
    model.eval()
    total_loss, total_correct = 0.0, 0.0
    for i in range(0, x.shape[0], batch_size):
        losses, correct = problem.per_sample_loss(model, x[i:i + batch_size], y[i:i + batch_size], gen)
        total_loss += losses.double().sum().item()
        if correct is not None:
            total_correct += correct.double().sum().item()
    model.train(was_training)
    n = x.shape[0]
    return total_loss / n, (total_correct / n if problem.task.facts.measures_accuracy else math.nan)


class Progress:
    """Rate-limited progress lines on stderr (they end up in the rule's log)."""

    def __init__(self, label: str, total: int, every_s: float):
        self.label, self.total, self.every_s = label, total, every_s
        self.start = self.last = time.perf_counter()

    def due(self) -> bool:
        return time.perf_counter() - self.last >= self.every_s

    def __call__(self, step: int, msg: str) -> None:
        now = self.last = time.perf_counter()
        rate = step / max(now - self.start, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else math.inf
        print(f"[{self.label}] step {step}/{self.total} ({100 * step / self.total:.0f}%) {msg} "
              f"| {rate:.1f} steps/s | eta {eta:.0f}s", file=sys.stderr, flush=True)


@dataclass
class Splits:
    """The run's data as tensors on its device; the validation split is held out of training."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor | None
    y_val: torch.Tensor | None
    x_test: torch.Tensor
    y_test: torch.Tensor
    source: str
    canaries: list = field(default_factory=list)  # planted in x_train (the task's; P4: dpbench.problems.language)


def load_splits(cfg: RunConfig, problem, seeds: dict[str, int], device) -> Splits:
    """The run's training, validation and test tensors. A problem whose task plants canaries (P4)
    gets them appended to the training split after the subset and validation split are drawn, so
    every run trains on them and they count in N. The training split has N examples as
    ``catalog.training_examples`` counts them, the count the grid keys matrix mechanisms by."""
    ds = problem.load(cfg.data_dir)
    train_idx = _subset(len(ds.y_train), cfg.train_subset, seeds["subset"])
    test_idx = _subset(len(ds.y_test), cfg.test_subset, seeds["subset"] + 1)
    val_idx = None
    if cfg.validation_size:
        pool = np.arange(len(ds.y_train)) if train_idx is None else train_idx
        if cfg.validation_size >= len(pool):
            raise ValueError(f"validation_size {cfg.validation_size} leaves no training examples "
                             f"(of {len(pool)})")
        held_out = np.zeros(len(pool), dtype=bool)
        held_out[np.random.default_rng(seeds["subset"] + 2).choice(len(pool), cfg.validation_size,
                                                                   replace=False)] = True
        train_idx, val_idx = pool[~held_out], pool[held_out]

    def tensors(images, labels, idx):
        if idx is None:
            return problem.preprocess(images).to(device), torch.from_numpy(labels).to(device)
        return problem.preprocess(images[idx]).to(device), torch.from_numpy(labels[idx]).to(device)

    x_train, y_train = tensors(ds.x_train, ds.y_train, train_idx)
    x_val, y_val = tensors(ds.x_train, ds.y_train, val_idx) if val_idx is not None else (None, None)
    x_test, y_test = tensors(ds.x_test, ds.y_test, test_idx)
    canaries = problem.task.make_canaries(seeds["canary"])
    if canaries:
        planted = problem.task.canary_records(canaries)
        x_train = torch.cat([x_train, problem.preprocess(planted).to(device)])
        y_train = torch.cat([y_train, torch.zeros(len(planted), dtype=y_train.dtype, device=device)])
    n_train = training_examples(len(ds.y_train), cfg.train_subset, cfg.validation_size, problem.facts.planted)
    if x_train.shape[0] != n_train:
        raise RuntimeError(f"problem {problem.id}: the training split has {x_train.shape[0]} examples where "
                           f"catalog.training_examples counts {n_train} (its facts' planted: {problem.facts.planted})")
    return Splits(x_train, y_train, x_val, y_val, x_test, y_test, ds.source, canaries)


# Settings that do not change a run's result: a checkpoint made under other values still applies.
VOLATILE = ("progress_every_s", "data_dir", "cache_dir", "factorization", "noise_file", "eval_batch_size")


@dataclass(frozen=True)
class Calibration:
    """The run's noise multiplier, where it came from, and the seconds its calibration took."""

    sigma: float
    source: str
    seconds: float


def plan_request(cfg: RunConfig, n_train: int) -> PlanRequest:
    """What the run asks of its mechanism, its files resolved: the given factorization and noise
    file, the cache directory (the default one unless given)."""
    return PlanRequest(n_train, cfg.batch_size, cfg.epochs, hyperparameters=cfg.hyperparameters,
                       target_epsilon=cfg.epsilon, delta=cfg.delta, cache_dir=cfg.cache_dir,
                       factorization=cfg.factorization, noise_file=cfg.noise_file)


def timed_noise_multiplier(cfg: RunConfig, spec: OptimizerSpec, plan: Plan) -> Calibration:
    """sigma for the run's plan (``harness.choose_noise_multiplier``), timed."""
    t0 = time.perf_counter()
    sigma, source = choose_noise_multiplier(spec, plan, target_epsilon=cfg.epsilon, noise_multiplier=cfg.noise_multiplier,
                                    delta=cfg.delta, accountant=cfg.accountant)
    return Calibration(sigma, source, time.perf_counter() - t0)


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
                             "eval_s": self.eval_s, "train_s": self.train_time(), "resumes": self.resumes}}

    def load_state_dict(self, state: dict) -> None:
        for name in ("train_loss", "train_correct", "batch_sizes"):
            getattr(self, name).copy_(state[name])
        progress = state["progress"]
        self.step, self.eval_rows, self.stats = progress["step"], progress["eval_rows"], progress["stats"]
        self.eval_s, self.train_s, self.resumes = progress["eval_s"], progress["train_s"], progress["resumes"] + 1


class Checkpoint:
    """Everything needed to continue a run exactly where it stopped: the calibration, model,
    optimizer and noise state, sampler and loss RNGs, and the trace so far. Written
    atomically (temporary name, fsync, rename) with a SHA-256 of its payload, verified on
    load: a damaged checkpoint (truncated, zeroed, bytes changed) is moved aside with a
    message naming it and the run starts afresh, never resumes from it. A checkpoint of
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
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)

    def load(self) -> dict | None:
        if self.path is None:
            return None
        remove_stale_partials(self.path)
        if not self.path.exists():
            return None
        try:
            state = self._read()
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, it is not resumed from
            aside = self.path.with_name(f"{self.path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
            os.replace(self.path, aside)
            print(f"checkpoint {self.path} is damaged ({exc}); moved it to {aside}, starting afresh",
                  file=sys.stderr, flush=True)
            return None
        if state.get("key") != self.key:
            print(f"checkpoint {self.path} belongs to another configuration; starting afresh",
                  file=sys.stderr, flush=True)
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


def checkpoint_state(calibration: Calibration, parts: Assembly, loss_gen: torch.Generator, trace: Trace) -> dict:
    return {"sigma": calibration.sigma, "sigma_source": calibration.source, "calibration_s": calibration.seconds,
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


def epoch_ends(planned_steps: int, epochs: int, steps: int) -> list[int]:
    """The step after which each epoch ends (the last is ``steps``, the steps to take)."""
    return sorted({min(steps, round(e * planned_steps / epochs)) for e in range(1, epochs + 1)})


def diverged(model: nn.Module, trace: Trace) -> bool:
    """A training loss or a parameter that is NaN or infinite."""
    return not torch.isfinite(trace.train_loss[:trace.step].nan_to_num(0.0)).all().item() or not all(
        torch.isfinite(p).all().item() for p in model.parameters())


def train_loop(parts: Assembly, splits: Splits, trace: Trace, ends: list[int],
               evaluate_epoch: Callable[[int, bool], dict], save: Callable[[], None],
               checkpoint_every_s: float, progress: Progress) -> str:
    """Steps from ``trace.step`` to the last epoch end, evaluating at each epoch end; saves
    (``save``) at every epoch end but the last and every ``checkpoint_every_s`` seconds.
    Returns the status: "completed", or "diverged" at the first epoch end with a non-finite
    loss or parameter (the run stops there and saves nothing more)."""
    trace.start_session()
    last_save = time.perf_counter()
    for epoch, end in enumerate(ends, start=1):
        if trace.step >= end:
            continue  # finished before the checkpoint
        while trace.step < end:
            idx = parts.sampler.sample()
            trace.record(idx.numel(), parts.step(splits.x_train[idx], splits.y_train[idx]))
            if progress.due():
                progress(trace.step, f"epoch {epoch}/{len(ends)} loss {trace.train_loss[trace.step - 1].item():.4g}")
            if trace.step < end and time.perf_counter() - last_save > checkpoint_every_s:
                save()
                last_save = time.perf_counter()
        is_diverged = diverged(parts.context.model, trace)
        test_row = evaluate_epoch(epoch, is_diverged)
        progress(trace.step, f"epoch {epoch} test loss {test_row['loss']:.4g} acc {test_row['accuracy']:.4f}")
        if is_diverged:
            return "diverged"  # a diverged run saves no checkpoint: it ends here
        if trace.step < ends[-1]:
            save()
            last_save = time.perf_counter()
    return "completed"


def evaluate_splits(problem: Problem, model: nn.Module, splits: Splits, trace: Trace, epoch: int,
                    is_diverged: bool, batch_size: int, seed: int) -> dict:
    """Validation (if any) and test metrics at an epoch end, appended to the trace; returns
    the test row. A diverged model is not evaluated: its loss is infinite."""
    t_eval = time.perf_counter()
    for split, x, y in (("val", splits.x_val, splits.y_val), ("test", splits.x_test, splits.y_test)):
        if x is None:
            continue
        loss, acc = (math.inf, math.nan) if is_diverged else evaluate(problem, model, x, y, batch_size, seed)
        trace.eval_rows.append({"split": split, "step": trace.step, "epoch": epoch, "loss": loss,
                                "accuracy": acc, "batch_size": x.shape[0]})
    trace.eval_s += time.perf_counter() - t_eval
    return trace.eval_rows[-1]


def metrics_table(trace: Trace, ends: list[int], task: TaskFacts) -> pd.DataFrame:
    """One row per training step (its batch's mean loss and accuracy, realised batch size) and
    one per evaluation, in the results schema's columns and dtypes."""
    done = trace.step
    train_df = pd.DataFrame({
        "split": "train",
        "step": np.arange(1, done + 1),
        "epoch": np.searchsorted(np.array(ends), np.arange(1, done + 1)) + 1,
        "loss": trace.train_loss[:done].cpu().numpy(),
        "accuracy": (trace.train_correct[:done].cpu().numpy() if task.measures_accuracy
                     else np.full(done, math.nan)),
        "batch_size": trace.batch_sizes[:done].cpu().numpy(),
    })
    if task.measures_accuracy:
        train_df.loc[train_df["batch_size"] == 0, "accuracy"] = math.nan
    metrics = pd.concat([train_df, pd.DataFrame(trace.eval_rows)], ignore_index=True)
    return metrics.astype({"step": "int64", "epoch": "int64", "batch_size": "int64",
                           "loss": "float64", "accuracy": "float64"})


@dataclass(frozen=True)
class Setup:
    """What is fixed before a run's first step."""

    cfg: RunConfig
    spec: OptimizerSpec
    problem: Problem
    device: torch.device
    seeds: dict[str, int]
    splits: Splits
    plan: Plan
    calibration: Calibration


def run_record(setup: Setup, parts: Assembly, trace: Trace, metrics: pd.DataFrame, status: str,
               timing: dict[str, Any]) -> dict[str, Any]:
    """The run's metadata: its configuration, problem, optimizer, data, the privacy promised
    (target epsilon, sigma, q, T, delta) and delivered (epsilon for the steps taken), the
    result, the timing and the environment."""
    cfg, spec, problem, plan, splits = setup.cfg, setup.spec, setup.problem, setup.plan, setup.splits
    ctx, sigma, private = parts.context, setup.calibration.sigma, spec.private
    privacy = ({**spec.mechanism.report(plan, sigma, trace.step, cfg.delta, cfg.accountant),
                **parts.step.privacy_record()} if private else {})
    return {
        "config": asdict(cfg),
        "problem": {"id": problem.id, "dataset": problem.dataset, "task": problem.task.name, "metric": problem.metric,
                    "parameters": sum(p.numel() for p in ctx.model.parameters()), "plugin": record_of(problem)},
        # plugin: distribution, version, entry point and source hash (dpbench.plugins); None: built-in
        "optimizer": {"name": spec.name, "private": private, "description": spec.description,
                      "reference": spec.reference, "hyperparameters": ctx.hyperparameters, "stats": trace.stats,
                      "plugin": record_of(spec)},
        "data": {"source": splits.source, "n_train": splits.x_train.shape[0], "n_test": int(splits.x_test.shape[0]),
                 "n_val": int(splits.x_val.shape[0]) if splits.x_val is not None else 0},
        "privacy": {
            "mechanism": spec.mechanism.name if private else None,
            # "plugin": sigma and epsilon come from a plugin's own mechanism class, not dpbench's
            "mechanism_origin": mechanism_origin(spec.mechanism),
            "noise_multiplier": sigma,
            "noise_multiplier_source": setup.calibration.source,
            "sample_rate": plan.sample_rate if private else None,
            "planned_steps": plan.steps,
            "steps": trace.step,
            "delta": cfg.delta if private else None,
            "target_epsilon": cfg.epsilon if private else None,
            "epsilon": privacy.pop("epsilon", math.inf),
            "epsilon_planned": privacy.pop("epsilon_planned", math.inf),
            "epsilon_rdp": privacy.pop("epsilon_rdp", math.inf),
            "accountant": cfg.accountant if private else None,
            "clip_norm": cfg.clip_norm if private else None,
            "normalize_clipping": cfg.normalize_clipping if private else None,
            "sensitivity": ctx.clipping.sensitivity if private else None,
            "noise_std_mean_gradient": getattr(parts.step, "noise_std", 0.0) / plan.batch_size if private else 0.0,
            "caveat": spec.caveat,
            "calibration_time_s": setup.calibration.seconds,
            **privacy,
        },
        "result": {"status": status, **summarize(metrics, problem.task.facts)},
        "timing": timing,
        "environment": {**provenance(), "device": str(setup.device), "torch_threads": torch.get_num_threads(),
                        **({"cuda": cuda.settings(), "gpu": torch.cuda.get_device_name(setup.device)}
                           if setup.device.type == "cuda" else {}),
                        "seeds": setup.seeds},
    }


def run(cfg: RunConfig, spec: OptimizerSpec, *, checkpoint: str | Path | None = None,
        checkpoint_every_s: float = 600.0, code_key: str | None = None) -> RunResult:
    """Train one cell with the optimizer ``spec`` (the registry's entry for ``cfg.optimizer``).
    With ``checkpoint``, state is saved there at every epoch end and every
    ``checkpoint_every_s`` seconds, and a run killed earlier continues from it, ending with
    the same metrics as an uninterrupted run; ``code_key`` (a hash of the code that trains
    it) makes a checkpoint of other code stale."""
    cfg.validate(spec)
    t_start = time.perf_counter()
    started_at = pd.Timestamp.now(tz="UTC").isoformat()
    problem = get_problem(cfg.problem)
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        cuda.configure()  # IEEE float32 (no TF32) and deterministic kernels: dpbench.training.cuda
    seeds = stream_seeds(cfg.seed)
    splits = load_splits(cfg, problem, seeds, device)
    n_train = splits.x_train.shape[0]
    ckpt = Checkpoint(checkpoint, cfg, code_key)
    saved = ckpt.load()

    # The privacy setting (batches, steps, sample rate) comes from the optimizer's mechanism.
    plan = spec.mechanism.plan(plan_request(cfg, n_train))
    calibration = (Calibration(saved["sigma"], saved["sigma_source"], saved["calibration_s"]) if saved
                   else timed_noise_multiplier(cfg, spec, plan))
    setup = Setup(cfg, spec, problem, device, seeds, splits, plan, calibration)

    model = build_model(problem, seeds["init"], device)
    loss_gen = torch.Generator(device=device)
    loss_gen.manual_seed(seeds["loss"])
    parts = assemble(spec, plan, model, lambda m, x, y: problem.per_sample_loss(m, x, y, loss_gen), lr=cfg.lr,
                     noise_multiplier=calibration.sigma, clip_norm=cfg.clip_norm,
                     normalize_clipping=cfg.normalize_clipping, hyperparameters=cfg.hyperparameters,
                     noise_seed=seeds["noise"], sampler_seed=seeds["sampler"], n_train=n_train, device=device)
    # a noise source whose state is secret (streamed correlated noise) makes checkpoints private files
    ckpt.private = bool(getattr(parts.context.noise, "private_state", False))
    steps = plan.steps if cfg.max_steps is None else min(plan.steps, cfg.max_steps)
    trace = Trace.empty(steps, device)
    if saved:
        restore(saved, parts, loss_gen, trace)

    ends = epoch_ends(plan.steps, cfg.epochs, steps)
    label = f"{cfg.problem} {cfg.optimizer} lr={cfg.lr:g} L={plan.batch_size} eps={cfg.epsilon} seed={cfg.seed}"
    print(f"[{label}] N={n_train} q={plan.sample_rate} T={plan.steps} steps={steps} sigma={calibration.sigma:.6g} "
          f"({calibration.source}) device={device}" + (f", resumed at step {trace.step}" if saved else ""),
          file=sys.stderr, flush=True)
    status = train_loop(
        parts, splits, trace, ends,
        evaluate_epoch=lambda epoch, is_diverged: evaluate_splits(problem, model, splits, trace, epoch, is_diverged,
                                                                  cfg.eval_batch_size, seeds["eval"]),
        save=lambda: ckpt.save(checkpoint_state(calibration, parts, loss_gen, trace)),
        checkpoint_every_s=checkpoint_every_s, progress=Progress(label, steps, cfg.progress_every_s))
    train_s = trace.train_time()

    metrics = metrics_table(trace, ends, problem.task.facts)
    memorisation = None
    if splits.canaries:
        t_mem = time.perf_counter()
        if status == "completed":
            memorisation = problem.task.memorisation(model, splits.canaries, device)
        else:  # a diverged model's exposure means nothing: recorded as not measured
            memorisation = {"space_size": None, "method": "not measured: the run diverged", "canaries": []}
        memorisation["time_s"] = time.perf_counter() - t_mem
    timing = {
        "started_at": started_at,
        "wall_time_s": time.perf_counter() - t_start,
        "train_time_s": train_s,
        "eval_time_s": trace.eval_s,
        "steps_per_second": trace.step / train_s if train_s > 0 else math.nan,
        "resumes": trace.resumes,
    }
    record = run_record(setup, parts, trace, metrics, status, timing)
    if memorisation is not None:
        record["memorisation"] = memorisation
    return RunResult(metrics, record)


def summarize(metrics: pd.DataFrame, task: TaskFacts) -> dict[str, float]:
    """Best and final test metrics; with a validation split also the best validation metrics
    and the test metrics at the epoch that validation picks (by the task's metric, the highest
    or the lowest: accuracy for classifiers, loss for the VAE and the language model), which
    are not selected on the test set."""
    test = metrics[metrics.split == "test"].set_index("epoch")
    val = metrics[metrics.split == "val"].set_index("epoch")
    nan = math.nan
    out = {
        "final_test_loss": float(test["loss"].iloc[-1]) if len(test) else nan,
        "final_test_accuracy": float(test["accuracy"].iloc[-1]) if len(test) else nan,
        "best_test_loss": float(test["loss"].min()) if len(test) else nan,
        "best_test_accuracy": float(test["accuracy"].max()) if len(test) else nan,
    }
    if len(val):
        metric = val[task.metric] if task.select_higher else -val[task.metric]
        metric = metric.replace([np.inf, -np.inf], np.nan)
        epoch = metric.idxmax() if metric.notna().any() else None
        out.update({
            "best_val_loss": float(val["loss"].min()),
            "best_val_accuracy": float(val["accuracy"].max()),
            "test_loss_at_best_val": float(test.loc[epoch, "loss"]) if epoch is not None else nan,
            "test_accuracy_at_best_val": float(test.loc[epoch, "accuracy"]) if epoch is not None else nan,
        })
    return out
