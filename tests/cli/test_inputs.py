"""Inputs that fail loudly, and nothing lost: every bad value is refused before any work with
a message naming the option, key or file, and no failure leaves a partial or stray file."""

import argparse
import contextlib
import errno
import math
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dpbench.privacy import accounting
from dpbench import cli
from dpbench.pipeline.grid import ConfigError, validate
from dpbench.optimizers import OPTIMIZERS
from dpbench.training.train import RunConfig

NON_FINITE = [math.inf, -math.inf, math.nan]


@pytest.fixture(autouse=True)
def no_data(monkeypatch):
    """A bad value must be refused before the data is read: reading it fails these tests."""
    from dpbench.data import image_datasets

    def load(*args, **kwargs):
        raise AssertionError("the data was read: the bad value was not refused up front")

    monkeypatch.setattr(image_datasets, "load", load)


def train_argv(tmp_path, *extra, optimizer="dpsgd"):
    """`dpbench train` arguments of a tiny cell."""
    return ["train", "--problem", "P2", "--optimizer", optimizer, "--lr", "0.1", "--batch-size", "10",
            "--epochs", "1", "--seed", "0", "--epsilon", "1", "--data-dir", str(tmp_path / "no-data"),
            "--out", str(tmp_path / "run.parquet"), *map(str, extra)]


