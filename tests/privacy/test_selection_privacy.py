"""The privacy a choice among runs spends (dpbench.privacy.selection, reporting.figures.spent) and
the intervals over seeds (reporting.figures.intervals)."""

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import norm

from dpbench.privacy import accounting
from dpbench.privacy.selection import composed_epsilon, composed_epsilon_of, gaussian_history, gaussian_mu
from dpbench.reporting.figures import intervals, spent

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
DELTA = 1e-5
DPSGD = [(1.0, 0.01, 200)]  # sigma, q, T: small enough for every accountant in a second


def closed_form_delta(eps, mu):
    """Balle & Wang 2018, Thm. 8, written out here rather than taken from the package."""
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


def test_one_candidate_spends_the_run_epsilon():
    run = accounting.epsilon(DPSGD, DELTA, "prv")
    assert composed_epsilon(DPSGD, 1, DELTA, "prv") == run
    assert composed_epsilon(DPSGD, 1, DELTA, "rdp") == accounting.fast_rdp_epsilon(DPSGD, DELTA)
    # our PLD is pessimistic, within its rounding of the PRV accountant's epsilon
    assert run - 0.01 <= composed_epsilon(DPSGD, 1, DELTA, "pld", eps_error=0.01) <= run + 0.02


@pytest.mark.parametrize("k", [2, 3, 10])
@pytest.mark.parametrize("sigma", [0.7, 3.0])
def test_k_gaussian_runs_are_one_gaussian_of_sigma_over_sqrt_k(k, sigma):
    """k releases of the Gaussian mechanism with noise sigma (sensitivity 1) compose exactly to
    one with noise sigma / sqrt(k): mu = sqrt(k) / sigma, not k / sigma and not k epsilons."""
    for accountant in ("prv", "pld", "rdp"):  # exact whatever the accountant
        eps = composed_epsilon([(sigma, 1.0, 1)], k, DELTA, accountant)
        assert closed_form_delta(eps, math.sqrt(k) / sigma) == pytest.approx(DELTA, rel=1e-6)
    one = accounting.gaussian_epsilon(1 / sigma, DELTA)
    assert composed_epsilon([(sigma, 1.0, 1)], k, DELTA) < k * one
    # T full-batch steps per run: mu = sqrt(k T) / sigma
    eps = composed_epsilon([(sigma, 1.0, 5)], k, DELTA)
    assert closed_form_delta(eps, math.sqrt(5 * k) / sigma) == pytest.approx(DELTA, rel=1e-6)


def test_composition_grows_with_k_and_never_beyond_k_epsilon():
    one = composed_epsilon(DPSGD, 1, DELTA)
    eps = [composed_epsilon(DPSGD, k, DELTA) for k in (1, 2, 3, 5)]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    assert all(e <= k * one for e, k in zip(eps, (1, 2, 3, 5)))
    assert eps[1] < 1.6 * one  # composition of subsampled runs is far below the sum
    # k runs are one run of k T steps
    assert eps[2] == accounting.epsilon([(1.0, 0.01, 600)], DELTA, "prv")
    # the PLD agrees with the PRV accountant on the composition too
    assert eps[2] - 0.01 <= composed_epsilon(DPSGD, 3, DELTA, "pld", eps_error=0.01) <= eps[2] + 0.03


def test_mixed_runs_compose():
    a, b = gaussian_history(0.5), gaussian_history(1.2)
    assert composed_epsilon_of([a, b], DELTA) == pytest.approx(accounting.gaussian_epsilon(math.hypot(0.5, 1.2), DELTA))
    mixed = composed_epsilon_of([DPSGD, a], DELTA)
    assert max(composed_epsilon(DPSGD, 1, DELTA), accounting.gaussian_epsilon(0.5, DELTA)) < mixed
    assert composed_epsilon_of([], DELTA) == 0.0
    with pytest.raises(ValueError, match="k must be a positive integer"):
        composed_epsilon(DPSGD, 0)
    with pytest.raises(ValueError, match="unknown accountant"):
        composed_epsilon(DPSGD, 2, DELTA, "moments")


@pytest.mark.parametrize("eps", [0.5, 1.0, 10.0])
def test_gaussian_mu_inverts_the_exact_curve_upwards(eps):
    mu = gaussian_mu(eps, DELTA)
    assert closed_form_delta(eps, mu) == pytest.approx(DELTA, rel=1e-9)
    assert closed_form_delta(eps, mu) >= DELTA * (1 - 1e-12)  # rounded up: never optimistic


