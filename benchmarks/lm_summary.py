"""Summarise P4 run files: privacy promised and delivered, held-out and validation perplexity,
and the exposure of the planted canaries per repetition count k, as a Markdown table.

Usage:  python benchmarks/lm_summary.py RUN.parquet [RUN.parquet ...]
        python benchmarks/lm_summary.py --over-seeds RUN.parquet [RUN.parquet ...]

One row per run, with its mode (where its model started: ``full``, ``lora-r8``, ... for a run
fine-tuned from a public checkpoint, ``scratch`` for its from-scratch twin, "—" for P4), or with ``--over-seeds`` one row per configuration (every setting of the run
but its seed, and its σ) over its seeds, each seed given once: perplexity as mean ± std over
the seeds (a diverged run or seed shows as "diverged"), exposure per k as the mean over every
canary of every seed, the extracted ones counted. ε is "target / achieved", "— / achieved" for
a run given σ instead of a target, "—" for a non-private run (achieved ε = ∞). A run without a
validation split (made without --validation-size) has "—" for its validation perplexity.
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

import numpy as np

from dpbench.problems.catalog import CANARY_REPEATS as REPEATS
from dpbench.reporting.aggregate import start_columns
from dpbench.reporting.results import read_meta


def _exposure(canaries: list[dict], k: int, detail: bool) -> str:
    values = [c["exposure"] for c in canaries if c["repeats"] == k]
    if not values:
        return "— (not measured: diverged)"
    extracted = sum(c["extracted"] for c in canaries if c["repeats"] == k)
    inner = ", ".join(f"{v:.1f}" for v in values) + "; " if detail else ""
    return f"{np.mean(values):.1f} ({inner}{extracted} of {len(values)} extracted)"


def _epsilon(targets: list[float | None], achieved: list[float]) -> str:
    if not all(map(math.isfinite, achieved)):
        return "—"  # not private (sigma = 0 or a non-private optimizer)
    low, high = min(achieved), max(achieved)
    target = "—" if targets[0] is None else f"{targets[0]:g}"
    return f"{target} / " + (f"{low:.3f}" if high - low < 5e-4 else f"{low:.3f}–{high:.3f}")


def _perplexity(losses: list[float | None]) -> str:
    if all(v is None for v in losses):
        return "—"  # no validation split
    values = [math.exp(v) if math.isfinite(v) else math.inf for v in losses]
    text = [f"{v:.2f}" if math.isfinite(v) else "diverged" for v in values]
    if len(values) == 1:
        return text[0]
    return f"{np.mean(values):.2f} ± {np.std(values, ddof=1):.2f}" if all(map(math.isfinite, values)) else \
        " / ".join(text)


def mode(meta: dict) -> str:
    """Where the run's model started (the runs table's ``finetune`` and ``lora_rank``): its
    fine-tuning mode (``lora-r8`` with LoRA's rank), ``scratch`` for the from-scratch twin of a
    problem that starts from a checkpoint, "—" for a problem that always trains from scratch
    (P4) or a run file made before the start was recorded."""
    start = start_columns(meta["config"]["problem"], meta.get("start"))
    if start["finetune"] is None:
        return "—"
    return f"lora-r{start['lora_rank']}" if start["finetune"] == "lora" else str(start["finetune"])


def summarise(metas: list[dict], detail: bool) -> str:
    """One table row for the runs of one configuration (one run unless over seeds)."""
    cfg = metas[0]["config"]
    canaries = [c for m in metas for c in m["memorisation"]["canaries"]]
    sigma = {round(m["privacy"]["noise_multiplier"], 4) for m in metas}
    cells = [cfg["optimizer"], f"{cfg['lr']:g}", str(cfg["batch_size"]), str(cfg["epochs"]), mode(metas[0])]
    cells += [str(len(metas))] if not detail else []
    cells += [_epsilon([m["privacy"]["target_epsilon"] for m in metas], [m["privacy"]["epsilon"] for m in metas]),
              " / ".join(f"{s:.4g}" for s in sorted(sigma)),
              _perplexity([m["result"].get("best_val_loss") for m in metas]),
              _perplexity([m["result"]["final_test_loss"] for m in metas])]
    cells += [_exposure(canaries, k, detail) for k in REPEATS]
    cells.append(f"{np.mean([m['timing']['wall_time_s'] for m in metas]) / 60:.1f}")
    return "| " + " | ".join(cells) + " |"


# Settings that change nothing a run computes, or differ per seed: not part of a configuration.
PER_RUN = ("seed", "data_dir", "cache_dir", "device", "progress_every_s", "eval_batch_size", "factorization",
           "noise_file")


def configuration(meta: dict) -> str:
    """What runs share to be seeds of one configuration: every setting but the per-run ones,
    and the σ the run used (a run given σ and a calibrated run at the same target are not one)."""
    cfg = {k: v for k, v in meta["config"].items() if k not in PER_RUN}
    return json.dumps([cfg, round(meta["privacy"]["noise_multiplier"], 12)], sort_keys=True, default=str)


def read(path: str) -> dict:
    """A run's metadata, or one line naming the file (missing, a directory, damaged, not a run)."""
    try:
        return read_meta(path)
    except OSError as exc:
        sys.exit(f"lm_summary: {path}: {exc.strerror or exc}")
    except ValueError as exc:
        sys.exit(f"lm_summary: {exc}")


def by_configuration(paths: list[str], metas: list[dict]) -> list[list[dict]]:
    """The runs grouped by configuration (``configuration``), ordered by target ε (non-private
    last), optimizer, lr, L, epochs, achieved ε; a seed given twice in a group is refused."""
    groups: dict[str, list[dict]] = defaultdict(list)
    seen: dict[tuple, int] = {}
    for i, (path, meta) in enumerate(zip(paths, metas)):
        key, seed = configuration(meta), meta["config"]["seed"]
        first = seen.setdefault((key, seed), i)
        if first != i:  # the same file twice, or two runs of one seed: it would count twice
            sys.exit(f"lm_summary: {paths[first]} and {path} are the same configuration and seed {seed}: "
                     "give each seed once")
        groups[key].append(meta)

    def order(key: str) -> tuple:
        c, p = groups[key][0]["config"], groups[key][0]["privacy"]
        return (c["epsilon"] or math.inf, c["optimizer"], c["lr"], c["batch_size"], c["epochs"], p["epsilon"], key)

    return [groups[key] for key in sorted(groups, key=order)]


def main(argv: list[str]) -> None:
    over_seeds = "--over-seeds" in argv
    paths = [a for a in argv if a != "--over-seeds"]
    if not paths:
        sys.exit(__doc__.split("\n\n")[1])  # the usage lines
    metas = [read(p) for p in paths]
    for path, meta in zip(paths, metas):
        if "memorisation" not in meta:
            sys.exit(f"lm_summary: {path} is a {meta['config']['problem']} run, not a language-model run with canaries")
    space = next((m["memorisation"]["space_size"] for m in metas if m["memorisation"]["space_size"]), None)
    if space is None:
        sys.exit("lm_summary: no run measured its canaries (every run diverged)")
    rows = by_configuration(paths, metas) if over_seeds else [[meta] for meta in metas]
    head = ["optimizer", "lr", "L", "epochs", "mode"] + (["seeds"] if over_seeds else [])
    head += ["target / achieved ε", "σ", "validation perplexity", "held-out perplexity"]
    head += [f"exposure k = {k} (bits, of {math.log2(space):.1f})" for k in REPEATS] + ["wall (min)"]
    right = {"lr", "L", "epochs", "seeds", "target / achieved ε", "σ", "validation perplexity",
             "held-out perplexity", "wall (min)"}
    print("| " + " | ".join(head) + " |")
    print("| " + " | ".join("---:" if h in right else "---" for h in head) + " |")
    for group in rows:
        print(summarise(group, detail=not over_seeds))


if __name__ == "__main__":
    main(sys.argv[1:])
