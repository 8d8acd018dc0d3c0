"""Private hyperparameter tuning (Papernot & Steinke, ICLR 2022, arXiv:2110.03620): the accountant
against the paper's closed forms (Theorem 2, truncated negative binomial incl. geometric;
Theorem 6, Poisson) computed here from the project's own RDP of the candidate, against
composition in the same RDP accountant, sigma calibration, the reproducible draw of K and the
candidates, the grid's expansion of a `tuning` block, and a tiny config run to its figure."""

import json
import math
import subprocess

import numpy as np
import pandas as pd
import pytest
import yaml

from dpbench.pipeline.grid import ConfigError, expand, validate
from dpbench.privacy import accounting
from dpbench.privacy import tuning as t

ORDERS = accounting.RDP_INTEGER_ORDERS
SETUP2 = [(1.0, 32 / 59_000, 1844)]  # DP-SGD, Setup 2 (P2, L = 32, one epoch; 1000 examples held out)


def candidate_rdp(history):
    """RDP of one candidate at ORDERS from the project's closed form (Mironov et al. 2019), not
    from dp_accounting."""
    sigma, q, n = (np.array(c, dtype=float) for c in zip(*history))
    return (accounting.rdp_subsampled_gaussian(q, sigma, ORDERS) * n[:, None]).sum(0)


def monotone(rdp):
    """RDP is non-decreasing in the order: each order may use the bound of any larger one."""
    return np.minimum.accumulate(np.asarray(rdp)[::-1])[::-1]


def theorem2(rdp, mean, eta):
    """Papernot & Steinke Thm. 2: eps'(lam) = eps(lam) + (1 + eta)(1 - 1/lamhat) eps(lamhat)
    + (1 + eta) log(1/gamma) / lamhat + log(E[K]) / (lam - 1), best lamhat among the orders."""
    a = np.asarray(ORDERS, dtype=float)
    gamma = t.negative_binomial_gamma(mean, eta)
    c = (1 + eta) * np.min((1 - 1 / a) * rdp + math.log(1 / gamma) / a)
    return monotone(rdp + c + math.log(mean) / (a - 1))


def delta_from_rdp(rdp, epsilon):
    """delta(epsilon) of a mechanism from its RDP curve (Canonne, Kamath & Steinke 2020, Prop. 12,
    and delta <= sqrt(1 - exp(-KL)) at small orders)."""
    a = np.asarray(ORDERS, dtype=float)
    log_delta = np.minimum((a - 1) * (rdp - epsilon + np.log1p(-1 / a)) - np.log(a), 0.5 * np.log1p(-np.exp(-rdp)))
    return float(np.exp(log_delta.min()))


def theorem6(rdp, mean):
    """Papernot & Steinke Thm. 6 (Poisson): eps'(lam) = eps(lam) + mu delta_hat + log(mu) / (lam - 1),
    delta_hat the candidate's delta at eps_hat = log(1 + 1 / (lam - 1))."""
    a = np.asarray(ORDERS, dtype=float)
    delta_hat = np.array([delta_from_rdp(rdp, math.log1p(1 / (x - 1))) for x in a])
    return rdp + mean * delta_hat + math.log(mean) / (a - 1)


def accountant_epsilon(event, delta=accounting.DELTA):
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(orders=list(ORDERS))
    acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("history", [SETUP2, [(8.0, 1.0, 1)], [(0.8, 0.01, 500)]], ids=["setup2", "gaussian", "q0.01"])
@pytest.mark.parametrize("mean,eta", [(3, 1.0), (10, 1.0), (10, 0.5), (30, 2.0)])
def test_negative_binomial_is_theorem_2(history, mean, eta):
    closed = accounting.rdp_to_epsilon(theorem2(candidate_rdp(history), mean, eta), accounting.DELTA, ORDERS)
    event = t.procedure_event(history, t.Tuning("negative_binomial", mean, eta))
    assert accountant_epsilon(event) == pytest.approx(closed, rel=1e-6)
    # at the project's orders (fractional ones too) the accountant can only be tighter
    assert t.procedure_epsilon(history, t.Tuning("negative_binomial", mean, eta)) <= closed * (1 + 1e-9)


@pytest.mark.parametrize("history", [SETUP2, [(8.0, 1.0, 1)]], ids=["setup2", "gaussian"])
@pytest.mark.parametrize("mean", [3, 10, 30])
def test_poisson_is_theorem_6(history, mean):
    closed = accounting.rdp_to_epsilon(theorem6(candidate_rdp(history), mean), accounting.DELTA, ORDERS)
    event = t.procedure_event(history, t.Tuning("poisson", mean))
    assert accountant_epsilon(event) == pytest.approx(closed, rel=1e-6)


