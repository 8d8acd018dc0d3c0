"""Many run files -> two tables anyone can read with pandas or DuckDB:

* runs: one row per run (settings, privacy promised and delivered, best and final metrics,
  status, timing), hyperparameters as a JSON string;
* epochs: one row per run and epoch (test and validation loss/accuracy, mean training
  loss/accuracy), with its run's settings (``RUN_KEYS``: what the run is, as RunConfig's
  fields declare it, and its seed).

Language models (P4) add to the runs table the final training and validation loss, the
validation perplexity exp(best_val_loss), and from the run's memorisation test (metadata key
``memorisation``: canaries inserted ``repeats`` = k times into the training text, each with its
exposure, Carlini et al. 2019, "The Secret Sharer", arXiv:1802.08232) per k in
``CANARY_REPEATS``: ``exposure_k<k>`` (mean over that k's canaries), ``exposure_std_k<k>``
(their std, ddof = 0, so that figures can pool seeds and canaries exactly), ``canaries_k<k>``
(how many) and ``extracted_k<k>`` (the share whose secret was extracted). Runs without a
memorisation test have NaN there and 0 canaries.

Every run says where its model started (``start_columns``, from the run record's ``start``
section, ``dpbench.problems.finetune.start_record``): ``start`` ("public": a checkpoint
pretrained on public text; "scratch"), ``finetune`` (the fine-tuning mode of a public start;
"scratch" for a from-scratch run of a problem that starts from a checkpoint, P5 and P6: the
twin its fine-tuned runs are compared with; None for P1-P4), ``lora_rank``,
``trainable_parameters`` (d) and ``checkpoint_sha256``. Run files written before the section
existed have None there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from dpbench.problems.catalog import CANARY_REPEATS, FACTS, task_facts
from dpbench.problems.modes import SCRATCH, option_settings
from dpbench.reporting.audits import violations
from dpbench.reporting.results import DamagedFileError, dp_guarantee, is_private, read_run, record_error
from dpbench.training.config import RunConfig
from dpbench.training.settings import block_settings, settings

# RunConfig's train settings that a grid block may set per block (pipeline.blocks.BLOCK_SETTINGS),
# as its fields declare them: the runs table's columns of the data a run trained on and its step cap
DATA_KEYS = tuple(block_settings(RunConfig))
# The runs table's column of each setting that says what a run is (RunConfig's configuration keys,
# as its fields declare them, and the seed): the setting's name, but epsilon's column is the target
# (the achieved epsilon is a column of its own)
SETTING_COLUMNS = {s.name: "target_epsilon" if s.name == "epsilon" else s.name for s in settings(RunConfig)
                   if s.configuration or s.name == "seed"}
# The per-epoch table's columns of its run: what the run is, and whose privacy claim it carries
RUN_KEYS = [*SETTING_COLUMNS.values(), "private", "mechanism_origin"]
# Columns computed from private data without noise (results.NOT_PRIVATE): marked private: false.
_VAL = "not differentially private: computed on the validation split, held-out training examples"
RUNS_NOT_PRIVATE = {
    "best_val_accuracy": _VAL, "best_val_loss": _VAL,
    "test_accuracy_at_best_val": "not differentially private: the epoch is chosen on the validation split "
                                 "(training examples) without noise",
    "test_loss_at_best_val": "not differentially private: the epoch is chosen on the validation split",
    "test_correct_at_best_val": "not differentially private: the epoch is chosen on the validation split "
                                "(training examples) without noise",
    "status": "not differentially private when diverged: decided from the private training losses",
}
_CANARY = ("not differentially private: computed from the canaries inserted into the training data "
           "(their secrets) and the model")
RUNS_NOT_PRIVATE.update({
    "final_val_loss": _VAL, "val_perplexity": _VAL,
    "final_train_loss": "not differentially private: mean loss on the private training batches of the last epoch",
    **{f"{c}_k{k}": _CANARY for k in CANARY_REPEATS for c in ("exposure", "exposure_std", "extracted")},
})
EPOCHS_NOT_PRIVATE = {
    "val_loss": _VAL, "val_accuracy": _VAL,
    "train_loss": "not differentially private: mean loss on the private training batches, without noise",
    "train_accuracy": "not differentially private: mean accuracy on the private training batches, without noise",
}


def _json_or_none(value) -> str | None:
    return None if value is None else json.dumps(value)


def run_row(run_id: str, path: Path, meta: dict, builtins: Mapping[str, Any] | None = None) -> dict:
    """The runs table's row of one run file; ``builtins``: as for ``aggregate_runs``."""
    cfg, priv, res, timing = meta["config"], meta["privacy"], meta["result"], meta["timing"]
    builtin = (builtins or {}).get(cfg["optimizer"])
    row = {
        "run_id": run_id,
        "problem": cfg["problem"],
        "dataset": meta["problem"]["dataset"],
        "task": meta["problem"]["task"],
        "optimizer": cfg["optimizer"],
        "private": is_private(meta, builtin),
        # the recorded (epsilon, delta) holds (False for non-private runs and for those whose
        # privacy.caveat says "not a valid DP guarantee"); caveat: that text, or None
        "dp_guarantee": dp_guarantee(meta, builtin),
        "caveat": meta["privacy"].get("caveat"),
        # "plugin" where sigma and epsilon come from a plugin's own mechanism (its privacy claim,
        # not dpbench's); origins: "built-in" or "plugin <distribution> <version>" (runs made
        # before plugins existed are built-in)
        "mechanism_origin": priv.get("mechanism_origin", "built-in"),
        "optimizer_origin": _origin(meta["optimizer"].get("plugin")),
        "problem_origin": _origin(meta["problem"].get("plugin")),
        "lr": cfg["lr"],
        "batch_size": cfg["batch_size"],
        "epochs": cfg["epochs"],
        "seed": cfg["seed"],
        "hyperparameters": json.dumps(meta["optimizer"]["hyperparameters"], sort_keys=True),
        "target_epsilon": priv["target_epsilon"],
        "epsilon": priv["epsilon"],
        "epsilon_rdp": priv["epsilon_rdp"],
        "delta": priv["delta"],
        "noise_multiplier": priv["noise_multiplier"],
        "noise_multiplier_source": priv["noise_multiplier_source"],
        "sample_rate": priv["sample_rate"],
        "planned_steps": priv["planned_steps"],
        "steps": priv["steps"],
        "accountant": priv["accountant"],
        # the accounted event of the steps taken, from the run's mechanism (JSON [[sigma, q, n], ...]);
        # None where it has none or the run predates the record (reporting.figures.spent)
        "accounted_history": _json_or_none(priv.get("accounted_history")),
        "status": res["status"],
        "best_test_accuracy": res["best_test_accuracy"],
        "best_test_loss": res["best_test_loss"],
        "final_test_accuracy": res["final_test_accuracy"],
        "final_test_loss": res["final_test_loss"],
        # with a validation split (train.validation_size > 0), else NaN
        "best_val_accuracy": res.get("best_val_accuracy", math.nan),
        "best_val_loss": res.get("best_val_loss", math.nan),
        "test_accuracy_at_best_val": res.get("test_accuracy_at_best_val", math.nan),
        "test_loss_at_best_val": res.get("test_loss_at_best_val", math.nan),
        "val_perplexity": _perplexity(res["best_val_loss"]) if "best_val_loss" in res else math.nan,
        # each test record's correctness at that epoch (results.pack_outcomes: base64 of packed
        # bits, n_test of them); None where the run file predates it or has no accuracy
        "n_test": meta["data"].get("n_test"),
        "test_correct_at_best_val": meta.get("test_outcomes", {}).get("correct_at_best_val"),
        "n_val": meta["data"].get("n_val", 0),
        # the data a run trained and was tested on and its step cap (a grid block may set its own):
        # part of a configuration, so that runs on different subsets are never pooled as seeds of
        # one (reporting.figures.selection.CONFIG_KEYS); None where not set
        **{key: cfg.get(key) for key in DATA_KEYS},
        "wall_time_s": timing["wall_time_s"],
        "steps_per_second": timing["steps_per_second"],
        "device": meta["environment"]["device"],
        "git_commit": meta["environment"]["git_commit"],
        "path": str(path),
        **memorisation_columns(meta.get("memorisation")),
        **tuning_columns(priv.get("tuning")),
        **start_columns(cfg["problem"], meta.get("start")),
    }
    # a setting that says what a run is and has no column above (a grid axis without its own
    # record): its value in the run's config section
    return row | {c: cfg.get(k) for k, c in SETTING_COLUMNS.items() if c not in row}


