"""Fine-tuning from a public checkpoint (P5, P6; docs/finetune.md): each optimizer's result per
fine-tuning mode beside the same optimizer trained from scratch, per ε.

A run's *mode* is its ``finetune`` column (the runs table's start columns: ``full``,
``last-block``, ``lora``, ``bias``, or ``scratch`` for the from-scratch twin), LoRA's with its
rank (``lora-r16``); runs without a recorded start are left out. For every (optimizer, ε, mode)
the configuration (learning rate, batch size, epochs, hyperparameters: everything but the seed)
is chosen as every comparison chooses it (``selection.select_best_config``: the best mean
selection score over its seeds, a seed that diverged rules it out, a tie on that score to the
lowest mean validation loss, then the first in config order: ``selection.TIE_TOLERANCE``), among
that mode's runs only: the mode is part of a configuration (``CONFIG_KEYS``), so
runs of two modes are never pooled as seeds or rates of one setting. The number shown is the
chosen configuration's mean over its seeds of the reported test metric, with the 95 % t interval
over them (``intervals``): P6 the test accuracy, P5 the test perplexity exp(test loss), at the
epoch the split ``select_by`` chose (default the validation split). ε_sel is what the choice spent
(``spent.selection_privacy`` of the mode's candidate runs).

* ``finetune_data``: the numbers (one row per optimizer, ε, mode), with each mode's rank among
  the optimizer's modes at that ε (ties: overlapping intervals), the gap to the non-private
  reference of the same mode and to the same optimizer from scratch, and for a language model the
  exposure of the canaries inserted k times (pooled over seeds and canaries as ``lm_exposure``).
* ``chosen_runs``: the runs behind those rows, one per seed of each chosen configuration
  (``finetune_claims`` pairs them by seed); ``tied_runs``: those of the configurations the tie
  rule passed over (``n_tied`` counts them with the chosen one), under which a claim's verdict
  is recomputed.
* ``finetune_figure``: panels per ε (non-private last), groups per optimizer, one bar per mode,
  the scratch bar hatched; ``finetune_exposure_figure``: the same bars of the exposure at k;
  ``finetune_table``: the numbers as Markdown.

``modes``, ``epsilons`` and ``optimizers`` restrict any of them: ``modes=[scratch, full],
epsilons=[1]`` is a pretrained DP run at ε = 1 beside its from-scratch twin.
"""

from __future__ import annotations

import math
from typing import Iterable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dpbench.problems.catalog import task_facts
from dpbench.problems.modes import SCRATCH, Start, option_settings, start_of
from dpbench.reporting.figures.intervals import (INTERVAL, RECORD_INTERVAL, draw_intervals, record_contrast_interval,
                                                t_interval, tied_with_above)
from dpbench.reporting.figures.language_model import pooled_exposure
from dpbench.reporting.results import unpack_outcomes
from dpbench.reporting.figures.selection import (CONFIG_KEYS, by_privacy, select_best_config, select_runs,
                                                 selection_columns, tied_configs)
from dpbench.reporting.figures.spent import caption, selection_privacy
from dpbench.reporting.figures.style import empty_figure, fmt_tick, label, legend_labels, ordered

# a mode's colour by its name (dpbench.problems.modes.MODES; from scratch hatched grey)
SCRATCH_COLOUR = "#dddddd"  # the twin from random initialisation (a mode's own colour: Mode.colour)
SCRATCH_HATCH = "///"
PAGE_WIDTH = 7.5  # inches: a figure reads at a page's width (letter or A4 less margins)
PANEL_HEIGHT = 2.6  # inches, one panel (one ε) a row
COLUMNS = ["problem", "optimizer", "private", "epsilon", "mode", "finetune", "lora_rank", "value", "ci_low",
           "ci_high", "n_seeds", "interval", "diverged", "metric", "higher_is_better", "rank", "tied", "gap_non_private",
           "gap_scratch", "lr", "batch_size", "epochs", "hyperparameters", "trainable_parameters", "n_runs",
           "n_configs", "n_tied", "selection_epsilon", "not_composed", "exposure", "exposure_std", "n_canaries",
           "extracted", "select_by"]


