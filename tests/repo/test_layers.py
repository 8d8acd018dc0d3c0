"""Layers point one way: the package's floors are the table in docs/layout.md ("Layers"); no
module imports one on a higher floor, no import cycle, storage never imports the orchestrator.
(That aggregation and figures need no torch: tests/repo/test_envs.py.)"""

import pkgutil
import re
from pathlib import Path

import dpbench
from conftest import REPO
from dpbench.pipeline import fingerprint

LAYOUT = REPO / "docs" / "layout.md"


def import_graph() -> dict[str, set[str]]:
    """dpbench module -> the dpbench modules it imports, statically (imports inside functions
    included), as dpbench.pipeline.fingerprint reads them."""
    modules = ["dpbench"] + [m.name for m in pkgutil.walk_packages(dpbench.__path__, "dpbench.")]
    return {m: set(fingerprint._imports(m)) - {m} for m in modules}


def floors() -> dict[str, int]:
    """The table of docs/layout.md's "Layers" section: name under src/dpbench/ (a folder or a
    module; ``__init__`` is the package's own) -> its floor, 1 the ground."""
    section = LAYOUT.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    table = {}
    for floor, names in re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", section, re.M):
        for name in re.findall(r"`([\w.]+)`", names):
            assert name not in table, f"{name} stands on two floors"
            table[name] = int(floor)
    return table


def floor_of(module: str, table: dict[str, int]) -> int:
    """The floor of the longest name of the table that holds the module."""
    name = module.removeprefix("dpbench").removeprefix(".") or "__init__"
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in table:
            return table[".".join(parts[:n])]
    raise AssertionError(f"{module} has no floor in {LAYOUT.relative_to(REPO)} (section Layers)")


def upward_imports(graph: dict[str, set[str]], table: dict[str, int]) -> list[tuple[str, str]]:
    """Every import of a module on a higher floor than the importer's."""
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if floor_of(b, table) > floor_of(a, table))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, found = {}, []

    def visit(node, path):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_the_layer_table_is_read_and_the_audit_is_on_top():
    table = floors()
    assert table["files"] == table["seeds"] == 1 and table["privacy"] == 2
    assert table["audit"] == max(v for k, v in table.items() if k not in ("cli", "__main__")) < table["cli"]
    assert list(table.values()) == sorted(table.values()), "the table goes from the ground up"


def test_no_import_runs_from_a_lower_floor_up():
    graph, table = import_graph(), floors()
    assert len(graph) > 30 and "dpbench.seeds" in graph["dpbench.matrix.store.cache"]
    assert {floor_of(m, table) for m in graph} == set(table.values())  # every floor holds a module
    assert upward_imports(graph, table) == []
    # nothing below the audit imports it: only the command does (its audit commands)
    assert {a for a, targets in graph.items() for b in targets
            if b.startswith("dpbench.audit") and not a.startswith("dpbench.audit")} == {"dpbench.cli.audit"}


def test_the_floor_check_catches_a_planted_violation():
    graph, table = import_graph(), floors()
    planted = {**graph, "dpbench.mechanisms.base": graph["dpbench.mechanisms.base"] | {"dpbench.audit.bounds"}}
    found = set(upward_imports(planted, table)) - set(upward_imports(graph, table))
    assert found == {("dpbench.mechanisms.base", "dpbench.audit.bounds")}
    # a module's own row overrides its folder's: the profiles put on the ground reach up to privacy
    found = set(upward_imports(graph, {**table, "privacy.profiles": 1})) - set(upward_imports(graph, table))
    assert found == {("dpbench.privacy.profiles", "dpbench.privacy"),
                     ("dpbench.privacy.profiles", "dpbench.privacy.accounting")}
    try:
        floor_of("dpbench.newfolder.loader", table)
    except AssertionError as e:
        assert "dpbench.newfolder.loader has no floor" in str(e)
    else:
        raise AssertionError("a module without a floor passed")


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]  # the check itself works


def test_storage_and_the_training_loop_do_not_reach_up():
    graph = import_graph()
    below_train = fingerprint.module_closure(("dpbench.matrix.store.cache", "dpbench.mechanisms.dense_matrix",
                                              "dpbench.training.harness", "dpbench.seeds"))
    assert "dpbench.training.train" not in below_train and not any(m.startswith("dpbench.cli") for m in below_train)
    # the training loop (train and its stages) is handed its optimizer and code key: it imports
    # neither the registry nor the fingerprints
    training = [m for m in graph if m.startswith("dpbench.training.")]
    assert {"dpbench.training.config", "dpbench.training.checkpoint"} <= set(training)
    for module in training:
        assert not {b for b in graph[module] if b in ("dpbench.optimizers", "dpbench.pipeline.fingerprint")
                    or b.startswith("dpbench.cli")}, module


def test_modules_fit_in_one_reading():
    """No module of the package over 500 lines, and the workflow's common.smk only input
    functions and what needs Snakemake (at most 150 lines): the config's semantics live in
    dpbench.pipeline."""
    src = Path(dpbench.__file__).parent
    long = {str(p.relative_to(src)): n for p in sorted(src.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}
    common = src.parents[1] / "workflow" / "rules" / "common.smk"
    assert len(common.read_text().splitlines()) <= 150
