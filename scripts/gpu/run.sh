#!/usr/bin/env bash
# Unattended GPU measurements for docs/gpu.md, in two parts of under 8.5 minutes each:
#
#   part1  environment; `pytest -m cuda` (per-sample gradients, clipping with TF32 on and off,
#          noise std, optimizer equivalences, matrix, exact resume on the GPU); step throughput
#          of P1-P3 at the thesis batch sizes against Opacus (hooks, ghost, functorch); K = 1..16
#          training processes on one GPU; the measured cost file gpu_costs.json and the projected
#          GPU-hours of the setups.
#   part2  cost of deterministic kernels and TF32; `dpbench train` alone vs 4 at once (identical
#          metrics, start-up time); the workflow (scripts/gpu/workflow.yaml: Setup 3 P1 cells on a
#          generated CIFAR-10 tarball, P3 cells on the real Fashion-MNIST, DP-SGD and matrix
#          mechanisms) with the gpu profile (CUDA); K processes for P2/P3 at L = 1024.
#
# On the GPU machine, from the repository root (the wheels of opacus, snakemake and the
# dependencies the image lacks in .whl/, the Fashion-MNIST .gz files in .gpudata/fashion-mnist/):
#   bash scripts/gpu/run.sh part1        (carry: .whl .gpudata)
# Everything lands in $OUT: log-PART.txt (the whole log, as it happens), summary-PART.md (all
# tables), PART.tar.gz (JSON, Markdown, JUnit XML, logs, figures), gpu_costs.json (part1).
# Every step has its own time limit; the summary and tarball are refreshed after each step, so
# a part cut short still returns what it measured.
#
# Smoke test on a CPU (a couple of minutes; the project venv; $OUT defaults to /tmp/dpbench-gpu-out):
#   DPBENCH_GPU_SMOKE=1 bash scripts/gpu/run.sh part1
set -uo pipefail   # no -e: a failing step is recorded and the next one runs

PART=${1:?usage: scripts/gpu/run.sh part1|part2}
case "$PART" in part1|part2) ;; *) echo "usage: scripts/gpu/run.sh part1|part2" >&2; exit 2 ;; esac
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
SMOKE=${DPBENCH_GPU_SMOKE:-0}
OUT=${OUT:-/tmp/dpbench-gpu-out}
TMP=${DPBENCH_GPU_TMP:-/tmp/dpbench-gpu}
WORK=$TMP/$PART
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/log-$PART.txt") 2>&1
T0=$(date +%s)
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH="$REPO/src"

since() { echo $(( $(date +%s) - T0 )); }

sync_out() {  # the summary and the tarball of small files, refreshed after every step
    local order="environment pytest-cuda throughput concurrency projection determinism identical workflow concurrency-L1024"
    { cat "$WORK/steps.md"; for f in $order; do [ -f "$WORK/$f.md" ] && { echo; cat "$WORK/$f.md"; }; done; } \
        > "$OUT/summary-$PART.md" 2>/dev/null
    tar -czf "$OUT/$PART.tar.gz.tmp" -C "$WORK" --exclude='*.npy' --exclude='*.npz' --exclude='*.gz' \
        --exclude='*.ckpt' --exclude='venv' --exclude='data' --exclude='cache' --exclude='.snakemake' . \
        && mv "$OUT/$PART.tar.gz.tmp" "$OUT/$PART.tar.gz"
}

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, record its exit status and duration
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== [$name] start at $(since) s (limit $limit s)"
    timeout -k 10 "$limit" "$@"
    rc=$?
    [ $rc -eq 124 ] && echo "=== [$name] TIMED OUT after $limit s"
    echo "=== [$name] exit $rc after $(( $(date +%s) - start )) s"
    echo "| $name | $rc | $(( $(date +%s) - start )) s |" >> "$WORK/steps.md"
    sync_out
    return 0
}

printf '## scripts/gpu/run.sh %s (smoke: %s)\n\n| step | exit | time |\n| --- | ---: | ---: |\n' "$PART" "$SMOKE" > "$WORK/steps.md"

