"""The language-model figures (P4, config/lm.yaml) of Gong, Pavliv & Peng, "Evaluating
Differentially Private SGD Optimizers for Training Transformer Language Models": training and
validation loss per optimizer and ε, exposure of canaries repeated k times (Carlini et al. 2019,
arXiv:1802.08232), and a ranking table.

Every number comes from one configuration per (optimizer, ε): the one whose mean best
validation loss over its seeds is lowest (selected on validation, never on test or canaries);
a configuration with a non-finite validation loss on any seed loses to every finite one. ε is
the one each run is shown under (``selection.by_privacy``: the target met, the achieved ε of a
run given σ alone, ∞ for non-private runs; a run that exceeded its target is left out), and a
configuration's runs share their σ and privacy.
"""

from __future__ import annotations

from typing import Iterable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dpbench.problems.catalog import CANARY_REPEATS
from dpbench.reporting.figures.intervals import INTERVAL, t_interval, tied_with_above
from dpbench.reporting.figures.selection import CONFIG_KEYS, by_privacy, select_runs
from dpbench.reporting.figures.spent import selection_privacy
from dpbench.reporting.figures.style import empty_figure, fmt_tick, label, legend_labels, ordered, palette

LM_REPEATS = CANARY_REPEATS  # canary repetitions k (0: never seen in training): the aggregated columns' k


def lm_configurations(runs: pd.DataFrame, problem: str = "P4") -> pd.DataFrame:
    """The runs of the chosen configuration of each (optimizer, ε) of ``problem``, all seeds,
    with ``epsilon`` the ε each is shown under (``by_privacy``; inf for non-private runs). A
    configuration is its settings, σ and privacy: runs that differ in σ are never pooled."""
    r = by_privacy(runs[runs["problem"] == problem])
    if r.empty:
        return r
    keys = [k for k in (*CONFIG_KEYS, "noise_multiplier", "private") if k in r.columns]
    val = r["best_val_loss"].astype(float)
    r["_score"] = val.where(np.isfinite(val), np.inf)
    # configurations numbered in the order of their keys (missing keys, such as the fine-tuning
    # mode of a run trained from scratch, last), each row tagged with its own
    r["_config"] = r.groupby(keys, dropna=False, sort=True).ngroup()
    configs = r.groupby("_config").agg(_score=("_score", lambda v: v.mean() if np.isfinite(v).all() else np.inf),
                                       optimizer=("optimizer", "first"), epsilon=("epsilon", "first"))
    chosen = configs.groupby(["optimizer", "epsilon"])["_score"].idxmin()  # the first of equal means
    return r[r["_config"].isin(chosen.to_numpy())].drop(columns=["_score", "_config"])


def _mean_std(values: pd.Series) -> tuple[float, float, int]:
    """Mean and std over the finite values, and their number; the mean is inf where every
    value is (every seed diverged), NaN where there is none."""
    v = values.astype(float)
    finite = v[np.isfinite(v)]
    if not len(finite):
        return np.inf if (v == np.inf).any() else np.nan, np.nan, 0
    return float(finite.mean()), float(finite.std(ddof=1)) if len(finite) > 1 else np.nan, len(finite)


def lm_loss_data(runs: pd.DataFrame, problem: str = "P4") -> pd.DataFrame:
    """Per (optimizer, ε) of the chosen configuration and split (train: ``final_train_loss``,
    val: ``best_val_loss``): mean, std (ddof = 1) and 95 % t interval (``intervals``) over its
    seeds with a finite loss, and ``n_diverged``, its seeds without one (a diverged run's
    training loss, whatever the steps before it diverged gave; its best validation loss where no
    epoch had a finite one); mean inf where every seed diverged. Columns: optimizer, private,
    epsilon (inf: non-private), split, mean, std, ci_low, ci_high, n_seeds, n_diverged, lr."""
    rows = []
    for (opt, eps), g in lm_configurations(runs, problem).groupby(["optimizer", "epsilon"], sort=True):
        for split, column in (("train", "final_train_loss"), ("val", "best_val_loss")):
            values = g[column].astype(float)
            gone = np.isinf(values) | (g["status"].eq("diverged") if split == "train" else False)
            kept = values.where(~gone, np.inf)
            mean, std, n = _mean_std(kept)
            _, low, high, _ = t_interval(kept.to_numpy())
            rows.append({"optimizer": opt, "private": bool(g["private"].all()), "epsilon": eps, "split": split,
                         "mean": mean, "std": std, "ci_low": low, "ci_high": high, "n_seeds": n,
                         "n_diverged": int(gone.sum()), "lr": float(g["lr"].iloc[0])})
    return pd.DataFrame(rows, columns=["optimizer", "private", "epsilon", "split", "mean", "std", "ci_low", "ci_high",
                                       "n_seeds", "n_diverged", "lr"])


