"""The training harness and the `dpbench train` CLI."""

import math

import numpy as np
import pandas as pd
import pytest

from conftest import run_cell, run_cli
from dpbench.privacy import accounting
from dpbench.reporting.results import read_run
from dpbench.optimizers import get_optimizer
from dpbench.seeds import stream_seeds
from dpbench.training.train import RunConfig


def test_seed_streams_are_distinct_and_stable():
    a, b = stream_seeds(1), stream_seeds(2)
    assert a == stream_seeds(1)
    assert len(set(a.values())) == len(a) and not set(a.values()) & set(b.values())
    # pinned: the noise files of the matrix mechanisms are named by these seeds, and every
    # stored result was drawn from them
    # (a stream added later, P4's "canary", goes last and leaves the earlier ones as they were)
    assert {k: a[k] for k in list(a)[:6]} == {
        "init": 4215923173971654960, "sampler": 2021340933837429789, "noise": 637987770806161565,
        "loss": 5220146013781160048, "subset": 5862124722997179473, "eval": 2946236235448961746}
    assert list(a) == ["init", "sampler", "noise", "loss", "subset", "eval", "canary"]


def test_run_records_what_was_promised_and_delivered(tiny_fmnist):
    cfg = RunConfig(problem="P2", optimizer="dpsgd", lr=0.5, batch_size=60, epochs=2, seed=3, epsilon=2.0,
                    progress_every_s=1e9)
    res = run_cell(cfg)
    m, meta = res.metrics, res.meta
    p = meta["privacy"]
    assert p["planned_steps"] == p["steps"] == round(2 * 600 / 60) == 20
    assert p["sample_rate"] == pytest.approx(60 / 600)
    assert p["noise_multiplier"] == pytest.approx(accounting.noise_multiplier_for(2.0, 0.1, 20))
    assert p["epsilon"] <= 2.0 and p["epsilon"] == pytest.approx(accounting.epsilon([(p["noise_multiplier"], 0.1, 20)]))
    assert p["epsilon_rdp"] >= p["epsilon"] and p["noise_multiplier_source"] == "calibrated"
    assert p["noise_std_mean_gradient"] == pytest.approx(p["noise_multiplier"] / 60)
    train, test = m[m.split == "train"], m[m.split == "test"]
    assert list(train.step) == list(range(1, 21)) and list(test.epoch) == [1, 2] and list(test.step) == [10, 20]
    assert train.batch_size.sum() == pytest.approx(20 * 60, rel=0.2)
    assert meta["result"]["status"] == "completed"
    assert meta["result"]["best_test_accuracy"] == test.accuracy.max()
    assert meta["problem"]["parameters"] == 225_034
    assert meta["config"]["lr"] == 0.5 and meta["optimizer"]["name"] == "dpsgd"


def test_max_steps_reports_epsilon_for_steps_taken(tiny_fmnist):
    res = run_cell(RunConfig(problem="P2", optimizer="dpsgd", lr=0.1, batch_size=60, epochs=3, seed=0, epsilon=1.0,
                        max_steps=7, progress_every_s=1e9))
    p = res.meta["privacy"]
    assert p["steps"] == 7 and p["planned_steps"] == 30
    assert p["epsilon"] < p["epsilon_planned"] <= 1.0


def test_same_seed_same_metrics_and_different_seed_differs(tiny_fmnist, device):
    cfg = dict(problem="P2", optimizer="dpsgd", lr=0.5, batch_size=50, epochs=1, epsilon=5.0, device=str(device),
               progress_every_s=1e9)
    a, b, c = run_cell(RunConfig(seed=1, **cfg)), run_cell(RunConfig(seed=1, **cfg)), run_cell(RunConfig(seed=2, **cfg))
    pd.testing.assert_frame_equal(a.metrics, b.metrics)
    assert not a.metrics.loss.equals(c.metrics.loss)


