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


rule all:
    input:
        rules.aggregate.output if CELLS else [],
        [AUDIT_TABLE] if AUDITS else [],
        [f"{RESULTS}/figures/{f}.{ext}" for f in FIGURES for ext in figure_extensions(f)],
    default_target: True
