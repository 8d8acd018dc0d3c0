"""Which run a figure shows: the runs a figure is about (``select_runs``) and, among the runs of
a group (a bar, a heatmap cell, ...), the best one (``select_best``).

"Best" means: the run with the best *selection metric*; the number shown is that run's *test*
metric.

* ``select_by="test"`` (default, as in the thesis): ``best_test_accuracy`` for classifiers,
  ``best_test_loss`` for the VAE (lower is better, shown as log10). Optimistic: the same
  test set selects and reports.
* ``select_by="val"``: ``best_val_accuracy`` / ``best_val_loss`` (columns a validation split
  adds) choose the run, and the number reported is its test metric at the epoch validation
  chose (``test_accuracy_at_best_val`` / ``test_loss_at_best_val``): nothing is selected on
  the test set.
* any other column name: selects by it (lower is better iff its name contains "loss").

Runs whose selection metric is not finite (diverged: infinite loss, NaN accuracy) never win;
a group whose runs all diverged is ``diverged`` (black boxes in heatmaps, no bar in bar plots).

Under which ε: ``by_privacy``. A run is shown under its target ε only where it met it
(``accounting.meets_target``), under its achieved ε where it was given σ and no target, under
ε = ∞ where it is not private; a run whose achieved ε exceeds its target is shown nowhere.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd

from dpbench.privacy.accounting import meets_target
from dpbench.problems.catalog import task_facts
from dpbench.training.config import RunConfig
from dpbench.training.settings import configuration_keys

# What a run is, apart from its seed: RunConfig's configuration keys, as its fields declare them
# (dpbench.training.settings), and the public start's bytes. ``epsilon`` is the ε a run is shown
# under (``by_privacy``). The grid's axes (problem, optimizer, lr, ..., ``finetune`` and the modes'
# options such as ``lora_rank``: the runs table's start columns, "scratch" for the from-scratch
# twin) and the settings a grid block may set for its cells alone (``train_subset``,
# ``test_subset``, ``validation_size``, ``max_steps``) make runs that differ in them different
# configurations, never seeds or rates of one; ``checkpoint_sha256`` likewise runs from two
# different public checkpoints. Tables without a column (runs aggregated before it existed) group
# as before.
CONFIG_KEYS = (*configuration_keys(RunConfig), "checkpoint_sha256")


def select_runs(runs: pd.DataFrame, filters: dict | None = None, optimizers: Iterable[str] | None = None,
                problems: Iterable[str] | None = None) -> pd.DataFrame:
    """The runs whose column values are in `filters` ({column: value or list of values}),
    and whose optimizer and problem are among those given."""
    for column, allowed in (filters or {}).items():
        if column not in runs.columns:
            raise KeyError(f"filter column {column!r} is not in the runs table")
        allowed = list(allowed) if isinstance(allowed, (list, tuple, set)) else [allowed]
        runs = runs[runs[column].isin(allowed)]
    if optimizers is not None:
        runs = runs[runs["optimizer"].isin(list(optimizers))]
    if problems is not None:
        runs = runs[runs["problem"].isin(list(problems))]
    return runs


def selection_columns(task: str, select_by: str = "test") -> tuple[str, str]:
    """(selection column, reported test column) for a task (its name): the columns of the task's
    metric (``dpbench.problems.catalog``: accuracy for classification, else the loss).

    With ``select_by="val"`` both the configuration and its epoch are chosen on validation:
    the reported number is the test metric at the epoch of the best validation metric."""
    kind = task_facts(task).metric
    if select_by == "val":
        return f"best_val_{kind}", f"test_{kind}_at_best_val"
    column = f"best_{select_by}_{kind}" if select_by == "test" else select_by
    return column, f"best_test_{kind}"


def scored(runs: pd.DataFrame, select_by: str = "test") -> pd.DataFrame:
    """The runs with, per run: `score` (selection metric, higher is better, -inf when not
    finite), `value` (reported test metric: accuracy, or log10 loss), `lower_is_better`
    (of `value`), `metric` (its name for axis labels) and `run_diverged`."""
    out = runs.copy()
    out["score"], out["value"] = -np.inf, np.nan
    out["lower_is_better"], out["metric"] = False, ""
    for task in out["task"].unique():
        rows = out["task"] == task
        sel_col, rep_col = selection_columns(task, select_by)
        if sel_col not in out.columns:
            raise KeyError(f"selection metric {sel_col!r} is not in the runs table "
                           f"(select_by={select_by!r})")
        sel = out.loc[rows, sel_col].astype(float)
        sel = -sel if "loss" in sel_col else sel
        out.loc[rows, "score"] = sel.where(np.isfinite(sel), -np.inf)
        rep = out.loc[rows, rep_col].astype(float)
        # the task's metric, not the column's ending: with select_by="val" the reported column
        # is test_loss_at_best_val
        is_loss = task_facts(task).metric == "loss"
        with np.errstate(divide="ignore", invalid="ignore"):
            out.loc[rows, "value"] = np.log10(rep) if is_loss else rep
        out.loc[rows, "lower_is_better"] = is_loss
        chosen = "" if select_by == "test" else f" (selected by {sel_col})"
        out.loc[rows, "metric"] = ("best log10 test loss" if is_loss else "best test accuracy") + chosen
    loss = out["best_test_loss"].astype(float) if "best_test_loss" in out else pd.Series(0.0, out.index)
    out["run_diverged"] = (out["status"] == "diverged") | ~np.isfinite(loss)
    return out


def privacy_epsilon(runs: pd.DataFrame) -> pd.Series:
    """The ε each run of a runs table is shown under: its target where its achieved ε meets it,
    its achieved ε where it had no target (σ given), ∞ where its achieved ε is not finite (not
    private: a non-private optimizer, or σ = 0); NaN where its achieved ε exceeds its target, and
    where its numbers do not support a finite ε (an edited table: ε negative or NaN, δ outside
    (0, 1), σ <= 0): such a run is shown under no ε."""
    achieved = runs["epsilon"].astype(float)
    target = runs["target_epsilon"].astype(float)
    met = np.array([meets_target(e, t) for e, t in zip(achieved, target)], dtype=bool)
    label = np.where(target.isna(), achieved, np.where(met, target, np.nan))
    supported = ~(achieved < 0)
    if "private" in runs:  # a row labelled private with no epsilon (NaN) is shown under none
        supported &= ~(runs["private"].astype(bool) & achieved.isna())
    # (a missing delta or sigma, NaN, contradicts nothing: dpbench aggregate refuses a private run without one)
    if "delta" in runs:
        delta = pd.to_numeric(runs["delta"], errors="coerce").astype(float)
        supported &= ~np.isfinite(achieved) | ~((delta <= 0) | (delta >= 1))
    if "noise_multiplier" in runs:
        supported &= ~np.isfinite(achieved) | ~(pd.to_numeric(runs["noise_multiplier"], errors="coerce") <= 0)
    label = np.where(supported, label, np.nan)
    return pd.Series(np.where(np.isfinite(achieved) | ~supported, label, np.inf), index=runs.index, dtype=float)


def by_privacy(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs a figure may show, ``epsilon`` the ε each is shown under (``privacy_epsilon``)
    and ``achieved_epsilon`` its achieved one; a run whose achieved ε exceeds its target is left
    out (it is not private at that target, and grouping it under another ε would mix it with
    runs calibrated to it)."""
    out = runs.assign(epsilon=privacy_epsilon(runs), achieved_epsilon=runs["epsilon"].astype(float))
    return out[out["epsilon"].notna()].drop(columns="target_epsilon")


