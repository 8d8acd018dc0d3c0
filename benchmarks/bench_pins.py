"""What pinning the kernels' instruction set costs: dpbench's DP-SGD step timed in fresh
processes with and without the pins (environment variables read when each library loads, so
each variant needs its own process), alternating variant by variant, repeat by repeat, so a busy
shared machine slows both alike.

Pinned: every kernel library to AVX2 (the widest set that an AVX2-only and an AVX-512 CPU
share): torch's ATen kernels (ATEN_CPU_CAPABILITY=avx2), oneDNN (ONEDNN_MAX_CPU_ISA=AVX2),
MKL (MKL_ENABLE_INSTRUCTIONS=AVX2, MKL_CBWR=AVX2: conditional numerical reproducibility),
NumPy's dispatch (NPY_DISABLE_CPU_FEATURES) and OpenBLAS (OPENBLAS_CORETYPE=Haswell, its AVX2
kernels). Native: the variables of this shell as they are (minus those pins).

Usage:  python benchmarks/bench_pins.py [--problem P2] [--batch-size 256] [--steps 20] [--repeats 5] [--threads 2]
Prints a Markdown table for docs/results.md ("What reproduces where").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PINS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "MKL_CBWR": "AVX2", "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR", "OPENBLAS_CORETYPE": "Haswell"}


def child(problem: str, L: int, steps: int, threads: int) -> dict:
    """ms per step of the DP-SGD step and the non-private step in this process (bench_step's
    batches, models and timing), and the kernels this process chose."""
    import torch

    spec = importlib.util.spec_from_file_location("bench_step", Path(__file__).resolve().with_name("bench_step.py"))
    bench_step = importlib.util.module_from_spec(spec)  # benchmarks/ is not a package: loaded by its file
    spec.loader.exec_module(bench_step)
    from dpbench.machine import platform_record
    from dpbench.mechanisms.sampling import PoissonSampler

    torch.set_num_threads(threads)
    x, y = bench_step.data(problem, None)
    sampler = PoissonSampler(len(y), L / len(y), seed=0)
    batches = [(x[i], y[i]) for i in (sampler.sample() for _ in range(steps))]
    out = {name: 1e3 * bench_step.timed(bench_step.our_step(problem, name, L, "cpu", steps)[0], batches)
           for name in ("dpsgd", "sgd")}
    return {**out, "torch": platform_record()["torch"]["cpu_capability"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", default="P2", choices=("P2", "P4"))
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.problem, args.batch_size, args.steps, args.threads)))
        return
    native = {k: v for k, v in os.environ.items() if k not in PINS}
    variants = {"native": native, "pinned (AVX2)": {**native, **PINS}}
    times: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.repeats):
        for name, env in variants.items():
            done = subprocess.run([sys.executable, __file__, "--child", "--problem", args.problem, "--batch-size",
                                   str(args.batch_size), "--steps", str(args.steps), "--threads", str(args.threads)],
                                  env=env, capture_output=True, text=True, check=True)
            times[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"repeat {r + 1}/{args.repeats} {name}: {times[name][-1]}", file=sys.stderr, flush=True)
    print(f"{args.problem}, L = {args.batch_size}, {args.steps} steps x {args.repeats} repeats, {args.threads} threads\n")
    print("| kernels | torch capability | DP-SGD step, ms (median, range) | non-private step, ms | DP step / pinned DP step |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, rows in times.items():
        dp, sgd = [t["dpsgd"] for t in rows], [t["sgd"] for t in rows]
        ratio = statistics.median(a / b for a, b in zip(dp, (t["dpsgd"] for t in times["pinned (AVX2)"])))
        print(f"| {name} | {rows[0]['torch']} | {statistics.median(dp):.1f} ({min(dp):.1f}-{max(dp):.1f}) "
              f"| {statistics.median(sgd):.1f} ({min(sgd):.1f}-{max(sgd):.1f}) | {ratio:.2f} |")


if __name__ == "__main__":
    main()
