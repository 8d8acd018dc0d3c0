"""Wall time of one empirical audit (dpbench audit) per optimizer and number of trials R,
everything included (sigma calibration, factorization from the cache, trials, the
post-processing and participation checks, the bounds), on this machine's CPU.

    .venv/bin/python benchmarks/bench_audit.py --trials 2000,10000 --threads 2

Prints a Markdown table (seconds; epsilon_lower and the verdict as a sanity check). The first
audit of a matrix mechanism also factorizes its audit problem (cached in --cache-dir after).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from dpbench.audit.run import audit
from dpbench.optimizers import OPTIMIZERS, get_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", default=",".join(sorted(n for n, s in OPTIMIZERS.items() if s.private)))
    parser.add_argument("--trials", default="2000,10000")
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "dpbench-audit-bench"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trials = [int(r) for r in args.trials.split(",")]
    print(f"| optimizer | " + " | ".join(f"R = {r}: s" for r in trials) + " | eps_lower (largest R) | violation |")
    print("| --- | " + " | ".join("---:" for _ in trials) + " | ---: | --- |")
    for name in args.optimizers.split(","):
        spec = get_optimizer(name)
        audit(spec, args.epsilon, 4, cache_dir=args.cache_dir)  # warm: imports, factorization cache
        cells, record = [], None
        for r in trials:
            t0 = time.perf_counter()
            _, record = audit(spec, args.epsilon, r, cache_dir=args.cache_dir)
            cells.append(f"{time.perf_counter() - t0:.1f}")
        print(f"| `{name}` | " + " | ".join(cells) + f" | {record['epsilon_lower']:.3f} | {record['violation']} |",
              flush=True)


if __name__ == "__main__":
    main()
