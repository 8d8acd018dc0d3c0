"""Incremental reruns, shown with `snakemake --dry-run` job counts on a copy of the repository
after the tiny workflow of .test/config/config.yaml has run in it (conftest.tiny_workflow): an
optimizer's code change reruns only its cells, a figure's code change only the figures it
draws, a grid change only the cells it adds, a change of a problem the grid does not train (or
of a comment anywhere) nothing; a killed workflow resumes from its checkpoints."""

import contextlib
import re
import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import yaml

from conftest import copy_repo, snakemake_exe, tree_env

pytestmark = pytest.mark.slow


def snakemake(workdir, *args, timeout=600, env=None):
    return subprocess.run([snakemake_exe(), "--cores", "2", "--configfile", "run.yaml", *map(str, args)],
                          cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env or tree_env(workdir))


def dry_run(workdir, *args, **kw) -> tuple[dict[str, int], str]:
    """Jobs a dry run would execute, per rule (its first 'Job stats' table), and its output."""
    proc = snakemake(workdir, "-n", *args, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts, lines = {}, iter(proc.stdout.splitlines())
    for line in lines:
        if line.startswith("Job stats:"):
            for row in lines:
                parts = row.split()
                if not parts:
                    break
                if len(parts) == 2 and parts[1].isdigit() and parts[0] != "total":
                    counts[parts[0]] = int(parts[1])
            break
    return counts, proc.stdout


def planned_jobs(workdir, *args, **kw) -> dict[str, int]:
    return dry_run(workdir, *args, **kw)[0]


PLOTS = {"plot_fig5_1": 1, "plot_fig5_2": 1, "plot_fig5_6": 1}  # the figures of the config


@pytest.fixture(scope="module")
def workdir(tiny_workflow):
    return tiny_workflow


def edit(path, text="\n_AN_EDIT = None\n"):  # code: a comment is no edit of the code (fingerprint.code_text)
    original = path.read_text()
    path.write_text(original + text)
    return lambda: path.write_text(original)


def test_changing_one_optimizer_reruns_only_its_cells(workdir):
    undo = edit(workdir / "src" / "dpbench" / "optimizers" / "dpmatrix.py")
    try:
        jobs, out = dry_run(workdir)
        # the two matrix-mechanism cells, and not their factorizations or noise files (other code)
        assert jobs == {"train": 2, "aggregate": 1, **PLOTS, "all": 1}
        trained = [line.split()[-1] for line in out.splitlines() if line.strip().startswith("output: results/runs/")]
        assert sorted(path.split("/")[3] for path in trained) == ["dpmatrix-me-lambda", "dpmatrix-se"]
    finally:
        undo()


def test_changing_the_harness_reruns_every_cell(workdir):
    undo = edit(workdir / "src" / "dpbench" / "privacy" / "per_sample.py")
    try:
        assert planned_jobs(workdir)["train"] == 6
    finally:
        undo()


def test_changing_one_figure_reruns_only_that_figure(workdir):
    undo = edit(workdir / "src" / "dpbench" / "reporting" / "figures" / "thesis.py",
                "\n\ndef heatmap_data(*args, **kwargs):  # a changed heatmap\n    return _heatmap_data(*args, **kwargs)\n")
    figures = workdir / "src" / "dpbench" / "reporting" / "figures" / "thesis.py"
    text = figures.read_text()
    figures.write_text(text.replace("def heatmap_data(runs", "def _heatmap_data(runs", 1))
    try:  # the heatmap (5.6), not the bar charts (5.1, 5.2)
        assert planned_jobs(workdir) == {"plot_fig5_6": 1, "all": 1}
    finally:
        undo()


def test_changing_a_grid_axis_touches_only_its_cells(workdir):
    config = yaml.safe_load((workdir / "run.yaml").read_text())
    original = yaml.safe_dump(config)
    try:
        config["grid"][0]["optimizers"]["dpsgd"]["lr"] = [0.5, 2.0]  # two new cells (epsilon 1 and 10)
        (workdir / "run.yaml").write_text(yaml.safe_dump(config))
        assert planned_jobs(workdir) == {"train": 2, "aggregate": 1, **PLOTS, "all": 1}
        config["grid"][0]["optimizers"]["dpsgd"]["lr"] = [0.5]
        del config["grid"][0]["optimizers"]["sgd"]  # one cell fewer: nothing to train, a new aggregate
        (workdir / "run.yaml").write_text(yaml.safe_dump(config))
        assert planned_jobs(workdir) == {"aggregate": 1, **PLOTS, "all": 1}
    finally:
        (workdir / "run.yaml").write_text(original)


def test_undoing_every_edit_and_editing_what_the_grid_does_not_run_reruns_nothing(workdir):
    """The tests above edited code, a figure and the grid, and undid each edit: the same
    sources give the same fingerprints, so nothing is out of date. Nor is it after the code of
    P7's encoders changed (the grid trains P2 and P3) and comments and a docstring were added to
    the harness, an optimizer and a figure's module (one dry run for all)."""
    src = workdir / "src" / "dpbench"
    undo = [edit(src / "problems" / "encoders.py"), edit(src / "privacy" / "per_sample.py", "\n# a comment\n"),
            edit(src / "optimizers" / "sgd.py", '\n"""A docstring, which is no code."""\n'),
            edit(src / "reporting" / "figures" / "thesis.py", "\n# a comment\n")]
    try:
        jobs, out = dry_run(workdir)
        assert jobs == {}, out[-3000:]
    finally:
        for u in undo:
            u()


def test_moving_the_data_reruns_nothing(workdir, tmp_path):
    """The dataset's identity is its checksum (verified by every job that reads it), not its
    directory: data_dir pointing at a copy of the same files reruns nothing."""
    config = yaml.safe_load((workdir / "run.yaml").read_text())
    original = yaml.safe_dump(config)
    copy = tmp_path / "elsewhere"
    shutil.copytree(config["data_dir"], copy)
    try:
        config["data_dir"] = str(copy)
        (workdir / "run.yaml").write_text(yaml.safe_dump(config))
        jobs, out = dry_run(workdir)
        assert jobs == {}, out[-3000:]
    finally:
        (workdir / "run.yaml").write_text(original)


FAKE_CONDA = """#!/bin/sh
# just enough of conda for a dry run: Snakemake asks for its version, info and channel priority
case "$1" in
  info) echo '{"conda_version": "24.7.1", "platform": "linux-64", "root_prefix": "/nonexistent",
               "conda_prefix": "/nonexistent", "envs_dirs": [], "pkgs_dirs": []}';;
  --version) echo "conda 24.7.1";;
  config) echo '{"get": {"channel_priority": "strict"}}';;
  *) echo "fake conda: $*" >&2; exit 1;;
esac
"""


def test_switching_to_conda_environments_reruns_nothing(workdir, tmp_path):
    """Results made with the venv's interpreter are up to date under the profile with
    --software-deployment-method conda (the interpreter's path is not a param, the environment
    not a rerun trigger: what computes a result is the fingerprinted code at its pinned
    versions, recorded in every run file). No conda here: a stand-in answers the queries a dry
    run makes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "conda").write_text(FAKE_CONDA)
    (bin_dir / "conda").chmod(0o755)
    env = tree_env(workdir, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    jobs, out = dry_run(workdir, "--profile", "workflow/profiles/default", "--software-deployment-method", "conda",
                        env=env)
    assert jobs == {}, out[-3000:]


def training_jobs(workdir) -> list[psutil.Process]:
    """The `dpbench train` processes working in ``workdir`` (as the recovery steps of docs/running.md find them)."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "dpbench train" in cmd and p.info["cwd"] == str(workdir):
            found.append(p)
    return found


def test_a_killed_workflow_resumes_from_its_checkpoints(tmp_path, fmnist_dir):
    copy_repo(tmp_path)
    config = {"data_dir": str(fmnist_dir), "results_dir": "results",
              "train": {"train_subset": 2000, "test_subset": 200, "accountant": "rdp"},
              "grid": [{"problems": ["P2"], "batch_sizes": [100], "epsilons": [2], "epochs": [4],
                        "optimizers": {"dpsgd": {"lr": [0.5]}}}]}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([snakemake_exe(), "--cores", "1", "--configfile", "run.yaml"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=tree_env(tmp_path))
    runs = tmp_path / "results" / "runs"
    deadline = time.time() + 300
    while not list(runs.rglob("*.ckpt")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    jobs = training_jobs(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # Snakemake dies mid-training (kill -9: it cannot stop its jobs)
    proc.wait()
    try:
        # its training job notices (dpbench.pipeline.watch) and stops within seconds; it neither goes on
        # as an orphan nor finishes the run nobody waits for
        assert jobs, "no training job found"
        gone, alive = psutil.wait_procs(jobs, timeout=10)
        assert not alive, f"orphaned training jobs: {alive}"
        assert not list(runs.rglob("*.parquet")), "the orphaned job finished its run"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert list(runs.rglob("*.ckpt")), "no checkpoint to resume from"
    # a killed Snakemake leaves its lock: --unlock, then rerun. The run file is written
    # atomically, so the job is simply missing its output; its checkpoint is there.
    assert snakemake(tmp_path, "--unlock").returncode == 0
    done = snakemake(tmp_path, "--rerun-incomplete")
    assert done.returncode == 0, done.stderr[-3000:]
    log = next((tmp_path / "results" / "logs" / "train").rglob("*.log")).read_text()
    assert "resumed at step" in log
    assert list(runs.rglob("*.parquet")) and not list(runs.rglob("*.ckpt"))
    assert planned_jobs(tmp_path) == {}


# ------------------------------------------ recovery: the documented next command completes
# Each test damages or deletes a file of the finished tiny workflow, follows the message the
# failure prints (delete the files it names), runs the README's command again and requires
# complete, up-to-date outputs: the file back, the aggregate and figures remade from it, and a
# dry run with nothing to do. Never "Nothing to be done" with a run file missing.

def workflow(workdir):
    """The README's command (profile default: keep-going, rerun-incomplete) on the tiny grid."""
    return snakemake(workdir, "--profile", "workflow/profiles/default")


def run_files(workdir, optimizer):
    return sorted((workdir / "results" / "runs").glob(f"*/{optimizer}/*.parquet"))


def assert_complete(workdir, remade):
    """Every output there, ``remade`` and the tables and figures after it newer than before."""
    aggregate = workdir / "results" / "aggregate" / "runs.parquet"
    assert remade.is_file() and aggregate.stat().st_mtime >= remade.stat().st_mtime
    for figure in ("fig5_1", "fig5_2", "fig5_6"):
        assert (workdir / "results" / "figures" / f"{figure}.png").stat().st_mtime >= aggregate.stat().st_mtime
    import pandas as pd
    runs = pd.read_parquet(aggregate)
    assert len(runs) == 6, runs
    assert planned_jobs(workdir) == {}


def fix_from(output, pattern):
    """The files a failure's message says to delete (relative to the workflow's directory)."""
    found = re.search(pattern, output)
    assert found, output[-3000:]
    return found.groups()


def test_a_deleted_run_file_is_retrained_and_everything_after_it_redone(workdir):
    run = run_files(workdir, "sgd")[0]
    run.unlink()
    assert planned_jobs(workdir) == {"train": 1, "aggregate": 1, **PLOTS, "all": 1}
    done = workflow(workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_complete(workdir, run)


def fails_then_recovers(workdir, run, message, *, names=None, run_removed=True):
    """The workflow fails (its failed job's run file removed, where ``run_removed``), naming in
    ``message`` (a regex; ``names``: how many files it must name) the files to delete; deleted,
    the same command completes every output, ``run`` included."""
    failed = workflow(workdir)
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0 and (not run_removed or not run.exists()), out[-3000:]
    found = fix_from(out, message)
    assert names is None or len(found) == names, found
    for name in found:
        (workdir / name).unlink()
    done = workflow(workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_complete(workdir, run)


def test_a_damaged_noise_file_recovers_with_the_commands_its_message_names(workdir):
    run = run_files(workdir, "dpmatrix-se")[0]
    noise = next((workdir / "results" / "cache" / "matrix").glob("se-*/noise-*.npy"))
    with open(noise, "r+b") as f:  # a bad disk: zeros over the rows' middle
        f.seek(noise.stat().st_size // 2)
        f.write(bytes(4096))
    run.unlink()  # the run reads it again (as after a code change)
    fails_then_recovers(workdir, run, r"delete (\S+) and (\S+); the workflow")
    assert noise.is_file()


def test_a_damaged_factorization_recovers_with_the_commands_its_message_names(workdir):
    run = run_files(workdir, "dpmatrix-se")[0]
    factorization = next((workdir / "results" / "cache" / "matrix").glob("se-*/factorization.npz"))
    factorization.write_bytes(factorization.read_bytes()[:100])  # truncated
    run.unlink()
    fails_then_recovers(workdir, run, r"delete (\S+) \(and (\S+)\); the workflow")


def test_a_damaged_run_file_recovers_with_the_command_its_message_names(workdir):
    run = run_files(workdir, "sgd")[0]
    run.write_bytes(run.read_bytes()[:-200])  # truncated: the aggregate reads it (its time is newer)
    fails_then_recovers(workdir, run, r"run file (\S+) is damaged .*delete it and run the workflow again",
                        names=1, run_removed=False)


def test_a_damaged_checkpoint_is_set_aside_and_the_run_completes(workdir):
    run = run_files(workdir, "sgd")[0]
    run.unlink()
    checkpoint = run.with_name(run.name + ".ckpt")
    checkpoint.write_bytes(b"not a checkpoint")  # a killed job's, damaged
    done = workflow(workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (workdir / "results" / "logs" / "train" / run.relative_to(workdir / "results" / "runs")).with_suffix(".log")
    assert f"checkpoint results/runs/{run.relative_to(workdir / 'results' / 'runs')}.ckpt is damaged" in log.read_text()
    aside = list(run.parent.glob(run.name + ".ckpt.damaged-*"))
    assert len(aside) == 1 and not checkpoint.exists()
    aside[0].unlink()
    assert_complete(workdir, run)
