"""benchmarks/snapshot_study.py: what of a long study is committed between sittings."""
import pandas as pd
import pytest
import yaml

from conftest import REPO, load_file
from dpbench.pipeline.jobs import load_jobs


def test_only_comparisons_with_every_rate_and_seed_are_taken(tmp_path):
    """Two rates x two seeds of DP-SGD at two epsilons and of SGD: a comparison missing one run
    (one seed of one rate) is left out; complete ones come with all their run files."""
    snapshot = load_file(REPO / "benchmarks" / "snapshot_study.py")
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({
        "results_dir": str(tmp_path / "results"), "train": {"train_subset": 1000},
        "grid": [{"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [1, 10], "seeds": [0, 1],
                  "optimizers": {"dpsgd": {"lr": [0.1, 0.5]}, "sgd": {"lr": [0.1, 0.5]}}}]}))
    jobs = load_jobs(str(config))
    assert len(jobs.cells) == 2 * 2 * 2 + 2 * 2
    for cell_id in jobs.cells:
        if cell_id != "P2/dpsgd/L100-E1-eps10-lr0.5-s1":  # one run of the eps 10 comparison not done
            path = tmp_path / "results" / "runs" / f"{cell_id}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"run")
    runs, n_groups, n_done = snapshot.complete_runs(jobs, tmp_path / "results")
    assert (n_groups, n_done) == (3, 2)
    names = sorted(f"{p.parent.name}/{p.stem}" for p in runs)
    assert names == sorted([f"dpsgd/L100-E1-eps1-lr{lr}-s{s}" for lr in (0.1, 0.5) for s in (0, 1)]
                           + [f"sgd/L100-E1-nonprivate-lr{lr}-s{s}" for lr in (0.1, 0.5) for s in (0, 1)])
    assert snapshot.main([str(config), "--out", str(tmp_path / "none"), "--results", str(tmp_path / "empty")]) == 1
    with pytest.raises(SystemExit, match=r"`dpbench aggregate` failed .*not complete, do not commit it"):
        snapshot.main([str(config), "--out", str(tmp_path / "out")])  # the complete runs are not Parquet
    assert not (tmp_path / "out" / "README.md").exists()


def test_a_comparison_is_every_configuration_of_an_optimizer_eps_and_mode(tmp_path):
    """The figures choose among learning rates and hyperparameters (a weight decay) together: a
    weight decay whose runs are all done is still left out while the other one's are not."""
    snapshot = load_file(REPO / "benchmarks" / "snapshot_study.py")
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({
        "results_dir": str(tmp_path / "results"), "train": {"train_subset": 1000},
        "grid": [{"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [1], "seeds": [0, 1],
                  "optimizers": {"dpadamw": {"lr": [1e-3], "weight_decay": [1e-4, 0.1]},
                                 "dpsgd": {"lr": [0.1]}}}]}))
    jobs = load_jobs(str(config))
    assert len(jobs.cells) == 2 * 2 + 2
    for cell_id in jobs.cells:
        if "weight_decay0.1" not in cell_id:  # every run of weight decay 1e-4 and of DP-SGD, none of 0.1
            path = tmp_path / "results" / "runs" / f"{cell_id}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"run")
    runs, n_groups, n_done = snapshot.complete_runs(jobs, tmp_path / "results")
    assert (n_groups, n_done) == (2, 1)
    assert sorted(p.stem for p in runs) == ["L100-E1-eps1-lr0.1-s0", "L100-E1-eps1-lr0.1-s1"]


def test_the_readme_summary_is_measured_from_the_runs_table():
    """Statuses counted, the largest achieved/target ε among the private runs only (a
    non-private run's infinite ε is not one), the runs' wall times added up in hours."""
    snapshot = load_file(REPO / "benchmarks" / "snapshot_study.py")
    table = pd.DataFrame({"private": [True, True, False], "epsilon": [0.99, 2.9997, float("inf")],
                          "target_epsilon": [1.0, 3.0, float("nan")], "status": ["completed", "diverged", "completed"],
                          "wall_time_s": [1800.0, 3600.0, 5400.0]})
    assert snapshot.summary(table) == [
        "- status of the runs: 2 completed, 1 diverged",
        "- privacy: 2 private runs, achieved ε at most 0.99990 of the target (max epsilon / target_epsilon)",
        "- time: the runs' wall_time_s add up to 3.00 hours (each run's training and evaluation; the jobs' "
        "start-up not counted)"]


def test_kept_run_files_let_a_fresh_clone_resume_without_replacing_a_finished_run(tmp_path):
    """snapshot_study --keep-runs copies exactly the complete comparisons' run files under their
    paths; run_study --restore puts them back where a config's cell has no file, never over one."""
    snapshot = load_file(REPO / "benchmarks" / "snapshot_study.py")
    study = load_file(REPO / "benchmarks" / "run_study.py")
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({
        "results_dir": str(tmp_path / "results"), "train": {"train_subset": 1000},
        "grid": [{"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [1], "seeds": [0, 1],
                  "optimizers": {"dpsgd": {"lr": [0.1]}, "sgd": {"lr": [0.1]}}}]}))
    jobs = load_jobs(str(config))
    results = tmp_path / "results"
    for cell_id in jobs.cells:
        if cell_id != "P2/sgd/L100-E1-nonprivate-lr0.1-s1":  # SGD's comparison is not complete
            path = results / "runs" / f"{cell_id}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(cell_id.encode())
    runs, _, _ = snapshot.complete_runs(jobs, results)
    out = tmp_path / "snap"
    (out / "runs" / "stale.parquet").parent.mkdir(parents=True)
    (out / "runs" / "stale.parquet").write_bytes(b"old")
    assert snapshot.keep_runs(runs, results, out) == 2
    kept = sorted(str(p.relative_to(out / "runs")) for p in (out / "runs").rglob("*.parquet"))
    assert kept == ["P2/dpsgd/L100-E1-eps1-lr0.1-s0.parquet", "P2/dpsgd/L100-E1-eps1-lr0.1-s1.parquet"]
    # a fresh clone: one kept run missing, the other already there (made again, other bytes)
    import shutil
    shutil.rmtree(results)
    mine = results / "runs" / "P2/dpsgd/L100-E1-eps1-lr0.1-s1.parquet"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"mine")
    assert study.restore(jobs, out) == 1
    assert (results / "runs" / "P2/dpsgd/L100-E1-eps1-lr0.1-s0.parquet").read_bytes() == b"P2/dpsgd/L100-E1-eps1-lr0.1-s0"
    assert mine.read_bytes() == b"mine"
    assert study.restore(jobs, out) == 0
    # run_study's order: whole comparisons, the non-private reference first, then by epsilon
    order = [(k, len(files)) for k, files in study.comparisons(jobs, ("scratch",), ["P2"])]
    assert order == [(("P2", "scratch", "sgd", None), 2), (("P2", "scratch", "dpsgd", 1.0), 2)]
    assert [[k for k, _ in b] for b in study.batches(jobs, ("scratch",), ["P2"], per_call=1)] == [[k] for k, _ in order]
