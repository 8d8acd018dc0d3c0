"""P7's DP step on the CPU (all-MiniLM-L6-v2 fine-tuned on P6's task), in every fine-tuning mode:
dpbench's DP-SGD step (``dpsgd``) against the non-private step (``sgd``) of the same mode, with
Opacus 1.6 beside it as a peer, hooks (``opacus-dpsgd``) and fast gradient clipping (ghost
clipping, ``make_private(grad_sample_mode="ghost")``); the memory a DP step adds against what the
non-private step adds; which path the per-sample engine takes in each layer; and mode head's
feature cache (warm-cache steps, the one-off cost per record, the uncached EncoderClassifier).

Model: ``harness.build_model(P7, 0, "cpu", PublicEncoder.load("all-MiniLM-L6-v2"), mode)``, as a run
builds it (mode head: a ``CachedFeatureClassifier``); "head, uncached" is the same classifier as an
``EncoderClassifier`` (the frozen encoder run at every step). Steps are built as
tests/problems/test_problems_encoder.py builds them, ``OPTIMIZERS[name].build(Context(...))``
(sigma = 1, C = 1, the default hyperparameters); Opacus's ghost clipping is driven as
benchmarks/bench_gpu.py drives it (``DPTensorFastGradientClipping`` on the per-sample losses).
Records: ``--batch-size`` (32) real P7 training records per batch (WordPiece rows cut at 128), the
same batches for every configuration, each cut to its longest record once (``cut``) as
``per_sample_loss`` cuts it. dpbench's steps take each batch in P7's groups of similar length
(``Task.groups``), as a run on the CPU does; ``sgd-one-pass`` and ``dpsgd-one-pass`` (in
``--steps-of``) take it in one padded pass, as Opacus does.

Timing: bench_finetune's ``round_robin`` (one untimed step each, then the configurations
alternating step by step over the same batch); medians, ranges, and every ratio as the median
(range) of per-step ratios against the same round's baseline. Mode head's cached models have
every batch's features computed before timing (a warm cache); the one-off cost is timed apart,
per record (each record alone, as the cache computes it). Memory: each (mode, step) in its own
fresh process (``--memory-child``), bench_finetune's ``step_memory``: peak resident set size over
two steps less the resident size before them; the DP step's excess is that over the
non-private step's.

Mode last-block with a prefix store (``--store``): the DP step (``--steps-of``, dpsgd by default)
with the embeddings' and first five blocks' output read from a prefix store made once for the
batches' records (``dpbench.problems.prefix_store``) against the same step computing them, both in
P7's groups, alternating step by step; the store's build time and size.

Usage:  python benchmarks/bench_encoder_step.py [--steps 5] [--batch-size 32] [--threads 2]
        [--modes full,last-block,lora,bias,head] [--memory sgd,dpsgd] [--memory-repeats 3]
        python benchmarks/bench_encoder_step.py --store --steps 20 [--steps-of dpsgd,sgd]
Prints Markdown for benchmarks/results/encoder/speed.md and docs/encoders.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from dpbench.machine import keep_freed_memory
from dpbench.mechanisms.base import PlanRequest
from dpbench.optimizers import OPTIMIZERS
from dpbench.optimizers.base import Context
from dpbench.privacy.clipping import Clipping, NoClipping
from dpbench.privacy.per_sample import Tape
from dpbench.privacy.per_sample_layers import FactorGrads
from dpbench.problems import get_problem, modes
from dpbench.problems.encoder_classification import PublicEncoder
from dpbench.training.harness import build_model

import bench_finetune as _ft  # a sibling script: a script's own folder is first on sys.path

ENCODER = "all-MiniLM-L6-v2"
N_TRAIN = 12_979  # P6's (and P7's) training records: the plan's sample rate
MODES = ("full", "last-block", "lora", "bias", "head")
STEPS = ("sgd", "dpsgd", "opacus-dpsgd", "opacus-ghost")
LABELS = {"sgd": "non-private SGD", "dpsgd": "dpbench DP-SGD", "opacus-dpsgd": "Opacus hooks",
          "opacus-ghost": "Opacus ghost clipping", "sgd-uncached": "non-private SGD, uncached",
          "dpsgd-uncached": "dpbench DP-SGD, uncached", "sgd-one-pass": "non-private SGD, one padded pass",
          "dpsgd-one-pass": "dpbench DP-SGD, one padded pass"}
VARIANTS = ("-uncached", "-one-pass")  # a step's variant: its name's suffix


def variant(name: str) -> str:
    return next((v for v in VARIANTS if name.endswith(v)), "")


def problem_of(start: PublicEncoder):
    return start.bind(get_problem("P7"), None)


def records(start: PublicEncoder, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` real P7 training records (token rows, labels), drawn without replacement."""
    problem = problem_of(start)
    data = problem.load(None)
    pick = np.random.default_rng(seed).choice(len(data.x_train), size=n, replace=False)
    return problem.task.preprocess(data.x_train[pick]), torch.as_tensor(data.y_train[pick], dtype=torch.int64)


