"""benchmarks/p6_beside_p7.py: P6's fine-tuning table beside P7's, from synthetic runs tables
whose chosen configurations are known by construction."""

import itertools

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, load_file

SEEDS = [0, 1, 2]
# the chosen configuration's mean test accuracy per (problem, ε, optimizer, mode); None: non-private
CHOSEN = {("P6", 1.0, "dpsgd", "scratch"): 0.100, ("P6", 1.0, "dpsgd", "full"): 0.200,
          ("P7", 1.0, "dpsgd", "full"): 0.350, ("P7", 1.0, "dpsgd", "head"): 0.250,
          ("P7", 1.0, "dpadam", "head"): 0.230,
          ("P6", 3.0, "dpsgd", "scratch"): 0.140, ("P6", 3.0, "dpsgd", "full"): 0.260,
          ("P7", 3.0, "dpsgd", "full"): 0.380, ("P7", 3.0, "dpsgd", "head"): 0.290,
          ("P6", None, "adamw", "full"): 0.600, ("P6", None, "adamw", "scratch"): 0.300,
          ("P7", None, "adamw", "full"): 0.520}


def _row(problem, eps, opt, mode, lr, seed, test, val, train_subset=1600):
    private = eps is not None
    return {"run_id": f"{problem}/{opt}/{mode}-eps{eps}-lr{lr:g}-s{seed}", "problem": problem,
            "dataset": "fortunes", "task": "classification" if problem != "P5" else "language-model",
            "optimizer": opt, "private": private, "dp_guarantee": private, "lr": lr, "batch_size": 32, "epochs": 1,
            "seed": seed, "hyperparameters": "{}", "target_epsilon": eps if private else np.nan,
            "epsilon": eps * 0.99 if private else np.inf, "delta": 1e-5 if private else np.nan,
            "noise_multiplier": 1.0 if private else 0.0, "sample_rate": 32 / 1400, "steps": 44,
            "accountant": "prv", "mechanism_origin": "built-in", "accounted_history": None, "status": "completed",
            "n_val": 200, "train_subset": train_subset, "validation_size": 200, "test_subset": 500,
            "best_test_accuracy": test, "best_test_loss": 1.0 - test, "best_val_accuracy": val,
            "best_val_loss": 1.0 - val, "test_accuracy_at_best_val": test, "test_loss_at_best_val": 1.0 - test,
            "start": "scratch" if mode == "scratch" else "public", "finetune": mode, "lora_rank": None,
            "trainable_parameters": 1000, "checkpoint_sha256": None if mode == "scratch" else problem * 32}


def runs_of(problem: str) -> pd.DataFrame:
    """Two rates per comparison: validation prefers lr 0.1 (the chosen configuration, CHOSEN's
    mean); lr 0.01 scores 0.03 higher on test, so a choice on test would show other numbers.
    Seeds at -0.01, 0, +0.01 around the mean: the 95 % t interval is the mean ± 0.0248."""
    rows = []
    for ((p, eps, opt, mode), mean), seed in itertools.product(CHOSEN.items(), SEEDS):
        if p == problem:
            test = mean + 0.01 * (seed - 1)
            rows += [_row(p, eps, opt, mode, 0.1, seed, test, test + 0.05),
                     _row(p, eps, opt, mode, 0.01, seed, test + 0.03, test - 0.05)]
    if problem == "P6":  # P6's file holds P5's runs too, on other records: left out
        rows += [_row("P5", 1.0, "dpsgd", "full", 0.1, s, 0.9, 0.9, train_subset=3000) for s in SEEDS]
    return pd.DataFrame(rows)