# each label mode_of has given, and the start it is the label of (labels are made from starts,
# never read back into one: Start.label is one-to-one)
_STARTS: dict[str, Start] = {}


def mode_of(runs: pd.DataFrame) -> pd.Series:
    """Each run's mode: the label of its start (``Start.label``: ``full``, ``lora-r16``,
    ``scratch``), made from the runs table's ``finetune`` column and its options' columns; None
    where the run recorded no start."""
    options = [s for s in option_settings() if s in runs]
    out = []
    for i, name in enumerate(runs["finetune"]):
        if name is None or (isinstance(name, float) and math.isnan(name)):
            out.append(None)
            continue
        given = {s: int(runs[s].iloc[i]) for s in options if pd.notna(runs[s].iloc[i])}
        start = start_of(str(name), **given)
        _STARTS.setdefault(start.label, start)
        out.append(start.label)
    return pd.Series(out, index=runs.index, dtype=object)


def start_of_label(mode: str) -> Start:
    """The start a label of ``mode_of`` was made from (a label no run gave: the start of that name)."""
    return _STARTS.get(mode) or start_of(mode)


def mode_name(mode: str) -> str:
    """The name of the mode (``full``, ``lora``) or ``scratch`` of a label of ``mode_of``."""
    start = start_of_label(mode)
    return SCRATCH if start.mode is None else start.mode.name


def _colour(mode: str) -> str:
    """A bar's colour: its mode's own (``Mode.colour``), the scratch twin's grey."""
    start = start_of_label(mode)
    return SCRATCH_COLOUR if start.mode is None else start.mode.colour


def mode_label(mode: str) -> str:
    """A mode's name in figures: ``LoRA (r = 16)``."""
    return start_of_label(mode).caption


def ordered_modes(labels: Iterable[str]) -> list[str]:
    """The modes present, scratch first, then the registry's order (LoRA by rank)."""
    return sorted(set(labels), key=lambda m: (start_of_label(m).sort_key, m))


def _wanted(mode: str, wanted: Iterable[str] | None) -> bool:
    """Whether ``wanted`` (names: ``lora`` takes every rank, ``lora-r8`` one) asks for ``mode``."""
    return wanted is None or mode in wanted or mode_name(mode) in wanted


def _same(column: pd.Series, value) -> pd.Series:
    return column.isna() if pd.isna(value) else column == value


def _shown(runs: pd.DataFrame, problem: str, modes, epsilons, non_private: bool) -> pd.DataFrame:
    """The problem's runs with a recorded mode that the options ask for, ``epsilon`` the ε each
    is shown under (``by_privacy``)."""
    if "finetune" not in runs:
        return runs.iloc[:0].assign(mode=pd.Series(dtype=object), epsilon=pd.Series(dtype=float))
    r = runs[runs["problem"] == problem]
    r = r.assign(mode=mode_of(r))
    r = r[r["mode"].notna()]
    r = r[np.array([_wanted(m, modes) for m in r["mode"]], dtype=bool)]  # (an empty list would select columns)
    r = by_privacy(r)
    private = r["private"].astype(bool)
    keep = (~private & non_private) | (private & (r["epsilon"].isin([float(e) for e in epsilons])
                                                 if epsilons is not None else True))
    return r[keep]


