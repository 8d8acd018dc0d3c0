# Matrix mechanisms: factorize A = B C once per (kind, k, b, tau), write the correlated noise
# C^-1 Z once per (factorization, d, seed). Both write to a temporary name and rename, so a
# reader never sees a partial file; each file is the output of exactly one job.


wildcard_constraints:
    factorization=r"(se|se-lambda|me|me-lambda|identity)-k\d+-b\d+(-tau\d+)?",
    dim=r"\d+",
    noise_seed=r"\d+",


rule factorize:
    output:
        npz=f"{MATRIX_CACHE}/{{factorization}}/factorization.npz",
        report=f"{MATRIX_CACHE}/{{factorization}}/factorization.json",
    log:
        f"{RESULTS}/logs/matrix/{{factorization}}/factorize.log",
    benchmark:
        f"{RESULTS}/benchmarks/matrix/{{factorization}}/factorize.tsv"
    params:
        dpbench=DPBENCH,
        code=MATRIX_CODE,
    threads: 1
    resources:
        mem_mb=matrix_resource("mem_mb"),
        runtime=matrix_resource("runtime"),
    conda:
        ENVS["matrix"]
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads} "
        "{params.dpbench} factorize --key {wildcards.factorization} --out {output.npz} "
        "--report {output.report} > {log} 2>&1"


rule noise:
    input:
        f"{MATRIX_CACHE}/{{factorization}}/factorization.npz",
    output:
        noise=f"{MATRIX_CACHE}/{{factorization}}/noise-d{{dim}}-seed{{noise_seed}}.npy",
        meta=f"{MATRIX_CACHE}/{{factorization}}/noise-d{{dim}}-seed{{noise_seed}}.json",
    log:
        f"{RESULTS}/logs/matrix/{{factorization}}/noise-d{{dim}}-seed{{noise_seed}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/matrix/{{factorization}}/noise-d{{dim}}-seed{{noise_seed}}.tsv"
    params:
        dpbench=DPBENCH,
        code=MATRIX_CODE,
    threads: 1
    resources:
        mem_mb=matrix_resource("mem_mb"),
        runtime=matrix_resource("runtime"),
    conda:
        ENVS["matrix"]
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads} "
        "{params.dpbench} noise --factorization {input} --dim {wildcards.dim} --seed {wildcards.noise_seed} "
        "--out {output.noise} > {log} 2>&1"
