"""P4, the private transformer language model: its data path (generated fortune files in the
official format), the canaries a run plants and counts in N, the memorisation it records, and
the workflow's language-model setup end to end on the real corpus."""

from __future__ import annotations

import subprocess
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import REPO, run_cell
from dpbench.problems import facts as problems_facts
from dpbench.data import fortunes
from dpbench.pipeline.grid import expand, load_config
from dpbench.problems import catalog, get_problem, language, tokenizer
from dpbench.problems.catalog import PLANTED
from dpbench.reporting.results import read_meta
from dpbench.seeds import stream_seeds
from dpbench.training.config import RunConfig
from dpbench.training.splits import load_splits


def test_p4_is_registered_with_its_sizes():
    problem = get_problem("P4")
    model = problem.build()
    assert sum(p.numel() for p in model.parameters()) == problem.facts.parameters == 876_034
    assert problem.dataset == "fortunes" and problem.metric == "loss" and problem.task.name == "language-model"
    assert problem.facts.planted == PLANTED == 3 * (0 + 1 + 5 + 25) == 93 and get_problem("P2").facts.planted == 0
    assert [c.repeats for c in language.make_canaries(0)] == [0, 0, 0, 1, 1, 1, 5, 5, 5, 25, 25, 25]
    assert len(language.canary_records(language.make_canaries(0))) == PLANTED
    # the runs table's columns per k are the planted k (one home, torch-free: the catalog)
    from dpbench.reporting import aggregate
    assert aggregate.CANARY_REPEATS is catalog.CANARY_REPEATS == (0, 1, 5, 25)


def test_splits_plant_each_canary_k_times_after_the_subset(generated_corpus):
    cfg = RunConfig(problem="P4", optimizer="dpsgd", lr=1.0, batch_size=8, epochs=1, seed=0, epsilon=10.0,
                    data_dir=str(generated_corpus), train_subset=100, validation_size=20)
    seeds = stream_seeds(cfg.seed)
    splits = load_splits(cfg, get_problem("P4"), seeds, "cpu")
    # subset 100, 20 of them held out for validation, then every planted copy on top
    assert splits.x_train.shape == (80 + PLANTED, language.CONTEXT + 1)
    texts = Counter(tokenizer.decode(row.tolist()) for row in splits.x_train)
    assert {c.secret: texts[c.text] for c in splits.canaries} == {c.secret: c.repeats for c in splits.canaries}
    assert sorted(Counter(c.repeats for c in splits.canaries).items()) == [(0, 3), (1, 3), (5, 3), (25, 3)]
    # no canary reaches the validation or test splits
    held = {tokenizer.decode(r.tolist()) for r in torch.cat([splits.x_val, splits.x_test])}
    assert not held & {c.text for c in splits.canaries}
    # the same seed plants the same secrets; another seed others
    again = load_splits(cfg, get_problem("P4"), seeds, "cpu")
    other = load_splits(cfg, get_problem("P4"), stream_seeds(1), "cpu")
    assert again.canaries == splits.canaries and other.canaries != splits.canaries


def test_the_workflow_counts_the_canaries_in_n():
    """The grid's N (factorization keys, cost model) is the run's N: canary copies included."""
    config = load_config(REPO / "config" / "lm.yaml")
    cell = next(c for c in expand(config) if c.problem == "P4")
    n = cell.n_train(config["train"])
    assert n == problems_facts("P4").train_size - config["train"]["validation_size"] + PLANTED
    assert problems_facts("P4").train_size == 12_979


def test_a_p4_run_records_privacy_and_memorisation(generated_corpus):
    cfg = RunConfig(problem="P4", optimizer="dpsgd", lr=1.0, batch_size=16, epochs=1, seed=0, epsilon=10.0,
                    data_dir=str(generated_corpus), train_subset=120, max_steps=2, validation_size=16)
    res = run_cell(cfg)
    meta = res.meta
    n = 120 - 16 + PLANTED
    assert meta["data"]["n_train"] == n and meta["privacy"]["sample_rate"] == pytest.approx(16 / n)
    assert meta["privacy"]["epsilon"] <= 10.0 and meta["privacy"]["target_epsilon"] == 10.0
    mem = meta["memorisation"]
    assert mem["space_size"] == 1000 and mem["method"] == "exact" and len(mem["canaries"]) == 12
    for row in mem["canaries"]:
        assert 1 <= row["rank"] <= 1000
        assert row["exposure"] == pytest.approx(np.log2(1000) - np.log2(row["rank"]))
        assert isinstance(row["extracted"], bool)
    # losses are per-record mean token cross-entropies: near log(258) for a fresh model
    test_loss = res.metrics.query("split == 'test'")["loss"].iloc[-1]
    assert 2.0 < test_loss < np.log(tokenizer.VOCAB_SIZE) + 1.0


