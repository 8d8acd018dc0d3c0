"""The fine-tuning figures (P5, P6) from synthetic runs tables whose chosen configurations are known
by construction: every bar is the mean over seeds of the configuration chosen on validation among
its own mode's runs, never runs of two modes pooled as seeds or rates of one setting."""

import itertools
import math
import statistics

import numpy as np
import pandas as pd
import pytest

from dpbench.reporting import figures
from dpbench.reporting.aggregate import memorisation_columns

SEEDS = [0, 1, 2]
LRS = [0.01, 0.1]
MODES = ["scratch", "full", "lora", "last-block"]
BASE = {"scratch": 0.20, "full": 0.50, "lora": 0.45, "last-block": 0.40}
OPT = {"dpsgd": 0.0, "dpadamw": 0.05, "adamw": 0.20}
# the better rate differs between modes: full learns best at 0.01, LoRA at 0.1 (pooling modes
# as configurations of one setting would choose one rate for both)
LR_TERM = {"full": {0.01: 0.04, 0.1: 0.0}, "lora": {0.01: 0.0, 0.1: 0.06}, "last-block": {0.01: 0.0, 0.1: 0.02},
           "scratch": {0.01: 0.01, 0.1: 0.0}}
TRAINED = {"scratch": 847_912, "full": 847_912, "lora": 152_616, "last-block": 203_688, "head": 5_160}


def accuracy(opt, eps, mode, lr, seed):
    eps_term = {1.0: 0.0, 3.0: 0.05, None: 0.1}[eps]
    return BASE[mode] + OPT[opt] + eps_term + LR_TERM[mode][lr] + 0.01 * seed ** 2


def _row(problem, task, opt, eps, mode, lr, seed, test, val, rank=None):
    private = eps is not None
    public = mode != "scratch"
    return {"run_id": f"{problem}/{opt}/{mode}-eps{eps}-lr{lr:g}-s{seed}", "problem": problem,
            "dataset": "fortunes", "task": task, "optimizer": opt, "private": private, "dp_guarantee": private,
            "lr": lr, "batch_size": 64, "epochs": 2, "seed": seed, "hyperparameters": "{}",
            "target_epsilon": eps if private else np.nan, "epsilon": eps * 0.99 if private else np.inf,
            "delta": 1e-5 if private else np.nan, "noise_multiplier": 1.0 if private else 0.0,
            "sample_rate": 64 / 13072, "steps": 400, "accountant": "prv", "mechanism_origin": "built-in",
            "accounted_history": None, "status": "completed", "n_val": 500,
            "best_test_accuracy": test, "best_test_loss": 1.0 - test if task == "classification" else test,
            "best_val_accuracy": val, "best_val_loss": 1.0 - val if task == "classification" else val,
            "test_accuracy_at_best_val": test if task == "classification" else np.nan,
            "test_loss_at_best_val": 1.0 - test if task == "classification" else test,
            "start": "public" if public else "scratch", "finetune": mode.split("-r")[0] if public else "scratch",
            "lora_rank": rank, "trainable_parameters": TRAINED[mode.split("-r")[0]],
            "checkpoint_sha256": "ab" * 32 if public else None}


def p6_runs():
    rows = []
    for (opt, eps), mode, lr, seed in itertools.product(
            [("dpsgd", 1.0), ("dpsgd", 3.0), ("dpadamw", 1.0), ("dpadamw", 3.0), ("adamw", None)], MODES, LRS, SEEDS):
        acc = accuracy(opt, eps, mode, lr, seed)
        rows.append(_row("P6", "classification", opt, eps, mode, lr, seed, acc, acc, 16 if mode == "lora" else None))
    runs = pd.DataFrame(rows)
    # validation disagrees with test once: DP-AdamW at eps 1, full, lr 0.1 looks best on validation
    trap = (runs.optimizer == "dpadamw") & (runs.target_epsilon == 1.0) & (runs.finetune == "full") & (runs.lr == 0.1)
    runs.loc[trap, "best_val_accuracy"] += 0.2
    # DP-SGD at eps 3 in LoRA: the better rate diverged on one seed, so the other one is chosen
    gone = ((runs.optimizer == "dpsgd") & (runs.target_epsilon == 3.0) & (runs.finetune == "lora")
            & (runs.lr == 0.1) & (runs.seed == 2))
    runs.loc[gone, ["status", "best_val_accuracy", "test_accuracy_at_best_val"]] = ["diverged", np.nan, np.nan]
    runs["lora_rank"] = pd.array(runs["lora_rank"].astype(float), dtype="Int64")
    runs["trainable_parameters"] = pd.array(runs["trainable_parameters"], dtype="Int64")
    return runs


def expected(opt, eps, mode, lr):
    return statistics.mean(accuracy(opt, eps, mode, lr, s) for s in SEEDS)


def row(data, opt, eps, mode):
    r = data[(data.optimizer == opt) & (data.epsilon == eps) & (data["mode"] == mode)]
    assert len(r) == 1, (opt, eps, mode)
    return r.iloc[0]


def bar_heights(fig) -> dict[str, float]:
    return {p.get_gid(): p.get_height() for ax in fig.axes for p in ax.patches
            if (p.get_gid() or "").startswith("finetune|")}


