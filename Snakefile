# dpbench: benchmark differentially private optimizers.
# The science lives in the `dpbench` package (src/); rules only name files and call it.
configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/matrix.smk"
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
        expand(f"{RESULTS}/figures/{{figure}}.{{ext}}", figure=FIGURES, ext=("png", "pdf")),
    default_target: True
