"""Figures of chapter 5 from synthetic aggregated tables whose best cells are known by construction."""

import itertools
import math
import statistics

import numpy as np
import pandas as pd
import pytest

from dpbench.reporting import figures
from dpbench.reporting.figures.spent import SHARED_SEEDS

LRS = [0.01, 0.1, 1.0]
SIZES = [256, 512]
EPOCHS = [250, 500]
SEEDS = [0, 1, 2]
OFFSET = {"dpsgd": 0.0, "dpadambc": -0.05, "dpdisk": -0.02}
# the best learning rate shifts with epsilon, as in the thesis
LR_TERM = {1.0: {0.01: 0.0, 0.1: 0.1, 1.0: 0.05}, 10.0: {0.01: 0.0, 0.1: 0.05, 1.0: 0.15}}


def accuracy(opt, eps, lr, size, epochs, seed):
    return (0.5 + OFFSET[opt] + (0.1 if eps == 10.0 else 0.0) + LR_TERM[eps][lr]
            + 0.02 * (size == 512) + 0.01 * (epochs == 500) + 0.01 * seed ** 2)


def diverged(opt, eps, lr, size, epochs, seed):
    # a whole cell (all epochs, all seeds) and a half cell (only E = 500)
    return opt == "dpsgd" and lr == 1.0 and size == 256 and (eps == 1.0 or epochs == 500)


def missing(opt, eps, lr, size, epochs, seed):
    return opt == "dpadambc" and lr == 1.0 and size == 512


def _row(problem, task, opt, eps, lr, size, epochs, seed, acc, loss, status):
    private = eps is not None
    return {"run_id": f"{problem}/{opt}/L{size}-E{epochs}-eps{eps}-lr{lr:g}-s{seed}", "problem": problem,
            "dataset": {"P1": "cifar10", "P2": "fashion-mnist", "P3": "fashion-mnist", "P4": "lm"}[problem],
            "task": task, "optimizer": opt, "private": private, "lr": lr, "batch_size": size, "epochs": epochs,
            "seed": seed, "hyperparameters": "{}", "target_epsilon": eps if private else np.nan,
            "epsilon": (eps * 0.99) if private else np.nan, "status": status,
            "best_test_accuracy": acc, "best_test_loss": loss, "final_test_accuracy": acc,
            "final_test_loss": loss, "best_epoch": 1.0,
            "best_val_accuracy": acc, "best_val_loss": loss,
            "test_accuracy_at_best_val": acc, "test_loss_at_best_val": loss}


def classification_runs():
    rows = []
    for opt, eps, lr, size, epochs, seed in itertools.product(["dpsgd", "dpadambc", "dpdisk"], [1.0, 10.0],
                                                               LRS, SIZES, EPOCHS, SEEDS):
        if missing(opt, eps, lr, size, epochs, seed) or (opt == "dpdisk" and seed > 0):
            continue
        if diverged(opt, eps, lr, size, epochs, seed):
            rows.append(_row("P1", "classification", opt, eps, lr, size, epochs, seed, np.nan, np.inf, "diverged"))
        else:
            acc = accuracy(opt, eps, lr, size, epochs, seed)
            rows.append(_row("P1", "classification", opt, eps, lr, size, epochs, seed, acc, 1.5 - acc, "completed"))
    for seed in SEEDS:  # a non-private reference
        rows.append(_row("P1", "classification", "sgd", None, 0.1, 256, 250, seed, 0.9, 0.3, "completed"))
    runs = pd.DataFrame(rows)
    # validation disagrees with test for one run: the worst learning rate looks best on validation
    trap = runs.run_id == "P1/dpsgd/L256-E250-eps1.0-lr0.01-s0"
    runs.loc[trap, "best_val_accuracy"] = 0.99
    runs.loc[trap, "test_accuracy_at_best_val"] = 0.45  # validation also picked a worse epoch
    return runs


VAE_LOSS = {  # (optimizer, eps, lr, batch size) -> best test loss; inf: diverged
    ("dpsgd", 1.0, 0.1, 1024): 320.0, ("dpsgd", 1.0, 1.0, 1024): 290.0, ("dpsgd", 1.0, 10.0, 1024): np.inf,
    ("dpsgd", 1.0, 0.1, 2048): 330.0, ("dpsgd", 1.0, 1.0, 2048): 300.0, ("dpsgd", 1.0, 10.0, 2048): 310.0,
    ("dpsgd", 10.0, 0.1, 1024): 280.0, ("dpsgd", 10.0, 1.0, 1024): 260.0, ("dpsgd", 10.0, 10.0, 1024): np.inf,
    ("dpsgd", 10.0, 0.1, 2048): 285.0, ("dpsgd", 10.0, 1.0, 2048): 265.0, ("dpsgd", 10.0, 10.0, 2048): np.inf,
    ("dpmatrix-me", 1.0, 0.1, 1024): 300.0, ("dpmatrix-me", 1.0, 1.0, 1024): 270.0,
    ("dpmatrix-me", 1.0, 0.1, 2048): 305.0, ("dpmatrix-me", 1.0, 1.0, 2048): 275.0,
    ("dpmatrix-me", 10.0, 0.1, 1024): 250.0, ("dpmatrix-me", 10.0, 1.0, 2048): 240.0,
}