START_COLUMNS = ("start", "finetune", *option_settings(), "trainable_parameters", "checkpoint_sha256")


def start_columns(problem: str, start: dict | None) -> dict:
    """Where the run's model started (module docstring): all None for a run file without a
    ``start`` section. A problem "starts from a checkpoint" where its facts name a pretraining
    recipe (a built-in's, ``catalog.FACTS``) or, for another problem, where this run started
    from one."""
    if not start:
        return dict.fromkeys(START_COLUMNS)
    public = start.get("kind") == "public checkpoint"
    facts = FACTS.get(problem)
    pretrained = public or (facts is not None and facts.pretrained is not None)
    return {"start": "public" if public else "scratch",
            "finetune": start.get("mode") if public else SCRATCH if pretrained else None,
            **{s: start.get(s) for s in option_settings()},
            "trainable_parameters": start.get("trainable_parameters"),
            "checkpoint_sha256": start.get("checkpoint_sha256")}


def _perplexity(loss: float) -> float:
    """exp(loss), infinite past float range (a classifier that diverged to a loss of 1e3 has no
    finite perplexity; math.exp would raise)."""
    return math.inf if loss >= math.log(np.finfo(float).max) else math.exp(loss)


def tuning_columns(tuning: dict | None) -> dict:
    """A search's candidate (dpbench.training.tuning): its distribution ("" for a run that is
    no candidate), mean, shape, K, index, and the (epsilon, delta) of the whole search."""
    tuning = tuning or {}
    return {"tuning_distribution": tuning.get("distribution", ""),
            **{f"tuning_{k}": float(tuning[k]) if tuning.get(k) is not None else math.nan
               for k in ("mean", "shape", "repetitions", "candidate", "epsilon")}}