def test_each_bar_is_its_own_modes_chosen_configuration_mean_over_seeds():
    runs = p6_runs()
    data = figures.finetune_data(runs, "P6")
    assert len(data) == 5 * len(MODES)
    # the chosen rate differs between the modes of one optimizer and epsilon: never pooled
    assert row(data, "dpsgd", 1.0, "full")["lr"] == 0.01 and row(data, "dpsgd", 1.0, "lora-r16")["lr"] == 0.1
    for (opt, eps, mode), r in data.set_index(["optimizer", "epsilon", "mode"]).iterrows():
        base = mode.split("-r")[0]
        target = None if eps == math.inf else eps
        lr = max(LRS, key=lambda x: LR_TERM[base][x])  # the best rate on validation (= test here)
        if (opt, eps, base) == ("dpadamw", 1.0, "full"):
            lr = 0.1  # validation's pick, whatever test says
        if (opt, eps, base) == ("dpsgd", 3.0, "lora"):
            lr = 0.01  # the better rate diverged on a seed
        assert r["lr"] == lr, (opt, eps, mode)
        assert r["value"] == pytest.approx(expected(opt, target, base, lr), abs=1e-12)
        assert r["n_seeds"] == 3 and r["n_runs"] == len(LRS) * len(SEEDS)  # one mode's candidates
        assert r["trainable_parameters"] == TRAINED[base]
    # the 95 % t interval over the chosen configuration's three seeds
    seeds = [accuracy("dpsgd", 1.0, "lora", 0.1, s) for s in SEEDS]
    half = 4.302652729749464 * statistics.stdev(seeds) / math.sqrt(3)
    r = row(data, "dpsgd", 1.0, "lora-r16")
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((statistics.mean(seeds) - half, statistics.mean(seeds) + half))


def test_modes_are_never_pooled_even_where_their_settings_coincide():
    """Two modes' runs share every setting but the mode (problem, optimizer, lr, L, E, ε,
    hyperparameters): were the mode not part of the configuration they would be six seeds of one
    setting. Each LoRA rank is a mode of its own too."""
    runs = p6_runs()
    eight = runs[runs.finetune == "lora"].assign(lora_rank=pd.array([8] * int((runs.finetune == "lora").sum()),
                                                                    dtype="Int64"),
                                                 run_id=lambda d: d.run_id + "-r8",
                                                 test_accuracy_at_best_val=lambda d: d.test_accuracy_at_best_val - 0.1)
    data = figures.finetune_data(pd.concat([runs, eight], ignore_index=True), "P6")
    r16, r8 = row(data, "dpsgd", 1.0, "lora-r16"), row(data, "dpsgd", 1.0, "lora-r8")
    assert r16["n_seeds"] == r8["n_seeds"] == 3 and r16["n_runs"] == r8["n_runs"] == 6
    assert r16["value"] - r8["value"] == pytest.approx(0.1)
    assert figures.finetune.ordered_modes(data["mode"]) == ["scratch", "full", "last-block", "lora-r8", "lora-r16"]
    # the selection rule every figure shares keeps them apart too (fig5_1's best per setting)
    best = figures.best_per_setting(pd.concat([runs, eight], ignore_index=True), select_by="val", privacy=False)
    assert (best["n_seeds"] == 3).all()


def test_gaps_to_non_private_and_scratch_and_ranks_among_modes():
    data = figures.finetune_data(p6_runs(), "P6")
    r = row(data, "dpsgd", 1.0, "full")
    # non-private reference of the mode: AdamW full, lr 0.01
    assert r["gap_non_private"] == pytest.approx(expected("dpsgd", 1.0, "full", 0.01) - expected("adamw", None, "full", 0.01))
    assert r["gap_scratch"] == pytest.approx(expected("dpsgd", 1.0, "full", 0.01) - expected("dpsgd", 1.0, "scratch", 0.01))
    assert math.isnan(row(data, "dpsgd", 1.0, "scratch")["gap_scratch"])
    assert math.isnan(row(data, "adamw", math.inf, "full")["gap_non_private"])  # the reference itself
    order = data[(data.optimizer == "dpsgd") & (data.epsilon == 1.0)].sort_values("rank")["mode"].tolist()
    assert order == ["full", "lora-r16", "last-block", "scratch"]
    # full (0.54 + seeds) and LoRA r16 (0.51 + seeds): the seeds' spread makes their intervals overlap
    assert row(data, "dpsgd", 1.0, "lora-r16")["tied"] and not row(data, "dpsgd", 1.0, "full")["tied"]