def finetune_data(runs: pd.DataFrame, problem: str = "P6", modes: Iterable[str] | None = None,
                  epsilons: Iterable[float] | None = None, select_by: str = "val", non_private: bool = True,
                  k: int = 25) -> pd.DataFrame:
    """One row per (optimizer, ε, mode) of ``problem`` (module docstring), in columns ``COLUMNS``:
    value (P6: mean test accuracy; P5: mean test perplexity), ci_low, ci_high (95 % t interval
    over seeds; equal to the value for one seed), n_seeds; rank among the optimizer's modes at
    that ε by value (1: best) and tied (the interval overlaps the one ranked above); gap_non_private
    (value minus the non-private reference of the same mode: its best non-private configuration
    by the selection score; NaN without one) and gap_scratch (value minus the same optimizer's
    from-scratch value at that ε); the chosen configuration (lr, batch_size, epochs,
    hyperparameters) and its d; n_runs (k, the candidate runs), n_configs and selection_epsilon;
    for a language model the exposure at ``k`` (mean, std over seeds and canaries, n_canaries,
    share extracted; NaN otherwise)."""
    r = _shown(runs, problem, modes, epsilons, non_private)
    if r.empty:
        return pd.DataFrame(columns=COLUMNS)
    facts = task_facts(r["task"].iloc[0])
    language = facts.plants_canaries
    rows = []
    for b, chosen, values in _choices(r, select_by):
        mean, low, high, n, how = _interval(chosen, values, facts.measures_accuracy and select_by == "val")
        if b["diverged"] or not np.isfinite(b["score"]):
            mean = low = high = (math.inf if b["diverged"] and not facts.select_higher else math.nan)
        candidates = r[(r["optimizer"] == b["optimizer"]) & (r["epsilon"] == b["epsilon"]) & (r["mode"] == b["mode"])]
        spent = selection_privacy(candidates, list(CONFIG_KEYS))
        exposure = (pooled_exposure(chosen, k) if language and f"canaries_k{k}" in chosen
                    else {"mean": np.nan, "std": np.nan, "n_canaries": 0, "extracted": np.nan})
        trained = chosen["trainable_parameters"] if "trainable_parameters" in chosen else pd.Series(dtype=float)
        rows.append({
            "problem": problem, "optimizer": b["optimizer"], "private": bool(chosen["private"].astype(bool).all()),
            "epsilon": float(b["epsilon"]), "mode": b["mode"], "finetune": mode_name(b["mode"]),
            "lora_rank": b.get("lora_rank"), "value": mean, "ci_low": low, "ci_high": high, "n_seeds": n, "interval": how,
            "diverged": bool(b["diverged"]),
            "metric": "test accuracy" if facts.measures_accuracy else "test perplexity",
            "higher_is_better": facts.select_higher, "score": float(b["score"]),
            "lr": float(b["lr"]), "batch_size": b["batch_size"], "epochs": b["epochs"],
            "hyperparameters": b.get("hyperparameters", "{}"),
            "trainable_parameters": trained.dropna().iloc[0] if trained.notna().any() else np.nan,
            "n_runs": spent["k"], "n_configs": spent["n_configs"], "n_tied": int(b.get("n_tied", 1)),
            "selection_epsilon": spent["selection_epsilon"],
            "not_composed": spent["not_composed"], "exposure": exposure["mean"], "exposure_std": exposure["std"],
            "n_canaries": exposure["n_canaries"], "extracted": exposure["extracted"], "select_by": select_by})
    out = pd.DataFrame(rows)
    _ranks_and_gaps(out)
    return out[COLUMNS + ["score"]]


def record_outcomes(c: pd.DataFrame) -> tuple[pd.Series | None, pd.Series | None, bool]:
    """(per-record outcomes by seed, test records by seed, shared) of one configuration's runs:
    the outcomes where a run recorded them (``test_correct_at_best_val``), the records from
    ``n_test`` or else the ``test_subset`` drawn; the seeds share their records where none drew
    a subset."""
    seeds = c["seed"].to_numpy()
    subset = c["test_subset"].astype(float) if "test_subset" in c else pd.Series(np.nan, index=c.index)
    n = c["n_test"].astype(float) if "n_test" in c else pd.Series(np.nan, index=c.index)
    n = n.where(n.notna(), subset)
    n_test = None if n.isna().any() else pd.Series(n.astype(int).to_numpy(), index=seeds)
    outcomes = None
    if n_test is not None and "test_correct_at_best_val" in c:
        packed = c["test_correct_at_best_val"].tolist()
        outcomes = pd.Series([unpack_outcomes(p, int(k)) if isinstance(p, str) else None
                              for p, k in zip(packed, n_test)], index=seeds, dtype=object)
    return outcomes, n_test, bool(subset.isna().all())


