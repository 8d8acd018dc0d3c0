# Public pretraining (dpbench.training.pretrain): one checkpoint per named recipe, its file named
# by the recipe's key and the pretraining code's fingerprint (pretrained_file), so that it is
# made again exactly when either changes and an old checkpoint is never taken for a new one; a
# problem that starts from a checkpoint names pretrained_file(recipe) as its input.
# The command checks that the name it is asked to write is the current one (--expect), resumes a
# killed job from OUT.resume, and writes the sidecar OUT.json (the checkpoint's SHA-256, recipe,
# code, corpora, and the text removed from the public corpus).

from dpbench.training.recipes import RECIPES as PRETRAIN_RECIPES, checkpoint_name

PRETRAIN_CACHE = f"{RESULTS}/cache/pretrain"
PRETRAIN_CODE = fingerprint.pretrain_fingerprint()
# the checkpoint of a named recipe under the current code
pretrained_file = lambda name: f"{PRETRAIN_CACHE}/{checkpoint_name(PRETRAIN_RECIPES[name], PRETRAIN_CODE)}"


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
        data_dir=DATA_DIR,
    threads: lambda wildcards: PRETRAIN_RECIPES[wildcards.recipe].threads
    resources:
        mem_mb=4000,
        runtime=120,
    conda:
        ENVS["train"]
    shell:
        "OMP_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads} MKL_NUM_THREADS={threads} "
        "{params.dpbench} pretrain --recipe {wildcards.recipe} --expect {wildcards.pretrain_key} "
        "--out {output.model} --data-dir {params.data_dir} > {log} 2>&1"
