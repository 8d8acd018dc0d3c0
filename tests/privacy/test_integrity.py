"""A run is never labelled private unless it was: damaged noise and factorization files are
refused, layers that mix samples are refused, and what is not private is marked so."""

from __future__ import annotations

import errno
import json
import math
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from conftest import run_cell
from dpbench.problems import facts as problems_facts
from dpbench.privacy import per_sample
from dpbench.privacy.clipping import Clipping
from dpbench.matrix import dense_factorization
from dpbench.matrix.store import dense_files, noise_files
from dpbench.matrix.store.noise_files import NoiseFile, NoiseFileError
from dpbench.privacy.per_sample import SampleMixingError, Tape
from dpbench.problems import PROBLEMS, catalog

# -- noise files: checksums written while writing, verified before training, rows checked ------


@pytest.fixture(scope="module")
def fact():
    return dense_factorization.factorize("me-k3-b4")  # T = 12


def written(tmp_path, fact, dim=20_000, seed=5, **kw):
    path = tmp_path / "noise.npy"
    noise_files.write_noise(path, fact.noising, dim, seed, meta={"factorization_digest": fact.digest}, **kw)
    return path


def zero_rows(path, rows):
    """Overwrite whole rows of the payload with zeros (the header is left alone)."""
    f = NoiseFile(path)
    with open(path, "r+b") as out:
        for t in rows:
            out.seek(f.offset + t * f.dim * 4)
            out.write(bytes(f.dim * 4))


def test_row_checksums_are_those_of_the_rows_whatever_the_chunking(tmp_path, fact):
    a = written(tmp_path, fact, dim=5000, chunk_blocks=1)  # five column chunks per row
    meta = noise_files.read_meta(a)
    rows = np.load(a)
    assert meta["format_version"] == 2
    assert meta["row_crc32"] == "".join(f"{zlib.crc32(r.tobytes()):08x}" for r in rows)
    b = tmp_path / "b.npy"
    noise_files.write_noise(b, fact.noising, 5000, 5, chunk_blocks=4)  # one chunk
    assert noise_files.read_meta(b)["row_crc32"] == meta["row_crc32"]
    NoiseFile(a, noise_files.row_variances(fact.noising)).verify(meta)  # a sound file passes


@pytest.mark.parametrize("rows", [range(12), [6, 7, 8, 9, 10, 11]], ids=["zero-filled", "six-rows-zeroed"])
def test_damaged_payload_is_refused_naming_the_file_and_the_fix(tmp_path, fact, rows):
    path = written(tmp_path, fact)
    zero_rows(path, rows)
    with pytest.raises(NoiseFileError, match=rf"{path}: row {rows[0]} does not match the checksum.*delete {path}"):
        NoiseFile(path).verify(noise_files.read_meta(path))


def test_rows_are_checked_against_the_factorization_even_with_a_matching_sidecar(tmp_path, fact):
    """A sidecar rewritten for damaged content (or a writer bug) still cannot pass: each row's
    norm must be in the chi-square range of a row of C^-1 Z."""
    path = written(tmp_path, fact)
    meta = noise_files.read_meta(path)
    zero_rows(path, [3])
    with open(path, "r+b") as f:  # halve row 8 instead of zeroing it
        reader = NoiseFile(path)
        row = reader.row(8) * 0.5
        f.seek(reader.offset + 8 * reader.dim * 4)
        f.write(row.tobytes())
    meta["row_crc32"] = "".join(f"{zlib.crc32(r.tobytes()):08x}" for r in np.load(path))
    checked = NoiseFile(path, noise_files.row_variances(fact.noising))
    with pytest.raises(NoiseFileError, match=r"row 3 has squared norm 0, outside .*delete"):
        checked.verify(meta)
    with pytest.raises(NoiseFileError, match=r"row 8 has squared norm"):
        checked.row(8)  # the check at each read
    assert checked.row(7).shape == (20_000,)  # sound rows pass


