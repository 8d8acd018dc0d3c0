# Empirical privacy audits (dpbench audit): one job per optimizer, claimed epsilon and seed,
# named <optimizer>-eps<epsilon>[-seed<seed>] (JOBS.audit_job), on the CPU in float64 (as the
# method asks), then one table of all of them.


wildcard_constraints:
    audit=r"[^/]+-eps[0-9.e+-]+?(-seed[0-9]+)?",


rule audit:
    output:
        f"{RESULTS}/audit/runs/{{audit}}.parquet",
    log:
        f"{RESULTS}/logs/audit/{{audit}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/audit/{{audit}}.tsv"
    params:
        dpbench=DPBENCH,
        optimizer=lambda wildcards: JOBS.audit_job(wildcards.audit)[0],
        epsilon=lambda wildcards: f"{JOBS.audit_job(wildcards.audit)[1]:g}",
        trials=lambda wildcards: AUDIT["trials"],
        beta=lambda wildcards: AUDIT["beta"],
        seed=lambda wildcards: JOBS.audit_job(wildcards.audit)[2],
        accountant=config["train"]["accountant"],
        delta=config["train"]["delta"],
        cache=f"{RESULTS}/cache",
        code=audit_code,
    threads: 1
    resources:
        mem_mb=4000,
        runtime=lambda wildcards, attempt: 60 * attempt,
    conda:
        "../../envs/train-cpu.yaml"
    shell:
        "{params.dpbench} audit --optimizer {params.optimizer} --epsilon {params.epsilon} "
        "--trials {params.trials} --beta {params.beta} --seed {params.seed} --accountant {params.accountant} "
        "--delta {params.delta} "
        "--cache-dir {params.cache:q} "
        "--threads {threads} --out {output:q} > {log:q} 2>&1"


rule audit_table:
    input:
        [audit_file(name) for name in AUDITS],
    output:
        AUDIT_TABLE,
    log:
        f"{RESULTS}/logs/audit/audits.log",
    params:
        dpbench=DPBENCH,
    localrule: True
    conda:
        ENVS["analysis"]
    shell:
        "{params.dpbench} audits {input:q} --out {output:q} > {log:q} 2>&1"
