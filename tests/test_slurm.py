"""Cluster execution: the resource model (dpbench.cluster), the SLURM profiles, and (optional)
a tiny grid through a real single-node SLURM cluster started on this machine."""

import os
import shutil
import subprocess
import time

import pytest
import yaml

from conftest import REPO, snakemake_exe
from dpbench import cluster

PROFILES = REPO / "workflow" / "profiles"
SCRIPTS = REPO / "scripts" / "slurm"
TRAIN = {}


def cell(problem="P2", optimizer="dpsgd", batch_size=256, epochs=2):
    return {"problem": problem, "optimizer": optimizer, "batch_size": batch_size, "epochs": epochs}


def test_steps_follow_the_training_loop():
    assert cluster.planned_steps("P2", 256, 2) == round(2 * 60_000 / 256) == 469
    assert cluster.planned_steps("P1", 1024, 30) == round(30 * 50_000 / 1024) == 1465
    assert cluster.planned_steps("P2", 100, 1, {"train_subset": 1000}) == 10
    assert cluster.planned_steps("P2", 100, 1, {"max_steps": 3}) == 3


def test_resources_of_known_cells():
    # P2, L 256, E 2 on a GPU: 469 steps x (10 ms + 256 x 30 us) = 8.3 s, plus 2 test passes
    seconds = 469 * (0.010 + 256 * 30e-6) + 2 * 10_000 * 30e-6 / 3
    assert cluster.compute_seconds(cell(), TRAIN) == pytest.approx(seconds)
    assert cluster.resources(cell(), TRAIN) == {"mem_mb": 5000, "runtime": 15}
    # the longest Setup 1 run: P1, L 256, E 500 (97,656 steps): about 34 minutes of compute
    long = cluster.resources(cell("P1", "dpsgd", 256, 500), TRAIN)
    assert long["runtime"] == 65 and long["mem_mb"] == 6000
    # on the CPU (a profile without GPUs for training) the (slower) CPU costs apply
    cpu = cluster.resources(cell("P1", "dpsgd", 256, 500), TRAIN, on_gpu=False)
    assert cpu["runtime"] > 4 * long["runtime"] and cpu["mem_mb"] == long["mem_mb"]


def test_matrix_mechanisms_train_at_dp_sgd_cost():
    # correlated noise is one row of a memory-mapped file per step: no T x d history in memory
    for problem, size in (("P3", 1024), ("P1", 2048)):
        dpsgd = cluster.resources(cell(problem, "dpsgd", size, 30), TRAIN)
        assert cluster.resources(cell(problem, "dpmatrix-me-lambda", size, 30), TRAIN) == dpsgd


def test_retries_ask_for_more_and_estimates_grow_with_the_work():
    first, second = cluster.resources(cell(), TRAIN, attempt=1), cluster.resources(cell(), TRAIN, attempt=2)
    assert second["mem_mb"] == 2 * first["mem_mb"] and second["runtime"] >= 2 * first["runtime"] - 5
    one, ten = cluster.compute_seconds(cell(epochs=1), TRAIN), cluster.compute_seconds(cell(epochs=10), TRAIN)
    assert ten == pytest.approx(10 * one, rel=0.01)
    # larger batches: fewer steps, so less per-step overhead for the same epochs
    assert cluster.compute_seconds(cell(batch_size=2048), TRAIN) < cluster.compute_seconds(cell(batch_size=256), TRAIN)


def test_only_short_runs_are_bundled():
    assert cluster.bundle(cell(), TRAIN) == "train_short"
    assert cluster.bundle(cell("P1", "dpsgd", 256, 500), TRAIN) is None
    assert cluster.bundle(cell("P2", "dpsgd", 100, 1), {"max_steps": 3}, on_gpu=False) == "train_short"


def test_factorization_resources():
    small, large = cluster.factorization_resources(1875), cluster.factorization_resources(10_000)
    assert small == {"mem_mb": 4000, "runtime": 15, "cpus_per_task": 4}
    assert large["mem_mb"] == 23000 and large["runtime"] == 510  # 16 x 10k^2 x 8 B; 200 x 2 x 10^12 flops