# -- the interpreter: the machine's python3 (or the project venv when smoking) plus the carried
# wheels and the test shim, through a throwaway venv whose .pth adds them (training jobs that
# Snakemake starts with PYTHONPATH=src still see them)
PYENV=$TMP/venv
make_python() {  # make_python BASE_PYTHON [EXTRA_SITE_DIR]
    local base=$1 extra=${2:-} basesite site
    basesite=$("$base" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$base" -m venv --without-pip --clear "$PYENV" || return 1
    site=$("$PYENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    {
        echo "import site; site.addsitedir('$basesite')${extra:+; site.addsitedir('$extra')}"
        echo "$REPO/scripts/gpu"
        echo "import dpbench_gpu_shim"
    } > "$site/dpbench-gpu.pth"
}
if [ "$SMOKE" = 1 ]; then
    DEVICE=cpu
    BASE=${DPBENCH_PYTHON:-$REPO/.venv/bin/python}
    [ -x "$BASE" ] || BASE=/work/main/.venv/bin/python
    make_python "$BASE"
else
    DEVICE=cuda
    BASE=$(command -v python3)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "!!! wheel install failed"
    make_python "$BASE" /tmp/site || { echo "!!! no venv module: adding the wheels to $BASE itself";
        echo "/tmp/site" > "$("$BASE" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dpbench-gpu.pth"
        PYENV=""; }
fi
PY=${PYENV:+$PYENV/bin/python}
PY=${PY:-$BASE}
echo "=== python: $PY (base $BASE), device $DEVICE, setup done at $(since) s"
"$PY" -c "import torch, opacus, snakemake, dpbench; print('torch', torch.__version__, 'opacus', opacus.__version__, 'snakemake', snakemake.__version__)" \
    || echo "!!! imports failed"

FMNIST=$REPO/.gpudata/fashion-mnist
[ -f "$FMNIST/train-images-idx3-ubyte.gz" ] || FMNIST=/usr/share/datasets/fashion-mnist
DATA=$TMP/data
mkdir -p "$DATA"
ln -sfn "$FMNIST" "$DATA/fashion-mnist"

env_report() {
    echo '### Environment'; echo; echo '```'
    date -u; uname -a; echo "$(nproc --all) CPUs"; free -g | head -2; df -h /tmp | tail -1
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
    "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(torch.cuda.get_device_name(0), p.multi_processor_count, "SMs", round(p.total_memory / 2**30, 1), "GiB")
import importlib.metadata as md
print(", ".join(f"{n} {md.version(n)}" for n in ("opacus", "snakemake", "numpy", "scipy", "pandas", "pyarrow", "matplotlib")))
EOF
    echo '```'
}

if [ "$SMOKE" = 1 ]; then
    Q=(--quick --target-s 0.1); BUDGET_TP=60; KS=1,2; WINDOW=1; CELLS=P2:64:dpsgd; PYTEST_FILES=(tests/privacy/test_per_sample.py tests/privacy/test_privacy.py)
else
    Q=(--target-s 0.5); BUDGET_TP=160; KS=1,2,4,8,16; WINDOW=3; CELLS=P2:256:dpsgd,P1:256:dpsgd
    PYTEST_FILES=(tests/privacy/test_per_sample.py tests/privacy/test_privacy.py tests/optimizers/test_optimizers.py tests/matrix/test_matrix.py tests/training/test_train.py)
fi

if [ "$PART" = part1 ]; then
    env_report > "$WORK/environment.md" 2>&1
    cat "$WORK/environment.md"
    echo "| environment | 0 | $(since) s |" >> "$WORK/steps.md"
    sync_out

    TIMEOUT_ARGS=()
    "$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout 90)
    step pytest-cuda 130 "$PY" -m pytest -m cuda -q -rfEs -p no:cacheprovider -o junit_family=legacy \
        --junitxml="$WORK/pytest-cuda.xml" "${TIMEOUT_ARGS[@]}" "${PYTEST_FILES[@]}"
    [ -f "$WORK/pytest-cuda.xml" ] && "$PY" scripts/gpu/report.py pytest "$WORK/pytest-cuda.xml" > "$WORK/pytest-cuda.md"
    sync_out

    step throughput 200 "$PY" benchmarks/bench_gpu.py throughput --device "$DEVICE" --out "$WORK" \
        --budget-s "$BUDGET_TP" "${Q[@]}"
    step concurrency 100 "$PY" benchmarks/bench_gpu.py concurrency --device "$DEVICE" --out "$WORK" --ks "$KS" \
        --cells "$CELLS" --window-s "$WINDOW" --budget-s 80 "${Q[@]}"
    step costs 15 "$PY" benchmarks/bench_gpu.py costs --out "$WORK"
    [ -f "$WORK/gpu_costs.json" ] && cp "$WORK/gpu_costs.json" "$OUT/gpu_costs.json"
    step projection 15 bash -c "'$PY' -m dpbench cost --costs '$WORK/gpu_costs.json' --cells-per-gpu 8 > '$WORK/projection.md'"
else
    CIFAR_PER_BATCH=10000
    [ "$SMOKE" = 1 ] && CIFAR_PER_BATCH=300
    # the generated CIFAR-10 tarball, made while the benchmarks run (CPU work)
    "$PY" scripts/gpu/make_cifar.py "$DATA" --per-batch $CIFAR_PER_BATCH > "$WORK/cifar-md5.txt" 2>&1 &
    CIFAR_PID=$!

    step determinism 60 "$PY" benchmarks/bench_gpu.py determinism --device "$DEVICE" --out "$WORK" \
        --cells "$([ "$SMOKE" = 1 ] && echo P2:64:dpsgd || echo P2:256:dpsgd,P1:1024:dpsgd)" \
        --rounds "$([ "$SMOKE" = 1 ] && echo 1 || echo 3)" --target-s "$([ "$SMOKE" = 1 ] && echo 0.1 || echo 0.5)" \
        $([ "$SMOKE" = 1 ] && echo --quick)
    step identical-runs "$([ "$SMOKE" = 1 ] && echo 240 || echo 80)" "$PY" scripts/gpu/identical_runs.py --out "$WORK" --data-dir "$DATA" --device "$DEVICE" \
        --k "$([ "$SMOKE" = 1 ] && echo 2 || echo 4)" --max-steps "$([ "$SMOKE" = 1 ] && echo 3 || echo 150)" \
        $([ "$SMOKE" = 1 ] && echo --test-subset 200)

    wait "$CIFAR_PID"
    export DPBENCH_TEST_CIFAR10_MD5=$(tail -1 "$WORK/cifar-md5.txt")
    echo "=== generated CIFAR-10 tarball md5:$DPBENCH_TEST_CIFAR10_MD5"
    WF=$WORK/workflow
    mkdir -p "$WF"
    if [ "$SMOKE" = 1 ]; then
        "$PY" scripts/gpu/report.py smoke-config scripts/gpu/workflow.yaml "$WF/config.yaml"
    else
        cp scripts/gpu/workflow.yaml "$WF/config.yaml"
    fi
    # the profile is the deployment: gpu (training with --device cuda) on the GPU machine
    step workflow "$([ "$SMOKE" = 1 ] && echo 400 || echo 220)" "$PY" -m snakemake --snakefile "$REPO/Snakefile" --directory "$WF" \
        --configfile "$WF/config.yaml" --config data_dir="$DATA" \
        --profile "$REPO/workflow/profiles/$([ "$SMOKE" = 1 ] && echo default || echo gpu)" \
        --cores "$([ "$SMOKE" = 1 ] && echo 2 || echo 8)" --scheduler greedy
    [ -f "$WF/results/aggregate/runs.parquet" ] && "$PY" scripts/gpu/report.py workflow "$WF/results" > "$WORK/workflow.md"
    unset DPBENCH_TEST_CIFAR10_MD5
    sync_out

    step concurrency-L1024 90 "$PY" benchmarks/bench_gpu.py concurrency --device "$DEVICE" --out "$WORK/L1024" \
        --ks "$([ "$SMOKE" = 1 ] && echo 1,2 || echo 1,4,8)" \
        --cells "$([ "$SMOKE" = 1 ] && echo P3:64:dpsgd || echo P3:1024:dpsgd,P2:1024:dpsgd)" \
        --window-s "$WINDOW" --budget-s 70 "${Q[@]}"
    [ -f "$WORK/L1024/concurrency.md" ] && cp "$WORK/L1024/concurrency.md" "$WORK/concurrency-L1024.md"
fi

echo "=== $PART done at $(since) s"
sync_out
cat "$OUT/summary-$PART.md"
