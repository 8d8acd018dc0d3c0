"""The golden runs: every registered optimizer on P2 and P4, a few steps at a fixed seed, and
one audit per mechanism family, reduced to what a run promises and delivers (metrics, sigma,
target and achieved epsilon, canary exposures, audit bounds). Recorded once before the package
was restructured (tests/golden/runs.json, at commit df9e1e6); tests/repo/test_golden.py recomputes
them and asserts they are bit-identical on the platform that recorded them, and equal within
each field's tolerance elsewhere. The platform (``dpbench.machine``: CPU, instruction sets,
kernels, library versions) is written beside them, tests/golden/platform.json; the recording of
df9e1e6 predates it and names none (its note says what is known).

Record anew (only when a change of numbers is intended, and say why in the commit):
    .venv/bin/python tests/golden_runs.py
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

GOLDEN = Path(__file__).resolve().parent / "golden" / "runs.json"
PLATFORM = GOLDEN.with_name("platform.json")
NUMERIC_PACKAGES = ("torch", "numpy", "scipy", "opacus", "dp-accounting")

# P4 on generated quotations in the official format (the real corpus's canary space is too large
# for exact exposure in a test): conftest.plant_generated_corpus, as tests/problems/test_lm.py
AUDITED = ("dpsgd", "d2psgd", "dp2sgd", "dpmatrix-se", "dpmatrix-band", "dpmatrix-band-amp", "dpmatrix-blt", "dpdice-strict")


@contextlib.contextmanager
def generated_corpus():
    from conftest import plant_generated_corpus

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        plant_generated_corpus(Path(tmp), patch)
        yield tmp


def _exact(value, cache_dir: str):
    """Floats as their shortest exact repr (JSON keeps them; NaN and inf as strings); durations
    dropped and the temporary cache's path replaced by <cache>: neither is a behaviour."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return value.replace(cache_dir, "<cache>")
    if isinstance(value, dict):
        return {k: _exact(v, cache_dir) for k, v in value.items()
                if not (k in ("seconds", "time_s") or k.endswith("_time_s"))}
    if isinstance(value, (list, tuple)):
        return [_exact(v, cache_dir) for v in value]
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return _exact(value.item(), cache_dir)
    return value


def run_summary(meta: dict, metrics, cache_dir: str) -> dict:
    """What must not move: the privacy record (calibration time aside), the results, every
    metric row, the canaries' exposures, the run's seeds."""
    out = {"privacy": meta["privacy"], "result": meta["result"], "data": {k: v for k, v in meta["data"].items() if k != "source"},
           "optimizer_stats": meta["optimizer"].get("stats"), "seeds": meta["environment"]["seeds"],
           "metrics": metrics.to_dict(orient="list")}
    if "memorisation" in meta:
        out["memorisation"] = meta["memorisation"]
    return _exact(out, cache_dir)


def training_runs(cache_dir: str, data_dirs: dict[str, str | None]):
    """(key, summary) of every registered optimizer on P2 and P4."""
    from dpbench.optimizers import OPTIMIZERS
    from dpbench.training.train import RunConfig, run

    for problem in ("P2", "P4"):
        for name, spec in sorted(OPTIMIZERS.items()):
            cfg = RunConfig(problem=problem, optimizer=name, lr=1e-3 if "adam" in name else 0.5, batch_size=16,
                            epochs=1, seed=0, epsilon=10.0 if spec.private else None,
                            data_dir=data_dirs[problem], train_subset=64 if problem == "P2" else 40,
                            test_subset=32 if problem == "P2" else 8, validation_size=16 if problem == "P2" else 8,
                            max_steps=3, cache_dir=cache_dir, progress_every_s=1e9)
            res = run(cfg, spec)
            yield f"{problem}/{name}", run_summary(res.meta, res.metrics, cache_dir)


