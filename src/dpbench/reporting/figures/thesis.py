"""The figures of thesis chapter 5 and Appendix B: the comparison of optimizers (Figs. 5.1,
5.2), seed sensitivity (5.3), heatmaps over two settings (5.4, 5.6-5.8, B.1) and the best
settings per batch size (5.5, B.2).

Every figure is two steps: a *data* function (runs table -> a tidy DataFrame holding exactly
the numbers drawn, testable without a plot) and a *draw* function (that DataFrame -> Figure);
the *figure* function (the ``build`` of its ``FigureSpec``) selects the runs and chains them.
"""

from __future__ import annotations

from typing import Iterable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dpbench.reporting.figures.intervals import INTERVAL, draw_intervals, overlap
from dpbench.reporting.figures.selection import CONFIG_KEYS, by_privacy, scored, select_best_config, select_runs
from dpbench.reporting.figures.spent import caption, selection_privacy
from dpbench.reporting.figures.style import (AXIS_LABELS, DATASETS, empty_figure, fmt_tick, label, legend_labels,
                                             ordered, palette)

# Which runs of config/thesis.yaml's table (all three setups) each figure is about: the setups
# differ in their epochs (Setup 1: 250, 500; Setup 2: 1; Setup 3: 30). Harmless on a table of
# one setup (config/setupN.yaml); wrong for small configs. plot(..., filters="thesis") uses them.
THESIS_FILTERS = {
    "fig5_1": {"epochs": [250, 500]}, "fig5_2": {"epochs": [1, 30]}, "fig5_3": {"epochs": [250, 500]},
    "fig5_4": {"epochs": [250, 500]}, "fig5_5": {"epochs": [250, 500]}, "fig5_6": {"epochs": [1]},
    "fig5_7": {"epochs": [30]}, "fig5_8": {"epochs": [30]}, "figB_1": {"epochs": [250, 500]},
    "figB_2": {"epochs": [250, 500]},
}



# ---------------------------------------------------------------------------- data functions

def best_per_setting(runs: pd.DataFrame, select_by: str = "test", privacy: bool = True) -> pd.DataFrame:
    """Figs. 5.1, 5.2: per (problem, optimizer, ε) the best configuration over all other
    settings, by its mean selection score over seeds (``select_best_config``), ε the one each
    run is shown under (``selection.by_privacy``: the target met, the achieved ε of a run given
    σ alone; inf for non-private). Columns: problem, dataset, optimizer, epsilon, private, value
    (mean over seeds), ci_low, ci_high (95 % t interval; equal to value for one seed), n_seeds,
    metric, lower_is_better, diverged, n_runs (= k, the candidate runs the choice looked at),
    n_configs, the chosen configuration's run_id (first seed), lr, batch_size, epochs, seed,
    achieved_epsilon, and with ``privacy``: selection_epsilon (the k runs composed, ``spent``),
    select_by."""
    r = by_privacy(runs)
    best = select_best_config(r, ["problem", "optimizer", "epsilon"], select_by)
    best["private"] = best["private"].astype(bool)
    best["select_by"] = select_by
    best["selection_epsilon"] = np.nan
    if privacy and not best.empty:
        best["selection_epsilon"] = [s["selection_epsilon"]
                                     for s in _spent_by(best, r, ["problem", "optimizer", "epsilon"])]
    cols = ["problem", "dataset", "optimizer", "epsilon", "private", "value", "ci_low", "ci_high", "n_seeds",
            "metric", "lower_is_better", "diverged", "n_runs", "n_configs", "run_id", "lr", "batch_size", "epochs",
            "seed", "achieved_epsilon", "selection_epsilon", "select_by"]
    return best[[c for c in cols if c in best.columns]]


