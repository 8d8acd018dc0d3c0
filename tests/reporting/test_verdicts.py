"""Verdicts that survive ties and test noise: the tie rule of a configuration choice, the claims'
intervals that count the test records as well as the seeds (paired on the same records, never of
width 0), the power calculation that sizes a study, and the per-record outcomes they read. Every
expected number is worked out by hand in the comments."""

import math

import numpy as np
import pandas as pd
import pytest

from dpbench.reporting import figures
from dpbench.reporting.figures.intervals import (Components, record_contrast_interval, records_needed, seeds_needed,
                                                 zero_discordance_bound)
from dpbench.reporting.results import pack_outcomes, unpack_outcomes
from test_figures_finetune import _row

T_975 = {2: 4.302652729749464, 3: 3.182446305284263, 9: 2.262157162740992}


def _term(w, rows, n=None, outcomes=True):
    """A term of record_contrast_interval from per-seed 0/1 rows (seeds 0, 1, ...)."""
    rows = [np.array(r, dtype=np.uint8) for r in rows]
    x = pd.Series([r.mean() for r in rows])
    out = pd.Series(rows, dtype=object) if outcomes else None
    counts = pd.Series([len(r) if n is None else n for r in rows])
    return (w, x, out, counts)


def test_three_equal_differences_get_the_test_records_noise_not_a_zero_width_interval():
    # records drawn per seed; on each seed A is right on record 0 of 4 and B on none: D_s = 0.25
    # on all three seeds (the t interval over seeds: width 0). Per record d = [1, 0, 0, 0]: variance
    # (0.75^2 + 3 * 0.25^2) / 3 = 0.25 within every seed; between seeds nothing beyond it. Var(mean)
    # = 0.25 / (4 * 3) = 1/48, df = 3 * (4 - 1) = 9: half-width 2.262157 * sqrt(1/48) = 0.326514
    # (above the floor 1 - 0.025^(1/12) = 0.264648)
    a = _term(1, [[1, 0, 0, 0]] * 3)
    b = _term(-1, [[0, 0, 0, 0]] * 3)
    c = record_contrast_interval([a, b], shared_records=False)
    assert (c.mean, c.n, c.records, c.how) == (0.25, 3, 4, "seeds + records")
    assert (c.components.seed, c.components.residual) == (0.0, pytest.approx(0.25))
    half = T_975[9] * math.sqrt(1 / 48)
    assert half == pytest.approx(0.326514, abs=1e-6)
    assert (c.low, c.high) == pytest.approx((0.25 - half, 0.25 + half))
    assert zero_discordance_bound(12) == pytest.approx(0.264648, abs=1e-6) and zero_discordance_bound(12) < half


def test_records_shared_by_every_seed_count_once_not_once_per_seed():
    # the same 4 records on every seed, d = [1, 0, 0, 0] on each: the seeds agree (no seed or
    # residual variance) and the evidence is 4 records, not 12. Record means r = [1, 0, 0, 0],
    # grand mean 0.25: MS_records = 3 * (0.75^2 + 3 * 0.25^2) / 3 = 0.75, s2_record = 0.75 / 3 = 0.25;
    # Var(mean) = 0.25 / 4 = 1/16 on MS_records' df 3: half-width 3.182446 * 0.25 = 0.795612 (floor:
    # 1 - 0.025^(1/4) = 0.602365)
    a, b = _term(1, [[1, 0, 0, 0]] * 3), _term(-1, [[0, 0, 0, 0]] * 3)
    c = record_contrast_interval([a, b], shared_records=True)
    assert c.how == "seeds × records"
    assert (c.components.seed, c.components.record, c.components.residual) == pytest.approx((0.0, 0.25, 0.0))
    assert (c.low, c.high) == pytest.approx((0.25 - 0.795612, 0.25 + 0.795612), abs=1e-6)
    assert zero_discordance_bound(4) == pytest.approx(0.602365, abs=1e-6)


def test_seeds_that_spread_more_than_the_records_keep_the_t_interval_over_seeds():
    # 4 records per seed, D_s = 0, 0.5, 1 (A right on 0, 2, 4 of 4 records, B on none): the t
    # interval over seeds, 0.5 +- 4.302653 * 0.5 / sqrt(3) = 0.5 +- 1.242069, is wider than the
    # records' (within-seed variance 0, 1/3, 0: mean 1/9; 1/9 / 4 = 0.0278 < var(D_s) = 0.25)
    a = _term(1, [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    b = _term(-1, [[0, 0, 0, 0]] * 3)
    c = record_contrast_interval([a, b], shared_records=False)
    assert c.components.seed == pytest.approx(0.25 - (1 / 9) / 4)
    assert (c.low, c.high) == pytest.approx((0.5 - 1.242069, 0.5 + 1.242069), abs=1e-6)


def test_identical_predictions_get_the_exact_bound_on_records_that_differ():
    # A and B right on the same records of every seed: every d is 0, no variance at all. The
    # interval is +- the 95 % Clopper-Pearson bound on a share seen in 0 of N draws, 1 - 0.025^(1/N):
    # N = 3 * 500 records drawn per seed: 0.0024562; the same 500 records for every seed: 0.0073506
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 2, 500) for _ in range(3)]
    a, b = _term(1, rows), _term(-1, rows)
    nested = record_contrast_interval([a, b], shared_records=False)
    assert nested.mean == 0 and (nested.low, nested.high) == pytest.approx((-0.0024562, 0.0024562), abs=1e-7)
    shared = record_contrast_interval([_term(1, [rows[0]] * 3), _term(-1, [rows[0]] * 3)], shared_records=True)
    assert (shared.low, shared.high) == pytest.approx((-0.0073506, 0.0073506), abs=1e-7)


