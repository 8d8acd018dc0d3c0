"""Operators dispatched per step, every registered optimizer against the non-private step.

On a GPU a DP step of a small model is bound by launching kernels from Python, not by
arithmetic; on the CPU the same overhead shows as the number of operators dispatched, which
this script counts without a GPU: torch.profiler over ``--steps`` steps (after ``--warmup``
untimed ones), counting the top-level ``aten::`` calls, i.e. every ``aten::`` event without
an ``aten::`` ancestor (a ``linear`` that calls ``addmm`` counts once; the kernels autograd's
backward runs count, each under its autograd node), divided by the number of steps.

Every optimizer is built as the harness builds it (its mechanism's plan and noise source, sigma
= 1, C = 1, default hyperparameters) on the problem's real training data and the same Poisson
batches (seed 0), with one exception: the dense matrix mechanisms read rows from an in-memory
pool (benchmarks/bench_gpu.py ``PooledNoise``) instead of a T x d noise file. ``--detail NAME``
adds the per-operator counts of NAME beside the non-private step's.

Usage:  python benchmarks/count_ops.py --problem P2 [--batch-size 256] [--steps 5] [--optimizers a,b]
        python benchmarks/count_ops.py --problem P4 [--batch-size 64] [--detail dpsgd]
Prints a Markdown table for docs/speed.md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from dpbench.mechanisms.base import PlanRequest
from dpbench.mechanisms.noise import CorrelatedNoise
from dpbench.mechanisms.sampling import PoissonSampler
from dpbench.optimizers import OPTIMIZERS, get_optimizer
from dpbench.optimizers.base import Context
from dpbench.privacy.clipping import Clipping, NoClipping
from dpbench.problems import get_problem


def _sibling(name: str):
    """benchmarks/<name>.py, imported by its file (benchmarks/ is not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


BASELINE = "sgd"  # the non-private step
DEFAULTS = {"P2": 256, "P4": 64}


def build_step(problem_id: str, name: str, L: int, n: int, cache_dir: str):
    """Optimizer ``name``'s step on a fresh model (seed 0), as the harness builds it."""
    problem, spec = get_problem(problem_id), get_optimizer(name)
    bench = _sibling("bench_step")
    model = bench.build_model(problem_id, "cpu")
    d = sum(p.numel() for p in model.parameters())
    request = PlanRequest(n, L, 1, hyperparameters=spec.hyperparameters(None), target_epsilon=8.0, delta=1e-5,
                          cache_dir=cache_dir)  # epsilon: amplified BandMF chooses its bands for it
    plan = None if _dense(spec) else spec.mechanism.plan(request)
    noise = bench._gpu.PooledNoise(d, "cpu") if plan is None else spec.mechanism.noise(plan, 1, "cpu")
    gen = torch.Generator().manual_seed(1)
    ctx = Context(model=model, loss_fn=lambda m, x, y: problem.per_sample_loss(m, x, y, gen), lr=1e-5,
                  expected_batch_size=L, noise_multiplier=1.0 if spec.private else 0.0,
                  clipping=Clipping(1.0) if spec.private else NoClipping(), noise=noise,
                  steps=plan.steps if plan is not None else 1000, hyperparameters=spec.hyperparameters(None))
    return spec.build(ctx)


def _dense(spec) -> bool:
    """Whether the mechanism's noise source reads a T x d noise file (replaced by an in-memory pool)."""
    return getattr(spec.mechanism.noise, "__annotations__", {}).get("return") in (CorrelatedNoise, "CorrelatedNoise")


def count(step, batches, warmup: int) -> tuple[float, collections.Counter]:
    """Top-level aten:: calls per step over ``batches[warmup:]``, and per operator."""
    for x, y in batches[:warmup]:
        step(x, y)
    timed = batches[warmup:]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for x, y in timed:
            step(x, y)
    ops: collections.Counter = collections.Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            ops[event.name] += 1
    return sum(ops.values()) / len(timed), ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", choices=sorted(DEFAULTS), default="P2")
    parser.add_argument("--batch-size", type=int, help="expected batch size L (default: P2 256, P4 64)")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizers", help="comma-separated (default: every registered one)")
    parser.add_argument("--detail", help="an optimizer whose per-operator counts to list beside the baseline's")
    parser.add_argument("--data-dir")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    started = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
    bench = _sibling("bench_step")

    pid, L = args.problem, args.batch_size or DEFAULTS[args.problem]
    x, y = bench.data(pid, args.data_dir)
    n = len(y)
    sampler = PoissonSampler(n, L / n, seed=0)
    batches = [(x[i], y[i]) for i in (sampler.sample() for _ in range(args.warmup + args.steps))]
    names = args.optimizers.split(",") if args.optimizers else list(OPTIMIZERS)
    names = [BASELINE] + [name for name in names if name != BASELINE]
    counts, detail = {}, {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in names:
            counts[name], detail[name] = count(build_step(pid, name, L, n, cache_dir), batches, args.warmup)
            print(f"{name}: {counts[name]:.1f} aten ops / step", file=sys.stderr, flush=True)

    base = counts[BASELINE]
    lines = [f"{pid}, L = {L}: top-level aten:: calls per step, mean over {args.steps} profiled steps "
             f"(after {args.warmup} unprofiled), {args.threads} CPU threads",
             f"machine: {bench.machine()}",
             f"date: {started} (UTC); torch {torch.__version__}",
             f"command: python benchmarks/count_ops.py {' '.join(sys.argv[1:])}", "",
             "| optimizer | aten ops / step | x non-private |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {c:.1f} | {c / base:.2f} |" for name, c in counts.items()]
    if args.detail:
        lines += ["", f"| operator | {BASELINE} / step | {args.detail} / step |", "| --- | ---: | ---: |"]
        ops = detail[args.detail] + detail[BASELINE]
        for op, _ in sorted(ops.items(), key=lambda kv: -kv[1]):
            base_n, n = detail[BASELINE][op] / args.steps, detail[args.detail][op] / args.steps
            lines.append(f"| {op} | {base_n:.1f} | {n:.1f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