# the kinds of interval record_contrast_interval gives that count the test records
RECORD_HOWS = ("seeds × records", "seeds + records", "seeds + record floor")


def interval_of(data: pd.DataFrame) -> str:
    """What ``finetune_data``'s intervals are (its ``interval`` column): over seeds and test
    records where a row's runs recorded their per-record outcomes, else the t interval over seeds."""
    hows = set(data["interval"]) if len(data) and "interval" in data else set()
    if not hows & set(RECORD_HOWS):
        return INTERVAL
    return RECORD_INTERVAL + ("" if hows <= set(RECORD_HOWS) else "; over seeds alone where runs did not record them")


def _interval(chosen: pd.DataFrame, values: pd.Series, records: bool) -> tuple[float, float, float, int, str]:
    """(mean, low, high, seeds, how) of one configuration's test values: for a test accuracy at
    the epoch validation chose (``records``), the interval over seeds and test records (the claims
    table's, ``intervals.record_contrast_interval`` of the one term: never of width 0 where two
    seeds agree to the last record; ``how`` one of ``RECORD_HOWS``, or "paired" where the runs
    recorded no test records), else the t interval over seeds ("t"); one seed: its value alone."""
    if not records or values.notna().sum() < 2:
        return (*t_interval(values.to_numpy()), "t")
    outcomes, n_test, shared = record_outcomes(chosen)
    by_seed = pd.Series(values.to_numpy(), index=chosen["seed"].to_numpy())
    c = record_contrast_interval([(1, by_seed, outcomes, n_test)], shared_records=shared)
    return c.mean, c.low, c.high, c.n, c.how


def _choices(r: pd.DataFrame, select_by: str):
    """Per (optimizer, ε, mode) of the shown runs ``r`` (``_shown``, one problem): the chosen
    configuration's row (``select_best_config``), its runs (every seed) and their test values
    (P6 the accuracy, P5 the perplexity exp(test loss)), the numbers ``finetune_data`` shows."""
    facts = task_facts(r["task"].iloc[0])
    reported = selection_columns(r["task"].iloc[0], select_by)[1]
    keys = [c for c in (*CONFIG_KEYS, "mode") if c in r.columns]
    for _, b in select_best_config(r, ["optimizer", "epsilon", "mode"], select_by).iterrows():
        chosen = r[np.logical_and.reduce([_same(r[c], b[c]).to_numpy() for c in keys])]
        values = chosen[reported].astype(float)
        if not facts.measures_accuracy:
            with np.errstate(over="ignore"):
                values = np.exp(values)  # perplexity
        yield b, chosen, values


def chosen_runs(runs: pd.DataFrame, problem: str = "P6", modes: Iterable[str] | None = None,
                epsilons: Iterable[float] | None = None, select_by: str = "val",
                non_private: bool = True) -> pd.DataFrame:
    """The runs behind ``finetune_data``'s rows, one per seed of each (optimizer, ε, mode)'s
    chosen configuration: the runs table's columns with ``mode``, ``epsilon`` (the ε shown),
    ``test_value`` (the value finetune_data averages), ``chosen_score`` (the configuration's
    mean selection score, -inf where a seed diverged) and ``chosen_diverged``."""
    r = _shown(runs, problem, modes, epsilons, non_private)
    if r.empty:
        return r.assign(test_value=pd.Series(dtype=float), chosen_score=pd.Series(dtype=float),
                        chosen_diverged=pd.Series(dtype=bool))
    parts = [chosen.assign(test_value=values, chosen_score=float(b["score"]), chosen_diverged=bool(b["diverged"]))
             for b, chosen, values in _choices(r, select_by)]
    return pd.concat(parts, ignore_index=True)


