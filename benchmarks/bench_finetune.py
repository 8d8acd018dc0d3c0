"""The DP step in the fine-tuning modes on the CPU: per mode (``full``, ``last-block``, ``lora``),
dpbench's DP-SGD step (``dpsgd``) against the non-private step (``sgd``) of the same mode, and
every mode's DP step against the ``full`` DP step; and the peak memory of a full and a LoRA step.

Model: P6's (``TransformerClassifier``, P4's default dims, 40 classes) built as a run builds it,
``harness.build_model(problem, seed, "cpu", checkpoint, modes.parse(mode))``, from a checkpoint
object made here from a randomly initialised ``TransformerLM`` state dict: a step's time does not
depend on the weights' values, only on which are trained. Batches: ``--batch-size`` (64)
records each, the same fixed-size batches for every configuration, drawn without replacement from
P6's real training records (token rows of ``tokenizer.encode_records``, labelled by their file);
where the fortunes files are absent, generated text of fortune-like lengths in the same format
(the header says which). Each step's loss is ``problem.per_sample_loss`` (the batch cut to its
longest record, as in a run).

Timing: the configurations alternate step by step (round-robin over the same batch, so a busy
shared machine slows them alike), after one untimed step each; the table gives the median ms per
step and its range (min-max) over ``--steps`` steps, and every ratio as the median (range) of the
per-step ratios, each against the same round's baseline. Memory: each of (full, lora) x (dpsgd,
sgd) runs in its own fresh process (``--memory-child``): the peak resident set size over two
steps (VmHWM, reset just before them through /proc/self/clear_refs, Linux) less the resident size
then, i.e. what the step itself adds (the
per-sample gradients, activations, optimizer state and the update's temporaries); the model's own
weights are counted before.

Usage:  python benchmarks/bench_finetune.py [--steps 8] [--batch-size 64] [--threads 1] [--modes full,last-block,lora]
Prints Markdown for benchmarks/results/finetune/speed.md and docs/finetune.md.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from types import SimpleNamespace

import numpy as np
import torch

from dpbench.mechanisms.base import PlanRequest
from dpbench.optimizers import get_optimizer
from dpbench.optimizers.base import Context
from dpbench.privacy.clipping import Clipping, NoClipping
from dpbench.problems import get_problem, modes, tokenizer
from dpbench.problems.finetune import trainable_count
from dpbench.problems.architectures import DEFAULT_DIMS
from dpbench.problems.transformer import TransformerLM
from dpbench.training.harness import build_model

PROBLEM = "P6"
OPTIMIZERS = ("dpsgd", "sgd")  # the DP step and the non-private step of the same mode


def checkpoint(seed: int = 0) -> SimpleNamespace:
    """A checkpoint object (``state_dict``, ``model_dims``) of a randomly initialised TransformerLM
    of the default dims: what ``finetune.from_checkpoint`` reads of a pretrained one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state = TransformerLM(**DEFAULT_DIMS).state_dict()
    return SimpleNamespace(state_dict=state, model_dims=dict(DEFAULT_DIMS), path=None, sha256=None,
                           recipe={"random": True})


