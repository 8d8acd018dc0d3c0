"""Figures of thesis chapter 5 and Appendix B, as pure functions of the aggregated tables.

Every figure is two steps: a *data* function (runs table -> a tidy DataFrame holding exactly
the numbers drawn, testable without a plot) and a *draw* function (that DataFrame -> Figure).
``plot(figure_id, runs_path, out_stem, **options)`` reads the runs table, builds the
figure named by its thesis number (``FIGURES``) and writes ``<out_stem>.png`` and ``.pdf``.

Selection. "Best" means: among the runs of a group (a bar, a heatmap cell, ...), the run with
the best *selection metric*; the number shown is that run's *test* metric.

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

Privacy marks. An optimizer with a private run whose recorded (epsilon, delta) does not hold
(the runs table's ``dp_guarantee`` is False: DP-Dice's published calibration, D2P2's paper
mode) is named "<name> (not a valid DP guarantee)" in every legend and panel title
(``legend_labels``), so such a number is never read as a DP result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import Normalize  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from dpbench.files import refuse_special  # noqa: E402
from dpbench.problems.catalog import CANARY_REPEATS, task_facts  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

# Thesis names, in the thesis's order; other optimizers follow alphabetically under their own name.
LABELS = {
    "dpsgd": "DP-SGD", "dpadambc": "DP-AdamBC", "dpdisk": "DP-DiSK", "dpdice": "DP-Dice",
    "dpmatrix-se": "DP-Matrix-SE", "dpmatrix-se-lambda": "DP-Matrix-SE-λ",
    "dpmatrix-me": "DP-Matrix-ME", "dpmatrix-me-lambda": "DP-Matrix-ME-λ",
    # beyond the thesis: the streamed correlated-noise mechanisms (config/beyond-setup{2,3}.yaml)
    "dpmatrix-band": "BandMF", "dpmatrix-band-amp": "BandMF (amplified)", "dpmatrix-blt": "BLT",
    # the papers' further optimizers
    "dpadam": "DP-Adam", "dpadamw": "DP-AdamW", "dpadamw-bc": "DP-AdamW-BC", "dpdice-strict": "DP-Dice (strict)",
    "d2p2sgd": "D2P2-SGD", "d2psgd": "D2P-SGD", "dp2sgd": "DP2-SGD",
    "sgd": "SGD (non-private)", "adam": "Adam (non-private)",
    # the language-model study (config/lm.yaml)
    "adamw": "AdamW (non-private)", "opacus-dpsgd": "DP-SGD (Opacus)",
}
# What a run is, apart from its seed.
CONFIG_KEYS = ("problem", "optimizer", "lr", "batch_size", "epochs", "target_epsilon", "hyperparameters")
DATASETS = {"cifar10": "CIFAR-10", "fashion-mnist": "Fashion-MNIST"}
AXIS_LABELS = {"lr": "learning rate η", "batch_size": "batch size L", "epochs": "epochs E",
               "target_epsilon": "target ε"}
# Which runs of config/thesis.yaml's table (all three setups) each figure is about: the setups
# differ in their epochs (Setup 1: 250, 500; Setup 2: 1; Setup 3: 30). Harmless on a table of
# one setup (config/setupN.yaml); wrong for small configs. plot(..., filters="thesis") uses them.
THESIS_FILTERS = {
    "fig5_1": {"epochs": [250, 500]}, "fig5_2": {"epochs": [1, 30]}, "fig5_3": {"epochs": [250, 500]},
    "fig5_4": {"epochs": [250, 500]}, "fig5_5": {"epochs": [250, 500]}, "fig5_6": {"epochs": [1]},
    "fig5_7": {"epochs": [30]}, "fig5_8": {"epochs": [30]}, "figB_1": {"epochs": [250, 500]},
    "figB_2": {"epochs": [250, 500]},
}


# ---------------------------------------------------------------------------- selection

NO_GUARANTEE_MARK = " (not a valid DP guarantee)"
AUDIT_MARK = " (audit: claim refuted)"


def label(optimizer: str, labels: dict[str, str] | None = None) -> str:
    """The optimizer's name in figures: from ``labels`` (``legend_labels``) if given there."""
    return (labels or {}).get(optimizer) or LABELS.get(optimizer, optimizer)


def legend_labels(runs: pd.DataFrame) -> dict[str, str]:
    """Each optimizer's name, marked NO_GUARANTEE_MARK if any of its private runs has no valid
    DP guarantee (``dp_guarantee`` False) and AUDIT_MARK if an empirical audit refuted its
    claim (``audit_violation`` True); tables without these columns mark nothing."""
    out = {o: label(o) for o in runs["optimizer"].unique()} if "optimizer" in runs else {}
    if "dp_guarantee" in runs and len(runs):
        void = runs["private"].astype(bool) & ~runs["dp_guarantee"].astype(bool)
        for o in runs.loc[void, "optimizer"].unique():
            out[o] += NO_GUARANTEE_MARK
    if "audit_violation" in runs and len(runs):
        for o in runs.loc[runs["audit_violation"].fillna(False).astype(bool), "optimizer"].unique():
            out[o] += AUDIT_MARK
    return out


def ordered(names: Iterable[str], optimizers: Iterable[str] | None = None) -> list[str]:
    """The optimizers present in `names`: in the order of `optimizers` if given (others
    dropped), else the thesis order, then the unknown ones alphabetically."""
    present = set(names)
    if optimizers is not None:
        return [o for o in optimizers if o in present]
    return [o for o in LABELS if o in present] + sorted(present - set(LABELS))


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
        is_loss = rep_col.endswith("loss")
        with np.errstate(divide="ignore", invalid="ignore"):
            out.loc[rows, "value"] = np.log10(rep) if is_loss else rep
        out.loc[rows, "lower_is_better"] = is_loss
        chosen = "" if select_by == "test" else f" (selected by {sel_col})"
        out.loc[rows, "metric"] = ("best log10 test loss" if is_loss else "best test accuracy") + chosen
    loss = out["best_test_loss"].astype(float) if "best_test_loss" in out else pd.Series(0.0, out.index)
    out["run_diverged"] = (out["status"] == "diverged") | ~np.isfinite(loss)
    return out