def test_the_figure_draws_the_chosen_means_and_says_what_chose():
    runs = p6_runs()
    data = figures.finetune_data(runs, "P6")
    fig = figures.build("finetune", runs)
    heights = bar_heights(fig)
    assert len(heights) == len(data)
    for _, r in data.iterrows():
        assert heights[f"finetune|{r.optimizer}|{figures.fmt_tick(r.epsilon)}|{r['mode']}"] == pytest.approx(r.value)
    scratch = [p for ax in fig.axes for p in ax.patches if (p.get_gid() or "").endswith("|scratch")]
    assert scratch and all(p.get_hatch() == figures.finetune.SCRATCH_HATCH for p in scratch)
    assert [ax.get_title() for ax in fig.axes] == ["ε = 1", "ε = 3", "non-private (ε = ∞)"]
    # at most a page wide, one panel a row; every bar within its optimizer's group, under its tick
    assert fig.get_size_inches()[0] <= figures.finetune.PAGE_WIDTH
    for ax in fig.axes:
        ticks = {t.get_text(): x for t, x in zip(ax.get_xticklabels(), ax.get_xticks())}
        for p in ax.patches:
            opt = (p.get_gid() or "").split("|")[1]
            assert abs(p.get_x() + p.get_width() / 2 - ticks[figures.label(opt)]) < 0.4, p.get_gid()
    caption = next(t.get_text() for t in fig.texts if t.get_gid() == "caption")
    assert "validation split" in caption and "3 seeds" in caption and "95 % t interval" in caption
    assert "k = 6" in caption and "from scratch" in caption
    intervals = [c for ax in fig.axes for c in ax.collections if c.get_gid() == "interval"]
    assert len(intervals) == len(data)
    figures.plt.close(fig)


def test_a_cell_whose_seeds_agree_to_the_last_record_has_an_interval_of_the_test_records_noise():
    """Two seeds right on the same 7 of 10 shared test records: the t interval over seeds is of
    width 0 (the pilot's DP-AdamW [0.730, 0.730]); the table's counts the records: the one-term
    crossed ANOVA gives Var = s2_b / n with s2_b = p (1 - p) n / (n - 1), df n - 1, so the
    half-width is t_{0.975, 9} sqrt(0.21 / 9) = 2.2622 x 0.15275 = 0.34555."""
    from dpbench.reporting.results import pack_outcomes

    correct = np.array([1, 1, 1, 0, 1, 1, 0, 1, 1, 0], dtype=bool)
    rows = [_row("P6", "classification", "dpsgd", 3.0, "full", 0.1, s, 0.7, 0.6) for s in (0, 1)]
    runs = pd.DataFrame(rows).assign(n_test=10, test_correct_at_best_val=pack_outcomes(correct))
    data = figures.finetune_data(runs, "P6")
    r = row(data, "dpsgd", 3.0, "full")
    assert r["value"] == pytest.approx(0.7) and r["interval"] == "seeds × records"
    assert (r["ci_high"] - r["ci_low"]) / 2 == pytest.approx(0.34555, abs=1e-4)
    table = figures.build("finetune_table", runs)
    assert "95 % interval over seeds and test records" in table and "0.700 [0.354, 1.046]" in table
    # without the per-record outcomes the table says it is the seeds' t interval (here of width 0)
    bare = figures.finetune_data(runs.drop(columns=["test_correct_at_best_val", "n_test"]), "P6")
    assert row(bare, "dpsgd", 3.0, "full")["interval"] == "paired"
    assert "95 % t interval over seeds" in figures.build("finetune_table", runs.drop(columns=["n_test"]))


def test_a_pretrained_dp_run_beside_its_from_scratch_twin_at_epsilon_1():
    runs = p6_runs()
    options = figures.parse_options(["modes=scratch,full", "epsilons=1", "optimizers=dpadamw",
                                     "non_private=false"])
    fig = figures.build("finetune", runs, **options)
    heights = bar_heights(fig)
    assert set(heights) == {"finetune|dpadamw|1|scratch", "finetune|dpadamw|1|full"}
    assert heights["finetune|dpadamw|1|full"] == pytest.approx(expected("dpadamw", 1.0, "full", 0.1))
    assert heights["finetune|dpadamw|1|scratch"] == pytest.approx(expected("dpadamw", 1.0, "scratch", 0.01))
    figures.plt.close(fig)
    # "lora" names every rank; the table follows the same options
    md = figures.build("finetune_table", runs, modes=["lora"], epsilons=[1.0], non_private=False)
    assert "## ε = 1" in md and "## ε = 3" not in md and "## non-private" not in md
    assert md.count("| LoRA (r = 16) |") == 2 and "from scratch" not in md.split("\n\n", 2)[2]


def test_the_table_gives_values_intervals_gaps_and_what_the_choice_spent():
    runs = p6_runs()
    data = figures.finetune_data(runs, "P6")
    md = figures.build("finetune_table", runs)
    assert md.startswith("# P6: test accuracy per optimizer and fine-tuning mode")
    assert md.index("## ε = 1") < md.index("## ε = 3") < md.index("## non-private (ε = ∞)")
    r = row(data, "dpsgd", 1.0, "full")
    gap_np = expected("dpsgd", 1.0, "full", 0.01) - expected("adamw", None, "full", 0.01)
    gap_s = expected("dpsgd", 1.0, "full", 0.01) - expected("dpsgd", 1.0, "scratch", 0.01)
    line = (f"| DP-SGD | full | 847,912 | {r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] | 1 | "
            f"−{abs(gap_np):.3f} | +{gap_s:.3f} | 0.01 | `{{}}` | 3 | 6 | – |")
    assert line in md
    assert "| DP-SGD | LoRA (r = 16) | 152,616 |" in md and "| = 2 |" in md
    assert "chosen on the validation split" in md


