"""Summarise P4 run files: privacy promised and delivered, held-out and validation perplexity,
and the exposure of the planted canaries per repetition count k, as a Markdown table.

Usage:  python benchmarks/lm_summary.py RUN.parquet [RUN.parquet ...]
        python benchmarks/lm_summary.py --over-seeds RUN.parquet [RUN.parquet ...]

One row per run, or with ``--over-seeds`` one row per configuration (optimizer, lr, L, epochs,
target ε) over its seeds: perplexity as mean ± std over the seeds (a diverged seed shows as
inf), exposure per k as the mean over every canary of every seed, the extracted ones counted.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict

import numpy as np

from dpbench.problems.catalog import CANARY_REPEATS as REPEATS
from dpbench.reporting.results import read_meta


def _exposure(canaries: list[dict], k: int, detail: bool) -> str:
    values = [c["exposure"] for c in canaries if c["repeats"] == k]
    if not values:
        return "— (not measured: diverged)"
    extracted = sum(c["extracted"] for c in canaries if c["repeats"] == k)
    inner = ", ".join(f"{v:.1f}" for v in values) + "; " if detail else ""
    return f"{np.mean(values):.1f} ({inner}{extracted} of {len(values)} extracted)"


def _epsilon(cfg: dict, achieved: list[float]) -> str:
    if cfg["epsilon"] is None:
        return "—"
    low, high = min(achieved), max(achieved)
    return f"{cfg['epsilon']:g} / " + (f"{low:.3f}" if high - low < 5e-4 else f"{low:.3f}–{high:.3f}")


def _perplexity(losses: list[float]) -> str:
    values = [math.exp(v) if math.isfinite(v) else math.inf for v in losses]
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}" if all(map(math.isfinite, values)) else \
        " / ".join(f"{v:.2f}" for v in values)


def summarise(metas: list[dict], detail: bool) -> str:
    """One table row for the runs of one configuration (one run unless over seeds)."""
    cfg = metas[0]["config"]
    canaries = [c for m in metas for c in m["memorisation"]["canaries"]]
    sigma = {round(m["privacy"]["noise_multiplier"], 4) for m in metas}
    cells = [cfg["optimizer"], f"{cfg['lr']:g}", str(cfg["batch_size"]), str(cfg["epochs"])]
    cells += [str(len(metas))] if not detail else []
    cells += [_epsilon(cfg, [m["privacy"]["epsilon"] for m in metas]), " / ".join(f"{s:.4g}" for s in sorted(sigma)),
              _perplexity([m["result"]["best_val_loss"] for m in metas]),
              _perplexity([m["result"]["final_test_loss"] for m in metas])]
    cells += [_exposure(canaries, k, detail) for k in REPEATS]
    cells.append(f"{np.mean([m['timing']['wall_time_s'] for m in metas]) / 60:.1f}")
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> None:
    over_seeds = "--over-seeds" in argv
    paths = [a for a in argv if a != "--over-seeds"]
    if not paths:
        sys.exit(__doc__.split("\n\n")[1])  # the usage lines
    metas = [read_meta(p) for p in paths]
    for path, meta in zip(paths, metas):
        if "memorisation" not in meta:
            sys.exit(f"lm_summary: {path} is a {meta['config']['problem']} run, not a language-model run with canaries")
    space = next((m["memorisation"]["space_size"] for m in metas if m["memorisation"]["space_size"]), None)
    if space is None:
        sys.exit("lm_summary: no run measured its canaries (every run diverged)")
    head = ["optimizer", "lr", "L", "epochs"] + (["seeds"] if over_seeds else [])
    head += ["target / achieved ε", "σ", "validation perplexity", "held-out perplexity"]
    head += [f"exposure k = {k} (bits, of {math.log2(space):.1f})" for k in REPEATS] + ["wall (min)"]
    right = {"lr", "L", "epochs", "seeds", "target / achieved ε", "σ", "validation perplexity",
             "held-out perplexity", "wall (min)"}
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---:" if h in right else "---" for h in head) + " |")
    if not over_seeds:
        for meta in metas:
            print(summarise([meta], detail=True))
        return
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for meta in metas:
        c = meta["config"]
        groups[(c["optimizer"], c["epsilon"] or math.inf, c["lr"], c["batch_size"], c["epochs"])].append(meta)
    for key in sorted(groups, key=lambda k: (k[1], k[0], k[2], k[3], k[4])):
        print(summarise(groups[key], detail=False))


if __name__ == "__main__":
    main(sys.argv[1:])