def _target_as_epsilon(df: pd.DataFrame) -> pd.DataFrame:
    """Figures call the target ε `epsilon`; the achieved one becomes `achieved_epsilon`."""
    return df.rename(columns={"epsilon": "achieved_epsilon"}).rename(columns={"target_epsilon": "epsilon"})


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


# ---------------------------------------------------------------------------- data functions

def best_per_setting(runs: pd.DataFrame, select_by: str = "test") -> pd.DataFrame:
    """Figs. 5.1, 5.2: per (problem, optimizer, target ε) the best run over all other settings.
    Columns: problem, dataset, optimizer, epsilon (target; inf for non-private), private,
    value, metric, lower_is_better, diverged, n_runs, and the chosen run's run_id, lr,
    batch_size, epochs, seed, achieved_epsilon."""
    r = _target_as_epsilon(runs)
    r["epsilon"] = r["epsilon"].astype(float).fillna(np.inf)
    best = select_best(r, ["problem", "optimizer", "epsilon"], select_by)
    best["private"] = best["private"].astype(bool)
    cols = ["problem", "dataset", "optimizer", "epsilon", "private", "value", "metric", "lower_is_better",
            "diverged", "n_runs", "run_id", "lr", "batch_size", "epochs", "seed", "achieved_epsilon"]
    return best[[c for c in cols if c in best.columns]]


def seed_sensitivity_data(runs: pd.DataFrame, select_by: str = "test", min_seeds: int = 2) -> pd.DataFrame:
    """Fig. 5.3: per (problem, optimizer, learning rate), the configuration (all settings but
    the seed) with at least `min_seeds` seeds whose mean selection score over seeds is best,
    and the mean and sample std (ddof=1) over those seeds of its reported test metric.

    A seed that diverged gives its configuration a score of -inf (a configuration that
    diverges on some seed is not chosen while another is available); mean and std are over
    the seeds with a finite value (`n_finite` of `n_seeds`)."""
    s = scored(runs, select_by)
    keys = [k for k in CONFIG_KEYS if k in s.columns]
    columns = [*keys, "n_seeds", "n_finite", "mean", "std", "metric"]
    if s.empty:
        return pd.DataFrame(columns=columns)
    s["finite_value"] = s["value"].where(np.isfinite(s["value"]))
    configs = (s.groupby(keys, dropna=False, sort=True)
               .agg(score=("score", "mean"), mean=("finite_value", "mean"), std=("finite_value", "std"),
                    n_seeds=("seed", "nunique"), n_finite=("finite_value", "count"), metric=("metric", "first"))
               .reset_index())
    configs = configs[configs["n_seeds"] >= min_seeds]
    if configs.empty:
        return pd.DataFrame(columns=columns)
    configs = configs.sort_values(keys, kind="stable").reset_index(drop=True)
    best = configs.loc[configs.groupby(["problem", "optimizer", "lr"], sort=True)["score"].idxmax().to_numpy()]
    return best[columns].reset_index(drop=True)


def heatmap_data(runs: pd.DataFrame, problem: str, y: str = "batch_size", x: str = "lr",
                 epsilons: Iterable[float] = (1, 10), select_by: str = "test") -> pd.DataFrame:
    """Figs. 5.4, 5.6-5.8, B.1: for one problem, the best run per (optimizer, ε, y, x) cell over
    all other settings, seeds included. Columns: problem, optimizer, epsilon, x, y, value,
    diverged, is_best (the best finite cell of each (optimizer, ε) panel: highest accuracy or
    lowest loss; one per panel), n_runs, run_id, metric, lower_is_better."""
    eps = [float(e) for e in epsilons]
    r = runs[(runs["problem"] == problem) & runs["private"].astype(bool)
             & runs["target_epsilon"].astype(float).isin(eps)]
    best = _target_as_epsilon(select_best(r, ["optimizer", "target_epsilon", y, x], select_by))
    cols = ["problem", "optimizer", "epsilon", x, y, "value", "diverged", "is_best", "n_runs", "run_id",
            "metric", "lower_is_better"]
    if best.empty:
        return pd.DataFrame(columns=cols)
    best["is_best"] = False
    finite = best[np.isfinite(best["value"])]
    for _, panel in finite.groupby(["optimizer", "epsilon"], sort=False):
        pick = panel["value"].idxmin() if panel["lower_is_better"].iloc[0] else panel["value"].idxmax()
        best.loc[pick, "is_best"] = True
    return best[cols].sort_values(["optimizer", "epsilon", y, x]).reset_index(drop=True)


def best_settings_data(runs: pd.DataFrame, problem: str, epsilons: Iterable[float] | None = None,
                       select_by: str = "test") -> pd.DataFrame:
    """Figs. 5.5, B.2: per (optimizer, ε, batch size) of one problem, the epochs and learning
    rate of the best run over all other settings. Columns: problem, optimizer, epsilon,
    batch_size, epochs, lr, value, metric, diverged, run_id."""
    r = runs[(runs["problem"] == problem) & runs["private"].astype(bool)]
    if epsilons is not None:
        r = r[r["target_epsilon"].astype(float).isin([float(e) for e in epsilons])]
    best = _target_as_epsilon(select_best(r, ["optimizer", "target_epsilon", "batch_size"], select_by))
    cols = ["problem", "optimizer", "epsilon", "batch_size", "epochs", "lr", "value", "metric", "diverged", "run_id"]
    if best.empty:
        return pd.DataFrame(columns=cols)
    # a batch size whose runs all diverged has no best epochs or learning rate
    best.loc[best["diverged"] | ~np.isfinite(best["value"]), ["epochs", "lr"]] = np.nan
    return best[cols].reset_index(drop=True)


# ---------------------------------------------------------------------------- drawing

# seaborn (and through it scipy.stats) is imported where a figure is drawn, not with the module:
# the workflow imports this module for the figures' fingerprints every time it starts.


def _style() -> None:
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper", font_scale=0.9)
    plt.rcParams.update({"pdf.fonttype": 42, "axes.titlesize": 9, "figure.dpi": 100})


