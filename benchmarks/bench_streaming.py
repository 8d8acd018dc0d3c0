"""Cost of the streaming correlated-noise mechanisms (dpmatrix-band, dpmatrix-band-amp,
dpmatrix-blt) at the thesis's Setup 2 and Setup 3 sizes.

1. Factorization time: each mechanism's ``plan`` (the factorization, and for
   dpmatrix-band-amp with bands = auto the band search at the target epsilon) for
   Setup 2 (P2, N = 60,000, L in {32, 64}, E = 1) and Setup 3 (P1 N = 50,000 and P3
   N = 60,000, L in {1024, 2048}, E = 30). Goal: <= 10 s each on 2 cores.
2. Per-step noise cost: ``sample`` of the streamed noise source for the problem's parameter
   count d, against the i.i.d. noise of DP-SGD and against a whole dpbench DP-SGD step (random
   inputs of the problem's shape; the cost does not depend on the data) at the setup's L. Goal:
   <= 0.3x a DP-SGD step for BandMF b <= 64 and BLT.
3. Peak RSS of each measurement (each runs in a fresh process) and bytes the process wrote to
   storage while streaming (/proc/self/io write_bytes; goal 0: no noise file).
4. (--errors) The expected squared error of the released prefix sums per coordinate,
   E||noise on prefix sums||^2 / d = sigma^2 T err_mean, of each mechanism with the sigma it
   needs at epsilon in {1, 10}, delta = 1e-5, against DP-SGD with Poisson sampling (PRV):
   the table of docs/matrix.md.

Usage: OPENBLAS_NUM_THREADS=1 python benchmarks/bench_streaming.py [--threads 2] [--skip-steps] [--skip-factorizations]
Prints Markdown tables. One BLAS thread for numpy/scipy (as the factorize rules and
bench_matrix.py use: on a loaded 2-core machine two OpenBLAS threads made the small L-BFGS-B
steps several times slower); ``--threads`` sets torch's threads for the noise and DP-SGD steps.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import statistics
import time
from types import SimpleNamespace

SETUP2 = [("P2", 60_000, L, 1) for L in (32, 64)]
SETUP3 = [(p, n, L, 30) for p, n in (("P1", 50_000), ("P3", 60_000)) for L in (1024, 2048)]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes:")).split()[1])


def factorization_job(args) -> dict:
    optimizer, problem, n_train, L, epochs, epsilon, threads = args
    import torch

    torch.set_num_threads(threads)
    from dpbench.optimizers import get_optimizer

    mech = get_optimizer(optimizer).mechanism
    cfg = SimpleNamespace(hyperparameters={}, epsilon=epsilon, delta=1e-5)
    t, c = time.perf_counter(), time.process_time()
    plan = mech.plan(n_train, L, epochs, cfg)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    fact = plan.extras["factorization"]
    size = getattr(fact, "bands", None) or getattr(fact, "buffers", None)
    sens = plan.extras.get("sensitivity", plan.extras.get("max_column_norm"))
    return {"optimizer": optimizer, "problem": problem, "L": L, "epochs": epochs, "epsilon": epsilon,
            "T": plan.steps, "size": size, "error_mean": fact.error_mean(), "sens": sens,
            "rate": plan.sample_rate, "wall_s": wall, "cpu_s": cpu, "rss_mb": _peak_rss_mb()}


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
    from dpbench.matrix.streaming_noise import BandedNoise, BLTNoise
    from dpbench.noise import GaussianNoise

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
    from dpbench.clipping import Clipping
    from dpbench.noise import GaussianNoise
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
    """sigma and sigma^2 T err_mean of DP-SGD and of the three mechanisms at one setup cell."""
    problem, n_train, L, epochs, threads = args
    import torch

    torch.set_num_threads(threads)
    from dpbench import accounting
    from dpbench.optimizers import get_optimizer

    rows = []
    for eps in (1.0, 10.0):
        steps = max(1, round(epochs * n_train / L))
        sigma = accounting.calibrate_noise_multiplier(eps, L / n_train, steps, 1e-5, "prv")
        rows.append({"mechanism": "DP-SGD, Poisson q = L/N, PRV", "eps": eps, "T": steps, "size": "—",
                     "sigma": sigma, "error": sigma ** 2 * steps * (steps + 1) / 2})
        for optimizer in ("dpmatrix-band", "dpmatrix-band-amp", "dpmatrix-blt"):
            mech = get_optimizer(optimizer).mechanism
            plan = mech.plan(n_train, L, epochs, SimpleNamespace(hyperparameters={}, epsilon=eps, delta=1e-5))
            fact = plan.extras["factorization"]
            sigma = mech.calibrate(plan, eps, 1e-5, "prv")
            rows.append({"mechanism": f"`{optimizer}`", "eps": eps, "T": plan.steps,
                         "size": getattr(fact, "bands", None) or getattr(fact, "buffers", None), "sigma": sigma,
                         "error": sigma ** 2 * plan.steps * fact.error_mean()})
    return rows


def run(job, args):
    with mp.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(job, (args,))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-factorizations", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--noise-steps", type=int, default=20)
    parser.add_argument("--errors", action="store_true", help="only the expected-error table")
    args = parser.parse_args()
    print(f"{args.threads} torch threads, {os.cpu_count()} CPUs, {platform.machine()}, "
          f"load average before: {os.getloadavg()[0]:.2f}\n")

    if args.errors:
        print("| setup | problem | L | mechanism | T | b or m | eps | sigma | E||noise on prefix sums||^2 / d "
              "| vs DP-SGD |")
        print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for setup, cells in (("2", SETUP2), ("3", SETUP3)):
            for problem, n, L, E in cells:
                rows = run(errors_job, (problem, n, L, E, args.threads))
                base = {r["eps"]: r["error"] for r in rows if r["mechanism"].startswith("DP-SGD")}
                for r in rows:
                    print(f"| {setup} | {problem} | {L} | {r['mechanism']} | {r['T']} | {r['size']} | {r['eps']:g} "
                          f"| {r['sigma']:.4g} | {r['error']:.4g} | {r['error'] / base[r['eps']]:.3g} |", flush=True)
        return

    if not args.skip_factorizations:
        print("| setup | problem | L | E | mechanism | target eps | T | b or m | err_mean | sens (amp: max col) "
              "| p | wall (s) | CPU (s) | peak RSS (MB) |")
        print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for setup, cells in (("2", SETUP2), ("3", SETUP3)):
            for problem, n, L, E in cells:
                jobs = [("dpmatrix-band", None), ("dpmatrix-blt", None), ("dpmatrix-band-amp", 1.0),
                        ("dpmatrix-band-amp", 10.0)]
                for optimizer, eps in jobs:
                    r = run(factorization_job, (optimizer, problem, n, L, E, eps, args.threads))
                    rate = "—" if r["rate"] is None else f"{r['rate']:.4g}"
                    print(f"| {setup} | {problem} | {L} | {E} | `{optimizer}` | {eps or '—'} | {r['T']} | {r['size']} "
                          f"| {r['error_mean']:.4g} | {r['sens']:.4g} | {rate} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} "
                          f"| {r['rss_mb']:.0f} |", flush=True)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}\n")

    if not args.skip_steps:
        print("| problem | d | L | DP-SGD step (ms) | noise source | state (MB) | noise ms / step | x DP-SGD step "
              "| x i.i.d. noise | peak RSS (MB) | bytes written |")
        print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for problem, L in (("P2", 32), ("P2", 64), ("P1", 1024), ("P3", 1024)):
            dp = run(dpsgd_job, (problem, L, 10 if L < 1000 else 3, args.threads))
            iid = None
            for kind, size in (("iid", 0), ("band", 16), ("band", 64), ("blt", 2), ("blt", 4)):
                r = run(step_job, (problem, kind, size, args.noise_steps, args.threads))
                iid = r["ms"] if kind == "iid" else iid
                label = {"iid": "i.i.d. (DP-SGD)", "band": f"BandMF b = {size}", "blt": f"BLT m = {size}"}[kind]
                print(f"| {problem} | {r['d']} | {L} | {dp['ms']:.1f} | {label} | {r['state_mb']:.1f} | {r['ms']:.2f} "
                      f"| {r['ms'] / dp['ms']:.3f} | {r['ms'] / iid:.2f} | {r['rss_mb']:.0f} | {r['write_bytes']} |",
                      flush=True)
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