def test_divergence_is_recorded_not_raised(tiny_fmnist):
    res = run_cell(RunConfig(problem="P2", optimizer="sgd", lr=1e30, batch_size=60, epochs=2, seed=0,
                        progress_every_s=1e9))
    assert res.meta["result"]["status"] == "diverged"
    test = res.metrics[res.metrics.split == "test"]
    assert test.loss.iloc[-1] == math.inf and len(test) == 1  # stops at the first epoch end


def test_noise_multiplier_given_is_recorded(tiny_fmnist):
    res = run_cell(RunConfig(problem="P2", optimizer="dpsgd", lr=0.1, batch_size=60, epochs=1, seed=0,
                        noise_multiplier=1.3, progress_every_s=1e9))
    p = res.meta["privacy"]
    assert p["noise_multiplier"] == 1.3 and p["noise_multiplier_source"] == "given"
    assert p["target_epsilon"] is None and p["epsilon"] == pytest.approx(accounting.epsilon([(1.3, 0.1, 10)]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(optimizer="dpsgd"), "give --epsilon or --noise-multiplier"),
    (dict(optimizer="nope", epsilon=1.0), "unknown optimizer 'nope'"),
    (dict(optimizer="dpsgd", epsilon=1.0, hyperparameters={"kappa": 1}), "no hyperparameter 'kappa'"),
    (dict(optimizer="dpsgd", epsilon=-1.0), "^epsilon: expected a finite positive number, got -1.0$"),
    (dict(optimizer="dpsgd", problem="P10", epsilon=1.0), "unknown problem 'P10'"),
    (dict(optimizer="dpsgd", epsilon=1.0, noise_multiplier=0.3), "--epsilon .* or --noise-multiplier .*not both"),
])
def test_bad_settings_are_named(kwargs, match):
    cfg = RunConfig(**{"problem": "P2", "lr": 0.1, "batch_size": 10, "epochs": 1, "seed": 0, **kwargs})
    with pytest.raises((ValueError, KeyError), match=match):
        cfg.validate(get_optimizer(cfg.optimizer))


def test_a_run_refuses_the_spec_of_another_optimizer():
    cfg = RunConfig(problem="P2", optimizer="dpsgd", lr=0.1, batch_size=10, epochs=1, seed=0, epsilon=1.0)
    with pytest.raises(ValueError, match="'dpsgd' was given the spec of 'dpadam'"):
        cfg.validate(get_optimizer("dpadam"))


@pytest.mark.slow
def test_cli_writes_a_valid_parquet_file_from_real_data(tmp_path, fmnist_dir):
    out = tmp_path / "run.parquet"
    args = ["train", "--problem", "P2", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "100", "--epsilon", "1",
            "--epochs", "1", "--seed", "7", "--max-steps", "6", "--train-subset", "1000", "--test-subset", "300",
            "--data-dir", fmnist_dir, "--threads", "1", "--accountant", "rdp"]
    proc = run_cli(*args, "--out", out)
    assert "step 6/6" in proc.stderr  # progress lines
    df, meta = read_run(out)
    assert set(df.split) == {"train", "test"} and (df.split == "train").sum() == 6
    assert df.dtypes["loss"] == np.float64 and df.dtypes["step"] == np.int64
    assert meta["data"] == {"source": str(fmnist_dir), "n_train": 1000, "n_test": 300, "n_val": 0}
    p = meta["privacy"]
    assert p["sample_rate"] == pytest.approx(100 / 1000) and p["planned_steps"] == round(1000 / 100)
    assert p["epsilon"] <= p["epsilon_planned"] <= 1.0 and p["delta"] == 1e-5 and p["accountant"] == "rdp"
    assert meta["environment"]["packages"]["torch"].startswith("2.13.0")
    assert meta["timing"]["steps_per_second"] > 0
    # determinism across processes: the same command gives identical metrics
    run_cli(*args, "--out", tmp_path / "again.parquet")
    pd.testing.assert_frame_equal(df, read_run(tmp_path / "again.parquet")[0])