def cli_error(argv, capsys) -> tuple[int, str]:
    """Exit status and stderr of ``dpbench`` run in-process (argparse exits, main returns)."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


# -- 6. non-finite values -------------------------------------------------------------------


@pytest.mark.parametrize("option,value", [
    ("--epsilon", "inf"), ("--epsilon", "nan"), ("--lr", "inf"), ("--lr", "nan"), ("--delta", "inf"),
    ("--delta", "nan"), ("--noise-multiplier", "inf"), ("--noise-multiplier", "nan"), ("--clip-norm", "inf"),
    ("--checkpoint-every", "nan"),
])
def test_cli_refuses_non_finite_numbers_naming_the_option(tmp_path, capsys, option, value):
    code, err = cli_error(train_argv(tmp_path, option, value), capsys)
    assert code == 2 and f"argument {option}" in err and "finite" in err, err
    assert not (tmp_path / "run.parquet").exists()


@pytest.mark.parametrize("name", ["epsilon", "lr", "delta", "noise_multiplier", "clip_norm"])
@pytest.mark.parametrize("value", NON_FINITE)
def test_run_config_refuses_non_finite_numbers(name, value):
    settings = dict(problem="P2", optimizer="dpsgd", lr=0.1, batch_size=10, epochs=1, seed=0, epsilon=1.0)
    if name == "noise_multiplier":  # sigma given: no target (both together are refused first)
        settings["epsilon"] = None
    cfg = RunConfig(**{**settings, name: value})
    with pytest.raises(ValueError, match=f"^{name}: expected a finite .*, got {value}$"):
        cfg.validate(OPTIMIZERS["dpsgd"])


def test_a_target_refuses_a_non_finite_epsilon_a_delta_outside_0_1_or_an_unknown_accountant():
    """Checked when the target is made, before any mechanism sees it: no search ever starts on them."""
    from dpbench.mechanisms.base import Target

    for eps in (*NON_FINITE, 0.0, -1.0):
        with pytest.raises(ValueError, match="target epsilon must be a finite positive number"):
            Target(eps, 1e-5, "rdp")
    for delta in (*NON_FINITE, 0.0, 1.0, 2.0):
        with pytest.raises(ValueError, match="delta must be in"):
            Target(1.0, delta, "rdp")
    with pytest.raises(ValueError, match=r"^unknown accountant 'gdp'; choose one of prv, rdp, rdp-integer-orders, "
                                         r"analytic-gaussian$"):
        Target(1.0, 1e-5, "gdp")


@pytest.mark.parametrize("name", sorted(n for n, s in OPTIMIZERS.items() if s.private))
def test_the_shared_calibration_refuses_a_bad_target_for_every_mechanism(name):
    """calibration.calibrate makes the Target every mechanism's calibrate is given (the plan,
    None here, is never looked at)."""
    from dpbench.training.calibration import calibrate

    with pytest.raises(ValueError, match="target epsilon must be a finite positive number"):
        calibrate(OPTIMIZERS[name], None, target_epsilon=math.inf, noise_multiplier=None, delta=1e-5, accountant="rdp")
    with pytest.raises(ValueError, match="delta must be in"):
        calibrate(OPTIMIZERS[name], None, target_epsilon=1.0, noise_multiplier=None, delta=1.0, accountant="rdp")


@pytest.mark.parametrize("sigma", [*NON_FINITE, -1.0])
def test_the_shared_calibration_refuses_a_non_finite_noise_multiplier(sigma):
    """calibration.calibrate is what every caller (a grid cell, the audit) gets its claim from."""
    from dpbench.training.calibration import calibrate
    from dpbench.mechanisms.base import Plan

    with pytest.raises(ValueError, match="noise multiplier must be finite and >= 0"):
        calibrate(OPTIMIZERS["dpsgd"], Plan(10, 5, 0.1), target_epsilon=None, noise_multiplier=sigma, delta=1e-5,
                  accountant="rdp")


@pytest.mark.parametrize("value", ["1e-300", "1e300", "0.001", "20000"])
def test_cli_refuses_a_noise_multiplier_no_accountant_computes_before_any_work(tmp_path, capsys, value):
    """--noise-multiplier 1e-300 trained to the end and died writing the record
    (ZeroDivisionError in the accountant: the compute lost); 1e300 overflowed in add_noise. Both
    are refused in one line naming the option and the range, before any data is read (no_data)."""
    code, err = cli_error(train_argv(tmp_path, "--noise-multiplier", value), capsys)
    assert code == 2, err  # argparse's usage, then the one line of the error
    assert err.splitlines()[-1] == (f"dpbench train: error: argument --noise-multiplier: expected a finite number, 0 (no noise) or from "
            f"{accounting.MIN_NOISE_MULTIPLIER:g} to {accounting.MAX_NOISE_MULTIPLIER:g}, got '{value}'"), err
    assert not (tmp_path / "run.parquet").exists()
    assert RunConfig(problem="P2", optimizer="dpsgd", lr=0.1, batch_size=10, epochs=1, seed=0,
                     noise_multiplier=accounting.MIN_NOISE_MULTIPLIER).noise_multiplier == 1e-2


def test_the_calibration_accounts_a_given_sigma_before_the_run_not_after_it():
    """A given sigma whose epsilon its accountant cannot compute (RDP divides by zero at sigma
    1e-300) is refused by calibrate, before any step, in one line naming the option, the
    accountant and the steps; a computable one is the claim as before (its epsilon unchanged)."""
    from dpbench.mechanisms.base import Plan
    from dpbench.training.calibration import calibrate

    with pytest.raises(ValueError, match=r"^noise multiplier 1e-300 \(--noise-multiplier\): the epsilon of its "
                                         r"5 planned steps cannot be accounted by rdp \(ZeroDivisionError"):
        calibrate(OPTIMIZERS["dpsgd"], Plan(10, 5, 0.1), target_epsilon=None, noise_multiplier=1e-300,
                  delta=1e-5, accountant="rdp")
    claim = calibrate(OPTIMIZERS["dpsgd"], Plan(10, 5, 0.1), target_epsilon=None, noise_multiplier=1.0,
                      delta=1e-5, accountant="rdp")
    assert claim.epsilon() == accounting.RDP.epsilon([(1.0, 0.1, 5)], 1e-5)


def test_sigma_searches_are_bounded():
    # a target no sigma <= MAX_NOISE_MULTIPLIER (per unit of sensitivity) reaches is an error, not a
    # search without end (the Gaussian at delta = 0 never gets there) or a sigma beyond the cap
    with pytest.raises(ValueError, match="delta must be in"):
        accounting.gaussian_noise_multiplier(1.0, 0.0)
    with pytest.raises(ValueError, match="not reachable"):
        accounting.gaussian_noise_multiplier(1e-7, 1e-5)
    sigma = accounting.gaussian_noise_multiplier(1e-3, 1e-5, sensitivity=100.0)  # large, but reachable
    assert accounting.MAX_NOISE_MULTIPLIER < sigma < 100 * accounting.MAX_NOISE_MULTIPLIER
    assert accounting.gaussian_delta(1e-3, 100.0 / sigma) <= 1e-5
    for eps in NON_FINITE:
        with pytest.raises(ValueError, match="target epsilon must be a finite positive number"):
            accounting.smallest_sigma(lambda s: 1 / s, eps)
        with pytest.raises(ValueError, match="target epsilon must be a finite positive number"):
            accounting.gaussian_noise_multiplier(eps)


def _config(**block):
    return {"grid": [{"problems": ["P2"], "batch_sizes": [10], "epochs": [1], "epsilons": [1.0],
                      "optimizers": {"dpsgd": {"lr": 0.1}}, **block}]}


@pytest.mark.parametrize("value", NON_FINITE)
def test_config_refuses_non_finite_numbers_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"config key grid\.0\.epsilons\.1: .* not a finite number"):
        validate(_config(epsilons=[1.0, value]))
    with pytest.raises(ConfigError, match=r"config key grid\.0\.optimizers\.dpsgd\.lr: .* not a finite number"):
        validate(_config(optimizers={"dpsgd": {"lr": value}}))
    with pytest.raises(ConfigError, match=r"config key grid\.0\.optimizers\.dpdisk\.kappa\.0: .* not a finite"):
        validate(_config(optimizers={"dpdisk": {"lr": 0.1, "kappa": [value]}}))
    with pytest.raises(ConfigError, match=r"config key train\.delta: .* not a finite number"):
        validate({**_config(), "train": {"delta": value}})


# -- 7. cell ids: unique, exact, one per computation -----------------------------------------


def test_number_format_of_ids_round_trips_and_keeps_the_short_forms():
    from dpbench.pipeline.grid import fmt

    for x in (0.1, 0.1000001, 1 / 3, 1e-5, 2.5e-6, 10.0, 123456789.0, 1e300, 7, 123456789):
        assert float(fmt(x)) == x, (x, fmt(x))
    # the ids every existing config has: unchanged
    assert [fmt(x) for x in (0.001, 1e-4, 1e-5, 10.0, 100.0, 0.5, 2)] == ["0.001", "0.0001", "1e-05", "10", "100",
                                                                          "0.5", "2"]


def test_values_that_print_alike_are_distinct_cells():
    from dpbench.pipeline.grid import expand

    cells = expand(validate(_config(optimizers={"dpsgd": {"lr": [0.1, 0.1000001]}}, epsilons=[1.0, 1.0000001])))
    assert len(cells) == 4 and len({c.id for c in cells}) == 4
    assert {c.id.split("/")[-1] for c in cells} == {f"L10-E1-eps{e}-lr{lr}-s0" for e in ("1", "1.0000001")
                                                    for lr in ("0.1", "0.1000001")}


def test_a_hyperparameter_at_its_default_is_the_cell_without_it():
    from dpbench.pipeline.grid import expand

    config = _config(optimizers={"dpdisk": {"lr": 0.1, "kappa": 0.7}})
    config["grid"].append({**config["grid"][0], "optimizers": {"dpdisk": {"lr": 0.1}}})
    config["grid"].append({**config["grid"][0], "optimizers": {"dpdisk": {"lr": 0.1, "kappa": [0.5, 0.7],
                                                                          "gamma": 0.5}}})
    cells = expand(validate(config))
    assert [c.id for c in cells] == ["P2/dpdisk/L10-E1-eps1-lr0.1-kappa0.5-s0", "P2/dpdisk/L10-E1-eps1-lr0.1-s0"]


def test_cells_whose_ids_collide_are_refused_naming_both_values():
    from dpbench.pipeline.grid import expand

    # the string "8" and the integer 8 print alike but are different settings
    with pytest.raises(ConfigError, match=r"grid\.0\.optimizers\.dpmatrix-band.*'8'.* 8\b"):
        expand(validate(_config(optimizers={"dpmatrix-band": {"lr": 0.1, "bands": ["8", 8]}})))
    with pytest.raises(ConfigError, match=r"grid\.0\.optimizers\.dpmatrix-band\.bands: .*'a/b'"):
        expand(validate(_config(optimizers={"dpmatrix-band": {"lr": 0.1, "bands": "a/b"}})))


def test_what_a_cell_passes_to_dpbench_train_is_exactly_its_values():
    from dpbench.pipeline.grid import expand

    config = _config(optimizers={"dpsgd": {"lr": 0.1000001}, "d2p2sgd": {"lr": 1 / 3, "paper_sensitivity": True,
                                                                        "projection_rate": 0.30000000000000004}},
                     epsilons=[0.1 + 0.2])
    for cell in expand(validate(config)):
        args = cli.build_parser().parse_args(["train", *cell.train_args(config["train"]), "--out", "x.parquet"])
        assert (args.lr, args.epsilon, args.seed) == (cell.lr, cell.epsilon, cell.seed)
        given = dict(args.hyperparameters or [])
        assert given == dict(cell.hyperparameters)
        assert all(type(given[k]) is type(v) for k, v in cell.hyperparameters)  # True stays a bool


@pytest.mark.parametrize("optimizer,hp,match", [
    ("dpdisk", "kappa=abc", r"--hp kappa=abc: .*'kappa' of 'dpdisk' takes a finite number \(default 0\.7\)"),
    ("dpdisk", "kappa=nan", r"'kappa' of 'dpdisk' takes a finite number"),
    ("dpdisk", "kappa=true", r"'kappa' of 'dpdisk' takes a finite number"),
    ("d2p2sgd", "paper_sensitivity=1", r"'paper_sensitivity' of 'd2p2sgd' takes true or false"),
    ("dpsgd", "kappa=1", r"--hp kappa=1: optimizer 'dpsgd' has no hyperparameter 'kappa'"),
])
def test_hyperparameters_of_the_wrong_type_are_refused_up_front(tmp_path, capsys, optimizer, hp, match):
    code, err = cli_error(train_argv(tmp_path, "--hp", hp, optimizer=optimizer), capsys)
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and re.search(match, err), err


def test_config_hyperparameters_of_the_wrong_type_name_the_key():
    with pytest.raises(ConfigError, match=r"grid\.0\.optimizers\.dpdisk: .*'kappa' of 'dpdisk' takes a finite"):
        validate(_config(optimizers={"dpdisk": {"lr": 0.1, "kappa": [0.5, "abc"]}}))


# -- 8. the output location is checked before any work ---------------------------------------


def timed_cli_error(argv, capsys):
    t0 = time.perf_counter()
    code, err = cli_error(argv, capsys)
    return code, err, time.perf_counter() - t0


def test_out_that_is_a_directory_fails_in_the_first_second(tmp_path, capsys):
    code, err, seconds = timed_cli_error(train_argv(tmp_path, "--out", tmp_path), capsys)
    assert code == 2 and f"argument --out: {tmp_path} is a directory" in err and seconds < 1, (err, seconds)


def test_out_under_a_file_fails_in_the_first_second(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code, err, seconds = timed_cli_error(train_argv(tmp_path, "--out", tmp_path / "file" / "run.parquet"), capsys)
    assert code == 2 and "argument --out" in err and "cannot create its directory" in err and seconds < 1, err


def test_out_that_cannot_be_written_fails_in_the_first_second(tmp_path, capsys, monkeypatch):
    if os.geteuid() != 0:  # root writes anywhere: there the refusal is simulated below
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        code, err, seconds = timed_cli_error(train_argv(tmp_path, "--out", locked / "run.parquet"), capsys)
        assert code == 2 and f"argument --out: cannot write in {locked}" in err and seconds < 1, err

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    code, err, seconds = timed_cli_error(train_argv(tmp_path), capsys)
    assert code == 2 and f"argument --out: cannot write in {tmp_path}: Permission denied" in err and seconds < 1, err


def test_out_on_a_full_file_system_fails_in_the_first_second(tmp_path, capsys, monkeypatch):
    real = os.statvfs

    def full(path):
        st = real(path)
        return types.SimpleNamespace(f_bavail=3, f_frsize=st.f_frsize, f_bsize=st.f_bsize)

    monkeypatch.setattr(os, "statvfs", full)
    code, err, seconds = timed_cli_error(train_argv(tmp_path), capsys)
    assert code == 2 and "argument --out" in err and "free on its file system" in err and seconds < 1, err
    assert list(tmp_path.iterdir()) == []  # the probe left nothing


# -- 9. checkpoints: verified on load, a bad one moved aside, no temporary file left ----------


def test_a_damaged_checkpoint_is_moved_aside_and_the_run_starts_afresh(tiny_fmnist, tmp_path, capsys):
    from conftest import run_cell

    cfg = RunConfig(problem="P2", optimizer="sgd", lr=0.1, batch_size=60, epochs=2, seed=3, train_subset=120,
                    test_subset=50, progress_every_s=1e9)
    ckpt = tmp_path / "run.parquet.ckpt"
    reference = run_cell(cfg, checkpoint=ckpt)  # leaves its epoch-1 checkpoint (the CLI deletes it)
    for damage in ("truncated", "zeroed", "middle"):
        raw = ckpt.read_bytes()
        half = len(raw) // 2
        ckpt.write_bytes({"truncated": raw[:half], "zeroed": bytes(len(raw)),
                          "middle": raw[:half] + bytes(64) + raw[half + 64:]}[damage])
        capsys.readouterr()
        fresh = run_cell(cfg, checkpoint=ckpt)
        err = capsys.readouterr().err
        aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.parquet.ckpt.damaged")]
        assert len(aside) == 1, damage
        assert f"checkpoint {ckpt} is damaged" in err and str(aside[0]) in err and "starting afresh" in err, err
        assert fresh.meta["timing"]["resumes"] == 0
        pd.testing.assert_frame_equal(fresh.metrics, reference.metrics)
        aside[0].unlink()
    assert ckpt.exists() and run_cell(cfg, checkpoint=ckpt).meta["timing"]["resumes"] == 1  # a sound one is used


@pytest.mark.parametrize("where", ["torch.save", "os.fsync"])
def test_a_checkpoint_that_cannot_be_written_leaves_no_temporary_file(tmp_path, monkeypatch, where):
    import torch

    from dpbench.training.checkpoint import Checkpoint

    cfg = RunConfig(problem="P2", optimizer="dpsgd", lr=0.1, batch_size=60, epochs=2, seed=3, epsilon=2.0)
    module, name = (torch, "save") if where == "torch.save" else (os, "fsync")
    real = getattr(module, name)

    def full_disk(*args, **kwargs):
        real(*args, **kwargs)  # the bytes were written (or buffered), then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, name, full_disk)
    ckpt = tmp_path / "run.parquet.ckpt"
    with pytest.raises(OSError, match=rf"no space left on device while writing the checkpoint {ckpt}.*free space"):
        Checkpoint(ckpt, cfg).save({"step": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_writing_a_table_names_it_and_leaves_nothing(tmp_path, monkeypatch):
    from dpbench.reporting import results

    real = os.fsync

    def full_disk(fd):
        real(fd)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    out = tmp_path / "runs.parquet"
    with pytest.raises(OSError, match=rf"no space left on device while writing the table {out}.*free space"):
        results.write_table(pd.DataFrame({"x": [1.0]}), out)
    assert list(tmp_path.iterdir()) == []


# -- 10. friendly errors naming the option or the file ---------------------------------------


@pytest.mark.parametrize("option,value,match", [
    ("--seed", "-5", "argument --seed: expected an integer >= 0, got '-5'"),
    ("--delta", "2", "argument --delta: expected a finite number in (0, 1), got '2'"),
    ("--delta", "0", "argument --delta: expected a finite number in (0, 1), got '0'"),
    ("--epsilon", "abc", "argument --epsilon: expected a finite positive number, got 'abc'"),
])
def test_bad_numbers_name_the_option(tmp_path, capsys, option, value, match):
    code, err = cli_error(train_argv(tmp_path, option, value), capsys)
    assert code == 2 and match in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_device_cuda_without_a_gpu_names_the_option(tmp_path, capsys, device):
    code, err = cli_error(train_argv(tmp_path, "--device", device), capsys)
    assert code == 2 and f"argument --device: {device}: no CUDA GPU is available" in err, err
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        __import__("dpbench.training.cuda").training.cuda.resolve_device(device)


def test_a_damaged_run_file_is_refused_naming_it_and_the_fix(tmp_path):
    from dpbench.reporting import results

    n = 3000
    metrics = pd.DataFrame({"split": "train", "step": np.arange(1, n + 1), "epoch": 1,
                            "loss": np.random.default_rng(0).random(n), "accuracy": 0.5, "batch_size": 10})
    path = results.write_run(tmp_path / "run.parquet", metrics, {"privacy": {}, "optimizer": {"private": True}})
    assert results.read_run(path)[0]["loss"].tolist() == metrics["loss"].tolist()
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 3] + bytes(64) + raw[len(raw) // 3 + 64:])  # the middle of the losses
    with pytest.raises(ValueError, match=rf"run file {path} is damaged .*delete it"):
        results.read_run(path)


def test_aggregate_of_a_directory_or_a_missing_file_says_what_it_is(tmp_path, capsys):
    """A directory given where run files are expected is named as a directory (with the glob
    to give instead), never as a damaged run file to delete; a missing file as missing."""
    runs = tmp_path / "runs"
    runs.mkdir()
    out = ["--out-runs", str(tmp_path / "r.parquet"), "--out-epochs", str(tmp_path / "e.parquet")]
    code, err = cli_error(["aggregate", str(runs), *out], capsys)
    assert code == 2 and err == (f"dpbench aggregate: error: {runs} is a directory, not a .parquet file: give the "
                                 f"files in it ({runs / '*.parquet'})\n")
    code, err = cli_error(["aggregate", str(runs / "absent.parquet"), *out], capsys)
    assert code == 1 and err == f"dpbench aggregate: error: No such file or directory: {runs / 'absent.parquet'}\n"
    assert list(tmp_path.iterdir()) == [runs]


def test_full_disk_while_writing_noise_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    from dpbench.matrix import dense_factorization
    from dpbench.matrix.store import dense_files

    fact = dense_factorization.factorize("me-k2-b3")
    dense_files.save(fact, tmp_path / "f.npz")

    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", pwrite)
    out = tmp_path / "noise.npy"
    code, err = cli_error(["noise", "--factorization", str(tmp_path / "f.npz"), "--dim", "100", "--seed", "1",
                           "--out", str(out)], capsys)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"dpbench noise: error: no space left on device while writing the noise file {out}" in err


# -- 12. files honour the umask --------------------------------------------------------------


@pytest.fixture(params=[0o022, 0o007])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_every_file_written_honours_the_umask(tmp_path, umask):
    import torch  # noqa: F401

    from dpbench.reporting import results
    from dpbench.matrix import dense_factorization
    from dpbench.matrix.store import dense_files, noise_files, streamed_files
    from dpbench.mechanisms import streamed
    from dpbench.training.checkpoint import Checkpoint

    metrics = pd.DataFrame({"split": ["train"], "step": [1], "epoch": [1], "loss": [1.0], "accuracy": [0.5],
                            "batch_size": [3]})
    written = [results.write_run(tmp_path / "run.parquet", metrics, {"privacy": {}}),
               results.write_table(metrics, tmp_path / "table.parquet")]
    fact = dense_factorization.factorize("me-k2-b3")
    dense_files.save(fact, tmp_path / "f.npz")
    written += [tmp_path / "f.npz", tmp_path / "f.json"]
    noise_files.write_noise(tmp_path / "noise.npy", fact.noising, 10, 1)
    written += [tmp_path / "noise.npy", noise_files.meta_path(tmp_path / "noise.npy")]
    streamed_files.save(streamed.compute("band-n12-b3"), tmp_path / "band.json")  # a streamed factorization
    written.append(tmp_path / "band.json")
    cfg = RunConfig(problem="P2", optimizer="dpsgd", lr=0.1, batch_size=60, epochs=2, seed=3, epsilon=2.0)
    Checkpoint(tmp_path / "run.ckpt", cfg).save({"step": 1})
    written.append(tmp_path / "run.ckpt")
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert modes == {p.name: oct(0o666 & ~umask) for p in written}


# -- 13. jobs die with the workflow that started them ----------------------------------------

PARENT = """
import os, subprocess, sys, time
from dpbench.pipeline import watch
child = "from dpbench.pipeline import watch; import time; watch.start(); print('ready', flush=True); time.sleep(120)"
env = dict(os.environ)
env.pop(watch.ENV, None)
plain = subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE, text=True)
env[watch.ENV] = watch.token()  # as the workflow sets it for its jobs
watched = subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE, text=True)
assert plain.stdout.readline() == watched.stdout.readline() == "ready\\n"
print(plain.pid, watched.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux /proc needed to watch processes")
def test_a_job_dies_with_the_workflow_process_that_started_it(tmp_path):
    """kill -9 of the parent (Snakemake): its job whose environment names it stops within
    seconds; a process not started by the workflow (no variable) is left alone."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    # SIGINT ignored, as in the background of a non-interactive shell (CI, nohup scripts): the
    # jobs inherit that, and the watch must stop them all the same
    parent = subprocess.Popen([sys.executable, "-c", PARENT], env=env, stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    plain, watched = map(int, parent.stdout.readline().split())
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 10
        while not _gone(watched) and time.time() < deadline:
            time.sleep(0.1)
        assert _gone(watched), "the watched job outlived its parent"
        assert not _gone(plain)
    finally:
        for pid in (plain, watched):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("option,value", [("--epsilon", "inf"), ("--epsilon", "nan"), ("--delta", "2"),
                                          ("--beta", "nan"), ("--beta", "1"), ("--seed", "-5"), ("--trials", "0"),
                                          ("--seed", str(2**63)), ("--seed", str(2**64))])
def test_audit_refuses_bad_numbers_with_the_same_argument_types(tmp_path, capsys, option, value):
    argv = ["audit", "--optimizer", "dpsgd", "--epsilon", "1", "--trials", "20", "--out", str(tmp_path / "a.parquet"),
            option, value]
    code, err = cli_error(argv, capsys)
    assert code == 2 and f"argument {option}: expected" in err, err
    assert not (tmp_path / "a.parquet").exists()  # refused before any trial


def test_audit_seed_takes_the_configs_bound():
    """dpbench audit --seed takes what the config's audit.seed takes: up to 2**63 - 1 (the int64 of its record)."""
    from dpbench.cli.arguments import audit_seed
    from dpbench.pipeline.jobs import MAX_AUDIT_SEED

    assert audit_seed(str(2**63 - 1)) == MAX_AUDIT_SEED == 2**63 - 1
    with pytest.raises(argparse.ArgumentTypeError, match="from 0 to 2\\*\\*63 - 1"):
        audit_seed(str(2**63))


# -- outputs are regular files or refused ------------------------------------------------------

@pytest.fixture(params=["fifo", "char-device", "symlink-to-fifo"])
def special_file(request, tmp_path):
    """(path, what it is): a FIFO, a character device (made with os.mknod in the test's own
    directory, never under /dev: root only, else skipped) or a symlink to a FIFO."""
    path = tmp_path / "special"
    if request.param == "char-device":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 7))  # /dev/full's numbers
        except PermissionError:
            pytest.skip("making a character device (os.mknod) needs root")
        return path, "a character device", stat.S_ISCHR
    os.mkfifo(tmp_path / "fifo")
    if request.param == "fifo":
        return tmp_path / "fifo", "a FIFO", stat.S_ISFIFO
    path.symlink_to(tmp_path / "fifo")
    return path, "a symlink to a FIFO", stat.S_ISFIFO


