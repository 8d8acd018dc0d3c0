# Frozen prefixes of encoder problems (dpbench.problems.prefix_store): each record's pooled feature
# (mode head) or hidden states entering the last block (mode last-block), computed once per
# problem, encoder and mode that the config's cells read (config key prefix_store: JOBS.prefix_store_of)
# and shared by all of them. Written to temporary names and renamed (the activations last), so a
# reader never sees a partial store; each store is the output of exactly one job, whose command
# verifies and keeps a store already there. Its data manifest is an input: new records make it again.
PREFIX_CACHE = f"{RESULTS}/cache/prefix"
PREFIX_CODE = fingerprint.modules_fingerprint(("dpbench.problems.prefix_store",))
# a store's (dataset, `dpbench prefix-store` arguments), by its path (JOBS.prefix_store_job)
PREFIX_STORE = "{0}/{1.prefix_problem}/{1.prefix_encoder}/{1.prefix_mode}.npy"


wildcard_constraints:
    prefix_problem=r"[A-Za-z0-9]+",
    prefix_encoder=r"[A-Za-z0-9._-]+",
    prefix_mode=r"head|last-block",


rule prefix_store:
    input:
        manifest=lambda wildcards: JOBS.manifest(JOBS.prefix_store_job(PREFIX_STORE.format(PREFIX_CACHE, wildcards))[0]),
    output:
        store=f"{PREFIX_CACHE}/{{prefix_problem}}/{{prefix_encoder}}/{{prefix_mode}}.npy",
        records=f"{PREFIX_CACHE}/{{prefix_problem}}/{{prefix_encoder}}/{{prefix_mode}}.records.npy",
        sidecar=f"{PREFIX_CACHE}/{{prefix_problem}}/{{prefix_encoder}}/{{prefix_mode}}.json",
    log:
        f"{RESULTS}/logs/prefix/{{prefix_problem}}/{{prefix_encoder}}/{{prefix_mode}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/prefix/{{prefix_problem}}/{{prefix_encoder}}/{{prefix_mode}}.tsv"
    params:
        dpbench=DPBENCH,
        args=lambda wildcards: JOBS.prefix_store_job(PREFIX_STORE.format(PREFIX_CACHE, wildcards))[1],
        data_dir=DATA_DIR,
        code=PREFIX_CODE,
    threads: 1
    resources:
        mem_mb=4000,
        runtime=120,
    conda:
        ENVS["train"]
    shell:
        "{params.dpbench} prefix-store {params.args} --data-dir {params.data_dir} --threads {threads} "
        "--out {output.store:q} > {log:q} 2>&1"
