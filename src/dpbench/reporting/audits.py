"""Audit files -> one table, and what the benchmark's other tables and figures need from it.

Torch-free (the aggregation and figure rules run in an environment without torch): it reads
only the ``audit`` metadata of each file written by ``dpbench audit``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import pandas as pd

from dpbench.reporting.results import read_meta, write_table

COLUMNS = ("optimizer", "mechanism_origin", "epsilon_claimed", "seed", "delta", "beta", "trials", "mode", "epsilon_lower",
           "epsilon_gdp", "epsilon_gdp_sound", "mu_lower", "violation", "violation_statistical", "participation_ok",
           "sensitivity_ok", "sensitivity_moved", "stages", "postprocessing", "max_certifiable_epsilon", "noise_multiplier", "sample_rate", "steps", "family",
           "hyperparameters", "caveat", "seconds", "file")


def audit_row(path: str | Path) -> dict:
    meta = read_meta(path)
    if "audit" not in meta:
        raise ValueError(f"{path} is not a dpbench audit file (no 'audit' metadata)")
    a = meta["audit"]
    claim, checks = a["claim"], a.get("checks", {})
    return {
        "optimizer": claim["optimizer"], "mechanism_origin": claim.get("mechanism_origin", "built-in"),
        "epsilon_claimed": a["epsilon_claimed"], "seed": int(a.get("seed", 0)), "delta": a["delta"],
        "beta": a["beta"], "trials": a["trials"], "mode": a["mode"], "epsilon_lower": a["epsilon_lower"],
        "epsilon_gdp": a["epsilon_gdp"], "epsilon_gdp_sound": a.get("epsilon_gdp_sound", False),
        "mu_lower": a.get("mu_lower", float("nan")), "violation": bool(a["violation"]),
        "violation_statistical": bool(a.get("violation_statistical", a["violation"])),
        "participation_ok": checks.get("participation", {}).get("ok", True),
        # the white-box check of the clipped sum (dpbench.audit.sensitivity); absent in older files
        "sensitivity_ok": checks.get("sensitivity", {}).get("ok", True),
        "sensitivity_moved": checks.get("sensitivity", {}).get("max_moved_per_sensitivity", float("nan")),
        "stages": _stages(claim.get("stages")),
        "postprocessing": checks.get("postprocessing"),
        "max_certifiable_epsilon": a.get("max_certifiable_epsilon", float("nan")),
        "noise_multiplier": claim["noise_multiplier"], "sample_rate": claim["sample_rate"], "steps": claim["steps"],
        "family": a["family"]["statistic"], "hyperparameters": json.dumps(claim["hyperparameters"], sort_keys=True),
        "caveat": claim.get("caveat"), "seconds": sum(a.get("seconds", {}).values()), "file": str(path),
    }


def _stages(stages: dict | None) -> str:
    """The step's own stages as ``clip_and_sum (plugin), ...``; "" where all are DPStep's or unrecorded."""
    return ", ".join(f"{stage} ({origin})" for stage, origin in (stages or {}).items())


def collect(paths: Iterable[str | Path]) -> pd.DataFrame:
    rows = [audit_row(p) for p in paths]
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    return df.sort_values(["optimizer", "epsilon_claimed", "seed"], ignore_index=True)


def aggregate_audits(paths: Iterable[str | Path], out: str | Path) -> pd.DataFrame:
    """The table of the audit files ``paths`` (one row per audit), written to ``out``."""
    df = collect(paths)
    write_table(df, out)
    return df


def violations(audits: pd.DataFrame) -> dict[str, bool]:
    """optimizer -> whether any of its audits flagged a violation (optimizers not audited absent)."""
    return {str(o): bool(v) for o, v in audits.groupby("optimizer")["violation"].any().items()}


def over_seeds(audits: pd.DataFrame) -> pd.DataFrame:
    """One row per (optimizer, claimed ε, mode) over the seeds audited (``audit.seed`` a list, or
    tables of several seeds concatenated): the mean ε_lower with its 95 % t interval over seeds
    (``ci_low``, ``ci_high``; the value itself for one seed), the mean ε_GDP, a violation if any
    seed's audit flagged one, the smallest max_certifiable_epsilon, and ``n_seeds``."""
    from dpbench.reporting.figures.intervals import t_interval

    rows = []
    keys = [k for k in ("optimizer", "epsilon_claimed", "mode") if k in audits]
    for _, g in audits.groupby(keys, sort=True):
        row = g.iloc[0].copy()
        row["epsilon_lower"], row["ci_low"], row["ci_high"], _ = t_interval(g["epsilon_lower"])
        row["epsilon_gdp"] = float(g["epsilon_gdp"].astype(float).mean())
        row["violation"] = bool(g["violation"].any())
        if "max_certifiable_epsilon" in g:
            row["max_certifiable_epsilon"] = float(g["max_certifiable_epsilon"].min())
        row["n_seeds"] = len(g)
        rows.append(row)
    return pd.DataFrame(rows).reset_index(drop=True)


def markdown(audits: pd.DataFrame) -> str:
    """The audits as a Markdown table, one row per optimizer and one column per claimed epsilon:
    ``ε_lower / ε_GDP`` of each audit (over several seeds: mean ± half the 95 % t interval of
    ε_lower, the mean ε_GDP, and the seeds), **VIOLATION** where the claim is refuted (by any
    seed); then the trials, the statistic family and the median wall time (s) per audit."""
    seconds = audits.groupby("optimizer")["seconds"].median()
    audits = over_seeds(audits)
    epsilons = sorted(audits["epsilon_claimed"].unique())
    head = ["optimizer"] + [f"ε* = {e:g}" for e in epsilons] + ["R", "statistic", "s / audit"]
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * (len(head) - 1)) + " |"]
    for optimizer, group in audits.groupby("optimizer", sort=True):
        by_eps = {row.epsilon_claimed: row for row in group.itertuples()}
        cells = []
        for e in epsilons:
            row = by_eps.get(e)
            spread = f" ± {(row.ci_high - row.ci_low) / 2:.2f}" if row is not None and row.n_seeds > 1 else ""
            seeds = f" ({row.n_seeds} seeds)" if row is not None and row.n_seeds > 1 else ""
            cells.append("—" if row is None else f"{row.epsilon_lower:.2f}{spread} / {row.epsilon_gdp:.2f}{seeds}"
                         + (" **VIOLATION**" if row.violation else ""))
        trials = "/".join(str(t) for t in sorted(group["trials"].unique()))
        lines.append(f"| `{optimizer}` | " + " | ".join(cells) + f" | {trials} | {group['family'].iloc[0]} | "
                     f"{seconds[optimizer]:.0f} |")
    return "\n".join(lines) + "\n"
