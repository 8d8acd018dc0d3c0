"""The Snakemake workflow: lint, deployment from the profiles, and the tiny grid of
.test/config/config.yaml end to end in a temporary directory."""

import re
import subprocess

import pandas as pd
import pytest
import yaml

from conftest import REPO, snakemake_exe
from dpbench.reporting import figures
from dpbench.reporting.results import read_meta


PROFILES = REPO / "workflow" / "profiles"


def snakemake(*args, cwd, timeout=900):
    return subprocess.run([snakemake_exe(), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_lint_is_clean(repo_copy):
    proc = snakemake("--lint", cwd=repo_copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Lints for" not in proc.stdout + proc.stderr


def test_bad_config_value_stops_with_the_key(tmp_path, repo_copy):
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["grid"][0]["batch_sizes"] = [-4]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    proc = snakemake("-n", "--configfile", tmp_path / "bad.yaml", cwd=repo_copy)
    assert proc.returncode != 0
    assert "batch_sizes" in proc.stdout + proc.stderr


def test_a_config_without_a_grid_is_refused_not_given_the_default_grid(tmp_path, repo_copy):
    """Snakemake merges a --configfile over the default config (config/config.yaml): a config
    without grid: would silently train the default's 6 cells."""
    (tmp_path / "nogrid.yaml").write_text(yaml.safe_dump({"results_dir": str(tmp_path / "out"),
                                                          "train": {"max_steps": 2}}))
    proc = snakemake("-n", "--configfile", tmp_path / "nogrid.yaml", cwd=repo_copy)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert f"{tmp_path / 'nogrid.yaml'} has no grid" in out and "config/config.yaml" in out, out[-2000:]


def test_a_config_without_audit_runs_no_audits_of_the_default_config(tmp_path, repo_copy):
    """The default config audits DP-SGD and DP-Dice; a --configfile without audit: must not
    inherit those jobs (Snakemake merges it over config/config.yaml), one with audit: gets its own."""
    config = {"results_dir": str(tmp_path / "out"),
              "grid": [{"problems": ["P2"], "batch_sizes": [64], "epochs": [1], "epsilons": [2],
                        "optimizers": {"dpsgd": {"lr": 0.5}}}]}
    (tmp_path / "noaudit.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "audit.yaml").write_text(yaml.safe_dump({**config, "audit": {"optimizers": "grid", "epsilons": "grid"}}))
    jobs = {}
    for name in ("noaudit", "audit"):
        proc = snakemake("-n", "--configfile", tmp_path / f"{name}.yaml", cwd=repo_copy)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
        jobs[name] = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.splitlines()
                      if re.match(r"^\w+\s+\d+$", line.strip())}
    assert "audit" not in jobs["noaudit"] and jobs["noaudit"]["train"] == 1
    assert jobs["audit"]["audit"] == 1 and jobs["audit"]["train"] == 1  # dpsgd at eps 2 only


def test_the_gpu_profile_trains_in_the_cuda_environment(repo_copy):
    """Deployment is the profile's: the GPU it gives rule train sets --device and the training
    environment (one variable, common.smk's TRAIN_DEVICE). One conda environment per kind of
    rule; Snakemake names each as it prepares them (and stops after that where conda is
    absent, as here). (--device and --threads: the tiny grid below and tests/test_slurm.py.)"""
    envs = snakemake("--containerize", "--profile", PROFILES / "gpu", cwd=repo_copy)
    # (audits always run on the CPU, in float64, in the CPU training environment)
    assert set(re.findall(r"envs/([\w-]+)\.yaml", envs.stdout + envs.stderr)) == {"data", "matrix", "train-cuda",
                                                                                  "train-cpu", "analysis"}


@pytest.mark.slow
def test_tiny_grid_end_to_end(tiny_workflow):
    """.test/config/config.yaml through the whole workflow, as CI runs it (conftest.tiny_workflow):
    data, the matrix stages (factorize -> noise, read by their cells), training, aggregation,
    figures (each kind of rule option) and the report; then every kind of figure (comparison
    bars, seed sensitivity, accuracy heatmaps, best settings, a VAE log-loss heatmap, selection
    on validation) from the real runs table."""
    config = yaml.safe_load((tiny_workflow / "run.yaml").read_text())
    out = tiny_workflow / "results"
    runs = pd.read_parquet(out / "aggregate" / "runs.parquet")
    assert len(runs) == 6 and set(runs.problem) == {"P2", "P3"}
    assert set(runs.optimizer) == {"dpsgd", "sgd", "dpmatrix-se", "dpmatrix-me-lambda"}
    assert (runs.status == "completed").all() and (runs.steps == 3).all()
    assert runs.groupby(["problem", "optimizer", "lr", "target_epsilon"]).size().max() == 2  # two seeds: Fig. 5.3
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
    # the matrix cells read the factorization and noise files the workflow made: N = 1000 - 100
    # held out, b = N // L = 9 batches, k = E epochs
    assert sorted(p.name for p in (out / "cache" / "matrix").iterdir()) == ["me-lambda-k2-b9-tau4", "se-k1-b9"]
    matrix = runs[runs.optimizer.str.startswith("dpmatrix")].set_index("optimizer")
    assert matrix.loc["dpmatrix-se", "planned_steps"] == 9 and matrix.loc["dpmatrix-me-lambda", "planned_steps"] == 18
    for optimizer, key in (("dpmatrix-se", "se-k1-b9"), ("dpmatrix-me-lambda", "me-lambda-k2-b9-tau4")):
        privacy = read_meta(tiny_workflow / matrix.loc[optimizer, "path"])["privacy"]
        assert privacy["matrix"]["key"] == key, privacy["matrix"]
        # the workflow's cached files, not a standalone run's own cache
        assert f"cache/matrix/{key}/noise-d" in privacy["noise_file"], privacy
    for figure in config["figures"]:
        assert (out / "figures" / f"{figure}.png").stat().st_size > 10_000
        assert (out / "figures" / f"{figure}.pdf").stat().st_size > 5_000
    # every kind of figure has data in the real table (the workflow drew three; the rest here):
    # drawn from runs, not the placeholder of an empty selection ("no runs ...")
    for figure, options in {**config["figures"], "fig5_3": {}, "fig5_4": {"problem": "P2"},
                            "fig5_5": {"problem": "P2"}, "fig5_8": {}}.items():
        fig = figures.build(figure, runs, **options)
        assert fig.axes and not [t.get_text() for t in fig.texts if t.get_text().startswith("no ")], figure
        figures.plt.close(fig)
    # the default profile: training on the CPU, one thread per job
    assert (tiny_workflow / "snakemake.log").read_text().count("--device cpu --threads 1 ") == 6
    for run_file in (out / "runs").rglob("*.parquet"):  # the config's train settings reached every run
        meta = read_meta(run_file)
        assert meta["config"]["max_steps"] == 3 and meta["config"]["accountant"] == "rdp"
        assert meta["environment"]["device"] == "cpu" and meta["environment"]["torch_threads"] == 1
    assert list((out / "logs" / "train").rglob("*.log")) and list((out / "benchmarks").rglob("*.tsv"))
    report = snakemake("--configfile", "run.yaml", "--report", "report.html", cwd=tiny_workflow)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (tiny_workflow / "report.html").stat().st_size > 100_000
    # nothing left to do: a second invocation runs no job
    again = snakemake("--configfile", "run.yaml", "--cores", "2", "-n", cwd=tiny_workflow)
    assert "Nothing to be done" in again.stdout + again.stderr