def palette(optimizers: Iterable[str]) -> dict[str, tuple]:
    """One colour per optimizer, the same in every figure."""
    import seaborn as sns

    names = [o for o in LABELS if o != "sgd"] + sorted(set(optimizers) - set(LABELS))
    # colorblind's 10, then dark's 10, then as many evenly spaced hues as are still needed (zip
    # would silently drop the optimizers past the 20th, and their figures fail to draw)
    base = sns.color_palette("colorblind") + sns.color_palette("dark")
    if len(names) > len(base):
        base += sns.color_palette("husl", len(names) - len(base))
    colours = dict(zip(names, base))
    return {**colours, "sgd": (0.25, 0.25, 0.25)}


def _empty(message: str) -> Figure:
    fig = plt.figure(figsize=(5, 2))
    fig.text(0.5, 0.5, message, ha="center", va="center")
    return fig


def _fmt_tick(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float, np.integer, np.floating)) else str(v)


def draw_comparison(best: pd.DataFrame, problems: list[str] | None = None,
                    optimizers: list[str] | None = None, labels: dict[str, str] | None = None) -> Figure:
    """Bars: best metric per optimizer (hue) and target ε (x), one panel per problem (in the
    order given, panels lettered (a), (b), ... when several); non-private optimizers as dashed
    horizontal lines. Groups whose runs all diverged have no bar."""
    import seaborn as sns

    present = list(best["problem"].unique())
    problems = [p for p in problems if p in present] if problems is not None else sorted(present)
    if not problems:
        return _empty("no runs to compare")
    colours = palette(best["optimizer"].unique())
    fig, axes = plt.subplots(1, len(problems), figsize=(4.6 * len(problems), 3.6), squeeze=False)
    for i, (ax, problem) in enumerate(zip(axes[0], problems)):
        here = best[best["problem"] == problem]
        names = ordered(here["optimizer"], optimizers)
        private = here[here["private"] & here["optimizer"].isin(names) & np.isfinite(here["value"])].copy()
        if len(private):
            eps = sorted(private["epsilon"].unique())
            private["ε"] = private["epsilon"].map(_fmt_tick)
            private["optimizer "] = private["optimizer"].map(lambda o: label(o, labels))
            hue = [label(o, labels) for o in names if o in set(private["optimizer"])]
            sns.barplot(data=private, x="ε", y="value", hue="optimizer ", order=[_fmt_tick(e) for e in eps],
                        hue_order=hue, palette={label(o, labels): colours[o] for o in names}, ax=ax)
            for container in ax.containers:
                ax.bar_label(container, fmt="%.3f", fontsize=6, padding=1,
                             bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.4, "alpha": 0.85})
        for _, ref in here[~here["private"] & here["optimizer"].isin(names)].iterrows():
            if np.isfinite(ref["value"]):
                ax.axhline(ref["value"], ls="--", lw=1, color=colours[ref["optimizer"]],
                           label=label(ref["optimizer"], labels))
        metric = here["metric"].iloc[0]
        dataset = f" · {DATASETS.get(here['dataset'].iloc[0], here['dataset'].iloc[0])}" if "dataset" in here else ""
        letter = f"({chr(ord('a') + i)}) " if len(problems) > 1 else ""
        ax.set(title=f"{letter}{problem}{dataset}", ylabel=metric, xlabel="target ε")
        if not here["lower_is_better"].iloc[0]:
            ax.set_ylim(0, 1)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    fig.tight_layout()
    return fig


def draw_seed_sensitivity(data: pd.DataFrame, optimizers: list[str] | None = None, min_seeds: int = 2,
                          labels: dict[str, str] | None = None) -> Figure:
    """Mean ± std over seeds vs learning rate (log x); rows = problems, columns = optimizers."""
    if data.empty:
        return _empty(f"no configuration with at least {min_seeds} seeds")
    problems = sorted(data["problem"].unique())
    names = ordered(data["optimizer"], optimizers)
    colours = palette(names)
    fig, axes = plt.subplots(len(problems), len(names), figsize=(3.2 * len(names), 2.6 * len(problems)),
                             squeeze=False, sharey="row")
    for i, problem in enumerate(problems):
        for j, opt in enumerate(names):
            ax = axes[i][j]
            d = data[(data["problem"] == problem) & (data["optimizer"] == opt)].sort_values("lr")
            if d.empty:
                ax.text(0.5, 0.5, f"no configuration\nwith ≥ {min_seeds} seeds", ha="center", va="center",
                        transform=ax.transAxes)
                ax.set_xticks([])
            else:
                ax.errorbar(d["lr"], d["mean"], yerr=d["std"].fillna(0), marker="o", ms=4, capsize=3,
                            color=colours[opt])
                ax.set_xscale("log")
                ax.set_xticks(d["lr"], [_fmt_tick(v) for v in d["lr"]])
                ax.minorticks_off()
            ax.set_title(f"{problem} · {label(opt, labels)}")
            ax.set_xlabel(AXIS_LABELS["lr"])
            if j == 0:
                metric = data.loc[data["problem"] == problem, "metric"].iloc[0]
                ax.set_ylabel(metric.replace("best ", "") + "\n(mean ± std over seeds)")
    fig.tight_layout()
    return fig


