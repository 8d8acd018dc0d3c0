"""Time DP steps of P2 (2c2d on Fashion-MNIST) or P4 (the byte-level transformer LM on the
fortunes corpus) at expected batch size L on a CPU:

1. dpbench's DP-SGD step (per-sample gradients by book-keeping, clipping, noise, SGD);
2. the non-private step on the same model and the same Poisson batches (autograd on the
   mean loss, SGD);
3-5. Opacus 1.6 in its three modes, hooks, ghost clipping (``grad_sample_mode="ghost"``) and
   functorch, fed the same in-memory batches (``make_private``'s model and optimizer, steps as
   in benchmarks/bench_gpu.py);
6. a plain Opacus loop: ``make_private`` (Poisson sampling, hooks) over a DataLoader of the
   same in-memory tensors.

Every method is timed ``--repeats`` times (default 5, the least the docs accept), round-robin
(so a busy shared machine slows all methods alike), each time from a fresh model over the same
``--steps`` batches, which it first runs once untimed (every batch size seen: oneDNN caches a
primitive per shape, as over a long run; the Opacus DataLoader loop only gets a few warm-up
steps). For every method the table gives the median ms per step with its range (min-max) over
the repeats, and its ratio to the non-private step as the median of the per-repeat ratios (each
repeat's method time over the same repeat's non-private time) with their range: every ratio is
measured in this one run, beside its baseline. The header states the machine, the date and the
load average, which the docs quote with the numbers.

P4 (``--problem P4``): the same methods on TransformerLM (876,034 parameters) over Poisson
batches of the real fortunes training records (token rows (N, 129), no canaries planted). Every
method's loss is ``language.per_sample_loss`` (per record, the mean next-token cross-entropy over
its real tokens; the batch cut to its longest record first, so every method pays for the same
trimmed length), averaged over the batch as for P2. An Opacus mode that cannot handle the
model (make_private refuses it, or its first step raises) is listed as "not supported: <the
error>" instead of timed; dpbench's own steps are never excused. Opacus 1.6.0's ghost clipping
needs contiguous ids in nn.Embedding (its norm sampler, grad_sample/embedding_norm_sample.py:123,
calls ``.view(-1, 1)`` on them; benchmarks/opacus_ghost_embedding_bug.py reproduces it), and
both of P4's embeddings get views (the positions are ``arange(T).expand(B, T)``, the tokens the
slice ``x[:, :-1]``): its model gets them copied contiguous by a forward pre-hook
(bench_gpu.contiguous_embedding_ids), inside the timed step. Defaults for P4: L = 64, 10 steps
(P2: L = 256, one epoch).

Usage:  python benchmarks/bench_step.py [--problem P2] [--batch-size 256] [--threads 2] [--steps N] [--repeats 5]
        python benchmarks/bench_step.py --problem P4 [--batch-size 64] [--steps 10] [--threads 2] [--repeats 5]
Prints a Markdown table for docs/speed.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from dpbench.machine import cpu_model
from dpbench.problems import get_problem
from dpbench.mechanisms.sampling import PoissonSampler


def _sibling(name: str):
    """benchmarks/<name>.py, imported by its file: benchmarks/ is not a package, and this script
    is both run (``python benchmarks/bench_step.py``) and imported by the tests."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


_gpu = _sibling("bench_gpu")
SIGMA, build_model, opacus_step, our_step = _gpu.SIGMA, _gpu.build_model, _gpu.opacus_step, _gpu.our_step

WARMUP = 3
MIN_REPEATS = 5  # docs/speed.md quotes only medians over at least this many repeats
BASELINE = "non-private step (same model, same batches)"
DP = "dpbench DP-SGD step"
LOOP = "Opacus make_private + DataLoader"
DEFAULTS = {"P2": {"batch_size": 256, "steps": None}, "P4": {"batch_size": 64, "steps": 10}}  # None: one epoch