def test_runs_without_per_record_outcomes_fall_back_to_the_least_record_noise_their_accuracies_allow():
    # D_s = 0.02 on each of 3 seeds of 500 records, no outcomes recorded: a per-record d in
    # {-1, 0, 1} with mean 0.02 has variance at least 0.02 * 0.98 (* 500/499 as a sample variance):
    # Var(mean) >= 0.0196 * 500/499 / 1500 = 1.30929e-5, df 1497 (t 1.961549): +- 0.0070977
    a = (1, pd.Series([0.52, 0.42, 0.32]), None, pd.Series([500] * 3))
    b = (-1, pd.Series([0.50, 0.40, 0.30]), None, pd.Series([500] * 3))
    c = record_contrast_interval([a, b], shared_records=False)
    assert c.how == "seeds + record floor" and c.mean == pytest.approx(0.02)
    assert (c.high - c.low) / 2 == pytest.approx(0.0070977, abs=1e-6)
    # without the records' count: the seeds alone, as before (width 0: the verdict is "–")
    c = record_contrast_interval([(1, a[1], None, None), (-1, b[1], None, None)], shared_records=False)
    assert c.how == "paired" and c.high - c.low == pytest.approx(0.0, abs=1e-15)
    from dpbench.reporting.figures.finetune_claims import verdict

    assert verdict(c.low, c.high, c.n, 1) == "–"


def test_outcomes_that_do_not_give_the_recorded_accuracy_are_refused_naming_the_seed():
    a = _term(1, [[1, 0, 0, 0]] * 3)
    a[1].loc[1] = 0.5
    with pytest.raises(ValueError, match=r"^seed 1: the per-record test outcomes \(4 records, accuracy 0.25\)"):
        record_contrast_interval([a, _term(-1, [[0, 0, 0, 0]] * 3)], shared_records=False)


def test_outcomes_pack_to_one_bit_a_record_and_back():
    correct = np.array([1, 0, 1, 1, 0, 0, 0, 1, 1, 1], dtype=bool)
    text = pack_outcomes(correct)
    # little bit order: byte 0 = 1 + 4 + 8 + 128 = 141, byte 1 = 1 + 2 = 3; base64 of [141, 3]
    assert text == "jQM="
    assert unpack_outcomes(text, 10).tolist() == correct.astype(int).tolist()
    with pytest.raises(ValueError, match="2 bytes hold 16 bits, not the 20 records recorded"):
        unpack_outcomes(text, 20)
    with pytest.raises(ValueError, match="not base64"):
        unpack_outcomes("j!M=", 10)


def test_seeds_and_records_needed_for_plus_minus_two_points():
    # per-record variance 0.25 only (records drawn per seed): Var(mean) = 0.25 / (n S) on df
    # S (n - 1). At n = 500: S = 4 gives 1.961151 * sqrt(0.25 / 2000) = 0.021926 > 0.02, S = 5
    # 1.960892 * 0.01 = 0.019609: 5 seeds. At S = 3: n >= 0.25 * t^2 / (3 * 0.0004) = 801.1 (t
    # 1.96093): n = 801 gives 0.0200012, n = 802 0.0199888: 802 records
    records = Components(seed=0.0, record=0.0, residual=0.25, shared=False)
    assert records.half_width(4, 500) == pytest.approx(0.021926, abs=1e-6)
    assert records.half_width(5, 500) == pytest.approx(0.019609, abs=1e-6)
    assert seeds_needed(records, 500) == 5 and records_needed(records, 3) == 802
    # a between-seed variance 0.0004 only: half-width t_{S-1} * 0.02 / sqrt(S) <= 0.02 iff
    # t_{S-1} <= sqrt(S): S = 6 has t_5 = 2.5706 > 2.4495, S = 7 t_6 = 2.4469 < 2.6458: 7 seeds;
    # at 3 seeds no count of records does (t_2 * 0.011547 = 0.0497)
    seeds = Components(seed=0.0004, record=0.0, residual=0.0, shared=False)
    assert seeds_needed(seeds, 500) == 7 and records_needed(seeds, 3) is None
    # records shared by every seed with s2_record = 0.25: the term 0.25 / n never shrinks with
    # seeds; at n = 500, 1.96 * sqrt(0.25 / 500) = 0.0438: no number of seeds reaches 0.02
    assert seeds_needed(Components(0.0, 0.25, 0.0, shared=True), 500, most=200) is None


