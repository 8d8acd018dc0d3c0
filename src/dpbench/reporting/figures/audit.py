"""The figure of the empirical privacy audit (``dpbench audit``), drawn from the audits table
(results/audit/audits.parquet), not the runs table: per optimizer, the claimed ε against the
lower bound the audit measured."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from dpbench.reporting.audits import over_seeds
from dpbench.reporting.figures.intervals import INTERVAL, draw_intervals
from dpbench.reporting.figures.style import empty_figure, fmt_tick, label, ordered


THROUGH_CURVE = ("✗ with its bar below the claim: refuted through the claimed privacy curve δ(ε) (the error rates "
                 "measured lie outside it), not by ε_lower, which R trials cannot raise above the dotted line "
                 "(below ln R)")


def refuted_below_claim(here: pd.DataFrame) -> np.ndarray:
    """Which violations of a panel have their certified ε_lower below the claimed ε: refuted
    through the claim's whole privacy profile, not by the certified bound."""
    return (here["violation"].to_numpy(bool)
            & (here["epsilon_lower"].to_numpy(float) < here["epsilon_claimed"].to_numpy(float)))


def draw_audit(audits: pd.DataFrame, optimizers: list[str] | None = None) -> Figure:
    """The empirical audit (dpbench audit): one panel per optimizer, claimed ε (x) against the
    certified lower bound ε_lower (filled, a bar from 0) and the GDP estimate ε_GDP (hollow;
    a heuristic under subsampling), the claim as the diagonal, and the largest ε any audit
    with that many trials could certify (dotted). A violation of the claim turns the panel red;
    one whose certified bar stays below the claim (DP-Dice at a claimed ε of 8 or 10) was refuted
    through the claim's privacy curve, which the panel and the legend say (``THROUGH_CURVE``).
    Audits of several seeds of the same (optimizer, ε) draw their mean and 95 % t interval
    (``over_seeds``); the legend says which, or "one seed"."""
    trials = audits[audits["mode"] == "trials"] if "mode" in audits else audits
    if trials.empty:
        return empty_figure("no audits")
    trials = over_seeds(trials)
    n_seeds = int(trials["n_seeds"].max())
    names = ordered(trials["optimizer"].unique(), optimizers)
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.4 * rows), squeeze=False, sharex=True)
    top = float(np.nanmax(trials[["epsilon_claimed", "epsilon_lower"]].to_numpy())) * 1.15
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    any_below = False
    for ax, name in zip(axes.flat, names):
        here = trials[trials["optimizer"] == name].sort_values("epsilon_claimed")
        eps = here["epsilon_claimed"].to_numpy(float)
        x = np.arange(len(eps))
        flagged = bool(here["violation"].any())
        ax.plot(x, eps, color="0.3", lw=1, marker="_", ms=14, label="claimed ε")
        ax.bar(x, here["epsilon_lower"], width=0.5, color="#c0392b" if flagged else "#2e86c1", alpha=0.85,
               label="ε_lower (certified)" + (", mean" if n_seeds > 1 else ""))
        if n_seeds > 1:
            draw_intervals(ax, x, here["epsilon_lower"], here["ci_low"], here["ci_high"])
        gdp = here["epsilon_gdp"].clip(upper=top)
        ax.scatter(x, gdp, facecolors="none", edgecolors="k", s=22, zorder=3, label="ε_GDP (estimate)")
        if "max_certifiable_epsilon" in here:
            ax.axhline(here["max_certifiable_epsilon"].min(), color="0.5", ls=":", lw=1, label="max certifiable")
        for xi, v in zip(x, here["violation"]):
            if v:
                ax.text(xi, 0.02 * top, "✗", ha="center", va="bottom", color="white", fontsize=9, fontweight="bold")
        below = refuted_below_claim(here)
        if below.any():
            claims = ", ".join(fmt_tick(e) for e in eps[below])
            ax.text(0.02, 0.97, f"✗ at claimed ε {claims}: refuted\nthrough the claimed curve", transform=ax.transAxes,
                    ha="left", va="top", fontsize=6, color="#c0392b", gid="through_curve")
        any_below = any_below or bool(below.any())
        ax.set_xticks(x, [fmt_tick(e) for e in eps])
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
               title=f"R = {r} trials, β = {trials['beta'].iloc[0]:g}, δ = {trials['delta'].iloc[0]:g}; "
                     + seeds_caption(trials["n_seeds"]),
               title_fontsize=7, bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    if any_below:
        fig.text(0.5, -0.09, THROUGH_CURVE, ha="center", va="top", fontsize=6.5, wrap=True, gid="caption")
    return fig


def seeds_caption(n_seeds: pd.Series) -> str:
    """"one seed", "3 seeds: mean and 95 % t interval", or, where the pairs have different
    counts, "1-3 seeds per claim: mean, and 95 % t interval where ≥ 2"."""
    low, high = int(n_seeds.min()), int(n_seeds.max())
    if high < 2:
        return "one seed"
    if low == high:
        return f"{high} seeds: mean and {INTERVAL}"
    return f"{low}-{high} seeds per claim: mean, and {INTERVAL} where ≥ 2"


def audit_figure(audits: pd.DataFrame, optimizers: list[str] | None = None) -> Figure:
    return draw_audit(audits, optimizers)

