"""What a job asks a cluster for: memory, wall time, GPU and CPUs of one training cell, from its
problem, batch size, epochs and optimizer alone (pure functions, no torch, no Snakemake).

The numbers are a deliberately conservative cost model, not a measurement of each run:

* steps T = round(E·N/L) (as ``dpbench train``), capped by ``max_steps``; N is capped by
  ``train_subset``, the test set by ``test_subset``;
* time per step = ``STEP_OVERHEAD_S`` + L x per-example cost of the problem (``GPU_S_PER_EXAMPLE``
  on a GPU, ``CPU_S_PER_EXAMPLE`` on the CPU; the profile decides, see workflow/rules/common.smk),
  plus one test pass per epoch;
  the GPU costs are 2-4x what a DP step of these small models takes on a current data-centre GPU
  (P2, L = 256: 17.7 ms assumed), the CPU costs are the measured 2-thread P2 step of the README
  (74.7 ms at L = 256, i.e. 0.29 ms per example) with P1 and P3 scaled by their FLOPs;
* matrix mechanisms (optimizers named ``dpmatrix*``) read one d-vector of precomputed
  correlated noise per step from a memory-mapped file (``dpbench.matrix``), which costs
  neither memory nor time worth modelling; their factorization and noise files are made by
  CPU jobs (``factorization_resources``);
* runtime = 1.5 x that estimate + ``STARTUP_MIN`` (interpreter, CUDA, data, sigma calibration),
  rounded up to 5 minutes; memory = 1.5 x (``BASE_MB`` + the datasets as uint8 and float32
  tensors), rounded up to 1000 MB;
* a retry (Snakemake's ``attempt``, 1-based) multiplies both by the attempt number.

``resources(cell, train, attempt, on_gpu)`` is meant for ``rule train``'s resource callables,
``bundle(cell, train, on_gpu)`` for its ``group:`` (short runs share one SLURM job, see
workflow/profiles/slurm), ``factorization_resources(steps)`` for the matrix rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

N_TRAIN = {"P1": 50_000, "P2": 60_000, "P3": 60_000}
N_TEST = {"P1": 10_000, "P2": 10_000, "P3": 10_000}
FEATURES = {"P1": 3 * 32 * 32, "P2": 28 * 28, "P3": 28 * 28}

STEP_OVERHEAD_S = 0.010  # sampling, clipping, noise, optimizer, kernel launches
GPU_S_PER_EXAMPLE = {"P1": 40e-6, "P2": 30e-6, "P3": 120e-6}  # forward + per-sample backward
CPU_S_PER_EXAMPLE = {"P1": 0.45e-3, "P2": 0.29e-3, "P3": 1.2e-3}
EVAL_FRACTION = 1 / 3  # a test example costs about a third of a training example (forward only)

BASE_MB = 3000  # python, torch, CUDA context on the host
STARTUP_MIN = 10
SAFETY = 1.5
SHORT_RUN_MIN = 5  # estimated compute below this: bundle with other short runs
SHORT_GROUP = "train_short"


def _get(cell: Any, key: str, default=None):
    if isinstance(cell, Mapping):
        return cell.get(key, default)
    return getattr(cell, key, default)


def _round_up(x: float, step: int) -> int:
    return int(step * math.ceil(x / step))


def train_size(problem: str, train: Mapping | None = None) -> int:
    """N: the problem's training set, capped by the config's train_subset."""
    train = train or {}
    return min(N_TRAIN[problem], train.get("train_subset") or N_TRAIN[problem])


def planned_steps(problem: str, batch_size: int, epochs: int, train: Mapping | None = None) -> int:
    """T = round(E·N/L), with N capped by train_subset and T by max_steps."""
    train = train or {}
    n = train_size(problem, train)
    steps = max(1, round(epochs * n / batch_size))
    return min(steps, train["max_steps"]) if train.get("max_steps") else steps


def compute_seconds(cell: Any, train: Mapping | None = None, on_gpu: bool = True) -> float:
    """Estimated seconds of training and evaluation of a cell on a GPU or on the CPU (no
    start-up, no safety factor)."""
    train = train or {}
    problem, batch_size, epochs = _get(cell, "problem"), int(_get(cell, "batch_size")), int(_get(cell, "epochs"))
    per_example = (GPU_S_PER_EXAMPLE if on_gpu else CPU_S_PER_EXAMPLE)[problem]
    steps = planned_steps(problem, batch_size, epochs, train)
    n_train = train_size(problem, train)
    evals = min(epochs, math.ceil(steps * batch_size / n_train))  # one test pass per epoch reached
    n_test = min(N_TEST[problem], train.get("test_subset") or N_TEST[problem])
    seconds = steps * (STEP_OVERHEAD_S + batch_size * per_example) + evals * n_test * per_example * EVAL_FRACTION
    return seconds


def memory_mb(cell: Any, train: Mapping | None = None) -> float:
    """Estimated peak host memory (MB) of a cell, before the safety factor."""
    train = train or {}
    problem = _get(cell, "problem")
    n_train = train_size(problem, train)
    # the full files as uint8, the (sub)set used as float32
    data = (N_TRAIN[problem] + N_TEST[problem] + 4 * (n_train + N_TEST[problem])) * FEATURES[problem]
    return BASE_MB + data / 1e6


def resources(cell: Any, train: Mapping | None = None, attempt: int = 1, on_gpu: bool = True) -> dict[str, int]:
    """Cluster resources of one training cell (a ``dpbench.grid.Cell`` or a mapping with
    problem, optimizer, batch_size, epochs) under the config's ``train`` section, on a GPU or
    on the CPU: ``mem_mb`` and ``runtime`` (minutes). The GPU request itself and the CPUs are
    the profile's (``set-resources: train: gpu``, ``set-threads: train``)."""
    train = train or {}
    runtime = _round_up((SAFETY * compute_seconds(cell, train, on_gpu) / 60 + STARTUP_MIN) * attempt, 5)
    mem_mb = _round_up(SAFETY * memory_mb(cell, train) * attempt, 1000)
    return {"mem_mb": mem_mb, "runtime": runtime}


def bundle(cell: Any, train: Mapping | None = None, on_gpu: bool = True) -> str | None:
    """``SHORT_GROUP`` for a cell whose estimated compute is under ``SHORT_RUN_MIN`` minutes
    (Snakemake then packs ``group-components`` of them into one SLURM job), else None."""
    return SHORT_GROUP if compute_seconds(cell, train, on_gpu) < 60 * SHORT_RUN_MIN else None


def factorization_resources(steps: int, attempt: int = 1) -> dict[str, int]:
    """CPU job that factorises a T x T workload (fixed-point or dual solver): a dozen dense
    float64 T x T matrices in memory; 200 iterations of O(2T³) flops at 20 GFLOP/s."""
    mem_mb = _round_up(SAFETY * (2000 + 16 * steps * steps * 8 / 1e6) * attempt, 1000)
    seconds = 200 * 2 * steps ** 3 / 20e9
    runtime = _round_up((SAFETY * seconds / 60 + STARTUP_MIN) * attempt, 5)
    return {"mem_mb": mem_mb, "runtime": runtime, "cpus_per_task": 4}