# -- P5: perplexity and exposure per mode -------------------------------------------------------

def _canaries(opt, eps, mode, seed):
    """Three canaries per k: DP and LoRA each cut the exposure of the k = 25 canaries."""
    scale = (0.2 if eps is not None else 3.0) * (0.3 if mode == "lora" else 1.0) * (0.0 if mode == "scratch" else 1.0)
    out = []
    for k in (0, 1, 5, 25):
        for j in range(3):
            e = 1.0 + scale * k ** 0.5 * (1 + 0.1 * j) + 0.5 * seed
            out.append({"repeats": k, "exposure": e, "extracted": e > 15})
    return out


def p5_runs():
    rows = []
    for (opt, eps), mode, lr, seed in itertools.product([("dpsgd", 1.0), ("adamw", None)], ["scratch", "full", "lora"],
                                                        LRS, SEEDS):
        loss = 4.0 - BASE[mode] - OPT[opt] - LR_TERM[mode][lr] + 0.01 * seed
        r = _row("P5", "language-model", opt, eps, mode, lr, seed, loss + 0.05, loss, 16 if mode == "lora" else None)
        r.update(memorisation_columns({"canaries": _canaries(opt, eps, mode, seed)}))
        rows.append(r)
    return pd.DataFrame(rows)


def test_p5_bars_are_test_perplexity_and_exposure_per_mode():
    runs = p5_runs()
    data = figures.finetune_data(runs, "P5")
    r = row(data, "dpsgd", 1.0, "lora-r16")
    assert r["metric"] == "test perplexity" and r["lr"] == 0.1  # lowest validation loss
    ppl = [math.exp(4.0 - 0.45 - 0.0 - 0.06 + 0.01 * s + 0.05) for s in SEEDS]
    assert r["value"] == pytest.approx(statistics.mean(ppl)) and r["n_seeds"] == 3
    # ranks: lower perplexity first
    order = data[(data.optimizer == "dpsgd") & (data.epsilon == 1.0)].sort_values("rank")["mode"].tolist()
    assert order == ["full", "lora-r16", "scratch"]
    # exposure at k = 25 pooled over the chosen configuration's seeds and canaries
    for opt, eps, mode in [("adamw", None, "lora"), ("adamw", None, "full"), ("dpsgd", 1.0, "full")]:
        raw = [c["exposure"] for s in SEEDS for c in _canaries(opt, eps, mode, s) if c["repeats"] == 25]
        r = row(data, opt, math.inf if eps is None else eps, "lora-r16" if mode == "lora" else mode)
        assert r["exposure"] == pytest.approx(statistics.mean(raw)) and r["n_canaries"] == 9
        assert r["exposure_std"] == pytest.approx(statistics.stdev(raw))
    # non-private AdamW in LoRA memorises less than in full fine-tuning
    assert row(data, "adamw", math.inf, "lora-r16")["exposure"] < row(data, "adamw", math.inf, "full")["exposure"]
    fig = figures.build("finetune_exposure", runs)
    heights = bar_heights(fig)
    assert heights["finetune|adamw|inf|lora-r16"] == pytest.approx(row(data, "adamw", math.inf, "lora-r16")["exposure"])
    assert len(heights) == len(data)
    figures.plt.close(fig)
    md = figures.build("finetune_table", runs, problem="P5")
    assert "exposure (k = 25)" in md and "| AdamW (non-private) | LoRA (r = 16) |" in md


@pytest.mark.parametrize("figure_id", ["finetune", "finetune_table", "finetune_exposure"])
def test_every_finetune_figure_writes_its_files_and_draws_an_old_table(tmp_path, figure_id):
    runs = p5_runs() if figure_id == "finetune_exposure" else p6_runs()
    runs_path = tmp_path / "runs.parquet"
    runs.to_parquet(runs_path)
    paths = figures.plot(figure_id, runs_path, tmp_path / "figs" / figure_id)
    assert [p.suffix for p in paths] == [f".{e}" for e in figures.extensions(figure_id)]
    if figure_id != "finetune_table":
        assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[0].stat().st_size > 20_000
    # a table aggregated before runs recorded their start: nothing to compare, said so
    old = runs.drop(columns=["start", "finetune", "lora_rank", "trainable_parameters", "checkpoint_sha256"])
    out = figures.build(figure_id, old, **({"problem": "P5"} if figure_id == "finetune_table" else {}))
    assert ("No fine-tuning runs" in out) if isinstance(out, str) else "no fine-tuning runs" in out.texts[0].get_text()
    if not isinstance(out, str):
        figures.plt.close(out)