def test_a_search_costs_at_least_one_candidate_and_grows_with_its_mean():
    one = t.rdp_epsilon(t.candidate_event(SETUP2))
    assert one == pytest.approx(accounting.epsilon(SETUP2, accountant="rdp"), rel=1e-3)  # Opacus's RDP, same orders
    for distribution in ("negative_binomial", "poisson"):
        eps = [t.procedure_epsilon(SETUP2, t.Tuning(distribution, m)) for m in (2, 5, 20)]
        assert one < eps[0] < eps[1] < eps[2]


@pytest.mark.parametrize("mean", [10, 30, 100])
def test_private_tuning_costs_less_than_composing_its_mean_number_of_gaussian_candidates(mean):
    """A Gaussian release (a matrix mechanism's candidate, eps ~ 0.4 alone): in the same RDP
    accountant, a geometric number of candidates with mean m costs less than m candidates
    composed, and the gap widens with m (log m against sqrt m)."""
    gaussian = [(10.0, 1.0, 1)]
    private = t.procedure_epsilon(gaussian, t.Tuning("negative_binomial", mean, 1.0))
    composed = t.rdp_epsilon(t.procedure_event(gaussian, t.Tuning("composition", mean)))
    assert private < composed
    assert private < 0.5 * composed if mean >= 30 else True


def test_dpsgd_at_setup2_is_cheaper_composed_than_repeated_at_random():
    """DP-SGD at q = 32 / N for one epoch has an RDP curve so flat that k candidates composed
    cost less than a random number with mean k (the docs say so): the reverse of the Gaussian's
    case, in the same RDP accountant, and more so with the PRV accountant of a composition."""
    for mean in (3, 10):
        for how in (t.Tuning("negative_binomial", mean, 1.0), t.Tuning("poisson", mean)):
            private = t.procedure_epsilon(SETUP2, how)
            composed_rdp = t.rdp_epsilon(t.procedure_event(SETUP2, t.Tuning("composition", mean)))
            composed = t.procedure_epsilon(SETUP2, t.Tuning("composition", mean))  # PRV
            assert composed < composed_rdp < private


def test_candidate_sigma_is_the_smallest_meeting_the_total_target():
    for how in (t.Tuning("negative_binomial", 5, 1.0), t.Tuning("poisson", 5), t.Tuning("composition", 4)):
        def history_of(s):
            return [(s, 0.02, 100)]

        sigma = t.candidate_noise_multiplier(history_of, how, 2.0, accountant="rdp")
        assert t.procedure_epsilon(history_of(sigma), how, accountant="rdp") <= 2.0
        assert t.procedure_epsilon(history_of(sigma * (1 - 2e-3)), how, accountant="rdp") > 2.0
        single = accounting.noise_multiplier_for(2.0, 0.02, 100, accountant="rdp")
        assert sigma > single  # the search costs more than one run


def test_gamma_matches_dp_accounting_and_the_mean():
    from dp_accounting.rdp.rdp_privacy_accountant import _gamma_truncated_negative_binomial

    for mean, eta in ((3, 1.0), (10, 0.5), (4, 2.0), (30, 3.0)):
        gamma = t.negative_binomial_gamma(mean, eta)
        assert gamma == pytest.approx(_gamma_truncated_negative_binomial(eta, mean), rel=1e-7)
        assert eta * (1 - gamma) / (gamma * (1 - gamma ** eta)) == pytest.approx(mean, rel=1e-9)


@pytest.mark.parametrize("how", [t.Tuning("negative_binomial", 3, 1.0), t.Tuning("negative_binomial", 5, 2.0),
                                 t.Tuning("poisson", 4)])
def test_the_number_of_candidates_has_the_stated_distribution(how):
    ks = np.array([len(t.draw_candidates(how, seed, 4)) for seed in range(3000)])
    assert abs(ks.mean() - how.mean) < 4 * ks.std() / math.sqrt(len(ks))
    if how.distribution == "negative_binomial":
        assert ks.min() >= 1
        if how.shape == 1:  # geometric on {1, 2, ...}: P[K = 1] = gamma = 1 / mean
            assert abs((ks == 1).mean() - 1 / how.mean) < 4 * math.sqrt(0.25 / len(ks))
    else:
        assert (ks == 0).mean() == pytest.approx(math.exp(-how.mean), abs=0.02)


def test_candidates_are_reproducible_from_the_seed_and_have_their_own_seeds():
    how = t.Tuning("negative_binomial", 10, 1.0)
    a, b = t.draw_candidates(how, 1234, 5), t.draw_candidates(how, 1234, 5)
    assert a == b and len({seed for _, seed in a}) == len(a)
    assert t.draw_candidates(how, 1235, 5) != a
    # candidate j does not depend on K: a Poisson search of the same seed shares its prefix
    other = t.draw_candidates(t.Tuning("poisson", 10), 1234, 5)
    n = min(len(a), len(other))
    assert a[:n] == other[:n]
    assert t.draw_candidates(t.Tuning("composition", 3), 1234, 3)[1][0] == 1  # each setting once, in order


