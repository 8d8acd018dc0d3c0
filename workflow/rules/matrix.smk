# Matrix mechanisms: factorize A = B C once per (kind, k, b, tau), write the correlated noise
# C^-1 Z once per (factorization, d, seed); the streamed mechanisms' factorizations (a few
# hundred numbers, no noise file) once per key (dpbench.matrix.store.keys). All write to a
# temporary name and rename, so a reader never sees a partial file; each file is the output of
# exactly one job.


wildcard_constraints:
    factorization=r"(se|se-lambda|me|me-lambda|identity)-k\d+-b\d+(-tau\d+)?",
    streamed_key=r"band-n\d+-b\d+|blt-n\d+-sep\d+-k\d+-m(\d+|auto)|band-auto-N\d+-L\d+-n\d+-eps[0-9.e+-]+-delta[0-9.e+-]+",
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
        blas=lambda wildcards, threads: cluster.BLAS_THREADS.format(threads=threads),
        code=MATRIX_CODE,
    threads: 1
    resources:
        mem_mb=matrix_resource("mem_mb"),
        runtime=matrix_resource("runtime"),
    conda:
        ENVS["matrix"]
    shell:
        "{params.blas}{params.dpbench} factorize --key {wildcards.factorization} --out {output.npz:q} "
        "--report {output.report:q} > {log:q} 2>&1"


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
        blas=lambda wildcards, threads: cluster.BLAS_THREADS.format(threads=threads),
        code=MATRIX_CODE,
    threads: 1
    resources:
        mem_mb=matrix_resource("mem_mb"),
        runtime=matrix_resource("runtime"),
    conda:
        ENVS["matrix"]
    shell:
        "{params.blas}{params.dpbench} noise --factorization {input:q} --dim {wildcards.dim} "
        "--seed {wildcards.noise_seed} --out {output.noise:q} > {log:q} 2>&1"


rule factorize_streamed:
    output:
        f"{STREAMED_CACHE}/{{streamed_key}}.json",
    log:
        f"{RESULTS}/logs/streaming/{{streamed_key}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/streaming/{{streamed_key}}.tsv"
    params:
        dpbench=DPBENCH,
        blas=lambda wildcards, threads: cluster.BLAS_THREADS.format(threads=threads),
        code=STREAMED_CODE,
    threads: 1
    resources:
        mem_mb=2000,
        runtime=30,
    conda:
        # the training environment: the band search shares the accountant and the streamed
        # mechanisms' module (torch) with training
        ENVS["train"]
    shell:
        "{params.blas}{params.dpbench} factorize --key {wildcards.streamed_key} --out {output:q} "
        "> {log:q} 2>&1"
