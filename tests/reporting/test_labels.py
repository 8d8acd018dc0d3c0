"""Every figure shows a run under a privacy it achieved: under its target ε only where its achieved
ε meets it, under its achieved ε where it was given σ and no target, under ε = ∞ only where it is
not private; the language-model figures never pool runs of different σ or privacy."""

import math

import numpy as np
import pandas as pd
import pytest
from test_figures import SEEDS, _row, classification_runs, lm_runs

from dpbench.reporting import figures

# What `dpbench train --epsilon 1 --noise-multiplier 0.3` made before it was refused: target 1,
# achieved 25.6, and the best numbers of all (little noise).
OVER = {"target_epsilon": 1.0, "epsilon": 25.6, "noise_multiplier": 0.3, "private": False}
# The same σ given alone: no target, private at the ε it achieved.
ALONE = {"target_epsilon": np.nan, "epsilon": 25.6, "noise_multiplier": 0.3, "private": True}


def _classification(tag: str, overrides: dict, acc: float) -> list[dict]:
    rows = []
    for seed in SEEDS:
        row = _row("P1", "classification", "dpsgd", 1.0, 0.1, 512, 500, seed, acc, 1.5 - acc, "completed")
        rows.append({**row, **overrides, "run_id": f"P1/dpsgd/{tag}-s{seed}"})
    return rows


def test_thesis_figures_show_no_run_under_a_target_it_exceeded():
    base = classification_runs()
    runs = pd.concat([base, pd.DataFrame(_classification("over", OVER, 0.99) + _classification("alone", ALONE, 0.7))],
                     ignore_index=True)
    shown = lambda df: set(df["run_id"])  # noqa: E731
    # fig5_1 / fig5_2: ε = 1 is the runs that met it; the σ-given runs form their own group at
    # the ε they achieved, private, and are not the non-private reference (ε = ∞)
    best, expected = (figures.best_per_setting(r).set_index(["problem", "optimizer", "epsilon"]) for r in (runs, base))
    assert not any(r.startswith("P1/dpsgd/over") for r in shown(best))
    assert best.loc[("P1", "dpsgd", 1.0), "run_id"] == expected.loc[("P1", "dpsgd", 1.0), "run_id"]
    alone = best.loc[("P1", "dpsgd", 25.6)]
    assert alone["private"] and alone["run_id"].startswith("P1/dpsgd/alone") and alone["value"] == pytest.approx(0.7)
    assert ("P1", "dpsgd", np.inf) not in best.index
    # heatmaps and best settings at ε 1 and 10: the same cells as without those runs
    for build in (lambda r: figures.heatmap_data(r, "P1", y="batch_size"),
                  lambda r: figures.best_settings_data(r, "P1", epsilons=(1, 10))):
        pd.testing.assert_frame_equal(build(runs), build(base))
    settings = figures.best_settings_data(runs, "P1")  # every ε: the σ-given runs at theirs
    assert set(settings["epsilon"]) == {1.0, 10.0, 25.6}
    assert not any(r.startswith("P1/dpsgd/over") for r in shown(settings))
    # fig5_3: the over-target seeds are not pooled with the configuration calibrated to ε 1
    with_over = runs[~runs["run_id"].str.startswith("P1/dpsgd/alone")]
    pd.testing.assert_frame_equal(figures.seed_sensitivity_data(with_over), figures.seed_sensitivity_data(base))
    assert figures.privacy_epsilon(pd.DataFrame([OVER, ALONE, {"target_epsilon": 1.0, "epsilon": 0.99},
                                                 {"target_epsilon": np.nan, "epsilon": math.inf}])).tolist()[1:] \
        == [25.6, 1.0, math.inf]


def _lm(tag: str, overrides: dict, val: float, opt: str = "dpsgd", lr: float = 0.5) -> list[dict]:
    from dpbench.reporting.aggregate import memorisation_columns

    rows = []
    for seed in SEEDS:
        row = _row("P4", "language_model", opt, 1.0, lr, 256, 1, seed, np.nan, val, "completed")
        canaries = [{"repeats": k, "exposure": 30.0 if tag == "over" else 2.0, "extracted": False} for k in (0, 1, 5, 25)]
        rows.append({**row, "dataset": "lm", "best_val_loss": val + 0.01 * seed, "final_train_loss": val,
                     "val_perplexity": math.exp(val), **memorisation_columns({"canaries": canaries}), **overrides,
                     "run_id": f"P4/{opt}/{tag}-s{seed}"})
    return rows


def _lm_base() -> pd.DataFrame:
    base = lm_runs()
    sigma = {1.0: 0.8, 10.0: 0.4}
    return base.assign(noise_multiplier=[sigma.get(e, 0.0) for e in base["target_epsilon"]])