def draw_heatmaps(blocks: list[tuple[str, pd.DataFrame]], x: str = "lr", epsilons: Iterable[float] = (1, 10),
                  optimizers: list[str] | None = None, fmt: str = ".2f",
                  labels: dict[str, str] | None = None) -> Figure:
    """Heatmap blocks, one per (y, heatmap_data) pair, stacked and lettered: rows = ε,
    columns = optimizers; x and y values of each optimizer's own grid, ascending; missing cells
    blank; the best cell of each panel boxed red, cells whose runs all diverged boxed black."""
    blocks = [(y, d) for y, d in blocks if not d.empty]
    if not blocks:
        return _empty("no runs for this heatmap")
    eps = [float(e) for e in epsilons]
    names = ordered(pd.concat([d["optimizer"] for _, d in blocks]), optimizers)
    n_cells_x = max(d[x].nunique() for _, d in blocks)
    width = max(4.0, len(names) * (0.55 * n_cells_x + 0.9) + 1.2)
    heights = [len(eps) * (0.42 * d[y].nunique() + 0.9) for y, d in blocks]
    fig = plt.figure(figsize=(width, sum(heights) + 0.3 * len(blocks)), layout="constrained")
    subfigs = np.atleast_1d(fig.subfigures(len(blocks), 1, height_ratios=heights))
    for k, (subfig, (y, data)) in enumerate(zip(subfigs, blocks)):
        lower = bool(data["lower_is_better"].iloc[0])
        finite = data["value"][np.isfinite(data["value"])]
        norm = Normalize(finite.min(), finite.max()) if len(finite) else Normalize(0, 1)
        cmap = plt.get_cmap("viridis_r" if lower else "viridis")
        axes = subfig.subplots(len(eps), len(names), squeeze=False)
        for i, e in enumerate(eps):
            for j, opt in enumerate(names):
                grid = data[data["optimizer"] == opt]
                _heatmap_panel(axes[i][j], grid[grid["epsilon"] == e], x, y, sorted(grid[x].unique()),
                               sorted(grid[y].unique()), norm, cmap, fmt, lower)
                axes[i][j].set_title(f"{label(opt, labels)} · ε = {e:g}")
                if i < len(eps) - 1:
                    axes[i][j].set_xlabel("")
                if j > 0:
                    axes[i][j].set_ylabel("")
        subfig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, shrink=0.8,
                        label=data["metric"].iloc[0])
        if len(blocks) > 1:
            subfig.suptitle(f"({chr(ord('a') + k)}) {AXIS_LABELS.get(x, x)} × {AXIS_LABELS.get(y, y)}",
                            fontsize=10)
    return fig


def _heatmap_panel(ax, cells: pd.DataFrame, x: str, y: str, xs: list, ys: list, norm, cmap, fmt: str,
                   lower: bool) -> None:
    matrix = np.full((len(ys), len(xs)), np.nan)
    for _, c in cells.iterrows():
        if np.isfinite(c["value"]):
            matrix[ys.index(c[y]), xs.index(c[x])] = c["value"]
    # cell (row i, column j) spans [j, j+1] x [i, i+1], first row on top (as seaborn's heatmap)
    ax.pcolormesh(np.ma.masked_invalid(matrix), cmap=cmap, norm=norm, edgecolors="white", linewidth=0.5)
    ax.set_xlim(0, len(xs))
    ax.set_ylim(len(ys), 0)
    ax.set_xticks(np.arange(len(xs)) + 0.5, [_fmt_tick(v) for v in xs], rotation=45)
    ax.set_yticks(np.arange(len(ys)) + 0.5, [_fmt_tick(v) for v in ys])
    ax.grid(False)
    ax.set_facecolor("white")
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set(xlabel=AXIS_LABELS.get(x, x), ylabel=AXIS_LABELS.get(y, y))
    for _, c in cells.iterrows():
        i, j = ys.index(c[y]), xs.index(c[x])
        if c["diverged"]:
            ax.text(j + 0.5, i + 0.5, "∞" if lower else "div.", ha="center", va="center", fontsize=9)
            ax.add_patch(_box(i, j, "black", "diverged"))
        elif np.isfinite(c["value"]):
            r, g, b, _ = cmap(norm(c["value"]))
            dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5
            ax.text(j + 0.5, i + 0.5, format(c["value"], fmt), ha="center", va="center", fontsize=7,
                    color="white" if dark else "black")
        if c["is_best"]:
            ax.add_patch(_box(i, j, "red", "best"))


def _box(i: int, j: int, colour: str, gid: str) -> Rectangle:
    """A frame just inside cell (i, j); gid names what it marks (tests find boxes by it)."""
    return Rectangle((j + 0.04, i + 0.04), 0.92, 0.92, fill=False, edgecolor=colour, lw=2.2, zorder=3, gid=gid)


def draw_best_settings(data: pd.DataFrame, optimizers: list[str] | None = None,
                       labels: dict[str, str] | None = None) -> Figure:
    """Top row: the best run's epochs per batch size; bottom row: its learning rate (log y);
    one column per ε, one line per optimizer (slightly dodged so that equal values stay visible)."""
    if data.empty:
        return _empty("no runs")
    eps = sorted(data["epsilon"].unique())
    names = ordered(data["optimizer"], optimizers)
    colours = palette(names)
    sizes = sorted(data["batch_size"].unique())
    fig, axes = plt.subplots(2, len(eps), figsize=(3.4 * len(eps), 5.0), squeeze=False, sharex=True, sharey="row")
    for j, e in enumerate(eps):
        for k, opt in enumerate(names):
            d = data[(data["epsilon"] == e) & (data["optimizer"] == opt)].sort_values("batch_size")
            pos = np.array([sizes.index(b) for b in d["batch_size"]]) + 0.08 * (k - (len(names) - 1) / 2)
            for row, column in enumerate(("epochs", "lr")):
                axes[row][j].plot(pos, d[column], marker="o", ms=4, color=colours[opt], label=label(opt, labels))
        axes[0][j].set_title(f"ε = {e:g}")
        axes[1][j].set_yscale("log")
        axes[1][j].set_xticks(range(len(sizes)), [_fmt_tick(b) for b in sizes])
        axes[1][j].set_xlabel(AXIS_LABELS["batch_size"])
    axes[0][0].set_ylabel(f"best {AXIS_LABELS['epochs']}")
    axes[1][0].set_ylabel(f"best {AXIS_LABELS['lr']}")
    for row, column in enumerate(("epochs", "lr")):
        values = sorted(data[column].dropna().unique())
        if values:
            axes[row][0].set_yticks(values, [_fmt_tick(v) for v in values])
            axes[row][0].minorticks_off()
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------- figures

def comparison_figure(runs: pd.DataFrame, problems: list[str] | None = None, optimizers: list[str] | None = None,
                      select_by: str = "test", filters: dict | None = None) -> Figure:
    """Figs. 5.1 (one panel per problem) and 5.2 (problems P1, P3, P2: (a)-(c))."""
    runs = select_runs(runs, filters, optimizers, problems)
    return draw_comparison(best_per_setting(runs, select_by), problems, optimizers, legend_labels(runs))