@pytest.mark.parametrize("option", ["--out", "--checkpoint"])
def test_train_refuses_an_output_that_is_not_a_regular_file_before_any_work(tmp_path, capsys, special_file, option):
    path, kind, still = special_file
    argv = train_argv(tmp_path, option, path) if option == "--checkpoint" else \
        [*train_argv(tmp_path)[:-2], "--out", str(path)]
    code, err, seconds = timed_cli_error(argv, capsys)
    assert code == 2 and f"argument {option}: {path} is {kind}, not a regular file" in err and seconds < 1, err
    assert still(os.stat(path).st_mode)  # the node is still there, not replaced by a file


def test_train_refuses_a_default_checkpoint_path_that_is_not_a_regular_file(tmp_path, capsys):
    os.mkfifo(tmp_path / "run.parquet.ckpt")  # a FIFO would block the checkpoint's reader forever
    code, err, _ = timed_cli_error(train_argv(tmp_path), capsys)
    assert code == 2 and f"{tmp_path / 'run.parquet.ckpt'} is a FIFO, not a regular file" in err, err


def test_the_atomic_writer_never_renames_over_a_special_file(tmp_path, special_file):
    from dpbench.files import atomic_write
    from dpbench.matrix.store import noise_files
    from dpbench.reporting.results import write_table

    path, kind, still = special_file
    with pytest.raises(ValueError, match=f"output {re.escape(str(path))} is {kind}, not a regular file"):
        atomic_write(path, lambda f: f.write(b"x"))
    with pytest.raises(ValueError, match="not a regular file"):
        write_table(pd.DataFrame({"a": [1]}), path)
    with pytest.raises(ValueError, match="not a regular file"):
        noise_files.write_noise(path, np.eye(3), 2, 0)
    assert still(os.stat(path).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) in (["special"], ["fifo"], ["fifo", "special"])  # no temporary file