def test_chi_square_band_has_negligible_false_alarms_and_catches_damage():
    d = problems_facts("P2").parameters
    lo, hi = noise_files.chi_square_band(d)
    assert (lo / d, hi / d) == pytest.approx((0.970, 1.030), abs=1e-3)
    # the Laurent-Massart bounds hold: each tail is below e^-50 (scipy's exact chi-square tails)
    for dim in (1000, 5000, d, problems_facts("P3").parameters):
        lo, hi = noise_files.chi_square_band(dim)
        assert stats.chi2.logsf(hi, dim) <= -noise_files.ROW_CHECK_X
        assert lo == 0 or stats.chi2.logcdf(lo, dim) <= -noise_files.ROW_CHECK_X
    assert 2 * 100_000 * math.exp(-noise_files.ROW_CHECK_X) < 1e-16  # a whole run of 1e5 rows


def test_old_sidecars_without_checksums_are_refused(tmp_path, fact):
    path = written(tmp_path, fact, dim=3000)
    meta = noise_files.read_meta(path)
    del meta["row_crc32"]
    with pytest.raises(NoiseFileError, match="no row checksums.*delete"):
        NoiseFile(path).verify(meta)


def test_damaged_header_is_refused_naming_the_file(tmp_path, fact):
    path = written(tmp_path, fact, dim=3000)
    with open(path, "r+b") as f:
        f.write(bytes(64))
    with pytest.raises(NoiseFileError, match=rf"noise file {path} has no valid .npy header.*delete"):
        NoiseFile(path)


def test_full_disk_while_writing_names_the_file_and_leaves_nothing(tmp_path, fact, monkeypatch):
    calls = {"n": 0}
    real = os.pwrite

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError, match=r"no space left on device while writing the noise file .*noise\.npy"):
        written(tmp_path, fact, dim=3000)
    assert list(tmp_path.iterdir()) == []


def test_a_zero_filled_noise_file_stops_the_run(tiny_fmnist, tmp_path):
    """Before: the run trained normally and reported sigma and epsilon while adding no noise."""
    from dpbench.training.train import RunConfig

    cfg = dict(problem="P2", optimizer="dpmatrix-se", lr=0.1, batch_size=100, epochs=1, seed=1,
               epsilon=1.0, cache_dir=str(tmp_path), progress_every_s=1e9, test_subset=20)
    run_cell(RunConfig(**cfg, max_steps=1))  # makes the files
    (path,) = tmp_path.rglob("noise-*.npy")
    zero_rows(path, range(6))
    with pytest.raises(NoiseFileError, match=rf"noise file {path}: row 0 does not match.*delete {path}"):
        run_cell(RunConfig(**cfg))


# -- factorizations: verified on load, sensitivity recomputed ----------------------------------


def saved(tmp_path, fact):
    path = tmp_path / "f.npz"
    dense_files.save(fact, path)
    return path


def rewrite(path, **arrays):
    with np.load(path) as z:
        content = {k: z[k] for k in z.files}
    content.update(arrays)
    np.savez(path, **content)


def test_loaded_sensitivity_is_recomputed_from_c(tmp_path, fact):
    back = dense_files.load(saved(tmp_path, fact))
    assert back.sensitivity == pytest.approx(fact.sensitivity, rel=1e-12)
    with np.load(tmp_path / "f.npz") as z:
        report = json.loads(str(z["report"]))
    report["sensitivity"] = 0.5  # a report claiming half the true sensitivity would halve sigma
    rewrite(tmp_path / "f.npz", report=np.array(json.dumps(report)))
    with pytest.raises(dense_files.FactorizationError,
                       match=r"f\.npz is refused: its recorded sensitivity 0\.5 is not the sensitivity of C.*delete"):
        dense_files.load(tmp_path / "f.npz")


@pytest.mark.parametrize("damage,match", [
    (lambda f: {"decoder": f.decoder * (1 + 1e-6)}, r"B C differs from the prefix-sum workload A by"),
    (lambda f: {"noising": f.noising + np.tril(np.full_like(f.noising, 1e-7))}, r"C\^-1 C differs from I"),
    (lambda f: {"strategy": f.strategy * 0.5}, r"C does not match the digest"),
    (lambda f: {"strategy": f.strategy + np.triu(np.ones_like(f.strategy), 1)}, r"not lower triangular"),
])
def test_inconsistent_matrices_are_refused(tmp_path, fact, damage, match):
    path = saved(tmp_path, fact)
    rewrite(path, **damage(fact))
    with pytest.raises(dense_files.FactorizationError, match=match):
        dense_files.load(path)


