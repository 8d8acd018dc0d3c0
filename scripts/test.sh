#!/usr/bin/env bash
# One command: set everything up, then run the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k privacy`.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec .venv/bin/python -m pytest "$@"
