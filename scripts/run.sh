#!/usr/bin/env bash
# One command: set everything up, then run the default workflow (config/config.yaml).
# Extra arguments go to snakemake, e.g. `scripts/run.sh --configfile config/my.yaml`.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# A --configfile Snakemake cannot parse stops inside Snakemake, before the workflow's own
# validation, naming neither file nor line: read each first, as the workflow does.
.venv/bin/python -c 'import sys; from dpbench.pipeline.configfile import check_configfiles; sys.exit(check_configfiles(sys.argv[1:]))' "$@"
exec .venv/bin/snakemake --profile workflow/profiles/default "$@"
