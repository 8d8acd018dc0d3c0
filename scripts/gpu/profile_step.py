"""Where a DP step's GPU time goes: torch.profiler tables and per-stage timings of dpbench's
dpsgd step (and variants of the per-sample path) on fixed batches. Writes to $OUT."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

from dpbench.training import cuda as dpcuda
from dpbench.privacy.per_sample import LayerGrads

# benchmarks/bench_gpu.py, imported by its file (benchmarks/ is not a package)
_spec = importlib.util.spec_from_file_location("bench_gpu", Path(__file__).resolve().parents[2] / "benchmarks" /
                                               "bench_gpu.py")
B = sys.modules["bench_gpu"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)

OUT = Path(os.environ.get("OUT", "/tmp/profile-out"))
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if dev.type == "cuda":
    print(dpcuda.configure(), flush=True)  # as the harness runs on CUDA: no TF32, deterministic kernels


@contextlib.contextmanager
def patched(name, value):
    original = LayerGrads.__dict__[name]
    setattr(LayerGrads, name, value)
    try:
        yield
    finally:
        setattr(LayerGrads, name, original)


def always_ghost():
    return patched("use_ghost", property(lambda self: True))


def never_ghost():
    return patched("use_ghost", property(lambda self: False))


VARIANTS = {
    "current": contextlib.nullcontext,
    "ghost-all": always_ghost,
    "materialise-all": never_ghost,
    "unfold-bmm": B.unfold_materialised,
    "unfold-bmm-materialise-all": lambda: contextlib.ExitStack(),
}


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_step(step, x, y, n=20):
    for _ in range(3):
        step(x, y)
    sync()
    t = time.perf_counter()
    for _ in range(n):
        step(x, y)
    sync()
    return (time.perf_counter() - t) / n


results = {}
lines = []
CASES = [("P1", 2048), ("P2", 1024), ("P1", 256), ("P3", 1024)] if dev.type == "cuda" else [("P2", 64)]
for problem, L in CASES:
    x, y = B.synthetic_data(problem, L, dev)
    sgd, _ = B.our_step(problem, "sgd", L, dev, 100)
    base = time_step(sgd, x, y)
    row = {"sgd_ms": base * 1e3}
    for name, ctx in VARIANTS.items():
        step, _ = B.our_step(problem, "dpsgd", L, dev, 100)
        with ctx():
            if name == "unfold-bmm-materialise-all":
                with B.unfold_materialised(), never_ghost():
                    t = time_step(step, x, y)
            else:
                t = time_step(step, x, y)
        row[name + "_ms"] = t * 1e3
    results[f"{problem} L={L}"] = row
    lines.append(f"{problem} L={L}: " + ", ".join(f"{k}={v:.2f}" for k, v in row.items()))
    print(lines[-1], flush=True)
    # per-layer decision of the current rule
    step, model = B.our_step(problem, "dpsgd", L, dev, 100)
    if (problem in ("P1", "P2") and L >= 1024) or dev.type == "cpu":
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        for _ in range(3):
            step(x, y)
        sync()
        with profile(activities=acts) as prof:
            for _ in range(5):
                step(x, y)
            sync()
        key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=25)
        (OUT / f"profile-{problem}-{L}.txt").write_text(table)
        print(table[:6000], flush=True)
(OUT / "profile.json").write_text(json.dumps(results, indent=1))
(OUT / "profile.md").write_text("\n".join(lines) + "\n")