def vae_runs():
    rows = []
    for (opt, eps, lr, size), loss in VAE_LOSS.items():
        status = "completed" if np.isfinite(loss) else "diverged"
        rows.append(_row("P3", "vae", opt, eps, lr, size, 30, 0, np.nan, loss, status))
        # a second, worse seed in every finite cell: the cell is the best over seeds
        if np.isfinite(loss):
            rows.append(_row("P3", "vae", opt, eps, lr, size, 30, 1, np.nan, loss + 7.0, "completed"))
    return pd.DataFrame(rows)


@pytest.fixture(scope="module")
def runs():
    return pd.concat([classification_runs(), vae_runs()], ignore_index=True)


def cell(df, **where):
    mask = np.ones(len(df), bool)
    for k, v in where.items():
        mask &= (df[k] == v).to_numpy()
    assert mask.sum() == 1, where
    return df[mask].iloc[0]


def test_heatmap_cells_are_the_best_configuration_by_its_mean_over_seeds(runs):
    """A cell is the mean over seeds of its best configuration (here: its best epochs), no longer
    its best single run; a configuration with a diverged seed is not chosen."""
    data = figures.heatmap_data(runs, "P1", y="batch_size")
    for (opt, eps, lr, size), c in data.set_index(["optimizer", "epsilon", "lr", "batch_size"]).iterrows():
        seeds = [0] if opt == "dpdisk" else SEEDS
        means = [statistics.mean(accuracy(opt, eps, lr, size, e, s) for s in seeds) for e in EPOCHS
                 if not any(diverged(opt, eps, lr, size, e, s) for s in seeds)]
        if means:
            assert c.value == pytest.approx(max(means)) and not c.diverged and c.n_seeds == len(seeds)
        else:
            assert math.isnan(c.value) and c.diverged
    seed_term = [0.01 * s ** 2 for s in SEEDS]  # 0, 0.01, 0.04
    half = 4.302652729749464 * statistics.stdev(seed_term) / math.sqrt(3)  # t_{0.975, 2} s / sqrt(3)
    # a literal: DP-SGD, eps 10, lr 1, L 512, E 500: 0.5 + 0.1 + 0.15 + 0.02 + 0.01, seeds 0.78, 0.79, 0.82
    c = cell(data, optimizer="dpsgd", epsilon=10.0, lr=1.0, batch_size=512)
    assert c.value == pytest.approx(0.78 + 0.05 / 3) and c.n_configs == 2
    assert (c.ci_low, c.ci_high) == (pytest.approx(0.78 + 0.05 / 3 - half), pytest.approx(0.78 + 0.05 / 3 + half))
    # half-diverged cell: E 500 diverged, so the E 250 configuration: 0.5 + 0.1 + 0.15 + its seeds' mean
    assert cell(data, optimizer="dpsgd", epsilon=10.0, lr=1.0, batch_size=256).value == pytest.approx(0.75 + 0.05 / 3)
    # DP-DiSK has one seed: its cells have no interval
    c = cell(data, optimizer="dpdisk", epsilon=10.0, lr=1.0, batch_size=512)
    assert c.n_seeds == 1 and c.ci_low == c.ci_high == c.value == pytest.approx(0.76) and not c.tied
    # missing cells are absent (drawn blank), not zero
    assert data[(data.optimizer == "dpadambc") & (data.lr == 1.0) & (data.batch_size == 512)].empty
    assert len(data) == 3 * 2 * len(LRS) * len(SIZES) - 2  # 3 optimizers, 2 eps; 2 missing cells
    assert (data.n_runs[data.optimizer == "dpsgd"] == len(EPOCHS) * len(SEEDS)).all()


def test_red_box_on_the_argmax_black_boxes_on_diverged_cells(runs):
    data = figures.heatmap_data(runs, "P1", y="epochs")
    best = data[data.is_best].set_index(["optimizer", "epsilon"])
    assert len(best) == 6  # one per panel
    assert best.loc[("dpsgd", 1.0), ["lr", "epochs"]].tolist() == [0.1, 500]
    assert best.loc[("dpsgd", 10.0), ["lr", "epochs"]].tolist() == [1.0, 500]  # L 512 (L 256 diverged at E 500)
    assert best.loc[("dpadambc", 10.0), ["lr", "epochs"]].tolist() == [1.0, 500]
    for _, panel in data.groupby(["optimizer", "epsilon"]):
        assert panel.value.max() == panel[panel.is_best].value.iloc[0]
    # lr x epochs: no cell of DP-SGD at eps 1, lr 1 is all-diverged (L 512 ran fine)
    assert not data.diverged.any()

    fig = figures.heatmap_figure(runs, "P1", ys=("batch_size",))
    boxes = _boxes(fig)
    assert boxes["best"] == {("DP-SGD · ε = 1", "0.1", "512"), ("DP-SGD · ε = 10", "1", "512"),
                             ("DP-AdamBC · ε = 1", "0.1", "512"), ("DP-AdamBC · ε = 10", "1", "256"),
                             ("DP-DiSK · ε = 1", "0.1", "512"), ("DP-DiSK · ε = 10", "1", "512")}
    assert boxes["diverged"] == {("DP-SGD · ε = 1", "1", "256")}
    figures.plt.close(fig)