def test_figures_of_runs_trained_from_scratch_are_unchanged_by_the_start_columns():
    """A runs table aggregated now carries the start columns for every run, None for P1-P4
    (``finetune``) and missing ranks: every figure draws the same numbers as from a table without
    them (the language-model figures merged on the configuration keys and failed on a None)."""
    from test_figures import classification_runs, lm_runs

    cases = [(classification_runs, lambda r: figures.best_per_setting(r, privacy=False)),
             (classification_runs, lambda r: figures.heatmap_data(r, "P1", privacy=False)),
             (classification_runs, figures.seed_sensitivity_data),
             (lm_runs, figures.lm_ranking_data), (lm_runs, figures.lm_exposure_data), (lm_runs, figures.lm_loss_data)]
    for make, data in cases:
        runs = make()
        started = runs.assign(start="scratch", finetune=None, lora_rank=pd.array([pd.NA] * len(runs), dtype="Int64"),
                              trainable_parameters=pd.array([1000] * len(runs), dtype="Int64"), checkpoint_sha256=None)
        before, after = data(runs), data(started)
        assert len(before) > 0
        pd.testing.assert_frame_equal(before.reset_index(drop=True), after[before.columns].reset_index(drop=True),
                                      check_dtype=False)


# -- the papers' claims tested (finetune_claims) ---------------------------------------------------

def test_the_difference_interval_is_paired_by_seed_else_welch():
    from scipy import stats

    from dpbench.reporting.figures.intervals import contrast_interval, difference_interval

    # paired: the per-seed differences [1, 2, 3]: mean 2, half-width t_{0.975, 2} * 1 / sqrt(3)
    mean, low, high, n, how = difference_interval(pd.Series([2.0, 4.0, 6.0]), pd.Series([1.0, 2.0, 3.0]))
    assert (mean, n, how) == (2.0, 3, "paired")
    assert high - mean == pytest.approx(2.4841377118, abs=1e-9) and mean - low == pytest.approx(2.4841377118, abs=1e-9)
    # other seeds: Welch. a = [1, 2, 3] (s^2 = 1), b = [2, 4, 6, 8] (s^2 = 20/3): mean -3, SE^2 = 1/3 + 5/3 = 2,
    # df = 4 / ((1/3)^2 / 2 + (5/3)^2 / 3) = 4.0755
    a, b = pd.Series([1.0, 2.0, 3.0], index=[0, 1, 2]), pd.Series([2.0, 4.0, 6.0, 8.0], index=[0, 1, 2, 3])
    mean, low, high, n, how = difference_interval(a, b)
    half = stats.t.ppf(0.975, 4 / ((1 / 3) ** 2 / 2 + (5 / 3) ** 2 / 3)) * math.sqrt(2.0)
    assert (mean, n, how) == (-3.0, 3, "Welch") and (low, high) == pytest.approx((-3 - half, -3 + half))
    assert (low, high) == pytest.approx(tuple(stats.ttest_ind(a, b, equal_var=False).confidence_interval()))
    # a contrast of four (a difference of gaps), paired: per seed (a - b) - (c - d)
    s = [pd.Series(v) for v in ([5.0, 6.0, 7.0], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.0, 0.0, 1.0])]
    mean, low, high, n, how = contrast_interval([(1, s[0]), (-1, s[1]), (-1, s[2]), (1, s[3])])
    per_seed = [2.0, 3.0, 5.0]
    half = stats.t.ppf(0.975, 2) * statistics.stdev(per_seed) / math.sqrt(3)
    assert (mean, how) == (pytest.approx(10 / 3), "paired")
    assert (low, high) == pytest.approx((10 / 3 - half, 10 / 3 + half))
    # one seed of a term: the mean alone
    mean, low, high, n, how = difference_interval(pd.Series([0.5], index=[0]), a)
    assert mean == pytest.approx(-1.5) and n == 1 and math.isnan(low) and math.isnan(high)


def test_the_verdicts():
    from dpbench.reporting.figures.finetune_claims import verdict

    assert verdict(0.17, 0.23, 3, 1, 0.15) == "holds"
    assert verdict(0.01, 0.10, 3, 1, 0.15) == "direction only"
    assert verdict(-0.03, -0.01, 3, -1, 0.02) == "holds" and verdict(-0.015, -0.01, 3, -1, 0.02) == "direction only"
    assert verdict(-0.01, 0.02, 3, 1) == "not supported" and verdict(-0.05, -0.01, 3, 1) == "reversed"
    assert verdict(0.01, 0.02, 1, 1) == "–" and verdict(math.nan, math.nan, 3, 1) == "–"
    assert verdict(-1.0, 2.0, 3, 0) == "no difference found" and verdict(1.0, 2.0, 3, 0) == "differs"
    assert verdict(1e-17, 0.01, 3, 1) == "not supported"  # an end within rounding of 0 is 0
    # an interval of width 0 (equal differences on every seed, no test records counted) measured no
    # noise: no verdict, whether at 0 or beside it (claim 4b on P7 was once "reversed" on one)
    assert verdict(-1e-17, 1e-17, 3, 1) == "–" and verdict(-0.02, -0.02, 3, 1) == "–"