def _tie_runs(val_loss_b: float) -> pd.DataFrame:
    """P6, full, ε = 1: DP-AdamW and DP-Adam, two rates each, seeds 0-2. DP-Adam's two rates tie
    on validation accuracy (0.5 each seed); lr 0.1's validation loss is ``val_loss_b`` against lr
    0.01's 0.5. DP-AdamW's test accuracy is 0.30, 0.32, 0.31; DP-Adam's 0.20, 0.21, 0.22 at lr 0.01
    and 0.30, 0.31, 0.33 at lr 0.1."""
    rows = []
    for seed in range(3):
        rows.append(_row("P6", "classification", "dpadamw", 1.0, "full", 0.01, seed, [0.30, 0.32, 0.31][seed], 0.6))
        rows.append(_row("P6", "classification", "dpadamw", 1.0, "full", 0.1, seed, 0.05, 0.1))
        for lr, test in ((0.01, [0.20, 0.21, 0.22]), (0.1, [0.30, 0.31, 0.33])):
            r = _row("P6", "classification", "dpadam", 1.0, "full", lr, seed, test[seed], 0.5)
            r["best_val_loss"] = 0.5 if lr == 0.01 else val_loss_b
            rows.append(r)
    return pd.DataFrame(rows)


def test_a_tie_on_validation_accuracy_goes_to_the_lower_validation_loss_then_config_order():
    runs = _tie_runs(0.4)
    data = figures.finetune_data(runs, "P6")
    adam = data[data.optimizer == "dpadam"].iloc[0]
    assert adam.lr == 0.1 and adam.n_tied == 2 and adam.value == pytest.approx(0.94 / 3)
    assert data[data.optimizer == "dpadamw"].iloc[0].n_tied == 1
    # equal losses too: the first in config order (the lower rate)
    assert figures.finetune_data(_tie_runs(0.5), "P6").set_index("optimizer").loc["dpadam", "lr"] == 0.01
    from dpbench.reporting.figures.finetune import tied_runs

    passed = tied_runs(runs, "P6")
    assert sorted(passed.lr) == [0.01] * 3 and set(passed.choice) == {1}


def test_a_verdict_that_a_tied_choice_flips_is_marked_tie_sensitive():
    # claim 1, DP-AdamW - DP-Adam (claimed +0.15). Chosen DP-Adam lr 0.1 (the lower loss): per-seed
    # differences 0, 0.01, -0.02, t interval contains 0: not supported. The tied lr 0.01: 0.10,
    # 0.11, 0.09, mean 0.10 +- 4.302653 * 0.01 / sqrt(3) = [0.0752, 0.1248]: direction only
    from dpbench.reporting.figures.finetune_claims import claims_data

    (one,) = claims_data(_tie_runs(0.4))["1"]
    assert one["verdict"] == "not supported · tie-sensitive" and one["tie_sensitive"]
    assert one["ties"] == "1 of 1: direction only (1)"
    (two,) = claims_data(_tie_runs(0.6))["1"]  # lr 0.01 chosen: the tied lr 0.1 flips it back
    assert two["verdict"] == "direction only · tie-sensitive" and two["diff"] == pytest.approx(0.10)
    md = figures.build("finetune_claims", _tie_runs(0.4))
    assert "tie-sensitive" in md and "| ties |" in md


def test_the_claims_table_sizes_each_difference_from_its_runs_as_a_pilot():
    # claim 1 on 500 test records per seed (drawn per seed), no per-record outcomes: per-seed
    # differences 0.20, 0.19, 0.21 (variance 1e-4). Record floor: (0.2*0.8 + 0.19*0.81 + 0.21*0.79) / 3
    # * 500/499 = 0.160254, over n = 500 above 1e-4: s2_seed = 0. Interval: the seeds' t interval,
    # 4.302653 * 0.01 / sqrt(3) = 0.02484 (the records' 1.96155 * sqrt(0.160254 / 1500) = 0.02027).
    # Seeds for +-0.02 at 500 records: 3 give 0.02027, 4 give 1.96133 * sqrt(0.160254 / 2000) =
    # 0.01756: 4. Records at 3 seeds: 513 give 0.020016, 514 give 0.019996: 514
    from dpbench.reporting.figures.finetune_claims import claims_data, draw_sizing, sizing
    from test_figures_finetune import _claim_runs

    runs = _claim_runs({("dpadamw", 1.0, "full"): [0.30, 0.31, 0.32], ("dpadam", 1.0, "full"): [0.10, 0.12, 0.11]})
    runs["test_subset"] = 500
    data = claims_data(runs)
    (one,) = data["1"]
    assert one["seeds"] == "3, seeds + record floor, n = 500"
    assert (one["high"] - one["low"]) / 2 == pytest.approx(T_975[2] * 0.01 / math.sqrt(3))
    (row,) = sizing(data)
    assert row["var_seed"] == 0.0 and row["var_residual"] == pytest.approx(0.160254, abs=1e-6)
    assert (row["seeds_needed"], row["records_needed"], row["lower_bound"]) == (4, 514, True)
    assert "| 1 | P6 | 1 | full | DP-AdamW | DP-Adam | 0.025 | 3 × 500 |" in draw_sizing([row])
    assert "~ 4 | ~ 514 |" in draw_sizing([row])