def test_cli_reports_errors_in_one_line(tmp_path):
    proc = run_cli("train", "--problem", "P2", "--optimizer", "dpsgd", "--lr", "0.1", "--batch-size", "8",
                   "--epochs", "1", "--seed", "0", "--out", tmp_path / "x.parquet", check=False)
    assert proc.returncode == 2 and "give --epsilon or --noise-multiplier" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("data", "--dataset", "cifar10", "--data-dir", tmp_path, "--no-download", check=False)
    assert proc.returncode == 2 and "cifar-10-python.tar.gz" in proc.stderr and str(tmp_path) in proc.stderr


def test_cli_refuses_a_target_epsilon_with_a_given_noise_multiplier(tmp_path):
    # sigma = 0.3 would be used as is (epsilon about 25 on P2), and the run file would carry
    # target 1 as if it had met it
    out = tmp_path / "x.parquet"
    proc = run_cli("train", "--problem", "P2", "--optimizer", "dpsgd", "--lr", "0.1", "--batch-size", "8",
                   "--epochs", "1", "--seed", "0", "--epsilon", "1", "--noise-multiplier", "0.3", "--out", out,
                   check=False)
    errors = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr
    assert "--epsilon" in errors[0] and "--noise-multiplier" in errors[0] and "not both" in errors[0]
    assert not out.exists()


class Interrupt(Exception):
    pass


class FlakySampler:
    """Wraps a run's sampler and raises on chosen calls (counted across runs): a killed job."""

    calls = 0
    fail_at: tuple = ()

    def __init__(self, inner):
        self.inner = inner

    def sample(self):
        FlakySampler.calls += 1
        if FlakySampler.calls in FlakySampler.fail_at:
            raise Interrupt
        return self.inner.sample()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


@pytest.mark.parametrize("optimizer", ["dpsgd", "dpadambc", "dpdisk", "sgd", "dpmatrix-me"])
def test_killed_run_resumes_to_identical_metrics(tiny_fmnist, tmp_path, monkeypatch, optimizer, device):
    """Interrupt mid-epoch 1 and mid-epoch 2 (after mid-epoch checkpoints); the resumed run
    ends with exactly the metrics of an uninterrupted one: model, optimizer state, noise
    stream (i.i.d. or correlated), sampler and metrics all continue where they stopped. On a
    GPU this needs deterministic kernels (dpbench.training.cuda)."""
    from dpbench.optimizers import get_optimizer

    eps = None if optimizer == "sgd" else 3.0
    cfg = RunConfig(problem="P2", optimizer=optimizer, lr=1e-3 if "adam" in optimizer else 0.05, batch_size=60,
                    epochs=3, seed=4, epsilon=eps, validation_size=60, progress_every_s=1e9,
                    cache_dir=str(tmp_path / "cache"), device=str(device))
    reference = run_cell(cfg)
    mechanism = get_optimizer(optimizer).mechanism
    original = type(mechanism).sampler
    monkeypatch.setattr(type(mechanism), "sampler", lambda self, *a, **k: FlakySampler(original(self, *a, **k)))
    monkeypatch.setattr(FlakySampler, "calls", 0)
    monkeypatch.setattr(FlakySampler, "fail_at", (7, 16))  # step 7 (epoch 1 of 9 steps), step 16 (epoch 2)
    ckpt = tmp_path / "run.ckpt"
    for _ in range(2):
        with pytest.raises(Interrupt):
            run_cell(cfg, checkpoint=ckpt, checkpoint_every_s=0.0)
        assert ckpt.exists()
    resumed = run_cell(cfg, checkpoint=ckpt, checkpoint_every_s=0.0)
    pd.testing.assert_frame_equal(resumed.metrics, reference.metrics)
    assert resumed.meta["timing"]["resumes"] == 2
    for key in ("privacy", "result", "test_outcomes"):  # (the outcomes of epochs before a resume: checkpointed)
        assert {k: v for k, v in resumed.meta[key].items() if k != "calibration_time_s"} == \
               {k: v for k, v in reference.meta[key].items() if k != "calibration_time_s"}