def seed_sensitivity_data(runs: pd.DataFrame, select_by: str = "test", min_seeds: int = 2) -> pd.DataFrame:
    """Fig. 5.3: per (problem, optimizer, learning rate), the configuration (all settings but
    the seed) with at least `min_seeds` seeds whose mean selection score over seeds is best,
    and the mean and sample std (ddof=1) over those seeds of its reported test metric.

    A seed that diverged gives its configuration a score of -inf (a configuration that
    diverges on some seed is not chosen while another is available); mean and std are over
    the seeds with a finite value (`n_finite` of `n_seeds`)."""
    s = scored(by_privacy(runs), select_by)
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
                 epsilons: Iterable[float] = (1, 10), select_by: str = "test", privacy: bool = True) -> pd.DataFrame:
    """Figs. 5.4, 5.6-5.8, B.1: for one problem, per (optimizer, ε, y, x) cell the best
    configuration over all other settings by its mean selection score over seeds
    (``select_best_config``: a seed that diverged rules its configuration out). Columns: problem,
    optimizer, epsilon, x, y, value (mean over seeds), ci_low, ci_high (95 % t interval), n_seeds,
    diverged, is_best (each (optimizer, ε) panel's cell of the best mean selection score: on the
    split ``select_by`` chooses by, highest accuracy or lowest loss; one per panel), tied (the cell's interval overlaps the best cell's: both with two
    or more seeds), n_runs, n_configs, run_id, metric, lower_is_better, select_by and, per panel,
    panel_runs (k, the runs the boxed cell was chosen among) and with ``privacy``
    selection_epsilon and not_composed (``spent.selection_privacy``)."""
    eps = [float(e) for e in epsilons]
    r = by_privacy(runs[runs["problem"] == problem])
    r = r[r["private"].astype(bool) & r["epsilon"].isin(eps)]
    best = select_best_config(r, ["optimizer", "epsilon", y, x], select_by)
    cols = ["problem", "optimizer", "epsilon", x, y, "value", "ci_low", "ci_high", "n_seeds", "diverged", "is_best",
            "tied", "n_runs", "n_configs", "run_id", "metric", "lower_is_better", "select_by", "panel_runs",
            "selection_epsilon", "not_composed"]
    if best.empty:
        return pd.DataFrame(columns=cols)
    best = best.assign(is_best=False, tied=False, select_by=select_by, panel_runs=0, selection_epsilon=np.nan,
                       not_composed="")
    spent = _spent_by(best, r, ["optimizer", "epsilon"], privacy)
    best["panel_runs"] = [s["k"] for s in spent]
    if privacy:
        best["selection_epsilon"] = [s["selection_epsilon"] for s in spent]
        best["not_composed"] = [s["not_composed"] for s in spent]
    for _, panel in best.groupby(["optimizer", "epsilon"], sort=False):
        finite = panel[np.isfinite(panel["value"]) & np.isfinite(panel["score"])]
        if finite.empty:
            continue
        pick = finite["score"].idxmax()  # by the split that chooses (select_by), not by the value shown
        best.loc[pick, "is_best"] = True
        best.loc[finite.index, "tied"] = [i != pick and _overlap(finite.loc[pick], c) for i, c in finite.iterrows()]
    return best[cols].sort_values(["optimizer", "epsilon", y, x]).reset_index(drop=True)


def _spent_by(chosen: pd.DataFrame, runs: pd.DataFrame, keys: list[str], privacy: bool = True) -> list[dict]:
    """For each row of ``chosen``, ``spent.selection_privacy`` of the runs sharing its ``keys``
    (the candidates its choice looked at), computed once per group; without ``privacy`` only
    the count ``k``."""
    groups = {tuple(k) if isinstance(k, tuple) else (k,): g for k, g in runs.groupby(keys, sort=False)}
    done: dict[tuple, dict] = {}
    for key in chosen[keys].itertuples(index=False, name=None):
        if key not in done:
            group = groups.get(key, runs.iloc[:0])
            done[key] = selection_privacy(group, list(CONFIG_KEYS)) if privacy else {"k": len(group)}
    return [done[key] for key in chosen[keys].itertuples(index=False, name=None)]


def _overlap(a: pd.Series, b: pd.Series) -> bool:
    """Whether two cells' intervals over seeds overlap (``intervals.tied_with_above``'s rule),
    only where both have two or more seeds: a single seed has no interval to overlap."""
    return min(a["n_seeds"], b["n_seeds"]) >= 2 and overlap((a["ci_low"], a["ci_high"]), (b["ci_low"], b["ci_high"]))