def _config(**tuning):
    return {"root_seed": 7, "train": {"validation_size": 100},
            "grid": [{"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [1, 10], "seeds": 2,
                      "optimizers": {"dpsgd": {"lr": [0.1, 0.5, 1.0]}, "sgd": {"lr": [0.1, 0.3]}},
                      "tuning": tuning}]}


def test_a_tuning_block_expands_into_the_drawn_candidates():
    from dpbench.pipeline.grid import seeds_from_root

    cells = expand(validate(_config(distribution="negative_binomial", mean=3)))
    tuned = [c for c in cells if c.optimizer == "dpsgd"]
    assert len([c for c in cells if c.optimizer == "sgd"]) == 4  # non-private: every rate, no search
    for s, seed in enumerate(seeds_from_root(7, 2)):
        drawn = t.draw_candidates(t.Tuning("negative_binomial", 3), seed, 3)
        for eps in (1.0, 10.0):
            mine = sorted((c for c in tuned if c.seed_index == s and c.epsilon == eps),
                          key=lambda c: dict(c.tuning)["candidate"])
            assert [(c.lr, c.seed) for c in mine] == [((0.1, 0.5, 1.0)[i], cs) for i, cs in drawn]
            assert all(dict(c.tuning)["repetitions"] == len(drawn) for c in mine)
    args = tuned[0].train_args({})
    assert args[args.index("--tuning") + 1].startswith('{"candidate": ')
    assert "-tunenb3x1-k" in tuned[0].id
    composed = [c for c in expand(validate(_config(distribution="composition"))) if c.optimizer == "dpsgd"]
    assert len(composed) == 3 * 2 * 2 and {c.lr for c in composed} == {0.1, 0.5, 1.0}


@pytest.mark.parametrize("change,message", [
    (lambda c: c["train"].pop("validation_size"), "grid.0.tuning: a search releases the candidate best on the validation split"),
    (lambda c: c["grid"][0]["tuning"].update(distribution="composition", mean=5), "grid.0.tuning.mean: composition runs each of the 3"),
    (lambda c: c["grid"][0]["tuning"].pop("mean"), "grid.0.tuning.mean: a negative_binomial search needs the mean"),
    (lambda c: c["grid"][0]["tuning"].update(shape=0), "grid.0.tuning.shape"),
])
def test_bad_tuning_settings_name_the_key(change, message):
    config = _config(distribution="negative_binomial", mean=3)
    change(config)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(config)


def test_the_figure_releases_the_candidate_best_on_validation():
    from dpbench.reporting.figures.tuning import tuning_data, tuning_table

    def row(run_id, lr, val, test, distribution="", total=math.nan, sigma=1.0):
        return {"run_id": run_id, "problem": "P2", "task": "classification", "optimizer": "dpsgd", "private": True,
                "lr": lr, "batch_size": 32, "epochs": 1, "target_epsilon": 1.0, "epsilon": 0.9, "delta": 1e-5,
                "noise_multiplier": sigma, "status": "completed", "best_test_accuracy": test, "best_test_loss": 1.0,
                "best_val_accuracy": val, "test_accuracy_at_best_val": test, "tuning_distribution": distribution,
                "tuning_epsilon": total, "hyperparameters": "{}"}

    runs = pd.DataFrame([row("a-lr0.1-s0", 0.1, 0.6, 0.61), row("a-lr1-s0", 1.0, 0.7, 0.69),
                         row("c-c0-s0", 0.1, 0.5, 0.52, "composition", 0.98, 2.0),
                         row("c-c1-s0", 1.0, 0.55, 0.50, "composition", 0.98, 2.0),
                         row("p-c0-s0", 1.0, 0.4, 0.45, "negative_binomial", 0.99, 3.0)])
    d = tuning_data(runs, "P2").set_index("procedure")
    assert d.loc["untuned", "value"] == 0.69 and d.loc["untuned", "total_epsilon"] == 0.9
    assert d.loc["composition", "value"] == 0.50 and d.loc["composition", "total_epsilon"] == 0.98  # val (test: 0.52)
    assert d.loc["private", "value"] == 0.45 and d.loc["private", "repetitions"] == 1
    assert "| 1 | private | DP-SGD | 0.4500 | 1 | 1 | 1 | 3 | 0.99 | 1e-05 | 1 |" in tuning_table(runs, "P2")