def seed_sensitivity_figure(runs: pd.DataFrame, problems: list[str] | None = None,
                            optimizers: list[str] | None = None, select_by: str = "test",
                            min_seeds: int = 2, filters: dict | None = None) -> Figure:
    """Fig. 5.3."""
    runs = select_runs(runs, filters, optimizers, problems)
    return draw_seed_sensitivity(seed_sensitivity_data(runs, select_by, min_seeds), optimizers, min_seeds,
                                 legend_labels(runs))


def heatmap_figure(runs: pd.DataFrame, problem: str, ys: Iterable[str] = ("batch_size",), x: str = "lr",
                   epsilons: Iterable[float] = (1, 10), optimizers: list[str] | None = None,
                   select_by: str = "test", filters: dict | None = None, fmt: str = ".2f") -> Figure:
    """Figs. 5.4 and B.1 (ys = batch_size, epochs), 5.6, 5.7, 5.8 (ys = batch_size)."""
    runs = select_runs(runs, filters, optimizers)
    blocks = [(y, heatmap_data(runs, problem, y, x, epsilons, select_by)) for y in ys]
    return draw_heatmaps(blocks, x, epsilons, optimizers, fmt, legend_labels(runs))


def best_settings_figure(runs: pd.DataFrame, problem: str, epsilons: Iterable[float] | None = None,
                         optimizers: list[str] | None = None, select_by: str = "test",
                         filters: dict | None = None) -> Figure:
    """Figs. 5.5 and B.2."""
    runs = select_runs(runs, filters, optimizers)
    return draw_best_settings(best_settings_data(runs, problem, epsilons, select_by), optimizers,
                              legend_labels(runs))


def draw_audit(audits: pd.DataFrame, optimizers: list[str] | None = None) -> Figure:
    """The empirical audit (dpbench audit): one panel per optimizer, claimed ε (x) against the
    certified lower bound ε_lower (filled, a bar from 0) and the GDP estimate ε_GDP (hollow;
    a heuristic under subsampling), the claim as the diagonal, and the largest ε any audit
    with that many trials could certify (dotted). A violation of the claim turns the panel red."""
    trials = audits[audits["mode"] == "trials"] if "mode" in audits else audits
    if trials.empty:
        return _empty("no audits")
    names = ordered(trials["optimizer"].unique(), optimizers)
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.4 * rows), squeeze=False, sharex=True)
    top = float(np.nanmax(trials[["epsilon_claimed", "epsilon_lower"]].to_numpy())) * 1.15
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        here = trials[trials["optimizer"] == name].sort_values("epsilon_claimed")
        eps = here["epsilon_claimed"].to_numpy(float)
        x = np.arange(len(eps))
        flagged = bool(here["violation"].any())
        ax.plot(x, eps, color="0.3", lw=1, marker="_", ms=14, label="claimed ε")
        ax.bar(x, here["epsilon_lower"], width=0.5, color="#c0392b" if flagged else "#2e86c1", alpha=0.85,
               label="ε_lower (certified)")
        gdp = here["epsilon_gdp"].clip(upper=top)
        ax.scatter(x, gdp, facecolors="none", edgecolors="k", s=22, zorder=3, label="ε_GDP (estimate)")
        if "max_certifiable_epsilon" in here:
            ax.axhline(here["max_certifiable_epsilon"].min(), color="0.5", ls=":", lw=1, label="max certifiable")
        for xi, v in zip(x, here["violation"]):
            if v:
                ax.text(xi, 0.02 * top, "✗", ha="center", va="bottom", color="white", fontsize=9, fontweight="bold")
        ax.set_xticks(x, [_fmt_tick(e) for e in eps])
        ax.set_ylim(0, top)
        ax.set_title(label(name) + ("  — VIOLATION" if flagged else ""), color="#c0392b" if flagged else "black")
        if flagged:
            ax.set_facecolor("#fdecea")
    for ax in axes[-1]:
        ax.set_xlabel("claimed ε")
    for ax in axes[:, 0]:
        ax.set_ylabel("ε")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    r = int(trials["trials"].max())
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False,
               title=f"R = {r} trials, β = {trials['beta'].iloc[0]:g}, δ = {trials['delta'].iloc[0]:g}",
               title_fontsize=7, bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def audit_figure(audits: pd.DataFrame, optimizers: list[str] | None = None) -> Figure:
    return draw_audit(audits, optimizers)


# ---------------------------------------------------------------------------- language models (P4)
# Gong, Pavliv & Peng, "Evaluating Differentially Private SGD Optimizers for Training
# Transformer Language Models": training and validation loss per optimizer and ε, exposure of
# canaries repeated k times (Carlini et al. 2019, arXiv:1802.08232), and a ranking table.
# Every number comes from one configuration per (optimizer, ε): the one whose mean best
# validation loss over its seeds is lowest (selected on validation, never on test or canaries);
# a configuration with a non-finite validation loss on any seed loses to every finite one.

LM_REPEATS = CANARY_REPEATS  # canary repetitions k (0: never seen in training): the aggregated columns' k


def lm_configurations(runs: pd.DataFrame, problem: str = "P4") -> pd.DataFrame:
    """The runs of the chosen configuration of each (optimizer, ε) of ``problem``, all seeds,
    with ``epsilon`` the target ε (inf for non-private runs)."""
    r = _target_as_epsilon(runs[runs["problem"] == problem])
    r["epsilon"] = r["epsilon"].astype(float).fillna(np.inf)
    if r.empty:
        return r
    keys = [k for k in CONFIG_KEYS if k in r.columns and k != "target_epsilon"] + ["epsilon"]
    val = r["best_val_loss"].astype(float)
    r["_score"] = val.where(np.isfinite(val), np.inf)
    configs = r.groupby(keys, dropna=False)["_score"].agg(lambda v: v.mean() if np.isfinite(v).all() else np.inf)
    configs = configs.reset_index().sort_values(keys, kind="stable")
    chosen = configs.loc[configs.groupby(["optimizer", "epsilon"])["_score"].idxmin()]
    return r.merge(chosen[keys], on=keys).drop(columns="_score")


def _mean_std(values: pd.Series) -> tuple[float, float, int]:
    v = values.astype(float)
    v = v[np.isfinite(v)]
    return float(v.mean()) if len(v) else np.nan, float(v.std(ddof=1)) if len(v) > 1 else np.nan, len(v)