def cut(x: torch.Tensor, pad: int, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch cut to its longest record, as ``per_sample_loss`` cuts it, and contiguous: Opacus's
    ghost norms of an Embedding ``view`` the token ids, which fails on the cut's strided view (the
    same family of failure as Opacus issue #841). Cut once here, every configuration gets the
    same tensor and ``per_sample_loss``'s own cut is the identity."""
    width = max(int((x != pad).sum(1).max()), 1)
    return x[:, :width].contiguous(), y


def model_of(start: PublicEncoder, mode: str, cached: bool = True) -> torch.nn.Module:
    """P7's model in ``mode`` as a run builds it; ``cached=False`` in mode head: the same classifier
    (the same head) as a plain EncoderClassifier, its frozen encoder run at every step."""
    problem, m = get_problem("P7"), modes.parse(mode)
    model = build_model(problem, 0, "cpu", start, m)
    if cached or mode != "head":
        return model
    from dpbench.problems.encoder_model import EncoderClassifier

    plain = EncoderClassifier(model.encoder, model.pooling, model.head.out_features, model.pad_id)
    plain.head = model.head
    return plain.train()


def build_step(start: PublicEncoder, mode: str, name: str, L: int, cached: bool = True, grouped: bool = True):
    """(step(x, y), model): step ``name`` (an optimizer of the registry, or ``opacus-ghost``) on
    P7's model in ``mode``; ``grouped``: dpbench's steps run the batch in P7's groups of similar
    length, as a run on the CPU does (``Task.groups``; none in mode head's cached model, whose
    features are computed record by record), else in one padded pass. Opacus takes one pass."""
    problem = problem_of(start)
    model = model_of(start, mode, cached)
    if name == "opacus-ghost":
        return opacus_ghost_step(problem, model, L), model
    spec = OPTIMIZERS[name]
    plan = spec.mechanism.plan(PlanRequest(N_TRAIN, L, 1, hyperparameters=spec.hyperparameters(None),
                                           target_epsilon=8.0, delta=1e-5))
    ctx = Context(model=model, loss_fn=problem.per_sample_loss, lr=1e-5, expected_batch_size=L,
                  noise_multiplier=1.0 if spec.private else 0.0,
                  clipping=Clipping(1.0) if spec.private else NoClipping(),
                  noise=spec.mechanism.noise(plan, 1, "cpu"), steps=plan.steps,
                  hyperparameters=spec.hyperparameters(None),
                  groups=problem.task.groups if grouped and not (cached and mode == "head") else None)
    return spec.build(ctx), model


def opacus_ghost_step(problem, model, L: int):
    """Opacus 1.6's fast gradient clipping (ghost norms) on ``model``'s trained parameters:
    ``make_private(grad_sample_mode="ghost")`` fed batches directly (the loader only gives the
    expected batch size), sigma = 1, C = 1, the per-sample losses ``problem.per_sample_loss``."""
    from opacus import PrivacyEngine
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
    from torch.utils.data import DataLoader, TensorDataset

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-5)
    loader = DataLoader(TensorDataset(torch.zeros(N_TRAIN, 1)), batch_size=L)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, grad_sample_mode="ghost")
    module, optimizer = made[0], made[1]  # (and, in ghost mode, a criterion and the loader)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        losses, _ = problem.per_sample_loss(module, x, y)
        DPTensorFastGradientClipping(module, optimizer, losses, "mean").backward()
        optimizer.step()

    return step


