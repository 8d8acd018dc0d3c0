"""Commit what finished of a long study: the comparisons whose every run is done, drawn.

A study of several CPU-hours (config/finetune.yaml) runs across sittings; between them, its
finished part is committed. A comparison is one (problem, optimizer, ε, mode) of the config:
every configuration (learning rate, batch size, epochs, hyperparameters such as a weight decay)
and seed of it, the candidates among which its figures choose. Only complete comparisons go in:
a choice among half of the candidates, or a mean over fewer seeds than the config asks for,
would be another experiment. This script
collects the run files of the complete ones, aggregates them as the workflow does
(``dpbench aggregate``), draws every figure of the config with its options (``dpbench plot``),
and writes a README saying how much of the study that is, when, where and on which CPU.

    python benchmarks/snapshot_study.py config/finetune.yaml --out benchmarks/results/finetune/study

The run files are read from the config's results directory (``--results`` to read another).
``--keep-runs`` copies the complete comparisons' run files too, to ``<out>/runs/`` (their paths
under the results directory kept), so that a later sitting on a fresh clone resumes from them
(``benchmarks/run_study.py --restore <out>``) instead of running them again.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from dpbench.machine import platform_record
from dpbench.pipeline.jobs import figure_options, load_jobs


def comparison(cell) -> tuple:
    """What a cell is compared as: its cell less the candidates' axes (learning rate, batch size,
    epochs, hyperparameters, seed), over which the fine-tuning figures choose per (optimizer, ε, mode)."""
    return (cell.problem, cell.optimizer, cell.epsilon, None if cell.start is None else cell.start.label)


def run_path(jobs, results: Path, cell_id: str) -> Path:
    """A cell's run file under ``results`` (the study's results directory, maybe not the config's)."""
    return results / Path(jobs.run_file(cell_id)).relative_to(jobs.results)


def complete_runs(jobs, results: Path) -> tuple[list[Path], int, int]:
    """The run files of the complete comparisons, and how many comparisons there are and are complete."""
    groups: dict[tuple, list[Path]] = defaultdict(list)
    for cell_id, cell in jobs.cells.items():
        groups[comparison(cell)].append(run_path(jobs, results, cell_id))
    done = [paths for paths in groups.values() if all(p.exists() for p in paths)]
    return sorted(p for paths in done for p in paths), len(groups), len(done)


def keep_runs(runs: list[Path], results: Path, out: Path) -> int:
    """Copy ``runs`` (files under ``results/runs/``) to ``out/runs/`` at their paths relative to
    ``results/runs/`` (``<cell id>.parquet``), anew (files of an earlier snapshot that are no
    longer complete are dropped)."""
    import shutil

    target = out / "runs"
    if target.exists():
        shutil.rmtree(target)
    for p in runs:
        dest = target / p.relative_to(results / "runs")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dest)
    return len(runs)


def made_by(runs: list[Path]) -> list[str]:
    """The git commits of the code that made the runs (each run file records its own)."""
    import pyarrow.parquet as pq

    return sorted({str(json.loads(pq.read_schema(p).metadata[b"dpbench"])["environment"].get("git_commit"))[:7]
                   for p in runs})


def summary(table) -> list[str]:
    """README lines measured from the aggregated runs table: the runs' statuses, the largest
    achieved/target ε of a private run, and the runs' own wall times added up."""
    private = table[table["private"].astype(bool)]
    ratio = (private["epsilon"] / private["target_epsilon"]).max() if len(private) else float("nan")
    statuses = ", ".join(f"{n} {status}" for status, n in table["status"].value_counts().sort_index().items())
    return [f"- status of the runs: {statuses}",
            f"- privacy: {len(private)} private runs, achieved ε at most {ratio:.5f} of the target "
            f"(max epsilon / target_epsilon)",
            f"- time: the runs' wall_time_s add up to {table['wall_time_s'].sum() / 3600:.2f} hours "
            f"(each run's training and evaluation; the jobs' start-up not counted)"]


def dpbench(*args: str) -> None:
    """``dpbench`` with ``args``; its failure (its own error above, naming the file) ends the
    snapshot in one line, not a traceback."""
    if subprocess.run([sys.executable, "-m", "dpbench", *args]).returncode:
        raise SystemExit(f"snapshot_study: `dpbench {args[0]}` failed (its error above): the snapshot is not complete, do not commit it")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--out", required=True, help="folder of the snapshot (written anew)")
    parser.add_argument("--results", help="the study's results directory (default: the config's results_dir)")
    parser.add_argument("--keep-runs", action="store_true",
                        help="copy the complete comparisons' run files to <out>/runs/ (for run_study.py --restore)")
    args = parser.parse_args(argv)
    jobs = load_jobs(args.config)
    results = Path(args.results or jobs.results)
    runs, n_groups, n_done = complete_runs(jobs, results)
    if not runs:
        print(f"no comparison of {args.config} is complete in {results}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "runs.parquet"
    dpbench("aggregate", *map(str, runs), "--out-runs", str(table), "--out-epochs", str(out / "epochs.parquet"))
    import pandas as pd

    from dpbench.pipeline import catalog

    aggregated = pd.read_parquet(table)
    trained = set(aggregated["problem"])
    drawn, skipped = [], []
    for name, options in jobs.figures.items():  # as rule plot_<name> draws it, where its problem has runs
        figure = jobs.figure_id(name)
        problem = {**catalog.figure(figure).defaults, **options}.get("problem")
        if problem is not None and problem not in trained:
            skipped.append(f"{name} ({problem})")
            continue
        dpbench("plot", figure, "--runs", str(table), "--out", str(out / name),
                *shlex.split(figure_options(options)))
        drawn.append(name)
    kept = keep_runs(runs, results, out) if args.keep_runs else 0
    done_files = sum(1 for c in jobs.cells if run_path(jobs, results, c).exists())
    cpu = platform_record()["cpu"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (out / "README.md").write_text(
        f"# {args.config}: the complete comparisons so far\n\n"
        f"Snapshot of {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, drawn by dpbench at {commit} "
        f"with `python benchmarks/snapshot_study.py {shlex.join(argv if argv is not None else sys.argv[1:])}`.\n\n"
        f"- complete comparisons (every configuration and seed of one problem, optimizer, ε and mode): "
        f"{n_done} of {n_groups}\n"
        f"- runs in them: {len(runs)}; runs finished in all: {done_files} of {len(jobs.cells)}\n"
        + "".join(f"{line}\n" for line in summary(aggregated)) +
        f"- the runs were made by dpbench at {', '.join(made_by(runs))} (each run file's environment.git_commit)\n"
        f"- CPU: {cpu.get('model_name')} (vendor {cpu.get('vendor')}, family {cpu.get('family')}, model "
        f"{cpu.get('model')}), {os.cpu_count()} cores\n"
        + (f"- run files: the {kept} runs' own files in runs/ (a later sitting resumes from them: "
           f"`python benchmarks/run_study.py {args.config} --restore {out}`)\n" if kept else "") +
        f"\nFiles: runs.parquet and epochs.parquet (the aggregate of those runs), and the config's figures "
        f"{', '.join(drawn)}" + (f"; not drawn, no complete comparison of their problem yet: {', '.join(skipped)}"
                                if skipped else "") + ".\n")
    print(f"{n_done} of {n_groups} comparisons complete ({len(runs)} runs) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