def test_a_sigma_given_search_is_shown_under_its_accounted_epsilon():
    """A search given sigma (no target) is shown at the epsilon the whole search was accounted
    to spend, beside a calibrated one at its target; alone, it is still drawn (before: dropped
    beside a calibrated search, `error: optimizer` alone)."""
    from dpbench.reporting.figures.tuning import tuning_data, tuning_figure, tuning_table

    def row(run_id, val, test, target, total, distribution="negative_binomial"):
        return {"run_id": run_id, "problem": "P2", "task": "classification", "optimizer": "dpsgd", "private": True,
                "lr": 0.1, "batch_size": 32, "epochs": 1, "target_epsilon": target, "epsilon": 0.5, "delta": 1e-5,
                "noise_multiplier": 2.0, "status": "completed", "best_test_accuracy": test, "best_test_loss": 1.0,
                "best_val_accuracy": val, "test_accuracy_at_best_val": test, "tuning_distribution": distribution,
                "tuning_epsilon": total, "hyperparameters": "{}"}

    given = [row("g-c0-s0", 0.5, 0.51, math.nan, 2.5), row("g-c1-s0", 0.6, 0.62, math.nan, 2.5)]
    calibrated = [row("t-c0-s0", 0.4, 0.41, 1.0, 0.99)]
    d = tuning_data(pd.DataFrame(given + calibrated), "P2").set_index("epsilon")
    assert sorted(d.index) == [1.0, 2.5]
    assert d.loc[2.5, "value"] == 0.62 and d.loc[2.5, "total_epsilon"] == 2.5 and d.loc[2.5, "repetitions"] == 2
    assert d.loc[1.0, "value"] == 0.41 and d.loc[1.0, "total_epsilon"] == 0.99
    alone = pd.DataFrame(given)
    assert tuning_data(alone, "P2")["epsilon"].tolist() == [2.5]
    assert "| 2.5 |" in tuning_table(alone, "P2")
    fig = tuning_figure(alone, "P2")
    assert any("2.5" in ax.get_title() for ax in fig.axes)


def test_the_table_gives_intervals_over_seed_indices_and_marks_ties():
    from dpbench.reporting.figures.tuning import tuning_data, tuning_figure, tuning_table

    def row(opt, seed, test, lr=0.1):
        return {"run_id": f"{opt}-lr{lr:g}-s{seed}", "problem": "P2", "task": "classification", "optimizer": opt,
                "private": True, "lr": lr, "batch_size": 32, "epochs": 1, "target_epsilon": 1.0, "epsilon": 0.9,
                "delta": 1e-5, "noise_multiplier": 1.0, "status": "completed", "best_test_accuracy": test,
                "best_test_loss": 1.0, "best_val_accuracy": test, "test_accuracy_at_best_val": test,
                "tuning_distribution": "", "tuning_epsilon": math.nan, "hyperparameters": "{}"}

    # DP-SGD 0.60, 0.62 (mean 0.61, half-width 12.7062 x 0.0141421 / 1.41421 = 0.127062) overlaps
    # BandMF 0.50, 0.52 (0.51 +- 0.127062); DP-Adam-BC 0.10, 0.12 does not overlap BandMF
    runs = pd.DataFrame([row(o, s, v) for o, values in (("dpsgd", (0.60, 0.62)), ("dpmatrix-band", (0.50, 0.52)),
                                                         ("dpadambc", (0.10, 0.12)))
                         for s, v in enumerate(values)])
    d = tuning_data(runs, "P2").set_index("optimizer")
    assert d.loc["dpsgd", "value"] == pytest.approx(0.61) and d.loc["dpsgd", "searches"] == 2
    assert d.loc["dpsgd", "ci_high"] == pytest.approx(0.61 + 0.127062)
    assert d["rank"].to_dict() == {"dpsgd": 1, "dpmatrix-band": 2, "dpadambc": 3}
    assert d["tied"].to_dict() == {"dpsgd": False, "dpmatrix-band": True, "dpadambc": False}
    table = tuning_table(runs, "P2")
    assert "| 1 | untuned | BandMF | 0.5100 ± 0.1271 | = 2 | 2 |" in table and "Mean over 2 seed indices" in table
    assert "| 1 | untuned | DP-AdamBC | 0.1100 ± 0.1271 | 3 | 2 |" in table
    fig = tuning_figure(runs, "P2")
    from matplotlib.collections import LineCollection
    bars = [c for ax in fig.axes for c in ax.get_children() if c.get_gid() == "interval" and isinstance(c, LineCollection)]
    assert len(bars) == 3  # one interval per optimizer (untuned only here)
    assert "Mean over 2 seed indices" in next(t.get_text() for t in fig.texts if t.get_gid() == "caption")
    one = tuning_table(runs[runs["run_id"].str.endswith("-s0")], "P2")
    assert "One seed index" in one and "±" not in one and "= " not in one.split("|---")[-1]


