#!/usr/bin/env bash
# The tiny grid of .test/config/slurm.yaml (P2; DP-SGD at eps 1 and 10, non-private SGD; 3 steps
# on 1000 training and 200 test examples) through SLURM with workflow/profiles/slurm-local, up to
# the figures, in a temporary directory; then checks the outputs and that the jobs really went
# through SLURM.
# Needs a running cluster (scripts/slurm/local-cluster.sh) and the venv (scripts/setup.sh).
#
#   scripts/slurm/run-tiny-grid.sh [WORKDIR] [extra snakemake arguments...]
#
# WORKDIR (default: a new mktemp -d) is kept, so its results and SLURM logs can be inspected.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="${1:-$(mktemp -d /tmp/dpbench-slurm-XXXXXX)}"
shift || true
DATA_DIR="${DPBENCH_FMNIST_DIR:-/usr/share/datasets/fashion-mnist}"
SNAKEMAKE="$REPO/.venv/bin/snakemake"

die() { echo "run-tiny-grid: $*" >&2; exit 1; }
[ -x "$SNAKEMAKE" ] || die "no $SNAKEMAKE (run scripts/setup.sh)"
"$REPO/.venv/bin/python" -c "import snakemake_executor_plugin_slurm" 2>/dev/null \
    || die "snakemake-executor-plugin-slurm is not installed in .venv"
sinfo -h -o %T 2>/dev/null | grep -q idle || die "no idle SLURM node (start one: scripts/slurm/local-cluster.sh)"
[ -d "$DATA_DIR" ] || die "no Fashion-MNIST in $DATA_DIR (set DPBENCH_FMNIST_DIR)"

mkdir -p "$WORK"

echo "run-tiny-grid: working in $WORK" >&2
start=$(date +%s)
(cd "$WORK" && "$SNAKEMAKE" --snakefile "$REPO/Snakefile" --directory "$WORK" \
    --configfile "$REPO/.test/config/slurm.yaml" --config data_dir="$DATA_DIR" \
    --profile "$REPO/workflow/profiles/slurm-local" "$@")
echo "run-tiny-grid: snakemake finished in $(( $(date +%s) - start )) s" >&2

# --- checks
fail=0
check() { if eval "$2"; then echo "ok   $1"; else echo "FAIL $1"; fail=1; fi; }
R="$WORK/results"
check "3 run files" '[ "$(find "$R/runs" -name "*.parquet" | wc -l)" -eq 3 ]'
check "aggregated runs and epochs tables" '[ -s "$R/aggregate/runs.parquet" ] && [ -s "$R/aggregate/epochs.parquet" ]'
for png in "$R"/figures/*.png; do
    check "figure $(basename "$png") (PNG and PDF)" '[ "$(stat -c %s "$png")" -gt 10000 ] && [ -s "${png%.png}.pdf" ]'
done
check "at least one figure" 'ls "$R"/figures/*.png >/dev/null 2>&1'
check "all runs completed, 3 steps each" \
    '"$REPO/.venv/bin/python" -c "import pandas as pd, sys; r = pd.read_parquet(sys.argv[1]); sys.exit(not (len(r) == 3 and (r.status == \"completed\").all() and (r.steps == 3).all()))" "$R/aggregate/runs.parquet"'
# SLURM's own logs (kept by the profile) prove that the jobs ran as SLURM jobs
LOGS="$WORK/.snakemake/slurm_logs"
check "training ran as SLURM job(s)" '[ -n "$(find "$LOGS" -path "*train*" -name "*.log" 2>/dev/null)" ]'
check "data ran as a SLURM job" '[ -n "$(find "$LOGS" -path "*rule_data*" -name "*.log" 2>/dev/null)" ]'
echo "run-tiny-grid: SLURM jobs of this run:" >&2
find "$LOGS" -name "*.log" 2>/dev/null | sed "s|$LOGS/||" | sort >&2
[ "$fail" -eq 0 ] || die "some checks failed (see above; results in $WORK)"
echo "run-tiny-grid: all checks passed; results in $WORK" >&2