def _lm():
    runs = pd.read_parquet(RESULTS / "lm" / "study" / "runs.parquet")
    return runs[runs["private"].astype(bool)]


def test_a_run_event_from_its_row_gives_its_epsilon_back():
    """The rows of the committed language-model study: DP-SGD's event is (sigma, q, T), amplified
    BandMF's ceil(T / b) steps at p; the PRV accountant on them returns each row's epsilon."""
    runs = _lm()
    for opt in ("dpsgd", "dpadamw", "opacus-dpsgd", "dpmatrix-band-amp"):
        for eps in (1.0, 10.0):
            row = runs[(runs.optimizer == opt) & (runs.target_epsilon == eps)].iloc[0]
            history = spent.run_history(row)
            assert accounting.epsilon(history, row.delta, "prv") == pytest.approx(row.epsilon, rel=1e-6), (opt, eps)
    amp = runs[(runs.optimizer == "dpmatrix-band-amp") & (runs.target_epsilon == 1.0)].iloc[0]
    assert spent.run_history(amp)[0][2] == 18  # b = 11 bands of 196 steps: ceil(196 / 11) rounds
    compare = pd.read_parquet(RESULTS / "beyond-setup2-compare" / "runs.parquet")
    row = compare[(compare.optimizer == "dpmatrix-band") & (compare.target_epsilon == 1.0)].iloc[0]
    (s, q, n), = spent.run_history(row)
    assert (q, n) == (1.0, 1) and accounting.gaussian_epsilon(1 / s, row.delta) == pytest.approx(row.epsilon)
    # a decaying noise schedule is not in the table: no event, rather than a wrong one
    assert spent.run_history(pd.Series({**row.to_dict(), "optimizer": "d2p2sgd", "accountant": "rdp"})) is None


def test_the_recorded_event_is_the_mechanisms_own_and_gives_its_epsilon_back(tmp_path):
    """``accounted_history`` (written into every run record) is each built-in mechanism's own
    event: accounted as the run is (PRV, or RDP where the mechanism accounts with RDP), it gives
    the epsilon the mechanism reports for the steps taken. dpdice-strict's is T Gaussian steps
    without amplification (q = 1), not DP-SGD's amplified one; the matrix mechanisms (one
    Gaussian release) and the Gaussian projection (a bound that may fail) record none."""
    from dpbench.mechanisms.base import PlanRequest, PrivacyClaim, recorded_history
    from dpbench.optimizers import OPTIMIZERS

    seen = {}
    for name, spec in OPTIMIZERS.builtins.items():
        if not spec.private:
            continue
        mech = spec.mechanism
        hyper = spec.hyperparameters({"bands": 2} if name == "dpmatrix-band-amp" else None)
        epochs = 1 if getattr(mech, "single_epoch", False) else 2
        plan = mech.plan(PlanRequest(40, 5, epochs, hyperparameters=hyper, target_epsilon=4.0, cache_dir=tmp_path))
        recorded = recorded_history(mech, plan, 1.3, plan.steps - 3)
        seen[name] = recorded
        if recorded is None:
            continue
        report = PrivacyClaim(mech, plan, 1.3, DELTA, accounting.PRV).spent(plan.steps - 3)
        accountant = "rdp" if report.accountant is accounting.RDP_INTEGER else "prv"
        history = [tuple(h) for h in recorded]
        eps = (accounting.fast_rdp_epsilon(history, DELTA) if accountant == "rdp"
               else accounting.epsilon(history, DELTA, "prv"))
        assert eps == pytest.approx(report.epsilon_spent, rel=1e-3), name
    assert seen["dpsgd"] == [[1.3, 5 / 40, 13]] and seen["dpdice-strict"] == [[1.3, 1.0, 13]]
    assert seen["dpmatrix-me"] is None and seen["dpmatrix-band"] is None and seen["d2p2sgd"] is not None
    assert len(seen["d2psgd"]) > 1  # a decaying schedule: segments of sigma_k
    assert seen["dpmatrix-band-amp"] is not None and seen["dpmatrix-band-amp"][0][2] < 13  # ceil(T / b) rounds
    gaussian = OPTIMIZERS["d2p2sgd"]
    plan = gaussian.mechanism.plan(PlanRequest(40, 5, 2, hyperparameters=gaussian.hyperparameters(
        {"projection": "gaussian"}), cache_dir=tmp_path))
    assert recorded_history(gaussian.mechanism, plan, 1.3, 13) is None