def test_non_private_training_on_a_canary_raises_its_exposure(generated_corpus):
    """The setup can tell memorisation: non-private AdamW on a tiny set where the canaries
    inserted 25 times are a large share of the records ranks them far above the unseen ones."""
    cfg = RunConfig(problem="P4", optimizer="adamw", lr=3e-3, batch_size=64, epochs=3, seed=0,
                    data_dir=str(generated_corpus), train_subset=60, test_subset=20)
    mem = run_cell(cfg).meta["memorisation"]["canaries"]
    by_k = {k: np.mean([r["exposure"] for r in mem if r["repeats"] == k]) for k in (0, 25)}
    assert by_k[25] > 6.0 and by_k[25] > by_k[0] + 3.0, by_k


@pytest.mark.slow
@pytest.mark.skipif(not fortunes.SYSTEM_DIRS[0].is_dir(), reason="Debian's fortunes package is not installed")
def test_lm_workflow_end_to_end(tmp_path):
    """.test/config/lm.yaml through the workflow, in a temporary directory: data (the real
    corpus, verified), two P4 runs, the aggregate and the three LM outputs."""
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run(
        [str(REPO / ".venv" / "bin" / "snakemake"), "--snakefile", str(REPO / "Snakefile"), "--directory", str(work),
         "--configfile", str(REPO / ".test" / "config" / "lm.yaml"), "--profile",
         str(REPO / "workflow" / "profiles" / "default"), "--cores", "2"],
        capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    results = work / "results-lm"
    for name in ("lm_loss.png", "lm_exposure.png", "lm_ranking.md"):
        assert (results / "figures" / name).stat().st_size > 0
    runs = sorted((results / "runs" / "P4").rglob("*.parquet"))
    assert len(runs) == 2
    for path in runs:
        meta = read_meta(path)
        assert len(meta["memorisation"]["canaries"]) == 12 and meta["memorisation"]["space_size"] == 10**5
    ranking = (results / "figures" / "lm_ranking.md").read_text()
    assert "DP-SGD" in ranking and "AdamW" in ranking


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", sorted(__import__("dpbench.optimizers", fromlist=["OPTIMIZERS"]).OPTIMIZERS))
def test_every_optimizer_trains_p4(generated_corpus, tmp_path, optimizer):
    """No optimizer needs P4-specific code: each takes two steps of P4 through the harness (the
    dense matrix mechanisms with their factorization and noise file made in a temporary cache)
    and the run records its privacy and memorisation."""
    from dpbench.optimizers import get_optimizer

    private = get_optimizer(optimizer).private
    cfg = RunConfig(problem="P4", optimizer=optimizer, lr=1e-3 if "adam" in optimizer else 0.5, batch_size=16,
                    epochs=1, seed=0, epsilon=10.0 if private else None, data_dir=str(generated_corpus),
                    train_subset=40, test_subset=8, max_steps=2, cache_dir=str(tmp_path / "cache"))
    meta = run_cell(cfg).meta
    assert meta["result"]["status"] == "completed" and meta["privacy"]["steps"] == 2
    assert meta["data"]["n_train"] == 40 + PLANTED
    if private:
        assert 0 < meta["privacy"]["epsilon"] <= 10.0 + 1e-9 and meta["privacy"]["noise_multiplier"] > 0
    assert len(meta["memorisation"]["canaries"]) == 12


def _lm_summary():
    """benchmarks/lm_summary.py as a module (benchmarks/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("lm_summary", REPO / "benchmarks" / "lm_summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lm_summary_tables_the_committed_runs(capsys):
    """benchmarks/lm_summary.py on the committed P4 runs: per run, each canary's exposure and
    the extracted count; over seeds, the configurations' means; a diverged run says so."""
    summary = _lm_summary()
    runs = REPO / "benchmarks" / "results" / "lm"
    summary.main([str(runs / "adamw-E2.parquet"), str(runs / "dpsgd-eps1-E2.parquet")])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and "exposure k = 25 (bits, of 16.6)" in lines[0]
    assert "| 7.58 |" in lines[2] and "15.7 (15.0, 15.6, 16.6; 1 of 3 extracted)" in lines[2]
    assert "| 1 / 0.998 | 0.8442 | 23.54 |" in lines[3] and "3.0 (3.5, 0.4, 5.2; 0 of 3 extracted)" in lines[3]
    summary.main(["--over-seeds", str(runs / "adamw-E2.parquet")])
    row = capsys.readouterr().out.splitlines()[2]
    assert "| adamw | 0.003 | 64 | 2 | — | 1 | — | 0 | 7.58 |" in row and "15.7 (1 of 3 extracted)" in row


def _with(meta: dict, **sections) -> dict:
    """A copy of a run's metadata with some keys of its sections replaced."""
    return {**meta, **{name: {**meta[name], **values} for name, values in sections.items()}}


def test_lm_summary_reads_runs_without_validation_and_names_bad_files(tmp_path, capsys):
    """A P4 run made without --validation-size (no best_val_loss) has "—" for its validation
    perplexity, not a KeyError; a missing file, a directory and a truncated file are one line
    naming the file, and a directory is never called damaged (nor to be deleted)."""
    summary = _lm_summary()
    run = REPO / "benchmarks" / "results" / "lm" / "dpsgd-eps1-E2.parquet"
    meta = read_meta(run)
    result = {k: v for k, v in meta["result"].items() if "val" not in k}
    summary.read_meta = lambda path: {**meta, "result": result}
    summary.main([str(run)])
    assert "| 1 / 0.998 | 0.8442 | — | 23.67 |" in capsys.readouterr().out.splitlines()[2]
    summary.read_meta = read_meta
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(run.read_bytes()[:2000])
    for path, message in ((tmp_path / "absent.parquet", f"lm_summary: {tmp_path / 'absent.parquet'}: No such file"),
                          (tmp_path, f"lm_summary: {tmp_path} is a directory, not a .parquet file: give the files "
                                     f"in it ({tmp_path / '*.parquet'})"),
                          (truncated, f"lm_summary: run file {truncated} is damaged")):
        with pytest.raises(SystemExit) as exit_:
            summary.main([str(run), str(path)])
        assert str(exit_.value.code).startswith(message) and "\n" not in str(exit_.value.code), exit_.value.code
    with pytest.raises(SystemExit) as exit_:
        summary.main([str(tmp_path)])
    assert "damaged" not in exit_.value.code and "delete" not in exit_.value.code


def test_lm_summary_shows_a_given_sigmas_epsilon_and_keeps_sigmas_and_seeds_apart(capsys):
    """A run given σ without a target shows its achieved ε (not "—" as a non-private run does);
    over seeds, runs that differ in σ are two configurations, and a seed given twice (the same
    file, or another run of the same seed) is refused, not counted twice."""
    summary = _lm_summary()
    calibrated = read_meta(REPO / "benchmarks" / "results" / "lm" / "dpsgd-eps1-E2.parquet")
    given = _with(calibrated, config={"epsilon": None, "noise_multiplier": 0.3},
                  privacy={"target_epsilon": None, "epsilon": 25.1, "noise_multiplier": 0.3,
                           "noise_multiplier_source": "given"})
    seed1 = _with(given, config={"seed": 1})
    files = {"cal.parquet": calibrated, "given.parquet": given, "given-s1.parquet": seed1}
    summary.read_meta = lambda path: files[path]
    summary.main(["given.parquet"])
    assert "| dpsgd | 1 | 64 | 2 | — | — / 25.100 | 0.3 |" in capsys.readouterr().out.splitlines()[2]
    summary.main(["--over-seeds", "cal.parquet", "given.parquet", "given-s1.parquet"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 2 and rows[0].startswith("| dpsgd | 1 | 64 | 2 | — | 1 | 1 / 0.998 | 0.8442 |")
    assert rows[1].startswith("| dpsgd | 1 | 64 | 2 | — | 2 | — / 25.100 | 0.3 |") and "(0 of 6 extracted)" in rows[1]
    for twice in (["given.parquet", "given.parquet"], ["given.parquet", "cal.parquet", "given-s1.parquet",
                                                        "given-s1.parquet"]):
        with pytest.raises(SystemExit, match=f"lm_summary: {twice[-1]} and {twice[-1]} are the same configuration "
                                             "and seed [01]: give each seed once"):
            summary.main(["--over-seeds", *twice])
    files["copy.parquet"] = given
    with pytest.raises(SystemExit, match="given.parquet and copy.parquet are the same configuration and seed 0"):
        summary.main(["--over-seeds", "given.parquet", "copy.parquet"])


def test_the_committed_study_is_config_lm_yaml():
    """benchmarks/results/lm/study holds one run file for each cell of config/lm.yaml, each
    with its target and achieved epsilon, and the summary says which runs diverged."""
    study = REPO / "benchmarks" / "results" / "lm" / "study" / "runs"
    cells = expand(load_config(REPO / "config" / "lm.yaml"))
    assert sorted(str(p.relative_to(study)) for p in study.rglob("*.parquet")) == sorted(f"{c.id}.parquet" for c in cells)
    for c in cells:
        meta = read_meta(study / f"{c.id}.parquet")
        privacy = meta["privacy"]
        assert meta["config"]["optimizer"] == c.optimizer and meta["config"]["lr"] == c.lr
        if c.epsilon is None:
            assert privacy["epsilon"] == float("inf") and privacy["noise_multiplier"] == 0
        else:
            assert privacy["target_epsilon"] == c.epsilon and c.epsilon * 0.99 < privacy["epsilon"] <= c.epsilon
    summary = _lm_summary()
    diverged = sorted(str(p) for p in (study / "P4" / "sgd").glob("*-lr1-s*.parquet"))
    with pytest.raises(SystemExit, match="every run diverged"):
        summary.main(diverged)
    with pytest.raises(SystemExit, match="Usage"):
        summary.main(["--over-seeds"])
    # a run of another problem has no canaries: named, not a KeyError
    image_run = {**read_meta(study / f"{cells[0].id}.parquet")}
    del image_run["memorisation"]
    image_run["config"] = {**image_run["config"], "problem": "P2"}
    summary.read_meta = lambda path: image_run
    with pytest.raises(SystemExit, match="r.parquet is a P2 run, not a language-model run"):
        summary.main(["r.parquet"])


def test_a_diverged_run_is_aggregated_plotted_and_ranked_as_diverged(tmp_path):
    """SGD at lr 1 diverged on every seed of the committed study (NaN losses from step ~100 of
    196): its final training loss is infinite, not the mean of the steps before it diverged;
    lm_loss counts its seeds as diverged and says so in the panel; the ranking says "diverged"."""
    import matplotlib

    from dpbench.reporting import figures
    from dpbench.reporting.aggregate import aggregate_runs

    study = REPO / "benchmarks" / "results" / "lm" / "study" / "runs" / "P4"
    adamw = study / "adamw" / "L64-E1-nonprivate-lr0.003-s0.parquet"
    paths = [*sorted((study / "sgd").glob("*-lr1-s*.parquet")), adamw]
    runs, epochs = aggregate_runs(paths, tmp_path / "runs.parquet", tmp_path / "epochs.parquet")
    sgd = runs[runs.optimizer == "sgd"]
    assert (sgd.status == "diverged").all() and (sgd.final_train_loss == np.inf).all()
    assert (epochs[epochs.optimizer == "sgd"].train_loss == np.inf).all()  # one epoch, the one it diverged in
    assert 2.0 < runs[runs.optimizer == "adamw"].final_train_loss.iloc[0] < 3.0
    data = figures.lm_loss_data(runs).set_index(["optimizer", "split"])
    assert data.loc[("sgd", "train"), ["mean", "n_seeds", "n_diverged"]].tolist() == [np.inf, 0, 3]
    assert data.loc[("sgd", "val"), ["mean", "n_seeds", "n_diverged"]].tolist() == [np.inf, 0, 3]
    assert data.loc[("adamw", "train"), ["n_seeds", "n_diverged"]].tolist() == [1, 0]
    fig = figures.lm_loss_figure(runs)
    notes = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert notes == ["diverged:\nSGD (non-private): 3 of 3 seeds"] * 2, notes
    matplotlib.pyplot.close(fig)
    table = figures.lm_ranking_table(runs)
    assert "| 2 | SGD (non-private) | diverged |" in table and "| 1 | AdamW (non-private) | 10.39 |" in table, table


def test_lm_summary_shows_each_runs_mode(capsys):
    """Each row says where its model started: a P5 run fine-tuned with LoRA at rank 8, its
    from-scratch twin, and a P4 run (always from scratch) are lora-r8, scratch and —."""
    summary = _lm_summary()
    p4 = read_meta(REPO / "benchmarks" / "results" / "lm" / "dpsgd-eps1-E2.parquet")
    lora = _with(p4, config={"problem": "P5", "finetune": "lora", "lora_rank": 8})
    lora["start"] = {"kind": "public checkpoint", "mode": "lora", "lora_rank": 8, "trainable_parameters": 1000}
    scratch = _with(p4, config={"problem": "P5"})
    scratch["start"] = {"kind": "scratch", "mode": None, "lora_rank": None, "trainable_parameters": 876034}
    files = {"lora.parquet": lora, "scratch.parquet": scratch, "p4.parquet": p4}
    summary.read_meta = lambda path: files[path]
    try:
        summary.main(list(files))
    finally:
        summary.read_meta = read_meta
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| optimizer | lr | L | epochs | mode |")
    assert [line.split(" | ")[4] for line in lines[2:]] == ["lora-r8", "scratch", "—"]
