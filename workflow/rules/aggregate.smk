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
        audits=lambda wildcards, input: f"--audits {input.audits[0]}" if input.audits else "",
    conda:
        ENVS["analysis"]
    shell:
        "{params.dpbench} aggregate {input.runs} {params.audits} --out-runs {output.runs} "
        "--out-epochs {output.epochs} > {log} 2>&1"
