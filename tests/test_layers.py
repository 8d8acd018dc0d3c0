"""Layers point one way: no import cycle in the package, storage never imports the
orchestrator. (That aggregation and figures need no torch: tests/test_envs.py.)"""

import pkgutil

import dpbench
from dpbench.pipeline import fingerprint


def import_graph() -> dict[str, set[str]]:
    """dpbench module -> the dpbench modules it imports, statically (imports inside functions
    included), as dpbench.pipeline.fingerprint reads them."""
    modules = ["dpbench"] + [m.name for m in pkgutil.walk_packages(dpbench.__path__, "dpbench.")]
    return {m: set(fingerprint._imports(m)) - {m} for m in modules}


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


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30 and "dpbench.seeds" in graph["dpbench.matrix.cache"]
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]  # the check itself works


def test_storage_and_the_training_loop_do_not_reach_up():
    graph = import_graph()
    below_train = fingerprint.module_closure(("dpbench.matrix.cache", "dpbench.matrix.dense_mechanism",
                                              "dpbench.training.harness", "dpbench.seeds"))
    assert "dpbench.training.train" not in below_train and "dpbench.cli" not in below_train
    # the training loop is handed its optimizer and code key: it imports neither the registry
    # nor the fingerprints
    assert not graph["dpbench.training.train"] & {"dpbench.optimizers", "dpbench.pipeline.fingerprint", "dpbench.cli"}
