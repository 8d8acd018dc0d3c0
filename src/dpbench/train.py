"""One grid cell = one run: data -> model -> privacy calibration -> steps -> metrics."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
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


def run(cfg: RunConfig) -> RunResult:
    cfg.validate()
    t_start = time.perf_counter()
    started_at = pd.Timestamp.now(tz="UTC").isoformat()
    spec = get_optimizer(cfg.optimizer)
    problem = get_problem(cfg.problem)
    hyper = spec.hyperparameters(cfg.hyperparameters)
    device = resolve_device(cfg.device)
    seeds = stream_seeds(cfg.seed)

    ds = data.load(problem.dataset, cfg.data_dir)
    train_idx = _subset(len(ds.train_labels), cfg.train_subset, seeds["subset"])
    test_idx = _subset(len(ds.test_labels), cfg.test_subset, seeds["subset"] + 1)
    pick = lambda a, idx: a if idx is None else a[idx]  # noqa: E731
    x_train = problem.preprocess(pick(ds.train_images, train_idx)).to(device)
    y_train = torch.from_numpy(pick(ds.train_labels, train_idx)).to(device)
    x_test = problem.preprocess(pick(ds.test_images, test_idx)).to(device)
    y_test = torch.from_numpy(pick(ds.test_labels, test_idx)).to(device)
    n_train = x_train.shape[0]

    # The privacy setting (batches, steps, sample rate) comes from the optimizer's mechanism.
    mechanism = spec.mechanism
    plan = mechanism.plan(n_train, cfg.batch_size, cfg.epochs, cfg)
    L, planned_steps = plan.batch_size, plan.steps
    steps = planned_steps if cfg.max_steps is None else min(planned_steps, cfg.max_steps)
    t0 = time.perf_counter()
    if not spec.private:
        sigma, sigma_source = 0.0, "none (non-private)"
    elif cfg.noise_multiplier is not None:
        sigma, sigma_source = float(cfg.noise_multiplier), "given"
    else:
        sigma, sigma_source = mechanism.calibrate(plan, cfg.epsilon, cfg.delta, cfg.accountant), "calibrated"
    calibration_s = time.perf_counter() - t0

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
    epoch_ends = sorted({min(steps, round(e * planned_steps / cfg.epochs)) for e in range(1, cfg.epochs + 1)})
    test_rows: list[dict] = []
    label = f"{cfg.problem} {cfg.optimizer} lr={cfg.lr:g} L={L} eps={cfg.epsilon} seed={cfg.seed}"
    progress = Progress(label, steps, cfg.progress_every_s)
    print(f"[{label}] N={n_train} q={plan.sample_rate} T={planned_steps} steps={steps} sigma={sigma:.6g} ({sigma_source}) "
          f"device={device}", file=sys.stderr, flush=True)

    status, step, eval_s, stats = "completed", 0, 0.0, {}
    train_t0 = time.perf_counter()
    for epoch, end in enumerate(epoch_ends, start=1):
        while step < end:
            idx = sampler.sample()
            out = step_fn(x_train[idx], y_train[idx])
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
        diverged = not torch.isfinite(train_loss[:step].nan_to_num(0.0)).all().item() or not all(
            torch.isfinite(p).all().item() for p in model.parameters())
        t_eval = time.perf_counter()
        if diverged:
            status = "diverged"
            test_loss, test_acc = math.inf, math.nan
        else:
            test_loss, test_acc = evaluate(problem, model, x_test, y_test, cfg.eval_batch_size, seeds["eval"])
        eval_s += time.perf_counter() - t_eval
        test_rows.append({"split": "test", "step": step, "epoch": epoch, "loss": test_loss,
                          "accuracy": test_acc, "batch_size": x_test.shape[0]})
        progress(step, f"epoch {epoch} test loss {test_loss:.4g} acc {test_acc:.4f}")
        if diverged:
            break
    train_s = time.perf_counter() - train_t0 - eval_s

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
    metrics = pd.concat([train_df, pd.DataFrame(test_rows)], ignore_index=True)
    metrics = metrics.astype({"step": "int64", "epoch": "int64", "batch_size": "int64",
                              "loss": "float64", "accuracy": "float64"})

    privacy = mechanism.report(plan, sigma, steps_done, cfg.delta, cfg.accountant) if spec.private else {}
    test = metrics[metrics.split == "test"]
    meta = {
        "config": asdict(cfg),
        "problem": {"id": problem.id, "dataset": problem.dataset, "task": problem.task, "metric": problem.metric,
                    "parameters": sum(p.numel() for p in model.parameters())},
        "optimizer": {"name": spec.name, "private": spec.private, "description": spec.description,
                      "reference": spec.reference, "hyperparameters": hyper, "stats": stats},
        "data": {"source": ds.source, "n_train": n_train, "n_test": int(x_test.shape[0])},
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
        "result": {
            "status": status,
            "final_test_loss": float(test["loss"].iloc[-1]) if len(test) else math.nan,
            "final_test_accuracy": float(test["accuracy"].iloc[-1]) if len(test) else math.nan,
            "best_test_loss": float(test["loss"].min()) if len(test) else math.nan,
            "best_test_accuracy": float(test["accuracy"].max()) if len(test) else math.nan,
        },
        "timing": {
            "started_at": started_at,
            "wall_time_s": time.perf_counter() - t_start,
            "train_time_s": train_s,
            "eval_time_s": eval_s,
            "steps_per_second": steps_done / train_s if train_s > 0 else math.nan,
        },
        "environment": {**provenance(), "device": str(device), "torch_threads": torch.get_num_threads(),
                        "seeds": seeds},
    }
    return RunResult(metrics, meta)