def _origin(plugin: dict | None) -> str:
    return "built-in" if not plugin else f"plugin {plugin['distribution']} {plugin['version']}"


def memorisation_columns(memorisation: dict | None) -> dict:
    """Per k in CANARY_REPEATS: mean and std (ddof = 0) of the exposures of the canaries
    repeated k times, their number and the share extracted (NaN, 0 without any)."""
    canaries = (memorisation or {}).get("canaries", [])
    out = {}
    for k in CANARY_REPEATS:
        exposure = np.array([c["exposure"] for c in canaries if c["repeats"] == k], dtype=float)
        extracted = np.array([bool(c["extracted"]) for c in canaries if c["repeats"] == k], dtype=float)
        n = len(exposure)
        out[f"exposure_k{k}"] = float(exposure.mean()) if n else math.nan
        out[f"exposure_std_k{k}"] = float(exposure.std()) if n else math.nan
        out[f"canaries_k{k}"] = n
        out[f"extracted_k{k}"] = float(extracted.mean()) if n else math.nan
    return out


def epoch_rows(run_id: str, metrics: pd.DataFrame) -> pd.DataFrame:
    train = (metrics[metrics.split == "train"].groupby("epoch")
             .agg(train_loss=("loss", "mean"), train_accuracy=("accuracy", "mean")))
    test = (metrics[metrics.split == "test"].set_index("epoch")[["step", "loss", "accuracy"]]
            .rename(columns={"loss": "test_loss", "accuracy": "test_accuracy"}))
    val = (metrics[metrics.split == "val"].set_index("epoch")[["loss", "accuracy"]]
           .rename(columns={"loss": "val_loss", "accuracy": "val_accuracy"}))
    out = test.join(val, how="left").join(train, how="left").reset_index()
    out.insert(0, "run_id", run_id)
    return out