@pytest.mark.parametrize("argv", [["plot", "fig5_1", "--runs", "runs.parquet", "--out", "{special}.png"],
                                  ["factorize", "--key", "se-k4-b1", "--out", "{special}"],
                                  ["noise", "--factorization", "f.npz", "--dim", "2", "--seed", "0", "--out", "{special}"]])
def test_every_command_refuses_an_output_that_is_a_fifo(tmp_path, capsys, argv):
    os.mkfifo(tmp_path / "fifo.png")
    os.mkfifo(tmp_path / "fifo")
    argv = [a.replace("{special}", str(tmp_path / "fifo")) for a in argv]
    code, err = cli_error(argv, capsys)
    assert code == 2 and "is a FIFO, not a regular file" in err, err


# -- one line for what no run can do ------------------------------------------------------------

def test_train_subset_above_the_dataset_is_refused_naming_the_option(tmp_path, capsys):
    code, err, seconds = timed_cli_error(train_argv(tmp_path, "--train-subset", 70000), capsys)
    assert code == 2 and seconds < 1
    assert err == "dpbench train: error: argument --train-subset: 70000 is above the 60000 training examples " \
                  "of fashion-mnist\n"


def test_test_subset_above_the_test_set_is_refused_naming_the_option(tmp_path, capsys):
    code, err, seconds = timed_cli_error(train_argv(tmp_path, "--test-subset", 10001), capsys)
    assert code == 2 and seconds < 1
    assert err == "dpbench train: error: argument --test-subset: 10001 is above the 10000 test examples of " \
                  "fashion-mnist\n"