def _claim_runs(values: dict, problem="P6", task="classification") -> pd.DataFrame:
    """Runs of ``values`` {(optimizer, ε or None, mode): [test value per seed]}: each at lr 0.01,
    beside a rate 0.1 that looks worse on validation and would show 0.99 (P6) if it were chosen."""
    rows = []
    for (opt, eps, mode), per_seed in values.items():
        for seed, v in enumerate(per_seed):
            rank = 16 if mode == "lora" else None
            if task == "classification":
                rows.append(_row(problem, task, opt, eps, mode, 0.01, seed, v, 0.5, rank))
                rows.append(_row(problem, task, opt, eps, mode, 0.1, seed, 0.99, 0.2, rank))
            else:
                rows.append(_row(problem, task, opt, eps, mode, 0.01, seed, v, 3.0, rank))
                rows.append(_row(problem, task, opt, eps, mode, 0.1, seed, 0.1, 4.0, rank))
    runs = pd.DataFrame(rows)
    runs["lora_rank"] = pd.array(runs["lora_rank"].astype(float), dtype="Int64")
    return runs


def _rows(md: str, number: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines()
            if line.startswith(f"| {number} (")]


def test_each_verdict_from_a_runs_table_whose_answers_are_known():
    from dpbench.reporting.figures.finetune_claims import claims_data

    adamw = [0.40, 0.41, 0.42]
    runs = _claim_runs({
        ("dpadamw", 1.0, "full"): [0.30, 0.31, 0.32],
        ("dpadam", 1.0, "full"): [0.10, 0.12, 0.11],          # 1: +0.20 [0.175, 0.225], claimed 0.15: holds
        ("dpadamw-bc", 1.0, "full"): [0.290, 0.299, 0.311],   # 2a: -0.010 [-0.0125, -0.0075]: direction only
        ("dpadambc", 1.0, "full"): [0.12, 0.10, 0.11],        # 2b: differences [+0.02, -0.02, 0]: not supported
        ("dpdisk", 1.0, "full"): [0.25, 0.25, 0.28],          # 3: [-0.05, -0.06, -0.04]: reversed
        ("dpadamw", 1.0, "lora"): [0.20, 0.21, 0.22],
        ("dpdisk", 1.0, "lora"): [0.30],                      # 4a: one seed: –
        ("adamw", None, "full"): adamw})
    data = claims_data(runs)
    verdicts = {n: [r["verdict"] for r in rows] for n, rows in data.items()}
    assert verdicts == {"1": ["holds"], "2a": ["direction only"], "2b": ["not supported"], "3": ["reversed"],
                        "4a": ["–"], "4b": [], "5": [], "6a": [], "6b": [], "6c": [], "7": []}
    one = data["1"][0]
    half = stats_t2() * 0.01 / math.sqrt(3)
    assert (one["diff"], one["low"], one["high"]) == pytest.approx((0.20, 0.20 - half, 0.20 + half))
    assert one["n"] == 3 and one["seeds"] == "3, paired" and one["claimed"] == "+0.150"
    assert data["2a"][0]["claimed"] == "−0.020" and data["2a"][0]["high"] < 0 < data["2a"][0]["low"] + 0.02
    assert data["3"][0]["claimed"] == "+0.038" and data["3"][0]["diff"] == pytest.approx(-0.05)
    # the values are finetune_data's chosen configurations (lr 0.01, not the 0.99 of lr 0.1)
    fd = figures.finetune_data(runs, "P6")
    r = row(fd, "dpadamw", 1.0, "full")
    assert r["lr"] == 0.01 and one["A value"] == f"{r.value:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"
    md = figures.build("finetune_claims", runs)
    assert md.startswith("# The papers' claims on private fine-tuning, tested")
    assert "1M-parameter" in md and "QNLI" in md and "ε_sel" in md and "paired by seed" in md
    # the scale sentence names the problem's model: P7's public encoder, not P6's small transformer
    p7 = figures.draw_claims_table({}, problem="P7")
    assert "all-MiniLM-L6-v2, a 22.6M-parameter" in p7 and "P7 the test accuracy" in p7 and "1M-parameter" not in p7
    assert _rows(md, "1") == [["1 (Chooi et al. 2025): DP-AdamW beats DP-Adam by more than 15 points at every ε",
                               "P6", "1", "full", "DP-AdamW", "DP-Adam", "0.310 [0.285, 0.335]", "0.110 [0.085, 0.135]",
                               f"+0.200 [+{0.2 - half:.3f}, +{0.2 + half:.3f}]", "+0.150", "3, paired", "–", "holds"]]
    assert _rows(md, "4a")[0][6:8] == ["0.300", "0.210 [0.185, 0.235]"]  # one seed: no interval
    assert _rows(md, "4a")[0][-3:] == ["1, Welch", "–", "–"]
    for number in ("4b", "5", "6a", "6b", "6c", "7"):
        (only,) = _rows(md, number)
        assert only[-1] == "not run" and set(only[1:-1]) == {"–"}