def _sort_keys(df: pd.DataFrame) -> list[str]:
    return [k for k in (*CONFIG_KEYS, "seed", "run_id") if k in df.columns]


def select_best(runs: pd.DataFrame, by: list[str], select_by: str = "test") -> pd.DataFrame:
    """One row per group of `by`: the run with the highest selection score (ties: the first
    in config order), its columns plus `value`, `metric`, `lower_is_better`, `n_runs` and
    `diverged` (no run of the group has a finite score and one of them diverged). A group
    without a finite score has `value` NaN, or +inf for a loss whose runs diverged."""
    s = scored(runs, select_by)
    if s.empty:
        return s.assign(n_runs=pd.Series(dtype=int), diverged=pd.Series(dtype=bool))
    s = s.sort_values(_sort_keys(s), kind="stable").reset_index(drop=True)
    groups = s.groupby(list(by), dropna=False, sort=True)
    best = s.loc[groups["score"].idxmax().to_numpy()].reset_index(drop=True)
    best["n_runs"] = groups.size().to_numpy()
    no_winner = ~np.isfinite(best["score"].to_numpy())
    best["diverged"] = no_winner & groups["run_diverged"].any().to_numpy()
    best.loc[no_winner, "value"] = np.nan
    best.loc[best["diverged"] & best["lower_is_better"].astype(bool), "value"] = np.inf
    return best



# The tie rule of a configuration choice. Mean selection scores within TIE_TOLERANCE of the best
# are a tie (accuracies are counts over a split: three seeds' means tie exactly, up to the order
# of a float sum); a tie goes to the configuration with the lowest mean of the same split's loss
# (``tie_break_column``: best_val_loss when choosing on validation), a finer measure of the same
# held-out fit (a loss moves where a count of right answers does not), then to the first in
# config order (CONFIG_KEYS ascending: the lower learning rate first). The choice reads only the
# selection split's numbers, as before: what it spends (ε_sel) is unchanged. ``tied_configs``
# lists every configuration of a tie, so a verdict can be recomputed under each (finetune_claims).
TIE_TOLERANCE = 1e-9


