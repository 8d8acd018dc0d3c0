"""The empirical audit through the harness: releases as claimed, every optimizer auditable,
mutants caught, correct mechanisms not flagged, the deterministic checks, the CLI and file."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from dpbench.audit import mutants, run, statistics
from dpbench.audit.trials import (AuditProblem, audit_spec, participation_check, postprocessing_check,
                                  run_trials, sign_worst_norm)
from dpbench.reporting import audits as audit_table
from dpbench.optimizers import OPTIMIZERS, get_optimizer
from dpbench.optimizers.base import SGD, DPStep
from dpbench.mechanisms.base import AuditSpec

SMALL = AuditProblem(dimension=5, examples=20, batch_size=5, steps=40)  # q = 0.25, E = 10


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one thread


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("audit-cache"))


PRIVATE = sorted(name for name, spec in OPTIMIZERS.items() if spec.private)


@pytest.mark.parametrize("name", PRIVATE)
def test_every_private_optimizer_is_auditable_and_its_release_noise_is_as_claimed(name, cache):
    """Out-trial releases in the canary's coordinate are pure noise of the claimed std (the
    audit reads the harness's release, sigma and sensitivity, not a model of them); in-trials
    move them. 64 trials x 40 steps: the std is within 6% (about 5 standard errors). sigma is
    given (calibration is exercised by the audits below)."""
    spec = get_optimizer(name)
    hyper = {"bands": 2} if name == "dpmatrix-band-amp" else None  # "auto" searches b for a target epsilon
    tr = run_trials(spec, None, 64, seed=1, hyper=hyper, problem=SMALL, lanes=64, cache_dir=cache,
                    noise_multiplier=1.5)
    assert tr.y.shape == (SMALL.steps, 64) and tr.canary_in.sum() == 32
    y = tr.y
    if tr.claim.strategy is not None:  # correlated noise sigma s C^-1 Z: whitened by C it is white
        y = tr.claim.strategy @ y
    out = y[:, ~tr.canary_in]
    assert out.std() == pytest.approx(np.sqrt(np.mean(tr.noise_std ** 2)), rel=0.06)
    if tr.audit.statistic != "projected-lr":  # there the canary's signal is spread by P_k
        shift = y[:, tr.canary_in].mean() - out.mean()
        assert shift > 3 * out.std() * np.sqrt(2 / out.size)  # in-trials move the release (z > 3)


def test_non_private_optimizers_are_refused():
    with pytest.raises(ValueError, match="not private"):
        audit_spec(get_optimizer("sgd"))


@pytest.mark.parametrize("name", ["dpsgd", "dpadamw-bc", "dpdisk", "dpmatrix-me"])
def test_update_rules_are_post_processing_of_the_releases(name, cache):
    """Replaying the recorded releases through a fresh update rule, without any gradient,
    gives bit-identical parameters: the rule reads nothing but the release."""
    from dpbench.audit.trials import make_claim

    spec = get_optimizer(name)
    hyper = spec.hyperparameters(None)
    claim = make_claim(spec, None, hyper, SMALL, 1e-5, "prv", 1.0, cache, noise_multiplier=1.5)
    assert postprocessing_check(spec, claim, hyper, SMALL, seed=3)


def test_a_rule_that_reads_raw_gradients_fails_the_post_processing_check(cache):
    """The check has teeth: a rule that also uses what the release does not contain (here: a
    counter of calls with a data-dependent step) is caught."""
    import dataclasses

    from dpbench.audit.trials import make_claim

    spec = get_optimizer("dpsgd")

    class Peeking:
        def __init__(self, step):
            self.step = step

        @torch.no_grad()
        def update(self, params, grads):
            raw = self.step.last_raw  # a hidden, data-dependent quantity
            torch._foreach_add_(params, [g + 1e-3 * raw for g in grads], alpha=-0.1)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    def build(ctx):
        step = spec.build(ctx)
        inner_clip = step.clip_and_sum

        def clip_and_sum(psg):
            step.last_raw = 0.0 if psg is None else float(psg.batch_size)
            return inner_clip(psg)

        step.last_raw = 0.0
        step.clip_and_sum = clip_and_sum
        step.rule = Peeking(step)
        return step

    peeking = dataclasses.replace(spec, name="dpsgd~peeking", build=build)
    claim = make_claim(peeking, None, {}, SMALL, 1e-5, "prv", 1.0, cache, noise_multiplier=1.5)
    assert not postprocessing_check(peeking, claim, {}, SMALL, seed=3)


def test_sign_worst_norm_enumerates_signs():
    c = np.array([[1.0, 0.0, 0.0], [-0.6, 0.8, 0.0], [0.0, 0.0, 1.0]])  # X_01 = -0.48 < 0
    steps = np.array([0, 1])
    # all-equal signs give ||C (e0 + e1)|| = sqrt(0.4^2 + 0.8^2 + 1^2 ... ) — opposite signs are worse
    plus = np.linalg.norm(c[:, 0] + c[:, 1])
    minus = np.linalg.norm(c[:, 0] - c[:, 1])
    assert minus > plus
    assert sign_worst_norm(c, steps) == pytest.approx(minus)
    assert sign_worst_norm(c, steps, enumerate_up_to=1) >= minus  # the |X| bound above it


def test_participation_check_passes_the_real_loader_and_catches_reshuffling(cache):
    from dpbench.audit.trials import make_claim, problem_size

    for spec, ok in ((get_optimizer("dpmatrix-me"), True), (mutants.reshuffled_participation(), False)):
        claim = make_claim(spec, 4.0, {}, SMALL, 1e-5, "prv", 1.0, cache)
        n, _ = problem_size(spec, SMALL)
        check = participation_check(claim.strategy, spec.mechanism.sampler(claim.plan, n, 5, "cpu"),
                                    claim.plan.steps, claim.strategy_sensitivity)
        assert check["ok"] is ok, check
        assert check["examples"] == n


@pytest.mark.parametrize("make", [mutants.no_clipping, mutants.reused_noise, mutants.noise_over_sqrt_t,
                                  mutants.amplified_rate_l_over_n])
def test_strong_mutants_are_flagged_with_few_trials(make, cache):
    _, rec = run.audit(make(), 2.0, 400, seed=0, problem=SMALL, lanes=200, cache_dir=cache)
    assert rec["violation"] and rec["violation_statistical"]


def test_reshuffled_participation_is_flagged_by_the_deterministic_check(cache):
    _, rec = run.audit(mutants.reshuffled_participation(), 2.0, 200, seed=0, problem=SMALL, lanes=200,
                       cache_dir=cache)
    assert rec["violation"] and not rec["checks"]["participation"]["ok"]


@pytest.mark.slow
def test_half_sample_rate_is_flagged(cache):
    """sigma calibrated for q/2 (true epsilon about twice the claim): the weakest mutant."""
    _, rec = run.audit(mutants.half_sample_rate(), 2.0, 4000, seed=0, lanes=200, cache_dir=cache)
    assert rec["violation"]


def test_dpdice_is_flagged_at_its_published_calibration(cache):
    _, rec = run.audit(get_optimizer("dpdice"), 2.0, 400, seed=0, problem=SMALL, lanes=200, cache_dir=cache)
    assert rec["violation"] and rec["epsilon_lower"] > 2.0


def test_false_alarm_rate_of_correct_mechanisms_is_at_most_beta(cache):
    """30 independent audits of unmodified DP-SGD through the harness (R = 200 each: one run of
    6000 trials cut into 30 disjoint groups, fixed seed). The violation test's false-alarm
    probability is <= beta = 0.05 each (in practice far less: the union bound is
    conservative), so we allow 4 of 30 (P[Bin(30, 0.05) > 4] = 0.06, and the true rate is
    lower still)."""
    from dpbench.audit import bounds

    spec = get_optimizer("dpsgd")
    tr = run_trials(spec, 2.0, 6000, seed=11, problem=SMALL, lanes=250, cache_dir=cache)
    profile = tr.claim.privacy.profile()
    scored = run.scores(tr)
    flagged = 0
    for group in np.arange(6000).reshape(30, 200):
        inn = tr.canary_in[group]
        result = bounds.analyse({k: (v[group][inn], v[group][~inn]) for k, v in scored.items()}, profile, rng=int(group[0]))
        flagged += result.violation
    assert flagged <= 4


def test_correct_matrix_mechanism_is_not_flagged_and_epsilon_lower_is_below_the_claim(cache):
    _, rec = run.audit(get_optimizer("dpmatrix-se"), 4.0, 800, seed=2, problem=SMALL, lanes=200, cache_dir=cache)
    assert not rec["violation"] and rec["checks"]["participation"]["ok"] and rec["checks"]["postprocessing"]
    assert 0 < rec["epsilon_lower"] < 4.0
    assert rec["epsilon_gdp_sound"]  # one Gaussian release: the GDP estimate is sound


def test_cli_writes_the_documented_file(tmp_path, cache):
    from dpbench.cli import main
    from dpbench.reporting.results import read_meta

    out = tmp_path / "a.parquet"
    assert main(["audit", "--optimizer", "dpsgd", "--epsilon", "4", "--trials", "200", "--seed", "1",
                 "--out", str(out), "--cache-dir", cache]) == 0
    rows = pd.read_parquet(out)
    assert list(rows.columns) == ["trial", "canary_in", "statistic", "score"]
    assert rows.dtypes["trial"] == np.int64 and rows.dtypes["canary_in"] == bool
    assert rows.dtypes["score"] == np.float64 and set(rows["statistic"]) == {"S_LR", "S_diff"}
    assert len(rows) == 2 * 200 and rows.groupby("statistic")["canary_in"].sum().tolist() == [100, 100]
    a = read_meta(out)["audit"]
    for key in ("epsilon_claimed", "delta", "beta", "trials", "mode", "statistics", "levels", "epsilon_lower",
                "violation", "epsilon_gdp", "canary_norm"):
        assert key in a, key
    assert a["levels"] == [1, 2, 4, 8, 16, 32] and a["canary_norm"] == 10.0  # n0 = 100: up to 2^floor(log2 50)
    claim = a["claim"]
    assert claim["sample_rate"] == 0.05 and claim["steps"] == 200 and claim["clip_sensitivity"] == 1.0
    assert claim["accountant"] == "prv" and claim["noise_multiplier"] > 0
    table = audit_table.collect([out])
    assert table.loc[0, "optimizer"] == "dpsgd" and not table.loc[0, "violation"]


def test_cli_refuses_non_private_and_missing_arguments(tmp_path, capsys):
    from dpbench.cli import main

    assert main(["audit", "--optimizer", "sgd", "--epsilon", "1", "--out", str(tmp_path / "x.parquet")]) == 2
    assert "not private" in capsys.readouterr().err
    assert main(["audit", "--optimizer", "dpsgd", "--out", str(tmp_path / "x.parquet")]) == 2
    assert "--epsilon" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # refused by the argument's type, as by dpbench train
        main(["audit", "--optimizer", "dpsgd", "--epsilon", "inf", "--out", str(tmp_path / "x.parquet")])
    assert refused.value.code == 2
    assert "argument --epsilon: expected a finite positive number" in capsys.readouterr().err


# -- the white-box sensitivity check (dpbench.audit.sensitivity) --------------------------------

def _claim(spec, cache, problem=SMALL):
    from dpbench.audit.trials import make_claim, problem_size

    hyper = spec.hyperparameters({"bands": 2} if spec.name == "dpmatrix-band-amp" else None)
    claim = make_claim(spec, None, hyper, problem, 1e-5, "rdp", 1.0, cache, noise_multiplier=1.5)
    return claim, hyper, problem_size(spec, problem)[0]


@pytest.mark.parametrize("name", PRIVATE)
def test_every_built_in_private_optimizer_passes_the_sensitivity_check(name, cache):
    """One example moves each built-in's clipped sum by at most the clipping's sensitivity, on
    the layered model, in every case (float64: within 1e-9), under both clippings."""
    from dpbench.audit.sensitivity import LAYERS, sensitivity_check

    spec = get_optimizer(name)
    check = sensitivity_check(spec, *_claim(spec, cache))
    assert check["ok"] and check["noise_std_ok"], check
    assert 1 - 1e-6 < check["max_moved_per_sensitivity"] <= 1 + 1e-9  # a case clips x: it moves by s
    assert check["cases"] == 2 * (len(LAYERS) + 9) and len(set(LAYERS)) == len(LAYERS) > 2


class PerLayerClip(DPStep):
    """As a plugin would write it (this module is not dpbench's): each of the K layers clipped at
    ``C / root``; root = 1 is the bug (one example moves the sum by up to C sqrt(K)), root =
    sqrt(K) is a valid per-layer clipping."""

    root = 1.0

    def clip_and_sum(self, psg):
        if psg is None:
            return super().clip_and_sum(psg)
        summed = {}
        for layer in psg.layers:
            norms = layer.inner(layer).clamp_min(0).sqrt() * self.root
            summed.update(layer.weighted_sum(self.ctx.clipping.coefficients(norms)))
        return [summed[p] for p in self.params]


class PerLayerClipFixed(PerLayerClip):
    @property
    def root(self):
        return math.sqrt(len(self.tape.layers))


def _per_layer(step_class, name):
    return dataclasses.replace(get_optimizer("dpsgd"), name=name, build=lambda ctx: step_class(ctx, SGD(ctx.lr)))


def test_per_layer_clipping_at_c_is_flagged_and_at_c_over_root_k_passes(cache):
    """The planted bug: K = 4 layers, each clipped at C: x spread over all layers moves the sum
    by C sqrt(K) = 2 s (normalised: 2). The statistical audit's model has one layer, where the
    bug is harmless; the sensitivity check flags it, and ``dpbench audit`` reports a violation.
    Clipping each layer at C / sqrt(K) is valid and passes."""
    from dpbench.audit.sensitivity import LAYERS, sensitivity_check

    buggy = _per_layer(PerLayerClip, "dpsgd-per-layer")
    check = sensitivity_check(buggy, *_claim(buggy, cache))
    assert not check["ok"] and check["stages"] == {"clip_and_sum": "plugin"}
    assert check["max_moved_per_sensitivity"] == pytest.approx(math.sqrt(len(LAYERS)), rel=1e-9)
    assert "spread over all layers" in check["worst_case"] or "aligned" in check["worst_case"]
    _, rec = run.audit(buggy, 2.0, 200, seed=0, problem=SMALL, lanes=200, cache_dir=cache)
    assert rec["violation"] and not rec["checks"]["sensitivity"]["ok"]
    assert rec["claim"]["stages"] == {"clip_and_sum": "plugin"}
    fixed = _per_layer(PerLayerClipFixed, "dpsgd-per-layer-fixed")
    check = sensitivity_check(fixed, *_claim(fixed, cache))
    assert check["ok"] and check["max_moved_per_sensitivity"] <= 1 + 1e-9, check
    # the built-in mutant, which the self-test audits
    check = sensitivity_check(mutants.per_layer_clipping(), *_claim(get_optimizer("dpsgd"), cache))
    assert not check["ok"] and check["stages"] == {"clip_and_sum": "built-in"}


def test_the_sensitivity_check_flags_a_step_that_shrinks_its_noise(cache):
    """A step whose ``noise_std`` is below sigma s (a plugin's own noise scale) fails the check."""
    from dpbench.audit.sensitivity import sensitivity_check

    class Quieter(DPStep):
        @property
        def noise_std(self):
            return super().noise_std / 2

    spec = dataclasses.replace(get_optimizer("dpsgd"), name="dpsgd-quiet", build=lambda ctx: Quieter(ctx, SGD(ctx.lr)))
    check = sensitivity_check(spec, *_claim(spec, cache))
    assert not check["ok"] and not check["noise_std_ok"] and check["max_moved_per_sensitivity"] <= 1 + 1e-9
    assert check["stages"] == {"noise_std": "plugin"}


def test_one_run_mode(cache):
    rows, rec = run.audit(get_optimizer("dpsgd"), 8.0, mode="one-run", canaries=200, seed=0, problem=SMALL,
                          cache_dir=cache)
    assert len(rows) == 200 and rec["guesses"] == 40 and rec["violation"] is False
    assert 0 <= rec["epsilon_lower"] < 8.0



# -- the statistics, objects registered by name ------------------------------------------------

def test_the_matrix_statistic_is_s_mf_of_each_trials_own_pattern():
    """The registered ``matrix`` statistic (each trial with its own participation v) equals the
    one-pattern oracle ``s_mf`` where all trials share v."""
    rng = np.random.default_rng(0)
    T, R = 6, 5
    strategy = np.tril(rng.random((T, T))) + np.eye(T)
    v = np.array([1.0, 0, 1, 0, 0, 1])
    trials = SimpleNamespace(y=rng.normal(size=(T, R)), pattern=np.tile(v[:, None], (1, R)),
                             claim=SimpleNamespace(strategy=strategy))
    scored = statistics.get_statistic("matrix").score(trials)
    np.testing.assert_allclose(scored, statistics.s_mf(trials.y.T, strategy, v), rtol=1e-12)


class LastRelease(statistics.AuditStatistic):
    def score(self, trials):
        return trials.y[-1]


def test_a_registered_statistic_scores_the_trials_of_a_spec_that_names_it(cache):
    statistics.register_statistic(LastRelease("last-release", "S_last"))
    try:
        spec = dataclasses.replace(get_optimizer("dpsgd"), audit=AuditSpec("last-release"))
        tr = run_trials(spec, None, 8, seed=1, problem=SMALL, lanes=8, cache_dir=cache, noise_multiplier=1.5)
        scored = run.scores(tr)
        assert list(scored) == ["S_last", "S_diff"] and np.array_equal(scored["S_last"], tr.y[-1])
        assert np.array_equal(scored["S_diff"], statistics.s_diff(tr.y.T))  # not whitened
    finally:
        del statistics.STATISTICS["last-release"]


def test_an_unknown_statistic_is_refused_by_name_when_the_audit_starts():
    spec = dataclasses.replace(get_optimizer("dpsgd"), audit=AuditSpec("likelihood"))
    with pytest.raises(ValueError, match=r"optimizer 'dpsgd': AuditSpec.statistic: unknown audit statistic "
                                         r"'likelihood' \(registered: lr, sum, projected-lr, matrix, banded-lr;"):
        run_trials(spec, 1.0, 8, problem=SMALL)
    with pytest.raises(ValueError, match="audit statistic 'sum' is already registered"):
        statistics.register_statistic(statistics.Sum("sum", "S_sum"))

def test_dpdice_runs_carry_the_audit_flag_in_the_runs_table_and_the_legends(tiny_fmnist, tmp_path, cache):
    """A refuted optimizer is marked wherever its runs are compared: the runs table's
    audit_violation (True for dpdice, False for dpsgd, missing for the unaudited sgd) and every
    comparison figure's legend."""
    from conftest import run_cell
    from dpbench.reporting import figures
    from dpbench.reporting.aggregate import aggregate_runs
    from dpbench.reporting.results import write_run, write_table
    from dpbench.training.train import RunConfig

    files = []
    for name in ("dpdice", "dpsgd", "sgd"):
        res = run_cell(RunConfig(problem="P2", optimizer=name, lr=0.1, batch_size=60, epochs=1, seed=0,
                                 noise_multiplier=1.0 if name != "sgd" else None, accountant="rdp", max_steps=2,
                                 test_subset=50, progress_every_s=1e9))
        files.append(write_run(tmp_path / f"{name}.parquet", res.metrics, {**res.meta, "run_id": name}))
    audits = []
    for name in ("dpdice", "dpsgd"):
        rows, rec = run.audit(get_optimizer(name), 2.0, 200, seed=0, problem=SMALL, lanes=200, cache_dir=cache)
        audits.append(write_table(rows, tmp_path / f"audit-{name}.parquet", meta={"audit": rec}))
    table = audit_table.aggregate_audits(audits, tmp_path / "audits.parquet")
    assert dict(zip(table.optimizer, table.violation)) == {"dpdice": True, "dpsgd": False}
    rows = {line.split(" | ")[0]: line for line in audit_table.markdown(table).splitlines()[2:]}
    assert set(rows) == {"| `dpdice`", "| `dpsgd`"} and "ε* = 2" in audit_table.markdown(table)
    assert "**VIOLATION**" in rows["| `dpdice`"] and "**VIOLATION**" not in rows["| `dpsgd`"]
    lower = table.set_index("optimizer").epsilon_lower
    assert f"| {lower['dpsgd']:.2f} / " in rows["| `dpsgd`"]
    runs, _ = aggregate_runs(files, tmp_path / "runs.parquet", tmp_path / "epochs.parquet",
                             audits=tmp_path / "audits.parquet")
    flag = dict(zip(runs.optimizer, runs.audit_violation))
    assert flag["dpdice"] == True and flag["dpsgd"] == False and pd.isna(flag["sgd"])  # noqa: E712
    labels = figures.legend_labels(pd.read_parquet(tmp_path / "runs.parquet"))
    assert labels["dpdice"].endswith(figures.AUDIT_MARK) and figures.AUDIT_MARK not in labels["dpsgd"]
    png, pdf = figures.plot("audit", tmp_path / "audits.parquet", tmp_path / "figs" / "audit")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pdf.read_bytes()[:5] == b"%PDF-"
