"""Does every optimizer learn? One short real run each: P2 (real Fashion-MNIST), epsilon = 10,
one epoch at L = 256, seed 0, through ``dpbench.training.train.run`` (the harness every grid cell uses:
calibration, Poisson sampling, accounting), and the test accuracy after it.

Learning rates are single picks from the thesis's grids (Setup 1: dpsgd {1e-3 .. 1},
dpadambc {1e-6 .. 1e-3}, dpdice and dpdisk {1e-3 .. 10}), not tuned; override with
``--lr NAME=VALUE``. d2p2sgd and dp2sgd use their default projection (srht); with
``--hp projection=gaussian`` they draw a 225,034 x 157,524 Gaussian matrix every step (minutes
per step on a CPU, 234 steps per epoch: give them a GPU, ``--device cuda``).

Usage:  python benchmarks/learns.py [--threads 2] [--steps N] [--test-subset N] [--optimizers a,b]
                                   [--hp NAME=VALUE (to every optimizer that takes it)]
        (--steps and --test-subset make a quick check; the default is the full epoch)
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time

LR = {
    "sgd": 0.1, "adam": 1e-3,
    "dpsgd": 1.0, "dpadam": 1e-3, "dpadambc": 1e-4, "dpadamw": 1e-3, "dpadamw-bc": 1e-4,
    "dpdice": 1.0, "dpdisk": 1.0, "d2p2sgd": 1.0, "d2psgd": 1.0, "dp2sgd": 1.0,
    # matrix mechanisms: Setup 2's best lr at epsilon = 10 (thesis Sec. 5.3); fixed batches, E = 1
    "dpmatrix-se": 1.0, "dpmatrix-se-lambda": 1.0, "dpmatrix-me": 1.0, "dpmatrix-me-lambda": 1.0,
    # beyond the thesis: DP-Dice calibrated to a valid bound, the streamed mechanisms (their
    # relatives' lr)
    "dpdice-strict": 1.0, "dpmatrix-band": 1.0, "dpmatrix-band-amp": 1.0, "dpmatrix-blt": 1.0,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizers", help="comma-separated (default: every registered optimizer with an lr here)")
    parser.add_argument("--lr", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--hp", action="append", default=[], metavar="NAME=VALUE",
                        help="a hyperparameter (string) for every optimizer that has it")
    parser.add_argument("--epsilon", type=float, default=10.0)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, help="stop after this many steps (quick check)")
    parser.add_argument("--test-subset", type=int, help="evaluate on this many test examples (quick check)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--data-dir")
    args = parser.parse_args()

    import torch

    from dpbench.optimizers import OPTIMIZERS
    from dpbench.training.train import RunConfig, run

    torch.set_num_threads(args.threads)
    lrs = {**LR, **{k: float(v) for k, v in (s.split("=", 1) for s in args.lr)}}
    names = args.optimizers.split(",") if args.optimizers else [n for n in OPTIMIZERS if n in lrs]
    hps = dict(s.split("=", 1) for s in args.hp)
    rows = []
    for name in names:
        spec = OPTIMIZERS[name]
        t = time.perf_counter()
        hyper = {k: v for k, v in hps.items() if k in spec.defaults}
        res = run(RunConfig(problem="P2", optimizer=name, lr=lrs[name], batch_size=args.batch_size, epochs=1, seed=0,
                            epsilon=args.epsilon if spec.private else None, max_steps=args.steps, hyperparameters=hyper,
                            test_subset=args.test_subset, data_dir=args.data_dir, device=args.device,
                            progress_every_s=60), spec)
        p, r = res.meta["privacy"], res.meta["result"]
        rows.append((name, lrs[name], p, r, res.meta["timing"], time.perf_counter() - t))
        print(f"{name}: test accuracy {r['final_test_accuracy']:.4f}", file=sys.stderr, flush=True)

    steps = f"{args.steps} steps" if args.steps else "1 epoch"
    print(f"P2, epsilon = {args.epsilon:g} (delta = 1e-5), L = {args.batch_size}, {steps}, seed 0, "
          f"{args.threads} threads, device {args.device}"
          + (f", test subset {args.test_subset}" if args.test_subset else "") + "\n")
    print("| optimizer | lr | sigma | epsilon achieved | accountant | steps | s / step | test loss | test accuracy |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for name, lr, p, r, timing, wall in rows:
        eps = f"{p['epsilon']:.3f}" if p.get("accountant") else "—"
        print(f"| {name} | {lr:g} | {p['noise_multiplier']:.4g} | {eps} | {p.get('accountant') or '—'} | "
              f"{p['steps']} | {1 / timing['steps_per_second']:.3f} | {r['final_test_loss']:.4g} | "
              f"{r['final_test_accuracy']:.4f} |")


if __name__ == "__main__":
    main()