def audits(cache_dir: str):
    """(key, summary) of one audit per mechanism family, few trials (the bounds are weak; what
    is checked is that the same trials give the same scores and bounds)."""
    from dpbench.audit.run import audit
    from dpbench.optimizers import get_optimizer

    for name in AUDITED:
        rows, record = audit(get_optimizer(name), 4.0, trials=64, seed=0, cache_dir=cache_dir)
        scores = hashlib.sha256(np.ascontiguousarray(rows["score"].to_numpy(np.float64)).tobytes()).hexdigest()
        keep = ("epsilon_lower", "violation", "epsilon_gdp", "mu_lower", "canary_norm", "family", "claim",
                "max_certifiable_epsilon", "checks", "n_in", "n_out")
        yield f"audit/{name}", _exact({"scores_sha256": scores, **{k: record[k] for k in keep}}, cache_dir)


def compute(fmnist_dir: str | None) -> dict:
    """The golden runs, computed in this process (one torch thread; see ``compute_isolated``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as cache, generated_corpus() as corpus:
            out = dict(training_runs(cache, {"P2": fmnist_dir, "P4": corpus}))
            out.update(audits(cache))
        return out
    finally:
        torch.set_num_threads(threads)


# Every numeric library's threads, fixed before it loads: with two BLAS threads a product is summed
# in another order, and a numerically solved factorization (the SE strategy's sensitivity) moves in
# its last digits on the same platform (0.9999999999999998 recorded, ...94 with two threads, ...97
# with threadpoolctl's limit set after the libraries loaded).
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def compute_isolated(fmnist_dir: str | None) -> dict:
    """``compute`` in a fresh interpreter whose libraries load with one thread each (``ONE_THREAD``;
    the rest of the environment, e.g. forced instruction sets, passes through), as the golden runs
    are recorded (``python tests/golden_runs.py``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        code = ("import json, sys; import golden_runs; "
                "json.dump(golden_runs.compute(sys.argv[1] or None), open(sys.argv[2], 'w'), sort_keys=True)")
        env = {**os.environ, **ONE_THREAD,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-c", code, fmnist_dir or "", str(out)], env=env, check=True,
                       capture_output=True, text=True, timeout=1200)
        return json.loads(out.read_text())


def platform() -> dict:
    """The platform this process computes on (``dpbench.machine.platform_record``, after the
    libraries the golden runs use are loaded) and the versions of the packages that compute."""
    from importlib import metadata

    import scipy.linalg  # noqa: F401  (loads SciPy's OpenBLAS, which the factorizations use)

    from dpbench.machine import platform_record

    return {"platform": platform_record(), "packages": {p: metadata.version(p) for p in NUMERIC_PACKAGES}}


def describe(record: dict) -> str:
    """One line naming a platform (a ``platform()`` record)."""
    p = record["platform"]
    cpu, torch_ = p["cpu"], p["torch"] or {}
    isa = ("AVX-512" if any(f.startswith("avx512") for f in p["isa"]) else "AVX2" if "avx2" in p["isa"]
           else "no AVX2")
    pins = " ".join(f"{k}={v}" for k, v in p["pins"].items()) or "none"
    return (f"{cpu['model_name']} (vendor {cpu['vendor']}, family {cpu['family']}, model {cpu['model']}) with {isa}, "
            f"torch {torch_.get('cpu_capability')} kernels, NumPy SIMD {'/'.join(p['numpy_simd']['found'] or [])}, "
            f"OpenBLAS {'/'.join(sorted(set(p['openblas'].values()))) or 'none loaded'}, pins {pins}")


if __name__ == "__main__":
    from conftest import _fmnist_dir

    d = _fmnist_dir()
    if d is None:
        sys.exit("golden runs need the real Fashion-MNIST files (apt-get install dataset-fashion-mnist)")
    runs = compute_isolated(str(d))
    GOLDEN.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")
    PLATFORM.write_text(json.dumps(platform(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}: {len(runs)} runs", file=sys.stderr)
