"""One grid cell = one run: data -> model -> privacy calibration -> steps -> metrics."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from dpbench import accounting, data
from dpbench.clipping import Clipping, NoClipping
from dpbench.optimizers import get_optimizer
from dpbench.optimizers.base import Context
from dpbench.problems import get_problem
from dpbench.results import provenance

# The independent random streams of a run, each seeded from SeedSequence(seed).spawn(...).
STREAMS = ("init", "sampler", "noise", "loss", "subset", "eval")


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
    accountant: str = "prv"
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

    def validate(self) -> None:
        spec = get_optimizer(self.optimizer)
        get_problem(self.problem)
        for name in ("lr", "batch_size", "epochs", "delta", "clip_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if spec.private and self.noise_multiplier is None and self.epsilon is None:
            raise ValueError(f"optimizer {self.optimizer!r} is private: give --epsilon or --noise-multiplier")
        if self.noise_multiplier is not None and self.noise_multiplier < 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if self.validation_size < 0:
            raise ValueError(f"validation_size must be >= 0, got {self.validation_size}")
        if self.epsilon is not None and not self.epsilon > 0:
            raise ValueError(f"epsilon must be positive, got {self.epsilon}")
        spec.hyperparameters(self.hyperparameters)


@dataclass
class RunResult:
    metrics: pd.DataFrame
    meta: dict[str, Any]


def stream_seeds(seed: int) -> dict[str, int]:
    """Independent 63-bit seeds for each random stream of a run (numpy SeedSequence)."""
    children = np.random.SeedSequence(seed).spawn(len(STREAMS))
    return {name: int(c.generate_state(1, np.uint64)[0] >> np.uint64(1)) for name, c in zip(STREAMS, children)}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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
    return total_loss / n, (total_correct / n if problem.task == "classification" else math.nan)


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


def load_splits(cfg: RunConfig, problem, seeds: dict[str, int], device) -> Splits:
    ds = data.load(problem.dataset, cfg.data_dir)
    train_idx = _subset(len(ds.train_labels), cfg.train_subset, seeds["subset"])
    test_idx = _subset(len(ds.test_labels), cfg.test_subset, seeds["subset"] + 1)
    val_idx = None
    if cfg.validation_size:
        pool = np.arange(len(ds.train_labels)) if train_idx is None else train_idx
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

    x_train, y_train = tensors(ds.train_images, ds.train_labels, train_idx)
    x_val, y_val = tensors(ds.train_images, ds.train_labels, val_idx) if val_idx is not None else (None, None)
    x_test, y_test = tensors(ds.test_images, ds.test_labels, test_idx)
    return Splits(x_train, y_train, x_val, y_val, x_test, y_test, ds.source)


# Settings that do not change a run's result: a checkpoint made under other values still applies.
VOLATILE = ("progress_every_s", "data_dir", "cache_dir", "factorization", "noise_file", "eval_batch_size")


class Checkpoint:
    """Everything needed to continue a run exactly where it stopped: model, optimizer and noise
    state, sampler and loss RNGs, and the metrics so far. Written atomically; a checkpoint of
    another configuration is ignored (with a message), never silently reused."""

    def __init__(self, path: str | Path | None, cfg: RunConfig):
        from dpbench.fingerprint import optimizer_fingerprint

        self.path = Path(path) if path else None
        self.key = None
        if self.path is not None:
            # the configuration and the code that trains it: a checkpoint made by other code is stale
            self.key = {k: v for k, v in asdict(cfg).items() if k not in VOLATILE}
            self.key["code"] = optimizer_fingerprint(cfg.optimizer)

    def load(self) -> dict | None:
        if self.path is None or not self.path.exists():
            return None
        state = torch.load(self.path, map_location="cpu", weights_only=False)
        if state.get("key") != self.key:
            print(f"checkpoint {self.path} belongs to another configuration; starting afresh",
                  file=sys.stderr, flush=True)
            return None
        return state

    def save(self, state: dict) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        torch.save({"key": self.key, **state}, tmp)
        os.replace(tmp, self.path)


def run(cfg: RunConfig, checkpoint: str | Path | None = None, checkpoint_every_s: float = 600.0) -> RunResult:
    """Train one cell. With ``checkpoint``, state is saved there at every epoch end and every
    ``checkpoint_every_s`` seconds, and a run killed earlier continues from it, ending with
    the same metrics as an uninterrupted run."""
    cfg.validate()
    t_start = time.perf_counter()
    started_at = pd.Timestamp.now(tz="UTC").isoformat()
    spec = get_optimizer(cfg.optimizer)
    problem = get_problem(cfg.problem)
    hyper = spec.hyperparameters(cfg.hyperparameters)
    device = resolve_device(cfg.device)
    seeds = stream_seeds(cfg.seed)
    splits = load_splits(cfg, problem, seeds, device)
    n_train = splits.x_train.shape[0]
    ckpt = Checkpoint(checkpoint, cfg)
    saved = ckpt.load()

    # The privacy setting (batches, steps, sample rate) comes from the optimizer's mechanism.
    mechanism = spec.mechanism
    plan = mechanism.plan(n_train, cfg.batch_size, cfg.epochs, cfg)
    L, planned_steps = plan.batch_size, plan.steps
    steps = planned_steps if cfg.max_steps is None else min(planned_steps, cfg.max_steps)
    t0 = time.perf_counter()
    if saved:
        sigma, sigma_source = saved["sigma"], saved["sigma_source"]
    elif not spec.private:
        sigma, sigma_source = 0.0, "none (non-private)"
    elif cfg.noise_multiplier is not None:
        sigma, sigma_source = float(cfg.noise_multiplier), "given"
    else:
        sigma, sigma_source = mechanism.calibrate(plan, cfg.epsilon, cfg.delta, cfg.accountant), "calibrated"
    calibration_s = saved["calibration_s"] if saved else time.perf_counter() - t0

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seeds["init"])
        model = problem.build()
    model.to(device).train()
    clipping = Clipping(cfg.clip_norm, cfg.normalize_clipping) if spec.private else NoClipping()
    loss_gen = torch.Generator(device=device)
    loss_gen.manual_seed(seeds["loss"])
    ctx = Context(
        model=model,
        loss_fn=lambda m, x, y: problem.per_sample_loss(m, x, y, loss_gen),
        lr=cfg.lr,
        expected_batch_size=L,
        noise_multiplier=sigma,
        clipping=clipping,
        noise=mechanism.noise(plan, seeds["noise"], device),
        steps=planned_steps,
        hyperparameters=hyper,
    )
    step_fn = spec.build(ctx)
    sampler = mechanism.sampler(plan, n_train, seeds["sampler"], device)

    # Per-step metrics stay on the device until an epoch ends (no sync per step).
    train_loss = torch.full((steps,), math.nan, dtype=torch.float64, device=device)
    train_correct = torch.zeros(steps, dtype=torch.float64, device=device)
    batch_sizes = torch.zeros(steps, dtype=torch.int64, device=device)
    progress_state = {"step": 0, "eval_rows": [], "stats": {}, "eval_s": 0.0, "train_s": 0.0, "resumes": 0}
    if saved:
        model.load_state_dict(saved["model"])
        step_fn.load_state_dict(saved["step_fn"])
        sampler.load_state_dict(saved["sampler"])
        loss_gen.set_state(saved["loss_gen"])
        for buffer, name in ((train_loss, "train_loss"), (train_correct, "train_correct"),
                             (batch_sizes, "batch_sizes")):
            buffer.copy_(saved[name])
        progress_state = {**saved["progress"], "resumes": saved["progress"]["resumes"] + 1}

    def save_checkpoint():
        ckpt.save({"sigma": sigma, "sigma_source": sigma_source, "calibration_s": calibration_s,
                   "model": model.state_dict(), "step_fn": step_fn.state_dict(), "sampler": sampler.state_dict(),
                   "loss_gen": loss_gen.get_state(), "train_loss": train_loss.cpu(),
                   "train_correct": train_correct.cpu(), "batch_sizes": batch_sizes.cpu(),
                   "progress": {**progress_state, "step": step, "train_s": train_time()}})

    def train_time() -> float:
        """Training seconds so far, over every session of this run, evaluation excluded."""
        return progress_state["train_s"] + time.perf_counter() - session_t0 - (progress_state["eval_s"] - eval_s0)

    epoch_ends = sorted({min(steps, round(e * planned_steps / cfg.epochs)) for e in range(1, cfg.epochs + 1)})
    label = f"{cfg.problem} {cfg.optimizer} lr={cfg.lr:g} L={L} eps={cfg.epsilon} seed={cfg.seed}"
    progress = Progress(label, steps, cfg.progress_every_s)
    step, stats = progress_state["step"], progress_state["stats"]
    print(f"[{label}] N={n_train} q={plan.sample_rate} T={planned_steps} steps={steps} sigma={sigma:.6g} "
          f"({sigma_source}) device={device}" + (f", resumed at step {step}" if saved else ""),
          file=sys.stderr, flush=True)

    session_t0, eval_s0 = time.perf_counter(), progress_state["eval_s"]
    status = "completed"
    last_save = time.perf_counter()
    for epoch, end in enumerate(epoch_ends, start=1):
        if step >= end:
            continue  # finished before the checkpoint
        while step < end:
            idx = sampler.sample()
            out = step_fn(splits.x_train[idx], splits.y_train[idx])
            batch_sizes[step] = idx.numel()
            for key, value in out.stats.items():
                stats[key] = stats.get(key, 0.0) + value
            if out.losses.numel():
                train_loss[step] = out.losses.double().mean()
                if out.correct is not None:
                    train_correct[step] = out.correct.double().mean()
            step += 1
            if progress.due():
                progress(step, f"epoch {epoch}/{len(epoch_ends)} loss {train_loss[step - 1].item():.4g}")
            if step < end and time.perf_counter() - last_save > checkpoint_every_s:
                save_checkpoint()
                last_save = time.perf_counter()
        diverged = not torch.isfinite(train_loss[:step].nan_to_num(0.0)).all().item() or not all(
            torch.isfinite(p).all().item() for p in model.parameters())
        t_eval = time.perf_counter()
        for split, x, y in (("val", splits.x_val, splits.y_val), ("test", splits.x_test, splits.y_test)):
            if x is None:
                continue
            loss, acc = (math.inf, math.nan) if diverged else evaluate(problem, model, x, y, cfg.eval_batch_size,
                                                                       seeds["eval"])
            progress_state["eval_rows"].append({"split": split, "step": step, "epoch": epoch, "loss": loss,
                                                "accuracy": acc, "batch_size": x.shape[0]})
        progress_state["eval_s"] += time.perf_counter() - t_eval
        test_row = progress_state["eval_rows"][-1]
        progress(step, f"epoch {epoch} test loss {test_row['loss']:.4g} acc {test_row['accuracy']:.4f}")
        if diverged:
            status = "diverged"  # a diverged run saves no checkpoint: it ends here
            break
        if step < steps:
            save_checkpoint()
            last_save = time.perf_counter()
    train_s, eval_s = train_time(), progress_state["eval_s"]

    steps_done = step
    epoch_of_step = np.searchsorted(np.array(epoch_ends), np.arange(1, steps_done + 1)) + 1
    train_df = pd.DataFrame({
        "split": "train",
        "step": np.arange(1, steps_done + 1),
        "epoch": epoch_of_step,
        "loss": train_loss[:steps_done].cpu().numpy(),
        "accuracy": (train_correct[:steps_done].cpu().numpy() if problem.task == "classification"
                     else np.full(steps_done, math.nan)),
        "batch_size": batch_sizes[:steps_done].cpu().numpy(),
    })
    if problem.task == "classification":
        train_df.loc[train_df["batch_size"] == 0, "accuracy"] = math.nan
    metrics = pd.concat([train_df, pd.DataFrame(progress_state["eval_rows"])], ignore_index=True)
    metrics = metrics.astype({"step": "int64", "epoch": "int64", "batch_size": "int64",
                              "loss": "float64", "accuracy": "float64"})

    privacy = ({**mechanism.report(plan, sigma, steps_done, cfg.delta, cfg.accountant), **step_fn.privacy_record()}
               if spec.private else {})
    meta = {
        "config": asdict(cfg),
        "problem": {"id": problem.id, "dataset": problem.dataset, "task": problem.task, "metric": problem.metric,
                    "parameters": sum(p.numel() for p in model.parameters())},
        "optimizer": {"name": spec.name, "private": spec.private, "description": spec.description,
                      "reference": spec.reference, "hyperparameters": hyper, "stats": stats},
        "data": {"source": splits.source, "n_train": n_train, "n_test": int(splits.x_test.shape[0]),
                 "n_val": int(splits.x_val.shape[0]) if splits.x_val is not None else 0},
        "privacy": {
            "mechanism": mechanism.name if spec.private else None,
            "noise_multiplier": sigma,
            "noise_multiplier_source": sigma_source,
            "sample_rate": plan.sample_rate if spec.private else None,
            "planned_steps": planned_steps,
            "steps": steps_done,
            "delta": cfg.delta if spec.private else None,
            "target_epsilon": cfg.epsilon if spec.private else None,
            "epsilon": privacy.pop("epsilon", math.inf),
            "epsilon_planned": privacy.pop("epsilon_planned", math.inf),
            "epsilon_rdp": privacy.pop("epsilon_rdp", math.inf),
            "accountant": cfg.accountant if spec.private else None,
            "clip_norm": cfg.clip_norm if spec.private else None,
            "normalize_clipping": cfg.normalize_clipping if spec.private else None,
            "sensitivity": clipping.sensitivity if spec.private else None,
            "noise_std_mean_gradient": getattr(step_fn, "noise_std", 0.0) / L if spec.private else 0.0,
            "caveat": spec.caveat,
            "calibration_time_s": calibration_s,
            **privacy,
        },
        "result": {"status": status, **summarize(metrics, problem.task)},
        "timing": {
            "started_at": started_at,
            "wall_time_s": time.perf_counter() - t_start,
            "train_time_s": train_s,
            "eval_time_s": eval_s,
            "steps_per_second": steps_done / train_s if train_s > 0 else math.nan,
            "resumes": progress_state["resumes"],
        },
        "environment": {**provenance(), "device": str(device), "torch_threads": torch.get_num_threads(),
                        "seeds": seeds},
    }
    return RunResult(metrics, meta)


def summarize(metrics: pd.DataFrame, task: str) -> dict[str, float]:
    """Best and final test metrics; with a validation split also the best validation metrics
    and the test metrics at the epoch that validation picks (accuracy for classifiers, loss
    for the VAE), which are not selected on the test set."""
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
        metric = val["accuracy"] if task == "classification" else -val["loss"]
        metric = metric.replace([np.inf, -np.inf], np.nan)
        epoch = metric.idxmax() if metric.notna().any() else None
        out.update({
            "best_val_loss": float(val["loss"].min()),
            "best_val_accuracy": float(val["accuracy"].max()),
            "test_loss_at_best_val": float(test.loc[epoch, "loss"]) if epoch is not None else nan,
            "test_accuracy_at_best_val": float(test.loc[epoch, "accuracy"]) if epoch is not None else nan,
        })
    return out
