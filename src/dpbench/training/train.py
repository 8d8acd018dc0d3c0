"""One grid cell = one run: data -> model -> privacy calibration -> steps -> metrics.

``run`` reads as those stages, each a function of its own: ``RunConfig`` (the settings,
``config``), ``load_splits`` (the data, ``splits``), ``calibrate`` (the privacy claim: sigma,
timed, ``calibration``), ``harness.assemble`` (the DP step and its
sampler, built exactly as the empirical audit builds them), ``Checkpoint``/``restore`` (resuming
a killed run: ``checkpoint``), ``train_loop`` (steps, evaluation at epoch ends, divergence) and
``run_record`` (the metadata every run file carries). The optimizer comes in as its
``OptimizerSpec``; looking it up by name is the caller's business (the CLI's).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from torch import nn

from dpbench import log
from dpbench.mechanisms.base import Plan, PrivacyClaim
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.plugins import mechanism_origin, record_of
from dpbench.optimizers.stages import own_stages
from dpbench.problems import Problem, get_problem
from dpbench.problems.finetune import start_record
from dpbench.problems.layout import StepLayout
from dpbench.problems.modes import Full, Mode
from dpbench.problems.catalog import TaskFacts
from dpbench.reporting.results import pack_outcomes, provenance
from dpbench.seeds import stream_seeds
from dpbench.training import capture, cuda, schedules
from dpbench.training.calibration import PrivacySection, calibrate, plan_request
from dpbench.training.checkpoint import Checkpoint, Trace, checkpoint_state, restore
from dpbench.training.config import RunConfig, check_data
from dpbench.training.cuda import resolve_device
from dpbench.training.harness import Assembly, assemble, build_model
from dpbench.training.splits import Splits, load_splits

_LOG = log.get(__name__)


@dataclass
class RunResult:
    metrics: pd.DataFrame
    meta: dict[str, Any]


@torch.no_grad()
def evaluate(problem, model, x, y, batch_size: int, seed: int, grouped: bool = False,
             outcomes: list | None = None) -> tuple[float, float]:
    """Mean per-sample test loss and accuracy (NaN for the VAE). The VAE's sampling noise
    comes from a generator reseeded identically at every evaluation. ``grouped``: each batch
    runs in the task's groups (``Task.groups``), the sums the same up to floating-point order.
    ``outcomes``: a list that gets, for a task with an accuracy, each record's correctness (a
    bool tensor in the order of ``x``), the per-record outcomes a paired interval needs."""
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed)
    was_training = model.training
    model.eval()
    total_loss, total_correct = 0.0, 0.0
    record_correct = torch.zeros(x.shape[0], dtype=torch.bool)
    passes = ((i, x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, x.shape[0], batch_size))
    for i, xb, yb in passes:
        for g in (problem.task.groups(xb) if grouped else None) or [slice(None)]:
            losses, correct = problem.per_sample_loss(model, xb[g], yb[g], gen)
            total_loss += losses.double().sum().item()
            if correct is not None:
                total_correct += correct.double().sum().item()
                if outcomes is not None:
                    rows = torch.arange(i, i + xb.shape[0])[g if isinstance(g, slice) else g.cpu()]
                    record_correct[rows] = correct.bool().cpu()
    if outcomes is not None and problem.task.facts.measures_accuracy:
        outcomes.append(record_correct)
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
        _LOG.info(f"[{self.label}] step {step}/{self.total} ({100 * step / self.total:.0f}%) {msg} "
                  f"| {rate:.1f} steps/s | eta {eta:.0f}s")



def epoch_ends(planned_steps: int, epochs: int, steps: int) -> list[int]:
    """The step after which each epoch ends (the last is ``steps``, the steps to take)."""
    return sorted({min(steps, round(e * planned_steps / epochs)) for e in range(1, epochs + 1)})


def diverged(model: nn.Module, trace: Trace) -> bool:
    """A training loss or a parameter that is NaN or infinite."""
    return not torch.isfinite(trace.train_loss[:trace.step].nan_to_num(0.0)).all().item() or not all(
        torch.isfinite(p).all().item() for p in model.parameters())


def train_loop(parts: Assembly, splits: Splits, trace: Trace, ends: list[int],
               evaluate_epoch: Callable[[int, bool], dict], save: Callable[[], None],
               checkpoint_every_s: float, progress: Progress, step: Callable | None = None,
               schedule: Callable[[int], None] | None = None) -> str:
    """Steps from ``trace.step`` to the last epoch end, evaluating at each epoch end; saves
    (``save``) at every epoch end but the last and every ``checkpoint_every_s`` seconds.
    Returns the status: "completed", or "diverged" at the first epoch end with a non-finite
    loss or parameter (the run stops there and saves nothing more). ``step`` stands in for
    ``parts.step`` (its captured form, ``training.capture``); ``schedule(t)``, where given, sets the
    learning rate of step t (0-based) before it runs (``training.schedules``)."""
    step = step or parts.step
    trace.start_session()
    last_save = time.perf_counter()
    for epoch, end in enumerate(ends, start=1):
        if trace.step >= end:
            continue  # finished before the checkpoint
        while trace.step < end:
            idx = parts.sampler.sample()
            if schedule is not None:
                schedule(trace.step)
            trace.record(idx.numel(), step(splits.x_train[idx], splits.y_train[idx]))
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
                    is_diverged: bool, batch_size: int, seed: int, grouped: bool = False) -> dict:
    """Validation (if any) and test metrics at an epoch end, appended to the trace; returns
    the test row. A diverged model is not evaluated: its loss is infinite. ``grouped``: as
    ``evaluate``'s."""
    t_eval = time.perf_counter()
    for split, x, y in (("val", splits.x_val, splits.y_val), ("test", splits.x_test, splits.y_test)):
        if x is None:
            continue
        outcomes = [] if split == "test" else None
        loss, acc = ((math.inf, math.nan) if is_diverged
                     else evaluate(problem, model, x, y, batch_size, seed, grouped, outcomes))
        if outcomes:
            trace.test_correct[epoch] = pack_outcomes(outcomes[0])
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
    claim: PrivacyClaim  # sigma calibrated (or given), and how long calibrating took
    checkpoint: Any = None  # a loaded public start the model starts from (None: from scratch)
    mode: Mode | None = None  # its fine-tuning mode
    text_file: dict | None = None  # a user's labelled text file's record (labelled_text.LabelledText.record)