@pytest.mark.parametrize("how", ["truncated", "zeroed"])
def test_unreadable_factorization_names_the_file(tmp_path, fact, how):
    path = saved(tmp_path, fact)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if how == "truncated" else bytes(len(raw)))
    with pytest.raises(dense_files.FactorizationError, match=rf"factorization file {path} is unreadable.*delete"):
        dense_files.load(path)


# -- layers that mix samples are refused ---------------------------------------------------------


def mixing_model(norm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), norm, nn.ReLU(), nn.Linear(8, 3))


def clipped_sum(model, x, y):
    """The normalised-clipped sum (C = 0.01: every example clipped) as training forms it."""
    tape = Tape(model)
    with tape:
        losses = F.cross_entropy(model(x), y, reduction="none")
    psg = tape.per_sample_gradients(losses)
    summed = psg.weighted_sum(Clipping(0.01).coefficients(psg.norms()))
    return torch.cat([summed[p].reshape(-1) for p in model.parameters()])


def test_batch_norm_without_parameters_breaks_the_sensitivity_and_is_refused(monkeypatch):
    model = mixing_model(nn.BatchNorm1d(8, affine=False, track_running_stats=False))
    with pytest.raises(SampleMixingError, match=r"layer '1' \(BatchNorm1d\) may mix samples"):
        Tape(model)
    # why: with the check off, removing one example moves the clipped sum by far more than its
    # sensitivity 1, because the example shifts the batch statistics of every other example
    monkeypatch.setattr(per_sample, "check_per_sample", lambda m: None)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    x[0] *= 30  # the changed example: far from the others
    moved = (clipped_sum(model, x, y) - clipped_sum(model, x[1:], y[1:])).norm().item()
    assert moved > 5  # 5.55 (normalised clipping: at most 1 for a per-sample model)
    # the same model with a per-sample normalisation in its place moves by at most 1
    model = mixing_model(nn.LayerNorm(8, elementwise_affine=False))
    assert (clipped_sum(model, x, y) - clipped_sum(model, x[1:], y[1:])).norm().item() <= 1 + 1e-5


class Centre(nn.Module):
    def forward(self, x):
        return x - x.mean(0)  # mixes samples, and has no parameters


class Declared(nn.Module):
    per_sample_forward = True

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.1))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


@pytest.mark.parametrize("layer,match", [
    (nn.BatchNorm1d(8, affine=False), r"BatchNorm1d\) may mix samples.*buffers \(running_mean, running_var"),
    (nn.InstanceNorm1d(8, track_running_stats=True), r"InstanceNorm1d\) .*buffers"),
    (nn.Softmax(dim=0), r"axis dim = 0"),
    (nn.Softmax(), r"axis dim = None"),
    (nn.Flatten(0), r"axis start_dim = 0"),
    (Centre(), r"Centre\) may mix samples.*per_sample_forward = True"),
])
def test_layers_that_may_mix_samples_are_refused_by_name(layer, match):
    with pytest.raises(SampleMixingError, match=match):
        Tape(nn.Sequential(nn.Linear(6, 8), layer, nn.Linear(8, 3)))


def test_per_sample_layers_and_declared_models_pass():
    for layer in (nn.ReLU(), nn.Softmax(dim=1), nn.LogSoftmax(-1), nn.Dropout(), nn.Identity(), nn.Tanh(),
                  nn.LayerNorm(8, elementwise_affine=False), nn.GroupNorm(2, 8, affine=False)):
        Tape(nn.Sequential(nn.Linear(6, 8), layer, nn.Linear(8, 3)))
    assert len(Tape(Declared()).layers) == 2
    for problem in PROBLEMS.values():
        Tape(problem.build())


# -- DP-Dice: the released sum's movement against the sensitivity its noise assumes ------------