def best_settings_data(runs: pd.DataFrame, problem: str, epsilons: Iterable[float] | None = None,
                       select_by: str = "test", privacy: bool = True) -> pd.DataFrame:
    """Figs. 5.5, B.2: per (optimizer, ε, batch size) of one problem, the epochs and learning
    rate of the best configuration over all other settings by its mean selection score over
    seeds (``select_best_config``). Columns: problem, optimizer, epsilon, batch_size, epochs, lr,
    value (mean over seeds), ci_low, ci_high (95 % t interval), n_seeds, n_configs (the candidate
    settings), n_runs (k: their runs, seeds included), metric, diverged, run_id, select_by and with
    ``privacy`` selection_epsilon (the k runs composed, ``spent``)."""
    r = by_privacy(runs[runs["problem"] == problem])
    r = r[r["private"].astype(bool) & np.isfinite(r["epsilon"])]
    if epsilons is not None:
        r = r[r["epsilon"].isin([float(e) for e in epsilons])]
    best = select_best_config(r, ["optimizer", "epsilon", "batch_size"], select_by)
    cols = ["problem", "optimizer", "epsilon", "batch_size", "epochs", "lr", "value", "ci_low", "ci_high", "n_seeds",
            "n_configs", "n_runs", "metric", "diverged", "run_id", "select_by", "selection_epsilon"]
    if best.empty:
        return pd.DataFrame(columns=cols)
    best["select_by"], best["selection_epsilon"] = select_by, np.nan
    if privacy:
        best["selection_epsilon"] = [s["selection_epsilon"]
                                     for s in _spent_by(best, r, ["optimizer", "epsilon", "batch_size"])]
    # a batch size whose configurations all diverged has no best epochs or learning rate
    best.loc[best["diverged"] | ~np.isfinite(best["value"]), ["epochs", "lr"]] = np.nan
    return best[cols].reset_index(drop=True)



# ---------------------------------------------------------------------------- drawing

def draw_comparison(best: pd.DataFrame, problems: list[str] | None = None,
                    optimizers: list[str] | None = None, labels: dict[str, str] | None = None) -> Figure:
    """Bars: best metric per optimizer (hue) and ε (x: the target met, or the achieved ε of runs
    given σ alone), one panel per problem (in the order given, panels lettered (a), (b), ...
    when several); non-private optimizers as dashed horizontal lines. Groups whose runs all
    diverged have no bar."""
    import seaborn as sns

    present = list(best["problem"].unique())
    problems = [p for p in problems if p in present] if problems is not None else sorted(present)
    if not problems:
        return empty_figure("no runs to compare")
    colours = palette(best["optimizer"].unique())
    fig, axes = plt.subplots(1, len(problems), figsize=(4.6 * len(problems), 3.6), squeeze=False)
    for i, (ax, problem) in enumerate(zip(axes[0], problems)):
        here = best[best["problem"] == problem]
        names = ordered(here["optimizer"], optimizers)
        private = here[here["private"] & here["optimizer"].isin(names) & np.isfinite(here["value"])].copy()
        if len(private):
            eps = sorted(private["epsilon"].unique())
            private["ε"] = private["epsilon"].map(fmt_tick)
            private["optimizer "] = private["optimizer"].map(lambda o: label(o, labels))
            hue = [label(o, labels) for o in names if o in set(private["optimizer"])]
            sns.barplot(data=private, x="ε", y="value", hue="optimizer ", order=[fmt_tick(e) for e in eps],
                        hue_order=hue, palette={label(o, labels): colours[o] for o in names}, ax=ax)
            _intervals_and_labels(ax, private, [fmt_tick(e) for e in eps], hue)
        for _, ref in here[~here["private"] & here["optimizer"].isin(names)].iterrows():
            if np.isfinite(ref["value"]):
                ax.axhline(ref["value"], ls="--", lw=1, color=colours[ref["optimizer"]],
                           label=label(ref["optimizer"], labels))
        metric = here["metric"].iloc[0]
        dataset = f" · {DATASETS.get(here['dataset'].iloc[0], here['dataset'].iloc[0])}" if "dataset" in here else ""
        letter = f"({chr(ord('a') + i)}) " if len(problems) > 1 else ""
        ax.set(title=f"{letter}{problem}{dataset}", ylabel=metric, xlabel="ε")
        if not here["lower_is_better"].iloc[0]:
            ax.set_ylim(0, 1)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False)
    fig.tight_layout()
    if "select_by" in best.columns and len(best):
        n_seeds = int(best["n_seeds"].max()) if "n_seeds" in best else 1
        k = sorted({int(v) for v in best.loc[best["private"], "n_runs"]}) if "n_runs" in best else []
        fig.text(0.01, -0.02, caption(str(best["select_by"].iloc[0]), n_seeds, INTERVAL,
                                      f"k = {', '.join(map(str, k))}." if k else ""),
                 fontsize=6.5, ha="left", va="top", wrap=True, gid="caption")
    return fig