@pytest.mark.slow
@pytest.mark.realdata
def test_a_tiny_tuning_config_runs_to_its_figure(tmp_path, repo_copy, fmnist_dir):
    """A grid with a private search (geometric, mean 2), a composed one and an untuned block
    through the workflow to the figure and its table, each candidate's run file recording the
    search and its total epsilon."""
    from conftest import snakemake_exe, tree_env
    from dpbench.reporting.results import read_meta

    block = {"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [2], "seeds": [0],
             "optimizers": {"dpsgd": {"lr": [0.1, 0.5]}}}
    config = {"data_dir": str(fmnist_dir), "results_dir": str(tmp_path / "out"),
              "train": {"accountant": "rdp", "max_steps": 2, "train_subset": 500, "test_subset": 100,
                        "validation_size": 100},
              "figures": {"tuning": {}, "tuning_table": {}},
              "grid": [block, {**block, "tuning": {"distribution": "negative_binomial", "mean": 2}},
                       {**block, "tuning": {"distribution": "composition"}}]}
    (tmp_path / "tuning.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([snakemake_exe(), "--profile", repo_copy / "workflow" / "profiles" / "default",
                           "--configfile", tmp_path / "tuning.yaml"], cwd=repo_copy, capture_output=True, text=True,
                          timeout=900, env=tree_env(repo_copy))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "figures" / "tuning.png").stat().st_size > 10_000
    table = (out / "figures" / "tuning_table.md").read_text()
    assert "| 2 | composition | DP-SGD |" in table and "| 2 | private | DP-SGD |" in table
    candidates = sorted((out / "runs" / "P2" / "dpsgd").glob("*-tune*.parquet"))
    assert candidates
    for path in candidates:
        privacy = read_meta(path)["privacy"]
        assert privacy["noise_multiplier_source"] == "calibrated for the whole search"
        assert privacy["tuning"]["epsilon"] <= 2.0 and privacy["tuning"]["epsilon"] > 1.99
        assert privacy["epsilon"] < 2.0  # one candidate spends less than the search


def test_a_candidate_of_dpdice_strict_is_accounted_without_amplification():
    """dpdice-strict's mechanism accounts T Gaussian steps without amplification: a private
    search over it composes candidates of that event (q = 1), not DP-SGD's amplified one (which
    its mechanism inherited before it defined its own ``history``: a sigma far too small)."""
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers import get_optimizer
    from dpbench.training.tuning import candidate_history

    spec = get_optimizer("dpdice-strict")
    plan = spec.mechanism.plan(PlanRequest(1000, 50, 2))
    history_of, fail = candidate_history(spec, plan)
    assert history_of(3.0) == [(3.0, 1.0, 40)] and fail == 0.0


# -- a search's epsilon is the search's (the config and a run refuse the same things) -----------


def _run_config(optimizer="dpsgd", validation_size=100, **tuning):
    from dpbench.training.config import RunConfig

    return RunConfig("P2", optimizer, 0.5, 100, 1, 0, epsilon=1.0, validation_size=validation_size,
                     tuning={"distribution": "negative_binomial", "mean": 3, "repetitions": 2, "candidate": 0,
                             **tuning})


@pytest.mark.parametrize("config_change,run,words", [
    (lambda c: c["train"].pop("validation_size"), _run_config(validation_size=0),
     "a search releases the candidate best on the validation split, and there is none"),
    (lambda c: c["grid"][0]["tuning"].update(distribution="poisson", shape=2), _run_config(distribution="poisson", shape=2),
     "shape is the negative binomial's eta; a poisson search takes none"),
    (lambda c: c["grid"][0].update(optimizers={"dpdice": {"lr": [0.1, 0.5]}}), _run_config("dpdice"),
     "optimizer 'dpdice' has no valid privacy claim (not a valid DP guarantee"),
    (lambda c: c["grid"][0]["tuning"].update(distribution="poisson", mean=1e6), _run_config(distribution="poisson", mean=1e6),
     "tuning mean 1e+06 is above 100 candidates"),
    (lambda c: c["grid"][0]["tuning"].update(mean=2, shape=1e-9), _run_config(mean=2, shape=1e-9),
     "tuning shape 1e-09 with mean 2: the negative binomial draws K = 0"),
])
def test_the_config_and_a_run_refuse_the_same_searches_in_the_same_words(config_change, run, words):
    """Each refusal once, in dpbench.training.tuning.check_search: the config check names the
    key, the run (``dpbench train --tuning``, RunConfig.validate) says ``tuning:``; the words
    after are the same. Poisson with mean 1e6 and the negative binomial with shape 1e-9 are
    refused at once (they hung in the draw of K)."""
    from dpbench.optimizers import get_optimizer

    config = _config(distribution="negative_binomial", mean=3)
    config_change(config)
    with pytest.raises(ConfigError) as by_config:
        validate(config)
    with pytest.raises(ValueError) as by_run:
        run.validate(get_optimizer(run.optimizer))
    assert str(by_config.value).startswith("config key grid.0.tuning: " + words)
    assert str(by_run.value).startswith("tuning: " + words)
    assert str(by_config.value).split("tuning: ", 1)[1] == str(by_run.value).split("tuning: ", 1)[1]


def test_a_composition_is_calibrated_for_the_k_it_records():
    """``--tuning`` with composition, mean 1 and repetitions 3 calibrated sigma for k = 1 while
    recording K = 3: refused; a composition of k calibrates for k runs composed."""
    from dpbench.optimizers import get_optimizer

    with pytest.raises(ValueError, match=r"tuning: a composition runs each of its 1 settings once, not 3"):
        _run_config(distribution="composition", mean=1, repetitions=3).validate(get_optimizer("dpsgd"))
    _run_config(distribution="composition", mean=3, repetitions=3, candidate=2).validate(get_optimizer("dpsgd"))


