"""The Snakemake workflow: lint, deployment from the profiles, and the tiny grid of
.test/config/config.yaml end to end in a temporary directory."""

import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import REPO, snakemake_exe, tree_env
from dpbench.reporting import figures
from dpbench.reporting.results import read_meta


PROFILES = REPO / "workflow" / "profiles"


def snakemake(*args, cwd, timeout=900):
    return subprocess.run([snakemake_exe(), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=tree_env(cwd))


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


def test_audits_test_the_configs_delta(tmp_path, repo_copy):
    """An audit tests the claim (epsilon, delta) the runs make: train.delta of the config, not
    the command's default of 1e-5."""
    config = {"results_dir": str(tmp_path / "out"), "train": {"delta": 1.0e-6},
              "grid": [{"problems": ["P2"], "batch_sizes": [64], "epochs": [1], "epsilons": [2],
                        "optimizers": {"dpsgd": {"lr": 0.5}}}],
              "audit": {"optimizers": "grid", "epsilons": "grid"}}
    (tmp_path / "delta.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake("-n", "-p", "--configfile", tmp_path / "delta.yaml", cwd=repo_copy)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-2000:]
    audit_commands = [line for line in out.splitlines() if " audit --optimizer dpsgd" in line]
    assert audit_commands and all("--delta 1e-06 " in line for line in audit_commands), out[-3000:]


@pytest.mark.parametrize("config", [".test/config/config.yaml", "config/audit.yaml", ".test/config/finetune.yaml"])
def test_dpbench_grid_lists_every_job_snakemake_runs(repo_copy, config):
    """The package's expansion (`dpbench grid --jobs`) and Snakemake's dry run agree rule by
    rule: datasets, matrix stages, cells, aggregate, audits, figures (Snakemake adds `all`)."""
    from collections import Counter

    from dpbench.pipeline.jobs import load_jobs

    proc = snakemake("-n", "--configfile", REPO / config, cwd=repo_copy)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    counts = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.splitlines()
              if re.match(r"^\w+\s+\d+$", line.strip())}
    listing = load_jobs(REPO / config).listing()
    assert counts == {**Counter(rule for rule, _ in listing), "all": 1, "total": len(listing) + 1}


def test_the_gpu_profile_trains_in_the_cuda_environment(repo_copy):
    """Deployment is the profile's: the GPU it gives rule train sets --device and the training
    environment (one variable, common.smk's TRAIN_DEVICE). One conda environment per kind of
    rule; Snakemake names each as it prepares them (and stops after that where conda is
    absent, as here). (--device and --threads: the tiny grid below and tests/pipeline/test_slurm.py.)"""
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
    assert sorted(zip(audits.optimizer, audits.seed, audits.file.map(lambda f: Path(f).name))) == [
        ("dpdice", 0, "dpdice-eps10.parquet"), ("dpdice", 1, "dpdice-eps10-seed1.parquet"),
        ("dpsgd", 0, "dpsgd-eps10.parquet"), ("dpsgd", 1, "dpsgd-eps10-seed1.parquet")]
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


# ------------------------------------------ config errors: one line naming the key and the file
# The workflow validates through dpbench.pipeline.grid (as `dpbench grid` does) before any job:
# each case below is one bad config (the tiny grid's, edited), and both the Snakefile and
# `dpbench grid` must print exactly this line. {file} is the config file given.

def _tiny():
    return yaml.safe_load((REPO / ".test" / "config" / "config.yaml").read_text())


def _edit(change):
    def make(path):
        config = _tiny()
        change(config)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    return make


def _twice(key):
    """The tiny config with ``key`` given twice, on its first two lines."""
    def make(path):
        config = _tiny()
        value = config.pop(key)
        path.write_text(f"{key}: {value}\n{key}: elsewhere\n" + yaml.safe_dump(config, sort_keys=False))
    return make


CONFIG_ERRORS = {
    "schema": (_edit(lambda c: c["grid"][0].update(batch_sizes=[-4])),
               "config key grid.0.batch_sizes.0: -4 is less than the minimum of 1 ({file})"),
    "unknown-top-level-key": (_edit(lambda c: c.update(gird=[])),
                              "config key gird: unknown key (did you mean 'grid'?) ({file})"),
    "unknown-nested-key": (_edit(lambda c: c["train"].update(acountant="rdp")),
                           "config key train.acountant: unknown key (did you mean 'accountant'?) ({file})"),
    "duplicate-key": (_twice("results_dir"),
                      "config key results_dir: given twice (lines 1 and 2); YAML would silently keep the last "
                      "value: keep one ({file})"),
    "unknown-figure-option": (_edit(lambda c: c["figures"].update(fig5_1={"bogus": 1})),
                              "config key figures.fig5_1: unknown option 'bogus' of figure fig5_1 (options: problems, "
                              "optimizers, select_by, filters) ({file})"),
    "select-by-val-without-validation": (_edit(lambda c: c["train"].update(validation_size=0)),
                                         "config key figures.fig5_6.select_by: 'val' selects on the validation split, "
                                         "and there is none (set train.validation_size) ({file})"),
    "figure-of-an-untrained-problem": (_edit(lambda c: c["figures"].update(fig5_4={})),
                                       "config key figures.fig5_4.problem: 'P1' (its default) is not trained by the "
                                       "grid (its problems: P2, P3): the figure would be empty ({file})"),
    "figure-of-untrained-epsilons": (_edit(lambda c: c["figures"].update(fig5_6={"epsilons": [3]})),
                                     "config key figures.fig5_6.epsilons: [3] is not trained by the grid (its "
                                     "epsilons: 1, 10): the figure would be empty ({file})"),
    "figure-needing-more-seeds": (_edit(lambda c: c["figures"].update(fig5_3={"min_seeds": 3})),
                                  "config key figures.fig5_3.min_seeds: the figure needs 3 seeds of a setting and the "
                                  "grid trains at most 2: the figure would be empty ({file})"),
    "batch-size-above-the-training-subset": (_edit(lambda c: c["grid"][0].update(batch_sizes=[2000])),
                                             "config key grid.0.batch_sizes: batch size 2000 is above the 900 "
                                             "training examples of P2 (after train.train_subset and validation_size) "
                                             "({file})"),
    "audit-of-a-non-private-optimizer": (_edit(lambda c: c["audit"].update(optimizers=["dpsgd", "sgd"])),
                                         "config key audit.optimizers: 'sgd' is not private: there is no claim to "
                                         "audit ({file})"),
    "train-subset-above-the-dataset": (_edit(lambda c: c["train"].update(train_subset=70000)),
                                       "config key train.train_subset: 70000 is above the 60000 training examples "
                                       "of fashion-mnist ({file})"),
    "test-subset-above-the-test-set": (_edit(lambda c: c["train"].update(test_subset=20000)),
                                       "config key train.test_subset: 20000 is above the 10000 test examples of "
                                       "fashion-mnist ({file})"),
    # not "batch size 100 is above the -100 training examples"
    "validation-size-holding-out-the-training-subset": (
        _edit(lambda c: c["train"].update(validation_size=1100)),
        "config key train.validation_size: 1100 is not below the 1000 training examples of P2 (fashion-mnist after "
        "train.train_subset): none would be left to train on ({file})"),
    # the 93 canaries a P4 run plants would keep N positive: the corpus's records are what counts
    "validation-size-holding-out-the-corpus": (
        _edit(lambda c: (c["train"].update(validation_size=12979, train_subset=None), c.update(grid=[
            {**c["grid"][0], "problems": ["P4"]}]), c.update(figures={}))),
        "config key train.validation_size: 12979 is not below the 12979 training examples of P4 (fortunes): none "
        "would be left to train on ({file})"),
    # the language-model figures draw P4 (their spec's defaults), whatever the grid trains
    "lm-figure-without-p4": (_edit(lambda c: c["figures"].update(lm_exposure={})),
                             "config key figures.lm_exposure.problem: 'P4' (its default) is not trained by the grid "
                             "(its problems: P2, P3): the figure would be empty ({file})"),
    "lm-figure-without-validation": (_edit(lambda c: (c["train"].update(validation_size=0),
                                                      c.update(figures={"lm_ranking": {}}))),
                                     "config key figures.lm_ranking: lm_ranking selects each optimizer's configuration "
                                     "on the validation split, and there is none (set train.validation_size) ({file})"),
    # above what an audit's record holds: it passed the check and failed inside Snakemake
    "audit-seed-out-of-range": (_edit(lambda c: c["audit"].update(seed=[99999999999999999999999])),
                                "config key audit.seed: 99999999999999999999999 is above 9223372036854775807 "
                                "(2**63 - 1), the largest seed an audit's record holds (an int64 column) ({file})"),
    # every seed index is derived from root_seed: 10**11 of them would never end
    "seed-index-out-of-range": (_edit(lambda c: c["grid"][0].update(seeds=[0, 99999999999])),
                                "config key grid.0.seeds: seed index 99999999999 is not below 10000, the seeds a "
                                "grid derives from root_seed ({file})"),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_dpbench_grid_prints_one_line_naming_the_key_and_the_file(tmp_path, capsys, case):
    from dpbench import cli

    make, line = CONFIG_ERRORS[case]
    make(tmp_path / "bad.yaml")
    assert cli.main(["grid", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert err == f"dpbench grid: error: {line.format(file=tmp_path / 'bad.yaml')}\n"


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_the_workflow_stops_before_any_job_with_the_same_line(tmp_path, repo_copy, case):
    make, line = CONFIG_ERRORS[case]
    make(tmp_path / "bad.yaml")
    proc = snakemake("-n", "--configfile", tmp_path / "bad.yaml", cwd=repo_copy)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert line.format(file=tmp_path / "bad.yaml") in out.splitlines(), out[-2000:]
    assert "Job stats" not in out and "jsonschema" not in out.lower()


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, repo_copy, capsys):
    """In the default config (the Snakefile reads it, and each --configfile, strictly before
    Snakemake merges them) and in `dpbench grid`."""
    from dpbench import cli

    (repo_copy / "config" / "config.yaml").write_text("results_dir: results\ngrid:\n  - problems: [P2\n")
    line = ("config file {file}, line 4, column 1: YAML syntax error: while parsing a flow sequence "
            "expected ',' or ']', but got '<stream end>'")
    proc = snakemake("-n", cwd=repo_copy)
    assert proc.returncode != 0
    assert line.format(file="config/config.yaml") in (proc.stdout + proc.stderr).splitlines(), proc.stderr[-2000:]
    assert cli.main(["grid", str(repo_copy / "config" / "config.yaml")]) == 2
    assert capsys.readouterr().err == f"dpbench grid: error: {line.format(file=repo_copy / 'config' / 'config.yaml')}\n"


def test_paths_with_a_space_and_a_non_ascii_letter_stay_whole_and_jobs_keep_the_callers_pythonpath(tmp_path,
                                                                                                  repo_copy,
                                                                                                  fmnist_dir):
    """Every rule's command quotes the paths it names: with results_dir and data_dir holding a
    space and a non-ASCII letter, each command (dry run, every rule) splits into whole paths, and
    the data job, run for real, writes inside results_dir (an unquoted redirect would create
    "<tmp>/r" beside it). The job's interpreter keeps the caller's PYTHONPATH after src/ (a
    sitecustomize on it records the command lines that saw it)."""
    import shlex

    results, data = tmp_path / "r ü space" / "out", tmp_path / "dä ta" / "fashion-mnist"
    data.mkdir(parents=True)
    for f in fmnist_dir.glob("*.gz"):
        (data / f.name).symlink_to(f)
    config = {"results_dir": str(results), "data_dir": str(data), "train": {"max_steps": 2, "validation_size": 100},
              "grid": [{"problems": ["P2"], "batch_sizes": [64], "epochs": [1], "epsilons": [2],
                        "optimizers": {"dpsgd": {"lr": 0.5}, "dpmatrix-se": {"lr": 0.5},
                                       "dpmatrix-band": {"lr": 0.5}}}],
              "audit": {"optimizers": ["dpsgd"], "epsilons": [2], "trials": 20},
              "figures": {"fig5_1": {}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    proc = snakemake("-n", "-p", "--configfile", tmp_path / "c.yaml", cwd=repo_copy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    commands = [line.strip() for line in proc.stdout.splitlines() if " -m dpbench " in line]
    rules = {c.split(" -m dpbench ", 1)[1].split()[0] for c in commands}
    assert rules == {"data", "factorize", "noise", "train", "aggregate", "audit", "audits", "plot"}, rules
    for command in commands:
        for token in shlex.split(command):
            path = token.split("=", 1)[-1]
            if path.startswith(str(tmp_path)):
                assert path.startswith((str(results), str(data))), (token, command)
    site = tmp_path / "caller site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nwith open(os.environ['SEEN_BY'], 'a') as f:\n"
        "    f.write(open('/proc/self/cmdline').read().replace('\\0', ' ') + '\\n')\n")
    env = tree_env(repo_copy, SEEN_BY=str(tmp_path / "seen.txt"))
    env["PYTHONPATH"] = env["PYTHONPATH"] + ":" + str(site)
    manifest = results / "data" / "fashion-mnist.json"
    run = subprocess.run([snakemake_exe(), manifest, "--profile", PROFILES / "default",
                          "--configfile", tmp_path / "c.yaml"], cwd=repo_copy, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert manifest.is_file() and not (tmp_path / "r").exists()
    assert any("-m dpbench data" in line for line in (tmp_path / "seen.txt").read_text().splitlines())
