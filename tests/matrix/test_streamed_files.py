"""The streamed mechanisms' factorizations as a cached stage (dpbench.matrix.store: keys, streamed_files):
keys name what determines a strategy, files round-trip exactly, damaged, stale and mismatched
files are refused, a run with a cached file does not optimise, and the workflow names the file
the run's plan reads."""

import json
import math

import numpy as np
import pytest

from dpbench.pipeline.grid import Cell
from dpbench.matrix import banded, blt
from dpbench.matrix.store import cache, keys, streamed_files
from dpbench.mechanisms import cyclic_poisson, streamed
from dpbench.mechanisms.base import PlanRequest
from dpbench.matrix.store.streamed_files import StreamedFactorizationError
from dpbench.optimizers import get_optimizer


def request(n_train, batch_size, epochs, epsilon=None, **kw):
    return PlanRequest(n_train, batch_size, epochs, target_epsilon=epsilon, **{"delta": 1e-5, **kw})


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DPBENCH_CACHE_DIR", str(tmp_path / "cache"))


def test_keys_name_what_determines_the_strategy():
    band, blt_mech, amp = (get_optimizer(n).mechanism for n in ("dpmatrix-band", "dpmatrix-blt", "dpmatrix-band-amp"))
    # Setup 2, L = 32: b' = 1875 steps per epoch, one epoch
    assert band.key(request(60_000, 32, 1)) == "band-n1875-b64"  # auto: min(64, b', T)
    assert band.key(request(60_000, 32, 1, hyperparameters={"bands": 16})) == "band-n1875-b16"
    assert blt_mech.key(request(60_000, 32, 1)) == "blt-n1875-sep1875-k1-mauto"
    # Setup 3, P1, L = 1024: b' = 48, k = 30, T = 1440
    assert band.key(request(50_000, 1024, 30)) == "band-n1440-b48"
    assert blt_mech.key(request(50_000, 1024, 30, hyperparameters={"buffers": 2})) == "blt-n1440-sep48-k30-m2"
    # amplified: T = round(E N / L) = 1465; auto names (N, L, T, epsilon, delta); a given b is a plain band
    assert amp.key(request(50_000, 1024, 30, epsilon=1.0)) == "band-auto-N50000-L1024-n1465-eps1-delta1e-05"
    assert amp.key(request(50_000, 1024, 30, epsilon=0.5, delta=1e-6)) == "band-auto-N50000-L1024-n1465-eps0.5-delta1e-06"
    assert amp.key(request(50_000, 1024, 30, hyperparameters={"bands": 48})) == "band-n1465-b48"
    with pytest.raises(ValueError, match="b <= N / L"):
        amp.key(request(50_000, 1024, 30, hyperparameters={"bands": 49}))
    # single participation does not depend on b': canonical separation n
    assert keys.blt_key(100, 7, 1, None) == keys.blt_key(100, 100, 5, None) == \
        "blt-n100-sep100-k1-mauto"
    assert keys.blt_key(100, 30, 9, 3) == "blt-n100-sep30-k4-m3"  # k' = min(k, ceil(n / b'))


@pytest.mark.parametrize("key", ["band-n1875-b64", "blt-n100-sep30-k4-m3", "blt-n100-sep100-k1-mauto",
                                 "band-auto-N50000-L1024-n1465-eps1-delta1e-05",
                                 "band-auto-N600-L60-n30-eps0.25-delta1e-05"])
def test_keys_parse_back(key):
    assert keys.is_streamed_key(key)
    kind, params = keys.parse_streamed_key(key)
    assert kind == key.split("-n")[0].split("-N")[0]
    assert params["n"] == int(key.split("-n")[1].split("-")[0])


@pytest.mark.parametrize("key,why", [("band-n10-b11", "b <= n"), ("blt-n100-sep30-k9-m3", "not canonical"),
                                     ("band-auto-N600-L60-n30-eps1.0-delta1e-05", "not canonical"),
                                     ("blt-n100-sep30-k4-m9", "buffers must be"), ("me-k30-b48", "not a streamed")])
def test_bad_keys_are_refused(key, why):
    with pytest.raises(ValueError, match=why):
        keys.parse_streamed_key(key)