def test_draws_are_bounded():
    """K above the cap is refused, not drawn; no redraw loop runs without end."""
    with pytest.raises(ValueError, match=r"above 100 candidates"):
        t.Tuning("poisson", 1e6)
    rng = np.random.default_rng(0)
    k = t.draw_repetitions(t.Tuning("negative_binomial", 100, 0.01), rng)  # heavy tail: some K are large
    assert 1 <= k <= t.MAX_REPETITIONS
    ks = [t.draw_repetitions(t.Tuning("poisson", 100), np.random.default_rng(s)) for s in range(50)]
    assert max(ks) < t.MAX_REPETITIONS and abs(np.mean(ks) - 100) < 10
    t.MAX_REPETITIONS, cap = 50, t.MAX_REPETITIONS
    try:
        with pytest.raises(ValueError, match=r"drew K = \d+ candidates, above the cap of 50"):
            t.draw_repetitions(t.Tuning("poisson", 100), np.random.default_rng(0))
    finally:
        t.MAX_REPETITIONS = cap


def test_a_search_never_costs_less_than_its_candidate():
    """The search's epsilon is refused below its candidate's own planned epsilon: dpdice-strict's
    T unamplified Gaussian releases accounted as DP-SGD's amplified steps gave a search epsilon
    of about 1 for a candidate of about 1.47 (issue 30). Its mechanism now accounts its own
    history (T Gaussian releases, q = 1), so the search composes that event and costs at least
    its candidate; the check catches the old undercount itself, numbers given; a DP-SGD search of
    one candidate composed costs exactly its candidate."""
    from dpbench.mechanisms.base import PlanRequest, PrivacyClaim
    from dpbench.optimizers import get_optimizer
    from dpbench.training import tuning as tt

    strict, dpsgd = get_optimizer("dpdice-strict"), get_optimizer("dpsgd")
    plan = strict.mechanism.plan(PlanRequest(5000, 250, 2, hyperparameters={}, target_epsilon=1.0, delta=1e-5))
    amplified = [(2.0, plan.sample_rate, plan.steps)]  # what the search accounted: DP-SGD's history at sigma 2
    search_eps = t.procedure_epsilon(amplified, t.Tuning("composition", 1))
    claim = PrivacyClaim(strict.mechanism, plan, 2.0, 1e-5, "prv")
    own = claim.spent().epsilon_planned
    assert own > 2 * search_eps  # 40 unamplified releases at sigma 2 cost far more than subsampled ones
    with pytest.raises(ValueError, match=r"the search's epsilon .* is below its candidate's own"):
        tt.check_not_below_candidate(strict, claim, search_eps)
    assert tt.search_refusal(strict) is None and tt.search_refusal(dpsgd) is None
    history_of, _ = tt.candidate_history(strict, plan)
    assert history_of(2.0) == [(2.0, 1.0, plan.steps)]  # its own event: no amplification
    own_search = t.procedure_epsilon(history_of(2.0), t.Tuning("composition", 1))
    assert own_search >= own * (1 - 1e-6)  # RDP's bound: never below the candidate's own (PRV) epsilon
    tt.check_not_below_candidate(strict, claim, own_search)
    dpsgd_claim = PrivacyClaim(dpsgd.mechanism, plan, 2.0, 1e-5, "prv")
    record = tt.record(dpsgd, dpsgd_claim, {"distribution": "composition", "mean": 1, "repetitions": 1,
                                            "candidate": 0})
    assert record["epsilon"] == pytest.approx(dpsgd_claim.epsilon(), rel=1e-12)
    assert record["accountant"] == "prv (k runs composed)" and record["delta"] == 1e-5


def test_the_table_of_runs_named_without_a_seed_index():
    """``dpbench plot tuning_table`` on runs whose id has no -s<i> failed with a KeyError: each
    run's seed stands for its seed index."""
    from dpbench.reporting.figures.tuning import tuning_table

    row = {"problem": "P2", "task": "classification", "optimizer": "dpsgd", "private": True, "lr": 0.1,
           "batch_size": 32, "epochs": 1, "target_epsilon": 1.0, "epsilon": 0.9, "delta": 1e-5, "noise_multiplier": 1.0,
           "status": "completed", "best_test_accuracy": 0.5, "best_test_loss": 1.0, "best_val_accuracy": 0.5,
           "test_accuracy_at_best_val": 0.5, "tuning_distribution": "", "tuning_epsilon": math.nan,
           "hyperparameters": "{}"}
    runs = pd.DataFrame([{**row, "run_id": "mine", "seed": 1}, {**row, "run_id": "other", "seed": 2,
                                                                 "test_accuracy_at_best_val": 0.7}])
    table = tuning_table(runs, "P2")
    assert "| 1 | untuned | DP-SGD | 0.6000 ± " in table and "Mean over 2 seed indices" in table