def records(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``n`` (tokens, labels) of P6: real training records if the fortunes files are installed,
    else generated text of fortune-like lengths; and which."""
    problem = get_problem(PROBLEM)
    rng = np.random.default_rng(seed)
    try:
        data = problem.load(None)
        pick = rng.choice(len(data.x_train), size=n, replace=False)
        x, y, source = data.x_train[pick], data.y_train[pick], f"real fortunes records ({data.source})"
    except Exception as error:  # noqa: BLE001 -- any missing or damaged file: generated records instead
        words = ["the", "a", "of", "computer", "love", "never", "is", "and", "to", "you", "will", "be", "fortune"]
        texts = [" ".join(rng.choice(words, size=int(rng.integers(3, 40)))) for _ in range(n)]
        x = tokenizer.encode_records(texts, DEFAULT_DIMS["context"])
        y = rng.integers(0, len(problem.facts.classes), size=n)
        source = f"generated text (fortunes unavailable: {error})"
    return problem.task.preprocess(x), torch.as_tensor(y, dtype=torch.int64), source


def build_step(mode: str, name: str, L: int, n_train: int, ckpt):
    """Optimizer ``name``'s step on P6's model in ``mode`` (seed 0), as the harness builds it
    (sigma = 1, C = 1, the default hyperparameters); and the model."""
    problem, spec = get_problem(PROBLEM), get_optimizer(name)
    model = build_model(problem, 0, "cpu", ckpt, modes.parse(mode))
    request = PlanRequest(n_train, L, 1, hyperparameters=spec.hyperparameters(None), target_epsilon=8.0, delta=1e-5)
    plan = spec.mechanism.plan(request)
    gen = torch.Generator().manual_seed(1)
    ctx = Context(model=model, loss_fn=lambda m, x, y: problem.per_sample_loss(m, x, y, gen), lr=1e-5,
                  expected_batch_size=L, noise_multiplier=1.0 if spec.private else 0.0,
                  clipping=Clipping(1.0) if spec.private else NoClipping(), noise=spec.mechanism.noise(plan, 1, "cpu"),
                  steps=plan.steps, hyperparameters=spec.hyperparameters(None))
    return spec.build(ctx), model


def _range(values) -> str:
    return f"{min(values):.0f}-{max(values):.0f}"


def _ratio_range(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def round_robin(steps: dict, batches) -> dict:
    """{config: [seconds per step]}: each of ``steps`` ({config: step(x, y)}) run once untimed on
    the first batch, then on every later batch in turn, the configurations alternating step by
    step (so a busy shared machine slows them alike)."""
    for step in steps.values():  # one untimed step each
        step(*batches[0])
    times = {c: [] for c in steps}
    for x, y in batches[1:]:
        for c, step in steps.items():
            t0 = time.perf_counter()
            step(x, y)
            times[c].append(time.perf_counter() - t0)
    return times


def time_steps(configs: list[tuple[str, str]], batches, ckpt, L: int, n_train: int) -> dict:
    steps = {c: build_step(*c, L, n_train, ckpt) for c in configs}
    times = round_robin({c: step for c, (step, _) in steps.items()}, batches)
    params = {c: (trainable_count(m), sum(p.numel() for p in m.parameters())) for c, (_, m) in steps.items()}
    return {"times": times, "params": params}


def memory_child(mode: str, name: str, L: int) -> None:
    """In a fresh process: print JSON {before, peak} resident kB around two steps."""
    x, y, _ = records(2 * L, seed=1)
    step, _ = build_step(mode, name, L, 12_979, checkpoint())
    print(json.dumps(step_memory(step, [(x[i * L:(i + 1) * L], y[i * L:(i + 1) * L]) for i in range(2)])))


def step_memory(step, batches) -> dict:
    """{before_kb, peak_kb}: the resident size just before ``step`` runs on each of ``batches``
    and the peak resident size over them (VmHWM, reset first through /proc/self/clear_refs,
    Linux). Meaningful in a fresh process that has run nothing else (``in_fresh_process``)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # resets the peak (VmHWM) to the current resident size
        f.write("5")
    before = _status_kb("VmRSS")
    for x, y in batches:
        step(x, y)
    return {"before_kb": before, "peak_kb": _status_kb("VmHWM")}


def _status_kb(key: str) -> int:
    """A line of /proc/self/status in kB: VmRSS (resident now), VmHWM (peak resident)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def memory(mode: str, name: str, L: int, threads: int) -> dict:
    return in_fresh_process(__file__, ["--memory-child", f"{mode},{name}", "--batch-size", str(L),
                                       "--threads", str(threads)])


def in_fresh_process(script: str, args: list[str]) -> dict:
    """The JSON that ``python script *args`` prints on its last line (a fresh interpreter)."""
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration (after one untimed)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default="full,last-block,lora")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    if args.memory_child:
        mode, name = args.memory_child.split(",")
        memory_child(mode, name, args.batch_size)
        return
    L, started = args.batch_size, time.time()
    chosen = args.modes.split(",")
    configs = [(m, o) for m in chosen for o in OPTIMIZERS]
    x, y, source = records(L * (args.steps + 1))
    batches = [(x[i * L:(i + 1) * L], y[i * L:(i + 1) * L]) for i in range(args.steps + 1)]
    ckpt = checkpoint()
    result = time_steps(configs, batches, ckpt, L, 12_979)
    t, params = result["times"], result["params"]
    load = os.getloadavg()
    lines = [f"# Fine-tuning step speed (P6's model, L = {L})", "",
             f"- command: `python benchmarks/bench_finetune.py --steps {args.steps} --batch-size {L} "
             f"--threads {args.threads} --modes {args.modes}`",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; CPU: {_cpu()} "
             f"({os.cpu_count()} cores visible), torch {torch.__version__}, {args.threads} thread(s)",
             f"- load average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (the machine was shared "
             "with other jobs: absolute times are inflated and noisy; the ratios, measured round by round on the "
             "same batch, are the numbers to read)",
             f"- records: {source}; {args.steps} timed steps per configuration after one untimed, configurations "
             "alternating step by step", ""]
    lines += ["| mode | step | trained / total parameters | ms / step, median | range | vs non-private step of "
              "the mode | vs full DP step |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    full_dp = t.get(("full", "dpsgd"))
    for mode in chosen:
        for name in OPTIMIZERS:
            v = t[(mode, name)]
            base = [a / b for a, b in zip(v, t[(mode, "sgd")])]
            vs_full = "" if full_dp is None else _ratio_range([a / b for a, b in zip(v, full_dp)])
            trained, total = params[(mode, name)]
            lines.append(f"| {mode} | {'DP-SGD' if name == 'dpsgd' else 'non-private SGD'} | "
                         f"{trained:,} / {total:,} | {1e3 * statistics.median(v):.0f} | "
                         f"{_range([1e3 * s for s in v])} | {_ratio_range(base)} | {vs_full} |")
    lines += ["", "Peak memory of one step (each in a fresh process: peak resident set size over two steps less "
              "the resident size just before them; VmHWM reset through /proc/self/clear_refs):", "",
              "| mode | step | resident before (MB) | peak (MB) | added by the step (MB) |",
              "| --- | --- | ---: | ---: | ---: |"]
    for mode in [m for m in ("full", "lora") if m in chosen]:
        for name in OPTIMIZERS:
            m = memory(mode, name, L, args.threads)
            lines.append(f"| {mode} | {'DP-SGD' if name == 'dpsgd' else 'non-private SGD'} | "
                         f"{m['before_kb'] / 1024:.0f} | {m['peak_kb'] / 1024:.0f} | "
                         f"{(m['peak_kb'] - m['before_kb']) / 1024:.0f} |")
    lines += ["", f"Wall time of the benchmark: {time.time() - started:.0f} s."]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