def tie_break_column(task: str, select_by: str = "test") -> str | None:
    """The column that breaks a tie on the selection score: the selection split's loss for a
    task chosen on its accuracy (``best_val_loss``, ``best_test_loss``), None otherwise (a loss
    is itself the score: config order alone)."""
    if task_facts(task).metric != "accuracy" or select_by not in ("val", "test"):
        return None
    return f"best_{select_by}_loss"


def _ranked_configs(group: pd.DataFrame, keys: list[str], select_by: str) -> tuple[list, list[float], list[int]]:
    """(configurations [(key, runs)], their mean scores, the indices of the tie the rule chooses
    from, the chosen first then the others in the rule's order). A configuration with a
    non-finite score is in no tie."""
    configs = list(group.groupby(keys, dropna=False, sort=False)) if keys else [(None, group)]
    means = [float(np.mean(c["score"])) for _, c in configs]
    best = max(means)
    if not np.isfinite(best):
        return configs, means, [int(np.argmax(means))]
    tied = [i for i, m in enumerate(means) if np.isfinite(m) and m >= best - TIE_TOLERANCE]
    column = tie_break_column(str(group["task"].iloc[0]), select_by) if "task" in group else None
    if column is not None and column in group:
        def loss(i):
            v = float(np.mean(configs[i][1][column].astype(float)))
            return v if np.isfinite(v) else np.inf
        tied.sort(key=lambda i: (loss(i), i))  # stable: equal losses keep config order
    return configs, means, tied


def tied_configs(runs: pd.DataFrame, by: list[str], select_by: str = "test"):
    """Per group of ``by``: (the group's values of ``by`` as a dict, [the runs of every
    configuration tied on the best mean selection score, the chosen one first]) — the
    alternatives the tie rule decided between (one entry: no tie)."""
    s = scored(runs, select_by)
    if s.empty:
        return
    s = s.sort_values(_sort_keys(s), kind="stable").reset_index(drop=True)
    keys = [k for k in CONFIG_KEYS if k in s.columns and k not in by]
    for values, group in s.groupby(list(by), dropna=False, sort=True):
        configs, _, tied = _ranked_configs(group, keys, select_by)
        yield dict(zip(by, values if isinstance(values, tuple) else (values,))), [configs[i][1] for i in tied]


def select_best_config(runs: pd.DataFrame, by: list[str], select_by: str = "test") -> pd.DataFrame:
    """One row per group of `by`: the configuration (the settings of ``CONFIG_KEYS``, all its
    seeds) with the best mean selection score over its seeds (a seed that diverged makes the
    mean -inf; ties: the tie rule, ``TIE_TOLERANCE``), as the row of its first seed with `value` the
    mean of its seeds' finite reported metrics, `ci_low`, `ci_high` (the 95 % t interval over
    them: ``intervals``), `n_seeds` (finite), `n_runs` (the group's runs: every candidate the
    choice looked at), `n_configs`, `n_tied` (the configurations tied on the best mean score, the
    chosen one included: the tie rule, ``TIE_TOLERANCE``, decided between them), `diverged`,
    `score` (the chosen configuration's mean selection score). With one seed a configuration is
    its run, and this is ``select_best`` (up to the tie rule's loss)."""
    from dpbench.reporting.figures.intervals import t_interval

    s = scored(runs, select_by)
    extra = ["ci_low", "ci_high", "n_seeds", "n_runs", "n_configs", "n_tied", "diverged"]
    if s.empty:
        return s.assign(**{c: pd.Series(dtype=float) for c in extra})
    s = s.sort_values(_sort_keys(s), kind="stable").reset_index(drop=True)
    keys = [k for k in CONFIG_KEYS if k in s.columns and k not in by]
    rows = []
    for _, group in s.groupby(list(by), dropna=False, sort=True):
        configs, means, tied = _ranked_configs(group, keys, select_by)
        best = tied[0]  # the tie rule's choice (TIE_TOLERANCE)
        chosen = configs[best][1]
        row = chosen.iloc[0].copy()
        mean, low, high, n = t_interval(chosen["value"].to_numpy(dtype=float))
        row["value"], row["ci_low"], row["ci_high"], row["n_seeds"] = mean, low, high, n
        row["n_runs"], row["n_configs"], row["n_tied"] = len(group), len(configs), len(tied)
        row["score"] = means[best]  # the mean selection score the choice was made by
        row["diverged"] = False
        if not np.isfinite(means[best]):  # no configuration without a non-finite seed
            row["diverged"] = bool(group["run_diverged"].any())
            row["value"] = row["ci_low"] = row["ci_high"] = (np.inf if row["diverged"] and row["lower_is_better"]
                                                             else np.nan)
        rows.append(row)
    return pd.DataFrame(rows).reset_index(drop=True)