def test_the_tuning_figure_table_and_docs_say_what_the_search_protects():
    """The selection score (best_val_*) is computed without noise: the validation records are
    not covered, nor is publishing every candidate (the runs table keeps them); the figure's and
    the table's captions, the report's captions and docs/privacy.md say so."""
    from conftest import REPO
    from dpbench.reporting.figures.tuning import PROTECTS, tuning_figure, tuning_table

    row = {"run_id": "a-s0", "problem": "P2", "task": "classification", "optimizer": "dpsgd", "private": True,
           "lr": 0.1, "batch_size": 32, "epochs": 1, "target_epsilon": 1.0, "epsilon": 0.9, "delta": 1e-5,
           "noise_multiplier": 1.0, "status": "completed", "best_test_accuracy": 0.5, "best_test_loss": 1.0,
           "best_val_accuracy": 0.5, "test_accuracy_at_best_val": 0.5, "tuning_distribution": "",
           "tuning_epsilon": math.nan, "hyperparameters": "{}"}
    runs = pd.DataFrame([row])
    for words in ("selection score", "not private", "validation records are not protected",
                  "the runs table keeps them all", "chosen candidate"):
        assert words in PROTECTS
    assert PROTECTS in tuning_table(runs, "P2")
    fig = tuning_figure(runs, "P2")
    assert PROTECTS in next(x.get_text() for x in fig.texts if x.get_gid() == "caption")
    for caption in ("tuning", "tuning_table"):
        text = " ".join((REPO / "workflow" / "report" / f"{caption}.rst").read_text().split())
        assert "the validation records are not protected" in text and "outside the guarantee" in text
    privacy = " ".join((REPO / "docs" / "privacy.md").read_text().split())
    assert "**What a search protects.**" in privacy and "not protected" in privacy
    assert "share their batches and, where two mechanisms draw their noise the same way, their noise" in privacy


# -- the candidates of a search share one accounted event ---------------------------------------


def _block(optimizer, **settings):
    config = _config(distribution="negative_binomial", mean=3)
    config["grid"][0]["optimizers"] = {optimizer: {"lr": [0.1, 0.5], **settings}}
    return config


@pytest.mark.parametrize("optimizer,name,values", [
    ("dpmatrix-band-amp", "bands", [2, 4]), ("dpmatrix-band", "bands", ["auto", 2]),
    ("dpmatrix-blt", "buffers", [2, 3]), ("dpmatrix-me-lambda", "tau", [2.0, 4.0]),
    ("d2p2sgd", "projection", ["srht", "gaussian"]),
])
def test_a_search_over_settings_with_different_privacy_events_is_refused(optimizer, name, values):
    """Papernot & Steinke bound the search by the pointwise maximum of the settings' RDP curves;
    each candidate is calibrated on its own, so settings that change the accounted event (BandMF's
    b: its sample rate and rounds) would undercount the search where the curves cross. Accepted
    before (candidates each calibrated on their own b)."""
    with pytest.raises(ConfigError) as refused:
        validate(_block(optimizer, **{name: values}))
    assert str(refused.value) == (f"config key grid.0.tuning: hyperparameter {name!r} changes the accounted privacy "
                                  "event (candidates must share one: sweep it across separate searches)")
    config = _block(optimizer, **{name: values})
    config["grid"][0].pop("tuning")
    assert len(expand(validate(config))) == 2 * 2 * 2 * 2  # without a search every setting is its own run
    config = _block(optimizer, **{name: values[1:]})  # one value: every candidate shares it
    assert {dict(c.hyperparameters).get(name, values[1]) for c in expand(validate(config))} == {values[1]}


@pytest.mark.parametrize("optimizer,settings", [
    ("dpsgd", {}), ("dpadam", {"beta2": [0.99, 0.999]}), ("d2p2sgd", {"projection_rate": [0.5, 0.7]}),
    ("dpdice-strict", {"c2": [0.5, 1.0]}), ("dpmatrix-band-amp", {"bands": [4]}),
])
def test_a_search_over_what_no_mechanism_reads_is_accepted(optimizer, settings):
    cells = expand(validate(_block(optimizer, **settings)))
    assert cells and all(dict(c.tuning)["repetitions"] >= 1 for c in cells)
    assert len({(c.lr, c.hyperparameters) for c in cells}) >= 1


def _other(name, default):
    """A valid value other than the default, for each kind of hyperparameter default."""
    if isinstance(default, bool):
        return not default
    return {None: 2, "auto": 2, "srht": "gaussian"}.get(default, default * 0.5 if isinstance(default, float) else 1)