def test_file_round_trips_exactly_and_plan_reads_it_without_optimising(tmp_path, monkeypatch):
    def no(*a, **k):
        raise AssertionError("a run with a cached factorization must not optimise")
    for module, name in ((blt, "optimize"), (banded, "optimize"), (cyclic_poisson, "choose_bands")):
        monkeypatch.setattr(module, name, no)
    key = "blt-n30-sep10-k3-m2"
    strategy = blt.BLT.from_pair([0.9, 0.3], [0.7, 0.1], 30)
    cached = cache.streamed_path(tmp_path / "c", key)  # as the workflow's factorize stage leaves it
    streamed_files.save(streamed_files.StreamedFactorization(key, strategy), cached)
    path = tmp_path / "f.json"
    streamed_files.save(streamed_files.load(cached, key), path)
    assert path.read_text() == cached.read_text()  # exact decimal float64: the round trip is the identity
    mech = get_optimizer("dpmatrix-blt").mechanism
    for run in (request(600, 60, 3, hyperparameters={"buffers": 2}, factorization=path),
                request(600, 60, 3, hyperparameters={"buffers": 2}, cache_dir=tmp_path / "c")):
        plan = mech.plan(run)
        np.testing.assert_array_equal(plan.factorization.theta, strategy.theta)
        # the sensitivity is recomputed from the loaded coefficients and the run's Pi(b' = 10, k = 3)
        assert plan.sensitivity == strategy.sensitivity(10, 3)
        assert plan.factorization_key == key
    assert plan.factorization_file == cached


def test_amplified_auto_reads_the_band_search_from_its_file(tmp_path, monkeypatch):
    key = "band-auto-N600-L60-n30-eps1-delta1e-05"
    mech = get_optimizer("dpmatrix-band-amp").mechanism
    run = request(600, 60, 3, epsilon=1.0, cache_dir=tmp_path)
    plan = mech.plan(run)
    assert plan.factorization_key == key and (tmp_path / "streaming" / f"{key}.json").exists()
    proxies = {e["bands"]: e["proxy"] for e in plan.band_search}
    assert plan.bands == min(proxies, key=proxies.get)
    monkeypatch.setattr(cyclic_poisson, "choose_bands", lambda *a, **k: pytest.fail("the search ran again"))
    again = mech.plan(run)
    assert again.bands == plan.bands and again.sample_rate == plan.sample_rate
    # another target epsilon is another search, hence another file
    assert mech.key(request(600, 60, 3, epsilon=10.0)) != key


def damaged(tmp_path, key, edit):
    path = tmp_path / f"{key}.json"
    streamed_files.save(streamed.compute(key), path)
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))
    return path


@pytest.mark.parametrize("key,edit,why", [
    ("band-n40-b5", lambda r: r["coef"].__setitem__(2, float(np.nextafter(r["coef"][2], 1))), "digest"),
    ("band-n40-b5", lambda r: r.update(coef=[0.0] * 5), "c_0 > 0"),
    ("band-n40-b5", lambda r: r.update(format_version=0), "stale"),
    ("band-n40-b5", lambda r: r.update(steps=41), "41 steps"),
    ("band-n40-b5", lambda r: r.update(error_mean=r["error_mean"] * 1.01), "err_mean"),
    ("band-n40-b5", lambda r: r.update(column_normalized=False), "column-normalised"),
    ("blt-n40-sep40-k1-m1", lambda r: r.update(theta=r["theta_hat"], theta_hat=r["theta"]), "interlaced"),
    ("blt-n40-sep40-k1-m1", lambda r: r["theta"].append(0.5), "length 1"),
    ("band-auto-N600-L60-n30-eps1-delta1e-05", lambda r: r["band_search"][-1].update(proxy=-1.0),
     "best candidate"),
])
def test_damaged_files_are_refused_naming_the_check_and_the_fix(tmp_path, key, edit, why):
    path = damaged(tmp_path, key, edit)
    with pytest.raises(StreamedFactorizationError, match=why) as exc:
        streamed_files.load(path, key)
    assert str(path) in str(exc.value) and "delete" in str(exc.value)


