rule train:
    input:
        unpack(train_inputs),
    output:
        f"{RESULTS}/runs/{{cell}}.parquet",
    log:
        f"{RESULTS}/logs/train/{{cell}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/train/{{cell}}.tsv"
    params:
        dpbench=DPBENCH,
        args=train_args,
        data_dir=config["data_dir"],
    threads: config["train"]["threads"]
    resources:
        mem_mb=4000,
    conda:
        ENV
    shell:
        "{params.dpbench} train {params.args} --data-dir {params.data_dir} --threads {threads} "
        "--run-id {wildcards.cell} --out {output} > {log} 2>&1"
