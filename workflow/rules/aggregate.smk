rule aggregate:
    input:
        runs=[run_file(cell_id) for cell_id in sorted(CELLS)],
        audits=[AUDIT_TABLE] if AUDITS else [],
    output:
        runs=f"{RESULTS}/aggregate/runs.parquet",
        epochs=f"{RESULTS}/aggregate/epochs.parquet",
    log:
        f"{RESULTS}/logs/aggregate.log",
    params:
        dpbench=DPBENCH,
        audits=lambda wildcards, input: f"--audits {shlex.quote(input.audits[0])}" if input.audits else "",
    conda:
        ENVS["analysis"]
    shell:
        "{params.dpbench} aggregate {input.runs:q} {params.audits} --out-runs {output.runs:q} "
        "--out-epochs {output.epochs:q} > {log:q} 2>&1"
