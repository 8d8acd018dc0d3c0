rule data:
    output:
        f"{RESULTS}/data/{{dataset}}.json",
    log:
        f"{RESULTS}/logs/data/{{dataset}}.log",
    params:
        dpbench=DPBENCH,
        data_dir=DATA_DIR,
    conda:
        ENVS["data"]
    shell:
        "{params.dpbench} data --dataset {wildcards.dataset} --data-dir {params.data_dir} "
        "--manifest {output:q} > {log:q} 2>&1"
