"""Time per step and peak memory of every registered optimizer on P2, relative to DP-SGD.

Each optimizer runs in a fresh subprocess (so peak RSS is its own): real Fashion-MNIST, the
2c2d CNN, Poisson batches at expected size L (the same batches for every optimizer), sigma = 1,
default hyperparameters, a few warm-up steps, then ``--steps`` timed steps. ``--repeat R`` runs
the whole list R times, round robin, so that a busy shared machine slows every optimizer alike;
the table gives the median over the rounds and the range of each optimizer's ratio to dpsgd
within a round. ``--interleave`` instead builds every optimizer in one process and times their
steps alternately on each batch (the order rotating from batch to batch), so that both sides of
each ratio see the same load: the median of these paired ratios is the robust number on a busy
shared machine (no memory columns in this mode).

The projected optimizers (d2p2sgd, dp2sgd) use ``--projection`` (default srht, the default
hyperparameter). With ``--projection gaussian`` they draw a d x p Gaussian matrix every step
(d = 225,034, p = 157,524: 3.5e10 draws), minutes per step on a CPU, so they are timed over
``--projection-steps`` steps without warm-up (their cost per step is the same every step).

Usage:  python benchmarks/bench_optimizers.py [--batch-size 256] [--threads 2] [--steps 50] [--repeat 1 | --interleave]
                                              [--projection srht|gaussian] [--projection-steps 2]
                                              [--optimizers a,b,...]
Prints a Markdown table: the median ms per step (robust to a busy shared machine; the mean too)
and peak memory while stepping (Linux /proc: the peak is
reset after the data are loaded), each also as a multiple of dpsgd's.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROJECTED = ("d2p2sgd", "dp2sgd")


def status_mib(key: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, from /proc (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the peak excludes data loading."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build(name: str, batch_size: int, threads: int, data_dir: str | None, projection: str):
    """Optimizer ``name``'s step on P2 (model initialised from seed 0), and the training data."""
    import torch

    from dpbench.data import image_datasets
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.privacy.clipping import Clipping, NoClipping
    from dpbench.optimizers import get_optimizer
    from dpbench.optimizers.base import Context
    from dpbench.problems import get_problem

    torch.set_num_threads(threads)
    problem, spec = get_problem("P2"), get_optimizer(name)
    hp = {"projection": projection} if name in PROJECTED else None
    ds = image_datasets.load(problem.dataset, data_dir)
    x, y = problem.preprocess(ds.x_train), torch.from_numpy(ds.y_train)
    n = len(y)
    torch.manual_seed(0)
    model = problem.build()
    plan = spec.mechanism.plan(PlanRequest(n, batch_size, 1, hyperparameters=hp, delta=1e-5))
    ctx = Context(model=model, loss_fn=lambda m, xb, yb: problem.per_sample_loss(m, xb, yb), lr=0.01,
                  expected_batch_size=batch_size, noise_multiplier=1.0 if spec.private else 0.0,
                  clipping=Clipping(1.0) if spec.private else NoClipping(),
                  noise=spec.mechanism.noise(plan, 1, "cpu"), steps=plan.steps,
                  hyperparameters=spec.hyperparameters(hp))
    return spec.build(ctx), x, y


def worker(name: str, batch_size: int, steps: int, warmup: int, threads: int, data_dir: str | None,
           projection: str) -> dict:
    from dpbench.mechanisms.sampling import PoissonSampler

    step, x, y = build(name, batch_size, threads, data_dir, projection)
    n = len(y)
    sampler = PoissonSampler(n, batch_size / n, seed=0)  # the same batches for every optimizer
    batches = [sampler.sample() for _ in range(warmup + steps)]
    gc.collect()
    reset_peak()
    base = status_mib("VmRSS")
    for idx in batches[:warmup]:
        step(x[idx], y[idx])
    times = []
    for idx in batches[warmup:]:
        t = time.perf_counter()
        step(x[idx], y[idx])
        times.append(time.perf_counter() - t)
    return {"name": name, "ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.fmean(times),
            "steps": steps, "peak_mib": status_mib("VmHWM"), "base_mib": base}


