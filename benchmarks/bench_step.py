"""Time DP steps of P2 (2c2d on Fashion-MNIST) at expected batch size L on a CPU:

1. dpbench's DP-SGD step (per-sample gradients by book-keeping, clipping, noise, SGD);
2. the non-private step on the same model and the same Poisson batches (autograd on the
   mean loss, SGD);
3-5. Opacus 1.6 in its three modes, hooks, ghost clipping (``grad_sample_mode="ghost"``) and
   functorch, fed the same in-memory batches (``make_private``'s model and optimizer, steps as
   in benchmarks/bench_gpu.py);
6. a plain Opacus loop: ``make_private`` (Poisson sampling, hooks) over a DataLoader of the
   same in-memory tensors.

Every method is timed ``--repeats`` times, round-robin (so a busy shared machine slows all
methods alike), each time from a fresh model over the same ``--steps`` batches, which it first
runs once untimed (every batch size seen: oneDNN caches a primitive per shape, as over a long
run; the Opacus DataLoader loop only gets a few warm-up steps); the table gives the median ms
per step and the range over the repeats.

Usage:  python benchmarks/bench_step.py [--batch-size 256] [--threads 2] [--steps N] [--repeats 3]
Prints a Markdown table (ms per step, steps per second, ratios) for the README.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import SIGMA, build_model, opacus_step, our_step  # noqa: E402

from dpbench.data import image_datasets  # noqa: E402
from dpbench.problems import get_problem  # noqa: E402
from dpbench.privacy.sampling import PoissonSampler  # noqa: E402

WARMUP = 3


def timed(step_fn, batches) -> float:
    """Seconds per step over the given batches, run once untimed first: every batch size has
    been seen (oneDNN makes and caches a primitive per shape, as over a long run)."""
    for x, y in batches:
        step_fn(x, y)
    t = time.perf_counter()
    for x, y in batches:
        step_fn(x, y)
    return (time.perf_counter() - t) / len(batches)


def opacus_loop(x, y, L: int, steps: int) -> float:
    """Opacus's own loop: make_private with Poisson sampling over a DataLoader, hooks mode."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    model = build_model("P2", "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = PrivacyEngine(accountant="prv").make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y), batch_size=L),
            noise_multiplier=SIGMA, max_grad_norm=1.0, poisson_sampling=True)
    done, t = 0, 0.0
    warnings.filterwarnings("ignore", message="Full backward hook")  # Opacus's hooks on a model without input grads
    while True:
        for xb, yb in loader:
            if done == WARMUP:
                t = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            done += 1
            if done >= steps + WARMUP:
                return (time.perf_counter() - t) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, help="steps to time (default: one epoch, round(N/L))")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    problem = get_problem("P2")
    ds = image_datasets.load(problem.dataset, args.data_dir)
    x = problem.preprocess(ds.train_images)
    y = torch.from_numpy(ds.train_labels)
    n, L = len(y), args.batch_size
    steps = args.steps or round(n / L)
    sampler = PoissonSampler(n, L / n, seed=0)
    batches = [(x[i], y[i]) for i in (sampler.sample() for _ in range(steps))]

    methods = {
        "dpbench DP-SGD step": lambda: our_step("P2", "dpsgd", L, "cpu", steps)[0],
        "non-private step (same model, same batches)": lambda: our_step("P2", "sgd", L, "cpu", steps)[0],
        "Opacus hooks (same batches)": lambda: opacus_step("P2", "hooks", L, n, "cpu")[0],
        "Opacus ghost clipping (same batches)": lambda: opacus_step("P2", "ghost", L, n, "cpu")[0],
        "Opacus functorch (same batches)": lambda: opacus_step("P2", "functorch", L, n, "cpu")[0],
    }
    times: dict[str, list[float]] = {name: [] for name in [*methods, "Opacus make_private + DataLoader"]}
    for r in range(args.repeats):
        for name, make in methods.items():
            times[name].append(timed(make(), batches))
        times["Opacus make_private + DataLoader"].append(opacus_loop(x, y, L, steps))
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k.split(' (')[0]} {1e3 * v[-1]:.1f} ms"
                                                             for k, v in times.items()), file=sys.stderr, flush=True)
    med = {name: statistics.median(v) for name, v in times.items()}
    epoch_steps = round(n / L)
    print(f"P2, L = {L}, {steps} steps (one epoch = {epoch_steps}) x {args.repeats} repeats, {args.threads} CPU "
          f"threads, torch {torch.__version__}, {platform.processor() or platform.machine()}\n")
    print("| method | ms / step (median) | range over repeats | steps / s | epoch (s) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, s in med.items():
        lo, hi = min(times[name]), max(times[name])
        print(f"| {name} | {1e3 * s:.1f} | {1e3 * lo:.1f}-{1e3 * hi:.1f} | {1 / s:.1f} | {s * epoch_steps:.1f} |")
    dp, nonpriv = med["dpbench DP-SGD step"], med["non-private step (same model, same batches)"]
    fastest = min((v, k) for k, v in med.items() if k.startswith("Opacus"))
    print(f"\nDP step / non-private step: {dp / nonpriv:.2f}x (goal <= 1.3x; per repeat: "
          + ", ".join(f"{a / b:.2f}" for a, b in zip(times["dpbench DP-SGD step"],
                                                     times["non-private step (same model, same batches)"])) + ")")
    print(f"fastest Opacus mode ({fastest[1]}) / DP step: {fastest[0] / dp:.2f}x (goal > 1)")


if __name__ == "__main__":
    main()