def test_lm_figures_show_no_run_under_a_target_it_exceeded():
    base = _lm_base()
    runs = pd.concat([base, pd.DataFrame(_lm("over", OVER, 2.0))], ignore_index=True)
    # lm_ranking: the over-target run would rank first at ε = 1 (perplexity exp(2)); it is not shown
    ranking, expected = figures.lm_ranking_data(runs), figures.lm_ranking_data(base)
    pd.testing.assert_frame_equal(ranking, expected)
    # lm_exposure, lm_loss: the same numbers as without it
    pd.testing.assert_frame_equal(figures.lm_exposure_data(runs), figures.lm_exposure_data(base))
    pd.testing.assert_frame_equal(figures.lm_loss_data(runs), figures.lm_loss_data(base))


def test_lm_figures_group_by_sigma_and_privacy():
    base = _lm_base()
    # σ = 0 (not private, no target) and σ given alone (private, no target), same settings: two
    # rows, each with its own runs and privacy, never one row whose privacy is the first run's
    noiseless = {"target_epsilon": np.nan, "epsilon": math.inf, "noise_multiplier": 0.0, "private": False}
    runs = pd.concat([base, pd.DataFrame(_lm("sigma0", noiseless, 3.2) + _lm("alone", ALONE, 3.6))],
                     ignore_index=True)
    ranking = figures.lm_ranking_data(runs).set_index(["epsilon", "optimizer"])
    off, on = ranking.loc[(math.inf, "dpsgd")], ranking.loc[(25.6, "dpsgd")]
    assert not off["private"] and off["val_perplexity"] == pytest.approx(np.mean(np.exp([3.2, 3.21, 3.22])))
    assert on["private"] and on["val_perplexity"] == pytest.approx(np.mean(np.exp([3.6, 3.61, 3.62])))
    assert off["n_seeds"] == on["n_seeds"] == 3
    loss = figures.lm_loss_data(runs).set_index(["optimizer", "epsilon", "split"])
    assert not loss.loc[("dpsgd", math.inf, "val"), "private"] and loss.loc[("dpsgd", 25.6, "val"), "private"]
    # two σ at one target (e.g. another validation split, so another N): two configurations,
    # the better one chosen, its seeds never pooled with the other's
    other = {"noise_multiplier": 0.9, "epsilon": 0.95}
    runs = pd.concat([base, pd.DataFrame(_lm("other-sigma", other, 3.9))], ignore_index=True)
    chosen = figures.lm_configurations(runs)
    at1 = chosen[(chosen["optimizer"] == "dpsgd") & (chosen["epsilon"] == 1.0)]
    assert len(at1) == 3 and set(at1["noise_multiplier"]) == {0.9}
    assert figures.lm_loss_data(runs).set_index(["optimizer", "epsilon", "split"]).loc[
        ("dpsgd", 1.0, "val"), "mean"] == pytest.approx(3.91)
    # drawing a private optimizer's σ = 0 row beside its private ones works (a dashed line)
    for figure_id in figures.LM_FIGURES:
        out = figures.build(figure_id, pd.concat([base, pd.DataFrame(_lm("sigma0", noiseless, 3.2))]))
        if not isinstance(out, str):
            figures.plt.close(out)


@pytest.mark.parametrize("edit", [{"epsilon": -1.0}, {"epsilon": np.nan}, {"delta": 1.0}, {"noise_multiplier": 0.0}])
def test_a_runs_table_edited_to_numbers_that_deny_privacy_draws_no_private_bar(tmp_path, edit):
    """A runs table edited after dpbench aggregate (ε = -1, δ = 1, δ NaN, σ = 0 beside a finite ε,
    the row still marked private at target 1, the best accuracy of all): fig5_1 shows it under no
    ε (it drew a DP-SGD bar at ε 1 from it), and dpbench plot reads it as not private."""
    base = classification_runs().assign(delta=1e-5, noise_multiplier=1.0)
    edited = {"target_epsilon": 1.0, "epsilon": 0.9, "delta": 1e-5, "noise_multiplier": 1.1, "private": True,
              "dp_guarantee": True, **edit}
    runs = pd.concat([base, pd.DataFrame(_classification("edited", edited, 0.99))], ignore_index=True)
    best = figures.best_per_setting(runs)
    assert not best["run_id"].str.startswith("P1/dpsgd/edited").any()
    pd.testing.assert_frame_equal(best, figures.best_per_setting(base))
    labelled = figures.supported_labels(runs).set_index("run_id")
    assert not labelled.filter(like="edited", axis=0)["private"].any()
    assert not labelled.filter(like="edited", axis=0)["dp_guarantee"].any()
    assert labelled.drop(labelled.filter(like="edited", axis=0).index)["private"].equals(
        base.set_index("run_id")["private"].astype(bool))
    runs.to_parquet(tmp_path / "runs.parquet")
    figures.plot("fig5_1", tmp_path / "runs.parquet", tmp_path / "fig")  # draws from the supported labels
    assert (tmp_path / "fig.png").exists()