def interleaved(names: list[str], batch_size: int, steps: int, warmup: int, threads: int,
                data_dir: str | None, projection: str) -> list[dict]:
    """Every optimizer in this process, their steps alternating on each batch."""
    from dpbench.mechanisms.sampling import PoissonSampler

    built = {name: build(name, batch_size, threads, data_dir, projection) for name in names}
    x, y = built[names[0]][1], built[names[0]][2]
    sampler = PoissonSampler(len(y), batch_size / len(y), seed=0)
    times: dict[str, list[float]] = {name: [] for name in names}
    for b in range(warmup + steps):
        idx = sampler.sample()
        order = names[b % len(names):] + names[:b % len(names)]
        for name in order:
            t = time.perf_counter()
            built[name][0](x[idx], y[idx])
            if b >= warmup:
                times[name].append(time.perf_counter() - t)
    rows = []
    for name in names:
        ratios = sorted(a / r for a, r in zip(times[name], times[names[0]]))
        q = statistics.quantiles(ratios, n=4)
        rows.append({"name": name, "ms": 1e3 * statistics.median(times[name]), "ratio": statistics.median(ratios),
                     "q1": q[0], "q3": q[2], "steps": steps})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="rounds over all optimizers (round robin)")
    parser.add_argument("--interleave", action="store_true",
                        help="one process, steps alternating per batch; paired ratios to dpsgd")
    parser.add_argument("--projection", choices=("srht", "gaussian"), default="srht",
                        help="d2p2sgd and dp2sgd's projection")
    parser.add_argument("--projection-steps", type=int, default=2,
                        help="timed steps for d2p2sgd, dp2sgd with --projection gaussian")
    parser.add_argument("--optimizers", help="comma-separated (default: all registered; dpsgd always)")
    parser.add_argument("--data-dir")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        slow = args.worker in PROJECTED and args.projection == "gaussian"
        print(json.dumps(worker(args.worker, args.batch_size, args.projection_steps if slow else args.steps,
                                0 if slow else args.warmup, args.threads, args.data_dir, args.projection)))
        return

    from dpbench.optimizers import OPTIMIZERS

    names = args.optimizers.split(",") if args.optimizers else list(OPTIMIZERS)
    names = ["dpsgd"] + [n for n in names if n != "dpsgd"]
    if args.interleave:
        import torch

        rows = interleaved(names, args.batch_size, args.steps, args.warmup, args.threads, args.data_dir,
                           args.projection)
        print(f"P2 (d = 225,034), L = {args.batch_size}, {args.threads} CPU threads, torch {torch.__version__}, "
              f"{platform.processor() or platform.machine()}; all optimizers in one process, steps alternating "
              f"on each of {args.steps} batches (after {args.warmup} warm-up), sigma = 1, default hyperparameters, "
              f"projection {args.projection}\n")
        print("| optimizer | ms / step (median) | x dpsgd (median of paired ratios) | paired ratio, 25-75% |")
        print("| --- | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['name']} | {r['ms']:.1f} | {r['ratio']:.2f} | {r['q1']:.2f}-{r['q3']:.2f} |")
        return
    rounds: list[dict[str, dict]] = []
    for r in range(args.repeat):
        rounds.append({})
        for name in names:
            cmd = [sys.executable, __file__, "--worker", name] + [
                a for k in ("batch_size", "threads", "steps", "warmup", "projection", "projection_steps")
                for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
            if args.data_dir:
                cmd += ["--data-dir", args.data_dir]
            t = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            if proc.returncode != 0:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            rounds[-1][name] = row = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"round {r + 1}, {name}: {row['ms']:.1f} ms/step ({time.perf_counter() - t:.0f}s)",
                  file=sys.stderr, flush=True)

    import torch

    def median_row(name: str) -> dict:
        runs = [rnd[name] for rnd in rounds]
        ratios = [rnd[name]["ms"] / rnd["dpsgd"]["ms"] for rnd in rounds]
        return {"name": name, "steps": runs[0]["steps"], "ratio_lo": min(ratios), "ratio_hi": max(ratios),
                **{k: statistics.median(run[k] for run in runs) for k in ("ms", "mean_ms", "peak_mib", "base_mib")}}

    rows = [median_row(name) for name in names]
    ref = rows[0]
    print(f"P2 (d = 225,034), L = {args.batch_size}, {args.threads} CPU threads, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}; each optimizer in a fresh process, sigma = 1, "
          f"default hyperparameters, projection {args.projection}; median of {args.repeat} round(s)\n")
    print("Peak memory: the process's peak RSS while stepping (data loaded, 190 MiB of it the training "
          "set); step memory: that peak minus the RSS before the first step.\n")
    print("| optimizer | ms / step (median) | x dpsgd | x dpsgd, range over rounds | mean ms | steps timed "
          "| peak RSS (MiB) | step memory (MiB) | x dpsgd |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        grow, ref_grow = r["peak_mib"] - r["base_mib"], ref["peak_mib"] - ref["base_mib"]
        print(f"| {r['name']} | {r['ms']:.1f} | {r['ms'] / ref['ms']:.2f} | {r['ratio_lo']:.2f}-{r['ratio_hi']:.2f} | "
              f"{r['mean_ms']:.1f} | {r['steps']} | {r['peak_mib']:.0f} | {grow:.0f} | {grow / ref_grow:.2f} |")


if __name__ == "__main__":
    main()
