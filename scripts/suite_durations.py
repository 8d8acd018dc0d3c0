"""Per-test times as data: runs pytest (any arguments: a folder, ``-k``, ``-n 0``) and writes the
time of every test that took at least ``--min-seconds`` (setup, call and teardown together: a
session fixture's time is the first test's that uses it) to a table, by default
benchmarks/results/suite/durations.tsv, with the command, the date, the CPU and the load average
beside it. tests/conftest.py's scheduler (scripts/test.sh, ``--dist loadgroup``) reads the table to
start the longest tests first. Regenerate it on a quiet machine with the whole suite:

    .venv/bin/python scripts/suite_durations.py -- -n 0

``--merge`` keeps the rows of the tests not run this time (measure a few slow tests again without
the rest). Each test's time is appended as it ends (to ``<table>.partial``), so a run stopped
early still leaves what it measured: ``--from-partial`` writes the table from it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "benchmarks" / "results" / "suite" / "durations.tsv"
PARTIAL_VARIABLE = "DPBENCH_DURATIONS_PARTIAL"
COLUMNS = ("test", "seconds", "outcome")


# ---------------------------------------------------------------- the pytest plugin (-p suite_durations)
_times: dict[str, float] = {}
_outcomes: dict[str, str] = {}


def pytest_runtest_logreport(report):
    """Adds each phase's time; at teardown appends the test's total to the partial file."""
    path = os.environ.get(PARTIAL_VARIABLE)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist: the controller writes each once
        return
    _times[report.nodeid] = _times.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _outcomes[report.nodeid] = report.outcome
    if report.when == "teardown":
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{_times.pop(report.nodeid):.3f}\t{_outcomes.pop(report.nodeid, 'passed')}\n")


# ---------------------------------------------------------------- the table
def read_table(path: Path) -> tuple[list[str], dict[str, tuple[float, str]]]:
    """(its comment lines, {test id: (seconds, outcome)}) of a table this script wrote; a line
    that is neither is refused naming the file and the line."""
    comments, rows = [], {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("#"):
            comments.append(line)
            continue
        fields = line.split("\t")
        if fields == list(COLUMNS) or not line.strip():
            continue
        try:
            test, seconds, outcome = fields
            rows[test] = (float(seconds), outcome)
        except ValueError:
            raise SystemExit(f"{path}, line {number}: not 'test<TAB>seconds<TAB>outcome': {line!r}") from None
    return comments, rows


def estimates(path: Path = TABLE) -> dict[str, float]:
    """{test id: seconds} of the committed table; empty where there is none."""
    return {test: seconds for test, (seconds, _) in read_table(path)[1].items()} if path.is_file() else {}


def cpu() -> str:
    from dpbench.machine import cpu_model

    return f"{cpu_model() or 'unknown CPU'}, {len(os.sched_getaffinity(0))} cores usable"


def write_table(path: Path, rows: dict[str, tuple[float, str]], header: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [*header, "\t".join(COLUMNS)]
    lines += [f"{test}\t{seconds:.3f}\t{outcome}" for test, (seconds, outcome)
              in sorted(rows.items(), key=lambda r: (-r[1][0], r[0]))]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=TABLE, help="the table (default: %(default)s)")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="tests faster than this are left out "
                        "(the scheduler takes a test not in the table as short)")
    parser.add_argument("--merge", action="store_true", help="keep the rows of tests not run this time")
    parser.add_argument("--note", default="", help="a sentence written into the table's header "
                        "(e.g. that the machine was shared)")
    parser.add_argument("--from-partial", action="store_true",
                        help="run nothing: write the table from <out>.partial (a run stopped early; give its "
                        "pytest arguments again, for the table's header)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest, after --")
    args = parser.parse_args(argv)
    partial = args.out.with_name(args.out.name + ".partial")
    command = [sys.executable, "-m", "pytest", "-p", "suite_durations", "-p", "no:cacheprovider", *args.pytest_args]
    started = datetime.datetime.now(datetime.timezone.utc)
    load = os.getloadavg()
    returncode = 0
    if not args.from_partial:
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(f"# {started.isoformat()} {load[0]:.2f}\n")
        env = {**os.environ, PARTIAL_VARIABLE: str(partial),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
        returncode = subprocess.run(command, cwd=REPO, env=env).returncode
    if not partial.is_file():
        raise SystemExit(f"{partial}: no test's time was recorded")
    measured = {}
    for line in partial.read_text().splitlines():
        if line.startswith("#"):  # the run's start, written before its first test
            started, load = datetime.datetime.fromisoformat(line.split()[1]), (float(line.split()[2]),)
            continue
        test, seconds, outcome = line.split("\t")
        measured[test] = (float(seconds), outcome)
    rows = read_table(args.out)[1] if args.merge and args.out.is_file() else {}
    rows.update({t: r for t, r in measured.items() if r[0] >= args.min_seconds})
    for t, r in measured.items():  # measured faster now: no longer a long test
        if r[0] < args.min_seconds:
            rows.pop(t, None)
    shown = ["python", "scripts/suite_durations.py", *(["--merge"] if args.merge else []), "--",
             *args.pytest_args]
    header = [f"# Per-test wall times in seconds (setup + call + teardown), the longest first; tests under "
              f"{args.min_seconds} s left out. Written by scripts/suite_durations.py, read by tests/conftest.py "
              f"(longest first).",
              f"# command: {shlex.join(shown)}",
              f"# date: {started:%Y-%m-%d %H:%M} UTC; CPU: {cpu()}; load average at the start "
              f"{load[0]:.1f}, at the end {os.getloadavg()[0]:.1f}; {len(measured)} tests timed, pytest exit "
              f"status {returncode}"]
    header += [f"# note: {args.note}"] if args.note else []
    if args.merge and args.out.is_file():
        header += [f"# earlier: {line[2:]}" for line in read_table(args.out)[0]
                   if line.startswith(("# command:", "# date:", "# note:", "# earlier:"))]
    write_table(args.out, rows, header)
    partial.unlink()
    print(f"wrote {args.out}: {len(rows)} tests of at least {args.min_seconds} s", file=sys.stderr)
    return returncode


if __name__ == "__main__":
    sys.exit(main())