def _boxes(fig):
    """{'best': {(panel title, x tick, y tick)}, 'diverged': {...}, 'tied': {...}} of the drawn rectangles."""
    out = {"best": set(), "diverged": set(), "tied": set()}
    for ax in fig.axes:
        xt = [t.get_text() for t in ax.get_xticklabels()]
        yt = [t.get_text() for t in ax.get_yticklabels()]
        for p in ax.patches:
            if p.get_gid() in out:
                j, i = p.get_xy()
                out[p.get_gid()].add((ax.get_title(), xt[int(j)], yt[int(i)]))
    return out


def test_vae_heatmap_log_loss_lowest_is_best_and_diverged_cells_boxed_black(runs):
    data = figures.heatmap_data(runs, "P3", y="batch_size")
    assert cell(data, optimizer="dpsgd", epsilon=1.0, lr=1.0, batch_size=1024).value == pytest.approx(
        np.mean(np.log10([290, 297])))
    assert data.metric.iloc[0] == "best log10 test loss"
    # the mean of its two seeds' log10 losses (290, 297); before: the best seed's alone
    diverged = {tuple(r) for r in data[data.diverged][["optimizer", "epsilon", "lr", "batch_size"]].to_numpy()}
    assert diverged == {k for k, v in VAE_LOSS.items() if not np.isfinite(v)}
    assert np.isposinf(data[data.diverged].value).all()
    best = data[data.is_best].set_index(["optimizer", "epsilon"])
    assert best.loc[("dpsgd", 1.0), ["lr", "batch_size"]].tolist() == [1.0, 1024]
    assert best.loc[("dpmatrix-me", 10.0), ["lr", "batch_size"]].tolist() == [1.0, 2048]
    assert best.loc[("dpmatrix-me", 10.0)].value == pytest.approx(np.mean(np.log10([240, 247])))

    fig = figures.heatmap_figure(runs, "P3")
    boxes = _boxes(fig)
    assert boxes["diverged"] == {("DP-SGD · ε = 1", "10", "1024"), ("DP-SGD · ε = 10", "10", "1024"),
                                 ("DP-SGD · ε = 10", "10", "2048")}
    assert ("DP-Matrix-ME · ε = 10", "1", "2048") in boxes["best"] and len(boxes["best"]) == 4
    # two seeds, 7 apart in loss: t_{0.975, 1} = 12.7 makes every finite cell's interval overlap the best's
    assert len(boxes["tied"]) == 15 - 4 and boxes["tied"] == {
        (f"{figures.label(o)} · ε = {e:g}", figures.fmt_tick(lr), figures.fmt_tick(size))
        for o, e, lr, size in data[np.isfinite(data.value) & ~data.is_best][
            ["optimizer", "epsilon", "lr", "batch_size"]].itertuples(index=False)}
    figures.plt.close(fig)


def _seed_runs(accuracies: dict) -> pd.DataFrame:
    """P1, DP-SGD at eps 1, L 256: {(lr, epochs): [test accuracy of seed 0, 1, ...]}, NaN: diverged."""
    rows = []
    for (lr, epochs), values in accuracies.items():
        for seed, acc in enumerate(values):
            ok = np.isfinite(acc)
            rows.append(_row("P1", "classification", "dpsgd", 1.0, lr, 256, epochs, seed, acc,
                             1.5 - acc if ok else np.inf, "completed" if ok else "diverged"))
    return pd.DataFrame(rows)


def test_heatmap_cell_is_the_mean_and_t_interval_of_its_seeds():
    data = figures.heatmap_data(_seed_runs({(0.1, 250): [0.5, 0.7]}), "P1")
    c = cell(data, lr=0.1, batch_size=256)
    # mean 0.6; half-width t_{0.975, 1} s / sqrt(2) = 12.7062 x 0.141421 / 1.414214 = 1.27062
    assert c.value == pytest.approx(0.6) and c.n_seeds == 2 and c.n_runs == 2 and c.n_configs == 1
    assert (c.ci_low, c.ci_high) == (pytest.approx(0.6 - 1.270620), pytest.approx(0.6 + 1.270620))
    assert c.is_best and not c.tied and c.select_by == "test"


def test_heatmap_marks_cells_whose_interval_overlaps_the_best_as_tied():
    # intervals (half-width 12.7062 x 0.0141421 / 1.41421 = 0.127062): lr 0.1 [0.483, 0.737] best,
    # lr 0.01 [0.433, 0.687] overlaps it, lr 1 [-0.017, 0.237] does not
    runs = _seed_runs({(0.1, 250): [0.60, 0.62], (0.01, 250): [0.55, 0.57], (1.0, 250): [0.10, 0.12]})
    data = figures.heatmap_data(runs, "P1").set_index("lr")
    assert data.is_best.tolist() == [False, True, False] and data.tied.tolist() == [True, False, False]
    assert data.loc[0.01, "ci_high"] == pytest.approx(0.56 + 0.127062)
    fig = figures.build("fig5_6", runs, problem="P1")
    boxes = _boxes(fig)
    assert boxes["best"] == {("DP-SGD · ε = 1", "0.1", "256")}
    assert boxes["tied"] == {("DP-SGD · ε = 1", "0.01", "256")}
    caption = next(t.get_text() for t in fig.texts if t.get_gid() == "caption")
    assert "2 seeds: mean and 95 % t interval over seeds" in caption and "TEST split" in caption
    assert "(tied)" in caption and "N = 6" in caption
    figures.plt.close(fig)
    # the candidates share their seeds: no composed epsilon is claimed for the boxed cell
    assert data.selection_epsilon.isna().all() and (data.not_composed == SHARED_SEEDS).all()
    assert (data.panel_runs == 6).all()


