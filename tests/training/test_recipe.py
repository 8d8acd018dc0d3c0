"""The field's recipe in a run: large logical batches in physical pieces (``physical_batch_size``)
over several epochs, and a learning-rate schedule (``lr_schedule``, dpbench.training.schedules).

* A run in pieces is the run in one piece: the same plan (q = L/N, T = round(E N / L) logical
  steps over E epochs), sigma, epsilon and privacy record, one metrics row per logical step, the
  same losses and test metrics (float rounding of the sums' order aside), and its record says
  how it ran (``timing.physical_batch_size``), never in its privacy section. Its command line
  carries the flag; one without it is a run's as before.
* ``linear`` gives step t the learning rate lr (1 - t/T) of the planned T, for every built-in
  rule (the Kalman filter's through its base rule), through a run killed and resumed;
  ``constant`` is the run as before (the golden runs, tests/repo/test_golden.py).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from conftest import run_cell
from dpbench.optimizers import get_optimizer
from dpbench.privacy import accounting
from dpbench.optimizers.base import SGD
from dpbench.optimizers.disk import KalmanFilter
from dpbench.training import schedules
from dpbench.training.config import RunConfig
from dpbench.training.settings import SettingError

BASE = dict(problem="P2", optimizer="dpsgd", lr=0.5, batch_size=32, epochs=2, seed=4, noise_multiplier=1.1,
            train_subset=128, test_subset=32, progress_every_s=1e9)


def test_a_run_in_pieces_is_the_run_in_one_piece_with_the_same_privacy(tiny_fmnist):
    whole = run_cell(RunConfig(**BASE))
    cut = run_cell(RunConfig(**BASE, physical_batch_size=8))
    p, q = whole.meta["privacy"], cut.meta["privacy"]
    assert p["planned_steps"] == q["planned_steps"] == round(2 * 128 / 32) == 8  # T logical steps, not pieces
    assert p["sample_rate"] == q["sample_rate"] == 32 / 128
    assert p["epsilon"] == q["epsilon"] == pytest.approx(accounting.epsilon([(1.1, 32 / 128, 8)]))
    assert {k: v for k, v in p.items() if k != "calibration_time_s"} == \
        {k: v for k, v in q.items() if k != "calibration_time_s"}
    train_w, train_c = (r.metrics[r.metrics.split == "train"] for r in (whole, cut))
    assert len(train_w) == len(train_c) == 8 and train_c.batch_size.max() > 8  # batches of several pieces
    pd.testing.assert_series_equal(train_w.batch_size, train_c.batch_size)  # the same Poisson batches
    assert train_w.loss.iloc[0] == pytest.approx(train_c.loss.iloc[0], rel=1e-6)  # before any update
    for split in ("train", "test"):  # float32: the clipped sums' order only
        a, b = (r.metrics[r.metrics.split == split] for r in (whole, cut))
        assert a.loss.to_numpy() == pytest.approx(b.loss.to_numpy(), rel=1e-4)
    assert (whole.metrics.split == "test").sum() == 2  # an evaluation per epoch
    assert cut.meta["timing"]["physical_batch_size"] == 8 and "physical_batch_size" not in whole.meta["timing"]
    assert cut.meta["config"]["physical_batch_size"] == 8
    assert "physical_batch_size" not in str(q)


def test_the_settings_command_lines_and_refusals():
    assert "--physical-batch-size" not in RunConfig(**BASE).to_args()  # every existing command line unchanged
    assert "--lr-schedule" not in RunConfig(**BASE).to_args()
    args = RunConfig(**BASE, physical_batch_size=64, lr_schedule="linear").to_args()
    assert args[args.index("--physical-batch-size") + 1] == "64" and args[args.index("--lr-schedule") + 1] == "linear"
    for bad in (dict(physical_batch_size=0), dict(lr_schedule="cosine"),
                dict(physical_batch_size=32, cuda_graphs=True), dict(lr_schedule="linear", cuda_graphs=True)):
        with pytest.raises(SettingError, match=next(iter(bad))):
            RunConfig(**BASE, **bad).validate(get_optimizer("dpsgd"))


def test_linear_schedule_factors():
    T = 8
    assert [schedules.factor("linear", t, T) for t in range(T)] == [1 - t / T for t in range(T)]
    assert all(schedules.factor("constant", t, T) == 1.0 for t in range(T))
    with pytest.raises(ValueError, match="outside the 8 planned steps"):
        schedules.factor("linear", 8, T)
    with pytest.raises(ValueError, match="'cosine' is not one of constant, linear"):
        schedules.factor("cosine", 0, T)


def test_a_schedule_sets_every_built_in_rules_learning_rate():
    """Every built-in update rule takes its learning rate from ``lr`` (the Kalman filter's from its
    base rule's), so the schedule reaches the update of every optimizer alike."""
    from dpbench.optimizers.adam import Adam

    theta = torch.zeros(3)
    for rule in (SGD(0.5), Adam(0.5), KalmanFilter(SGD(0.5), 0.7)):
        schedules.check_rule(rule, "x")
        schedules.apply(rule, 0.5, "linear", 2, 4)
        assert rule.lr == 0.25
    kalman = KalmanFilter(SGD(0.5), 1.0)
    schedules.apply(kalman, 0.5, "linear", 3, 4)
    p = [theta.clone()]
    kalman.update(p, [torch.ones(3)])
    assert torch.equal(p[0], torch.full((3,), -0.125))  # theta - (lr / 4) g: the base rule moved at the scheduled lr

    class NoLr:
        def update(self, params, grads):
            pass

    with pytest.raises(ValueError, match="optimizer 'plug': its update rule NoLr has no learning rate"):
        schedules.check_rule(NoLr(), "plug")


def test_a_linear_schedule_in_a_run_killed_and_resumed(tiny_fmnist, tmp_path, monkeypatch):
    """Each step's learning rate is lr (1 - t/T) over the planned T, through a checkpoint: the
    resumed run ends as the uninterrupted one."""
    from dpbench.training import train

    seen, update = [], SGD.update

    def recording(self, params, grads):
        seen.append(self.lr)
        return update(self, params, grads)

    monkeypatch.setattr(SGD, "update", recording)
    cfg = RunConfig(**{**BASE, "lr_schedule": "linear", "physical_batch_size": 8})
    reference = run_cell(cfg)
    T = reference.meta["privacy"]["planned_steps"]
    assert T == 8 and seen == [0.5 * (1 - t / T) for t in range(T)]
    assert reference.meta["config"]["lr_schedule"] == "linear"
    ckpt = tmp_path / "run.ckpt"
    real_record, calls = train.Trace.record, [0]

    def dying(self, *a, **kw):
        calls[0] += 1
        if calls[0] == 6:  # mid-epoch 2, after the checkpoint at the end of epoch 1
            raise KeyboardInterrupt
        return real_record(self, *a, **kw)

    monkeypatch.setattr(train.Trace, "record", dying)
    with pytest.raises(KeyboardInterrupt):
        run_cell(cfg, checkpoint=ckpt, checkpoint_every_s=1e9)
    monkeypatch.setattr(train.Trace, "record", real_record)
    seen.clear()
    resumed = run_cell(cfg, checkpoint=ckpt, checkpoint_every_s=1e9)
    assert resumed.meta["timing"]["resumes"] == 1 and seen == [0.5 * (1 - t / T) for t in range(4, T)]
    pd.testing.assert_frame_equal(resumed.metrics, reference.metrics)
