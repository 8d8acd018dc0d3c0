"""The run file: schema, metadata round trip, atomic writes."""

import math
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from dpbench.reporting import results


def _metrics():
    return pd.DataFrame({"split": ["train", "train", "test"], "step": [1, 2, 2], "epoch": [1, 1, 1],
                         "loss": [0.5, math.nan, math.inf], "accuracy": [0.1, 0.2, math.nan],
                         "batch_size": [3, 0, 10]})


def test_round_trip_keeps_nonfinite_values(tmp_path):
    meta = {"privacy": {"epsilon": math.inf, "target_epsilon": None}, "result": {"x": math.nan}}
    path = results.write_run(tmp_path / "a" / "run.parquet", _metrics(), meta)
    df, back = results.read_run(path)
    assert list(df.columns) == list(results.METRIC_COLUMNS)
    assert back["privacy"]["epsilon"] == math.inf and back["privacy"]["target_epsilon"] is None
    assert math.isnan(back["result"]["x"]) and back["schema_version"] == results.SCHEMA_VERSION
    assert df.loss.iloc[2] == math.inf
    # readable without dpbench: plain pyarrow metadata
    assert b"dpbench" in pq.read_schema(path).metadata


def test_crash_during_write_leaves_no_file(tmp_path, monkeypatch):
    target = tmp_path / "run.parquet"

    def crash(table, where, **kwargs):
        where.write(b"PAR1 partial")  # the temporary file, open
        raise KeyboardInterrupt

    monkeypatch.setattr(results.pq, "write_table", crash)
    with pytest.raises(KeyboardInterrupt):
        results.write_run(target, _metrics(), {})
    assert list(tmp_path.iterdir()) == []


def test_rejects_non_run_files(tmp_path):
    path = tmp_path / "plain.parquet"
    _metrics().to_parquet(path)
    with pytest.raises(ValueError, match="not a dpbench run file"):
        results.read_meta(path)


def test_a_private_optimizer_run_without_noise_is_not_labelled_private(tmp_path):
    """DP-SGD given sigma = 0 (the committed P4 run that takes the noise out) records epsilon =
    inf; the aggregated table must not call it private nor say its (epsilon, delta) holds,
    while a DP-SGD run at epsilon 1 on the same problem stays private with a guarantee."""
    from conftest import REPO
    from dpbench.reporting.aggregate import aggregate_runs

    lm = REPO / "benchmarks" / "results" / "lm" / "study"
    noiseless = lm / "extra" / "dpsgd-sigma0-lr1-s0.parquet"
    private = lm / "runs" / "P4" / "dpsgd" / "L64-E1-eps1-lr1-s0.parquet"
    meta = results.read_meta(noiseless)
    assert meta["optimizer"]["private"] and meta["privacy"]["epsilon"] == math.inf
    assert not results.is_private(results.read_meta(noiseless)) and results.is_private(results.read_meta(private))
    aggregate_runs([noiseless, private], tmp_path / "runs.parquet", tmp_path / "epochs.parquet")
    runs = pd.read_parquet(tmp_path / "runs.parquet")
    row = runs[runs["noise_multiplier"] == 0].iloc[0]
    assert row["optimizer"] == "dpsgd" and not row["private"] and not row["dp_guarantee"]
    row = runs[runs["noise_multiplier"] > 0].iloc[0]
    assert row["private"] and row["dp_guarantee"] and row["epsilon"] < 1.0


def test_a_run_that_exceeded_its_target_is_not_labelled_private(tmp_path):
    """A run given sigma = 0.3 and target 1 (accepted before the command refused the pair)
    achieved epsilon 25.6: neither private nor with a guarantee at its target; the same run
    given sigma alone, no target, is private at the epsilon it achieved."""
    from conftest import REPO
    from dpbench.reporting.aggregate import aggregate_runs

    source = REPO / "benchmarks" / "results" / "lm" / "study" / "runs" / "P4" / "dpsgd" / "L64-E1-eps1-lr1-s0.parquet"
    metrics, meta = results.read_run(source)
    given = {"noise_multiplier": 0.3, "noise_multiplier_source": "given", "epsilon": 25.6, "epsilon_planned": 25.6}
    over = {**meta, "run_id": "over", "config": {**meta["config"], "noise_multiplier": 0.3},
            "privacy": {**meta["privacy"], **given, "target_epsilon": 1.0}}
    alone = {**meta, "run_id": "alone", "config": {**meta["config"], "epsilon": None, "noise_multiplier": 0.3},
             "privacy": {**meta["privacy"], **given, "target_epsilon": None}}
    paths = [results.write_run(tmp_path / f"{m['run_id']}.parquet", metrics, m) for m in (over, alone)]
    assert not results.is_private(over) and not results.dp_guarantee(over)
    assert results.is_private(alone) and results.dp_guarantee(alone)
    runs = aggregate_runs(paths, tmp_path / "runs.parquet", tmp_path / "epochs.parquet")[0].set_index("run_id")
    assert not runs.loc["over", "private"] and not runs.loc["over", "dp_guarantee"]
    assert runs.loc["alone", "private"] and runs.loc["alone", "dp_guarantee"]
    # met exactly: the calibrations' own test (epsilon <= target), no slack either way
    at = {**over, "privacy": {**over["privacy"], "epsilon": 1.0}}
    assert results.is_private(at)
    assert not results.is_private({**at, "privacy": {**at["privacy"], "epsilon": math.nextafter(1.0, 2.0)}})


