# Empirical privacy audits (dpbench audit): one job per optimizer and claimed epsilon, on the
# CPU in float64 (as the method asks), then one table of all of them.


wildcard_constraints:
    audit_epsilon=r"[0-9.e+-]+",


rule audit:
    output:
        f"{RESULTS}/audit/runs/{{optimizer}}-eps{{audit_epsilon}}.parquet",
    log:
        f"{RESULTS}/logs/audit/{{optimizer}}-eps{{audit_epsilon}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/audit/{{optimizer}}-eps{{audit_epsilon}}.tsv"
    params:
        dpbench=DPBENCH,
        trials=lambda wildcards: AUDIT["trials"],
        beta=lambda wildcards: AUDIT["beta"],
        seed=lambda wildcards: AUDIT["seed"],
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
        "{params.dpbench} audit --optimizer {wildcards.optimizer} --epsilon {wildcards.audit_epsilon} "
        "--trials {params.trials} --beta {params.beta} --seed {params.seed} --accountant {params.accountant} "
        "--delta {params.delta} "
        "--cache-dir {params.cache} "
        "--threads {threads} --out {output} > {log} 2>&1"


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
        "{params.dpbench} audits {input} --out {output} > {log} 2>&1"
