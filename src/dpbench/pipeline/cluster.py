"""What a job asks a cluster for: memory, wall time, GPU and CPUs of one training cell, from its
problem, batch size, epochs and optimizer alone (pure functions, no Snakemake; torch only through
the optimizer registry, read for each optimizer's cost class).

The numbers are a deliberately conservative cost model, not a measurement of each run:

* the problem's sizes and cost constants come from its facts (``dpbench.problems.catalog``);
* steps T = round(E·N/L) (as ``dpbench train``), capped by ``max_steps``; N is the run's own
  (``ProblemFacts.n_train``: ``train_subset``, ``validation_size`` and planted canaries
  included), the test set capped by ``test_subset``; each of these the cell's own where its
  grid block sets it (``cell_train``: a cell's ``train_settings`` over the config's ``train``);
* time per step on a GPU (the profile decides GPU or CPU, see workflow/rules/common.smk) comes
  from ``GpuCosts``: the measured seconds per step of the problem and the optimizer's cost class
  (``OptimizerSpec.cost_class``) at the measured batch sizes, interpolated linearly in L (below
  the smallest measured L: that step's time; above the largest: its time per example), read from
  ``gpu_costs.json`` next to this module (written by ``benchmarks/bench_gpu.py costs`` on a GPU,
  see docs/gpu.md); without that file, or for a problem or cost class it does not hold, the
  assumed ``STEP_OVERHEAD_S`` + L x the problem's ``gpu_s_per_example``. On the CPU:
  ``STEP_OVERHEAD_S`` + L x its ``cpu_s_per_example`` (where those numbers come from: the
  catalog); plus one test pass per epoch;
* matrix mechanisms (optimizers named ``dpmatrix*``) read one d-vector of precomputed
  correlated noise per step from a memory-mapped file (``dpbench.matrix``), which costs
  neither memory nor time worth modelling; their factorization and noise files are made by
  CPU jobs (``factorization_resources``);
* a run that shares its GPU with others (``cells_per_gpu`` = K processes at a time, the
  profile's ``gpu_slots``) takes K / gain(K) times as long, gain(K) the measured aggregate
  throughput of K processes over one (``GpuCosts.gain``);
* runtime = 1.5 x that estimate + ``STARTUP_MIN`` (interpreter, CUDA, data, sigma calibration),
  rounded up to 5 minutes; memory = 1.5 x (``BASE_MB`` + the datasets as uint8 and float32
  tensors), rounded up to 1000 MB;
* a retry (Snakemake's ``attempt``, 1-based) multiplies both by the attempt number.

``resources(cell, train, attempt, on_gpu, cells_per_gpu=K)`` is meant for ``rule train``'s
resource callables, ``bundle(cell, train, on_gpu)`` for its ``group:`` (runs of similar length
share one SLURM job and its GPU, see workflow/profiles/slurm),
``factorization_resources(steps)`` for the matrix rules, and
``gpu_hours(cells, train, cells_per_gpu)`` (``dpbench cost``) projects what a grid costs on
GPUs, one cell per GPU or several (the measured throughput gain of K processes sharing a GPU).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpbench.problems import facts

STEP_OVERHEAD_S = 0.010  # sampling, clipping, noise, optimizer, kernel launches
EVAL_FRACTION = 1 / 3  # a test example costs about a third of a training example (forward only)

BASE_MB = 3000  # python, torch, CUDA context on the host
STARTUP_MIN = 10
SAFETY = 1.5
SHORT_RUN_MIN = 5  # estimated compute below this: bundle with other short runs
SHORT_GROUP = "train_short"
LONG_GROUP = "train_long"
COSTS_FILE = Path(__file__).with_name("gpu_costs.json")
# The math libraries' threads pinned to a job's threads: the prefix of the shell command of every
# rule that computes with them outside `dpbench train --threads` (factorize, noise, pretrain).
BLAS_THREADS = "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads} "
ASSUMED_STARTUP_S = 60.0  # interpreter, CUDA context, data, sigma calibration of one job (assumed)


def cost_class(optimizer: str) -> str | None:
    """The measured step whose cost stands for ``optimizer``'s: its spec's ``cost_class`` (the
    non-private step for sgd and adam, one Adam variant for all DP-Adam variants, one matrix
    mechanism for all, their steps differing only in the factorization behind the noise rows;
    None for the projected optimizers, a d x p projection per step, not measured, and for a
    plugin's optimizer unless its spec names a class: the assumed, conservative cost)."""
    from dpbench.pipeline import catalog  # torch-free for the built-ins (a plugin's: its spec)

    return catalog.optimizer(optimizer).cost_class


def _interpolate(table: Mapping[int, float], batch_size: int) -> float:
    """Seconds per step at L from measured (L, seconds): linear between measured sizes, the
    smallest size's time below them, the largest size's time per example above them."""
    sizes = sorted(table)
    if batch_size <= sizes[0]:
        return table[sizes[0]]
    if batch_size >= sizes[-1]:
        return table[sizes[-1]] * batch_size / sizes[-1]
    hi = next(i for i, size in enumerate(sizes) if size >= batch_size)
    a, b = sizes[hi - 1], sizes[hi]
    return table[a] + (table[b] - table[a]) * (batch_size - a) / (b - a)


@dataclass(frozen=True)
class GpuCosts:
    """Measured GPU costs (``from_file``) or the assumed ones (``ASSUMED``): seconds per step
    by problem, cost class and batch size, seconds per evaluated test example, start-up
    seconds of one job, and the aggregate-throughput gain of K processes sharing one GPU."""

    source: str
    step_seconds: Mapping[str, Mapping[str, Mapping[int, float]]] = field(default_factory=dict)
    eval_seconds_per_example: Mapping[str, float] = field(default_factory=dict)
    startup_seconds: float = ASSUMED_STARTUP_S
    concurrency_gain: Mapping[str, Mapping[int, Mapping[int, float]]] = field(default_factory=dict)  # problem, L, K

    @classmethod
    def from_file(cls, path: str | Path) -> "GpuCosts":
        raw = json.loads(Path(path).read_text())
        try:
            return cls(
                source=f"measured on {raw['device']} ({Path(path).name})",
                step_seconds={p: {m: {int(L): float(s) for L, s in by_l.items()} for m, by_l in by_m.items()}
                              for p, by_m in raw["step_seconds"].items()},
                eval_seconds_per_example={p: float(s) for p, s in raw["eval_seconds_per_example"].items()},
                startup_seconds=float(raw.get("startup_seconds") or ASSUMED_STARTUP_S),
                concurrency_gain={p: {int(L): {int(k): float(g) for k, g in by_k.items()} for L, by_k in by_l.items()}
                                  for p, by_l in raw.get("concurrency_gain", {}).items()})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a GPU cost file of benchmarks/bench_gpu.py costs ({e!r})") from None

    def step(self, problem: str, optimizer: str, batch_size: int) -> float:
        table = self.step_seconds.get(problem, {}).get(cost_class(optimizer) or "")
        if not table:
            return STEP_OVERHEAD_S + batch_size * facts(problem).gpu_s_per_example
        return _interpolate(table, batch_size)

    def eval_per_example(self, problem: str) -> float:
        return self.eval_seconds_per_example.get(problem, facts(problem).gpu_s_per_example * EVAL_FRACTION)

    def gain(self, problem: str, batch_size: int, cells_per_gpu: int) -> float:
        """Aggregate throughput of K processes on one GPU over one process's, measured for the
        problem at the measured batch size nearest to L (by ratio; between two equally near,
        the smaller gain) and the largest measured K <= cells_per_gpu; for an unmeasured
        problem the smallest such gain of any problem; 1 without measurements (no gain is
        claimed that was not measured)."""
        def at(by_l: Mapping[int, Mapping[int, float]]) -> float:
            def largest_k(by_k: Mapping[int, float]) -> float:
                ks = [k for k in by_k if k <= cells_per_gpu]
                return by_k[max(ks)] if ks else 1.0

            distance = {size: round(abs(math.log(size / batch_size)), 9) for size in by_l}
            nearest = [size for size in by_l if distance[size] == min(distance.values())]
            return min(largest_k(by_l[size]) for size in nearest)

        if cells_per_gpu <= 1 or not self.concurrency_gain:
            return 1.0
        if problem in self.concurrency_gain:
            return at(self.concurrency_gain[problem])
        return min(map(at, self.concurrency_gain.values()))


ASSUMED = GpuCosts(source="assumed (no measurement)")


def default_costs() -> GpuCosts:
    """The measured costs of ``gpu_costs.json`` next to this module, else ``ASSUMED``."""
    return GpuCosts.from_file(COSTS_FILE) if COSTS_FILE.exists() else ASSUMED


COSTS = default_costs()


def _get(cell: Any, key: str, default=None):
    if isinstance(cell, Mapping):
        return cell.get(key, default)
    return getattr(cell, key, default)


def _round_up(x: float, step: int) -> int:
    return int(step * math.ceil(x / step))


def cell_train(cell: Any, train: Mapping | None = None) -> dict:
    """The config's ``train`` section as a cell's run has it: the cell's ``train_settings`` (its
    grid block's own ``max_steps``, subsets, validation split: ``grid.Cell``; a mapping's key
    of that name, pairs or a dict) over it."""
    return {**(train or {}), **dict(_get(cell, "train_settings") or ())}


def train_size(problem: str, train: Mapping | None = None) -> int:
    """N, as the run counts it (``ProblemFacts.n_train``) under the config's ``train`` section."""
    train = train or {}
    return facts(problem).n_train(train.get("train_subset"), train.get("validation_size") or 0)


def planned_steps(problem: str, batch_size: int, epochs: int, train: Mapping | None = None) -> int:
    """T = round(E·N/L), with N the run's (``train_size``) and T capped by max_steps."""
    train = train or {}
    n = train_size(problem, train)
    steps = max(1, round(epochs * n / batch_size))
    return min(steps, train["max_steps"]) if train.get("max_steps") else steps


def compute_seconds(cell: Any, train: Mapping | None = None, on_gpu: bool = True,
                    costs: GpuCosts | None = None) -> float:
    """Estimated seconds of training and evaluation of a cell on a GPU or on the CPU (no
    start-up, no safety factor); on a GPU from ``costs`` (default: the measured ones if
    committed, see ``GpuCosts``)."""
    train, costs = cell_train(cell, train), costs or COSTS
    problem, batch_size, epochs = _get(cell, "problem"), int(_get(cell, "batch_size")), int(_get(cell, "epochs"))
    steps = planned_steps(problem, batch_size, epochs, train)
    n_train = train_size(problem, train)
    evals = min(epochs, math.ceil(steps * batch_size / n_train))  # one test pass per epoch reached
    n_test = min(facts(problem).test_size, train.get("test_subset") or facts(problem).test_size)
    if not on_gpu:
        per_example = facts(problem).cpu_s_per_example
        return steps * (STEP_OVERHEAD_S + batch_size * per_example) + evals * n_test * per_example * EVAL_FRACTION
    step = costs.step(problem, _get(cell, "optimizer"), batch_size)
    return steps * step + evals * n_test * costs.eval_per_example(problem)


def memory_mb(cell: Any, train: Mapping | None = None) -> float:
    """Estimated peak host memory (MB) of a cell, before the safety factor."""
    train = cell_train(cell, train)
    problem = _get(cell, "problem")
    n_train, f = train_size(problem, train), facts(problem)
    # the full files (and planted canaries) as uint8, the (sub)set used as float32
    data = (f.n_train() + f.test_size + 4 * (n_train + f.test_size)) * f.features
    return BASE_MB + data / 1e6


def slowdown(cell: Any, on_gpu: bool = True, cells_per_gpu: int = 1, costs: GpuCosts | None = None) -> float:
    """How much longer a run takes while ``cells_per_gpu`` runs share its GPU: K / gain(K) (1
    on the CPU, where each run has its own cores, and for K = 1)."""
    if not on_gpu or cells_per_gpu <= 1:
        return 1.0
    costs = costs or COSTS
    return cells_per_gpu / costs.gain(_get(cell, "problem"), int(_get(cell, "batch_size")), cells_per_gpu)


def resources(cell: Any, train: Mapping | None = None, attempt: int = 1, on_gpu: bool = True,
              costs: GpuCosts | None = None, cells_per_gpu: int = 1) -> dict[str, int]:
    """Cluster resources of one training cell (a ``dpbench.pipeline.grid.Cell`` or a mapping with
    problem, optimizer, batch_size, epochs) under the config's ``train`` section, on a GPU or
    on the CPU: ``mem_mb`` and ``runtime`` (minutes), the latter for a run that shares its GPU
    with ``cells_per_gpu`` - 1 others (``slowdown``). The GPU request itself and the CPUs are
    the profile's (``set-resources: train: gpu``, ``set-threads: train``)."""
    train = train or {}
    seconds = compute_seconds(cell, train, on_gpu, costs) * slowdown(cell, on_gpu, cells_per_gpu, costs)
    runtime = _round_up((SAFETY * seconds / 60 + STARTUP_MIN) * attempt, 5)
    mem_mb = _round_up(SAFETY * memory_mb(cell, train) * attempt, 1000)
    return {"mem_mb": mem_mb, "runtime": runtime}


def bundle(cell: Any, train: Mapping | None = None, on_gpu: bool = True, costs: GpuCosts | None = None) -> str:
    """The group of a training run: ``SHORT_GROUP`` for a cell whose estimated compute is under
    ``SHORT_RUN_MIN`` minutes, else ``LONG_GROUP``. The SLURM profile packs
    ``group-components`` of a group into one job that shares one GPU between ``gpu_slots``
    runs at a time; two groups keep runs of similar length together (a job lasts as long as
    its longest round). Local runs ignore groups."""
    return SHORT_GROUP if compute_seconds(cell, train, on_gpu, costs) < 60 * SHORT_RUN_MIN else LONG_GROUP


def gpu_hours(cells: Iterable[Any], train: Mapping | None = None, cells_per_gpu: int = 1,
              costs: GpuCosts | None = None) -> float:
    """Projected GPU-hours of training the cells: per cell its compute plus one job's start-up,
    divided by the measured throughput gain when ``cells_per_gpu`` cells share each GPU."""
    costs = costs or COSTS
    total = 0.0
    for cell in cells:
        seconds = compute_seconds(cell, train, True, costs) + costs.startup_seconds
        total += seconds / costs.gain(_get(cell, "problem"), int(_get(cell, "batch_size")), cells_per_gpu)
    return total / 3600


def factorization_resources(steps: int, attempt: int = 1) -> dict[str, int]:
    """CPU job that factorises a T x T workload (fixed-point or dual solver): a dozen dense
    float64 T x T matrices in memory; 200 iterations of O(2T³) flops at 20 GFLOP/s."""
    mem_mb = _round_up(SAFETY * (2000 + 16 * steps * steps * 8 / 1e6) * attempt, 1000)
    seconds = 200 * 2 * steps ** 3 / 20e9
    runtime = _round_up((SAFETY * seconds / 60 + STARTUP_MIN) * attempt, 5)
    return {"mem_mb": mem_mb, "runtime": runtime, "cpus_per_task": 4}