def tied_runs(runs: pd.DataFrame, problem: str = "P6", modes: Iterable[str] | None = None,
              epsilons: Iterable[float] | None = None, select_by: str = "val",
              non_private: bool = True) -> pd.DataFrame:
    """The runs of every configuration tied with a chosen one on its mean selection score and
    passed over by the tie rule (``selection.tied_configs``), in ``chosen_runs``' columns plus
    ``choice`` (1, 2, ...: the rule's order after the chosen one); empty where nothing tied."""
    r = _shown(runs, problem, modes, epsilons, non_private)
    empty = r.iloc[:0].assign(test_value=pd.Series(dtype=float), chosen_score=pd.Series(dtype=float),
                              chosen_diverged=pd.Series(dtype=bool), choice=pd.Series(dtype=int))
    if r.empty:
        return empty
    facts = task_facts(r["task"].iloc[0])
    reported = selection_columns(r["task"].iloc[0], select_by)[1]
    parts = []
    for _, configs in tied_configs(r, ["optimizer", "epsilon", "mode"], select_by):
        for choice, c in enumerate(configs[1:], start=1):
            values = c[reported].astype(float)
            if not facts.measures_accuracy:
                with np.errstate(over="ignore"):
                    values = np.exp(values)
            parts.append(c.drop(columns=["score", "value", "lower_is_better", "metric", "run_diverged"])
                         .assign(test_value=values.to_numpy(), chosen_score=float(c["score"].mean()),
                                 chosen_diverged=False, choice=choice))
    return pd.concat(parts, ignore_index=True) if parts else empty


def _ranks_and_gaps(out: pd.DataFrame) -> None:
    """Adds rank, tied, gap_non_private and gap_scratch in place (``finetune_data``)."""
    sign = np.where(out["higher_is_better"].astype(bool), -1.0, 1.0)
    values = out["value"].astype(float).to_numpy()
    out["_key"] = np.where(np.isfinite(values), sign * values, np.inf)
    out["rank"], out["tied"] = 0, False
    for _, g in out.groupby(["optimizer", "epsilon"], sort=False):
        g = g.sort_values(["_key", "mode"], kind="stable")
        out.loc[g.index, "rank"] = np.arange(1, len(g) + 1)
        out.loc[g.index, "tied"] = tied_with_above(g)
    del out["_key"]
    reference = {}  # mode -> the non-private value of its best configuration (by the selection score)
    for mode, g in out[~out["private"]].groupby("mode", sort=False):
        g = g[np.isfinite(g["score"])]
        if len(g):
            reference[mode] = float(g.loc[g["score"].idxmax(), "value"])
    scratch = {(o, e): v for o, e, m, v in zip(out["optimizer"], out["epsilon"], out["mode"], out["value"])
               if m == "scratch"}
    out["gap_non_private"] = [v - reference[m] if m in reference and p else np.nan
                              for v, m, p in zip(out["value"], out["mode"], out["private"])]
    out["gap_scratch"] = [v - scratch[(o, e)] if (o, e) in scratch and m != "scratch" else np.nan
                          for o, e, m, v in zip(out["optimizer"], out["epsilon"], out["mode"], out["value"])]


def _panel_title(eps: float) -> str:
    return f"ε = {fmt_tick(eps)}" if np.isfinite(eps) else "non-private (ε = ∞)"


