# Public pretraining (dpbench.training.pretrain): one checkpoint per named recipe, its file named
# by the recipe's key and the pretraining code's fingerprint (JOBS.pretrained_file), so that it
# is made again exactly when either changes and an old checkpoint is never taken for a new one;
# a fine-tuning cell names its recipe's checkpoint as an input (common.smk's train_inputs).
# The command checks that the name it is asked to write is the current one (--expect), copies
# the committed checkpoint of that exact name where one verifies (--reuse: its SHA-256, recipe
# and code; a damaged one stops the job, naming it), else trains, resuming a killed job from
# OUT.resume, and writes the sidecar OUT.json (the checkpoint's SHA-256, recipe, code, corpora,
# and the text removed from the public corpus).
from dpbench.training.recipes import RECIPES as PRETRAIN_RECIPES


PRETRAIN_CACHE = f"{RESULTS}/cache/pretrain"
# the recipe's name or JSON, its threads and where the committed checkpoints are: common.smk


wildcard_constraints:
    recipe="|".join(PRETRAIN_RECIPES),
    pretrain_key=r"[0-9a-f]{16}-[0-9a-f]{16}",


rule pretrain:
    output:
        model=f"{PRETRAIN_CACHE}/{{recipe}}-{{pretrain_key}}.pt",
        sidecar=f"{PRETRAIN_CACHE}/{{recipe}}-{{pretrain_key}}.pt.json",
    log:
        f"{RESULTS}/logs/pretrain/{{recipe}}-{{pretrain_key}}.log",
    benchmark:
        f"{RESULTS}/benchmarks/pretrain/{{recipe}}-{{pretrain_key}}.tsv"
    params:
        dpbench=DPBENCH,
        blas=lambda wildcards, threads: cluster.BLAS_THREADS.format(threads=threads),
        data_dir=DATA_DIR,
        recipe=pretrain_recipe,
        reuse=PRETRAINED_DIR,
    threads: pretrain_threads
    resources:
        mem_mb=4000,
        runtime=120,
    conda:
        ENVS["train"]
    shell:
        "{params.blas}{params.dpbench} pretrain --recipe {params.recipe} --expect {wildcards.pretrain_key} "
        "--out {output.model:q} --reuse {params.reuse} --data-dir {params.data_dir} > {log:q} 2>&1"