def table_rows(text: str) -> list[list[str]]:
    """The rows of the first Markdown table in ``text``."""
    text = text.split("\n\n|", 1)[1].split("\n\n", 1)[0]
    lines = [line for line in ("|" + text).splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [line.strip("| ").split(" | ") for line in lines[1:]]


def test_each_problem_shows_its_own_chosen_configuration_beside_the_other(tmp_path, capsys):
    script = load_file(REPO / "benchmarks" / "p6_beside_p7.py")
    p6, p7 = tmp_path / "p6.parquet", tmp_path / "p7.parquet"
    runs_of("P6").to_parquet(p6)
    runs_of("P7").to_parquet(p7)
    assert script.main(["--p6", str(p6), "--p7", str(p7)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"# P6 (`{p6}`) beside P7 (`{p7}`): test accuracy"
    assert "Records: dataset fortunes, train_subset 1600, validation_size 200, test_subset 500." in out
    # rows by ε (∞ last), optimizers in the thesis order (DP-SGD before DP-Adam), modes scratch first
    assert table_rows(out) == [
        ["1", "DP-SGD", "from scratch", "0.100 [0.075, 0.125]", "–", "–"],
        ["1", "DP-SGD", "full", "0.200 [0.175, 0.225]", "0.350 [0.325, 0.375]", "+0.150"],
        ["1", "DP-SGD", "head (linear probe)", "–", "0.250 [0.225, 0.275]", "–"],
        ["1", "DP-Adam", "head (linear probe)", "–", "0.230 [0.205, 0.255]", "–"],
        ["3", "DP-SGD", "from scratch", "0.140 [0.115, 0.165]", "–", "–"],
        ["3", "DP-SGD", "full", "0.260 [0.235, 0.285]", "0.380 [0.355, 0.405]", "+0.120"],
        ["3", "DP-SGD", "head (linear probe)", "–", "0.290 [0.265, 0.315]", "–"],
        ["∞", "AdamW (non-private)", "from scratch", "0.300 [0.275, 0.325]", "–", "–"],
        ["∞", "AdamW (non-private)", "full", "0.600 [0.575, 0.625]", "0.520 [0.495, 0.545]", "−0.080"],
    ]


def test_claim_5_sets_p7_full_gap_against_p6_from_scratch_and_full(tmp_path):
    """Each gap is the optimizer's chosen configuration minus the same problem's and mode's
    non-private AdamW: P7 full at ε = 1 0.350 − 0.520 = −0.170; P6 from scratch 0.100 − 0.300 =
    −0.200, P6 full 0.200 − 0.600 = −0.400. Every seed shifts every configuration by the same
    0.01, so each gap and each difference is equal on every seed: the seeds' interval has width 0,
    and the differences' intervals are the test records' noise alone. These runs record no
    per-record outcomes, so it is the least their accuracies allow (``record_contrast_interval``'s
    floor): a difference D of four ±1 terms on 500 records per seed has per-record variance at least
    D (1 - D) 500 / 499, the mean's D (1 - D) / (499 * 3), half-width t_{0.975, 1497} times its root:
    D = 0.03 gives ± 0.00865, 0.02 ± 0.00710, 0.23 ± 0.02134, 0.20 ± 0.02028."""
    script = load_file(REPO / "benchmarks" / "p6_beside_p7.py")
    out = script.table(runs_of("P6"), runs_of("P7"), "p6.parquet", "p7.parquet")
    gaps = out.split("## Claim 5", 1)[1]
    assert table_rows(gaps) == [
        ["1", "DP-SGD − AdamW (non-private) (P7 full)", "DP-SGD − AdamW (non-private) (P6 from scratch)",
         "−0.170 [−0.170, −0.170]", "−0.200 [−0.200, −0.200]", "+0.030 [+0.021, +0.039]", "3, seeds + record floor, n = 500", "holds"],
        ["3", "DP-SGD − AdamW (non-private) (P7 full)", "DP-SGD − AdamW (non-private) (P6 from scratch)",
         "−0.140 [−0.140, −0.140]", "−0.160 [−0.160, −0.160]", "+0.020 [+0.013, +0.027]", "3, seeds + record floor, n = 500", "holds"],
        ["1", "DP-SGD − AdamW (non-private) (P7 full)", "DP-SGD − AdamW (non-private) (P6 full)",
         "−0.170 [−0.170, −0.170]", "−0.400 [−0.400, −0.400]", "+0.230 [+0.209, +0.251]", "3, seeds + record floor, n = 500", "holds"],
        ["3", "DP-SGD − AdamW (non-private) (P7 full)", "DP-SGD − AdamW (non-private) (P6 full)",
         "−0.140 [−0.140, −0.140]", "−0.340 [−0.340, −0.340]", "+0.200 [+0.180, +0.220]", "3, seeds + record floor, n = 500", "holds"],
    ]
    p7 = runs_of("P7")
    no_full = script.table(runs_of("P6"), p7[p7["finetune"] != "full"], "p6.parquet", "p7.parquet")
    assert "No pair yet: it needs P7's mode full" in no_full


def test_runs_on_other_records_are_refused():
    script = load_file(REPO / "benchmarks" / "p6_beside_p7.py")
    p7 = runs_of("P7").assign(train_subset=3000)
    with pytest.raises(SystemExit, match="P6 and P7 ran on different records"):
        script.table(runs_of("P6"), p7, "p6.parquet", "p7.parquet")


def test_runs_at_another_delta_are_refused():
    """An ε at another δ is another guarantee: the two problems' runs are not set side by side."""
    script = load_file(REPO / "benchmarks" / "p6_beside_p7.py")
    p7 = runs_of("P7")
    p7.loc[p7["private"], "delta"] = 1e-6
    with pytest.raises(ValueError, match="the runs have δ 1e-06, 1e-05"):
        script.table(runs_of("P6"), p7, "p6.parquet", "p7.parquet")