def read_text_file(cfg: RunConfig):
    """The user's labelled text file (``cfg.text_source``) read and checked, or None; a SHA-256
    other than ``cfg.text_sha256`` (the one the workflow read with the config) refused naming both."""
    if cfg.text_source is None:
        return None
    from dpbench.data.labelled_text import DataError, load

    data = load(cfg.text_source)
    if cfg.text_sha256 is not None and data.sha256 != cfg.text_sha256:
        raise DataError(f"{data.path}: SHA-256 {data.sha256} is not {cfg.text_sha256}, the one the config's "
                        "text_file had when the workflow read it: the file changed since")
    return data


def run_record(setup: Setup, parts: Assembly, trace: Trace, metrics: pd.DataFrame, status: str,
               timing: dict[str, Any]) -> dict[str, Any]:
    """The run's metadata: its configuration, problem, its start (from scratch, or a public
    checkpoint: file, SHA-256, recipe, no privacy spent by pretraining; the fine-tuning mode and
    the trained parameter count), optimizer, data, the privacy promised (target epsilon,
    sigma, q, T, delta) and delivered (epsilon for the steps taken), the result, the timing and
    the environment."""
    cfg, spec, problem, splits = setup.cfg, setup.spec, setup.problem, setup.splits
    ctx, private = parts.context, spec.private
    return {
        "config": asdict(cfg),
        "problem": {"id": problem.id, "dataset": problem.dataset, "task": problem.task.name, "metric": problem.metric,
                    "parameters": sum(p.numel() for p in ctx.model.parameters()), "plugin": record_of(problem)},
        "start": start_record(setup.checkpoint, setup.mode or Full(), ctx.model),
        # plugin: distribution, version, entry point and source hash (dpbench.plugins); None: built-in
        "optimizer": {"name": spec.name, "private": private, "description": spec.description,
                      "reference": spec.reference, "hyperparameters": ctx.hyperparameters, "stats": trace.stats,
                      "plugin": record_of(spec)},
        "data": {"source": splits.source, "n_train": splits.x_train.shape[0], "n_test": int(splits.x_test.shape[0]),
                 "n_val": int(splits.x_val.shape[0]) if splits.x_val is not None else 0,
                 **({"file": setup.text_file} if setup.text_file is not None else {})},
        "privacy": privacy_section(setup, parts, trace.step).run_file(),
        "result": {"status": status, **summarize(metrics, problem.task.facts)},
        # each test record's correctness at the epoch validation chose (results.pack_outcomes;
        # docs/results.md): released model and test set, post-processing as the accuracy is
        **test_outcomes(trace, metrics, problem.task.facts, int(splits.x_test.shape[0])),
        "timing": timing,
        "environment": {**provenance(), "device": str(setup.device), "torch_threads": torch.get_num_threads(),
                        **({"cuda": cuda.settings(), "gpu": torch.cuda.get_device_name(setup.device)}
                           if setup.device.type == "cuda" else {}),
                        "seeds": setup.seeds},
    }