def test_the_dp_adamw_papers_mode_last_block_answers_claims_1_to_3_but_not_the_lora_ones():
    """Runs in mode last-block (the DP-AdamW paper's) give rows to claims 1, 2a, 2b and 3, labelled
    "last block", and none to the LoRA claims 4a and 4b."""
    from dpbench.reporting.figures.finetune_claims import claims_data

    runs = _claim_runs({("dpadamw", 1.0, "last-block"): [0.30, 0.31, 0.32],
                        ("dpadam", 1.0, "last-block"): [0.30, 0.32, 0.31],
                        ("dpadamw-bc", 1.0, "last-block"): [0.20, 0.22, 0.21],
                        ("dpadambc", 1.0, "last-block"): [0.10, 0.11, 0.11],
                        ("dpdisk", 1.0, "last-block"): [0.35, 0.37, 0.36],  # (unequal differences)
                        ("dpsgd", 1.0, "last-block"): [0.33, 0.34, 0.35]})
    data = claims_data(runs)
    got = {n: [(r["mode"], r["verdict"]) for r in rows] for n, rows in data.items() if rows}
    assert got == {"1": [("last block", "not supported")], "2a": [("last block", "holds")],
                   "2b": [("last block", "reversed")], "3": [("last block", "holds")]}
    assert data["3"][0]["diff"] == pytest.approx(0.05) and data["2a"][0]["diff"] == pytest.approx(-0.10)


def test_the_linear_probe_claim_on_p7_compares_head_with_full_per_optimizer():
    """Claim 7 (Tramèr & Boneh 2021) on P7: an optimizer's chosen configuration in mode head minus
    in mode full, paired by seed; claims 1-4 are tested on P7 when asked for it."""
    from dpbench.reporting.figures.finetune_claims import claims_data

    runs = _claim_runs({("dpsgd", 1.0, "head"): [0.50, 0.52, 0.51], ("dpsgd", 1.0, "full"): [0.30, 0.31, 0.32],
                        ("dpadamw", 1.0, "head"): [0.40, 0.41, 0.42], ("dpadam", 1.0, "head"): [0.40, 0.42, 0.41]},
                       "P7")
    assert claims_data(runs)["7"] == []  # P6's claims: no P6 runs
    data = claims_data(runs, problem="P7")
    (seven,) = data["7"]
    assert (seven["problem"], seven["mode"], seven["verdict"]) == ("P7", "head vs full", "holds")
    assert seven["diff"] == pytest.approx(0.20) and seven["n"] == 3
    assert [(r["mode"], r["verdict"]) for r in data["1"]] == [("head (linear probe)", "not supported")]
    md = figures.build("finetune_claims", runs, problem="P7")
    assert _rows(md, "7")[0][1:4] == ["P7", "1", "head vs full"]


def test_runs_from_two_public_checkpoints_are_never_pooled_as_seeds():
    """The start's checkpoint is part of a configuration (its SHA-256 a configuration key): runs
    of two checkpoints never average as seeds of one bar; each is its own configuration."""
    runs = _claim_runs({("dpsgd", 1.0, "full"): [0.30, 0.31, 0.32, 0.90, 0.91, 0.92]})
    other = runs["seed"] >= 3
    runs.loc[other, "checkpoint_sha256"] = "cd" * 32
    runs.loc[other, "seed"] -= 3  # seeds 0-2 of a second checkpoint
    (r,) = figures.finetune_data(runs, "P6").itertuples()
    # one checkpoint's three seeds (their validation scores tie: the first), never the six pooled (0.61)
    assert r.n_seeds == 3 and r.value == pytest.approx(0.31)
    assert r.n_configs == 4  # two rates x two checkpoints, chosen among (and paid for: ε_sel)


def stats_t2() -> float:
    return 4.302652729749464  # t_{0.975, 2}


def _p5_exposure_runs() -> pd.DataFrame:
    """P5 with the exposure of the k = 25 canaries set per run (three canaries each)."""
    exposure = {("adamw", None, "full"): [10.0, 11.0, 12.0], ("adamw", None, "lora"): [4.0, 6.0, 5.0],
                ("dpsgd", 1.0, "full"): [5.0, 4.0, 6.0]}
    runs = _claim_runs({key: [3.5, 3.6, 3.7] for key in exposure}, "P5", "language-model")
    for (opt, eps, mode), per_seed in exposure.items():
        for seed, e in enumerate(per_seed):
            at = (runs.optimizer == opt) & (runs["finetune"] == mode) & (runs.seed == seed)
            runs.loc[at, ["exposure_k25", "exposure_std_k25", "canaries_k25", "extracted_k25"]] = [e, 0.0, 3, 0.0]
    return runs


