# Config validation and the grid, expanded once (dpbench.pipeline.grid) into CELLS: cell id -> Cell.
import os
import shlex
import sys

from snakemake.exceptions import WorkflowError
from snakemake_interface_executor_plugins.settings import DeploymentMethod
from snakemake.utils import min_version

min_version("9.0")

SRC = os.path.join(workflow.basedir, "src")
sys.path.insert(0, SRC)
from dpbench.pipeline import cluster, watch  # noqa: E402
from dpbench.pipeline.fingerprint import figure_fingerprint, modules_fingerprint, optimizer_fingerprint  # noqa: E402
from dpbench.pipeline.grid import ConfigError, expand as expand_grid, own_audit, refuse_inherited_grid, workflow_config  # noqa: E402

FIGURES_GIVEN = "figures" in config  # else the schema's default, {fig5_1: {}}, fills it in
try:
    # a --configfile without grid: would inherit the default config's grid
    refuse_inherited_grid(workflow.overwrite_configfiles, workflow.config_settings.overwrite_config)
    # what `dpbench grid` checks (dpbench.pipeline.grid.validate), one line naming the key and
    # the file: deployment keys moved to the profiles, non-finite numbers, the schema (defaults
    # filled in), unknown keys, optimizers and hyperparameters, batch sizes, figure options
    workflow_config(config, CONFIG_FILES)
    CELLS = {cell.id: cell for cell in expand_grid(config)}
except ConfigError as exc:
    raise WorkflowError(str(exc))

RESULTS = config["results_dir"]
# Jobs stop when this Snakemake process is gone (kill -9 cannot be caught, and would leave
# them running as orphans): every dpbench command watches the process named here
# (dpbench.pipeline.watch). Not a param: it changes with every invocation.
os.environ[watch.ENV] = watch.token()
# What each job runs (params.dpbench), namely the package from src/ with the interpreter
# running Snakemake (the venv), or the job's conda environment under
# --software-deployment-method conda; and where the data rule and training jobs look for the
# dataset files (params.data_dir). Neither can change a result (the code is fingerprinted,
# the dataset verified against its checksums by every job that reads it), so neither may be
# a rerun trigger: Snakemake compares every param with its recorded value except those it
# derives from a job's input, output, threads or resources, so these two are functions of
# `resources` that do not use it. Moving the data, moving the repository or switching
# between the venv and conda environments thus reruns nothing (tests/test_reruns.py).
CONDA = DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method
PYTHON = "python" if CONDA else os.path.relpath(sys.executable)


def DPBENCH(wildcards, resources):
    return f"PYTHONPATH={shlex.quote(os.path.relpath(SRC))} {shlex.quote(PYTHON)} -m dpbench"


def DATA_DIR(wildcards, resources):
    return shlex.quote(config["data_dir"])



# Deployment (where jobs run, not what they compute) comes from the profile, never from the
# config: the GPUs a training job is given (`set-resources: train: gpu: N`, or a gres naming a
# GPU; none unless the profile says so) choose its device, cuda or cpu, and under
# --software-deployment-method conda its environment, envs/train-cuda.yaml or
# envs/train-cpu.yaml; the profile's `set-threads: train=N` sets its torch threads. Snakemake
# hands the same settings to every job it submits, so a cluster job agrees with its submitter.
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
DATASETS = sorted({cell.dataset for cell in CELLS.values()})


def run_file(cell_id):
    return f"{RESULTS}/runs/{cell_id}.parquet"


def train_args(wildcards):
    cell = CELLS[wildcards.cell]
    args = cell.train_args(config["train"])
    files = cell_files(cell)  # matrix cells also name their factorization (and noise) files
    for name, flag in (("factorization", "--factorization"), ("noise", "--noise-file")):
        if name in files:
            args += [flag, str(files[name])]
    return shlex.join(args)


def dataset_manifest(wildcards):
    return f"{RESULTS}/data/{CELLS[wildcards.cell].dataset}.json"


# Matrix mechanisms (dpbench.mechanisms): a training cell of a dense dpmatrix-* optimizer needs its
# factorization (keyed by kind, k, b, tau) and its noise file (keyed by the factorization,
# the parameter count d and the run seed); a cell of a streamed one (dpmatrix-band,
# dpmatrix-band-amp, dpmatrix-blt) only its factorization (keyed by what determines it:
# dpbench.matrix.store.keys). Rules factorize, factorize_streaming and noise (matrix.smk)
# make them once and every cell that shares them reads them (common random numbers).
MATRIX_CACHE = f"{RESULTS}/cache/matrix"
STREAMING_CACHE = f"{RESULTS}/cache/streaming"


def cell_files(cell):
    """{"factorization": path, "noise": path} of a cell (dpbench.pipeline.grid.Cell.cache_files)."""
    return cell.cache_files(config["train"], f"{RESULTS}/cache")