def privacy_section(setup: Setup, parts: Assembly, steps: int) -> PrivacySection:
    """The run's privacy section after ``steps`` steps: its claim's record (the mechanism's),
    what its private step fixed, and the search a candidate belongs to (what it spends in all)."""
    cfg, spec, plan, claim = setup.cfg, setup.spec, setup.plan, setup.claim
    ctx, private = parts.context, spec.private
    tuning = None
    if cfg.tuning and private:
        from dpbench.training.tuning import record as search_record

        tuning = search_record(spec, claim, cfg.tuning)
    return PrivacySection(
        claim.record(steps), mechanism_origin(spec.mechanism),
        clip_norm=cfg.clip_norm if private else None,
        normalize_clipping=cfg.normalize_clipping if private else None,
        sensitivity=ctx.clipping.sensitivity if private else None,
        noise_std_mean_gradient=getattr(parts.step, "noise_std", 0.0) / plan.batch_size if private else 0.0,
        caveat=spec.caveat, stages=own_stages(type(parts.step)) if private else None,
        step_class=f"{type(parts.step).__module__}.{type(parts.step).__qualname__}" if private else None,
        step=parts.step.privacy_record() if private else {}, tuning=tuning)


def run(cfg: RunConfig, spec: OptimizerSpec, *, checkpoint: str | Path | None = None,
        checkpoint_every_s: float = 600.0, code_key: str | None = None, pretrained=None) -> RunResult:
    """Train one cell with the optimizer ``spec`` (the registry's entry for ``cfg.optimizer``).
    With ``checkpoint``, state is saved there at every epoch end and every
    ``checkpoint_every_s`` seconds, and a run killed earlier continues from it, ending with
    the same metrics as an uninterrupted run; ``code_key`` (a hash of the code that trains
    it) makes a checkpoint of other code stale. ``pretrained``: a loaded public start to
    fine-tune under the settings' mode (``cfg.mode``, ``harness.build_model``)."""
    cfg.validate(spec)
    mode = cfg.mode
    t_start = time.perf_counter()
    started_at = pd.Timestamp.now(tz="UTC").isoformat()
    problem = get_problem(cfg.problem)
    text_data = read_text_file(cfg)
    device = resolve_device(cfg.device)
    if hasattr(pretrained, "bind"):  # a start that reads the records itself (an encoder's tokenizer)
        # how its steps are laid out, chosen once (problems.layout: groups on the CPU, a prefix store)
        problem = pretrained.bind(problem, mode, StepLayout.choose(mode, device.type, cfg.prefix_store), data=text_data)
    if text_data is not None:
        check_data(cfg.problem, cfg.train_subset, cfg.test_subset, cfg.validation_size, problem.facts)
    if cfg.prefix_store is not None:  # made here, under a lock, where no workflow made it first
        from dpbench.problems import prefix_store

        prefix_store.ensure_store(cfg.prefix_store, lambda path: prefix_store.make_store(
            path, pretrained, problem, mode, cfg.data_dir, log=_LOG.info), log=_LOG.info)
    if device.type == "cuda":
        cuda.configure()  # IEEE float32 (no TF32) and deterministic kernels: dpbench.training.cuda
    seeds = stream_seeds(cfg.seed)
    splits = load_splits(cfg, problem, seeds, device)
    n_train = splits.x_train.shape[0]
    ckpt = Checkpoint(checkpoint, cfg, code_key)
    saved = ckpt.load()

    # The privacy setting (batches, steps, sample rate) comes from the optimizer's mechanism.
    plan = spec.mechanism.plan(plan_request(cfg, n_train))
    claim = (PrivacyClaim(spec.mechanism, plan, saved["sigma"], cfg.delta, cfg.accountant, cfg.epsilon,
                          saved["sigma_source"], saved["calibration_s"], spec.private) if saved
             else calibrate(spec, plan, target_epsilon=cfg.epsilon, noise_multiplier=cfg.noise_multiplier,
                            delta=cfg.delta, accountant=cfg.accountant, tuning=cfg.tuning))
    setup = Setup(cfg, spec, problem, device, seeds, splits, plan, claim, pretrained, mode,
                  None if text_data is None else text_data.record())

    model = build_model(problem, seeds["init"], device, pretrained, mode)
    loss_gen = torch.Generator(device=device)
    loss_gen.manual_seed(seeds["loss"])
    # Groups (Task.groups) where the step's layout has them (problems.layout: on the CPU; on a GPU one
    # padded pass): the bound encoder task's, chosen once above, else the device's
    layout = getattr(problem.task, "layout", None) or StepLayout.choose(mode, device.type)
    grouped = layout.groups
    parts = assemble(spec, plan, model, lambda m, x, y: problem.per_sample_loss(m, x, y, loss_gen), lr=cfg.lr,
                     noise_multiplier=claim.noise_multiplier, clip_norm=cfg.clip_norm,
                     normalize_clipping=cfg.normalize_clipping, hyperparameters=cfg.hyperparameters,
                     noise_seed=seeds["noise"], sampler_seed=seeds["sampler"], n_train=n_train, device=device,
                     groups=problem.task.groups if grouped else None, piece_size=cfg.physical_batch_size)
    # a noise source whose state is secret (streamed correlated noise) makes checkpoints private files
    ckpt.private = bool(getattr(parts.context.noise, "private_state", False))
    steps = plan.steps if cfg.max_steps is None else min(plan.steps, cfg.max_steps)
    trace = Trace.empty(steps, device)
    if saved:
        restore(saved, parts, loss_gen, trace)

    if cfg.lr_schedule != schedules.DEFAULT:
        schedules.check_rule(parts.step.rule, spec.name)
    stepper, capture_record = capture.for_run(
        cfg.cuda_graphs, parts.step, problem, parts.sampler, device,
        loss_fn=lambda m, x, y: problem.task.fixed_shape_loss(m, x, y, loss_gen))
    ends = epoch_ends(plan.steps, cfg.epochs, steps)
    label = f"{cfg.problem} {cfg.optimizer} lr={cfg.lr:g} L={plan.batch_size} eps={cfg.epsilon} seed={cfg.seed}"
    _LOG.info(f"[{label}] N={n_train} q={plan.sample_rate} T={plan.steps} steps={steps} sigma={claim.noise_multiplier:.6g} "
              f"({claim.source}) device={device}" + (f", resumed at step {trace.step}" if saved else ""))
    status = train_loop(
        parts, splits, trace, ends,
        evaluate_epoch=lambda epoch, is_diverged: evaluate_splits(problem, model, splits, trace, epoch, is_diverged,
                                                                  cfg.eval_batch_size, seeds["eval"], grouped),
        save=lambda: ckpt.save(checkpoint_state(claim, parts, loss_gen, trace)),
        checkpoint_every_s=checkpoint_every_s, progress=Progress(label, steps, cfg.progress_every_s), step=stepper,
        schedule=None if cfg.lr_schedule == schedules.DEFAULT else
        lambda t: schedules.apply(parts.step.rule, cfg.lr, cfg.lr_schedule, t, plan.steps))
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
    if cfg.cuda_graphs:  # how the steps ran: captured, padded or eager (and why)
        timing["cuda_graphs"] = capture_record()
    if cfg.physical_batch_size is not None:  # how the steps ran: each logical batch in pieces of at most P
        timing["physical_batch_size"] = cfg.physical_batch_size
    record = run_record(setup, parts, trace, metrics, status, timing)
    if getattr(problem.task, "layout", None) is not None:  # an encoder problem's: how its steps ran
        record["layout"] = layout.record()
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
    epoch = best_val_epoch(metrics, task)
    out = {
        "final_test_loss": float(test["loss"].iloc[-1]) if len(test) else nan,
        "final_test_accuracy": float(test["accuracy"].iloc[-1]) if len(test) else nan,
        "best_test_loss": float(test["loss"].min()) if len(test) else nan,
        "best_test_accuracy": float(test["accuracy"].max()) if len(test) else nan,
    }
    if len(val):
        out.update({
            "best_val_loss": float(val["loss"].min()),
            "best_val_accuracy": float(val["accuracy"].max()),
            "test_loss_at_best_val": float(test.loc[epoch, "loss"]) if epoch is not None else nan,
            "test_accuracy_at_best_val": float(test.loc[epoch, "accuracy"]) if epoch is not None else nan,
        })
    return out


def best_val_epoch(metrics: pd.DataFrame, task: TaskFacts) -> int | None:
    """The epoch whose validation metric is best (the task's: the highest accuracy or the lowest
    loss; the first of equal ones), None without a validation split or a finite value."""
    val = metrics[metrics.split == "val"].set_index("epoch")
    if not len(val):
        return None
    metric = val[task.metric] if task.select_higher else -val[task.metric]
    metric = metric.replace([np.inf, -np.inf], np.nan)
    return metric.idxmax() if metric.notna().any() else None


def test_outcomes(trace: Trace, metrics: pd.DataFrame, task: TaskFacts, n_test: int) -> dict:
    """The run record's ``test_outcomes`` section: each test record's correctness at the epoch
    validation chose (``best_val_epoch``), packed (``results.pack_outcomes``), with the count of
    records; {} for a task without an accuracy, without a validation split, or where that
    epoch was not evaluated here (a run resumed from a checkpoint older than the outcomes)."""
    epoch = best_val_epoch(metrics, task)
    if not task.measures_accuracy or epoch is None or int(epoch) not in trace.test_correct:
        return {}
    return {"test_outcomes": {"correct_at_best_val": trace.test_correct[int(epoch)], "n_test": n_test,
                              "epoch": int(epoch)}}
