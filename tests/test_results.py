"""The run file: schema, metadata round trip, atomic writes."""

import math

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
    from dpbench.reporting.aggregate import aggregate

    lm = REPO / "benchmarks" / "results" / "lm" / "study"
    noiseless = lm / "extra" / "dpsgd-sigma0-lr1-s0.parquet"
    private = lm / "runs" / "P4" / "dpsgd" / "L64-E1-eps1-lr1-s0.parquet"
    meta = results.read_meta(noiseless)
    assert meta["optimizer"]["private"] and meta["privacy"]["epsilon"] == math.inf
    assert not results.is_private(results.read_meta(noiseless)) and results.is_private(results.read_meta(private))
    aggregate([noiseless, private], tmp_path / "runs.parquet", tmp_path / "epochs.parquet")
    runs = pd.read_parquet(tmp_path / "runs.parquet")
    row = runs[runs["noise_multiplier"] == 0].iloc[0]
    assert row["optimizer"] == "dpsgd" and not row["private"] and not row["dp_guarantee"]
    row = runs[runs["noise_multiplier"] > 0].iloc[0]
    assert row["private"] and row["dp_guarantee"] and row["epsilon"] < 1.0
