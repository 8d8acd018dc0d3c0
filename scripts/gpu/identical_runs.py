"""Runs one training cell with ``dpbench train`` alone, then K copies of it at once on the same
device, and checks that every copy wrote exactly the metrics of the run alone (concurrency on
one GPU must not change results). Also reports one job's start-up seconds (wall time of the
process minus its training and evaluation time), for the cost model.

Usage: python scripts/gpu/identical_runs.py --out DIR --data-dir D [--device cuda] [--k 4] [--max-steps 150]
                                           [--test-subset N]
Writes DIR/identical.json and DIR/identical.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dpbench.reporting.results import read_run

REPO = Path(__file__).resolve().parents[2]


def command(args, out: Path) -> list[str]:
    return [sys.executable, "-m", "dpbench", "train", "--problem", args.problem, "--optimizer", "dpsgd",
            "--lr", "0.5", "--batch-size", str(args.batch_size), "--epochs", "1", "--seed", "0",
            "--epsilon", "1", "--max-steps", str(args.max_steps), "--device", args.device,
            "--threads", "2", "--data-dir", args.data_dir, "--progress-every", "1e9", "--out", str(out)] + \
        (["--test-subset", str(args.test_subset)] if args.test_subset else [])


def launch(args, outs: list[Path]) -> tuple[float, list[subprocess.Popen]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    t = time.perf_counter()
    procs = [subprocess.Popen(command(args, out), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for out in outs]
    return t, procs


def wait(t: float, procs) -> float:
    for p in procs:
        log = p.communicate()[0]
        if p.returncode != 0:
            raise SystemExit(f"dpbench train failed ({p.returncode}):\n{log[-3000:]}")
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--problem", default="P2")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--test-subset", type=int, help="evaluate on this many test examples (default: all)")
    args = parser.parse_args()
    out = Path(args.out)
    runs = out / "identical-runs"
    runs.mkdir(parents=True, exist_ok=True)

    alone_file = runs / "alone.parquet"
    alone_wall = wait(*launch(args, [alone_file]))
    reference, meta = read_run(alone_file)
    timing = meta["timing"]
    startup = alone_wall - timing["train_time_s"] - timing["eval_time_s"]

    files = [runs / f"concurrent-{i}.parquet" for i in range(args.k)]
    together_wall = wait(*launch(args, files))
    identical, differences = [], []
    for f in files:
        metrics, m = read_run(f)
        same = metrics.equals(reference)
        identical.append(same)
        if not same:
            diff = (metrics.loss - reference.loss).abs().max()
            differences.append(f"{f.name}: max |loss difference| {diff:.3g}")
    result = {"problem": args.problem, "batch_size": args.batch_size, "steps": meta["privacy"]["steps"],
              "device": meta["environment"].get("gpu", meta["environment"]["device"]),
              "cuda_settings": meta["environment"].get("cuda"), "k": args.k,
              "alone_wall_s": alone_wall, "alone_steps_per_s": timing["steps_per_second"],
              "startup_s": startup, "concurrent_wall_s": together_wall,
              "concurrent_steps_per_s": [read_run(f)[1]["timing"]["steps_per_second"] for f in files],
              "identical": identical, "all_identical": all(identical), "differences": differences}
    (out / "identical.json").write_text(json.dumps(result, indent=1) + "\n")
    text = (f"### `dpbench train` alone and {args.k} at once on {result['device']}\n\n"
            f"{args.problem}, dpsgd, L = {args.batch_size}, {result['steps']} steps, epsilon 1: alone "
            f"{alone_wall:.1f} s wall ({timing['steps_per_second']:.1f} steps/s; start-up {startup:.1f} s: "
            f"interpreter, CUDA, data, sigma calibration); {args.k} at once {together_wall:.1f} s wall "
            f"({', '.join(f'{s:.1f}' for s in result['concurrent_steps_per_s'])} steps/s each). Metrics identical "
            f"to the run alone: {sum(identical)} of {args.k}" + (f" ({'; '.join(differences)})" if differences else "")
            + ".\n")
    (out / "identical.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
