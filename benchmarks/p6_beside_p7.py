"""P6's fine-tuning results beside P7's, as one Markdown table on stdout.

P6 and P7 are one 40-class text classification task on the same records (the runs' dataset and
training, validation and test subsets are checked to be equal): P6 fine-tunes the ~1M-parameter
model pretrained in-house, P7 the public all-MiniLM-L6-v2 encoder. Each problem's numbers are
``finetune_table``'s (``dpbench.reporting.figures.finetune.finetune_data``, applied to that
problem's runs alone): per (ε, optimizer, mode) the configuration with the best mean validation
score over its seeds among that mode's runs, and its test accuracy as the mean over seeds with
the 95 % t interval over them. A row per (ε, optimizer, mode) present in either problem: P6's
value, P7's, and P7 − P6 (the difference of the two means); "–" where a side has no such
comparison (P7 has no from-scratch twin, P6 no mode head or bias). Rows by ε (non-private: ∞,
last), then optimizer and mode in the table's orders.

Then claim 5 (Li et al. 2022; Yu et al. 2022: with public pretraining the cost of privacy nearly
vanishes) across the two problems: per private optimizer and ε, its gap to non-private training
(its chosen configuration minus the best non-private one of the same mode and problem) in P7's
mode full, minus the same gap in P6 from scratch (no public start) and in P6's mode full (the
in-house public start); the difference with its 95 % interval, paired by seed (seed i draws the
same records in both problems) and a verdict, as ``finetune_claims`` gives them.

Usage:  python benchmarks/p6_beside_p7.py [--p6 benchmarks/results/finetune/study/runs.parquet]
            [--p7 benchmarks/results/encoder/study/runs.parquet]
"""

from __future__ import annotations

import argparse
import math

import pandas as pd

from dpbench.reporting.figures import check_one_delta
from dpbench.problems.modes import SCRATCH, Full
from dpbench.reporting.figures.finetune import chosen_runs, finetune_data, mode_label, number, ordered_modes
from dpbench.reporting.figures.finetune_claims import CLAIMS, gap_contrast
from dpbench.reporting.figures.intervals import INTERVAL
from dpbench.reporting.figures.style import fmt_tick, label, legend_labels, ordered

P6_RUNS = "benchmarks/results/finetune/study/runs.parquet"
P7_RUNS = "benchmarks/results/encoder/study/runs.parquet"
# what makes two problems' runs the same records (P6's file also holds P5's runs)
RECORDS = ["dataset", "train_subset", "validation_size", "test_subset"]


def records(runs: pd.DataFrame) -> str:
    """The records the runs trained and were measured on, as text (one entry per distinct setting)."""
    columns = [c for c in RECORDS if c in runs]
    rows = runs[columns].astype(str).drop_duplicates().sort_values(columns).itertuples(index=False)
    return "; ".join(", ".join(f"{c} {v}" for c, v in zip(columns, row)) for row in rows)


def value(data: pd.DataFrame, key: tuple[float, str, str]) -> pd.Series | None:
    """``finetune_data``'s row of (ε, optimizer, mode), None where there is none."""
    rows = data[(data["epsilon"] == key[0]) & (data["optimizer"] == key[1]) & (data["mode"] == key[2])]
    return None if rows.empty else rows.iloc[0]


def cell(row: pd.Series | None) -> str:
    """A value as the table writes it: mean [interval] over seeds (the mean alone for one seed)."""
    if row is None or not math.isfinite(row["value"]):
        return "diverged" if row is not None and row["diverged"] else "–"
    if row["n_seeds"] >= 2 and math.isfinite(row["ci_low"]):
        return f"{number(row['value'], '.3f')} [{number(row['ci_low'], '.3f')}, {number(row['ci_high'], '.3f')}]"
    return number(row["value"], ".3f")


def difference(p6: pd.Series | None, p7: pd.Series | None) -> str:
    if p6 is None or p7 is None or not math.isfinite(p7["value"] - p6["value"]):
        return "–"
    d = p7["value"] - p6["value"]
    return ("+" if d >= 0 else "−") + number(abs(d), ".3f")