def train_inputs(wildcards):
    inputs = {"manifest": dataset_manifest(wildcards)}
    inputs.update({name: str(path) for name, path in cell_files(CELLS[wildcards.cell]).items()})
    return inputs


# Incremental reruns: a content hash of the code behind each job is one of its params, so
# Snakemake reruns exactly the jobs whose code changed (see dpbench.pipeline.fingerprint): editing one
# optimizer's module reruns its cells, editing the harness reruns all cells, editing one
# figure reruns that figure.
def train_code(wildcards):
    return optimizer_fingerprint(CELLS[wildcards.cell].optimizer)


MATRIX_CODE = modules_fingerprint(("dpbench.matrix.store.dense_files", "dpbench.matrix.store.noise_files"))
STREAMING_CODE = modules_fingerprint(("dpbench.mechanisms.streamed",))


# Training runs that share one GPU at a time: the profile's `resources: gpu_slots` (each run
# holds one slot), 1 where the profile sets none.
def _gpu_slots():
    resource = workflow.global_resources.get("gpu_slots")
    value = None if resource is None else resource.value
    return int(value) if isinstance(value, (int, float)) and value >= 1 else 1


GPU_SLOTS = _gpu_slots()


# Cluster resources of a training cell (dpbench.pipeline.cluster: from its problem, batch size, epochs
# and device, and, on a GPU, the measured slowdown of GPU_SLOTS runs sharing it; they grow with
# each retry); the SLURM profile bundles runs of similar length into shared jobs.
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


# Figures: those the config asks for, each with its options as `dpbench plot -o KEY=VALUE`.
FIGURES = config["figures"]


def figure_options(figure):
    join = lambda v: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
    options = []
    for key, value in FIGURES[figure].items():
        if key == "filters" and isinstance(value, dict):
            options += [f"filter.{column}={join(v)}" for column, v in value.items()]
        else:
            options.append(f"{key}={join(value)}")
    return " ".join(f"-o {shlex.quote(o)}" for o in options)


# Empirical privacy audits (config key `audit`, rules in audit.smk): one job per optimizer and
# claimed epsilon; "grid" audits the private optimizers of this config's grid.
def _audited_optimizers(names):
    from dpbench.optimizers import OPTIMIZERS, get_optimizer

    if names == "all":
        return sorted(n for n, spec in OPTIMIZERS.items() if spec.private)
    if names == "grid":
        return sorted({c.optimizer for c in CELLS.values() if get_optimizer(c.optimizer).private})
    for name in names:
        if not get_optimizer(name).private:
            raise WorkflowError(f"audit.optimizers: {name!r} is not private: there is no claim to audit")
    return sorted(set(names))


def _audited_epsilons(epsilons):
    if epsilons == "grid":
        return sorted({c.epsilon for c in CELLS.values() if c.epsilon is not None})
    return sorted(set(epsilons))


# a --configfile without audit: gets none (not the default config's, merged under it)
AUDIT = own_audit(config, workflow.overwrite_configfiles, workflow.config_settings.overwrite_config)
AUDITS = (
    [
        f"{o}-eps{float(e):g}"
        for o in _audited_optimizers(AUDIT["optimizers"])
        for e in _audited_epsilons(AUDIT["epsilons"])
    ]
    if AUDIT
    else []
)
if not CELLS and not AUDITS:
    raise WorkflowError("the config has an empty grid and no audit section: nothing to run")
AUDIT_TABLE = f"{RESULTS}/audit/audits.parquet"
if AUDITS:
    FIGURES.setdefault("audit", {})  # a config with audits draws them
elif "audit" in FIGURES:
    raise WorkflowError("figures: 'audit' needs audits (the config key `audit`)")
if not CELLS:  # an audit-only config: no runs table, so only the audit figure
    if not FIGURES_GIVEN:
        FIGURES = {"audit": {}}
    extra = sorted(set(FIGURES) - {"audit"})
    if extra:
        raise WorkflowError(f"figures {extra} need training runs, but the grid is empty")


def audit_file(name):
    return f"{RESULTS}/audit/runs/{name}.parquet"


def audit_code(wildcards):
    return modules_fingerprint(("dpbench.audit.run",)) + optimizer_fingerprint(
        wildcards.optimizer
    )


def figure_extensions(figure):
    """The extensions of the files a figure makes: png and pdf, or md for a table (lm_ranking)."""
    from dpbench.reporting.figures import extensions

    return extensions(figure)


def figure_input(figure):
    """The table a figure is drawn from: the audits for `audit`, the runs for the others."""
    return AUDIT_TABLE if figure == "audit" else f"{RESULTS}/aggregate/runs.parquet"