def dice_movements(name, c2=1.0, L=64, steps=12):
    """||release(D) - release(D')|| per step, D' = D without one outlying example that takes
    part in step 1 only; both evaluated along D's parameter trajectory (the same released
    history), noise off. Returns the movements and the noise std per unit sigma."""
    from dpbench.mechanisms.noise import GaussianNoise
    from dpbench.optimizers import get_optimizer
    from dpbench.optimizers.base import Context

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(L, 10, generator=g), torch.randint(0, 3, (L,), generator=g)
    x[0] = 1000 * torch.randn(10, generator=g)  # the changed example: a huge raw gradient
    spec = get_optimizer(name)
    steps_, models, seen = [], [], []
    for run in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))
        y[0] = model(x[:1]).argmin()  # a wrong label: the loss, and the gradient, do not saturate at 0
        ctx = Context(model=model, loss_fn=lambda m, xb, yb: (F.cross_entropy(m(xb), yb, reduction="none"), None),
                      lr=0.5, expected_batch_size=L, noise_multiplier=0.0, clipping=Clipping(1.0),
                      noise=GaussianNoise(0), steps=steps, hyperparameters=spec.hyperparameters({"c2": c2}))
        step = spec.build(ctx)
        releases = []
        update = step.rule.update
        step.rule.update = lambda p, gr, r=releases, u=update: (r.append(torch.cat([t.reshape(-1) for t in gr]) * L),
                                                               u(p, gr))[1]
        steps_.append(step), models.append(model), seen.append(releases)
    for t in range(steps):
        with torch.no_grad():  # D' is evaluated at D's parameters: the same history of releases
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                b.copy_(a)
        steps_[0](x, y) if t == 0 else steps_[0](x[1:], y[1:])
        steps_[1](x[1:], y[1:])
    ctx.noise_multiplier = 1.0
    return [(a - b).norm().item() for a, b in zip(*seen)], steps_[1].noise_std


def test_dpdice_release_moves_far_beyond_its_calibration_and_dpdice_strict_covers_it():
    from dpbench.optimizers.dice_strict import release_sensitivity

    moved, per_sigma = dice_movements("dpdice")
    assert moved[0] <= 1 + 1e-5  # step 1: the residual is 0 on both sides, only the clipped example differs
    assert per_sigma == pytest.approx(math.sqrt(3))  # the authors' calibration, sensitivity sqrt(1 + 2 C2 / C)
    # ... but the residual carries the example into every later step, though it never takes part
    # again: 64.2 at step 2, 94.4 at step 12 (and up to 99.9, for 37 steps, in a run of 100)
    assert min(moved[1:]) > 60 and max(moved) > 90 > 50 * per_sigma
    strict, per_sigma = dice_movements("dpdice-strict")
    assert strict == moved  # the same algorithm
    assert per_sigma == release_sensitivity(1.0, 64, 1.0, 1.0) == 129.0  # s (1 + 2 L C2 / C)
    assert max(strict) <= per_sigma


def test_dpdice_strict_accounts_t_gaussian_releases_without_amplification():
    from dpbench.mechanisms.base import PlanRequest, PrivacyClaim, Target
    from dpbench.optimizers import get_optimizer
    from dpbench.privacy import accounting

    mech = get_optimizer("dpdice-strict").mechanism
    plan = mech.plan(PlanRequest(60_000, 256, 1))  # P2, one epoch: T = 234 Poisson steps at q = 256 / 60000
    assert plan.steps == 234
    sigma = mech.calibrate(plan, Target(10.0, 1e-5))
    one = accounting.gaussian_noise_multiplier(10.0, 1e-5)  # 0.49989, one release of sensitivity 1
    assert sigma == pytest.approx(math.sqrt(234) * one, rel=1e-9) == pytest.approx(7.647, abs=1e-3)
    claim = PrivacyClaim(mech, plan, sigma, 1e-5)
    rep = claim.spent(234)
    assert rep.epsilon_spent == pytest.approx(10.0, rel=1e-6) and rep.epsilon_rdp > rep.epsilon_spent
    assert claim.epsilon(100) < 10.0  # stopped early: fewer releases
    # what that costs: noise std on the mean gradient sigma (1 + 2 L C2 / C) / L at C2 = C = 1
    assert sigma * (1 + 2 * 256) / 256 == pytest.approx(15.32, abs=0.01)