def test_checkpoint_of_another_configuration_is_ignored(tiny_fmnist, tmp_path, capsys):
    ckpt = tmp_path / "run.ckpt"
    base = dict(problem="P2", optimizer="dpsgd", batch_size=60, epochs=2, seed=1, epsilon=2.0, progress_every_s=1e9)
    from dpbench.training.checkpoint import Checkpoint

    Checkpoint(ckpt, RunConfig(lr=0.1, **base)).save({"step": 99})
    fresh = run_cell(RunConfig(lr=0.2, **base), checkpoint=ckpt)
    assert "another configuration" in capsys.readouterr().err
    assert fresh.meta["timing"]["resumes"] == 0
    # the same configuration trained by other code (another code key) is stale too
    cfg = RunConfig(lr=0.2, **base)
    Checkpoint(ckpt, cfg, code_key="old").save({"step": 99})
    assert Checkpoint(ckpt, cfg, code_key="new").load() is None
    assert Checkpoint(ckpt, cfg, code_key="old").load()["step"] == 99


def test_validation_split_is_held_out_and_selects_without_test(tiny_fmnist):
    res = run_cell(RunConfig(problem="P2", optimizer="sgd", lr=0.05, batch_size=50, epochs=3, seed=2, validation_size=100,
                        progress_every_s=1e9))
    m, r = res.metrics, res.meta["result"]
    assert res.meta["data"]["n_train"] == 500 and res.meta["data"]["n_val"] == 100
    assert res.meta["privacy"]["planned_steps"] == round(3 * 500 / 50)
    val, test = m[m.split == "val"].set_index("epoch"), m[m.split == "test"].set_index("epoch")
    assert list(val.index) == [1, 2, 3] and (val.batch_size == 100).all()
    best_epoch = val.accuracy.idxmax()
    assert r["best_val_accuracy"] == val.accuracy.max()
    assert r["test_accuracy_at_best_val"] == test.loc[best_epoch, "accuracy"]
    assert r["test_loss_at_best_val"] == test.loc[best_epoch, "loss"]
    # each test record's correctness at that epoch, packed: as many records as the test split, and
    # their mean the test accuracy recorded for the epoch
    from dpbench.reporting.results import unpack_outcomes

    outcomes = res.meta["test_outcomes"]
    n_test = res.meta["data"]["n_test"]
    assert outcomes["n_test"] == n_test and outcomes["epoch"] == best_epoch
    correct = unpack_outcomes(outcomes["correct_at_best_val"], n_test)
    assert correct.dtype == np.uint8 and set(correct.tolist()) <= {0, 1}
    assert correct.mean() == pytest.approx(r["test_accuracy_at_best_val"], abs=1e-12)
    assert len(outcomes["correct_at_best_val"]) == 4 * math.ceil(math.ceil(n_test / 8) / 3)  # base64 of n/8 bytes


def test_the_privacy_section_is_written_whole_and_refuses_a_key_given_twice():
    """The run file's privacy section is one typed value: the claim's record (its facts with
    it), the private step's keys, the step's facts and a search's record, each key once; the
    mechanism's caveat replaces the optimizer's; a key two parts give is refused, not merged."""
    import dataclasses

    from dpbench.mechanisms.base import PlanRequest, PrivacyClaim
    from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian
    from dpbench.training.calibration import PrivacySection

    mech = PoissonSubsampledGaussian()
    record = PrivacyClaim(mech, mech.plan(PlanRequest(1000, 100, 1)), 1.0, 1e-5, "prv", 2.0).record(4)
    section = PrivacySection(record, "built-in", clip_norm=1.0, normalize_clipping=False, sensitivity=1.0,
                             noise_std_mean_gradient=0.01, caveat="the optimizer's", stages={}, step_class="x.Y",
                             step={"noise_file": None}, tuning={"epsilon": 3.0})
    out = section.run_file()
    assert out["noise_schedule"] == "constant" and out["noise_file"] is None and out["tuning"] == {"epsilon": 3.0}
    assert (out["epsilon"], out["steps"], out["caveat"], out["clip_norm"]) == (record.epsilon_spent, 4,
                                                                                "the optimizer's", 1.0)
    assert "tuning" not in dataclasses.replace(section, tuning=None).run_file()
    mechanisms = dataclasses.replace(section, claim=dataclasses.replace(record, caveat="the mechanism's"))
    assert mechanisms.run_file()["caveat"] == "the mechanism's"
    for step in ({"clip_norm": 2.0}, {"epsilon": 0.0}, {"noise_schedule": "x"}):
        with pytest.raises(ValueError, match=f"the privacy section's key {next(iter(step))!r} is given twice"):
            dataclasses.replace(section, step=step).run_file()