def table(p6_runs: pd.DataFrame, p7_runs: pd.DataFrame, p6_name: str, p7_name: str) -> str:
    """The Markdown table of P6's runs beside P7's (module docstring)."""
    p6_runs, p7_runs = p6_runs[p6_runs["problem"] == "P6"], p7_runs[p7_runs["problem"] == "P7"]
    both = pd.concat([p6_runs, p7_runs], ignore_index=True)
    check_one_delta("p6_beside_p7", both, {"problems": ["P6", "P7"]})  # an ε at another δ is another guarantee
    if records(p6_runs) != records(p7_runs):
        raise SystemExit(f"P6 and P7 ran on different records: {records(p6_runs)} against {records(p7_runs)}")
    p6, p7 = finetune_data(p6_runs, "P6"), finetune_data(p7_runs, "P7")
    for problem, data, name in (("P6", p6, p6_name), ("P7", p7, p7_name)):
        if data.empty:
            raise SystemExit(f"{name} holds no fine-tuning runs of {problem}")
    metric = p6["metric"].iloc[0]
    labels = legend_labels(both)
    shown = pd.concat([p6, p7], ignore_index=True)
    optimizers, modes = ordered(shown["optimizer"]), ordered_modes(shown["mode"])
    keys = sorted({(e, o, m) for e, o, m in zip(shown["epsilon"], shown["optimizer"], shown["mode"])},
                  key=lambda k: (k[0], optimizers.index(k[1]), modes.index(k[2])))
    lines = [f"# P6 (`{p6_name}`) beside P7 (`{p7_name}`): {metric}", "",
             f"Records: {records(p6_runs)}. Per ε (the target met; ∞: non-private), optimizer and mode, each "
             f"problem's configuration chosen as finetune_table chooses it (the best mean validation score over its "
             f"seeds among that mode's runs of that problem); its {metric}, mean over seeds [{INTERVAL}]. "
             "P7 − P6: the difference of the two means; –: no such comparison in that problem.", "",
             f"| ε | optimizer | mode | P6 {metric} | P7 {metric} | P7 − P6 |",
             "| ---: | --- | --- | ---: | ---: | ---: |"]
    for key in keys:
        a, b = value(p6, key), value(p7, key)
        lines.append(f"| {fmt_tick(key[0]) if math.isfinite(key[0]) else '∞'} | {label(key[1], labels)} | "
                     f"{mode_label(key[2])} | {cell(a)} | {cell(b)} | {difference(a, b)} |")
    return "\n".join(lines + [""] + pretraining(p6_runs, p7_runs, labels)) + "\n"


GAP_COLUMNS = ["ε", "A", "B", "A value", "B value", "A − B", "seeds", "verdict"]


def pretraining(p6_runs: pd.DataFrame, p7_runs: pd.DataFrame, labels: dict) -> list[str]:
    """Claim 5 across the problems (module docstring): Markdown lines, a note where no pair is run."""
    claim = next(c for c in CLAIMS if c.number == "5")
    p6, p7 = chosen_runs(p6_runs, "P6"), chosen_runs(p7_runs, "P7")
    rows = [row for base, name in ((SCRATCH, "P6 from scratch"), (Full.name, "P6 full"))
            for row in gap_contrast(claim, "P7", (p7, Full.name, "P7 full"), (p6, base, name), labels, ".3f")]
    lines = [f"## Claim 5 ({claim.paper}): {claim.text}", "",
             "A: a private optimizer's gap to non-private training in P7's mode full (the public MiniLM start); "
             "B: the same optimizer's gap in P6 from scratch or in P6's mode full (the in-house start), on the same "
             "records. A − B > 0: the public start shrinks the gap. Mean over seeds [95 % interval], paired by seed "
             "and counting the test records' noise as finetune_claims does (the seeds column says how).",
             ""]
    if not rows:
        return lines + ["No pair yet: it needs P7's mode full and P6's from-scratch or full runs, private and "
                        "non-private."]
    lines += ["| " + " | ".join(GAP_COLUMNS) + " |",
              "| " + " | ".join("---" if c in ("A", "B", "verdict") else "---:" for c in GAP_COLUMNS) + " |"]
    return lines + ["| " + " | ".join(str(r[c]) for c in GAP_COLUMNS) + " |" for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--p6", default=P6_RUNS, help="runs.parquet holding P6's runs (default: %(default)s)")
    parser.add_argument("--p7", default=P7_RUNS, help="runs.parquet holding P7's runs (default: %(default)s)")
    args = parser.parse_args(argv)
    print(table(pd.read_parquet(args.p6), pd.read_parquet(args.p7), args.p6, args.p7), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
