rule aggregate:
    input:
        [run_file(cell_id) for cell_id in sorted(CELLS)],
    output:
        runs=f"{RESULTS}/aggregate/runs.parquet",
        epochs=f"{RESULTS}/aggregate/epochs.parquet",
    log:
        f"{RESULTS}/logs/aggregate.log",
    params:
        dpbench=DPBENCH,
    conda:
        ENVS["analysis"]
    shell:
        "{params.dpbench} aggregate {input} --out-runs {output.runs} --out-epochs {output.epochs} > {log} 2>&1"