@pytest.mark.parametrize("problem,argv,held,drawn,dataset", [
    ("P4", [], 12979, 12979, "fortunes"),  # the 93 canaries would keep N positive
    ("P2", ["--train-subset", "500"], 600, 500, "fashion-mnist after --train-subset"),
])
def test_a_validation_split_holding_out_every_record_is_refused_naming_the_option(tmp_path, capsys, problem, argv,
                                                                                 held, drawn, dataset):
    argv = train_argv(tmp_path, *argv, "--validation-size", held)
    code, err, seconds = timed_cli_error([problem if a == "P2" else a for a in argv], capsys)
    assert code == 2 and seconds < 1
    assert err == f"dpbench train: error: argument --validation-size: {held} is not below the {drawn} training " \
                  f"examples of {problem} ({dataset}): none would be left to train on\n"


@pytest.mark.parametrize("figure,option,why", [
    ("fig5_1", ["-o", "select_by=val"], "option select_by: 'val' selects on the validation split"),
    ("lm_loss", [], "lm_loss selects each optimizer's configuration on the validation split"),
])
def test_plot_refuses_selecting_on_validation_without_a_validation_split(tmp_path, capsys, figure, option, why):
    """As the config check refuses it: else an empty figure (fig5_1) or a learning rate chosen on
    NaN (lm_loss), exit 0. Runs of another problem with a split do not count."""
    runs = pd.DataFrame({"problem": ["P1", "P4", "P2"], "n_val": [0, 0, 100]})
    table = tmp_path / "runs.parquet"
    runs.to_parquet(table)
    code, err = cli_error(["plot", figure, "--runs", str(table), "--out", str(tmp_path / "f"), *option,
                           "-o", f"problem{'s=P1' if figure == 'fig5_1' else '=P4'}"], capsys)
    assert code == 2 and err == (f"dpbench plot: error: {why}, and no run in {table} has one (train with "
                                 "--validation-size)\n")
    assert list(tmp_path.iterdir()) == [table]


def test_an_unknown_figure_option_is_one_line_before_the_runs_are_read(tmp_path, capsys):
    code, err = cli_error(["plot", "fig5_1", "--runs", str(tmp_path / "absent.parquet"), "--out",
                           str(tmp_path / "f"), "-o", "bogus=1"], capsys)
    assert code == 2 and err == ("dpbench plot: error: unknown option 'bogus' of figure fig5_1 "
                                 "(options: problems, optimizers, select_by, filters)\n")


def test_the_prv_accountant_refuses_absurd_step_counts_in_one_line():
    with pytest.raises(ValueError, match=r"^the PRV accountant cannot account 1000000000000 steps \(at most 1e\+08\); "
                                         r"use fewer epochs or --accountant rdp"):
        accounting.epsilon([(1.0, 0.01, 10**12)], 1e-5, "prv")

