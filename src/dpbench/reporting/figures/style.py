"""How every figure names and colours things: the optimizers' names (the thesis's), the marks on
names whose privacy claim does not hold, the order of optimizers in legends, one colour per
optimizer, the plot style.

Privacy marks. An optimizer with a private run whose recorded (epsilon, delta) does not hold
(the runs table's ``dp_guarantee`` is False: DP-Dice's published calibration, D2P2's paper
mode) is named "<name> (not a valid DP guarantee)" in every legend and panel title
(``legend_labels``), so such a number is never read as a DP result; one whose claim an
empirical audit refuted (``audit_violation``) is named "<name> (audit: claim refuted)".
"""

from __future__ import annotations

from typing import Iterable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

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
DATASETS = {"cifar10": "CIFAR-10", "fashion-mnist": "Fashion-MNIST"}
AXIS_LABELS = {"lr": "learning rate η", "batch_size": "batch size L", "epochs": "epochs E",
               "target_epsilon": "target ε"}
# Which runs of config/thesis.yaml's table (all three setups) each figure is about: the setups

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


# seaborn (and through it scipy.stats) is imported where a figure is drawn, not with the module:
# the workflow imports the figures for their fingerprints every time it starts.


def apply_style() -> None:
    """The plot style of every figure (``build`` sets it before drawing)."""
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


def empty_figure(message: str) -> Figure:
    """A figure saying why there is nothing to draw."""
    fig = plt.figure(figsize=(5, 2))
    fig.text(0.5, 0.5, message, ha="center", va="center")
    return fig


def fmt_tick(v) -> str:
    """A number as a tick label (1e-05, 0.5, 256); anything else as it is."""
    return f"{v:g}" if isinstance(v, (int, float, np.integer, np.floating)) else str(v)