def test_a_plugin_optimizer_on_a_built_in_mechanism_gets_its_selection_epsilon():
    """epsilon_sel comes from the event the run's mechanism recorded, whatever the optimizer's
    id: a plugin's optimizer on DP-SGD's mechanism composes as DP-SGD does; on a mechanism of its
    own class (mechanism_origin plugin) it gets none."""
    import json

    history = [[1.0, 0.01, 200]]
    row = {"private": True, "epsilon": accounting.epsilon(DPSGD, DELTA, "prv"), "delta": DELTA, "accountant": "prv",
           "noise_multiplier": 1.0, "sample_rate": 0.01, "steps": 200, "epochs": 2, "lr": 0.1,
           "accounted_history": json.dumps(history), "mechanism_origin": "built-in"}
    runs = pd.DataFrame([{**row, "optimizer": opt, "seed": seed, "lr": lr}
                         for opt in ("dpsgd", "dpsgd-momentum") for seed, lr in ((0, 0.1), (1, 0.2))])
    assert spent.run_history(runs.iloc[2]) == [(1.0, 0.01, 200)]
    mine, theirs = (spent.selection_privacy(runs[runs.optimizer == o], ["lr"]) for o in ("dpsgd-momentum", "dpsgd"))
    assert mine["selection_epsilon"] == theirs["selection_epsilon"] > row["epsilon"] and mine["not_composed"] == ""
    own = runs.assign(mechanism_origin="plugin")
    assert spent.run_history(own.iloc[2]) is None
    assert spent.selection_privacy(own[own.optimizer == "dpsgd-momentum"], ["lr"])["not_composed"] == "dpsgd-momentum"


def test_selection_privacy_of_committed_groups():
    compare = pd.read_parquet(RESULTS / "beyond-setup2-compare" / "runs.parquet")
    group = compare[(compare.optimizer == "dpmatrix-se") & (compare.target_epsilon == 10.0)]
    # its two learning rates ran on the same three seeds: the same noise, so no composed epsilon is claimed
    s = spent.selection_privacy(group, ["lr"])
    assert s["k"] == len(group) == 6 and s["n_configs"] == group.lr.nunique() == 2 and s["n_seeds"] == 3
    assert math.isnan(s["selection_epsilon"]) and s["not_composed"] == spent.SHARED_SEEDS
    # the same runs on seeds of their own: independent Gaussian releases, mu * sqrt(k)
    own = group.assign(seed=range(len(group)))
    s = spent.selection_privacy(own, ["lr"])
    mu = gaussian_mu(group.epsilon.iloc[0], DELTA)
    assert s["selection_epsilon"] == pytest.approx(accounting.gaussian_epsilon(mu * math.sqrt(len(group)), DELTA))
    lm = _lm()
    group = lm[(lm.optimizer == "dpsgd") & (lm.target_epsilon == 1.0)]
    s = spent.selection_privacy(group, ["lr"])
    exact = composed_epsilon(spent.run_history(group.iloc[0]), 3, DELTA, "prv")
    assert s["k"] == 3 and s["n_seeds"] == 3 and s["selection_accountant"] == "pld"
    assert exact - 0.01 <= s["selection_epsilon"] <= exact + spent.EPS_ERROR + 0.01
    assert math.isnan(spent.selection_privacy(group.assign(private=False), ["lr"])["selection_epsilon"])


def test_t_interval_and_ties():
    mean, low, high, n = intervals.t_interval([1.0, 2.0, 3.0, np.nan])
    half = 4.302652729749464 / math.sqrt(3)  # t_{0.975, 2} x s / sqrt(n), s = 1
    assert (mean, n) == (2.0, 3) and (low, high) == (pytest.approx(2 - half), pytest.approx(2 + half))
    assert intervals.t_interval([5.0])[1:3] == (5.0, 5.0)
    ranked = pd.DataFrame({"ci_low": [1.0, 1.5, 3.0, 3.0], "ci_high": [2.0, 2.5, 4.0, 3.0]})
    assert intervals.tied_with_above(ranked) == [False, True, False, True]
    one_seed = pd.DataFrame({"ci_low": [1.0, 1.0], "ci_high": [1.0, 1.0]})
    assert intervals.tied_with_above(one_seed) == [False, False]  # equal points without intervals


