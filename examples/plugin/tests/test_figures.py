"""The plugin's figure: a well-formed figure spec, one row per (problem, optimizer, target epsilon)
with its runs counted and the largest epsilon achieved, restricted by its options. Run with the
plugin installed: ``python -m pytest examples/plugin/tests``."""

import pandas as pd

from dpbench.plugin import check_figure
from dpbench_example.figures import PRIVACY_TABLE, privacy_table


def runs():
    row = {"problem": "digits", "optimizer_origin": "built-in", "mechanism_origin": "built-in", "status": "completed"}
    return pd.DataFrame([
        {**row, "optimizer": "dpsgd-momentum", "optimizer_origin": "plugin dpbench-example-plugin 0.1.0",
         "target_epsilon": 4.0, "epsilon": 3.2},
        {**row, "optimizer": "dpsgd-momentum", "optimizer_origin": "plugin dpbench-example-plugin 0.1.0",
         "target_epsilon": 4.0, "epsilon": 3.9, "status": "diverged"},
        {**row, "optimizer": "dpsgd", "target_epsilon": 4.0, "epsilon": 3.99},
        {**row, "optimizer": "dpsgd", "problem": "P2", "target_epsilon": 1.0, "epsilon": 0.5},
    ])


def test_the_spec_is_well_formed():
    check_figure(PRIVACY_TABLE)
    assert PRIVACY_TABLE.id == "privacy_table" and PRIVACY_TABLE.kind == "table"


def test_one_row_per_problem_optimizer_and_target():
    lines = privacy_table(runs()).splitlines()
    assert lines[0].startswith("| problem | optimizer | origin |") and len(lines) == 2 + 3
    assert lines[2] == "| P2 | dpsgd | built-in | built-in | 1 | 1 | 1 | 0.5 |"
    assert lines[3] == "| digits | dpsgd | built-in | built-in | 4 | 1 | 1 | 3.99 |"  # the thesis's order first
    assert lines[4] == ("| digits | dpsgd-momentum | plugin dpbench-example-plugin 0.1.0 | built-in | 4 | 2 | 1 | 3.9 |")
    only = privacy_table(runs(), optimizers=["dpsgd-momentum"], problem="digits").splitlines()
    assert len(only) == 3 and "dpsgd-momentum" in only[2]
