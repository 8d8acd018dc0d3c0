#!/usr/bin/env bash
# One command: set everything up, then run the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k privacy` (`-n 0`: in one process).
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# pytest-xdist: one worker per core (`-n auto`); the tests that share an expensive fixture
# (the tiny workflow's run, a module's fixture) or a timing run on one worker each (xdist_group
# marks, tests/conftest.py), the rest wherever a worker is free, the longest first (by the
# committed per-test times, benchmarks/results/suite/durations.tsv: scripts/suite_durations.py).
exec .venv/bin/python -m pytest -n auto --dist loadgroup "$@"
