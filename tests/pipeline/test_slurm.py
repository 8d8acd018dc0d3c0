"""Cluster execution: the resource model (dpbench.pipeline.cluster), the SLURM profiles, and (optional)
a tiny grid through a real single-node SLURM cluster started on this machine."""

import json
import os
import shutil
import subprocess
import time

import pytest
import yaml

from conftest import REPO, run_cli, snakemake_exe, tree_env
from dpbench.pipeline import cluster
from dpbench.pipeline.grid import expand, load_config

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
    # the assumed GPU costs: P2, L 256, E 2: 469 steps x (10 ms + 256 x 30 us) = 8.3 s, plus 2 test passes
    seconds = 469 * (0.010 + 256 * 30e-6) + 2 * 10_000 * 30e-6 / 3
    assumed = cluster.ASSUMED
    assert cluster.compute_seconds(cell(), TRAIN, costs=assumed) == pytest.approx(seconds)
    assert cluster.resources(cell(), TRAIN, costs=assumed) == {"mem_mb": 5000, "runtime": 15}
    # the longest Setup 1 run: P1, L 256, E 500 (97,656 steps): about 34 minutes of compute
    long = cluster.resources(cell("P1", "dpsgd", 256, 500), TRAIN, costs=assumed)
    assert long["runtime"] == 65 and long["mem_mb"] == 6000
    # on the CPU (a profile without GPUs for training) the (slower) CPU costs apply
    cpu = cluster.resources(cell("P1", "dpsgd", 256, 500), TRAIN, on_gpu=False)
    assert cpu["runtime"] > 4 * long["runtime"] and cpu["mem_mb"] == long["mem_mb"]


MEASURED = {"device": "Test GPU", "torch": "x",
            "step_seconds": {"P2": {"dpsgd": {"256": 0.004, "1024": 0.010},
                                    "sgd": {"256": 0.002, "1024": 0.005}}},
            "eval_seconds_per_example": {"P2": 1e-6}, "startup_seconds": 20.0,
            "concurrency_gain": {"P2": {"256": {"1": 1.0, "2": 1.7, "4": 2.5}, "1024": {"1": 1.0, "4": 1.2}},
                                 "P1": {"256": {"1": 1.0, "4": 3.0}}}}