def test_a_file_for_another_setting_and_unreadable_files_are_refused(tmp_path):
    path = tmp_path / "f.json"
    streamed_files.save(streamed.compute("band-n40-b5"), path)
    with pytest.raises(StreamedFactorizationError, match="is for 'band-n40-b5', but this run needs 'band-n40-b4'"):
        streamed_files.load(path, "band-n40-b4")
    mech = get_optimizer("dpmatrix-band").mechanism
    with pytest.raises(StreamedFactorizationError, match="this run needs 'band-n30-b10'"):
        mech.plan(request(600, 60, 3, factorization=path))
    path.write_text(path.read_text()[:100])  # truncated
    with pytest.raises(StreamedFactorizationError, match="unreadable"):
        streamed_files.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        mech.plan(request(600, 60, 3, factorization=tmp_path / "missing.json"))


def test_workflow_names_the_file_the_plan_reads(tmp_path):
    """Cell.cache_files (what the workflow passes as --factorization) is the plan's own key, for
    every streamed mechanism, with the config's subset, validation split and delta."""
    train = {"train_subset": 700, "validation_size": 100, "delta": 1e-6}
    for name, hp in (("dpmatrix-band", (("bands", 5),)), ("dpmatrix-blt", (("buffers", 1),)),
                     ("dpmatrix-band-amp", ()), ("dpmatrix-band-amp", (("bands", 2),))):
        cell = Cell("P2", name, 60, 2, 2.0, 0.1, 0, 123, hp)
        files = cell.cache_files(train, tmp_path)
        assert set(files) == {"factorization"}
        run = request(600, 60, 2, hyperparameters=dict(hp), epsilon=2.0, delta=1e-6, cache_dir=tmp_path)
        plan = get_optimizer(name).mechanism.plan(run)
        assert files["factorization"] == cache.streamed_path(tmp_path, plan.factorization_key)
        assert plan.factorization_file == files["factorization"]
    assert Cell("P2", "dpsgd", 60, 2, 2.0, 0.1, 0, 123).cache_files(train, tmp_path) == {}
    dense = Cell("P2", "dpmatrix-se", 60, 1, 2.0, 0.1, 0, 123).cache_files(train, tmp_path)
    assert dense["factorization"].parent.name == "se-k1-b10" and dense["noise"].suffix == ".npy"


def test_noise_estimate_counts_dense_files_only(tmp_path, capsys):
    from dpbench.cli import main
    from dpbench.matrix.store.noise_files import file_bytes

    config = tmp_path / "c.yaml"
    config.write_text(f"""results_dir: {tmp_path / 'results'}
grid:
  - problems: [P2]
    batch_sizes: [32, 64]
    epsilons: [1, 10]
    epochs: [1]
    optimizers:
      dpsgd: {{lr: [1.0]}}
      dpmatrix-se: {{lr: [0.1, 1.0]}}
      dpmatrix-band: {{lr: [1.0]}}
      dpmatrix-band-amp: {{lr: [1.0]}}
""")
    assert main(["noise", "--estimate", str(config)]) == 0
    out = capsys.readouterr().out
    # one noise file per (factorization, d, seed): L = 32 and 64, shared by both lr and epsilons
    assert "read 2 noise files" in out
    assert "| 1875 | 225034 | 1.69 | 4 |" in out and "| 937 | 225034 | 0.84 | 4 |" in out
    total = file_bytes(1875, 225_034) + file_bytes(937, 225_034)
    assert f"noise files: {total / 1e9:.2f} GB" in out
    assert "streamed mechanisms: 6 factorizations" in out  # band: 2 keys; band-amp auto: 4 (L x epsilon)
    assert file_bytes(1875, 225_034) == 128 + 1875 * 225_034 * 4


def test_factorize_command_writes_a_streamed_key(tmp_path):
    from dpbench.cli import main

    out = tmp_path / "f.json"
    assert main(["factorize", "--key", "band-n50-b4", "--out", str(out)]) == 0
    fact = streamed_files.load(out, "band-n50-b4")
    assert fact.strategy.bands == 4 and math.isclose(np.linalg.norm(fact.strategy.coef), 1.0, rel_tol=1e-12)
    assert main(["factorize", "--key", "band-n50-b4", "--out", str(out), "--tol", "1e-3"]) == 2