def test_every_mechanism_declares_the_hyperparameters_its_plan_reads():
    """Each registered private optimizer: a hyperparameter outside the mechanism's declaration
    leaves its plan (or the factorization key, which fixes C and sens(C)) unchanged; each one in
    it changes them. A mechanism that read a new hyperparameter without declaring it fails here."""
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers import OPTIMIZERS
    from dpbench.training.tuning import event_hyperparameters

    checked = set()
    for name in sorted(OPTIMIZERS):
        spec = OPTIMIZERS[name]
        if not spec.private:
            continue
        mechanism, read = spec.mechanism, event_hyperparameters(spec.mechanism)
        assert read is not None, name
        assert set(read) <= set(spec.defaults), name

        def planned(hyper, mechanism=mechanism):
            request = PlanRequest(1000, 50, 1, hyperparameters=hyper, target_epsilon=1.0)
            return mechanism.key(request) if hasattr(mechanism, "key") else mechanism.plan(request)

        base = planned({})
        for hp, default in spec.defaults.items():
            changed = planned({hp: _other(hp, default)}) != base
            assert changed == (hp in read), (name, hp)
            checked.add((name, hp, changed))
    assert ("dpmatrix-band-amp", "bands", True) in checked and ("dpadam", "beta2", False) in checked
    assert ("d2p2sgd", "projection", True) in checked and ("d2p2sgd", "projection_rate", False) in checked


def test_a_mechanism_that_declares_nothing_shares_no_hyperparameter():
    """A plugin's mechanism that plans itself without declaring what it reads (one inheriting
    DP-SGD's declaration but planning otherwise, or one declaring nothing) is taken to read every
    hyperparameter: its searches sweep learning rates only. The run side sees one setting."""
    import dataclasses

    from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian
    from dpbench.optimizers import get_optimizer
    from dpbench.training import tuning as tt

    class Reads(PoissonSubsampledGaussian):
        def plan(self, request):
            return super().plan(request)

    class Declares(Reads):
        event_hyperparameters = ("beta1",)

    dpadam = get_optimizer("dpadam")
    plugin = dataclasses.replace(dpadam, mechanism=Reads())
    assert tt.event_hyperparameters(Reads()) is None and tt.event_hyperparameters(Declares()) == ("beta1",)
    assert tt.shared_event_refusal(dpadam, [{"beta2": 0.99}, {"beta2": 0.999}]) is None
    assert tt.shared_event_refusal(plugin, [{"beta2": 0.99}, {"beta2": 0.999}]) == (
        "hyperparameter 'beta2' may change the accounted privacy event: mechanism 'poisson-subsampled-gaussian' does "
        "not declare the hyperparameters it reads (event_hyperparameters), and candidates must share one: sweep it "
        "across separate searches")
    assert tt.shared_event_refusal(plugin, [{"beta2": 0.99}, {"beta2": 0.99}]) is None
    declared = dataclasses.replace(dpadam, mechanism=Declares())
    assert tt.shared_event_refusal(declared, [{"beta2": 0.99}, {"beta2": 0.999}]) is None
    assert "'beta1' changes" in tt.shared_event_refusal(declared, [{"beta1": 0.8}, {}])
    with pytest.raises(ValueError, match="hyperparameter 'beta2' may change"):
        tt.check_search({"distribution": "poisson", "mean": 2}, plugin, 100, [{"beta2": 0.99}, {"beta2": 0.9}])
    tt.check_search({"distribution": "poisson", "mean": 2}, plugin, 100)  # a run: one setting, nothing to compare


def test_a_candidate_is_one_typed_value_parsed_in_one_place():
    """A run's ``tuning`` is read by ``Candidate.parse`` alone: the run's flag, the cell id's
    part and the config check refuse a bad one in its words, and the id part names the search,
    K and j."""
    from dpbench.pipeline import searches
    from dpbench.privacy.tuning import Candidate
    from dpbench.training.settings import search_candidate
    from dpbench.training.tuning import search

    given = {"distribution": "negative_binomial", "mean": 3, "shape": 1.0, "repetitions": 4, "candidate": 2}
    candidate = Candidate.parse(given, drawn=True)
    assert candidate == Candidate(t.Tuning("negative_binomial", 3.0, 1.0), 4, 2)
    assert candidate.id_part == searches.id_part(tuple(sorted(given.items()))) == "-tunenb3x1-k4c2"
    assert search(given) == candidate.search
    assert Candidate.parse({"distribution": "poisson", "mean": 2}).repetitions is None  # a block's: not drawn
    for bad, words in (({**given, "k": 1}, "unknown key 'k'"), ({**given, "candidate": 4}, "got 4 of 4"),
                       ({**given, "distribution": "poisson"}, "a poisson search takes none"),
                       ({"distribution": "composition", "mean": 3, "repetitions": 2, "candidate": 0}, "not 2"),
                       ({"distribution": "poisson", "mean": 0.5, "repetitions": 1, "candidate": 0},
                        "finite number >= 1")):
        with pytest.raises(ValueError, match=words):
            Candidate.parse(bad)
        with pytest.raises(ValueError, match=words):
            search_candidate.parse(json.dumps(bad))
    with pytest.raises(ValueError, match="candidate must be an index below repetitions, got None of None"):
        Candidate.parse({"distribution": "poisson", "mean": 2}, drawn=True)  # a run's must be drawn