def test_a_runs_environment_names_the_platform_its_numbers_depend_on(tiny_fmnist, tmp_path, monkeypatch):
    """The CPU, its numeric instruction sets, the kernels torch, NumPy and OpenBLAS chose, and the
    variables pinning them: read back from the run file as this process sees them."""
    import numpy as np
    import torch

    from conftest import run_cell
    from dpbench.training.train import RunConfig

    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")  # recorded as set (its effect is fixed when MKL loads)
    res = run_cell(RunConfig(problem="P2", optimizer="dpsgd", lr=0.5, batch_size=60, epochs=1, seed=0, epsilon=2.0,
                             max_steps=2, progress_every_s=1e9))
    _, meta = results.read_run(results.write_run(tmp_path / "run.parquet", res.metrics, res.meta))
    p = meta["environment"]["platform"]
    cpuinfo = open("/proc/cpuinfo").read().split("\n\n")[0]
    flags = cpuinfo.split("\nflags", 1)[1].split(":", 1)[1].split("\n", 1)[0].split()
    assert f"vendor_id\t: {p['cpu']['vendor']}" in cpuinfo and f"model name\t: {p['cpu']['model_name']}" in cpuinfo
    assert set(p["isa"]) <= set(flags) and ("avx2" in p["isa"]) == ("avx2" in flags)
    assert ("avx512f" in p["isa"]) == ("avx512f" in flags) and "sse2" not in p["isa"]  # only what changes floats
    assert p["torch"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert p["torch"]["blas"] == "mkl" and p["torch"]["onednn"].startswith("v")
    assert p["numpy_simd"]["found"] == np.show_config(mode="dicts")["SIMD Extensions"]["found"]
    assert all(core for core in p["openblas"].values()) and len(p["openblas"]) >= 1
    assert p["pins"]["MKL_CBWR"] == "COMPATIBLE"


def test_runs_table_says_where_each_run_started(tmp_path):
    """The start columns come from each run's ``start`` section: a public start gives its mode,
    rank, d and checkpoint hash; a from-scratch run of a problem that starts from a checkpoint
    (P6) is the "scratch" twin; a from-scratch P4 run has no fine-tuning mode; and a run file
    written before the section existed still aggregates, with None there."""
    from conftest import REPO
    from dpbench.problems.architectures import transformer_lm
    from dpbench.problems.modes import LoRA
    from dpbench.reporting.aggregate import aggregate_runs

    source = REPO / "benchmarks" / "results" / "lm" / "study" / "runs" / "P4" / "dpsgd" / "L64-E1-eps1-lr1-s0.parquet"
    metrics, meta = results.read_run(source)
    assert "start" not in meta  # recorded before runs named their start
    d = LoRA(8).trainable_parameters(transformer_lm(None, 40))
    public = {"kind": "public checkpoint", "checkpoint": "pretrained/wordnet-lm.pt", "checkpoint_sha256": "ab" * 32,
              "recipe": {"corpus": "wordnet"}, "pretraining_epsilon": 0.0, "mode": "lora", "lora_rank": 8,
              "lora_alpha": 16, "trainable_parameters": d, "parameters": 847_912 + d}
    scratch = {"kind": "scratch", "checkpoint": None, "checkpoint_sha256": None, "recipe": None,
               "pretraining_epsilon": None, "mode": None, "lora_rank": None, "lora_alpha": None,
               "trainable_parameters": 847_912, "parameters": 847_912}
    p6 = {**meta["config"], "problem": "P6"}
    metas = {"old": {**meta, "run_id": "old"},
             "lora": {**meta, "run_id": "lora", "config": p6, "start": public},
             "twin": {**meta, "run_id": "twin", "config": p6, "start": scratch},
             "p4": {**meta, "run_id": "p4", "start": {**scratch, "trainable_parameters": 876_034}}}
    paths = [results.write_run(tmp_path / f"{k}.parquet", metrics, m) for k, m in metas.items()]
    aggregate_runs(paths, tmp_path / "runs.parquet", tmp_path / "epochs.parquet")
    runs = pd.read_parquet(tmp_path / "runs.parquet").set_index("run_id")
    cols = ["start", "finetune", "lora_rank", "trainable_parameters", "checkpoint_sha256"]
    assert runs.loc["lora", cols].tolist() == ["public", "lora", 8, d, "ab" * 32]
    assert runs.loc["twin", cols].tolist()[:2] == ["scratch", "scratch"]
    assert runs.loc["twin", "trainable_parameters"] == 847_912 and pd.isna(runs.loc["twin", "lora_rank"])
    assert runs.loc["p4", "start"] == "scratch" and pd.isna(runs.loc["p4", "finetune"])
    assert runs.loc["old", cols].isna().all()
    assert str(runs["trainable_parameters"].dtype) == "Int64"


LM_RUN = ("benchmarks", "results", "lm", "study", "runs", "P4", "dpsgd", "L64-E1-eps1-lr1-s0.parquet")


def _edited(tmp_path, name, edit):
    """The committed DP-SGD run at epsilon 1 (P4) with its metadata edited by ``edit``."""
    import copy

    from conftest import REPO

    metrics, meta = results.read_run(REPO.joinpath(*LM_RUN))
    meta = copy.deepcopy(meta)
    edit(meta)
    return results.write_run(tmp_path / f"{name}.parquet", metrics, meta)


def _refused_by_aggregate(tmp_path, capsys, edit, field) -> str:
    """dpbench aggregate of the run file ``_edited`` by ``edit``: refused in one line naming the
    file and ``field``, nothing written; that line."""
    from dpbench import cli

    path = _edited(tmp_path, "edited", edit)
    assert cli.main(["aggregate", str(path), "--out-runs", str(tmp_path / "r.parquet"),
                     "--out-epochs", str(tmp_path / "e.parquet")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dpbench aggregate: error: run file {path} is damaged or edited (") and field in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "r.parquet").exists()
    return err


def _set(section, key, value):
    return lambda meta: meta[section].__setitem__(key, value)


@pytest.mark.parametrize("edit,field", [
    (_set("privacy", "epsilon", -1.0), "privacy.epsilon: -1.0"),
    (_set("privacy", "epsilon", math.nan), "privacy.epsilon: nan"),
    (_set("privacy", "epsilon", True), "privacy.epsilon: True"),
    (_set("privacy", "epsilon", "0.5"), "privacy.epsilon: '0.5'"),
    (lambda m: m["privacy"].pop("epsilon"), "privacy.epsilon: None"),
    (_set("privacy", "delta", 1.0), "privacy.delta: 1.0"),
    (_set("privacy", "delta", math.nan), "privacy.delta: nan"),
    (_set("privacy", "noise_multiplier", 0.0), "privacy.noise_multiplier: 0.0, no noise, yet epsilon"),
    (_set("config", "batch_size", 10**30), "config.batch_size: 1000000000000000000000000000000"),
    (lambda m: m.pop("result"), "result: missing"),
    (lambda m: m["result"].pop("best_test_loss"), "missing key 'best_test_loss'"),
])
def test_aggregate_refuses_a_run_file_whose_record_no_run_writes(tmp_path, capsys, edit, field):
    """An edited or damaged record (a negative, NaN or non-number epsilon; delta outside (0, 1); a
    finite epsilon without noise; a 10^30 batch size; a missing key) is refused by dpbench
    aggregate in one line naming the file and the key, never labelled private nor a traceback."""
    _refused_by_aggregate(tmp_path, capsys, edit, field)


def test_aggregate_refuses_metadata_that_is_a_json_list(tmp_path, capsys):
    from dpbench import cli

    path = _edited(tmp_path, "listed", lambda m: None)
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({results.META_KEY: b"[1, 2]"}), path)
    assert cli.main(["aggregate", str(path), "--out-runs", str(tmp_path / "r.parquet"),
                     "--out-epochs", str(tmp_path / "e.parquet")]) != 0
    err = capsys.readouterr().err.strip()
    assert "is damaged or edited (the metadata is a JSON list, not an object)" in err and len(err.splitlines()) == 1


def test_a_builtin_optimizer_is_labelled_by_the_registry_not_by_its_file(tmp_path):
    """A run file edited to say sgd is private, or one of DP-Dice with its caveat cut, is
    labelled by the registry (dpbench aggregate passes the catalog's built-in facts): not
    private; private without a DP guarantee. The unedited DP-SGD run keeps both labels."""
    from dpbench import cli

    def as_optimizer(name, caveat=None):
        def edit(meta):
            meta["config"]["optimizer"] = name
            meta["privacy"]["caveat"] = caveat
            meta["run_id"] = f"P4/{name}/edited"  # another run (one run_id twice is refused)
        return edit

    paths = [_edited(tmp_path, "sgd", as_optimizer("sgd")), _edited(tmp_path, "dpdice", as_optimizer("dpdice")),
             _edited(tmp_path, "dpsgd", lambda m: None),
             _edited(tmp_path, "paper", lambda m: (as_optimizer("d2p2sgd")(m), m["optimizer"].__setitem__(
                 "hyperparameters", {"paper_sensitivity": True})))]
    assert cli.main(["aggregate", *map(str, paths), "--out-runs", str(tmp_path / "r.parquet"),
                     "--out-epochs", str(tmp_path / "e.parquet")]) == 0
    runs = pd.read_parquet(tmp_path / "r.parquet").set_index("optimizer")
    assert not runs.loc["sgd", "private"] and not runs.loc["sgd", "dp_guarantee"]
    assert runs.loc["dpdice", "private"] and not runs.loc["dpdice", "dp_guarantee"]
    assert runs.loc["d2p2sgd", "private"] and not runs.loc["d2p2sgd", "dp_guarantee"]
    assert runs.loc["dpsgd", "private"] and runs.loc["dpsgd", "dp_guarantee"]


def _all(*edits):
    return lambda meta: [edit(meta) for edit in edits]


_NOT_PRIVATE = _set("optimizer", "private", False)


@pytest.mark.parametrize("edit,field", [
    (_all(_NOT_PRIVATE, _set("privacy", "delta", 1.0)), "privacy.delta: 1.0 is not in (0, 1)"),
    (_all(_NOT_PRIVATE, _set("privacy", "delta", math.nan)), "privacy.delta: nan is not in (0, 1)"),
    (_all(_NOT_PRIVATE, _set("privacy", "noise_multiplier", 0.0)), "privacy.noise_multiplier: 0.0, no noise"),
    (_all(_set("privacy", "epsilon", 0.0), _set("privacy", "noise_multiplier", 2.5)),
     "privacy.epsilon: 0 after"),
    (_set("privacy", "noise_multiplier", math.inf), "privacy.noise_multiplier: inf is not a finite number"),
    (_all(_NOT_PRIVATE, _set("privacy", "noise_multiplier", math.inf)), "privacy.noise_multiplier: inf"),
])
def test_a_builtin_runs_checks_read_the_registrys_claim_as_its_label_does(tmp_path, capsys, edit, field):
    """The label bypass: a DP-SGD run file edited to say optimizer.private false, with delta 1, delta
    NaN or sigma 0, was labelled private (the label read the registry's claim, the checks the
    file's); epsilon 0 after noisy steps with sigma 2.5, and sigma infinite, were labelled private
    too. Each is refused in one line naming the key, the registry's claim named."""
    err = _refused_by_aggregate(tmp_path, capsys, edit, field)
    if "inf" not in field:  # the claim checked is the registry's, whatever the file says
        assert "(the registry's dpsgd is private)" in err, err


def test_a_run_without_a_release_keeps_epsilon_zero(tmp_path):
    """epsilon 0 is what a private claim spends before its first step: a record of 0 steps at
    epsilon 0 is a valid file, labelled private (the rule refuses epsilon 0 only after a release)."""
    from dpbench.pipeline.catalog import OPTIMIZERS
    from dpbench.reporting.aggregate import aggregate_runs

    path = _edited(tmp_path, "none", _all(_set("privacy", "epsilon", 0.0), _set("privacy", "steps", 0)))
    runs, _ = aggregate_runs([path], tmp_path / "r.parquet", tmp_path / "e.parquet", builtins=OPTIMIZERS)
    assert runs["private"].tolist() == [True] and runs["epsilon"].tolist() == [0.0]


@pytest.mark.parametrize("copy", [False, True])
def test_aggregate_refuses_one_run_given_twice(tmp_path, capsys, copy):
    """The same run file given twice (one path twice, or a copy of it) was two seeds with an
    interval: dpbench aggregate refuses it in one line naming both files and the run_id."""
    import shutil

    from dpbench import cli

    path = _edited(tmp_path, "run", lambda m: None)
    other = path
    if copy:
        (tmp_path / "copy").mkdir()
        other = Path(shutil.copy(path, tmp_path / "copy" / "renamed.parquet"))
    assert cli.main(["aggregate", str(path), str(other), "--out-runs", str(tmp_path / "r.parquet"),
                     "--out-epochs", str(tmp_path / "e.parquet")]) != 0
    err = capsys.readouterr().err.strip()
    run_id = results.read_meta(path).get("run_id", path.stem)
    assert err == (f"dpbench aggregate: error: run files {path} and {other} are one run (run_id {run_id}"
                   f"{'' if copy else ', the same file'}): give each run once (each its own dpbench train "
                   "--run-id)"), err
    assert not (tmp_path / "r.parquet").exists()
