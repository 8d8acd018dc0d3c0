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
        data_dir=DATA_DIR,
        code=train_code,
    threads: 1  # the profile's set-threads: train=N raises it
    group:
        train_group
    resources:
        mem_mb=train_resource("mem_mb"),
        runtime=train_resource("runtime"),
        cpus_per_gpu=lambda wildcards, threads: threads,
        # cuda where the profile gives training a GPU, else cpu (common.smk); a resource, not a
        # param, so that moving results between deployments reruns nothing
        device=TRAIN_DEVICE,
    conda:
        ENVS["train"]
    shell:
        # Checkpoints go to OUT.ckpt (every epoch and every 10 minutes): a killed job, rerun
        # (--rerun-incomplete, or a SLURM retry), continues where it stopped.
        "{params.dpbench} train {params.args} --data-dir {params.data_dir} --device {resources.device} "
        "--threads {threads} --run-id {wildcards.cell:q} --out {output:q} > {log:q} 2>&1"