def draw_finetune(data: pd.DataFrame, value: str = "value", low: str = "ci_low", high: str = "ci_high",
                  ylabel: str | None = None, optimizers: list[str] | None = None,
                  labels: dict[str, str] | None = None, note: str = "", interval: str | None = None,
                  title: str = "") -> Figure:
    """Panels per ε (ascending, non-private last), a group of bars per optimizer, one bar per
    mode (colours: each mode's ``colour``; from scratch hatched), each bar's ``value`` with error bars
    from ``low`` to ``high`` where it has two or more seeds; bars carry the gid
    ``finetune|<optimizer>|<ε>|<mode>``. The caption says the split that chose, the seeds, the
    interval and k (the candidate runs per bar)."""
    shown = data[np.isfinite(data[value].astype(float))] if len(data) else data
    if shown.empty:
        return empty_figure("no fine-tuning runs to compare")
    epsilons = sorted(shown["epsilon"].unique())
    modes = ordered_modes(shown["mode"])
    width = 0.8 / len(modes)
    panels = [(e, ordered(shown.loc[shown["epsilon"] == e, "optimizer"], optimizers)) for e in epsilons]
    # one panel a row, at most a page wide (PAGE_WIDTH inches): a study's 7 optimizers x 5 modes
    # in one row of four panels would be a strip 40 inches wide
    fig_width = min(PAGE_WIDTH, max(3.0, 0.3 * len(modes) * max(len(o) for _, o in panels) + 1.0))
    height = PANEL_HEIGHT * len(panels) + 1.2
    fig, axes = plt.subplots(len(panels), 1, figsize=(fig_width, height), squeeze=False, sharey=True)
    axes = axes.T  # axes[0]: the panels, top to bottom
    for ax, (eps, names) in zip(axes[0], panels):
        d = shown[shown["epsilon"] == eps]
        for i, mode in enumerate(modes):
            for j, opt in enumerate(names):
                row = d[(d["optimizer"] == opt) & (d["mode"] == mode)]
                if row.empty:
                    continue
                row = row.iloc[0]
                x = j + (i - (len(modes) - 1) / 2) * width
                scratch = mode == "scratch"
                bar = ax.bar(x, row[value], width, color=_colour(mode),
                             hatch=SCRATCH_HATCH if scratch else None, edgecolor="0.25" if scratch else "none",
                             label=mode_label(mode))
                bar.patches[0].set_gid(f"finetune|{opt}|{fmt_tick(eps)}|{mode}")
                if row.get("n_seeds", 1) >= 2 and np.isfinite([row[low], row[high]]).all():
                    draw_intervals(ax, x, row[value], row[low], row[high])
                sel = row.get("selection_epsilon", np.nan)
                text = format(row[value], ".3f" if abs(row[value]) < 10 else ".1f")
                ax.text(x, 0, text + (f" · ε_sel {sel:.3g}" if np.isfinite(sel) else ""), rotation=90, ha="center",
                        va="bottom", fontsize=5.5, bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.3,
                                                           "alpha": 0.8})
        ax.set_xticks(np.arange(len(names)), [label(o, labels) for o in names], rotation=25, ha="right", fontsize=7)
        ax.set_title(_panel_title(eps), fontsize=9)
    axes[0][0].set_ylabel(ylabel or f"{shown['metric'].iloc[0]}"
                          + (" (lower is better)" if not bool(shown["higher_is_better"].iloc[0]) else ""))
    handles = {}
    for ax in axes[0]:
        for h, n in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(n, h)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.9 / height))
    if title:
        fig.suptitle(title, fontsize=9, y=1 - 0.05 / height)
    fig.legend(handles.values(), handles.keys(), fontsize=7, loc="upper center",
               bbox_to_anchor=(0.5, 1 - 0.3 / height), ncol=len(handles), frameon=False, title="fine-tuning mode",
               title_fontsize=7)
    n_seeds = int(shown["n_seeds"].max())
    ks = sorted({int(v) for v in shown["n_runs"]})
    extra = ("One bar per fine-tuning mode, hatched: the same optimizer trained from scratch; each mode's "
             "configuration chosen among that mode's runs alone. " + f"k = {', '.join(map(str, ks))}." +
             (f" {note}" if note else ""))
    fig.text(0.01, -0.02, caption(str(shown["select_by"].iloc[0]), n_seeds, interval or interval_of(shown), extra),
             fontsize=6.5, ha="left", va="top", wrap=True, gid="caption")
    return fig