@pytest.mark.slow
def test_workflow_factorizes_once_and_trains_streamed_cells(tmp_path, fmnist_dir):
    """factorize_streamed -> train -> aggregate through Snakemake: one job per key (the band
    search's file shared by two learning rates), each cell reads the workflow's file, and no
    noise file or checkpoint is left anywhere."""
    import subprocess

    import pandas as pd
    import yaml

    from conftest import REPO, snakemake_exe, tree_env
    from dpbench.reporting.results import read_meta

    config = {"data_dir": str(fmnist_dir), "results_dir": "out", "train": {"train_subset": 256, "test_subset": 200},
              "figures": {},
              "grid": [{"problems": ["P2"], "batch_sizes": [32], "epochs": [1], "epsilons": [10],
                        "optimizers": {"dpmatrix-band": {"lr": [0.5]}, "dpmatrix-band-amp": {"lr": [0.5, 1.0]},
                                       "dpmatrix-blt": {"lr": [0.5], "buffers": 1}}}]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([snakemake_exe(), "--snakefile", REPO / "Snakefile", "--directory", tmp_path, "--configfile",
                           tmp_path / "config.yaml", "--cores", "2"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900, env=tree_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "out"
    keys = {"dpmatrix-band": "band-n8-b8", "dpmatrix-blt": "blt-n8-sep8-k1-m1",
            "dpmatrix-band-amp": "band-auto-N256-L32-n8-eps10-delta1e-05"}
    assert sorted(p.name for p in (out / "cache").iterdir()) == ["streaming"]  # no dense cache, no noise file
    assert sorted(p.name for p in (out / "cache" / "streaming").glob("*.json")) == sorted(f"{k}.json" for k in
                                                                                         keys.values())
    assert proc.stderr.count("rule factorize_streamed:") == 3
    runs = pd.read_parquet(out / "aggregate" / "runs.parquet")
    assert len(runs) == 4 and (runs.status == "completed").all() and (runs.steps == 8).all()
    for _, run in runs.iterrows():
        matrix = read_meta(tmp_path / run.path)["privacy"]["matrix"]
        assert matrix["key"] == keys[run.optimizer]
        assert matrix["factorization_file"] == f"out/cache/streaming/{keys[run.optimizer]}.json"
    assert not list(out.rglob("*.ckpt")) and not list(out.rglob("*.npy"))


@pytest.mark.parametrize("name,value,ok", [("bands", "auto", True), ("bands", [16, "auto"], True), ("bands", 0, False),
                                           ("bands", "16", False), ("bands", [1, -2], False), ("buffers", 8, True),
                                           ("buffers", 9, False), ("buffers", "many", False)])
def test_config_schema_accepts_auto_or_a_positive_integer(name, value, ok):
    import copy

    from dpbench.pipeline.grid import ConfigError, expand, validate

    optimizer = "dpmatrix-band-amp" if name == "bands" else "dpmatrix-blt"
    config = {"grid": [{"problems": ["P2"], "batch_sizes": [32], "epochs": [1], "epsilons": [1],
                        "optimizers": {optimizer: {"lr": 1.0, name: copy.deepcopy(value)}}}]}
    if ok:
        cells = expand(validate(config))
        # a value at its default ("auto") is the cell without the hyperparameter
        assert sorted((dict(c.hyperparameters).get(name, "auto") for c in cells), key=str) == sorted(
            value if isinstance(value, list) else [value], key=str)
    else:
        with pytest.raises(ConfigError, match=rf"grid\.0\.optimizers\.{optimizer}\.{name}: .*auto or"):
            validate(config)


def test_hp_flags_carry_auto_and_integers():
    from dpbench.cli import build_parser

    args = build_parser().parse_args(["train", "--problem", "P2", "--optimizer", "dpmatrix-band-amp", "--lr", "1",
                                      "--batch-size", "32", "--epochs", "1", "--seed", "0", "--out", "x.parquet",
                                      "--hp", "bands=auto", "--hp", "buffers=3"])
    assert args.hyperparameters == [("bands", "auto"), ("buffers", 3)]
    mech = get_optimizer("dpmatrix-band").mechanism
    with pytest.raises(ValueError, match="'bands' must be a positive integer or 'auto', got 'abc'"):
        mech.key(request(600, 60, 1, hyperparameters={"bands": "abc"}))
