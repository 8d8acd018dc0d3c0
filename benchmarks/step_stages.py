"""Where the DP step's time goes beyond the non-private step's, on the CPU: each stage timed
on the same Poisson batches of the real training data, the two steps alternating batch by
batch (so both see the same load), median ms per step over ``--steps`` steps after one untimed.

* non-private step (``sgd``): forward; backward (autograd to the parameters: the weight
  gradients); the update;
* DP-SGD step (``dpsgd``): forward with the tape; backward to the layer outputs only
  (``DPStep.per_sample_gradients``, which times forward and backward together); the clipped sum
  (``DPStep.clip_and_sum``: per-sample norms, from materialised per-sample gradients or the
  ghost identity, the clipping coefficients, the weighted sum); noise, mean and update.

Then the clipped sum split by layer: for every trainable layer of the DP step, the time of its
norm terms (``LayerGrads.norm_terms``: the batched products that materialise per-sample weight
gradients, or the ghost products, and the norms) on a fresh backward pass, summed by layer type
and shape, in ms per step.

Usage:  python benchmarks/step_stages.py --problem P4 [--batch-size 64] [--steps 10] [--threads 2]
Prints Markdown for docs/speed.md.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from dpbench.mechanisms.sampling import PoissonSampler

# benchmarks/count_ops.py, imported by its file (benchmarks/ is not a package): its build_step
# builds both steps as the harness does, and its _sibling loads bench_step
_spec = importlib.util.spec_from_file_location("count_ops", Path(__file__).resolve().with_name("count_ops.py"))
count_ops = sys.modules.setdefault("count_ops", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(count_ops)

DEFAULTS = {"P2": 256, "P4": 64}


def stage_times(sgd, dp, batches) -> dict[str, list[float]]:
    """Seconds per stage per batch, the two steps alternating."""
    clock, times = time.perf_counter, collections.defaultdict(list)
    for x, y in batches:
        t0 = clock()
        losses, _ = sgd.ctx.loss_fn(sgd.model, x, y)
        t1 = clock()
        grads = torch.autograd.grad(losses.sum(), sgd.params)
        t2 = clock()
        sgd.rule.update(sgd.params, [g.div_(sgd.ctx.expected_batch_size) for g in grads])
        t3 = clock()
        times["non-private: forward"].append(t1 - t0)
        times["non-private: backward (weight gradients)"].append(t2 - t1)
        times["non-private: update"].append(t3 - t2)
        t0 = clock()
        psg, _ = dp.per_sample_gradients(x, y)
        t1 = clock()
        summed = dp.clip_and_sum(psg)
        t2 = clock()
        dp.rule.update(dp.params, dp.scale_to_mean(dp.add_noise(summed)))
        t3 = clock()
        times["DP-SGD: forward and backward to the layer outputs"].append(t1 - t0)
        times["DP-SGD: clipped sum (norms, coefficients, weighted sum)"].append(t2 - t1)
        times["DP-SGD: noise, mean, update"].append(t3 - t2)
    return times


def layer_times(dp, batches) -> dict[str, float]:
    """Seconds per step of each layer kind's norm terms (materialisation or ghost products
    included), on fresh backward passes over ``batches``."""
    clock, total = time.perf_counter, collections.Counter()
    for x, y in batches:
        psg, _ = dp.per_sample_gradients(x, y)
        for layer in psg.layers:
            ghost = getattr(layer, "use_ghost", False)
            shape = "x".join(map(str, layer.module.weight.shape))
            key = f"{type(layer.module).__name__} {shape} ({'ghost' if ghost else 'materialised'})"
            t = clock()
            layer.norm_terms()
            total[key] += clock() - t
    return {k: v / len(batches) for k, v in total.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", choices=sorted(DEFAULTS), default="P4")
    parser.add_argument("--batch-size", type=int, help="expected batch size L (default: P2 256, P4 64)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after one untimed)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    bench = count_ops._sibling("bench_step")
    started = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
    load_start = " ".join(f"{v:.2f}" for v in os.getloadavg())

    pid, L = args.problem, args.batch_size or DEFAULTS[args.problem]
    x, y = bench.data(pid, args.data_dir)
    sampler = PoissonSampler(len(y), L / len(y), seed=0)
    batches = [(x[i], y[i]) for i in (sampler.sample() for _ in range(args.steps + 1))]
    with tempfile.TemporaryDirectory() as cache_dir:
        sgd = count_ops.build_step(pid, "sgd", L, len(y), cache_dir)
        dp = count_ops.build_step(pid, "dpsgd", L, len(y), cache_dir)
        stage_times(sgd, dp, batches[:1])
        times = stage_times(sgd, dp, batches[1:])
        layers = layer_times(dp, batches[1:])

    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    np_total = sum(v for k, v in med.items() if k.startswith("non-private"))
    dp_total = sum(v for k, v in med.items() if k.startswith("DP-SGD"))
    load_end = " ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [f"{pid}, L = {L}: stages of the DP-SGD and the non-private step, median ms per step over "
             f"{args.steps} steps (after one untimed), the steps alternating batch by batch, {args.threads} CPU threads",
             f"machine: {bench.machine()}",
             f"date: {started} (UTC); torch {torch.__version__}; load average (1, 5, 15 min) {load_start} at the "
             f"start, {load_end} at the end",
             f"command: python benchmarks/step_stages.py {' '.join(sys.argv[1:])}", "",
             "| stage | ms / step, median | range |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {med[k]:.1f} | {1e3 * min(v):.1f}-{1e3 * max(v):.1f} |" for k, v in times.items()]
    lines += [f"| non-private step, sum of medians | {np_total:.1f} | |",
              f"| DP-SGD step, sum of medians | {dp_total:.1f} ({dp_total / np_total:.2f}x) | |", "",
              "| layer (norm terms in the clipped sum) | ms / step, mean |", "| --- | ---: |"]
    lines += [f"| {k} | {1e3 * v:.1f} |" for k, v in sorted(layers.items(), key=lambda kv: -kv[1])]
    lines.append(f"| all layers | {1e3 * sum(layers.values()):.1f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
