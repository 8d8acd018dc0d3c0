# Config validation and the grid, expanded once (dpbench.grid) into CELLS: cell id -> Cell.
import os
import shlex
import sys

from snakemake.exceptions import WorkflowError
from snakemake_interface_executor_plugins.settings import DeploymentMethod
from snakemake.utils import min_version, validate

min_version("9.0")

SRC = os.path.join(workflow.basedir, "src")
sys.path.insert(0, SRC)
from dpbench.grid import ConfigError, expand as expand_grid  # noqa: E402

validate(config, "../schemas/config.schema.yaml")
try:
    CELLS = {cell.id: cell for cell in expand_grid(config)}
except ConfigError as exc:
    raise WorkflowError(str(exc))

RESULTS = config["results_dir"]
# What each job runs (passed in as params.dpbench), namely the package from src/ with the
# interpreter running Snakemake (the venv), or the job's conda environment under
# --software-deployment-method conda. Paths are relative to the working directory, so that
# moving the repository does not change the rules' params and rerun everything.
CONDA = DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method
PYTHON = "python" if CONDA else os.path.relpath(sys.executable)
DPBENCH = f"PYTHONPATH={shlex.quote(os.path.relpath(SRC))} {shlex.quote(PYTHON)} -m dpbench"
ENV = f"../../envs/{config['software_env']}.yaml"
DATASETS = sorted({cell.dataset for cell in CELLS.values()})


def run_file(cell_id):
    return f"{RESULTS}/runs/{cell_id}.parquet"


def train_args(wildcards):
    return shlex.join(CELLS[wildcards.cell].train_args(config["train"]))


def dataset_manifest(wildcards):
    return f"{RESULTS}/data/{CELLS[wildcards.cell].dataset}.json"
