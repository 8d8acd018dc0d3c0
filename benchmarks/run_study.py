"""Run a long study's comparisons cheapest first, so that each sitting ends with whole comparisons.

Snakemake runs a config's cells in an order of its own; a study of many CPU-hours that is
stopped after two of them would then hold a little of every comparison and none complete
(``snapshot_study.py`` commits only complete ones). This script runs the config's training
cells one (problem, mode) batch at a time, in the order given (by default the modes whose steps
are cheapest first), each batch one Snakemake call with the batch's run files as targets: the
stores, data and factorizations they need are built by the workflow as usual, a finished run is
never run again, and a killed sitting resumes where it stopped (``rerun-incomplete``). It prints
each batch's measured time.

    python benchmarks/run_study.py config/finetune-movies.yaml
    python benchmarks/run_study.py config/finetune-movies.yaml --order head last-block --problems P8
    python benchmarks/run_study.py config/finetune-movies.yaml --restore benchmarks/results/movies/study

``--restore SNAPSHOT`` first copies the run files a snapshot kept (``snapshot_study.py
--keep-runs``) into the results directory where the config has those cells and no file yet, so
that a fresh clone resumes the study instead of running it again (the copies are run files as
any other: ``dpbench aggregate`` checks each when it reads it, and each says which commit made it).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from dpbench.pipeline.jobs import load_jobs

ORDER = ("head", "last-block", "bias", "lora", "full")  # the modes by a step's cost, cheapest first


def batches(jobs, modes, problems) -> list[tuple[tuple[str, str], list[str]]]:
    """The run files of the config's cells by (problem, mode), in ``problems`` then ``modes``
    order (cells of other problems or modes: left out)."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for cell_id, cell in jobs.cells.items():
        label = "scratch" if cell.start is None or cell.start.mode is None else cell.start.mode.name
        groups[(cell.problem, label)].append(jobs.run_file(cell_id))
    keys = [(p, m) for p in problems for m in modes if (p, m) in groups]
    return [(k, sorted(groups[k])) for k in keys]


def restore(jobs, snapshot: Path) -> int:
    """Copy ``snapshot/runs/``'s run files of the config's cells into the results directory where
    none is there yet (an existing file is never replaced); how many were copied."""
    import shutil

    copied = 0
    for cell_id in jobs.cells:
        source = snapshot / "runs" / f"{cell_id}.parquet"  # as snapshot_study.keep_runs keeps it
        dest = Path(jobs.run_file(cell_id))
        if source.is_file() and not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)
            copied += 1
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--order", nargs="+", default=list(ORDER), help="modes, in the order to run them")
    parser.add_argument("--problems", nargs="+", help="problems, in the order to run them (default: the config's)")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="print the batches and what is left of each")
    parser.add_argument("--restore", type=Path, help="a snapshot whose kept run files to start from")
    args = parser.parse_args(argv)
    jobs = load_jobs(args.config)
    if args.restore:
        print(f"run_study: {restore(jobs, args.restore)} run files restored from {args.restore}", flush=True)
    problems = args.problems or list(dict.fromkeys(c.problem for c in jobs.cells.values()))
    for (problem, mode), files in batches(jobs, args.order, problems):
        left = [f for f in files if not Path(f).exists()]
        print(f"run_study: {problem} {mode}: {len(files) - len(left)} of {len(files)} runs done", flush=True)
        if not left or args.dry_run:
            continue
        start = time.monotonic()
        code = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "workflow/profiles/default",
                               "--configfile", args.config, "--cores", str(args.cores), *left]).returncode
        done = sum(Path(f).exists() for f in left)
        hours = (time.monotonic() - start) / 3600
        print(f"run_study: {problem} {mode}: {done} of {len(left)} runs made in {hours:.2f} h "
              f"({args.cores} cores)", flush=True)
        if code:
            print(f"run_study: snakemake failed on {problem} {mode} (exit {code}); its log above", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