def test_heatmap_red_box_is_the_cell_the_selection_split_chose():
    # validation prefers lr 0.01 (0.70 against 0.60), test prefers lr 0.1: with select_by=val
    # the box is on the cell validation chose, though its test mean shown is lower
    runs = _seed_runs({(0.1, 250): [0.60, 0.62], (0.01, 250): [0.50, 0.52]})
    runs.loc[runs["lr"] == 0.01, "best_val_accuracy"] = 0.70
    runs.loc[runs["lr"] == 0.1, "best_val_accuracy"] = 0.60
    by_val = figures.heatmap_data(runs, "P1", select_by="val").set_index("lr")
    by_test = figures.heatmap_data(runs, "P1").set_index("lr")
    assert by_val.loc[0.01, "is_best"] and not by_val.loc[0.1, "is_best"]
    assert by_test.loc[0.1, "is_best"] and not by_test.loc[0.01, "is_best"]
    assert by_val.loc[0.01, "value"] == pytest.approx(0.51)  # its test accuracy at the best validation epoch


def test_heatmap_of_one_seed_says_so_and_marks_no_ties():
    runs = _seed_runs({(0.1, 250): [0.60], (0.01, 250): [0.599]})
    data = figures.heatmap_data(runs, "P1")
    assert (data.n_seeds == 1).all() and not data.tied.any() and (data.ci_low == data.ci_high).all()
    fig = figures.build("fig5_6", runs, problem="P1", select_by="val")
    caption = next(t.get_text() for t in fig.texts if t.get_gid() == "caption")
    assert "one seed" in caption and "validation split" in caption and "(tied)" not in caption
    assert not _boxes(fig)["tied"] and len(_boxes(fig)["best"]) == 1
    figures.plt.close(fig)
    fig = figures.build("fig5_5", runs, problem="P1")
    assert "one seed" in next(t.get_text() for t in fig.texts if t.get_gid() == "caption")
    figures.plt.close(fig)


def test_a_diverged_seed_rules_its_configuration_out_of_heatmaps_and_best_settings():
    # E 250 has the best run (0.9) but its other seed diverged; E 500 (mean 0.61) is chosen
    runs = _seed_runs({(0.1, 250): [0.9, np.nan], (0.1, 500): [0.60, 0.62]})
    c = cell(figures.heatmap_data(runs, "P1"), lr=0.1, batch_size=256)
    assert c.value == pytest.approx(0.61) and not c.diverged and (c.n_runs, c.n_configs) == (4, 2)
    by_epochs = figures.heatmap_data(runs, "P1", y="epochs").set_index("epochs")
    assert by_epochs.loc[500].is_best and by_epochs.loc[250].diverged and math.isnan(by_epochs.loc[250].value)
    settings = figures.best_settings_data(runs, "P1").iloc[0]
    assert (settings.epochs, settings.lr, settings.n_configs, settings.n_runs) == (500, 0.1, 2, 4)
    assert settings.value == pytest.approx(0.61)


def test_heatmap_title_gives_the_composed_epsilon_of_independent_candidates():
    """Candidates on seeds of their own (one Gaussian release each): the boxed cell's choice is
    their composition, mu sqrt(k) (``spent.selection_privacy``), named in the panel's title."""
    from dpbench.privacy import accounting
    from dpbench.privacy.selection import gaussian_mu

    runs = _seed_runs({(0.1, 250): [0.60], (0.01, 250): [0.55]})
    runs = runs.assign(seed=[0, 1], delta=1e-5, accountant="analytic-gaussian")
    data = figures.heatmap_data(runs, "P1")
    expected = accounting.gaussian_epsilon(gaussian_mu(0.99, 1e-5) * math.sqrt(2), 1e-5)
    assert data.selection_epsilon.tolist() == [pytest.approx(expected)] * 2 and expected > 0.99
    fig = figures.build("fig5_6", runs, problem="P1")
    assert any(ax.get_title() == f"DP-SGD · ε = 1 · ε_sel {expected:.3g}" for ax in fig.axes)
    figures.plt.close(fig)


def test_seed_sensitivity_mean_and_std_of_the_best_config_per_lr(runs):
    data = figures.seed_sensitivity_data(runs[runs.problem == "P1"]).set_index(["optimizer", "lr"])
    # DP-DiSK (one seed) and SGD (one config, 3 seeds) -- DP-DiSK is dropped, SGD kept
    assert set(data.index.get_level_values("optimizer")) == {"dpsgd", "dpadambc", "sgd"}
    seed_term = [0.01 * s ** 2 for s in SEEDS]  # 0, 0.01, 0.04
    # DP-SGD at lr 0.1: eps 10 (0.1 + 0.05) beats eps 1 (0 + 0.1); L 512, E 500
    row = data.loc[("dpsgd", 0.1)]
    assert (row.epsilon, row.batch_size, row.epochs) == (10.0, 512, 500)
    base = 0.5 + 0.1 + 0.05 + 0.02 + 0.01
    assert row["mean"] == pytest.approx(statistics.mean(base + t for t in seed_term))
    assert row["std"] == pytest.approx(statistics.stdev(base + t for t in seed_term))
    assert row.n_seeds == 3
    # DP-SGD at lr 1: eps 10, L 512, E 500 (L 256 diverged at E 500; eps 1 L 256 all diverged)
    row = data.loc[("dpsgd", 1.0)]
    assert (row.epsilon, row.batch_size, row.epochs) == (10.0, 512, 500)
    assert row["mean"] == pytest.approx(0.5 + 0.1 + 0.15 + 0.02 + 0.01 + statistics.mean(seed_term))
    assert row["std"] == pytest.approx(statistics.stdev(seed_term))
    assert figures.seed_sensitivity_data(runs, min_seeds=4).empty