def engine_paths(start: PublicEncoder, mode: str, x: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """Per trained layer of ``mode`` on the batch (x, y): its type and weight shape, the path the
    per-sample engine took for the norms and the clipped sum (read off the layer's cached
    per-sample tensors after them: ``materialised`` present or not), and the per-sample tensors it
    formed (MB)."""
    model, problem = model_of(start, mode), problem_of(start)
    tape = Tape(model)
    with tape:
        losses, _ = problem.per_sample_loss(model, x, y)
    psg = tape.per_sample_gradients(losses)
    psg.weighted_sum(Clipping(1.0).coefficients(psg.norms()))
    rows = []
    for layer in psg.layers:
        held = [v for k, v in layer.__dict__.items() if k in ("materialised", "per_sample", "bias")]
        tensors = [t for v in held for t in (v.values() if isinstance(v, dict) else [v]) if t is not None]
        unique = {id(t): t for t in tensors}.values()
        w = layer.module.weight
        positions = getattr(layer, "_positions", None) if w.requires_grad else None
        if not w.requires_grad:
            path = "weight frozen: bias only"
        elif isinstance(layer, FactorGrads):
            path = "materialised" if "materialised" in layer.__dict__ else "ghost norms"
        else:  # LayerNorm: materialised always (one output row per sample)
            path = "materialised"
        rows.append({"type": type(layer.module).__name__, "shape": tuple(w.shape), "positions": positions,
                     "path": path, "mb": sum(t.numel() * t.element_size() for t in unique) / 2**20})
    return rows


def held(start: PublicEncoder, mode: str, x: torch.Tensor, y: torch.Tensor) -> dict:
    """What the book-keeping DP step holds beyond a non-private backward, in MB, on the batch (x, y):
    the trained layers' inputs ``x`` and output gradients ``gy`` of one group (``Task.groups``, the
    largest such), kept from its backward pass until its per-sample norms are known and its clipped
    sum is added (``DPStep._clip_and_sum_by_pass``), each storage counted once; and the step's two
    gradient buffers (the clipped sum and the noise drawn into its own buffer, ``GradBuffer``:
    2 x d floats, kept between steps)."""
    model, problem = model_of(start, mode), problem_of(start)

    def mb(tensors) -> float:
        unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(unique.values()) / 2**20

    largest = {"x": 0.0, "gy": 0.0}
    for rows in problem.task.groups(x):  # as a run on the CPU takes the batch
        tape = Tape(model)
        with tape:
            losses, _ = problem.per_sample_loss(model, x[rows], y[rows])
        layers = tape.per_sample_gradients(losses).layers
        kept = {"x": mb(layer.x for layer in layers), "gy": mb(layer.gy for layer in layers)}
        if kept["x"] + kept["gy"] > largest["x"] + largest["gy"]:
            largest = kept
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {**largest, "buffers": 2 * d * 4 / 2**20}


def budget_sweep(start: PublicEncoder, batches, budgets: list[int], mode: str, name: str, args) -> str:
    """The step ``name`` in ``mode`` with the batch in P7's groups of at most each of ``budgets``
    tokens and in one padded pass, timed round-robin over ``batches``: the Markdown table that
    chose ``EncoderTextClassification.GROUP_TOKENS``."""
    steps = {}
    for budget in [0, *budgets]:  # 0: one padded pass
        step, _ = build_step(start, mode, name, len(batches[0][0]), grouped=budget > 0)
        if budget:
            task = problem_of(start).task
            task.GROUP_TOKENS = budget  # this instance's budget
            step.ctx.groups = task.groups
        steps[budget] = step
    t = _ft.round_robin(steps, batches)
    lines = [f"# P7's step in groups of similar length: the token budget ({mode}, {name}, L = {len(batches[0][0])})",
             "", f"- command: `{' '.join(['python', 'benchmarks/bench_encoder_step.py', *sys.argv[1:]])}`",
             f"- code: {_commit()}",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; CPU: {_ft._cpu()} "
             f"({os.cpu_count()} cores visible), torch {torch.__version__}, {args.threads} thread(s); load average "
             f"at the start {args.load_at_start}",
             f"- {len(batches) - 1} timed batches of real P7 records after one untimed (widths {args.widths}), the "
             "budgets alternating step by step", "",
             "| tokens a group at most | groups a batch | ms / step, median | range | vs one padded pass |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for budget, v in t.items():
        counts = [len(steps[budget].ctx.groups(x)) if budget else 1 for x, _ in batches[1:]]
        lines.append(f"| {budget or 'one padded pass'} | {_ft._range(counts)} | {_ms(v)} | "
                     f"{_ft._ratio_range([a / b for a, b in zip(v, t[0])])} |")
    return "\n".join(lines)


def store_comparison(start: PublicEncoder, batches, names: list[str], args) -> str:
    """Mode last-block's steps ``names`` with the frozen prefix (embeddings and the first five
    blocks) read from a prefix store (``dpbench.problems.prefix_store``, made here once for the
    batches' records, float32, as a run's) against the same steps computing it, both in P7's groups
    of similar length as a run on the CPU takes them, timed round-robin (A B A B ...) over the same
    batches: the Markdown table of docs/encoders.md's store section."""
    from dpbench.problems.encoder_model import EncoderClassifier
    from dpbench.problems.layout import StepLayout
    from dpbench.problems.prefix_store import build_store, key_for

    mode, L = modes.LastBlock(), len(batches[0][0])
    pad = start.loaded.pad_id
    width = max(x.shape[1] for x, _ in batches)
    rows = torch.full((sum(len(x) for x, _ in batches), width), pad, dtype=torch.int64)
    i = 0
    for x, _ in batches:
        rows[i:i + len(x), :x.shape[1]] = x
        i += len(x)
    rows = rows.numpy()
    steps = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store.npy"
        with torch.random.fork_rng(devices=[]):
            encoder = EncoderClassifier.from_loaded(start.loaded, 1)
        t0 = time.perf_counter()
        info = build_store(path, encoder, rows, pad, key_for(start, rows, mode))
        build_s = time.perf_counter() - t0
        bound = start.bind(get_problem("P7"), mode, StepLayout.choose(mode, "cpu", str(path)))
        for name in names:
            steps[name], _ = build_step(start, "last-block", name, L)
            spec = OPTIMIZERS[name]
            model = build_model(bound, 0, "cpu", start, mode)
            plan = spec.mechanism.plan(PlanRequest(N_TRAIN, L, 1, hyperparameters=spec.hyperparameters(None),
                                                   target_epsilon=8.0, delta=1e-5))
            ctx = Context(model=model, loss_fn=bound.per_sample_loss, lr=1e-5, expected_batch_size=L,
                          noise_multiplier=1.0 if spec.private else 0.0,
                          clipping=Clipping(1.0) if spec.private else NoClipping(),
                          noise=spec.mechanism.noise(plan, 1, "cpu"), steps=plan.steps,
                          hyperparameters=spec.hyperparameters(None), groups=bound.task.groups)
            steps[name + "-store"] = spec.build(ctx)
        t = _ft.round_robin(steps, batches)
    load = os.getloadavg()
    lines = [f"# P7's last-block step with the frozen prefix read from a prefix store (all-MiniLM-L6-v2, L = {L})",
             "", f"- command: `{' '.join(['python', 'benchmarks/bench_encoder_step.py', *sys.argv[1:]])}`",
             f"- code: {_commit()}",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; CPU: {_ft._cpu()} "
             f"({os.cpu_count()} cores visible), torch {torch.__version__}, {args.threads} thread(s); load average "
             f"at the start {args.load_at_start}, at the end {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} (a shared "
             "machine: the ratios, measured round by round on the same batch, are the numbers to read)",
             f"- {len(batches) - 1} timed batches of real P7 training records after one untimed (widths "
             f"{args.widths}); both steps in P7's groups of similar length (at most "
             f"{bound.task.GROUP_TOKENS} tokens a group), the configurations alternating step by step",
             f"- the store of these {info['records']} records: {info['rows']} x {info['hidden']} float32 "
             f"({info['bytes'] / 1e6:.1f} MB, {info['bytes'] / info['tokens']:.0f} bytes per token), built in "
             f"{build_s:.1f} s ({1e3 * build_s / info['records']:.1f} ms per record, each alone)", "",
             "| step | ms / step, median | range | store over computed prefix, median (range) of per-step ratios |",
             "| --- | ---: | ---: | ---: |"]
    for name in names:
        for c in (name, name + "-store"):
            ratio = _ft._ratio_range([b / a for a, b in zip(t[c], t[name])]) if c != name else ""
            label = LABELS[name] + (", prefix from the store" if c != name else ", prefix computed")
            lines.append(f"| {label} | {_ms(t[c])} | {ratio} |")
    lines += ["", "Speed-up: the computed-prefix step's time over the stored-prefix step's, round by round."]
    return "\n".join(lines)


def feature_cost(start: PublicEncoder, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
    """(seconds per record, records): mode head's one-off feature computation, each record alone
    (what ``CachedFeatureClassifier`` does the first time it sees a record)."""
    model = model_of(start, "head")
    t0 = time.perf_counter()
    model.features(x)
    return (time.perf_counter() - t0) / len(model.cache), len(model.cache)


def memory_child(spec: str, batches_file: str) -> None:
    """In a fresh process: JSON {before_kb, peak_kb} around two steps of ``mode,name``."""
    mode, name = spec.split(",")
    batches = torch.load(batches_file)
    start = PublicEncoder.load(ENCODER)
    step, model = build_step(start, mode, name.removesuffix(variant(name)), len(batches[0][0]),
                             cached=variant(name) != "-uncached", grouped=variant(name) != "-one-pass")
    if hasattr(model, "cache"):  # a warm cache, as in the timed steps: its features are counted before
        with torch.no_grad():
            for x, _ in batches:
                model.features(x)
    print(json.dumps(_ft.step_memory(step, batches)))


def _commit() -> str:
    """The checkout's commit, marked where its files differ from it."""
    import subprocess

    def git(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + (" (with uncommitted changes)" if dirty else "")


def _ms(v) -> str:
    return f"{1e3 * statistics.median(v):.0f} | {_ft._range([1e3 * s for s in v])}"


def report(t: dict, params: dict, mem: dict, paths: list[dict], feature: tuple[float, int], args, L: int,
           started: float, kept: dict) -> str:
    load = os.getloadavg()
    lines = [f"# P7's DP step: speed and memory (all-MiniLM-L6-v2, L = {L})", "",
             f"- command: `{' '.join(['python', 'benchmarks/bench_encoder_step.py', *sys.argv[1:]])}`",
             f"- code: {_commit()}",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; CPU: {_ft._cpu()} "
             f"({os.cpu_count()} cores visible), torch {torch.__version__}, {args.threads} thread(s)",
             f"- load average at the start: {args.load_at_start}; at the end: {load[0]:.2f}, {load[1]:.2f}, "
             f"{load[2]:.2f} (a shared machine: absolute times are inflated and noisy; the ratios, measured "
             "round by round on the same batch, are the numbers to read)",
             f"- glibc malloc keeps freed memory (`dpbench train`'s setting, machine.keep_freed_memory): "
             f"{'yes' if args.kept else 'no (--default-malloc)'}",
             f"- records: {L} real P7 training records per batch (WordPiece, cut at 128; each batch cut to its "
             f"longest record: {args.widths}); {args.steps} timed steps per configuration after one untimed, "
             "configurations alternating step by step",
             f"- dpbench's steps take a batch in P7's groups of similar length (`Task.groups`, at most "
             f"{args.group_tokens} tokens a group), as a run on the CPU does, unless marked \"one padded pass\"; "
             f"the first batch's groups (records x tokens): {args.first_groups}. Opacus takes one padded pass, and "
             "its ratios are to dpbench's one-pass steps where those were timed", "",
             "| mode | step | trained / total parameters | ms / step, median | range | vs non-private step of the "
             "mode | vs dpbench DP-SGD |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (mode, name), v in t.items():
        base, dp = t.get((mode, "sgd" + variant(name))), t.get((mode, "dpsgd" + variant(name)))
        if name.startswith("opacus") and (mode, "sgd-one-pass") in t:  # Opacus takes one padded pass
            base, dp = t[(mode, "sgd-one-pass")], t.get((mode, "dpsgd-one-pass"), dp)
        ratio = "" if base is None else _ft._ratio_range([a / b for a, b in zip(v, base)])
        vs_dp = "" if dp is None else _ft._ratio_range([a / b for a, b in zip(v, dp)])
        trained, total = params[(mode, name)]
        lines.append(f"| {mode} | {LABELS[name]} | {trained:,} / {total:,} | {_ms(v)} | {ratio} | {vs_dp} |")
    if ("head", "sgd-uncached") in t:
        saved = _ft._ratio_range([a / b for a, b in zip(t[("head", "sgd-uncached")], t[("head", "sgd")])])
        saved_dp = _ft._ratio_range([a / b for a, b in zip(t[("head", "dpsgd-uncached")], t[("head", "dpsgd")])])
        lines += ["", f"Mode head: the uncached step (the frozen encoder run at every step) over the warm-cache "
                      f"step: non-private {saved}, DP-SGD {saved_dp}. One-off feature cost: "
                      f"{1e3 * feature[0]:.1f} ms per record (each record alone, {feature[1]} records), paid "
                      "once per record over a run."]
    lines += ["", f"Memory of one step ({args.memory_repeats} fresh processes each: peak resident set size over two "
              "steps less the "
              "resident size just before them; VmHWM reset through /proc/self/clear_refs):", "",
              "| mode | step | resident before (MB) | added by the step (MB), median (range) | vs the non-private "
              "step's, median (range) | DP's excess (MB), median | of it, held: layer inputs + output gradients + "
              "step buffers (MB) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    added = {c: [(r["peak_kb"] - r["before_kb"]) / 1024 for r in runs] for c, runs in mem.items()}
    for (mode, name), runs in mem.items():
        base = added.get((mode, "sgd" + variant(name)))
        mine = added[(mode, name)]
        ratio = "" if base is None else _ft._ratio_range([a / statistics.median(base) for a in mine])
        excess = (f"{statistics.median(mine) - statistics.median(base):.0f}"
                  if name.startswith("dpsgd") and base is not None else "")
        h = kept.get(mode) if name == "dpsgd" else None
        parts = "" if h is None else (f"{h['x']:.0f} + {h['gy']:.0f} + {h['buffers']:.0f} = "
                                      f"{h['x'] + h['gy'] + h['buffers']:.0f}")
        before = statistics.median(r["before_kb"] for r in runs) / 1024
        lines.append(f"| {mode} | {LABELS[name]} | {before:.0f} | {statistics.median(mine):.0f} ({min(mine):.0f}-"
                     f"{max(mine):.0f}) | {ratio} | {excess} | {parts} |")
    lines += ["", "Held: a non-private backward frees each layer's input as it passes the layer and never "
              "keeps an output gradient; the book-keeping DP step keeps both for every trained layer of a group "
              "(the largest group's are counted) until the group's norms are known and its clipped sum added (the "
              "layer inputs are the forward's own tensors, kept longer), into two d-sized buffers that live "
              "across steps (the clipped sum, and the noise, which also takes each later group's sum before it is "
              "added)."]
    lines += ["", f"Per-sample engine, mode full, one batch of {L} in one padded pass (its width {args.widths.split(',')[0]}): the "
              "path each trained layer took (the norms and the clipped sum of a DP-SGD step) and the per-sample "
              "tensors it formed:", "",
              "| layer | weight | layers | positions | path | per-sample tensors per layer (MB) |",
              "| --- | --- | ---: | ---: | --- | ---: |"]
    groups: dict = {}
    for r in paths:
        groups.setdefault((r["type"], r["shape"], r["positions"], r["path"]), []).append(r["mb"])
    for (kind, shape, positions, path), mbs in groups.items():
        lines.append(f"| {kind} | {' x '.join(map(str, shape))} | {len(mbs)} | {positions} | {path} | "
                     f"{max(mbs):.2f} |")
    lines += ["", f"All per-sample tensors of mode full together: {sum(r['mb'] for r in paths):.0f} MB "
              f"(L x d = {L} x 22,580,776 floats would be {L * 22_580_776 * 4 / 2**20:.0f} MB).",
              "", f"Wall time of the benchmark: {time.time() - started:.0f} s."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (after one untimed)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps-of", default=",".join(STEPS), help="steps timed in each mode")
    parser.add_argument("--memory", default="sgd,dpsgd", help="steps whose memory is measured in each mode")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc's malloc as it is (a run keeps its freed memory: machine.keep_freed_memory)")
    parser.add_argument("--memory-repeats", type=int, default=3, help="fresh processes per measured (mode, step)")
    parser.add_argument("--group-budgets", default=None,
                        help="only time the first of --steps-of in the first of --modes with the batch in groups of "
                             "at most each of these tokens (comma-separated) against one padded pass")
    parser.add_argument("--store", action="store_true",
                        help="only time mode last-block's --steps-of (dpsgd by default here) with the frozen prefix "
                             "read from a prefix store against computing it")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batches", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    args.kept = False if args.default_malloc else keep_freed_memory()  # as `dpbench train` does
    if args.memory_child:
        memory_child(args.memory_child, args.batches)
        return
    started, L = time.time(), args.batch_size
    args.load_at_start = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    chosen, names = args.modes.split(","), args.steps_of.split(",")
    start = PublicEncoder.load(ENCODER)
    x, y = records(start, L * (args.steps + 1))
    pad = start.loaded.pad_id
    batches = [cut(x[i * L:(i + 1) * L], pad, y[i * L:(i + 1) * L]) for i in range(args.steps + 1)]
    args.widths = ", ".join(str(b.shape[1]) for b, _ in batches)
    if args.group_budgets:
        print(budget_sweep(start, batches, [int(b) for b in args.group_budgets.split(",")], chosen[0], names[0], args))
        return
    if args.store:
        print(store_comparison(start, batches, names if args.steps_of != ",".join(STEPS) else ["dpsgd"], args))
        return
    task = problem_of(start).task
    args.group_tokens = task.GROUP_TOKENS
    first = batches[0][0]
    args.first_groups = ", ".join(f"{len(g)} x {int((first[g] != pad).sum(1).max())}" for g in task.groups(first))
    configs = [(m, n) for m in chosen for n in names]
    if "head" in chosen:
        configs += [("head", n + "-uncached") for n in ("sgd", "dpsgd") if n in names]
    built = {c: build_step(start, c[0], c[1].removesuffix(variant(c[1])), L, cached=variant(c[1]) != "-uncached",
                           grouped=variant(c[1]) != "-one-pass") for c in configs}
    feature = (float("nan"), 0)
    if "head" in chosen:
        feature = feature_cost(start, x, y)
        with torch.no_grad():  # warm caches: the timed steps read every batch's features from them
            for step, model in built.values():
                if hasattr(model, "cache"):
                    model.features(x)
    params = {c: (sum(p.numel() for p in m.parameters() if p.requires_grad), sum(p.numel() for p in m.parameters()))
              for c, (_, m) in built.items()}
    times = _ft.round_robin({c: step for c, (step, _) in built.items()}, batches)
    del built
    mem = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(batches[:2], Path(tmp) / "batches.pt")
        for mode in chosen:
            for name in args.memory.split(",") + (["sgd-uncached", "dpsgd-uncached"] if mode == "head" else []):
                mem[(mode, name)] = [_ft.in_fresh_process(__file__, [
                    "--memory-child", f"{mode},{name}", "--batches", str(Path(tmp) / "batches.pt"),
                    "--threads", str(args.threads), *(["--default-malloc"] if args.default_malloc else [])])
                    for _ in range(args.memory_repeats)]
    paths = engine_paths(start, "full", *batches[0])
    kept = {mode: held(start, mode, *batches[0]) for mode in chosen if mode != "head"}
    print(report(times, params, mem, paths, feature, args, L, started, kept))


if __name__ == "__main__":
    main()
