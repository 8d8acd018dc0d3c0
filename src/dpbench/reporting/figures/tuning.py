"""Results at the privacy the whole search spent: each optimizer untuned at its best fixed
setting, tuned by composition and tuned privately (Papernot & Steinke 2022), at the same total ε.

* ``untuned``: the runs of a plain grid block, the best setting chosen afterwards (by
  ``select_by``) and not paid for: ε is one run's, the figures of chapter 5 as drawn;
* ``composition``: a ``tuning: {distribution: composition}`` block, each setting once with σ
  calibrated so that the k runs composed meet ε, the candidate best on validation released;
* ``private``: a ``negative_binomial`` or ``poisson`` block, K random candidates with σ for the
  whole search, the best on validation released (K = 0, possible under Poisson, releases none).

Each search is a (problem, optimizer, batch size, epochs, ε, seed index) group of candidate
runs; with several seed indices the value is their mean with a 95 % t interval over them
(``intervals``), and a rank whose interval overlaps the one above is marked tied. The table gives what each release
spent (K, candidate σ, the accounted total ε and δ) and each optimizer's rank per ε and procedure.

What a search's ε covers (``PROTECTS``, in the caption and the table): the training records, for
the release of the chosen candidate alone. The selection score (``best_val_*``) is computed
without noise on the validation records, so those records are not protected; and the runs table
keeps every candidate's row, which the guarantee does not cover.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dpbench.reporting.figures.intervals import INTERVAL, draw_intervals, t_interval, tied_with_above
from dpbench.reporting.figures.selection import scored, select_runs
from dpbench.reporting.figures.style import empty_figure, fmt_tick, label, ordered

PROCEDURES = ("untuned", "composition", "private")
PROCEDURE_LABELS = {"untuned": "untuned, best fixed rate (selection not paid)",
                    "composition": "tuned, k runs composed", "private": "tuned privately (random K)"}
_SEARCH = ["problem", "optimizer", "batch_size", "epochs", "shown_epsilon", "seed_index"]
PROTECTS = ("A search's ε covers the training records, for the chosen candidate's release alone: the selection "
            "score (best validation metric) is not private, so the validation records are not protected, and "
            "publishing every candidate (the runs table keeps them all) is outside the guarantee.")


def seed_index(runs: pd.DataFrame) -> pd.Series:
    """Each run's seed index: the ``-s<i>`` that ends a grid cell's id, else (a run named
    otherwise) its seed, so that runs of one seed still form one search."""
    parsed = runs["run_id"].astype(str).str.extract(r"-s(\d+)$")[0]
    fallback = runs["seed"].astype(str) if "seed" in runs else runs["run_id"].astype(str)
    return parsed.fillna("seed" + fallback)


def shown_epsilon(runs: pd.DataFrame) -> pd.Series:
    """The ε each run's search is shown under: its target where it had one; for a search given σ
    (no target), the ε the whole search was accounted to spend (``tuning_epsilon``), and for a
    run of no search given σ, the ε it achieved. (Grouping by the target alone dropped σ-given
    searches, or failed where every search was one.)"""
    target = pd.to_numeric(runs["target_epsilon"], errors="coerce").astype(float)
    accounted = pd.to_numeric(runs.get("tuning_epsilon", pd.Series(np.nan, index=runs.index)),
                              errors="coerce").astype(float)
    achieved = pd.to_numeric(runs["epsilon"], errors="coerce").astype(float)
    given = np.where(runs["procedure"] == "untuned", achieved, accounted)
    return pd.Series(np.where(target.isna(), given, target), index=runs.index, dtype=float)


def _procedure(distribution: str) -> str:
    return "untuned" if not distribution else "composition" if distribution == "composition" else "private"


def tuning_data(runs: pd.DataFrame, problem: str = "P2", select_by: str = "val") -> pd.DataFrame:
    """One row per (optimizer, ε, procedure): the released value (mean over seed indices, with
    ci_low and ci_high: the 95 % t interval over them, equal to the value for one), the searches'
    K, σ, accounted total ε and δ, the chosen learning rates, the rank of the optimizer among
    those of its (ε, procedure) (1: best) and tied (its interval overlaps the one ranked above)."""
    r = runs[(runs["problem"] == problem) & runs["private"].astype(bool)].copy()
    columns = ["optimizer", "epsilon", "procedure", "value", "ci_low", "ci_high", "metric", "searches", "repetitions",
               "noise_multiplier", "total_epsilon", "delta", "lr", "rank", "tied"]
    if r.empty:
        return pd.DataFrame(columns=columns)
    r["tuning_distribution"] = r.get("tuning_distribution", pd.Series("", index=r.index)).fillna("")
    r["procedure"] = r["tuning_distribution"].map(_procedure)
    r["seed_index"] = seed_index(r)
    r["shown_epsilon"] = shown_epsilon(r)
    s = scored(r, select_by)
    rows = []
    for keys, g in s.groupby(_SEARCH + ["procedure"], sort=True):
        best = g.loc[g["score"].idxmax()] if np.isfinite(g["score"]).any() else None
        procedure = keys[-1]
        rows.append({"optimizer": keys[1], "epsilon": float(keys[4]), "procedure": procedure,
                     "value": float(best["value"]) if best is not None else np.nan, "metric": g["metric"].iloc[0],
                     "repetitions": len(g) if procedure == "private" else np.nan,
                     "noise_multiplier": float(g["noise_multiplier"].max()),
                     "total_epsilon": (float(g["tuning_epsilon"].max()) if procedure != "untuned"
                                       else float(g["epsilon"].max())),
                     "delta": float(g["delta"].iloc[0]), "lr": float(best["lr"]) if best is not None else np.nan,
                     "lower_is_better": bool(g["lower_is_better"].iloc[0])})
    if not rows:  # no run with a finite epsilon to show it under
        return pd.DataFrame(columns=columns)
    per_search = pd.DataFrame(rows)
    out = per_search.groupby(["optimizer", "epsilon", "procedure"], sort=True).agg(
        value=("value", "mean"), metric=("metric", "first"), searches=("value", "size"),
        repetitions=("repetitions", "mean"), noise_multiplier=("noise_multiplier", "max"),
        total_epsilon=("total_epsilon", "max"), delta=("delta", "first"),
        lr=("lr", lambda v: ",".join(fmt_tick(x) for x in sorted(set(v.dropna())))),
        lower_is_better=("lower_is_better", "first")).reset_index()
    sign = np.where(out["lower_is_better"].astype(bool), 1.0, -1.0)
    # no released value (every candidate diverged, or K = 0) ranks last
    out["_key"] = np.where(np.isfinite(out["value"].astype(float)), sign * out["value"].astype(float), np.inf)
    out["rank"] = out.groupby(["epsilon", "procedure"])["_key"].rank(method="min").astype(int)
    bounds = {keys: t_interval(g["value"].to_numpy(dtype=float))[1:3]
              for keys, g in per_search.groupby(["optimizer", "epsilon", "procedure"], sort=True)}
    out["ci_low"] = [bounds[k][0] for k in zip(out["optimizer"], out["epsilon"], out["procedure"])]
    out["ci_high"] = [bounds[k][1] for k in zip(out["optimizer"], out["epsilon"], out["procedure"])]
    out = out.sort_values(["epsilon", "procedure", "rank", "optimizer"], kind="stable").reset_index(drop=True)
    out["tied"] = False
    for _, g in out.groupby(["epsilon", "procedure"], sort=False):
        out.loc[g.index, "tied"] = tied_with_above(g)
    return out[columns]


def draw_tuning(data: pd.DataFrame, problem: str) -> Figure:
    if data.empty:
        return empty_figure(f"{problem}: no private runs to compare")
    epsilons = sorted(data["epsilon"].unique())
    optimizers = ordered(data["optimizer"].unique())
    fig, axes = plt.subplots(1, len(epsilons), figsize=(4.2 * len(epsilons), 3.6), squeeze=False, sharey=True)
    width = 0.8 / len(PROCEDURES)
    colours = {"untuned": "#bbbbbb", "composition": "#4477aa", "private": "#ee6677"}
    for ax, eps in zip(axes[0], epsilons):
        d = data[data["epsilon"] == eps]
        for i, procedure in enumerate(PROCEDURES):
            rows = [d[(d["optimizer"] == o) & (d["procedure"] == procedure)] for o in optimizers]
            heights = np.array([float(r["value"].iloc[0]) if len(r) else np.nan for r in rows])
            x = np.arange(len(optimizers)) + (i - 1) * width
            ax.bar(x, heights, width, color=colours[procedure], label=PROCEDURE_LABELS[procedure])
            for xi, r in zip(x, rows):
                if len(r) and r["searches"].iloc[0] >= 2 and np.isfinite(r[["ci_low", "ci_high"]].iloc[0]).all():
                    draw_intervals(ax, xi, r["value"].iloc[0], r["ci_low"].iloc[0], r["ci_high"].iloc[0])
        ax.set_xticks(np.arange(len(optimizers)), [label(o) for o in optimizers], rotation=30, ha="right")
        ax.set_title(f"total ε = {fmt_tick(eps)}")
    axes[0][0].set_ylabel(data["metric"].iloc[0])
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=7, loc="lower center", ncol=len(PROCEDURES), frameon=False,
               bbox_to_anchor=(0.5, 0.02))
    fig.suptitle(f"{problem}: untuned, tuned by composition and tuned privately at the same total ε", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.text(0.01, 0.0, _seeds_note(data) + " " + PROTECTS, fontsize=6.5, ha="left", va="top", wrap=True, gid="caption")
    return fig


def tuning_figure(runs: pd.DataFrame, problem: str = "P2", select_by: str = "val",
                  optimizers: list[str] | None = None, filters: dict | None = None) -> Figure:
    runs = select_runs(runs, filters, optimizers)
    return draw_tuning(tuning_data(runs, problem, select_by), problem)


def tuning_table(runs: pd.DataFrame, problem: str = "P2", select_by: str = "val",
                 optimizers: list[str] | None = None, filters: dict | None = None) -> str:
    """The figure's numbers as Markdown: per total ε and procedure, each optimizer's value and
    rank, K (mean over searches; composition: every setting once), σ, total ε and δ."""
    data = tuning_data(select_runs(runs, filters, optimizers), problem, select_by)
    if data.empty:
        return f"{problem}: no private runs to compare\n"
    lines = [f"{problem}: {data['metric'].iloc[0]}, at the same total ε; rank among the optimizers of each ε and "
             "procedure (1: best). untuned: one run's ε, the best rate chosen afterwards and not paid for. "
             + _seeds_note(data) + " " + PROTECTS, "",
             "| total ε | procedure | optimizer | value | rank | searches | mean K | candidate σ | accounted ε | δ | "
             "rate(s) released |", "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for _, row in data.iterrows():
        k = "" if np.isnan(row["repetitions"]) else f"{row['repetitions']:.3g}"
        half = row["ci_high"] - row["value"]
        value = f"{row['value']:.4f}" + (f" ± {half:.4f}" if row["searches"] >= 2 and np.isfinite(half) else "")
        rank = f"= {row['rank']}" if row["tied"] else f"{row['rank']}"
        lines.append(f"| {fmt_tick(row['epsilon'])} | {row['procedure']} | {label(row['optimizer'])} | "
                     f"{value} | {rank} | {row['searches']} | {k} | {row['noise_multiplier']:.4g} | "
                     f"{row['total_epsilon']:.4g} | {row['delta']:g} | {row['lr']} |")
    return "\n".join(lines) + "\n"


def _seeds_note(data: pd.DataFrame) -> str:
    """What the values are over: one seed index (a single draw of each search), or the mean and
    interval over several, and what a tie mark means."""
    n = int(data["searches"].max())
    if n < 2:
        return "One seed index: each value is a single run or search, no interval."
    return (f"Mean over {n} seed indices (each its own searches) and the {INTERVAL.replace('seeds', 'seed indices')} "
            "(± its half-width); a rank marked = is tied with the one above (their intervals overlap).")
