"""A figure for dpbench, as one spec: ``PRIVACY_TABLE``, a Markdown table of the runs per problem
and optimizer with the privacy they promised and achieved.

One row per (problem, optimizer, target epsilon): where the optimizer comes from
(``optimizer_origin``: built-in, or the plugin and its version), whose privacy claim it is
(``mechanism_origin``), the number of runs and of completed ones, and the largest epsilon any of
them achieved (the accountant's, for the steps taken). Nothing is chosen among the runs, so the
table spends no privacy beyond the runs' own; it reads only columns of the runs table.

Registration: the entry point ``privacy_table = "dpbench_example.figures:PRIVACY_TABLE"`` in the
group ``dpbench.figures`` (the entry point's name is the figure's id, ``PRIVACY_TABLE.id``). It
imports no torch, as the figure environments have none.
"""

from __future__ import annotations

import math

from dpbench.plugin import FigureSpec, ordered, select_runs

COLUMNS = ("problem", "optimizer", "origin", "claim", "target ε", "runs", "completed", "largest ε achieved")


def _number(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"


def privacy_table(runs, optimizers=None, problem=None) -> str:
    """The table as Markdown; ``optimizers`` (a list) and ``problem`` (an id) restrict the rows."""
    runs = select_runs(runs, None, optimizers, [problem] if problem else None)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for prob in sorted(runs["problem"].unique()):
        of_problem = runs[runs["problem"] == prob]
        for name in ordered(of_problem["optimizer"], optimizers):
            of_optimizer = of_problem[of_problem["optimizer"] == name]
            for target, group in of_optimizer.groupby("target_epsilon", dropna=False, sort=True):
                completed = group[group["status"] == "completed"]
                lines.append("| " + " | ".join([
                    prob, name, str(group["optimizer_origin"].iloc[0]), str(group["mechanism_origin"].iloc[0]),
                    _number(target), str(len(group)), str(len(completed)),
                    _number(float(group["epsilon"].max()) if len(group) else math.nan)]) + " |")
    return "\n".join(lines) + "\n"


PRIVACY_TABLE = FigureSpec("privacy_table", privacy_table,
                           "runs per problem, optimizer and target epsilon, with the largest epsilon achieved",
                           {}, kind="table")