class DuplicateRunError(ValueError):
    """Two run files given to ``aggregate_runs`` are one run (the same ``run_id``)."""


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def aggregate_runs(paths: list[str | Path], out_runs: str | Path, out_epochs: str | Path,
                   audits: str | Path | None = None,
                   builtins: Mapping[str, Any] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The runs and per-epoch tables of ``paths``; with ``audits`` (the table of ``dpbench
    audits``), the runs table's ``audit_violation``: True where an audit of the run's optimizer
    refuted its claim, False where its audits found none, missing where it was not audited.
    ``builtins``: the built-in optimizers' facts (``dpbench.pipeline.catalog.OPTIMIZERS``, as
    ``dpbench aggregate`` gives them): a run of one is labelled by the registry's ``private`` and
    caveat, never by what its file says. A run file whose record no run writes
    (``results.record_error``: a missing key, an epsilon that is no number >= 0, a delta outside
    (0, 1), ...) is refused in one line naming the file and the key, and so are two files of one
    run (the same ``run_id``: one path given twice, or a copy), never counted as two seeds."""
    from dpbench.reporting.results import write_table

    paths = [Path(p) for p in paths]
    rows, epochs, seen = [], [], {}
    for path in paths:
        metrics, meta = read_run(path)
        error = record_error(meta, builtins)
        if error is not None:
            raise DamagedFileError(f"run file {path} is damaged or edited ({error}); delete it and run the "
                                   "workflow again, which retrains that cell")
        run_id = meta.get("run_id", path.stem)
        if run_id in seen:  # one run counted twice would be two seeds, with an interval
            raise DuplicateRunError(f"run files {seen[run_id]} and {path} are one run (run_id {run_id}"
                                    f"{', the same file' if _same_file(seen[run_id], path) else ''}): give each "
                                    "run once (each its own dpbench train --run-id)")
        seen[run_id] = path
        try:
            rows.append(run_row(run_id, path, meta, builtins))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a key the checks above do not cover
            what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
            raise DamagedFileError(f"run file {path} is damaged or edited ({what}); delete it and run the "
                                   "workflow again, which retrains that cell") from None
        epochs.append(epoch_rows(run_id, metrics))
    runs = pd.DataFrame(rows)
    for column in (*option_settings(), "trainable_parameters"):  # integers, missing where not recorded
        runs[column] = pd.array(runs[column].astype(float), dtype="Int64")
    per_epoch = pd.concat(epochs, ignore_index=True).merge(runs[["run_id"] + RUN_KEYS], on="run_id")
    per_epoch = per_epoch[["run_id"] + RUN_KEYS + [c for c in per_epoch.columns if c not in RUN_KEYS + ["run_id"]]]
    # a diverged run stops at the epoch end where it diverged, its losses there partly NaN, which
    # the mean skips: that epoch's training loss is infinite (as its test loss is), never the mean
    # of the steps before it diverged
    last_epoch = per_epoch["epoch"] == per_epoch.groupby("run_id")["epoch"].transform("max")
    per_epoch.loc[last_epoch & per_epoch["run_id"].isin(runs.loc[runs.status == "diverged", "run_id"]),
                  "train_loss"] = np.inf
    last = per_epoch.sort_values(["run_id", "epoch"]).groupby("run_id").tail(1).set_index("run_id")
    runs["final_train_loss"] = runs["run_id"].map(last["train_loss"]).astype(float)
    runs["final_val_loss"] = runs["run_id"].map(last["val_loss"]).astype(float)
    runs["best_epoch"] = [_best_epoch(per_epoch[per_epoch.run_id == r], t) for r, t in zip(runs.run_id, runs.task)]
    flagged = {}
    if audits is not None:
        flagged = violations(pd.read_parquet(audits))
    runs["audit_violation"] = pd.array([flagged.get(o) for o in runs["optimizer"]], dtype="boolean")
    write_table(runs, out_runs, RUNS_NOT_PRIVATE)
    write_table(per_epoch, out_epochs, EPOCHS_NOT_PRIVATE)
    return runs, per_epoch


def _best_epoch(epochs: pd.DataFrame, task: str) -> float:
    """The epoch of the best test value of the task's metric (its facts: the highest or the lowest)."""
    facts = task_facts(task)
    col, best = f"test_{facts.metric}", "idxmax" if facts.select_higher else "idxmin"
    values = epochs[col].replace([np.inf, -np.inf], np.nan)
    if values.isna().all():
        return np.nan
    return float(epochs.loc[getattr(values, best)(), "epoch"])
