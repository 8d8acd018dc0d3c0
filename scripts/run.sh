#!/usr/bin/env bash
# One command: set everything up, then run the default workflow (config/config.yaml).
# Extra arguments go to snakemake, e.g. `scripts/run.sh --configfile config/my.yaml`.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec .venv/bin/snakemake --profile workflow/profiles/default "$@"