class _RunsCode:
    """Pickled as a call of os.system: what a crafted checkpoint would run when unpickled."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


def test_a_checkpoint_whose_pickle_would_run_code_runs_nothing(tmp_path, capsys):
    """A crafted checkpoint with a valid header (its SHA-256 is no key) whose pickle calls
    os.system when loaded: refused as damaged in one line, moved aside, and nothing ran."""
    import hashlib
    import io

    import torch

    from dpbench.training.checkpoint import Checkpoint

    cfg = RunConfig(problem="P2", optimizer="dpsgd", lr=0.1, batch_size=60, epochs=2, seed=1, epsilon=2.0)
    ckpt, marker = tmp_path / "run.ckpt", tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save({"step": 1, "payload": _RunsCode(f"touch {marker}")}, buffer)
    payload = buffer.getvalue()
    ckpt.write_bytes(Checkpoint.MAGIC + hashlib.sha256(payload).digest() + payload)
    capsys.readouterr()
    assert Checkpoint(ckpt, cfg).load() is None
    err = capsys.readouterr().err
    assert not marker.exists()
    assert len(err.strip().splitlines()) == 1 and f"checkpoint {ckpt} is damaged" in err, err
    assert "could run code" in err and not ckpt.exists()


BUILTINS = ["sgd", "dpsgd", "opacus-dpsgd", "adam", "adamw", "dpadam", "dpadambc", "dpadamw", "dpadamw-bc", "dpdice",
            "dpdice-strict", "dpdisk", "d2p2sgd", "d2psgd", "dp2sgd", "dpmatrix-se", "dpmatrix-se-lambda",
            "dpmatrix-me", "dpmatrix-me-lambda", "dpmatrix-band", "dpmatrix-band-amp", "dpmatrix-blt"]


def test_the_builtins_list_above_is_the_registrys():
    from dpbench.optimizers import OPTIMIZERS

    assert BUILTINS == list(OPTIMIZERS.builtins)


@pytest.mark.parametrize("optimizer", BUILTINS)
def test_every_optimizers_checkpoint_is_tensors_and_plain_data(tiny_fmnist, tmp_path, optimizer):
    """What each built-in optimizer's run checkpoints (model, optimizer and noise state, sampler,
    RNGs, trace) loads with weights_only=True, as Checkpoint.load reads it (a state holding
    anything else would be moved aside as damaged, and the run never resume)."""
    from dpbench.optimizers import get_optimizer
    from dpbench.training.checkpoint import Checkpoint

    private = get_optimizer(optimizer).private
    epochs = 1 if optimizer.startswith("dpmatrix-se") else 2  # the single-epoch mechanisms
    cfg = RunConfig(problem="P2", optimizer=optimizer, lr=0.05, batch_size=60, epochs=epochs, seed=3,
                    epsilon=8.0 if private else None, train_subset=120, test_subset=50, progress_every_s=1e9,
                    cache_dir=str(tmp_path / "cache"))
    ckpt = tmp_path / "run.ckpt"
    run_cell(cfg, checkpoint=ckpt, checkpoint_every_s=0.0)  # leaves its last checkpoint (the CLI deletes it)
    state = Checkpoint(ckpt, cfg).load()
    assert state is not None and ckpt.exists() and state["progress"]["step"] >= 1
    assert set(state) >= {"model", "step_fn", "sampler", "loss_gen", "train_loss"}