def test_measured_gpu_costs(tmp_path):
    (tmp_path / "costs.json").write_text(json.dumps(MEASURED))
    costs = cluster.GpuCosts.from_file(tmp_path / "costs.json")
    assert costs.source.startswith("measured on Test GPU")
    # measured sizes exactly; linear in L between them; the smallest size's time below; per example above
    assert costs.step("P2", "dpsgd", 256) == 0.004 and costs.step("P2", "dpsgd", 1024) == 0.010
    assert costs.step("P2", "dpsgd", 512) == pytest.approx(0.004 + 0.006 * 256 / 768)
    assert costs.step("P2", "dpsgd", 64) == 0.004 and costs.step("P2", "dpsgd", 2048) == pytest.approx(0.020)
    # cost classes: DP-Adam and matrix variants, the non-private adam; unmeasured ones fall back
    assert costs.step("P2", "adam", 256) == 0.002
    assert cluster.cost_class("dpadamw-bc") == "dpadambc" and cluster.cost_class("dpmatrix-me-lambda") == "dpmatrix-se"
    assert cluster.cost_class("d2p2sgd") is None and cluster.cost_class("d2psgd") == "dpsgd"
    assert costs.step("P2", "dpdisk", 256) == cluster.ASSUMED.step("P2", "dpdisk", 256) == 0.010 + 256 * 30e-6
    assert costs.step("P3", "dpsgd", 256) == cluster.ASSUMED.step("P3", "dpsgd", 256)
    # P2, L 256, E 2: 469 steps of 4 ms and 2 test passes of 10,000 examples at 1 us
    assert cluster.compute_seconds(cell(), TRAIN, costs=costs) == pytest.approx(469 * 0.004 + 2 * 10_000 * 1e-6)
    # the gain of K cells per GPU: the nearest measured L, the largest measured K <= K; other
    # problems the smallest gain measured
    assert costs.gain("P2", 256, 1) == 1.0 and costs.gain("P2", 256, 3) == 1.7 and costs.gain("P2", 300, 16) == 2.5
    assert costs.gain("P2", 2048, 8) == 1.2 and costs.gain("P2", 600, 8) == 1.2 and costs.gain("P2", 400, 8) == 2.5
    assert costs.gain("P3", 256, 4) == 2.5 and costs.gain("P3", 1024, 4) == 1.2 and cluster.ASSUMED.gain("P2", 256, 8) == 1.0
    assert costs.gain("P3", 256, 2) == 1.0  # P1's largest measured K <= 2 is 1: no gain claimed
    assert costs.gain("P2", 512, 4) == 1.2  # 256 and 1024 equally near (by ratio): the smaller gain
    # a run sharing its GPU with 3 others takes 4 / gain(4) as long; the runtime asks for that
    assert cluster.slowdown(cell(), True, 4, costs) == pytest.approx(4 / 2.5)
    assert cluster.slowdown(cell(), False, 4, costs) == 1.0 and cluster.slowdown(cell(), True, 1, costs) == 1.0
    # P2, L 1024, E 300: 17,578 steps of 10 ms + 300 test passes = 178.8 s alone, 1.5 x 178.8 s
    # + 10 min -> 15 min; with 4 runs on the GPU 4 / 1.2 x 178.8 s = 596 s -> 24.9 -> 25 min
    long = cell("P2", "dpsgd", 1024, 300)
    assert cluster.compute_seconds(long, TRAIN, costs=costs) == pytest.approx(17_578 * 0.010 + 300 * 10_000 * 1e-6)
    assert cluster.resources(long, TRAIN, costs=costs) == {"mem_mb": 5000, "runtime": 15}
    assert cluster.resources(long, TRAIN, costs=costs, cells_per_gpu=4) == {"mem_mb": 5000, "runtime": 25}
    assert cluster.resources(long, TRAIN, on_gpu=False, cells_per_gpu=4) == cluster.resources(long, TRAIN, on_gpu=False)
    cells = [cell(), cell(epochs=4)]
    alone = (469 * 0.004 + 0.02 + 20) + (938 * 0.004 + 0.04 + 20)
    assert cluster.gpu_hours(cells, TRAIN, 1, costs) == pytest.approx(alone / 3600)
    assert cluster.gpu_hours(cells, TRAIN, 4, costs) == pytest.approx(alone / 2.5 / 3600)
    (tmp_path / "bad.json").write_text(json.dumps({"device": "x"}))
    with pytest.raises(ValueError, match="not a GPU cost file"):
        cluster.GpuCosts.from_file(tmp_path / "bad.json")


def test_the_cost_class_is_read_from_the_optimizer_spec(tmp_path, monkeypatch):
    """A spec's cost_class decides which measured step stands for it (none: the assumed cost),
    read from the torch-free catalog (tests/pipeline/test_catalog.py holds it equal to the spec)."""
    import dataclasses

    from dpbench.pipeline import catalog

    (tmp_path / "costs.json").write_text(json.dumps(MEASURED))
    costs = cluster.GpuCosts.from_file(tmp_path / "costs.json")
    assert costs.step("P2", "d2p2sgd", 256) == cluster.ASSUMED.step("P2", "d2p2sgd", 256) == 0.010 + 256 * 30e-6
    monkeypatch.setitem(catalog.OPTIMIZERS, "d2p2sgd", dataclasses.replace(catalog.OPTIMIZERS["d2p2sgd"],
                                                                         cost_class="dpsgd"))
    assert cluster.cost_class("d2p2sgd") == "dpsgd" and costs.step("P2", "d2p2sgd", 256) == 0.004


def test_default_costs_are_the_committed_measurement_or_assumed():
    if cluster.COSTS_FILE.exists():
        assert cluster.COSTS == cluster.GpuCosts.from_file(cluster.COSTS_FILE)
        assert {"P1", "P2", "P3"} <= set(cluster.COSTS.step_seconds)
    else:
        assert cluster.COSTS is cluster.ASSUMED


