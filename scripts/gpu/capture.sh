#!/usr/bin/env bash
# The GPU checks of captured steps (docs/gpu.md, "Captured steps (CUDA graphs)") as one short
# script for a GPU session (about 8 minutes): the cuda tests of tests/training/test_capture.py and
# tests/training/test_capture_lm.py (graph replays against eager steps, P4's included, fresh noise per
# replay, whole runs with and without the option, a captured run killed and resumed), then ms per
# step of sgd, dpsgd and dpmatrix-se, eager and captured, on P2 and P1 at L = 64, 256, 1024, and
# of sgd and dpsgd, eager and captured, on P4 at L = 64, 256, 1024 (benchmarks/bench_gpu.py
# throughput --cuda-graphs; each captured row keeps its capture record: captures, replays, a
# failure's reason).
#
# From the repository root, with a python that has torch (CUDA), pytest, scipy, pandas, pyyaml:
#   OUT=/tmp/capture-out PY=python3 bash scripts/gpu/capture.sh
# $OUT gets log.txt, pytest-cuda.xml, throughput.json and throughput.md (P4's in $OUT/p4).
# Smoke test on a CPU (the cuda tests skip; tiny sizes):
#   DPBENCH_GPU_SMOKE=1 PY=.venv/bin/python bash scripts/gpu/capture.sh
set -uo pipefail   # no -e: the benchmark runs whatever the tests said

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/dpbench-capture-out}
PY=${PY:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH="$REPO/src"
if [ "${DPBENCH_GPU_SMOKE:-0}" = 1 ]; then
    DEVICE=cpu; SIZES=(--quick --target-s 0.1 --batch-sizes 64)
else
    DEVICE=cuda; SIZES=(--target-s 0.5 --batch-sizes 64,256,1024)
fi

timeout -k 10 200 "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider --junitxml="$OUT/pytest-cuda.xml" \
    tests/training/test_capture.py tests/training/test_capture_lm.py
echo "=== pytest -m cuda tests/training/test_capture.py tests/training/test_capture_lm.py: exit $?"

timeout -k 10 300 "$PY" benchmarks/bench_gpu.py throughput --device "$DEVICE" --cuda-graphs --no-opacus \
    --problems P2,P1 --methods sgd,dpsgd,dpmatrix-se,sgd+graphs,dpsgd+graphs,dpmatrix-se+graphs \
    --budget-s 240 --out "$OUT" "${SIZES[@]}"
echo "=== bench_gpu.py throughput --cuda-graphs: exit $?"

mkdir -p "$OUT/p4"
timeout -k 10 200 "$PY" benchmarks/bench_gpu.py throughput --device "$DEVICE" --cuda-graphs --no-opacus \
    --problems P4 --methods sgd,dpsgd,sgd+graphs,dpsgd+graphs --budget-s 150 --out "$OUT/p4" "${SIZES[@]}"
echo "=== bench_gpu.py throughput --cuda-graphs --problems P4: exit $?"
