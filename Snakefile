# dpbench: benchmark differentially private optimizers.
# The science lives in the `dpbench` package (src/); rules only name files and call it.
import os
from pathlib import Path

from snakemake.exceptions import WorkflowError

# The package comes from the install (scripts/setup.sh installs this repository's src/ into
# .venv, editable), and it must be this workflow's own src/: the code fingerprints (rerun
# triggers) hash the package Snakemake imports, and the jobs run src/ (common.smk's DPBENCH).
SRC = os.path.join(workflow.basedir, "src")
try:
    import dpbench
except ImportError:
    raise WorkflowError(f"dpbench is not installed: run scripts/setup.sh (pip install -e .), or set PYTHONPATH={SRC}") from None
if Path(dpbench.__file__).resolve().parent != Path(SRC, "dpbench").resolve():
    raise WorkflowError(f"dpbench is imported from {Path(dpbench.__file__).parent}, not from this workflow's {SRC}: "
                        f"install this repository's package (scripts/setup.sh: pip install -e .), or set PYTHONPATH={SRC}")

from dpbench.pipeline.grid import ConfigError, read_yaml

DEFAULT_CONFIG = "config/config.yaml"
# The config files, read as `dpbench grid` reads them before Snakemake merges them: a YAML
# syntax error names the file and line, a key given twice is refused (YAML keeps the last).
# (A --configfile Snakemake cannot parse at all stops inside Snakemake, before this file runs.)
CONFIG_FILES = [f for f in (DEFAULT_CONFIG,) if os.path.exists(f)] + [str(f) for f in workflow.overwrite_configfiles]
try:
    for _file in CONFIG_FILES:
        read_yaml(_file)
except ConfigError as exc:
    raise WorkflowError(str(exc))


configfile: DEFAULT_CONFIG


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/matrix.smk"
include: "workflow/rules/pretrain.smk"
include: "workflow/rules/store.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/audit.smk"
include: "workflow/rules/plots.smk"


localrules:
    all,
    aggregate,


# `all` names every run file and audit file itself, not only the tables made of them: Snakemake
# regenerates a missing input of an up-to-date table only where a target asks for it, so a
# run file deleted by hand, or by a failed job (a damaged noise file or factorization), would
# otherwise leave "Nothing to be done" with the run missing and the aggregate and figures
# stale. Named here, a missing one is retrained and everything made from it redone.
rule all:
    input:
        [run_file(cell_id) for cell_id in sorted(CELLS)],
        [audit_file(name) for name in AUDITS],
        rules.aggregate.output if CELLS else [],
        [AUDIT_TABLE] if AUDITS else [],
        [path for f in FIGURES for path in JOBS.figure_files(f)],
    default_target: True