def test_committed_gpu_costs_follow_the_committed_h100_measurements():
    """src/dpbench/gpu_costs.json is benchmarks/bench_gpu.py costs of the committed H100 results:
    step seconds of the throughput run, and each K's gain = its measured aggregate steps/s over
    one process's steady-state steps/s from the throughput run (not the concurrency run's own
    K = 1, which ran slower)."""
    results = REPO / "benchmarks" / "results" / "h100"
    if not cluster.COSTS_FILE.exists():
        pytest.skip("no committed GPU cost file")
    raw = json.loads(cluster.COSTS_FILE.read_text())
    tp = json.loads((results / "part1" / "throughput.json").read_text())
    steady = {(r["problem"], r["L"], r["method"]): r for r in tp["rows"] if "s_per_step" in r}
    assert raw["device"] == tp["environment"]["device"] == "NVIDIA H100 80GB HBM3"
    assert raw["step_seconds"]["P1"]["dpsgd"]["2048"] == steady[("P1", 2048, "dpsgd")]["s_per_step"]
    rows = [r for f in ("part1/concurrency.json", "large-L/concurrency.json")
            for r in json.loads((results / f).read_text())["rows"]]
    assert len(rows) == 25
    for r in rows:
        gain = raw["concurrency_gain"][r["problem"]][str(r["L"])][str(r["K"])]
        one = steady[(r["problem"], r["L"], r["optimizer"])]["steps_per_s"]
        assert gain == (1.0 if r["K"] == 1 else pytest.approx(r["aggregate_steps_per_s"] / one))
    # P1 at L = 2048: 8 processes, 112.0 steps/s together; one process alone, 122.2 steps/s
    assert raw["concurrency_gain"]["P1"]["2048"]["8"] == pytest.approx(112.0 / 122.2, abs=1e-3)
    assert raw["startup_seconds"] == json.loads((results / "large-L" / "identical.json").read_text())["startup_s"]


def test_cost_command_projects_gpu_hours(tmp_path):
    (tmp_path / "costs.json").write_text(json.dumps(MEASURED))
    proc = run_cli("cost", "config/setup2.yaml", "--costs", tmp_path / "costs.json", "--cells-per-gpu", "4")
    costs = cluster.GpuCosts.from_file(tmp_path / "costs.json")
    cells = expand(load_config(REPO / "config" / "setup2.yaml"))
    one, four = (cluster.gpu_hours(cells, {}, k, costs) for k in (1, 4))
    assert f"| config/setup2.yaml | 60 | {one:,.1f} | {four:,.1f} |" in proc.stdout
    assert "measured on Test GPU" in proc.stdout and "P2 2.50x at L = 256, 1.20x at L = 2048" in proc.stdout


def test_matrix_mechanisms_train_at_dp_sgd_cost():
    # correlated noise is one row of a memory-mapped file per step: no T x d history in memory
    # (the assumed costs; measured ones time the matrix step on its own)
    for problem, size in (("P3", 1024), ("P1", 2048)):
        dpsgd = cluster.resources(cell(problem, "dpsgd", size, 30), TRAIN, costs=cluster.ASSUMED)
        assert cluster.resources(cell(problem, "dpmatrix-me-lambda", size, 30), TRAIN, costs=cluster.ASSUMED) == dpsgd


def test_retries_ask_for_more_and_estimates_grow_with_the_work():
    first, second = cluster.resources(cell(), TRAIN, attempt=1), cluster.resources(cell(), TRAIN, attempt=2)
    assert second["mem_mb"] == 2 * first["mem_mb"] and second["runtime"] >= 2 * first["runtime"] - 5
    one, ten = cluster.compute_seconds(cell(epochs=1), TRAIN), cluster.compute_seconds(cell(epochs=10), TRAIN)
    assert ten == pytest.approx(10 * one, rel=0.01)
    # larger batches: fewer steps, so less per-step overhead for the same epochs
    assert cluster.compute_seconds(cell(batch_size=2048), TRAIN) < cluster.compute_seconds(cell(batch_size=256), TRAIN)


