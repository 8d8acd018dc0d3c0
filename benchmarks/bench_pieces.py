"""A large logical batch in physical pieces on P7 (all-MiniLM-L6-v2): the peak memory and the time
of one logical DP step at L = 1,024 (the field's recipe: Li et al. 2022) with the batch in one piece
and in pieces of at most P records (``Context.piece_size``, the run setting ``physical_batch_size``).

Each configuration (mode, optimizer, layout, P) runs in its own fresh process: the model built as
a run builds it (``bench_encoder_step.build_step``: sigma = 1, C = 1, the default
hyperparameters), the same L real P7 training records a logical step, one step (``--steps``: a
shared 2-core CPU makes each step at L = 1,024 take minutes; DiSK's first step is at one point). Memory: bench_finetune's ``step_memory``, the peak
resident set size (VmHWM, Linux) over the step less the resident size before it, glibc keeping
freed memory as ``dpbench train`` sets it (``machine.keep_freed_memory``). Time: the step's wall
time (a first step: allocations included).
Layouts: ``groups``, P7's groups of similar length (``Task.groups``, as a run on the CPU takes
a batch), and ``one pass``, the batch padded to its longest record in one pass (as on a GPU),
each with P = all (one piece) or a piece size.

Usage:  python benchmarks/bench_pieces.py [--batch-size 1024] [--threads 1] [--steps 1]
        [--configs last-block:dpsgd:one-pass:all,last-block:dpsgd:one-pass:64,...]
Prints Markdown for benchmarks/results/encoder/pieces.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time
import warnings

import torch

import bench_encoder_step as _es  # sibling scripts: a script's own folder is first on sys.path
import bench_finetune as _ft
from dpbench.machine import keep_freed_memory
from dpbench.problems.encoder_classification import PublicEncoder

CONFIGS = ("last-block:dpsgd:one-pass:all", "last-block:dpsgd:one-pass:64", "last-block:dpsgd:one-pass:32",
           "last-block:dpsgd:groups:all", "last-block:dpsgd:groups:64",
           "last-block:dpdisk:groups:all", "last-block:dpdisk:groups:64",
           "full:dpsgd:groups:all", "full:dpsgd:groups:64")


def child(config: str, batches_file: str) -> None:
    """In a fresh process: JSON {before_kb, peak_kb, step_s} of ``config``'s logical steps, one a
    batch (the last step's time)."""
    mode, name, layout, piece = config.split(":")
    batches = torch.load(batches_file)
    start = PublicEncoder.load(_es.ENCODER)
    step, _ = _es.build_step(start, mode, name, len(batches[0][0]), grouped=layout == "groups")
    step.ctx = dataclasses.replace(step.ctx, piece_size=None if piece == "all" else int(piece))
    times = []

    def timed(x, y):
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)

    print(json.dumps({**_ft.step_memory(timed, batches), "step_s": times[-1], "realised_batch": len(batches[0][0])}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1,
                        help="logical steps per configuration (DiSK's second step is its first at two points)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="mode:optimizer:layout:P, comma-separated")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batches", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    kept = keep_freed_memory()
    if args.child:
        child(args.child, args.batches)
        return
    load, started = os.getloadavg(), time.perf_counter()
    start = PublicEncoder.load(_es.ENCODER)
    x, y = _es.records(start, args.steps * args.batch_size)
    size = args.batch_size
    batches = [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(args.steps)]
    widths = [int((b != start.loaded.pad_id).sum(1).max()) for b, _ in batches]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "batches.pt")
        torch.save(batches, path)
        for config in args.configs.split(","):
            out = _ft.in_fresh_process(__file__, ["--child", config, "--batches", path,
                                                  "--threads", str(args.threads)])
            rows.append((config, out))
            print(config, out, file=sys.stderr, flush=True)
    end = os.getloadavg()
    lines = [f"# A logical batch of L = {args.batch_size} in physical pieces: P7 (all-MiniLM-L6-v2)", "",
             f"- command: `python benchmarks/bench_pieces.py {' '.join(sys.argv[1:])}`",
             f"- code: {_es._commit()}",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; CPU: {_ft._cpu()} "
             f"({os.cpu_count()} cores visible, shared with other work), torch {torch.__version__}, "
             f"{args.threads} thread(s)",
             f"- load average at the start: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; at the end: "
             f"{end[0]:.2f}, {end[1]:.2f}, {end[2]:.2f} (a shared machine: times are inflated and noisy)",
             f"- glibc malloc keeps freed memory (as `dpbench train`): {'yes' if kept else 'no'}",
             f"- records: {args.steps} batch(es) of {args.batch_size} real P7 training records (WordPiece rows cut "
             f"at 128; the longest record of each: {widths} tokens), the same for every configuration; each "
             f"configuration in a fresh process, {args.steps} logical step(s), one a batch",
             "- memory: peak resident set size (VmHWM) over the steps less the resident size before them "
             "(bench_finetune.step_memory); time: the last step's wall time (with one step: a first step, "
             "allocations included)",
             f"- total wall time: {time.perf_counter() - started:.0f} s", "",
             "| mode | optimizer | layout | P (records a piece) | peak memory over the step (MB) | time per logical step (s) |",
             "| --- | --- | --- | --- | ---: | ---: |"]
    for config, out in rows:
        mode, name, layout, piece = config.split(":")
        lines.append(f"| {mode} | {name} | {layout} | {piece} | {(out['peak_kb'] - out['before_kb']) / 1024:.0f} | "
                     f"{out['step_s']:.1f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