def test_a_loss_task_chosen_on_validation_reports_log10_test_loss_lowest_best(runs):
    # select_by="val" reports test_loss_at_best_val: still a loss (log10, lower is better), not
    # an accuracy; the VAE rows have val = test, so the choice is the test one
    s = figures.scored(runs[runs.problem == "P3"], "val")
    finite = s[np.isfinite(s["value"])]
    assert finite["lower_is_better"].all() and (finite["metric"] == "best log10 test loss (selected by best_val_loss)").all()
    assert np.allclose(finite["value"], np.log10(finite["test_loss_at_best_val"]))
    by_val = figures.heatmap_data(runs, "P3", select_by="val")
    by_test = figures.heatmap_data(runs, "P3")
    assert by_val[by_val.is_best].run_id.tolist() == by_test[by_test.is_best].run_id.tolist()
    assert np.allclose(by_val["value"], by_test["value"], equal_nan=True)


def test_validation_selection_picks_another_configuration(runs):
    by_test = figures.best_per_setting(runs).set_index(["problem", "optimizer", "epsilon"])
    by_val = figures.best_per_setting(runs, select_by="val").set_index(["problem", "optimizer", "epsilon"])
    t, v = by_test.loc[("P1", "dpsgd", 1.0)], by_val.loc[("P1", "dpsgd", 1.0)]
    # the configuration with the best mean over its three seeds (seed terms 0, 0.01, 0.04)
    assert t.lr == 0.1 and t.value == pytest.approx(0.5 + 0.1 + 0.02 + 0.01 + 0.05 / 3)
    # k: 3 learning rates x 2 batch sizes x 2 epochs x 3 seeds, the diverged runs among them
    assert t.n_seeds == 3 and t.n_runs == 36 and t.n_configs == 12
    # validation chose the trap run's configuration (mean validation (0.99 + 0.51 + 0.54) / 3);
    # what is reported is its seeds' test accuracy at the epoch validation chose, not their
    # best test accuracy (0.5 on seed 0)
    assert v.run_id == "P1/dpsgd/L256-E250-eps1.0-lr0.01-s0" and v.value == pytest.approx((0.45 + 0.51 + 0.54) / 3)
    assert t.select_by == "test" and v.select_by == "val"
    assert "best_val_accuracy" in v.metric
    # elsewhere validation equals test, so the choice is the same
    assert (by_val.drop(("P1", "dpsgd", 1.0)).run_id == by_test.drop(("P1", "dpsgd", 1.0)).run_id).all()
    # an explicit column works the same; a missing one says which
    explicit = figures.best_per_setting(runs, select_by="best_val_accuracy")
    assert "P1/dpsgd/L256-E250-eps1.0-lr0.01-s0" in set(explicit.run_id)
    with pytest.raises(KeyError, match="best_val_accuracy"):
        figures.best_per_setting(runs.drop(columns=["best_val_accuracy"]), select_by="val")


def test_best_per_setting_keeps_fig_5_1_numbers(runs):
    best = figures.best_per_setting(runs).set_index(["problem", "optimizer", "epsilon"])
    assert best.loc[("P1", "sgd", np.inf)].value == pytest.approx(0.9) and not best.loc[("P1", "sgd", np.inf)].private
    # means over seeds (seed terms 0, 0.01, 0.04); the VAE's of the log10 losses of its two seeds
    dpsgd = best.loc[("P1", "dpsgd", 10.0)]
    assert dpsgd.value == pytest.approx(0.78 + 0.05 / 3)
    seeds = [0.78, 0.79, 0.82]
    half = 4.302652729749464 * statistics.stdev(seeds) / math.sqrt(3)  # t_{0.975, 2}
    assert (dpsgd.ci_low, dpsgd.ci_high) == (pytest.approx(np.mean(seeds) - half), pytest.approx(np.mean(seeds) + half))
    assert best.loc[("P3", "dpsgd", 1.0)].value == pytest.approx(np.mean(np.log10([290, 297])))
    assert best.loc[("P3", "dpmatrix-me", 10.0)].value == pytest.approx(np.mean(np.log10([240, 247])))
    # DP-DiSK has one seed: no interval
    disk = best.loc[("P1", "dpdisk", 10.0)]
    assert disk.n_seeds == 1 and disk.ci_low == disk.ci_high == disk.value


