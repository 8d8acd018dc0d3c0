"""The Snakemake workflow: lint, deployment from the profiles, and the tiny grid of
.test/config/config.yaml end to end in a temporary directory."""

import re
import subprocess

import pandas as pd
import pytest
import yaml

from conftest import REPO, snakemake_exe
from dpbench import figures
from dpbench.results import read_meta


PROFILES = REPO / "workflow" / "profiles"
TEST_CONFIG = REPO / ".test" / "config" / "config.yaml"


def snakemake(*args, cwd=REPO, timeout=900):
    return subprocess.run([snakemake_exe(), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_lint_is_clean():
    proc = snakemake("--lint")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Lints for" not in proc.stdout + proc.stderr


def test_bad_config_value_stops_with_the_key(tmp_path):
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["grid"][0]["batch_sizes"] = [-4]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake("-n", "--configfile", tmp_path / "bad.yaml")
    assert proc.returncode != 0
    assert "batch_sizes" in proc.stdout + proc.stderr


def test_a_config_without_a_grid_is_refused_not_given_the_default_grid(tmp_path):
    """Snakemake merges a --configfile over the default config (config/config.yaml): a config
    without grid: would silently train the default's 6 cells."""
    (tmp_path / "nogrid.yaml").write_text(yaml.safe_dump({"results_dir": str(tmp_path / "out"),
                                                          "train": {"max_steps": 2}}))
    proc = snakemake("-n", "--configfile", tmp_path / "nogrid.yaml")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert f"{tmp_path / 'nogrid.yaml'} has no grid" in out and "config/config.yaml" in out, out[-2000:]


def test_the_profile_chooses_device_threads_and_environments():
    """Deployment is the profile's: the GPU it gives rule train sets --device and the training
    environment (one variable, common.smk's TRAIN_DEVICE), its set-threads the threads; the
    config (the science) is the same. (The SLURM profiles: tests/test_slurm.py.)"""
    dry = snakemake("-n", "-p", "--cores", "8", "--profile", PROFILES / "default")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert dry.stdout.count("--device cpu --threads 1 ") == 6  # config/config.yaml: 6 cells
    # one conda environment per kind of rule; Snakemake names each as it prepares them (and
    # stops after that where conda is absent, as here)
    envs = snakemake("--containerize", "--profile", PROFILES / "gpu")
    # (audits always run on the CPU, in float64, in the CPU training environment)
    assert set(re.findall(r"envs/([\w-]+)\.yaml", envs.stdout + envs.stderr)) == {"data", "matrix", "train-cuda",
                                                                                  "train-cpu", "analysis"}


@pytest.mark.slow
def test_tiny_grid_end_to_end(tmp_path, fmnist_dir):
    """.test/config/config.yaml through the whole workflow, as CI runs it: every kind of figure
    (comparison bars, seed sensitivity, accuracy heatmaps, best settings, a VAE log-loss heatmap,
    selection on validation) from real runs, and the report."""
    config = yaml.safe_load(TEST_CONFIG.read_text())
    config["data_dir"] = str(fmnist_dir)
    config["results_dir"] = "out"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake("--snakefile", REPO / "Snakefile", "--directory", tmp_path, "--configfile",
                     tmp_path / "config.yaml", "--profile", REPO / "workflow" / "profiles" / "default", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    runs = pd.read_parquet(out / "aggregate" / "runs.parquet")
    assert len(runs) == 7 and set(runs.optimizer) == {"dpsgd", "sgd"} and set(runs.problem) == {"P2", "P3"}
    assert runs.groupby(["problem", "optimizer", "lr", "target_epsilon"]).size().max() == 2  # two seeds: Fig. 5.3
    assert (runs.status == "completed").all() and (runs.steps == 3).all()
    private = runs[runs.private]
    assert (private.epsilon <= private.target_epsilon).all()
    epochs = pd.read_parquet(out / "aggregate" / "epochs.parquet")
    assert set(epochs.run_id) == set(runs.run_id)
    classifier = runs.problem == "P2"
    assert runs[classifier].test_accuracy_at_best_val.notna().all() and (runs.n_val == 100).all()
    assert runs[~classifier].test_loss_at_best_val.notna().all()  # the VAE: loss only
    # the audits: DP-Dice refuted, DP-SGD not; the runs table says which optimizers were refuted
    audits = pd.read_parquet(out / "audit" / "audits.parquet")
    assert set(zip(audits.optimizer, audits.violation)) == {("dpsgd", False), ("dpdice", True)}
    assert (audits.trials == 200).all()
    assert runs.audit_violation.dtype == "boolean"
    assert (runs.loc[runs.optimizer == "dpsgd", "audit_violation"] == False).all()  # noqa: E712
    assert runs.loc[runs.optimizer == "sgd", "audit_violation"].isna().all()  # not private: not audited
    assert (out / "figures" / "audit.png").stat().st_size > 10_000
    for figure, options in config["figures"].items():
        assert (out / "figures" / f"{figure}.png").stat().st_size > 10_000
        assert (out / "figures" / f"{figure}.pdf").stat().st_size > 5_000
        # drawn from data, not the placeholder of an empty selection ("no runs ...")
        fig = figures.build(figure, runs, **options)
        assert fig.axes and not [t.get_text() for t in fig.texts if t.get_text().startswith("no ")], figure
        figures.plt.close(fig)
    report = snakemake("--snakefile", REPO / "Snakefile", "--directory", tmp_path, "--configfile",
                       tmp_path / "config.yaml", "--report", tmp_path / "report.html", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (tmp_path / "report.html").stat().st_size > 100_000
    for run_file in (out / "runs").rglob("*.parquet"):  # the config's train settings reached every run
        meta = read_meta(run_file)
        assert meta["config"]["max_steps"] == 3 and meta["config"]["accountant"] == "rdp"
        assert meta["environment"]["device"] == "cpu" and meta["environment"]["torch_threads"] == 1
    assert list((out / "logs" / "train").rglob("*.log")) and list((out / "benchmarks").rglob("*.tsv"))
    # nothing left to do: a second invocation runs no job
    again = snakemake("--snakefile", REPO / "Snakefile", "--directory", tmp_path, "--configfile",
                      tmp_path / "config.yaml", "--cores", "2", "-n", cwd=tmp_path)
    assert "Nothing to be done" in again.stdout + again.stderr
