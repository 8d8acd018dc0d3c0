"""Run a long study's comparisons cheapest first, so that each sitting ends with whole comparisons.

Snakemake runs a config's cells in an order of its own; a study of many CPU-hours that is
stopped after two of them would then hold a little of every comparison and none complete
(``snapshot_study.py`` commits only complete ones). This script runs the config's training
cells a few comparisons at a time (a comparison: one problem, mode, optimizer and ε, every
configuration and seed of it), in the order given (by default the modes whose steps are
cheapest first, within a mode the non-private reference first), each batch one Snakemake call
with its run files as targets: the
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


def comparisons(jobs, modes, problems, optimizers=None, epsilons=None) -> list[tuple[tuple, list[str]]]:
    """The run files of the config's cells by comparison (problem, mode, optimizer, ε: every
    configuration and seed the figures choose among, as ``snapshot_study.comparison``), in
    ``problems`` then ``modes`` order, within a mode the non-private ones first, then by
    ``epsilons`` and ``optimizers`` order (default: ascending ε, the config's optimizers).
    Cells of other problems or modes are left out."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for cell_id, cell in jobs.cells.items():
        mode = "scratch" if cell.start is None or cell.start.mode is None else cell.start.mode.name
        groups[(cell.problem, mode, cell.optimizer, cell.epsilon)].append(jobs.run_file(cell_id))
    optimizers = list(optimizers or dict.fromkeys(k[2] for k in groups))
    epsilons = [float(e) for e in epsilons] if epsilons else sorted({float(k[3]) for k in groups if k[3] is not None})

    def key(k):
        problem, mode, optimizer, eps = k
        private = eps is not None
        return (problems.index(problem), modes.index(mode), private,
                epsilons.index(float(eps)) if private and float(eps) in epsilons else len(epsilons),
                optimizers.index(optimizer) if optimizer in optimizers else len(optimizers))

    keys = sorted((k for k in groups if k[0] in problems and k[1] in modes), key=key)
    return [(k, sorted(groups[k])) for k in keys]


def batches(jobs, modes, problems, optimizers=None, epsilons=None, per_call: int = 2):
    """``comparisons`` taken ``per_call`` at a time within one (problem, mode), one Snakemake call
    each: a sitting that is stopped leaves whole comparisons done, not a little of every one."""
    by_mode: dict[tuple, list] = defaultdict(list)
    for k, files in comparisons(jobs, modes, problems, optimizers, epsilons):
        by_mode[k[:2]].append((k, files))
    return [group[i:i + per_call] for group in by_mode.values() for i in range(0, len(group), per_call)]


def name(comparison: tuple) -> str:
    """"P8 last-block dpadamw ε=3" or "P8 head adamw non-private"."""
    problem, mode, optimizer, eps = comparison
    return f"{problem} {mode} {optimizer} " + ("non-private" if eps is None else f"ε={float(eps):g}")


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
    parser.add_argument("--optimizers", nargs="+", help="optimizers, in the order to run them within a mode")
    parser.add_argument("--epsilons", nargs="+", type=float, help="epsilons, in the order to run them within a mode")
    parser.add_argument("--per-call", type=int, default=2, help="comparisons per Snakemake call")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="print the comparisons and what is left of each")
    parser.add_argument("--restore", type=Path, help="a snapshot whose kept run files to start from")
    args = parser.parse_args(argv)
    jobs = load_jobs(args.config)
    if args.restore:
        print(f"run_study: {restore(jobs, args.restore)} run files restored from {args.restore}", flush=True)
    problems = args.problems or list(dict.fromkeys(c.problem for c in jobs.cells.values()))
    for batch in batches(jobs, args.order, problems, args.optimizers, args.epsilons, args.per_call):
        names = "; ".join(name(k) for k, _ in batch)
        files = [f for _, fs in batch for f in fs]
        left = [f for f in files if not Path(f).exists()]
        print(f"run_study: {names}: {len(files) - len(left)} of {len(files)} runs done", flush=True)
        if not left or args.dry_run:
            continue
        start = time.monotonic()
        code = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "workflow/profiles/default",
                               "--configfile", args.config, "--cores", str(args.cores), *left]).returncode
        done = sum(Path(f).exists() for f in left)
        print(f"run_study: {names}: {done} of {len(left)} runs made in {(time.monotonic() - start) / 60:.1f} min "
              f"({args.cores} cores)", flush=True)
        if code:
            print(f"run_study: snakemake failed on {names} (exit {code}); its log above", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