def test_pretraining_shrinks_the_gap_and_lora_against_dp_sgd_exposure():
    from dpbench.reporting.figures.finetune_claims import claims_data

    p6 = _claim_runs({("adamw", None, "full"): [0.60, 0.62, 0.61], ("dpsgd", 1.0, "full"): [0.50, 0.51, 0.52],
                      ("adamw", None, "scratch"): [0.40, 0.41, 0.42], ("dpsgd", 1.0, "scratch"): [0.10, 0.12, 0.11]})
    runs = pd.concat([p6, _p5_exposure_runs()], ignore_index=True)
    data = claims_data(runs)
    # 5: gap full [-0.10, -0.11, -0.09], gap scratch [-0.30, -0.29, -0.31]: (full) - (scratch) [0.20, 0.18, 0.22]
    (five,) = data["5"]  # P5 has no scratch runs: no P5 row
    per_seed = [0.20, 0.18, 0.22]
    half = stats_t2() * statistics.stdev(per_seed) / math.sqrt(3)
    assert (five["diff"], five["low"], five["high"]) == pytest.approx((statistics.mean(per_seed),
                                                                        statistics.mean(per_seed) - half,
                                                                        statistics.mean(per_seed) + half))
    assert five["verdict"] == "holds" and five["problem"] == "P6" and five["mode"] == "full vs from scratch"
    gap = row(figures.finetune_data(runs, "P6"), "dpsgd", 1.0, "full")["gap_non_private"]
    assert five["A value"].startswith(f"−{abs(gap):.3f} [")  # finetune_data's gap to the non-private reference
    # 6: exposure at k = 25, AdamW LoRA [4, 6, 5], AdamW full [10, 11, 12], DP-SGD full at ε = 1 [5, 4, 6]
    assert [(r["ε"], r["diff"], r["verdict"]) for r in data["6a"]] == [("∞", pytest.approx(-6.0), "holds")]
    assert [(r["ε"], r["diff"], r["verdict"]) for r in data["6b"]] == [("1", pytest.approx(-6.0), "holds")]
    (six,) = data["6c"]  # LoRA - DP-SGD per seed [-1, 2, -1]: mean 0
    half = stats_t2() * statistics.stdev([-1, 2, -1]) / math.sqrt(3)
    assert (six["low"], six["high"]) == pytest.approx((-half, half)) and six["verdict"] == "no difference found"
    assert six["A"] == "AdamW (non-private), LoRA (r = 16)" and six["B"] == "DP-SGD, full"


def test_dpbench_plot_finetune_claims_writes_the_table(tmp_path):
    from dpbench import cli

    runs = pd.concat([_claim_runs({("dpadamw", 1.0, "full"): [0.30, 0.31, 0.32],
                                   ("dpadam", 1.0, "full"): [0.10, 0.12, 0.11]}), _p5_exposure_runs()],
                     ignore_index=True)
    runs.to_parquet(tmp_path / "runs.parquet")
    assert cli.main(["plot", "finetune_claims", "--runs", str(tmp_path / "runs.parquet"),
                     "--out", str(tmp_path / "claims")]) == 0
    md = (tmp_path / "claims.md").read_text()
    assert _rows(md, "1")[0][-1] == "holds" and _rows(md, "6c")[0][-1] == "no difference found"
    assert _rows(md, "2a")[0][-1] == "not run"
    # the scale a verdict is about, measured from the runs: steps, and N = L / q (64 / (64 / 13,072))
    assert "for 400 steps on 13,072 training records, so a verdict here is about this scale only" in md
    assert figures.extensions("finetune_claims") == ("md",)
    # a table without the start columns: every claim not run
    old = runs.drop(columns=["start", "finetune", "lora_rank", "trainable_parameters", "checkpoint_sha256"])
    md = figures.build("finetune_claims", old)
    assert all(r[-1] == "not run" for n in ("1", "2a", "5", "6c") for r in _rows(md, n))


def test_a_perplexity_that_blew_up_is_printed_in_three_significant_digits():
    """A run at test loss 35 has perplexity e^35 ≈ 1.586e+15: the tables print 1.59e+15, not 20 digits;
    ordinary values keep the table's format."""
    from dpbench.reporting.figures.finetune import number

    assert number(math.exp(35), ".2f") == "1.59e+15"
    assert number(-math.exp(35), ".2f") == "-1.59e+15"
    assert number(13.684, ".2f") == "13.68" and number(99999.0, ".2f") == "99999.00"
    assert number(0.1234, ".3f") == "0.123"


@pytest.mark.parametrize("option,match", [
    ("non_private=maybe", "option non_private of figure finetune_table: expected true or false, got 'maybe'"),
    ("epsilons=1,abc", "option epsilons of figure finetune_table: expected finite positive numbers"),
    ("epsilons=1,-2", "option epsilons of figure finetune_table: expected finite positive numbers"),
    ("k=abc", "option k of figure finetune_table: expected a positive integer, got 'abc'"),
    ("optimizers=dpadamx", "option optimizers of figure finetune_table: 'dpadamx' is not in .*did you mean 'dpadamw'"),
    ("modes=lorra", "option modes of figure finetune_table: 'lorra' is not in .*did you mean 'lora'"),
])
def test_dpbench_plot_refuses_an_option_value_of_the_wrong_type_or_an_unknown_name(tmp_path, capsys, option, match):
    """Figure options are typed and checked before drawing: one line naming the option (today a
    traceback, a message naming no option, claims silently "not run", or an empty figure)."""
    import re

    from dpbench import cli

    p6_runs().to_parquet(tmp_path / "runs.parquet")
    code = cli.main(["plot", "finetune_table", "--runs", str(tmp_path / "runs.parquet"), "--out",
                     str(tmp_path / "t"), "--option", option])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and re.search(match, err), err
    assert not (tmp_path / "t.md").exists()
    # the same option values, well formed, draw the table
    assert cli.main(["plot", "finetune_table", "--runs", str(tmp_path / "runs.parquet"), "--out", str(tmp_path / "t"),
                     "--option", "non_private=false", "--option", "epsilons=1", "--option", "k=6",
                     "--option", "optimizers=dpadamw", "--option", "modes=lora"]) == 0
