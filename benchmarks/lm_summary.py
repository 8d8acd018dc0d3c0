"""Summarise P4 run files: privacy promised and delivered, held-out and validation perplexity,
and the exposure of the planted canaries per repetition count k, as a Markdown table.

Usage:  python benchmarks/lm_summary.py RUN.parquet [RUN.parquet ...]
"""

from __future__ import annotations

import math
import sys

import numpy as np

from dpbench.reporting.results import read_meta

REPEATS = (0, 1, 5, 25)


def row(path: str) -> str:
    meta = read_meta(path)
    cfg, privacy, result = meta["config"], meta["privacy"], meta["result"]
    canaries = meta["memorisation"]["canaries"]
    exposure = []
    for k in REPEATS:
        values = [c["exposure"] for c in canaries if c["repeats"] == k]
        extracted = sum(c["extracted"] for c in canaries if c["repeats"] == k)
        exposure.append(f"{np.mean(values):.1f} ({', '.join(f'{v:.1f}' for v in values)}; {extracted} extracted)")
    eps = "—" if cfg["epsilon"] is None else f"{cfg['epsilon']:g} / {privacy['epsilon']:.3f}"
    return (f"| {cfg['optimizer']} | {cfg['lr']:g} | {cfg['batch_size']} | {cfg['epochs']} | {eps} "
            f"| {privacy['noise_multiplier']:.4g} | {math.exp(result['best_val_loss']):.2f} "
            f"| {math.exp(result['final_test_loss']):.2f} | " + " | ".join(exposure)
            + f" | {meta['timing']['wall_time_s'] / 60:.1f} |")


def main(paths: list[str]) -> None:
    space = read_meta(paths[0])["memorisation"]["space_size"]
    print(f"| optimizer | lr | L | epochs | target / achieved ε | σ | validation perplexity | held-out perplexity | "
          + " | ".join(f"exposure k = {k} (bits, of {math.log2(space):.1f})" for k in REPEATS) + " | wall (min) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---" for _ in REPEATS) + " | ---: |")
    for path in paths:
        print(row(path))


if __name__ == "__main__":
    main(sys.argv[1:])