def finetune_figure(runs: pd.DataFrame, problem: str = "P6", modes: list[str] | None = None,
                    epsilons: list[float] | None = None, optimizers: list[str] | None = None,
                    select_by: str = "val", non_private: bool = True, filters: dict | None = None) -> Figure:
    runs = select_runs(runs, filters, optimizers)
    data = finetune_data(runs, problem, modes, epsilons, select_by, non_private)
    title = f"{problem}: {data['metric'].iloc[0]} per optimizer and fine-tuning mode" if len(data) else ""
    return draw_finetune(data, optimizers=optimizers, labels=legend_labels(runs), title=title)


def finetune_exposure_figure(runs: pd.DataFrame, problem: str = "P5", k: int = 25, modes: list[str] | None = None,
                             epsilons: list[float] | None = None, optimizers: list[str] | None = None,
                             select_by: str = "val", non_private: bool = True,
                             filters: dict | None = None) -> Figure:
    """The exposure of the canaries inserted ``k`` times per optimizer and mode (the
    configuration chosen on ``select_by``'s split, as in ``finetune_figure``); error bars ± the
    std over seeds and canaries."""
    runs = select_runs(runs, filters, optimizers)
    data = finetune_data(runs, problem, modes, epsilons, select_by, non_private, k)
    data = data[data["n_canaries"] > 0]
    data = data.assign(exposure_low=data["exposure"] - data["exposure_std"].fillna(0),
                       exposure_high=data["exposure"] + data["exposure_std"].fillna(0))
    if len(data):
        data = data.assign(metric=f"exposure (k = {k})", higher_is_better=True)
    return draw_finetune(data, "exposure", "exposure_low", "exposure_high",
                        f"exposure of the canaries inserted k = {k} times (bits)\nmean ± std over seeds and canaries",
                        optimizers, legend_labels(runs),
                        "Exposure is measured on the training canaries: a measurement of memorisation, not a "
                        "private release; the error bars are the std over seeds and canaries.",
                        interval="± the std over seeds and canaries",
                        title=f"{problem}: exposure of the canaries inserted k = {k} times per optimizer and mode")


def number(v: float, fmt: str) -> str:
    """``v`` in ``fmt``, or in 3 significant digits from 10⁵ on (a perplexity of a run that blew up,
    e^35 ≈ 1.6e+15, is not printed in 20 digits)."""
    return format(v, ".3g" if abs(v) >= 1e5 else fmt)


def _value(r, fmt: str) -> str:
    if not np.isfinite(r["value"]):
        return "diverged" if r["diverged"] else "–"
    if r["n_seeds"] >= 2 and np.isfinite(r["ci_low"]):
        return f"{number(r['value'], fmt)} [{number(r['ci_low'], fmt)}, {number(r['ci_high'], fmt)}]"
    return number(r["value"], fmt)


def _gap(v: float, fmt: str) -> str:
    return "–" if not np.isfinite(v) else ("+" if v >= 0 else "−") + number(abs(v), fmt)