def test_audit_figure_and_table_take_several_seeds():
    from dpbench.reporting import figures
    from dpbench.reporting.audits import markdown, over_seeds

    audits = pd.read_parquet(RESULTS / "audit" / "audits.parquet")
    audits = audits[audits.seed == 0].reset_index(drop=True)  # the committed table has seeds 0, 1, 2
    assert len(audits) == 76  # 19 private optimizers x 4 claims
    committed = over_seeds(pd.read_parquet(RESULTS / "audit" / "audits.parquet"))
    assert (committed.n_seeds == 3).all() and len(committed) == 76
    assert set(committed[committed.violation].optimizer) == {"dpdice"}  # refuted by some seed: DP-Dice alone
    one = over_seeds(audits)
    assert (one.n_seeds == 1).all() and (one.ci_low == one.epsilon_lower).all() and len(one) == len(audits)
    shifted = [audits.assign(epsilon_lower=audits.epsilon_lower + d, seed=s) for s, d in enumerate((-0.1, 0.0, 0.1))]
    three = over_seeds(pd.concat(shifted))
    assert (three.n_seeds == 3).all() and len(three) == len(audits)
    row = three[(three.optimizer == "dpsgd") & (three.epsilon_claimed == 8)].iloc[0]
    base = audits[(audits.optimizer == "dpsgd") & (audits.epsilon_claimed == 8)].epsilon_lower.iloc[0]
    half = 4.302652729749464 * 0.1 / math.sqrt(3)
    assert row.epsilon_lower == pytest.approx(base) and row.ci_high == pytest.approx(base + half)
    line = next(x for x in markdown(pd.concat(shifted)).splitlines() if x.startswith("| `dpsgd` |"))
    assert f"{base:.2f} ± {half:.2f} / " in line and "(3 seeds)" in line
    # one seed's violation flags the pair: a claim refuted by any seed is refuted
    flagged = [s.assign(violation=(s.optimizer == "dpsgd") & (s.seed == 2)) for s in shifted]
    assert three.violation.sum() == audits.violation.sum()
    assert over_seeds(pd.concat(flagged)).query("optimizer == 'dpsgd'").violation.all()
    fig = figures.build("audit", pd.concat(shifted))
    assert "3 seeds: mean and 95 % t interval" in fig.legends[0].get_title().get_text()
    figures.plt.close(fig)
    fig = figures.build("audit", pd.concat(shifted[:2] + [shifted[2][shifted[2].optimizer == "dpsgd"]]))
    assert "2-3 seeds per claim" in fig.legends[0].get_title().get_text()
    figures.plt.close(fig)


def test_the_audit_figure_says_why_a_bar_below_its_claim_is_a_violation():
    """DP-Dice at a claimed ε of 8 (or 10) is refuted with its certified bar below the claim (R trials
    certify at most about ln R): the panel and the figure say it was refuted through the claimed
    privacy curve; a figure without such a violation says nothing of it."""
    from dpbench.reporting import figures
    from dpbench.reporting.figures.audit import refuted_below_claim

    audits = pd.read_parquet(RESULTS / "audit" / "audits.parquet")
    audits = audits[audits.seed == 0].reset_index(drop=True)
    dice = audits[(audits.optimizer == "dpdice") & audits.violation]
    assert set(dice.epsilon_claimed[refuted_below_claim(dice)]) == {8.0}  # the committed claims: 1, 2, 4, 8
    assert (dice.epsilon_lower <= dice.max_certifiable_epsilon + 1e-12).all()  # no bar rises above ln R
    fig = figures.build("audit", audits, optimizers=["dpsgd", "dpdice"])
    notes = [t for ax in fig.axes for t in ax.texts if t.get_gid() == "through_curve"]
    assert len(notes) == 1 and "claimed curve" in notes[0].get_text()
    assert any("refuted through the claimed privacy curve" in t.get_text() and "ln R" in t.get_text()
               for t in fig.texts if t.get_gid() == "caption")
    figures.plt.close(fig)
    clean = figures.build("audit", audits[audits.optimizer == "dpsgd"])
    assert not [t for t in clean.texts if t.get_gid() == "caption"]
    figures.plt.close(clean)