def machine() -> str:
    """The CPU model and core count, for the header the docs quote."""
    model = cpu_model() or platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def report(times: dict[str, list[float]], *, steps: int, epoch_steps: int, L: int, threads: int, repeats: int,
           started: str, load_before: str, problem: str = "P2", unsupported: dict[str, str] | None = None) -> str:
    """The Markdown the docs quote: header (machine, date, load), table, ratios. A method in
    ``unsupported`` (name -> reason) gets a "not supported: <reason>" row and no ratios."""
    import opacus

    unsupported = unsupported or {}
    lines = [f"{problem}, L = {L}, {steps} steps (one epoch = {epoch_steps}) x {repeats} repeats, "
             f"{threads} CPU threads",
             f"machine: {machine()}",
             f"date: {started} (UTC start) to {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} (end)",
             f"torch {torch.__version__}, opacus {opacus.__version__}; load average (1, 5, 15 min) at start "
             f"{load_before}, at end {load()}", ""]
    if repeats < MIN_REPEATS:
        lines += [f"WARNING: {repeats} repeats < {MIN_REPEATS}: not enough for the docs", ""]
    lines += ["| method | ms / step, median | range over repeats | x non-private, median of per-repeat ratios "
              "| range | steps / s | epoch (s) |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, v in times.items():
        if name in unsupported:
            lines.append(f"| {name} | not supported: {unsupported[name]} | | | | | |")
            continue
        med, lo, hi = median_range(v)
        r_med, r_lo, r_hi = median_range([a / b for a, b in zip(v, times[BASELINE])])
        lines.append(f"| {name} | {1e3 * med:.1f} | {1e3 * lo:.1f}-{1e3 * hi:.1f} | {r_med:.2f} | {r_lo:.2f}-{r_hi:.2f} "
                     f"| {1 / med:.1f} | {med * epoch_steps:.1f} |")
    dp = median_range([a / b for a, b in zip(times[DP], times[BASELINE])])
    lines += ["", f"DP step / non-private step: {dp[0]:.2f}x, range {dp[1]:.2f}-{dp[2]:.2f} over {repeats} repeats "
                  f"(goal <= 1.3x)"]
    for name in [k for k in times if k.startswith("Opacus") and k not in unsupported]:
        r = median_range([a / b for a, b in zip(times[name], times[DP])])
        lines.append(f"{name} / DP step: {r[0]:.2f}x, range {r[1]:.2f}-{r[2]:.2f} (goal > 1)")
    return "\n".join(lines)


def timed(step_fn, batches) -> float:
    """Seconds per step over the given batches, run once untimed first: every batch size has
    been seen (oneDNN makes and caches a primitive per shape, as over a long run)."""
    for x, y in batches:
        step_fn(x, y)
    t = time.perf_counter()
    for x, y in batches:
        step_fn(x, y)
    return (time.perf_counter() - t) / len(batches)


def why(e: Exception) -> str:
    """One line for the table: the error and the innermost frame that raised it."""
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = ""
    if frame:
        where = f" in {frame.name} ({Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno})"
    msg = (str(e).strip().splitlines() or [""])[0].split(" (")[0].replace("|", "/")[:160]
    return f"{type(e).__name__}{where}: {msg}"


def opacus_loop(problem_id: str, x, y, L: int, steps: int) -> float:
    """Opacus's own loop: make_private with Poisson sampling over a DataLoader, hooks mode."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    problem = get_problem(problem_id)
    model = build_model(problem_id, "cpu")
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
            if problem_id == "P2":
                F.cross_entropy(model(xb), yb).backward()
            else:  # the problem's per-sample losses (P4: per-record token CE, batch trimmed), mean over the batch
                problem.per_sample_loss(model, xb, yb)[0].mean().backward()
            optimizer.step()
            done += 1
            if done >= steps + WARMUP:
                return (time.perf_counter() - t) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", choices=sorted(DEFAULTS), default="P2")
    parser.add_argument("--batch-size", type=int, help="expected batch size L (default: P2 256, P4 64)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, help="steps to time (default: P2 one epoch, round(N/L); P4 10)")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS,
                        help=f"timed repeats per method (default {MIN_REPEATS}; fewer are flagged as not enough)")
    parser.add_argument("--data-dir")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    started, load_before = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}", load()

    pid = args.problem
    x, y = data(pid, args.data_dir)
    n, L = len(y), args.batch_size or DEFAULTS[pid]["batch_size"]
    steps = args.steps or DEFAULTS[pid]["steps"] or round(n / L)
    sampler = PoissonSampler(n, L / n, seed=0)
    batches = [(x[i], y[i]) for i in (sampler.sample() for _ in range(steps))]

    methods = {
        DP: lambda: our_step(pid, "dpsgd", L, "cpu", steps)[0],
        BASELINE: lambda: our_step(pid, "sgd", L, "cpu", steps)[0],
        "Opacus hooks (same batches)": lambda: opacus_step(pid, "hooks", L, n, "cpu")[0],
        "Opacus ghost clipping (same batches)": lambda: opacus_step(pid, "ghost", L, n, "cpu")[0],
        "Opacus functorch (same batches)": lambda: opacus_step(pid, "functorch", L, n, "cpu")[0],
        LOOP: lambda: opacus_loop(pid, x, y, L, steps),  # builds and times its own loop
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    unsupported: dict[str, str] = {}
    for r in range(args.repeats):
        for name, make in methods.items():
            if name in unsupported:
                continue
            try:
                times[name].append(make() if name == LOOP else timed(make(), batches))
            except Exception as e:  # an Opacus mode that cannot handle the model: reported, not timed
                if not name.startswith("Opacus"):
                    raise
                unsupported[name] = why(e)
                print(f"{name}: not supported: {unsupported[name]}", file=sys.stderr, flush=True)
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{k.split(' (')[0]} {1e3 * v[-1]:.1f} ms"
                                                             for k, v in times.items() if k not in unsupported),
              file=sys.stderr, flush=True)
    print(report(times, steps=steps, epoch_steps=round(n / L), L=L, threads=args.threads, repeats=args.repeats,
                 started=started, load_before=load_before, problem=pid, unsupported=unsupported))


def data(problem_id: str, data_dir: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The problem's training split as model inputs and labels (P2: Fashion-MNIST images; P4:
    the fortunes training records as token rows (N, 129), labels unused zeros)."""
    problem = get_problem(problem_id)
    ds = problem.load(data_dir)
    return problem.preprocess(ds.x_train), torch.from_numpy(ds.y_train)


if __name__ == "__main__":
    main()
