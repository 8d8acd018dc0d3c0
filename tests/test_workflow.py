"""The Snakemake workflow: lint, and a tiny grid end to end in a temporary directory."""

import subprocess

import pandas as pd
import pytest
import yaml

from conftest import REPO, snakemake_exe
from dpbench.results import read_meta


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


@pytest.mark.slow
def test_tiny_grid_end_to_end(tmp_path, fmnist_dir):
    config = {
        "data_dir": str(fmnist_dir),
        "results_dir": "out",
        "train": {"max_steps": 3, "train_subset": 1000, "test_subset": 200, "validation_size": 100, "threads": 1,
                  "device": "cpu"},
        # every kind of figure: comparison bars, seed sensitivity, accuracy heatmaps, best settings,
        # a VAE log-loss heatmap, and selection on validation
        "figures": {"fig5_1": {}, "fig5_3": {}, "fig5_4": {"problem": "P2"}, "fig5_5": {"problem": "P2"},
                    "fig5_6": {"select_by": "val"}, "fig5_8": {}},
        "grid": [{"problems": ["P2"], "batch_sizes": [100], "epsilons": [1, 10], "epochs": [1], "seeds": 2,
                  "optimizers": {"dpsgd": {"lr": [0.5, 1.0]}, "sgd": {"lr": [0.1]}}},
                 {"problems": ["P3"], "batch_sizes": [100], "epsilons": [10], "epochs": [1],
                  "optimizers": {"dpsgd": {"lr": [0.5]}}}],
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake("--snakefile", REPO / "Snakefile", "--directory", tmp_path, "--configfile",
                     tmp_path / "config.yaml", "--profile", REPO / "workflow" / "profiles" / "default", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    runs = pd.read_parquet(out / "aggregate" / "runs.parquet")
    assert len(runs) == 11 and set(runs.optimizer) == {"dpsgd", "sgd"} and set(runs.problem) == {"P2", "P3"}
    assert (runs.status == "completed").all() and (runs.steps == 3).all()
    private = runs[runs.private]
    assert (private.epsilon <= private.target_epsilon).all()
    epochs = pd.read_parquet(out / "aggregate" / "epochs.parquet")
    assert set(epochs.run_id) == set(runs.run_id)
    classifier = runs.problem == "P2"
    assert runs[classifier].test_accuracy_at_best_val.notna().all() and (runs.n_val == 100).all()
    assert runs[~classifier].test_loss_at_best_val.notna().all()  # the VAE: loss only
    for figure in config["figures"]:
        assert (out / "figures" / f"{figure}.png").stat().st_size > 10_000
        assert (out / "figures" / f"{figure}.pdf").stat().st_size > 5_000
    report = snakemake("--snakefile", REPO / "Snakefile", "--directory", tmp_path, "--configfile",
                       tmp_path / "config.yaml", "--report", tmp_path / "report.html", cwd=tmp_path)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (tmp_path / "report.html").stat().st_size > 100_000
    for run_file in (out / "runs").rglob("*.parquet"):
        assert read_meta(run_file)["config"]["max_steps"] == 3
    assert list((out / "logs" / "train").rglob("*.log")) and list((out / "benchmarks").rglob("*.tsv"))
    # nothing left to do: a second invocation runs no job
    again = snakemake("--snakefile", REPO / "Snakefile", "--directory", tmp_path, "--configfile",
                      tmp_path / "config.yaml", "--cores", "2", "-n", cwd=tmp_path)
    assert "Nothing to be done" in again.stdout + again.stderr
