"""Figures from the aggregated runs table (thesis chapter 5)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402


def best_per_setting(runs: pd.DataFrame) -> pd.DataFrame:
    """Best test metric over all other settings, per (problem, optimizer, target epsilon):
    the highest best-epoch accuracy for classifiers, the lowest log10 test loss for the VAE."""
    rows = []
    for (problem, task, optimizer), g in runs.groupby(["problem", "task", "optimizer"], sort=True):
        eps = g["target_epsilon"].fillna(np.inf)
        for e, ge in g.groupby(eps):
            if task == "classification":
                value, metric = ge["best_test_accuracy"].max(), "best test accuracy"
            else:
                loss = ge["best_test_loss"].replace([np.inf, -np.inf], np.nan).min()
                value, metric = np.log10(loss), "best log10 test loss"
            rows.append({"problem": problem, "optimizer": optimizer, "epsilon": e, "value": value,
                         "metric": metric, "private": bool(ge["private"].iloc[0])})
    return pd.DataFrame(rows)


def best_accuracy(runs_path: str | Path, out: str | Path) -> Path:
    """Thesis Fig. 5.1: for each optimizer and epsilon, the best test accuracy over all
    tested settings (one panel per problem); non-private references as dashed lines."""
    runs = pd.read_parquet(runs_path)
    best = best_per_setting(runs)
    problems = sorted(best["problem"].unique())
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, len(problems), figsize=(4.5 * len(problems), 3.6), squeeze=False)
    private = best[best.private]
    palette = dict(zip(sorted(best.optimizer.unique()), sns.color_palette("colorblind")))
    for ax, problem in zip(axes[0], problems):
        sub = private[private.problem == problem].copy()
        sub["ε"] = sub["epsilon"].map(lambda e: f"{e:g}")
        if len(sub):
            sns.barplot(data=sub, x="ε", y="value", hue="optimizer", palette=palette, ax=ax)
            for container in ax.containers:
                ax.bar_label(container, fmt="%.3f", fontsize=7, padding=1)
        for _, ref in best[(best.problem == problem) & ~best.private].iterrows():
            ax.axhline(ref.value, ls="--", lw=1, color=palette[ref.optimizer],
                       label=f"{ref.optimizer} (non-private)")
        metric = best[best.problem == problem]["metric"].iloc[0]
        ax.set(title=problem, ylabel=metric, xlabel="target ε")
        if metric.endswith("accuracy"):
            ax.set_ylim(0, 1)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out
