"""Time one epoch of P2 (2c2d on Fashion-MNIST) at expected batch size L three ways:

1. dpbench's DP-SGD step (per-sample gradients by book-keeping, clipping, noise, SGD);
2. the non-private step on the same model and the same Poisson batches (autograd on the
   mean loss, SGD);
3. a plain Opacus loop: ``PrivacyEngine.make_private`` (Poisson sampling, hooks) over a
   DataLoader of the same in-memory tensors.

Usage:  python benchmarks/bench_step.py [--batch-size 256] [--threads 2] [--steps N]
Prints a Markdown table (ms per step, steps per second, ratios) for the README.
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings

import torch
import torch.nn.functional as F

from dpbench import data
from dpbench.clipping import Clipping
from dpbench.noise import GaussianNoise
from dpbench.optimizers.base import SGD, Context, DPStep, NonPrivateStep
from dpbench.problems import get_problem
from dpbench.sampling import PoissonSampler

SIGMA, LR = 1.0, 0.5


def timed(step_fn, batches, warmup: int = 3) -> float:
    """Seconds per step over the given batches (after a few warm-up steps)."""
    for x, y in batches[:warmup]:
        step_fn(x, y)
    t = time.perf_counter()
    for x, y in batches:
        step_fn(x, y)
    return (time.perf_counter() - t) / len(batches)


def ours(problem, x, y, batches, private: bool) -> float:
    torch.manual_seed(0)
    model = problem.build()
    ctx = Context(model=model, loss_fn=lambda m, xb, yb: problem.per_sample_loss(m, xb, yb), lr=LR,
                  expected_batch_size=batches.L, noise_multiplier=SIGMA, clipping=Clipping(1.0),
                  noise=GaussianNoise(1), steps=len(batches.idx))
    step = DPStep(ctx, SGD(LR)) if private else NonPrivateStep(ctx, SGD(LR))
    return timed(lambda xb, yb: step(xb, yb), [(x[i], y[i]) for i in batches.idx])


def opacus_loop(problem, x, y, L: int, steps: int) -> float:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = problem.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = PrivacyEngine(accountant="prv").make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(TensorDataset(x, y), batch_size=L),
            noise_multiplier=SIGMA, max_grad_norm=1.0, poisson_sampling=True)
    done, t, warm = 0, 0.0, 3
    warnings.filterwarnings("ignore", message="Full backward hook")  # Opacus's hooks on a model without input grads
    while done < steps:
        for xb, yb in loader:
            if done == warm:
                t = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            done += 1
            if done >= steps + warm:
                return (time.perf_counter() - t) / steps
    return (time.perf_counter() - t) / (done - warm)


class Batches:
    def __init__(self, n: int, L: int, steps: int):
        sampler = PoissonSampler(n, L / n, seed=0)
        self.L, self.idx = L, [sampler.sample() for _ in range(steps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, help="steps to time (default: one epoch, round(N/L))")
    parser.add_argument("--data-dir")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    problem = get_problem("P2")
    ds = data.load(problem.dataset, args.data_dir)
    x = problem.preprocess(ds.train_images)
    y = torch.from_numpy(ds.train_labels)
    steps = args.steps or round(len(y) / args.batch_size)
    batches = Batches(len(y), args.batch_size, steps)

    rows = [("dpbench DP-SGD step", ours(problem, x, y, batches, private=True)),
            ("non-private step (same model, same batches)", ours(problem, x, y, batches, private=False)),
            ("Opacus make_private + DataLoader", opacus_loop(problem, x, y, args.batch_size, steps))]
    dp, nonpriv, opacus = (r[1] for r in rows)
    print(f"P2, L = {args.batch_size}, {steps} steps (one epoch = {round(len(y) / args.batch_size)}), "
          f"{args.threads} CPU threads, torch {torch.__version__}, {platform.processor() or platform.machine()}\n")
    print("| method | ms / step | steps / s | epoch (s) |")
    print("| --- | ---: | ---: | ---: |")
    epoch_steps = round(len(y) / args.batch_size)
    for name, s in rows:
        print(f"| {name} | {1e3 * s:.1f} | {1 / s:.1f} | {s * epoch_steps:.1f} |")
    print(f"\nDP step / non-private step: {dp / nonpriv:.2f}x (target <= 2.0x)")
    print(f"Opacus loop / DP step: {opacus / dp:.2f}x faster (target >= 1.5x)")


if __name__ == "__main__":
    main()
