# What the workflow runs comes from the package (dpbench.pipeline.jobs, as `dpbench grid --jobs` lists
# it); this file holds what needs Snakemake: commands, environments, inputs, resources, fingerprints.
import os
import shlex
import sys

from snakemake.exceptions import WorkflowError
from snakemake_interface_executor_plugins.settings import DeploymentMethod
from snakemake.utils import min_version

from dpbench.pipeline import cluster, fingerprint, jobs, watch
from dpbench.pipeline.grid import ConfigError

min_version("9.0")

CONDA = DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method
PYTHON = "python" if CONDA else os.path.relpath(sys.executable)  # the jobs' interpreter (below)
try:
    # one line naming the key and the file, as `dpbench grid` prints it (a --configfile without
    # grid: would inherit the default config's grid, and is refused); the plugins it names must be
    # found by the jobs' interpreter (not checked under conda, whose environments come later)
    JOBS = jobs.workflow_jobs(config, CONFIG_FILES, workflow.overwrite_configfiles,
                              workflow.config_settings.overwrite_config,
                              None if CONDA else (PYTHON, os.path.relpath(SRC)))
except ConfigError as exc:
    raise WorkflowError(str(exc))
CELLS, AUDIT, AUDITS, FIGURES = JOBS.cells, JOBS.audit, JOBS.audits, JOBS.figures
RESULTS = config["results_dir"]
AUDIT_TABLE = JOBS.audit_table
run_file, audit_file, figure_input = JOBS.run_file, JOBS.audit_file, JOBS.figure_input

# Jobs stop when this Snakemake process is gone, even after kill -9 (dpbench.pipeline.watch);
# not a param: it changes with every invocation.
os.environ[watch.ENV] = watch.token()


# What each job runs (jobs.dpbench_command: this workflow's src/ before the caller's PYTHONPATH,
# the venv's interpreter or conda's) and where it finds the data: neither changes a result, so
# neither is a rerun trigger: functions of `resources`, which Snakemake does not compare
# (moving the data or the repository reruns nothing: tests/workflow/test_reruns.py).
def DPBENCH(wildcards, resources):
    return jobs.dpbench_command(os.path.relpath(SRC), PYTHON)


def DATA_DIR(wildcards, resources):
    return shlex.quote(config["data_dir"])


# Deployment comes from the profile, never the config: GPUs given to training (`set-resources:
# train: gpu: N`, or a gres naming one) choose the device and conda environment (cuda or cpu).
def _train_has_gpu():
    settings = workflow.resource_settings.overwrite_resources.get("train", {})

    def setting(name):
        resource = settings.get(name)
        if resource is None:
            return None
        return resource.raw if resource.is_evaluable() else resource.value

    gpu, gres = setting("gpu"), setting("gres")
    return str(gpu or 0).strip() not in ("0", "") or "gpu" in str(gres or "")


TRAIN_DEVICE = "cuda" if _train_has_gpu() else "cpu"
# One conda environment per kind of rule: aggregation and figures need no torch.
ENVS = {
    "data": "../../envs/data.yaml",
    "matrix": "../../envs/matrix.yaml",
    "train": f"../../envs/train-{TRAIN_DEVICE}.yaml",
    "analysis": "../../envs/analysis.yaml",
}


# Matrix mechanisms' files (Cell.cache_files), made once by matrix.smk for every cell sharing them.
MATRIX_CACHE = f"{RESULTS}/cache/matrix"
STREAMED_CACHE = f"{RESULTS}/cache/streaming"  # the folder's first name: runs record these paths


def train_inputs(wildcards):
    cell = CELLS[wildcards.cell]
    pretrained = JOBS.pretrained_of(cell)  # a fine-tuning cell's public checkpoint (pretrain.smk)
    files = {**JOBS.data_inputs(cell), **{k: str(p) for k, p in JOBS.cache_files(cell).items()}, **JOBS.prefix_inputs(cell)}
    return {**files, "pretrained": pretrained} if pretrained else files


def train_args(wildcards):
    return JOBS.train_args(CELLS[wildcards.cell])


def figure_options(figure):
    return jobs.figure_options(FIGURES[figure])


# Incremental reruns: a hash of the code behind each job is one of its params, so Snakemake reruns exactly
# the jobs whose code changed (dpbench.pipeline.fingerprint): one optimizer's or problem's modules its cells,
# the harness all cells, one figure that figure, comments none; a local encoder's files (JOBS.start_code) its cells.
def train_code(wildcards):
    cell = CELLS[wildcards.cell]
    return fingerprint.optimizer_fingerprint(cell.optimizer) + fingerprint.problem_fingerprint(cell.problem) + JOBS.start_code(cell)


def audit_code(wildcards):
    optimizer = JOBS.audit_job(wildcards.audit)[0]
    return fingerprint.modules_fingerprint(("dpbench.audit.run",)) + fingerprint.optimizer_fingerprint(optimizer)


MATRIX_CODE = fingerprint.modules_fingerprint(("dpbench.matrix.store.dense_files", "dpbench.matrix.store.noise_files"))
STREAMED_CODE = fingerprint.modules_fingerprint(("dpbench.mechanisms.streamed",))


# Training runs that share one GPU at a time: the profile's `resources: gpu_slots` (each run
# holds one slot), 1 where the profile sets none.
def _gpu_slots():
    resource = workflow.global_resources.get("gpu_slots")
    value = None if resource is None else resource.value
    return int(value) if isinstance(value, (int, float)) and value >= 1 else 1


GPU_SLOTS = _gpu_slots()


# Cluster resources of a training cell (dpbench.pipeline.cluster: from its problem, batch size,
# epochs, device and the slowdown of GPU_SLOTS runs sharing a GPU; they grow with each retry);
# the SLURM profile bundles runs of similar length into shared jobs.
def train_resource(name):
    return lambda wildcards, attempt: cluster.resources(CELLS[wildcards.cell], config["train"], attempt,
                                                        on_gpu=TRAIN_DEVICE == "cuda",
                                                        cells_per_gpu=GPU_SLOTS)[name]


def train_group(wildcards):
    return cluster.bundle(CELLS[wildcards.cell], config["train"], on_gpu=TRAIN_DEVICE == "cuda")


def matrix_resource(name):
    def resource(wildcards, attempt):
        from dpbench.matrix.store.keys import parse_dense_key

        _, k, b, _ = parse_dense_key(wildcards.factorization)
        return cluster.factorization_resources(k * b, attempt)[name]

    return resource


# Public pretraining (pretrain.smk): a checkpoint's --recipe (a name, or the JSON of a recipe the
# config changes: pretrain.fields) and threads; the committed checkpoints' folder beside this
# Snakefile is no result, so not a rerun trigger (as DATA_DIR).
pretrain_recipe = lambda wildcards: JOBS.pretrain_job(wildcards.recipe, wildcards.pretrain_key)[0]
pretrain_threads = lambda wildcards: JOBS.pretrain_job(wildcards.recipe, wildcards.pretrain_key)[1]
PRETRAINED_DIR = lambda wildcards, resources: shlex.quote(os.path.relpath(os.path.join(workflow.basedir, *jobs.COMMITTED_PRETRAINED)))