def lm_loss_data(runs: pd.DataFrame, problem: str = "P4") -> pd.DataFrame:
    """Per (optimizer, ε) of the chosen configuration and split (train: ``final_train_loss``,
    val: ``best_val_loss``): mean and std (ddof = 1) over its seeds with a finite loss.
    Columns: optimizer, private, epsilon (inf: non-private), split, mean, std, n_seeds, lr."""
    rows = []
    for (opt, eps), g in lm_configurations(runs, problem).groupby(["optimizer", "epsilon"], sort=True):
        for split, column in (("train", "final_train_loss"), ("val", "best_val_loss")):
            mean, std, n = _mean_std(g[column])
            rows.append({"optimizer": opt, "private": bool(g["private"].iloc[0]), "epsilon": eps, "split": split,
                         "mean": mean, "std": std, "n_seeds": n, "lr": float(g["lr"].iloc[0])})
    return pd.DataFrame(rows, columns=["optimizer", "private", "epsilon", "split", "mean", "std", "n_seeds", "lr"])


def lm_exposure_data(runs: pd.DataFrame, problem: str = "P4", repeats: Iterable[int] = LM_REPEATS) -> pd.DataFrame:
    """Per (optimizer, ε) of the chosen configuration and k: the exposure's mean and std
    (ddof = 1) over all its canaries of all seeds, pooled exactly from each run's mean, std
    (ddof = 0) and count; the share of them extracted. Columns: optimizer, private, epsilon
    (inf: non-private), k, mean, std, n_canaries, n_seeds, extracted."""
    rows = []
    for (opt, eps), g in lm_configurations(runs, problem).groupby(["optimizer", "epsilon"], sort=True):
        for k in repeats:
            n = g[f"canaries_k{k}"].astype(float).fillna(0).to_numpy()
            m, s = g[f"exposure_k{k}"].astype(float).to_numpy(), g[f"exposure_std_k{k}"].astype(float).to_numpy()
            ok = (n > 0) & np.isfinite(m)
            n, m, s, x = n[ok], m[ok], s[ok], g[f"extracted_k{k}"].astype(float).to_numpy()[ok]
            total = n.sum()
            mean = float((n * m).sum() / total) if total else np.nan
            # total sum of squares: within runs (n s^2) plus between runs (n (m - mean)^2)
            std = float(np.sqrt((n * s ** 2 + n * (m - mean) ** 2).sum() / (total - 1))) if total > 1 else np.nan
            rows.append({"optimizer": opt, "private": bool(g["private"].iloc[0]), "epsilon": eps, "k": k,
                         "mean": mean, "std": std, "n_canaries": int(total), "n_seeds": int(ok.sum()),
                         "extracted": float((n * x).sum() / total) if total else np.nan})
    return pd.DataFrame(rows, columns=["optimizer", "private", "epsilon", "k", "mean", "std", "n_canaries",
                                       "n_seeds", "extracted"])


def lm_ranking_data(runs: pd.DataFrame, problem: str = "P4", k: int = 25) -> pd.DataFrame:
    """The paper's ranking: per ε (inf: the non-private runs), the optimizers by mean
    validation perplexity exp(best_val_loss) over the chosen configuration's seeds (rank 1:
    lowest; diverged last), with its std, the exposure at k and the share extracted.
    Columns: epsilon, rank, optimizer, private, val_perplexity, val_perplexity_std, n_seeds,
    lr, exposure, exposure_std, extracted."""
    chosen = lm_configurations(runs, problem)
    exposure = lm_exposure_data(runs, problem, (k,)).set_index(["optimizer", "epsilon"])
    rows = []
    for (opt, eps), g in chosen.groupby(["optimizer", "epsilon"], sort=True):
        ppl = np.exp(g["best_val_loss"].astype(float))
        mean, std, n = _mean_std(ppl)
        e = exposure.loc[(opt, eps)]
        rows.append({"epsilon": eps, "optimizer": opt, "private": bool(g["private"].iloc[0]),
                     "val_perplexity": mean, "val_perplexity_std": std, "n_seeds": n, "lr": float(g["lr"].iloc[0]),
                     "exposure": e["mean"], "exposure_std": e["std"], "extracted": e["extracted"]})
    out = pd.DataFrame(rows, columns=["epsilon", "optimizer", "private", "val_perplexity", "val_perplexity_std",
                                      "n_seeds", "lr", "exposure", "exposure_std", "extracted"])
    out["_key"] = out["val_perplexity"].fillna(np.inf)
    out = out.sort_values(["epsilon", "_key", "optimizer"], kind="stable").drop(columns="_key")
    out.insert(1, "rank", out.groupby("epsilon").cumcount() + 1)
    return out.reset_index(drop=True)


def _eps_positions(epsilons: Iterable[float]) -> dict[float, float]:
    """x positions: finite ε on a log scale, ε = ∞ (non-private) one decade right of the largest."""
    finite = sorted(e for e in set(epsilons) if np.isfinite(e))
    pos = {e: float(np.log10(e)) for e in finite}
    if any(not np.isfinite(e) for e in epsilons):
        pos[np.inf] = (max(pos.values()) if pos else 0.0) + 1.0
    return pos


def _eps_axis(ax, pos: dict[float, float]) -> None:
    ax.set_xticks(list(pos.values()), ["∞\n(non-private)" if not np.isfinite(e) else _fmt_tick(e) for e in pos])
    ax.set_xlabel("target ε")
    if np.inf in pos:
        ax.axvline(pos[np.inf] - 0.5, color="0.6", lw=0.8, ls=":")