def lm_exposure_data(runs: pd.DataFrame, problem: str = "P4", repeats: Iterable[int] = LM_REPEATS) -> pd.DataFrame:
    """Per (optimizer, ε) of the chosen configuration and k: the exposure's mean and std
    (ddof = 1) over all its canaries of all seeds, pooled exactly from each run's mean, std
    (ddof = 0) and count; the share of them extracted. Columns: optimizer, private, epsilon
    (inf: non-private), k, mean, std, n_canaries, n_seeds, extracted."""
    rows = []
    for (opt, eps), g in lm_configurations(runs, problem).groupby(["optimizer", "epsilon"], sort=True):
        for k in repeats:
            rows.append({"optimizer": opt, "private": bool(g["private"].all()), "epsilon": eps, "k": k,
                         **pooled_exposure(g, k)})
    return pd.DataFrame(rows, columns=["optimizer", "private", "epsilon", "k", "mean", "std", "n_canaries",
                                       "n_seeds", "extracted"])


def pooled_exposure(runs: pd.DataFrame, k: int) -> dict:
    """The exposure of the canaries inserted k times over every canary of ``runs`` (the seeds of
    one configuration), pooled exactly from each run's mean, std (ddof = 0) and count: mean, std
    (ddof = 1), n_canaries, n_seeds (runs with canaries) and the share extracted."""
    n = runs[f"canaries_k{k}"].astype(float).fillna(0).to_numpy()
    m, s = runs[f"exposure_k{k}"].astype(float).to_numpy(), runs[f"exposure_std_k{k}"].astype(float).to_numpy()
    ok = (n > 0) & np.isfinite(m)
    n, m, s, x = n[ok], m[ok], s[ok], runs[f"extracted_k{k}"].astype(float).to_numpy()[ok]
    total = n.sum()
    mean = float((n * m).sum() / total) if total else np.nan
    # total sum of squares: within runs (n s^2) plus between runs (n (m - mean)^2)
    std = float(np.sqrt((n * s ** 2 + n * (m - mean) ** 2).sum() / (total - 1))) if total > 1 else np.nan
    return {"mean": mean, "std": std, "n_canaries": int(total), "n_seeds": int(ok.sum()),
            "extracted": float((n * x).sum() / total) if total else np.nan}


def lm_ranking_data(runs: pd.DataFrame, problem: str = "P4", k: int = 25) -> pd.DataFrame:
    """The paper's ranking: per ε (inf: the non-private runs), the optimizers by mean
    validation perplexity exp(best_val_loss) over the chosen configuration's seeds (rank 1:
    lowest; diverged last), with its std and 95 % t interval over seeds (``intervals``), `tied`
    (its interval overlaps the one ranked just above), the exposure at k and the share
    extracted, and what the choice spent: `n_runs` (k candidate runs of the optimizer at that ε,
    every configuration and seed the validation split chose among), `n_configs`,
    `selection_epsilon` (those runs composed, ``spent``).
    Columns: epsilon, rank, optimizer, private, val_perplexity, val_perplexity_std, ci_low,
    ci_high, tied, n_seeds, lr, exposure, exposure_std, extracted, n_runs, n_configs,
    selection_epsilon."""
    chosen = lm_configurations(runs, problem)
    exposure = lm_exposure_data(runs, problem, (k,)).set_index(["optimizer", "epsilon"])
    everything = by_privacy(runs[runs["problem"] == problem])
    rows = []
    for (opt, eps), g in chosen.groupby(["optimizer", "epsilon"], sort=True):
        ppl = np.exp(g["best_val_loss"].astype(float))
        mean, std, n = _mean_std(ppl)
        _, low, high, _ = t_interval(ppl.to_numpy())
        e = exposure.loc[(opt, eps)]
        spent = selection_privacy(everything[(everything["optimizer"] == opt) & (everything["epsilon"] == eps)],
                                  list(CONFIG_KEYS))
        rows.append({"epsilon": eps, "optimizer": opt, "private": bool(g["private"].all()),
                     "val_perplexity": mean, "val_perplexity_std": std, "ci_low": low, "ci_high": high,
                     "n_seeds": n, "lr": float(g["lr"].iloc[0]),
                     "exposure": e["mean"], "exposure_std": e["std"], "extracted": e["extracted"],
                     "n_runs": spent["k"], "n_configs": spent["n_configs"],
                     "selection_epsilon": spent["selection_epsilon"]})
    out = pd.DataFrame(rows, columns=["epsilon", "optimizer", "private", "val_perplexity", "val_perplexity_std",
                                      "ci_low", "ci_high", "n_seeds", "lr", "exposure", "exposure_std", "extracted",
                                      "n_runs", "n_configs", "selection_epsilon"])
    out["_key"] = out["val_perplexity"].fillna(np.inf)
    out = out.sort_values(["epsilon", "_key", "optimizer"], kind="stable").drop(columns="_key")
    out.insert(1, "rank", out.groupby("epsilon").cumcount() + 1)
    out.insert(list(out.columns).index("n_seeds"), "tied", False)
    for _, g in out.groupby("epsilon", sort=False):
        out.loc[g.index, "tied"] = tied_with_above(g)
    return out.reset_index(drop=True)


