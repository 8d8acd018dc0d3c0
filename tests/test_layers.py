"""Layers point one way: no import cycle in the package, storage never imports the
orchestrator, and the aggregation and figure commands run without torch (their conda
environment has none)."""

import pkgutil
import subprocess
import sys

import dpbench
from conftest import REPO, run_cell
from dpbench import fingerprint
from dpbench.results import write_run
from dpbench.train import RunConfig


def import_graph() -> dict[str, set[str]]:
    """dpbench module -> the dpbench modules it imports, statically (imports inside functions
    included), as dpbench.fingerprint reads them."""
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
    below_train = fingerprint.module_closure(("dpbench.matrix.cache", "dpbench.matrix.mechanism",
                                              "dpbench.harness", "dpbench.seeds"))
    assert "dpbench.train" not in below_train and "dpbench.cli" not in below_train
    # the training loop is handed its optimizer and code key: it imports neither the registry
    # nor the fingerprints
    assert not graph["dpbench.train"] & {"dpbench.optimizers", "dpbench.fingerprint", "dpbench.cli"}


def test_aggregate_and_plot_run_without_torch(tmp_path, tiny_fmnist):
    """`dpbench aggregate` and `dpbench plot` (their rules use envs/analysis.yaml, which has no
    torch) never import it: with torch made unimportable, both commands run to the end on a
    real run file."""
    res = run_cell(RunConfig(problem="P2", optimizer="sgd", lr=0.1, batch_size=60, epochs=1, seed=0, max_steps=2,
                             test_subset=50, progress_every_s=1e9))
    write_run(tmp_path / "run.parquet", res.metrics, {**res.meta, "run_id": "run"})
    code = f"""
import sys


class NoTorch:  # any `import torch` now raises ImportError, as in an environment without it
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ImportError("torch is not installed here")


sys.meta_path.insert(0, NoTorch())
sys.path.insert(0, {str(REPO / "src")!r})
from dpbench.cli import main
assert main(["aggregate", "run.parquet", "--out-runs", "runs.parquet", "--out-epochs", "epochs.parquet"]) == 0
assert main(["plot", "fig5_1", "--runs", "runs.parquet", "--out", "fig"]) == 0
assert not [m for m in sys.modules if m.split(".")[0] == "torch"]
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert (tmp_path / "fig.png").stat().st_size > 1000 and (tmp_path / "epochs.parquet").exists()