def draw_lm_loss(data: pd.DataFrame, optimizers: list[str] | None = None,
                 labels: dict[str, str] | None = None) -> Figure:
    """Two panels (training, validation loss): mean ± std over seeds against target ε (log x),
    one line per private optimizer; non-private optimizers as dashed lines with a ± std band."""
    if data.empty:
        return _empty("no language-model runs")
    names = ordered(data["optimizer"], optimizers)
    colours = palette(names)
    pos = _eps_positions(data.loc[data["private"], "epsilon"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, split, title in zip(axes, ("train", "val"), ("training loss (last epoch)", "validation loss (best)")):
        d = data[data["split"] == split]
        for opt in names:
            o = d[d["optimizer"] == opt].sort_values("epsilon")
            if o.empty:
                continue
            if o["private"].iloc[0]:
                ax.errorbar([pos[e] for e in o["epsilon"]], o["mean"], yerr=o["std"].fillna(0), marker="o", ms=4,
                            capsize=3, color=colours[opt], label=label(opt, labels))
            else:
                m, sd = o["mean"].iloc[0], (0.0 if pd.isna(o["std"].iloc[0]) else o["std"].iloc[0])
                ax.axhline(m, ls="--", lw=1, color=colours[opt], label=label(opt, labels))
                ax.axhspan(m - sd, m + sd, color=colours[opt], alpha=0.12, lw=0)
        if pos:
            ax.set_xticks(list(pos.values()), [_fmt_tick(e) for e in pos])
        ax.set_xlabel("target ε")
        ax.set_title(title)
    axes[0].set_ylabel("cross-entropy (nats/token)\nmean ± std over seeds")
    axes[1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def draw_lm_exposure(data: pd.DataFrame, optimizers: list[str] | None = None,
                     labels: dict[str, str] | None = None) -> Figure:
    """One panel per k (canary repetitions; k = 0: unseen canaries, the reference): exposure
    mean ± std over seeds and canaries against target ε (log x), non-private runs at the
    right edge (ε = ∞). Panel titles give the share of canaries extracted, worst optimizer."""
    if data.empty:
        return _empty("no memorisation results")
    names = ordered(data["optimizer"], optimizers)
    colours = palette(names)
    pos = _eps_positions(data["epsilon"])
    ks = sorted(data["k"].unique())
    fig, axes = plt.subplots(1, len(ks), figsize=(3.3 * len(ks), 3.4), sharey=True, squeeze=False)
    offsets = {o: (i - (len(names) - 1) / 2) * 0.03 for i, o in enumerate(names)}  # keep error bars apart
    for ax, k in zip(axes[0], ks):
        d = data[data["k"] == k]
        for opt in names:
            o = d[(d["optimizer"] == opt) & np.isfinite(d["mean"])].sort_values("epsilon")
            if o.empty:
                continue
            x = [pos[e] + offsets[opt] for e in o["epsilon"]]
            ax.errorbar(x, o["mean"], yerr=o["std"].fillna(0), marker="o" if o["private"].iloc[0] else "D",
                        ms=4, capsize=3, color=colours[opt], ls="-" if o["private"].iloc[0] else "none",
                        label=label(opt, labels))
        _eps_axis(ax, pos)
        worst = d["extracted"].max()
        ax.set_title(f"k = {k}" + (" (unseen)" if k == 0 else "") +
                     (f" · extracted ≤ {worst:.0%}" if np.isfinite(worst) else ""))
    axes[0][0].set_ylabel("exposure (bits)\nmean ± std over seeds and canaries")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def _pm(mean: float, std: float, fmt: str) -> str:
    if not np.isfinite(mean):
        return "diverged" if mean == np.inf else "–"
    return format(mean, fmt) + ("" if not np.isfinite(std) else " ± " + format(std, fmt))


def draw_lm_ranking(data: pd.DataFrame, k: int = 25, labels: dict[str, str] | None = None) -> str:
    """The ranking as Markdown: one table per ε (non-private last)."""
    if data.empty:
        return "# Language model: ranking\n\nNo language-model runs.\n"
    lines = ["# Language model: optimizers ranked by validation perplexity", "",
             "Per target ε, the configuration of each optimizer with the lowest mean validation loss; "
             f"perplexity exp(best validation loss), mean ± std over seeds; exposure of the canaries "
             f"inserted k = {k} times (bits), mean ± std over seeds and canaries.", ""]
    for eps, g in data.groupby("epsilon", sort=True):
        lines += [f"## ε = {_fmt_tick(eps)}" if np.isfinite(eps) else "## non-private (ε = ∞)", "",
                  f"| rank | optimizer | validation perplexity | exposure (k = {k}) | extracted (k = {k}) | lr | seeds |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for _, r in g.iterrows():
            extracted = "–" if not np.isfinite(r["extracted"]) else f"{r['extracted']:.0%}"
            lines.append(f"| {r['rank']} | {label(r['optimizer'], labels)} | "
                         f"{_pm(r['val_perplexity'], r['val_perplexity_std'], '.2f')} | "
                         f"{_pm(r['exposure'], r['exposure_std'], '.2f')} | {extracted} | {_fmt_tick(r['lr'])} | "
                         f"{r['n_seeds']} |")
        lines.append("")
    return "\n".join(lines)


def lm_loss_figure(runs: pd.DataFrame, problem: str = "P4", optimizers: list[str] | None = None,
                   filters: dict | None = None) -> Figure:
    runs = select_runs(runs, filters, optimizers)
    return draw_lm_loss(lm_loss_data(runs, problem), optimizers, legend_labels(runs))


def lm_exposure_figure(runs: pd.DataFrame, problem: str = "P4", optimizers: list[str] | None = None,
                       filters: dict | None = None) -> Figure:
    runs = select_runs(runs, filters, optimizers)
    return draw_lm_exposure(lm_exposure_data(runs, problem), optimizers, legend_labels(runs))


def lm_ranking_table(runs: pd.DataFrame, problem: str = "P4", k: int = 25, optimizers: list[str] | None = None,
                     filters: dict | None = None) -> str:
    runs = select_runs(runs, filters, optimizers)
    return draw_lm_ranking(lm_ranking_data(runs, problem, k), k, legend_labels(runs))


@dataclass(frozen=True)
class FigureSpec:
    build: Callable[..., Figure | str]
    defaults: dict
    title: str
    kind: str = "figure"  # "figure": <stem>.png and .pdf; "table": a Markdown string, <stem>.md


FIGURES = {
    "fig5_1": FigureSpec(comparison_figure, {}, "Setup 1: best test accuracy per optimizer and ε"),
    "fig5_2": FigureSpec(comparison_figure, {"problems": ["P1", "P3", "P2"]},
                         "Setups 2 & 3: matrix mechanisms, best utility per optimizer and ε"),
    "fig5_3": FigureSpec(seed_sensitivity_figure, {}, "Setup 1: seed sensitivity"),
    "fig5_4": FigureSpec(heatmap_figure, {"problem": "P1", "ys": ("batch_size", "epochs")},
                         "Setup 1, P1: best test accuracy over lr × batch size and lr × epochs"),
    "fig5_5": FigureSpec(best_settings_figure, {"problem": "P1"}, "Setup 1, P1: best epochs and lr per batch size"),
    "fig5_6": FigureSpec(heatmap_figure, {"problem": "P2"}, "Setup 2, P2: best test accuracy over lr × batch size"),
    "fig5_7": FigureSpec(heatmap_figure, {"problem": "P1"}, "Setup 3, P1: best test accuracy over lr × batch size"),
    "fig5_8": FigureSpec(heatmap_figure, {"problem": "P3"}, "Setup 3, P3: best log10 test loss over lr × batch size"),
    "figB_1": FigureSpec(heatmap_figure, {"problem": "P2", "ys": ("batch_size", "epochs")},
                         "Setup 1, P2: best test accuracy over lr × batch size and lr × epochs"),
    "figB_2": FigureSpec(best_settings_figure, {"problem": "P2"}, "Setup 1, P2: best epochs and lr per batch size"),
    # drawn from the audits table (results/audit/audits.parquet), not the runs table
    "audit": FigureSpec(audit_figure, {}, "Empirical privacy audit: claimed ε against the measured lower bound"),
    # the language model (config/lm.yaml; Gong, Pavliv & Peng)
    "lm_loss": FigureSpec(lm_loss_figure, {}, "P4: training and validation loss per optimizer and ε"),
    "lm_exposure": FigureSpec(lm_exposure_figure, {}, "P4: canary exposure against ε per repetition count k"),
    "lm_ranking": FigureSpec(lm_ranking_table, {}, "P4: optimizers ranked by validation perplexity per ε",
                             kind="table"),
}
THESIS_FIGURES = [f for f in FIGURES if f.startswith("fig")]
LM_FIGURES = [f for f in FIGURES if f.startswith("lm_")]  # the ones drawn from the runs table


def extensions(figure_id: str) -> tuple[str, ...]:
    """The files `plot` writes for a figure: ("png", "pdf"), or ("md",) for a table."""
    return ("md",) if FIGURES[figure_id].kind == "table" else ("png", "pdf")


def save(fig: Figure | str, out_stem: str | Path) -> tuple[Path, ...]:
    """Writes <stem>.png (200 dpi) and <stem>.pdf (vector, no creation date, so reruns give the
    same bytes) and closes the figure; a table (Markdown string) as <stem>.md. A .png/.pdf/.md
    suffix on `out_stem` is dropped."""
    stem = Path(out_stem)
    if stem.suffix in (".png", ".pdf", ".md"):
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(fig, str):
        from dpbench.files import atomic_write

        md = stem.with_name(stem.name + ".md")
        atomic_write(md, lambda f: f.write(fig), mode="w")
        return (md,)
    png, pdf = stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")
    for out in (png, pdf):
        refuse_special(out)
    fig.savefig(png, dpi=200, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(pdf, bbox_inches="tight", metadata={"CreationDate": None, "Creator": None, "Producer": None})
    plt.close(fig)
    return png, pdf


def check_options(figure_id: str, options: dict) -> None:
    """Refuses an option the figure does not take (naming it and the closest one it does) and
    a ``select_by`` other than test or val, before any drawing."""
    import difflib
    import inspect

    params = list(inspect.signature(FIGURES[figure_id].build).parameters)[1:]  # after the table
    for key in options:
        if key not in params:
            close = difflib.get_close_matches(key, params, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"options: {', '.join(params)}"
            raise ValueError(f"unknown option {key!r} of figure {figure_id} ({hint})")
    if options.get("select_by", "test") not in ("test", "val"):
        raise ValueError(f"select_by must be test or val, got {options['select_by']!r}")


def build(figure_id: str, runs: pd.DataFrame, **options) -> Figure:
    """The figure `figure_id` (a key of FIGURES) of a runs table; options override the
    figure's defaults; filters="thesis" uses THESIS_FILTERS[figure_id]."""
    try:
        spec = FIGURES[figure_id]
    except KeyError:
        raise ValueError(f"unknown figure {figure_id!r}; known: {', '.join(FIGURES)}") from None
    check_options(figure_id, options)
    if isinstance(options.get("filters"), str):
        if options["filters"] != "thesis":
            raise ValueError(f"filters must be a dict or 'thesis', got {options['filters']!r}")
        options["filters"] = THESIS_FILTERS[figure_id]
    _style()
    return spec.build(runs, **{**spec.defaults, **options})


LIST_OPTIONS = ("ys", "epsilons", "optimizers", "problems")


def parse_options(items: Iterable[str]) -> dict:
    """Command-line options ``KEY=VALUE`` -> keyword arguments of `plot`: values are YAML
    scalars (``min_seeds=3``, ``select_by=val``); ``ys``, ``epsilons``, ``optimizers`` and
    ``problems`` take comma-separated lists; ``filter.COLUMN=v1,v2`` adds to ``filters``;
    ``filters=thesis`` uses THESIS_FILTERS."""
    import yaml

    options: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"figure option {item!r}: expected KEY=VALUE")
        if key.startswith("filter."):
            options.setdefault("filters", {})[key[len("filter."):]] = [yaml.safe_load(v) for v in value.split(",")]
        elif key in LIST_OPTIONS:
            options[key] = [yaml.safe_load(v) for v in value.split(",")]
        else:
            options[key] = yaml.safe_load(value)
    return options


def plot(figure_id: str, runs_path: str | Path, out_stem: str | Path, **options) -> tuple[Path, ...]:
    """Reads the aggregated runs table, draws figure `figure_id`, writes <out_stem>.png and
    .pdf (a table: <out_stem>.md); returns their paths."""
    runs = pd.read_parquet(runs_path)
    return save(build(figure_id, runs, **options), out_stem)