def test_best_settings_per_batch_size(runs):
    data = figures.best_settings_data(runs, "P1").set_index(["optimizer", "epsilon", "batch_size"])
    assert data.loc[("dpsgd", 1.0, 256), ["epochs", "lr"]].tolist() == [500, 0.1]
    assert data.loc[("dpsgd", 10.0, 256), ["epochs", "lr"]].tolist() == [250, 1.0]  # E 500 diverged
    assert data.loc[("dpsgd", 10.0, 512), ["epochs", "lr"]].tolist() == [500, 1.0]
    assert data.loc[("dpadambc", 10.0, 512), ["epochs", "lr"]].tolist() == [500, 0.1]  # lr 1 missing
    # the chosen configuration's mean over its three seeds, among 3 lr x 2 epochs = 6 configurations, 18 runs
    row = data.loc[("dpsgd", 1.0, 256)]
    assert row.value == pytest.approx(0.5 + 0.1 + 0.01 + 0.05 / 3) and row.ci_low < row.value < row.ci_high
    assert (row.n_seeds, row.n_configs, row.n_runs) == (3, 6, 18)
    disk = data.loc[("dpdisk", 10.0, 512)]
    assert (disk.n_seeds, disk.n_configs, disk.n_runs) == (1, 6, 6) and disk.ci_low == disk.ci_high == disk.value
    fig = figures.build("fig5_5", runs)
    caption = next(t.get_text() for t in fig.texts if t.get_gid() == "caption")
    assert "3 seeds" in caption and "TEST split" in caption and "k = 6, 12, 18" in caption
    figures.plt.close(fig)


def test_all_diverged_group_never_crashes_and_has_no_bar():
    runs = vae_runs()
    runs = runs[runs.optimizer == "dpsgd"].assign(best_test_loss=np.inf, status="diverged")
    best = figures.best_per_setting(runs)
    assert best.diverged.all() and np.isposinf(best.value).all()
    fig = figures.build("fig5_2", runs)
    assert not any(p.get_height() > 0 for ax in fig.axes for p in ax.patches)
    figures.plt.close(fig)


@pytest.mark.parametrize("figure_id", figures.THESIS_FIGURES)
def test_every_figure_writes_png_and_pdf(runs, tmp_path, figure_id):
    runs_path = tmp_path / "runs.parquet"
    runs.to_parquet(runs_path)
    options = {"problem": "P1"} if figure_id in ("fig5_6", "figB_1", "figB_2") else {}
    png, pdf = figures.plot(figure_id, runs_path, tmp_path / "figs" / figure_id, **options)
    assert png == tmp_path / "figs" / f"{figure_id}.png" and pdf.suffix == ".pdf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 5_000


def test_filters_and_unknown_figure(runs, tmp_path):
    assert set(figures.select_runs(runs, {"epochs": [30]}).problem) == {"P3"}
    with pytest.raises(KeyError, match="nope"):
        figures.select_runs(runs, {"nope": [1]})
    with pytest.raises(ValueError, match="unknown figure"):
        figures.build("fig9_9", runs)
    # thesis filters on a table without Setup 3 runs: an empty figure, not a crash
    fig = figures.build("fig5_7", runs[runs.problem == "P1"], filters="thesis")
    assert "no runs" in fig.texts[0].get_text()
    figures.plt.close(fig)