def test_profiles():
    slurm = yaml.safe_load((PROFILES / "slurm" / "config.yaml").read_text())
    assert slurm["executor"] == "slurm" and slurm["jobs"] == 100 and slurm["retries"] == 2
    assert slurm["default-resources"]["slurm_account"].startswith("CHANGE-ME")
    assert slurm["default-resources"]["slurm_partition"].startswith("CHANGE-ME")
    train = slurm["set-resources"]["train"]
    assert train["gpu"] == 1 and train["slurm_partition"].startswith("CHANGE-ME")
    assert "mem_mb" not in train and "runtime" not in train  # they come from dpbench.cluster via the rule
    assert slurm["group-components"] == {cluster.SHORT_GROUP: 8}
    assert slurm["set-resource-scopes"] == {"gpu": "local"} and slurm["resources"] == {"gpu": 1}

    local = yaml.safe_load((PROFILES / "slurm-local" / "config.yaml").read_text())
    assert local["slurm-status-command"] == "squeue" and local["slurm-no-account"] is True
    text = (PROFILES / "slurm-local" / "config.yaml").read_text()
    assert "slurm_partition" not in text and "slurm_account" not in text and "gres" not in text
    assert local["set-resources"]["train"] == {"gpu": 0}


@pytest.mark.parametrize("profile,device,threads", [("slurm", "cuda", 4), ("slurm-local", "cpu", 1)])
def test_profile_dry_run(profile, device, threads):
    """The profile is the deployment: GPU training (--device cuda, 4 threads) on the cluster,
    CPU training on the GPU-less test cluster."""
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="snakemake-executor-plugin-slurm not installed")
    proc = subprocess.run([snakemake_exe(), "-n", "-p", "--cores", "8", "--profile", PROFILES / profile], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count(f"--device {device} --threads {threads} ") == 6  # config/config.yaml: 6 cells


# --------------------------------------------------------------- a real SLURM cluster (optional)

def _idle_node():
    if not shutil.which("sinfo"):
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    return proc.returncode == 0 and "idle" in proc.stdout


@pytest.fixture(scope="module")
def slurm_cluster():
    """A running single-node cluster: an existing one is used and left running; otherwise
    scripts/slurm/local-cluster.sh starts one (as root) and stops it afterwards. Runs wherever
    it can without installing packages (CI included); DPBENCH_SLURM_TEST=1 also lets the
    script apt-get them, DPBENCH_SLURM_TEST=0 skips."""
    wanted = os.environ.get("DPBENCH_SLURM_TEST")
    if wanted == "0":
        pytest.skip("DPBENCH_SLURM_TEST=0")
    installed = all(shutil.which(p) for p in ("slurmctld", "slurmd", "munged", "sbatch"))
    if wanted != "1" and not (_idle_node() or (os.geteuid() == 0 and installed)):
        pytest.skip("no SLURM cluster here and none can be started without installing packages: "
                    "DPBENCH_SLURM_TEST=1 installs slurm-wlm and munge (root, apt-get) and runs a tiny grid")
    if _idle_node():
        yield "existing"
        return
    if os.geteuid() != 0:
        pytest.skip("no running SLURM cluster, and starting one (scripts/slurm/local-cluster.sh) needs root")
    t0 = time.perf_counter()
    proc = subprocess.run([SCRIPTS / "local-cluster.sh"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"local cluster up in {time.perf_counter() - t0:.1f} s")
    try:
        yield "started"
    finally:
        stop = subprocess.run([SCRIPTS / "local-cluster.sh", "--stop"], capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        status = subprocess.run([SCRIPTS / "local-cluster.sh", "--status"], capture_output=True, text=True)
        assert "running" not in status.stdout, status.stdout


@pytest.mark.slow
def test_tiny_grid_through_slurm(slurm_cluster, tmp_path, fmnist_dir):
    t0 = time.perf_counter()
    proc = subprocess.run([SCRIPTS / "run-tiny-grid.sh", tmp_path / "work"], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "DPBENCH_FMNIST_DIR": str(fmnist_dir)})
    print(f"tiny grid through SLURM in {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout and proc.stdout.count("ok ") >= 6, proc.stdout
    logs = tmp_path / "work" / ".snakemake" / "slurm_logs"
    assert list(logs.glob("group_train_short*/*.log")), "training did not run as a bundled SLURM job"