def test_runs_of_similar_length_are_bundled():
    assert cluster.bundle(cell(), TRAIN) == "train_short"
    assert cluster.bundle(cell("P1", "dpsgd", 256, 500), TRAIN) == "train_long"
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
    assert train["gres"] == "gpu:1" and "gpu" not in train and train["slurm_partition"].startswith("CHANGE-ME")
    assert "mem_mb" not in train and "runtime" not in train  # they come from dpbench.pipeline.cluster via the rule
    assert slurm["group-components"] == {cluster.SHORT_GROUP: 16, cluster.LONG_GROUP: 8}
    assert slurm["set-resource-scopes"] == {"gpu_slots": "local"} and slurm["resources"] == {"gpu_slots": 8}
    # the local GPU profile: 8 runs share its one GPU; `gpu: 1` marks the device, no global limit on it
    gpu = yaml.safe_load((PROFILES / "gpu" / "config.yaml").read_text())
    assert gpu["resources"] == {"gpu_slots": 8} and gpu["set-resources"]["train"] == {"gpu": 1, "gpu_slots": 1}
    assert gpu["cores"] >= gpu["resources"]["gpu_slots"] * gpu["set-threads"]["train"]

    local = yaml.safe_load((PROFILES / "slurm-local" / "config.yaml").read_text())
    assert local["slurm-status-command"] == "squeue" and local["slurm-no-account"] is True
    text = (PROFILES / "slurm-local" / "config.yaml").read_text()
    assert "slurm_partition" not in text and "slurm_account" not in text and "gres" not in text
    assert local["set-resources"]["train"] == {"gpu": 0}


def test_a_bundle_shares_one_gpu_between_gpu_slots_runs():
    """What the slurm profile makes Snakemake 9 ask SLURM for a bundle of 16 short runs and one
    of 8 long runs: the group's resources (Snakemake's own layering of a group job) with the
    profile's train resources and threads. 8 slots: 8 runs at a time on ONE GPU, 2 rounds of
    runtime (short) or 1 (long: the longest run's), the memory and CPUs of 8 runs."""
    from types import SimpleNamespace

    from snakemake.resources import GroupResources, Resources
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    slurm = yaml.safe_load((PROFILES / "slurm" / "config.yaml").read_text())
    threads = slurm["set-threads"]["train"]
    per_run = {"mem_mb": 5000, "runtime": 15, "_cores": threads, "cpus_per_gpu": threads,  # rule train's
               "slurm_partition": "gpu", **slurm["set-resources"]["train"]}
    n = slurm["group-components"][cluster.SHORT_GROUP]
    jobs = [SimpleNamespace(resources=dict(per_run), pipe_group=None) for _ in range(n)]
    group = GroupResources.basic_layered([jobs], Resources.from_mapping(slurm["resources"]), run_local=False,
                                         additive_resources=["runtime"], sortby=["runtime"])
    slots = slurm["resources"]["gpu_slots"]
    assert group["gres"] == "gpu:1" and group["gpu_slots"] == slots == 8
    assert group["runtime"] == 15 * n // slots == 30 and group["mem_mb"] == 5000 * slots
    assert group["cpus_per_gpu"] == group["_cores"] == threads * slots == 16  # --cpus-per-gpu of the bundle's job
    long = [SimpleNamespace(resources={**per_run, "runtime": 25 + 5 * i}, pipe_group=None)
            for i in range(slurm["group-components"][cluster.LONG_GROUP])]
    group = GroupResources.basic_layered([long], Resources.from_mapping(slurm["resources"]), run_local=False,
                                         additive_resources=["runtime"], sortby=["runtime"])
    assert group["runtime"] == 60 and group["mem_mb"] == 5000 * slots and group["gres"] == "gpu:1"
    assert set_gres_string(SimpleNamespace(resources=SimpleNamespace(get=group.get, gres=group["gres"]))).strip() \
        == "--gres=gpu:1"


@pytest.mark.parametrize("profile,device,threads", [("slurm", "cuda", 2), ("slurm-local", "cpu", 1)])
def test_profile_dry_run(profile, device, threads, repo_copy):
    """The profile is the deployment: GPU training (--device cuda, 2 threads) on the cluster,
    CPU training on the GPU-less test cluster."""
    pytest.importorskip("snakemake_executor_plugin_slurm", reason="snakemake-executor-plugin-slurm not installed")
    proc = subprocess.run([snakemake_exe(), "-n", "-p", "--cores", "8", "--profile", PROFILES / profile],
                          cwd=repo_copy, env=tree_env(repo_copy),
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
                          timeout=900, env=tree_env(DPBENCH_FMNIST_DIR=str(fmnist_dir)))
    print(f"tiny grid through SLURM in {time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout and proc.stdout.count("ok ") >= 6, proc.stdout
    logs = tmp_path / "work" / ".snakemake" / "slurm_logs"
    assert list(logs.glob("group_train_short*/*.log")), "training did not run as a bundled SLURM job"
