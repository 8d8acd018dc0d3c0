"""Matrix mechanisms: factorization time and quality, noise-file throughput and memory, and
the expected error each mechanism adds to the prefix sums, against DP-SGD. Prints Markdown.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/bench_matrix.py --out-dir /tmp/dpbench-bench

Sizes (thesis Setups 2 and 3, b = N // L, T = E b):
  Setup 2, P2 (N = 60000, E = 1): L = 32 -> T = 1875 (se, se-lambda); L = 64 -> T = 937
  Setup 3, P1 (N = 50000, E = 30): L = 1024 -> b = 48, L = 2048 -> b = 24 (me, me-lambda)
  Setup 3, P3 (N = 60000, E = 30): L = 1024 -> b = 58, L = 2048 -> b = 29

Noise files (d = 225,034 P2, 258,762 P1, 1,875,265 P3) are written under --out-dir by the
``dpbench noise`` command in a child process (its own peak RSS), then deleted; --noise-max-gb
truncates d for files larger than that (the table says so).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FACTORIZATIONS = [  # (setup, problem, L, key)
    ("2", "P2", 32, "se-k1-b1875"),
    ("2", "P2", 32, "se-lambda-k1-b1875-tau1875"),
    ("2", "P2", 64, "se-k1-b937"),
    ("2", "P2", 64, "se-lambda-k1-b937-tau937"),
    ("3", "P1", 1024, "me-k30-b48"),
    ("3", "P1", 1024, "me-lambda-k30-b48-tau1440"),
    ("3", "P1", 2048, "me-k30-b24"),
    ("3", "P1", 2048, "me-lambda-k30-b24-tau720"),
    ("3", "P3", 1024, "me-k30-b58"),
    ("3", "P3", 1024, "me-lambda-k30-b58-tau1740"),
    ("3", "P3", 2048, "me-k30-b29"),
    ("3", "P3", 2048, "me-lambda-k30-b29-tau870"),
]
NOISE = [("P2", "se-k1-b1875"), ("P1", "me-k30-b48"), ("P3", "me-k30-b58")]
N_TRAIN = {"P1": 50_000, "P2": 60_000, "P3": 60_000}


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def run_factorizations(out_dir: Path, keys: list[str], tol: float | None) -> dict[str, dict]:
    from dpbench.matrix import dense_factorization
    from dpbench.matrix.store import dense_files

    reports = {}
    for setup, problem, L, key in FACTORIZATIONS:
        if keys and key not in keys:
            continue
        path = out_dir / key / "factorization.npz"
        print(f"factorizing {key} (load {load_average()})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        fact = dense_factorization.factorize(key, tol=tol)
        wall = time.perf_counter() - t0
        dense_files.save(fact, path)
        reports[key] = {**fact.report, "wall_s": wall, "setup": setup, "problem": problem, "L": L,
                        "load_after": load_average()}
        print(f"  {wall:.1f} s, relative gap {fact.report.get('relative_duality_gap')}", file=sys.stderr, flush=True)
    return reports


def factorization_table(reports: dict[str, dict]) -> str:
    rows = ["| setup | problem | L | factorization | T | iterations | time (s) | objective | certified rel. gap "
            "| ‖B‖²_F (prefix-sum error) | sens(C) |",
            "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, r in reports.items():
        rows.append(f"| {r['setup']} | {r['problem']} | {r['L']} | `{key}` | {r['steps']} | {r['iterations']} "
                    f"| {r['wall_s']:.1f} | {r['objective']:.6g} | {r['relative_duality_gap']:.1e} "
                    f"| {r['prefix_sum_error']:.6g} | {r['sensitivity']:.12f} |")
    return "\n".join(rows)


def run_noise(out_dir: Path, max_gb: float, threads: int) -> list[dict]:
    from dpbench.matrix.store.cache import PARAMETER_COUNTS

    results = []
    for problem, key in NOISE:
        fact_path = out_dir / key / "factorization.npz"
        if not fact_path.exists():
            print(f"skipping noise for {key}: no factorization", file=sys.stderr)
            continue
        steps = json.loads((out_dir / key / "factorization.json").read_text())["steps"]
        full_d = PARAMETER_COUNTS[problem]
        dim = min(full_d, int(max_gb * 1e9 / (4 * steps)))
        path = out_dir / key / f"noise-d{dim}.npy"
        env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
               "PYTHONPATH": str(REPO / "src")}
        print(f"noise {key} d={dim} (load {load_average()})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "dpbench", "noise", "--factorization", str(fact_path),
                               "--dim", str(dim), "--seed", "1", "--out", str(path)],
                              env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr)
        info = json.loads(proc.stdout)
        size = path.stat().st_size
        path.unlink()
        path.with_suffix(".json").unlink()
        results.append({"problem": problem, "key": key, "steps": steps, "dim": dim, "full_dim": full_d,
                        "bytes": size, "seconds": info["seconds"], "wall_s": wall,
                        "gb_per_min": info["throughput_gb_per_min"], "peak_rss_mb": info["peak_rss_mb"],
                        "full_gb": steps * full_d * 4 / 1e9, "load_after": load_average()})
    return results


def noise_table(results: list[dict]) -> str:
    rows = ["| problem | factorization | T | d written (of d) | file (GB) | write time (s) | GB/min "
            "| peak RSS (MB) | full file (GB) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        part = "" if r["dim"] == r["full_dim"] else " (truncated)"
        rows.append(f"| {r['problem']} | `{r['key']}` | {r['steps']} | {r['dim']:,} of {r['full_dim']:,}{part} "
                    f"| {r['bytes'] / 1e9:.2f} | {r['seconds']:.1f} | {r['gb_per_min']:.1f} "
                    f"| {r['peak_rss_mb']:.0f} | {r['full_gb']:.2f} |")
    return "\n".join(rows)


def error_table(reports: dict[str, dict], amplified: bool) -> str:
    """Expected total squared error of the T released prefix sums, per coordinate and in
    units of the clipping norm: sigma^2 ||B||_F^2 (matrix, sens(C) = 1) against DP-SGD with
    B = A, C = I (sens sqrt(k), the same fixed batches, no amplification) and, for reference,
    DP-SGD with Poisson sampling and PRV accounting (amplified)."""
    import numpy as np

    from dpbench.privacy import accounting
    from dpbench.matrix.workload import objective_workload

    rows = ["| setup | problem | L | mechanism | T | ε | σ | E‖noise on prefix sums‖² / d | vs DP-SGD (no ampl.) "
            "| own objective σ²·obj | vs DP-SGD (no ampl.) on it |",
            "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    seen_sgd = set()
    for key, r in reports.items():
        k, T, tau = r["epochs"], r["steps"], r["tau"]
        a_fro2 = T * (T + 1) / 2
        w = objective_workload(T, tau)
        sgd_obj = float((w * w).sum())
        for eps in (1.0, 10.0):
            sigma_id = accounting.gaussian_noise_multiplier(eps, 1e-5, sensitivity=np.sqrt(k))
            sgd_err = sigma_id ** 2 * a_fro2
            if (r["problem"], r["L"], eps) not in seen_sgd:
                seen_sgd.add((r["problem"], r["L"], eps))
                rows.append(f"| {r['setup']} | {r['problem']} | {r['L']} | DP-SGD, fixed batches, no amplification "
                            f"| {T} | {eps:g} | {sigma_id:.4g} | {sgd_err:.4g} | 1 | — | — |")
                if amplified:
                    q = r["L"] / N_TRAIN[r["problem"]]
                    t_poisson = round(k * N_TRAIN[r["problem"]] / r["L"])
                    s_amp = accounting.noise_multiplier_for(eps, q, t_poisson)
                    amp_err = s_amp ** 2 * t_poisson * (t_poisson + 1) / 2
                    rows.append(f"| {r['setup']} | {r['problem']} | {r['L']} | DP-SGD, Poisson q = L/N, PRV "
                                f"(amplified) | {t_poisson} | {eps:g} | {s_amp:.4g} | {amp_err:.4g} "
                                f"| {amp_err / sgd_err:.3g} | — | — |")
            sigma = accounting.gaussian_noise_multiplier(eps, 1e-5, sensitivity=r["sensitivity"])
            err = sigma ** 2 * r["prefix_sum_error"]
            own = sigma ** 2 * r["objective"]
            rows.append(f"| {r['setup']} | {r['problem']} | {r['L']} | `{key}` | {T} | {eps:g} | {sigma:.4g} "
                        f"| {err:.4g} | {err / sgd_err:.3g} | {own:.4g} | {own / (sigma_id ** 2 * sgd_obj):.3g} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="/tmp/dpbench-bench", help="factorizations and (temporary) noise files")
    p.add_argument("--keys", nargs="*", default=[], help="only these factorizations")
    p.add_argument("--tol", type=float, help="solver tolerance (default: the package's)")
    p.add_argument("--reuse", action="store_true", help="read factorization reports from --out-dir")
    p.add_argument("--skip-noise", action="store_true")
    p.add_argument("--noise-max-gb", type=float, default=16.0, help="truncate d above this file size")
    p.add_argument("--noise-threads", type=int, default=1)
    p.add_argument("--skip-amplified", action="store_true", help="skip the PRV calibrations")
    p.add_argument("--json", help="write all measurements here")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"# dpbench matrix benchmark, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, load average {load_average()}\n")
    if args.reuse:
        reports = {}
        for setup, problem, L, key in FACTORIZATIONS:
            f = out_dir / key / "factorization.json"
            if f.exists() and (not args.keys or key in args.keys):
                r = json.loads(f.read_text())
                reports[key] = {**r, "wall_s": r["seconds"], "setup": setup, "problem": problem, "L": L}
    else:
        reports = run_factorizations(out_dir, args.keys, args.tol)
    print("## Factorizations\n\n" + factorization_table(reports) + "\n")
    noise = []
    if not args.skip_noise:
        noise = run_noise(out_dir, args.noise_max_gb, args.noise_threads)
        print("## Noise files\n\n" + noise_table(noise) + "\n")
    print("## Expected error on the prefix sums\n\n" + error_table(reports, not args.skip_amplified) + "\n")
    print(f"load average at the end: {load_average()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"factorizations": reports, "noise": noise}, indent=2, default=str))
    free = shutil.disk_usage(out_dir).free / 1e9
    print(f"\n(free disk under {out_dir}: {free:.0f} GB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
