"""Cost and error of the streamed correlated-noise mechanisms (dpmatrix-band,
dpmatrix-band-amp, dpmatrix-blt) at the thesis's Setup 2 and Setup 3 sizes.

1. Factorization: the workflow's factorize stage for each mechanism's key
   (``streamed.compute``: the optimisation, and for dpmatrix-band-amp with bands = auto the
   band search at the target epsilon) for Setup 2 (P2, N = 60,000, L in {32, 64}, E = 1) and
   Setup 3 (P1 N = 50,000 and P3 N = 60,000, L in {1024, 2048}, E = 30), and what every
   training cell then pays: loading and verifying the file (``streamed_files.load``). Goal:
   <= 10 s each on 2 cores.
2. Per-step noise cost: ``sample`` of the streamed noise source for the problem's parameter
   count d, against the i.i.d. noise of DP-SGD and against a whole dpbench DP-SGD step (random
   inputs of the problem's shape; the cost does not depend on the data) at the setup's L. Goal:
   <= 0.3x a DP-SGD step for BandMF b <= 64 and BLT.
3. Peak RSS of each measurement (each runs in a fresh process) and bytes the process wrote to
   storage while streaming (/proc/self/io write_bytes; goal 0: no noise file).
4. (--errors) The expected error of the released prefix sums of every mechanism at each
   setup's (T, b', k), each with the sigma it needs at epsilon in {1, 10}, delta = 1e-5:
   err_mean (mean over t of the squared error of the t-th prefix sum at unit noise and
   sensitivity) and RMSE = sigma sqrt(err_mean), against DP-SGD with Poisson sampling (PRV)
   and DP-SGD on fixed batches (no amplification); the dense mechanisms from the reports of
   benchmarks/bench_matrix.py (--dense-reports, its --out-dir): the table of docs/matrix.md.

``--repeat N`` runs each measurement of 1 and 2 N times (each in a fresh process) and prints
the median with the range: the machine is shared, so single timings mislead.

Usage: OPENBLAS_NUM_THREADS=1 python benchmarks/bench_streamed.py [--threads 2] [--skip-steps] [--skip-factorizations]
       OPENBLAS_NUM_THREADS=1 python benchmarks/bench_streamed.py --errors --dense-reports /tmp/dpbench-bench
Prints Markdown tables. One BLAS thread for numpy/scipy (as the factorize rules and
bench_matrix.py use: on a loaded 2-core machine two OpenBLAS threads made the small L-BFGS-B
steps several times slower); ``--threads`` sets torch's threads for the noise and DP-SGD steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

SETUP2 = [("P2", 60_000, L, 1) for L in (32, 64)]
SETUP3 = [(p, n, L, 30) for p, n in (("P1", 50_000), ("P3", 60_000)) for L in (1024, 2048)]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes:")).split()[1])


def factorization_job(args) -> dict:
    """The factorize stage of one mechanism's key (compute, in this fresh process), then the
    load a training cell does (verify the file), timed; the plan that reads it."""
    optimizer, problem, n_train, L, epochs, epsilon, threads = args
    import torch

    torch.set_num_threads(threads)
    from dpbench.matrix.store import streamed_files
    from dpbench.mechanisms import streamed
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers import get_optimizer

    mech = get_optimizer(optimizer).mechanism
    request = PlanRequest(n_train, L, epochs, target_epsilon=epsilon, delta=1e-5)
    key = mech.key(request)
    t, c = time.perf_counter(), time.process_time()
    computed = streamed.compute(key)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{key}.json"
        streamed_files.save(computed, path)
        size = path.stat().st_size
        t = time.perf_counter()
        streamed_files.load(path, key)
        load_s = time.perf_counter() - t
        plan = mech.plan(dataclasses.replace(request, factorization=path))
    fact = plan.factorization
    size_param = getattr(fact, "bands", None) or getattr(fact, "buffers", None)
    sens = plan.sensitivity if hasattr(plan, "sensitivity") else plan.max_column_norm
    return {"optimizer": optimizer, "problem": problem, "L": L, "epochs": epochs, "epsilon": epsilon, "key": key,
            "T": plan.steps, "size": size_param, "error_mean": fact.error_mean(), "sens": sens,
            "rate": plan.sample_rate, "wall_s": wall, "cpu_s": cpu, "load_ms": 1e3 * load_s, "file_bytes": size,
            "rss_mb": _peak_rss_mb()}


def _like(problem_id):
    import torch

    from dpbench.problems import get_problem

    torch.manual_seed(0)
    model = get_problem(problem_id).build()
    return model, [p.detach().clone() for p in model.parameters()]


def step_job(args) -> dict:
    """ms per noise step of one source (median over steps), its state, RSS and bytes written."""
    problem, kind, size, steps, threads = args
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    from dpbench.matrix import banded, blt
    from dpbench.mechanisms.noise import BandedNoise, BLTNoise, GaussianNoise

    _, like = _like(problem)
    d = sum(p.numel() for p in like)
    n = steps + 5
    if kind == "iid":
        source = GaussianNoise(1)
    elif kind == "band":
        fact = banded.optimize(max(n, size), size)
        source = BandedNoise(fact.coef, fact.scale(), 1)
    else:
        x = np.sort(np.random.default_rng(size).uniform(0.05, 0.99, 2 * size))[::-1]
        fact = blt.BLT.from_pair(x[0::2], x[1::2], n)
        source = BLTNoise(fact.theta, fact.omega, n, 1)
    for _ in range(3):
        source.sample(like)
    written = _write_bytes()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        source.sample(like)
        times.append(time.perf_counter() - t)
    return {"problem": problem, "kind": kind, "size": size, "d": d, "ms": 1e3 * statistics.median(times),
            "state_mb": getattr(source, "state_floats", 0) * 4 / 2 ** 20, "rss_mb": _peak_rss_mb(),
            "write_bytes": _write_bytes() - written}


def dpsgd_job(args) -> dict:
    """ms per dpbench DP-SGD step at expected batch size L (random inputs of the right shape)."""
    problem, L, steps, threads = args
    import torch

    torch.set_num_threads(threads)
    from dpbench.privacy.clipping import Clipping
    from dpbench.mechanisms.noise import GaussianNoise
    from dpbench.optimizers.base import SGD, Context, DPStep
    from dpbench.problems import get_problem

    prob = get_problem(problem)
    model, _ = _like(problem)
    shape = (3, 32, 32) if prob.dataset == "cifar10" else (1, 28, 28)
    x = torch.rand(L, *shape)
    y = torch.randint(0, 10, (L,))
    gen = torch.Generator()
    ctx = Context(model=model, loss_fn=lambda m, xb, yb: prob.per_sample_loss(m, xb, yb, gen), lr=0.1,
                  expected_batch_size=L, noise_multiplier=1.0, clipping=Clipping(1.0), noise=GaussianNoise(1),
                  steps=steps + 2)
    step = DPStep(ctx, SGD(0.1))
    step(x, y)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t)
    return {"problem": problem, "L": L, "ms": 1e3 * statistics.median(times), "rss_mb": _peak_rss_mb()}


def errors_job(args) -> list[dict]:
    """sigma, err_mean and RMSE = sigma sqrt(err_mean) of every mechanism at one setup cell."""
    problem, n_train, L, epochs, threads, dense_dir, cache_dir = args
    import math

    import torch

    torch.set_num_threads(threads)
    from dpbench.mechanisms.base import PlanRequest, Target
    from dpbench.optimizers import get_optimizer
    from dpbench.privacy import accounting

    rows = []
    batches = n_train // L
    fixed_steps, poisson_steps = epochs * batches, max(1, round(epochs * n_train / L))
    dense = ["dpmatrix-se", "dpmatrix-se-lambda"] if epochs == 1 else ["dpmatrix-me", "dpmatrix-me-lambda"]
    for eps in (1.0, 10.0):
        def row(mechanism, steps, size, sigma, err_mean):
            rows.append({"mechanism": mechanism, "eps": eps, "T": steps, "size": size, "sigma": sigma,
                         "error_mean": err_mean, "rmse": sigma * math.sqrt(err_mean)})
        sigma = accounting.noise_multiplier_for(eps, L / n_train, poisson_steps, 1e-5, "prv")
        row("DP-SGD, Poisson q = L/N, PRV", poisson_steps, "—", sigma, (poisson_steps + 1) / 2)
        sigma = accounting.gaussian_noise_multiplier(eps, 1e-5, sensitivity=math.sqrt(epochs))
        row("DP-SGD, fixed batches, no amplification", fixed_steps, "—", sigma, (fixed_steps + 1) / 2)
        for optimizer in dense:
            key = get_optimizer(optimizer).mechanism.key(PlanRequest(n_train, L, epochs))
            report = Path(dense_dir or "/nonexistent") / key / "factorization.json"
            if report.exists():
                r = json.loads(report.read_text())
                sigma = accounting.gaussian_noise_multiplier(eps, 1e-5, sensitivity=r["sensitivity"])
                row(f"`{optimizer}` (`{key}`)", r["steps"], "dense", sigma, r["prefix_sum_error"] / r["steps"])
        for optimizer in ("dpmatrix-band", "dpmatrix-band-amp", "dpmatrix-blt"):
            mech = get_optimizer(optimizer).mechanism
            plan = mech.plan(PlanRequest(n_train, L, epochs, target_epsilon=eps, delta=1e-5, cache_dir=cache_dir))
            fact = plan.factorization
            row(f"`{optimizer}`", plan.steps, getattr(fact, "bands", None) or getattr(fact, "buffers", None),
                mech.calibrate(plan, Target(eps, 1e-5)), fact.error_mean())
    return rows


def run(job, args):
    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(job, (args,))


def repeated(job, args, times: int, fields: tuple[str, ...]) -> dict:
    """``job`` ``times`` times, each in a fresh process: the last result, with each of ``fields``
    replaced by its median and a ``<field>_range`` (min, max)."""
    results = [run(job, args) for _ in range(times)]
    out = dict(results[-1])
    for f in fields:
        values = [r[f] for r in results]
        out[f], out[f + "_range"] = statistics.median(values), (min(values), max(values))
    return out


def spread(r: dict, field: str, fmt: str) -> str:
    lo, hi = r.get(field + "_range", (r[field], r[field]))
    return format(r[field], fmt) if lo == hi else f"{format(r[field], fmt)} ({format(lo, fmt)}–{format(hi, fmt)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-factorizations", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--noise-steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=1, help="run each timing this many times (fresh processes)")
    parser.add_argument("--errors", action="store_true", help="only the expected-error table")
    parser.add_argument("--dense-reports", help="bench_matrix.py's --out-dir: adds the dense mechanisms' rows")
    parser.add_argument("--cache-dir", help="--errors: where the streamed factorizations are computed (default: a "
                                            "temporary directory)")
    args = parser.parse_args()
    print(f"{args.threads} torch threads, {os.cpu_count()} CPUs, {platform.machine()}, "
          f"load average before: {os.getloadavg()[0]:.2f}\n")

    if args.errors:
        cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="dpbench-errors-")
        print("| setup | problem | L | b′, k | mechanism | T | b or m | ε | σ | err_mean | RMSE = σ√err_mean "
              "| vs DP-SGD (Poisson) | vs DP-SGD (fixed batches) |")
        print("| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for setup, cells in (("2", SETUP2), ("3", SETUP3)):
            for problem, n, L, E in cells:
                rows = run(errors_job, (problem, n, L, E, args.threads, args.dense_reports, cache_dir))
                amp = {r["eps"]: r["rmse"] for r in rows if r["mechanism"].startswith("DP-SGD, Poisson")}
                fixed = {r["eps"]: r["rmse"] for r in rows if r["mechanism"].startswith("DP-SGD, fixed")}
                for r in rows:
                    print(f"| {setup} | {problem} | {L} | {n // L}, {E} | {r['mechanism']} | {r['T']} | {r['size']} "
                          f"| {r['eps']:g} | {r['sigma']:.4g} | {r['error_mean']:.4g} | {r['rmse']:.4g} "
                          f"| {r['rmse'] / amp[r['eps']]:.3g} | {r['rmse'] / fixed[r['eps']]:.3g} |", flush=True)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")
        return

    if not args.skip_factorizations:
        print("| setup | problem | L | E | mechanism | target eps | key | T | b or m | err_mean | sens (amp: max col) "
              "| p | factorize wall (s) | factorize CPU (s) | load + verify (ms) | file (kB) | peak RSS (MB) |")
        print("| --- | --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
              "| ---: | ---: |")
        for setup, cells in (("2", SETUP2), ("3", SETUP3)):
            for problem, n, L, E in cells:
                jobs = [("dpmatrix-band", None), ("dpmatrix-blt", None), ("dpmatrix-band-amp", 1.0),
                        ("dpmatrix-band-amp", 10.0)]
                for optimizer, eps in jobs:
                    r = repeated(factorization_job, (optimizer, problem, n, L, E, eps, args.threads), args.repeat,
                                 ("wall_s", "cpu_s", "load_ms", "rss_mb"))
                    rate = "—" if r["rate"] is None else f"{r['rate']:.4g}"
                    print(f"| {setup} | {problem} | {L} | {E} | `{optimizer}` | {eps or '—'} | `{r['key']}` "
                          f"| {r['T']} | {r['size']} | {r['error_mean']:.4g} | {r['sens']:.4g} | {rate} "
                          f"| {spread(r, 'wall_s', '.2f')} | {spread(r, 'cpu_s', '.2f')} "
                          f"| {spread(r, 'load_ms', '.1f')} | {r['file_bytes'] / 1e3:.1f} | {r['rss_mb']:.0f} |",
                          flush=True)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}\n")

    if not args.skip_steps:
        print("| problem | d | L | DP-SGD step (ms) | noise source | state (MB) | noise ms / step | x DP-SGD step "
              "| x i.i.d. noise | peak RSS (MB) | bytes written |")
        print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for problem, L in (("P2", 32), ("P2", 64), ("P1", 1024), ("P3", 1024)):
            dp = repeated(dpsgd_job, (problem, L, 10 if L < 1000 else 3, args.threads), args.repeat, ("ms",))
            iid = None
            for kind, size in (("iid", 0), ("band", 16), ("band", 64), ("blt", 2), ("blt", 4)):
                r = repeated(step_job, (problem, kind, size, args.noise_steps, args.threads), args.repeat,
                             ("ms", "rss_mb", "write_bytes"))
                iid = r["ms"] if kind == "iid" else iid
                label = {"iid": "i.i.d. (DP-SGD)", "band": f"BandMF b = {size}", "blt": f"BLT m = {size}"}[kind]
                ratio = dict(r, ratio=r["ms"] / dp["ms"], ratio_range=(r["ms_range"][0] / dp["ms_range"][1],
                                                                       r["ms_range"][1] / dp["ms_range"][0]))
                print(f"| {problem} | {r['d']} | {L} | {spread(dp, 'ms', '.1f')} | {label} | {r['state_mb']:.1f} "
                      f"| {spread(r, 'ms', '.2f')} | {spread(ratio, 'ratio', '.3f')} | {r['ms'] / iid:.2f} "
                      f"| {r['rss_mb']:.0f} | {r['write_bytes_range'][1]:.0f} |", flush=True)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