def draw_finetune_table(data: pd.DataFrame, problem: str, k: int = 25, labels: dict[str, str] | None = None) -> str:
    """``finetune_data`` as Markdown: a table per ε (non-private last), rows per optimizer and
    mode; a mode whose interval overlaps the one ranked above it is marked tied (=)."""
    if data.empty:
        return f"# {problem}: fine-tuning\n\nNo fine-tuning runs.\n"
    accuracy = data["metric"].iloc[0] == "test accuracy"
    fmt = ".3f" if accuracy else ".2f"
    language = (data["n_canaries"] > 0).any()
    seeds = int(data["n_seeds"].max())
    lines = [f"# {problem}: {data['metric'].iloc[0]} per optimizer and fine-tuning mode", "",
             f"Per ε (the target met; ∞: non-private), optimizer and mode (from scratch: the same optimizer and "
             f"settings without the public checkpoint), the configuration (learning rate, batch size, epochs, "
             f"hyperparameters) with the best mean selection score over its seeds, "
             f"{'chosen on the validation split' if data['select_by'].iloc[0] == 'val' else 'chosen on the TEST split (optimistic)'}"
             f" among that mode's runs alone; the {data['metric'].iloc[0]} of that configuration, "
             + ("one seed (no interval)" if seeds < 2 else f"mean over seeds [{interval_of(data)}]")
             + f" ({'higher' if accuracy else 'lower'} is better). rank: among the optimizer's modes at that ε; = "
             "marks a mode tied with the one ranked above (their intervals overlap). Δ non-private: minus the "
             "non-private reference of the same mode (its best non-private configuration); Δ scratch: minus the same "
             "optimizer from scratch at that ε. d: the trained parameters. k runs: the candidate runs the choice "
             "looked at; ε_sel: those runs composed (PLD, at the runs' δ), the privacy the number spent (– where "
             "it has none: candidates sharing a seed, or non-private)."
             + (f" Exposure: of the canaries inserted k = {k} times (bits), mean ± std over seeds and canaries; "
                "a measurement of memorisation, not a private release." if language else ""), ""]
    head = ["optimizer", "mode", "d", data["metric"].iloc[0], "rank", "Δ non-private", "Δ scratch", "lr",
            "hyperparameters", "seeds", "k runs", "ε_sel"]
    if language:
        head += [f"exposure (k = {k})", f"extracted (k = {k})"]
    for eps, g in data.groupby("epsilon", sort=True):
        lines += [f"## {_panel_title(eps)}", "", "| " + " | ".join(head) + " |",
                  "| " + " | ".join("---" if h in ("optimizer", "mode", "hyperparameters") else "---:" for h in head)
                  + " |"]
        names = ordered(g["optimizer"])
        g = g.assign(_o=g["optimizer"].map(names.index),
                     _m=g["mode"].map(ordered_modes(g["mode"]).index)).sort_values(["_o", "_m"])
        for _, r in g.iterrows():
            sel = "–" if not np.isfinite(r["selection_epsilon"]) else f"{r['selection_epsilon']:.3g}"
            d = "–" if pd.isna(r["trainable_parameters"]) else f"{int(r['trainable_parameters']):,}"
            cells = [label(r["optimizer"], labels), mode_label(r["mode"]), d, _value(r, fmt),
                     f"= {r['rank']}" if r["tied"] else f"{r['rank']}", _gap(r["gap_non_private"], fmt),
                     _gap(r["gap_scratch"], fmt), fmt_tick(r["lr"]), f"`{r['hyperparameters']}`",
                     f"{r['n_seeds']}", f"{r['n_runs']}", sel]
            if language:
                exposure = ("–" if not np.isfinite(r["exposure"]) else f"{r['exposure']:.2f}" +
                            ("" if not np.isfinite(r["exposure_std"]) else f" ± {r['exposure_std']:.2f}"))
                cells += [exposure, "–" if not np.isfinite(r["extracted"]) else f"{r['extracted']:.0%}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def finetune_table(runs: pd.DataFrame, problem: str = "P6", modes: list[str] | None = None,
                   epsilons: list[float] | None = None, optimizers: list[str] | None = None,
                   select_by: str = "val", non_private: bool = True, k: int = 25,
                   filters: dict | None = None) -> str:
    runs = select_runs(runs, filters, optimizers)
    return draw_finetune_table(finetune_data(runs, problem, modes, epsilons, select_by, non_private, k), problem, k,
                               legend_labels(runs))