def _eps_positions(epsilons: Iterable[float]) -> dict[float, float]:
    """x positions: finite ε on a log scale, ε = ∞ (non-private) one decade right of the largest."""
    finite = sorted(e for e in set(epsilons) if np.isfinite(e))
    pos = {e: float(np.log10(e)) for e in finite}
    if any(not np.isfinite(e) for e in epsilons):
        pos[np.inf] = (max(pos.values()) if pos else 0.0) + 1.0
    return pos


def _eps_axis(ax, pos: dict[float, float]) -> None:
    ax.set_xticks(list(pos.values()), ["∞\n(non-private)" if not np.isfinite(e) else fmt_tick(e) for e in pos])
    ax.set_xlabel("ε")
    if np.inf in pos:
        ax.axvline(pos[np.inf] - 0.5, color="0.6", lw=0.8, ls=":")


def draw_lm_loss(data: pd.DataFrame, optimizers: list[str] | None = None,
                 labels: dict[str, str] | None = None) -> Figure:
    """Two panels (training, validation loss): mean and 95 % t interval over seeds against ε
    (log x), one line per private optimizer; non-private runs as dashed lines with their
    interval as a band (a private optimizer's σ = 0 runs too, named "(non-private)"). One seed:
    the points alone, and the axis says so. Seeds that diverged are left out of the mean and
    listed in the panel ("diverged: ...")."""
    if data.empty:
        return empty_figure("no language-model runs")
    names = ordered(data["optimizer"], optimizers)
    colours = palette(names)
    pos = _eps_positions(data.loc[data["private"], "epsilon"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, split, title in zip(axes, ("train", "val"), ("training loss (last epoch)", "validation loss (best)")):
        d = data[data["split"] == split]
        for opt in names:
            o = d[d["optimizer"] == opt].sort_values("epsilon")
            private, reference = o[o["private"]], o[~o["private"]]
            if len(private):
                err = [(private["mean"] - private["ci_low"]).fillna(0), (private["ci_high"] - private["mean"]).fillna(0)]
                ax.errorbar([pos[e] for e in private["epsilon"]], private["mean"].where(np.isfinite(private["mean"])),
                            yerr=err, marker="o", ms=4, capsize=3, color=colours[opt], label=label(opt, labels))
            if len(reference) and np.isfinite(reference["mean"].iloc[0]):
                m = reference["mean"].iloc[0]
                ax.axhline(m, ls="--", lw=1, color=colours[opt],
                           label=label(opt, labels) + (" (non-private)" if len(private) else ""))
                if np.isfinite(reference["ci_low"].iloc[0]):
                    ax.axhspan(reference["ci_low"].iloc[0], reference["ci_high"].iloc[0], color=colours[opt],
                               alpha=0.12, lw=0)
        gone = d[d["n_diverged"] > 0] if "n_diverged" in d else d.iloc[:0]
        if not gone.empty:
            ax.text(0.02, 0.98, "diverged:\n" + "\n".join(
                label(r.optimizer, labels) + (f" ε = {fmt_tick(r.epsilon)}" if np.isfinite(r.epsilon) else "") +
                f": {r.n_diverged} of {r.n_seeds + r.n_diverged} seeds" for r in gone.itertuples()),
                transform=ax.transAxes, va="top", fontsize=6, color="0.25")
        if pos:
            ax.set_xticks(list(pos.values()), [fmt_tick(e) for e in pos])
        ax.set_xlabel("ε")
        ax.set_title(title)
    seeds = int(data["n_seeds"].max())
    axes[0].set_ylabel("cross-entropy (nats/token)\n" + ("one seed" if seeds < 2 else f"mean, {INTERVAL}"),
                       fontsize=8)
    axes[1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def draw_lm_exposure(data: pd.DataFrame, optimizers: list[str] | None = None,
                     labels: dict[str, str] | None = None) -> Figure:
    """One panel per k (canary repetitions; k = 0: unseen canaries, the reference): exposure
    mean ± std over seeds and canaries against ε (log x), non-private runs at the
    right edge (ε = ∞). Panel titles give the share of canaries extracted, worst optimizer."""
    if data.empty:
        return empty_figure("no memorisation results")
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
            for i, private in enumerate(p for p in (True, False) if (o["private"] == p).any()):
                part = o[o["private"] == private]
                x = [pos[e] + offsets[opt] for e in part["epsilon"]]
                ax.errorbar(x, part["mean"], yerr=part["std"].fillna(0), marker="o" if private else "D", ms=4,
                            capsize=3, color=colours[opt], ls="-" if private else "none",
                            label=None if i else label(opt, labels))
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


def _interval(r) -> str:
    """'± half-width' of the 95 % t interval (symmetric), or '' for one seed."""
    if r["n_seeds"] < 2 or not np.isfinite(r["ci_high"]):
        return ""
    return f" (± {r['ci_high'] - r['val_perplexity']:.2f})"


def draw_lm_ranking(data: pd.DataFrame, k: int = 25, labels: dict[str, str] | None = None) -> str:
    """The ranking as Markdown: one table per ε (non-private last); a rank whose interval
    overlaps the one above it is marked tied (=)."""
    if data.empty:
        return "# Language model: ranking\n\nNo language-model runs.\n"
    seeds = int(data["n_seeds"].max())
    lines = ["# Language model: optimizers ranked by validation perplexity", "",
             "Per ε (the target met; the achieved ε of runs given σ alone), the configuration of each optimizer "
             "with the lowest mean validation loss, chosen on the validation split (never on test or canaries); "
             "perplexity exp(best validation loss), mean ± std over "
             + ("one seed (no interval)" if seeds < 2 else
                f"seeds, in brackets ± the half-width of the {INTERVAL}; a rank marked = is tied with the one above "
                "(their intervals overlap)")
             + f"; exposure of the canaries inserted k = {k} times (bits), mean ± std over seeds and canaries. "
             "k runs: the candidate runs of the optimizer at that ε that the choice looked at (its configurations "
             "× seeds in this table; rates chosen on pilot runs before it are not counted); ε_sel: those runs "
             "composed on the same data (PLD, at the runs' δ), the privacy the row's number spent.", ""]
    for eps, g in data.groupby("epsilon", sort=True):
        lines += [f"## ε = {fmt_tick(eps)}" if np.isfinite(eps) else "## non-private (ε = ∞)", "",
                  f"| rank | optimizer | validation perplexity | exposure (k = {k}) | extracted (k = {k}) | lr | seeds "
                  "| k runs | ε_sel |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for _, r in g.iterrows():
            extracted = "–" if not np.isfinite(r["extracted"]) else f"{r['extracted']:.0%}"
            rank = f"= {r['rank']}" if r["tied"] else f"{r['rank']}"
            sel = "–" if not np.isfinite(r["selection_epsilon"]) else f"{r['selection_epsilon']:.3g}"
            lines.append(f"| {rank} | {label(r['optimizer'], labels)} | "
                         f"{_pm(r['val_perplexity'], r['val_perplexity_std'], '.2f')}{_interval(r)} | "
                         f"{_pm(r['exposure'], r['exposure_std'], '.2f')} | {extracted} | {fmt_tick(r['lr'])} | "
                         f"{r['n_seeds']} | {r['n_runs']} | {sel} |")
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