@pytest.mark.slow  # three runs through the command line, the aggregation and a figure: about 8 s
def test_dpdice_runs_say_their_calibration_is_no_guarantee_in_output_table_and_figures(tiny_fmnist, tmp_path,
                                                                                      capsys):
    from dpbench import cli
    from dpbench.reporting import figures
    from dpbench.reporting.aggregate import aggregate_runs

    paths = []
    for name in ("dpdice", "dpdice-strict", "dpsgd"):
        paths.append(tmp_path / f"{name}.parquet")
        assert cli.main(["train", "--problem", "P2", "--optimizer", name, "--lr", "0.1", "--batch-size", "60",
                         "--epochs", "1", "--seed", "0", "--noise-multiplier", "1", "--accountant", "rdp",
                         "--max-steps", "1", "--test-subset", "20", "--progress-every", "1e9",
                         "--out", str(paths[-1])]) == 0
        err = capsys.readouterr().err
        assert ("privacy caveat: not a valid DP guarantee (for C2 > 0)" in err) == (name == "dpdice"), err
    runs, _ = aggregate_runs(paths, tmp_path / "runs.parquet", tmp_path / "epochs.parquet")
    assert dict(zip(runs.optimizer, runs.dp_guarantee)) == {"dpdice": False, "dpdice-strict": True, "dpsgd": True}
    assert runs.set_index("optimizer").caveat["dpdice"].startswith("not a valid DP guarantee")
    fig = figures.build("fig5_1", runs)
    legend = {t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}
    assert {"DP-Dice (not a valid DP guarantee)", "DP-SGD", "DP-Dice (strict)"} <= legend
    assert figures.legend_labels(runs.assign(dp_guarantee=True))["dpdice"] == "DP-Dice"


def test_every_void_calibration_is_worded_so_that_it_is_found():
    from dpbench.mechanisms.projected_gaussian import PAPER_SENSITIVITY_CAVEAT
    from dpbench.optimizers import get_optimizer
    from dpbench.reporting.results import NO_GUARANTEE

    CAVEAT = get_optimizer("dpdice").caveat
    assert CAVEAT.startswith(NO_GUARANTEE) and PAPER_SENSITIVITY_CAVEAT.startswith(NO_GUARANTEE)


# -- what is not private is marked so -------------------------------------------------------------


def test_columns_computed_from_private_data_without_noise_are_marked_private_false(tiny_fmnist, tmp_path):
    from dpbench.reporting.aggregate import aggregate_runs
    from dpbench.reporting.results import not_private_columns, write_run
    from dpbench.training.train import RunConfig

    res = run_cell(RunConfig(problem="P2", optimizer="dpsgd", lr=0.1, batch_size=60, epochs=1, seed=0,
                        noise_multiplier=1.0, accountant="rdp", max_steps=2, validation_size=50, test_subset=20,
                        progress_every_s=1e9))
    path = write_run(tmp_path / "run.parquet", res.metrics, {**res.meta, "run_id": "r"})
    marked = not_private_columns(path)
    assert set(marked) == {"loss", "accuracy", "batch_size"}
    assert "train" in marked["loss"] and "val" in marked["loss"] and "Poisson" in marked["batch_size"]
    aggregate_runs([path], tmp_path / "runs.parquet", tmp_path / "epochs.parquet")
    # (the language model's columns: its validation and training losses, and what the canaries
    # planted in the training data show of the model)
    assert set(not_private_columns(tmp_path / "runs.parquet")) == {
        "best_val_accuracy", "best_val_loss", "test_accuracy_at_best_val", "test_loss_at_best_val",
        "test_correct_at_best_val", "status",
        "final_val_loss", "val_perplexity", "final_train_loss",
        *(f"{c}_k{k}" for k in (0, 1, 5, 25) for c in ("exposure", "exposure_std", "extracted"))}
    assert set(not_private_columns(tmp_path / "epochs.parquet")) == {
        "train_loss", "train_accuracy", "val_loss", "val_accuracy"}
    assert "test_accuracy" not in not_private_columns(tmp_path / "epochs.parquet")  # the released model on test data
    docs = Path(__file__).resolve().parents[2] / "docs"
    assert "**What is not private.**" in (docs / "privacy.md").read_text()
    assert "| **false** for `train` and `val` rows" in (docs / "results.md").read_text()