def _intervals_and_labels(ax, private: pd.DataFrame, x_order: list[str], hue: list[str]) -> None:
    """Each bar's 95 % interval over seeds (where it has two or more) and its label inside it:
    the value and ε_sel (the privacy of the choice, ``spent``)."""
    for container, name in zip(ax.containers, hue):
        rows = private[private["optimizer "] == name].set_index("ε")
        labels = []
        for bar in container:
            x = int(round(bar.get_x() + bar.get_width() / 2))
            if not 0 <= x < len(x_order) or x_order[x] not in rows.index:
                labels.append("")
                continue
            r = rows.loc[x_order[x]]
            centre = bar.get_x() + bar.get_width() / 2
            if r.get("n_seeds", 1) >= 2 and np.isfinite(r.get("ci_low", np.nan)):
                draw_intervals(ax, centre, r["value"], r["ci_low"], r["ci_high"])
            sel = r.get("selection_epsilon", np.nan)
            labels.append(f"{r['value']:.3f}" + (f" · ε_sel {sel:.3g}" if np.isfinite(sel) else ""))
        ax.bar_label(container, labels=labels, fontsize=6, label_type="center", rotation=90,
                     bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.4, "alpha": 0.85})


def draw_seed_sensitivity(data: pd.DataFrame, optimizers: list[str] | None = None, min_seeds: int = 2,
                          labels: dict[str, str] | None = None) -> Figure:
    """Mean ± std over seeds vs learning rate (log x); rows = problems, columns = optimizers."""
    if data.empty:
        return empty_figure(f"no configuration with at least {min_seeds} seeds")
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
                ax.set_xticks(d["lr"], [fmt_tick(v) for v in d["lr"]])
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
    columns = optimizers; x and y values of each optimizer's own grid, ascending; each cell the
    mean over seeds of its best configuration, missing cells blank; the best cell of each panel
    boxed red, cells whose interval overlaps it framed dashed orange (tied), cells whose runs all
    diverged boxed black; a panel's title gives ε_sel where its choice has a composed ε. The
    caption says the seeds, the interval and the split that chose."""
    blocks = [(y, d) for y, d in blocks if not d.empty]
    if not blocks:
        return empty_figure("no runs for this heatmap")
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
                sel = grid.loc[grid["epsilon"] == e, "selection_epsilon"] if "selection_epsilon" in grid else []
                spent = f" · ε_sel {sel.iloc[0]:.3g}" if len(sel) and np.isfinite(sel.iloc[0]) else ""
                axes[i][j].set_title(f"{label(opt, labels)} · ε = {e:g}{spent}")
                if i < len(eps) - 1:
                    axes[i][j].set_xlabel("")
                if j > 0:
                    axes[i][j].set_ylabel("")
        subfig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=axes, shrink=0.8,
                        label=data["metric"].iloc[0])
        if len(blocks) > 1:
            subfig.suptitle(f"({chr(ord('a') + k)}) {AXIS_LABELS.get(x, x)} × {AXIS_LABELS.get(y, y)}",
                            fontsize=10)
    _heatmap_caption(fig, pd.concat([d for _, d in blocks]))
    return fig


def _heatmap_caption(fig: Figure, data: pd.DataFrame) -> None:
    """The line under the heatmaps: the split that chose, the seeds, what the boxes mean."""
    if "select_by" not in data or "n_seeds" not in data:
        return
    n_seeds = int(data["n_seeds"].max())
    shown = data.loc[np.isfinite(data["value"]), "n_seeds"]  # diverged cells have no finite seed
    fewest = int(shown.min()) if len(shown) else n_seeds
    k = sorted({int(v) for v in data["panel_runs"]}) if "panel_runs" in data else []
    boxes = ("Each cell: the mean over seeds of its best configuration (every other setting); red box: the best "
             "cell of its panel" + ("; dashed orange: cells whose interval overlaps the best's (tied)"
                                   if n_seeds >= 2 else "") + "; black: every run diverged."
             + (" A cell of one seed has no interval and is never marked tied." if fewest <= 1 < n_seeds else ""))
    extra = (f"{boxes} ε_sel in a panel's title: the boxed cell's choice among all its panel's runs "
             f"(N = {', '.join(map(str, k))})." if k else boxes)
    fig.text(0.01, -0.01, caption(str(data["select_by"].iloc[0]), n_seeds, INTERVAL, extra), fontsize=6.5,
             ha="left", va="top", wrap=True, gid="caption")


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
    ax.set_xticks(np.arange(len(xs)) + 0.5, [fmt_tick(v) for v in xs], rotation=45)
    ax.set_yticks(np.arange(len(ys)) + 0.5, [fmt_tick(v) for v in ys])
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
        elif c.get("tied", False):
            ax.add_patch(_box(i, j, "darkorange", "tied", "--"))


def _box(i: int, j: int, colour: str, gid: str, ls: str = "-") -> Rectangle:
    """A frame just inside cell (i, j); gid names what it marks (tests find boxes by it)."""
    return Rectangle((j + 0.04, i + 0.04), 0.92, 0.92, fill=False, edgecolor=colour, lw=2.2, ls=ls, zorder=3,
                     gid=gid)


def _largest_spent(data: pd.DataFrame) -> str:
    """ε_sel of Figs. 5.5, B.2 for the caption (a point per choice would crowd the lines)."""
    sel = data["selection_epsilon"] if "selection_epsilon" in data else pd.Series(dtype=float)
    finite = sel[np.isfinite(sel)]
    if not len(finite):
        return "ε_sel: none (–)."
    rest = "." if len(finite) == len(sel) else " where composed, else none (–)."
    return f"ε_sel up to {finite.max():.3g}{rest}"


def draw_best_settings(data: pd.DataFrame, optimizers: list[str] | None = None,
                       labels: dict[str, str] | None = None) -> Figure:
    """Top row: the epochs of the best configuration (by its mean over seeds) per batch size;
    bottom row: its learning rate (log y); one column per ε, one line per optimizer (slightly
    dodged so that equal values stay visible); the caption says the seeds and the split that chose."""
    if data.empty:
        return empty_figure("no runs")
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
        axes[1][j].set_xticks(range(len(sizes)), [fmt_tick(b) for b in sizes])
        axes[1][j].set_xlabel(AXIS_LABELS["batch_size"])
    axes[0][0].set_ylabel(f"best {AXIS_LABELS['epochs']}")
    axes[1][0].set_ylabel(f"best {AXIS_LABELS['lr']}")
    for row, column in enumerate(("epochs", "lr")):
        values = sorted(data[column].dropna().unique())
        if values:
            axes[row][0].set_yticks(values, [fmt_tick(v) for v in values])
            axes[row][0].minorticks_off()
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    if "select_by" in data and "n_seeds" in data:
        k = sorted({int(v) for v in data["n_runs"]})
        interval = f"{INTERVAL} of the chosen configuration's metric (in the data; not drawn: the points are settings)"
        fig.text(0.01, -0.01, caption(str(data["select_by"].iloc[0]), int(data["n_seeds"].max()), interval,
                                      f"Per batch size: the epochs and lr of the configuration with the best mean "
                                      f"over seeds; k = {', '.join(map(str, k))}; " + _largest_spent(data)),
                 fontsize=6.5, ha="left", va="top", wrap=True, gid="caption")
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