def test_command_line_options():
    assert figures.parse_options(["problem=P2", "ys=batch_size,epochs", "epsilons=1,10", "select_by=val",
                                  "min_seeds=3", "filter.epochs=250,500", "filter.problem=P1"]) == {
        "problem": "P2", "ys": ["batch_size", "epochs"], "epsilons": [1, 10], "select_by": "val", "min_seeds": 3,
        "filters": {"epochs": [250, 500], "problem": ["P1"]}}
    assert figures.parse_options(["filters=thesis"]) == {"filters": "thesis"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        figures.parse_options(["problem"])


def test_every_registered_optimizer_has_a_figure_label():
    from dpbench.optimizers import OPTIMIZERS

    assert sorted(set(OPTIMIZERS.builtins) - set(figures.LABELS)) == []  # a plugin's: its id
    assert len(set(figures.LABELS.values())) == len(figures.LABELS)  # no two optimizers look alike


# -- the language model (P4): loss, exposure, ranking --------------------------------------------

def _canaries(opt, eps, lr, seed):
    """Two canaries per k; exposure falls with privacy and rises with k; extracted above 17 bits."""
    scale = {None: 3.0, 1.0: 0.2, 10.0: 1.0}[eps] * (1.5 if opt == "dpadamw" else 1.0)
    out = []
    for k in (0, 1, 5, 25):
        for j in range(2):
            exposure = 1.0 + scale * k ** 0.5 * (1 + 0.1 * j) + 0.5 * seed + (lr == 1.0)
            out.append({"secret": f"{k}-{j}", "repeats": k, "log_perplexity": 1.0, "rank": 1,
                        "exposure": exposure, "extracted": exposure > 17})
    return out


def _val_loss(opt, eps, lr, seed):
    base = {"sgd": 3.0, "dpsgd": 4.0, "dpadamw": 3.8}[opt] + (0.3 if eps == 1.0 else 0.0)
    if opt == "dpsgd" and eps == 1.0 and lr == 1.0:  # the better learning rate, but one seed diverged
        return np.inf if seed == 2 else base - 0.2 + 0.01 * seed
    return base + (0.1 if lr == 1.0 else 0.0) + 0.01 * seed


def lm_runs():
    from dpbench.reporting.aggregate import memorisation_columns

    rows = []
    for opt, eps in [("sgd", None), ("dpsgd", 1.0), ("dpsgd", 10.0), ("dpadamw", 1.0), ("dpadamw", 10.0)]:
        for lr, seed in itertools.product([0.5, 1.0], SEEDS):
            val = _val_loss(opt, eps, lr, seed)
            row = _row("P4", "language_model", opt, eps, lr, 256, 1, seed, np.nan, val, "completed")
            row.update({"best_val_loss": val, "final_train_loss": val - 0.1, "dataset": "lm",
                        "val_perplexity": math.exp(val),
                        **memorisation_columns({"canaries": _canaries(opt, eps, lr, seed)})})
            rows.append(row)
    return pd.DataFrame(rows)


def test_memorisation_columns():
    from dpbench.reporting.aggregate import memorisation_columns

    cols = memorisation_columns({"space_size": 10**6, "method": "exact", "canaries": [
        {"repeats": 5, "exposure": 2.0, "extracted": False}, {"repeats": 5, "exposure": 6.0, "extracted": True},
        {"repeats": 0, "exposure": 1.0, "extracted": False}]})
    assert cols["exposure_k5"] == 4.0 and cols["exposure_std_k5"] == 2.0 and cols["canaries_k5"] == 2
    assert cols["extracted_k5"] == 0.5 and cols["extracted_k0"] == 0.0 and cols["exposure_k0"] == 1.0
    assert cols["canaries_k25"] == 0 and math.isnan(cols["exposure_k25"]) and math.isnan(cols["extracted_k1"])
    assert memorisation_columns(None)["canaries_k1"] == 0


def test_lm_loss_data_selects_on_validation():
    d = figures.lm_loss_data(lm_runs()).set_index(["optimizer", "epsilon", "split"])
    assert len(d) == 5 * 2
    # dpsgd at eps 1: lr 1.0 is better on two seeds but diverged on the third: lr 0.5 is chosen
    r = d.loc[("dpsgd", 1.0, "val")]
    assert r["lr"] == 0.5 and r["mean"] == pytest.approx(4.31) and r["std"] == pytest.approx(0.01)
    assert r["n_seeds"] == 3
    assert d.loc[("dpsgd", 1.0, "train"), "mean"] == pytest.approx(4.21)
    assert d.loc[("dpadamw", 10.0, "val"), "mean"] == pytest.approx(3.81)
    sgd = d.loc[("sgd", np.inf, "val")]
    assert not sgd["private"] and sgd["lr"] == 0.5 and sgd["mean"] == pytest.approx(3.01)


def test_lm_exposure_data_pools_seeds_and_canaries():
    runs = lm_runs()
    d = figures.lm_exposure_data(runs).set_index(["optimizer", "epsilon", "k"])
    assert len(d) == 5 * 4
    for opt, eps, k in [("dpsgd", 10.0, 25), ("sgd", np.inf, 5), ("dpadamw", 1.0, 0)]:
        lr = 0.5  # the chosen configuration (lowest validation loss)
        raw = [c["exposure"] for s in SEEDS for c in _canaries(opt, None if eps == np.inf else eps, lr, s)
               if c["repeats"] == k]
        r = d.loc[(opt, eps, k)]
        assert r["n_canaries"] == 6 and r["n_seeds"] == 3
        assert r["mean"] == pytest.approx(statistics.mean(raw), rel=1e-12)
        assert r["std"] == pytest.approx(statistics.stdev(raw), rel=1e-12)  # over seeds and canaries
    # sgd, k = 25: 1 + 3 * 5 * (1, 1.1) + 0.5 s: 16, 17.5 / 16.5, 18 / 17, 18.5 -> 3 of 6 above 17
    assert d.loc[("sgd", np.inf, 25), "extracted"] == 0.5
    assert d.loc[("dpsgd", 1.0, 0), "mean"] == pytest.approx(1.5)


def test_lm_ranking_orders_by_validation_perplexity():
    d = figures.lm_ranking_data(lm_runs())
    eps1 = d[d.epsilon == 1.0]
    assert list(eps1.optimizer) == ["dpadamw", "dpsgd"] and list(eps1["rank"]) == [1, 2]
    assert eps1.iloc[0]["val_perplexity"] == pytest.approx(np.mean(np.exp([4.1, 4.11, 4.12])))
    assert list(d[d.epsilon == np.inf].optimizer) == ["sgd"]
    # exposure at k = 25, dpsgd at eps 10, lr 0.5: mean of 1 + 5 (1, 1.1) + 0.5 s
    r = d[(d.epsilon == 10.0) & (d.optimizer == "dpsgd")].iloc[0]
    assert r["exposure"] == pytest.approx(6.25 + 0.5)
    md = figures.draw_lm_ranking(d)
    assert "## ε = 1" in md and "## non-private (ε = ∞)" in md
    assert md.index("## ε = 1") < md.index("## ε = 10") < md.index("## non-private")
    # exp(4.1), exp(4.11), exp(4.12): 60.95 +- 0.61; k = 25: 1 + 0.3 * 5 * (1, 1.1) + 0.5 s: 3.075
    # ± std, then ± the t interval's half-width: 4.303 x 0.61 / sqrt(3); k = 2 rates x 3 seeds looked at
    assert "| 1 | DP-AdamW | 60.95 ± 0.61 (± 1.51) | 3.08 ± 0.45 | 0% | 0.5 | 3 | 6 | – |" in md
    assert "| 1 | SGD (non-private) | 20.29 ± 0.20 (± 0.50) | 17.25 ± 0.94 | 50% | 0.5 | 3 | 6 | – |" in md
    assert not d.tied.any() and "chosen on the validation split" in md


def test_lm_ranking_marks_overlapping_intervals_as_tied():
    runs = lm_runs()
    # DP-SGD at eps 1 moved to DP-AdamW's validation losses plus 0.005: the intervals overlap
    adamw = runs[(runs.optimizer == "dpadamw") & (runs.target_epsilon == 1.0)].best_val_loss.to_numpy()
    mask = (runs.optimizer == "dpsgd") & (runs.target_epsilon == 1.0)
    runs.loc[mask, "best_val_loss"] = np.tile(adamw[:3], 2) + 0.005 if mask.sum() == 6 else np.nan
    d = figures.lm_ranking_data(runs)
    eps1 = d[d.epsilon == 1.0]
    assert list(eps1.optimizer) == ["dpadamw", "dpsgd"] and list(eps1.tied) == [False, True]
    assert "| = 2 | DP-SGD |" in figures.draw_lm_ranking(d)
    assert not d[d.epsilon == 10.0].tied.any()


@pytest.mark.parametrize("figure_id", figures.LM_FIGURES)
def test_every_lm_figure_draws(tmp_path, figure_id):
    runs_path = tmp_path / "runs.parquet"
    lm_runs().to_parquet(runs_path)
    paths = figures.plot(figure_id, runs_path, tmp_path / "figs" / figure_id)
    assert [p.suffix for p in paths] == [f".{e}" for e in figures.extensions(figure_id)]
    if figure_id == "lm_ranking":
        assert paths[0].read_text().startswith("# Language model")
    else:
        assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[0].stat().st_size > 20_000
    fig = figures.build(figure_id, lm_runs().iloc[:0])
    assert ("No language-model runs" in fig) if isinstance(fig, str) else fig.texts


def test_every_optimizer_has_its_own_colour():
    """The palette covers every registered optimizer and unknown ones, with distinct colours
    (it held 20 colours and dropped the optimizers past the 20th: their figures failed to draw)."""
    from dpbench.optimizers import OPTIMIZERS

    names = sorted(OPTIMIZERS) + ["my-new-optimizer"]
    colours = figures.palette(names)
    assert set(names) <= set(colours)
    assert len({tuple(colours[n]) for n in names}) == len(names)


def test_comparison_draws_intervals_over_seeds_and_says_what_chose():
    runs = classification_runs()
    fig = figures.build("fig5_1", runs)
    caption = next(t.get_text() for t in fig.texts if t.get_gid() == "caption")
    assert "3 seeds" in caption and "TEST split" in caption and "95 % t interval" in caption
    intervals = [c for ax in fig.axes for c in ax.collections if c.get_gid() == "interval"]
    # DP-SGD and DP-AdamBC at two epsilons; DP-DiSK has one seed: no interval
    assert len(intervals) == 2 * 2
    figures.plt.close(fig)
    one = runs[runs.seed == 0]
    fig = figures.build("fig5_1", one, select_by="val")
    caption = next(t.get_text() for t in fig.texts if t.get_gid() == "caption")
    assert "one seed" in caption and "validation split" in caption
    assert not [c for ax in fig.axes for c in ax.get_children() if c.get_gid() == "interval"]
    figures.plt.close(fig)


def test_every_built_in_figure_of_one_problem_declares_it_for_the_config_check():
    """The config check reads a figure's spec, not its build's signature: a build whose
    ``problem`` has a default must give it in the spec's defaults (the LM figures draw P4), and
    the figures that select on validation whatever their options say so."""
    import inspect

    for figure_id in figures.FIGURES.builtins:
        spec = figures.FIGURES[figure_id]
        default = inspect.signature(spec.build).parameters.get("problem", inspect.Parameter("p", 1)).default
        if default is not inspect.Parameter.empty:
            assert spec.defaults.get("problem") == default, figure_id
    assert [f for f in figures.FIGURES.builtins if figures.FIGURES[f].needs_validation] == figures.LM_FIGURES
    assert figures.validation_needed("lm_ranking", {}) == (
        "", "lm_ranking selects each optimizer's configuration on the validation split")
    assert figures.validation_needed("fig5_6", {"select_by": "val"})[0] == "select_by"
    assert figures.validation_needed("fig5_6", {}) is None


def test_runs_of_different_delta_are_not_pooled_under_one_epsilon(runs):
    """Runs aggregated from configs of different δ were drawn under one "ε 1" bar as if they were
    seeds of one setting: refused, naming the δs and the filter that draws one of them (which
    the command line reads back as that δ)."""
    mixed = runs.assign(delta=np.where(runs["seed"] % 2 == 0, 1e-5, 1e-6))
    with pytest.raises(ValueError, match=r"fig5_1: the runs have δ 1e-06, 1e-05, .* draw one δ at a time "
                                         r"\(-o filter.delta=1.0e-06\)"):
        figures.build("fig5_1", mixed)
    options = figures.parse_options(["filter.delta=1.0e-06"])
    fig = figures.build("fig5_1", mixed, **options)  # one δ: drawn
    figures.plt.close(fig)
    figures.plt.close(figures.build("fig5_1", runs.assign(delta=1e-5)))
