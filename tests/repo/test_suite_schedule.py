"""scripts/test.sh's schedule (tests/conftest.py, ``--dist loadgroup``): the groups and lone tests
go to the two workers longest first, by the committed table of per-test times
(benchmarks/results/suite/durations.tsv, scripts/suite_durations.py), so that neither worker
idles while the other works through a queue of long tests. Shown on a simulated suite shaped like
the real one, against pytest-xdist's own order (the groups by their number of tests, then
collection order), and on the table itself."""

import types

import pytest
from xdist.remote import Producer

import conftest
from conftest import REPO, load_file


class Node:
    """A stand-in for a pytest-xdist worker: what it was sent, and whether it was told to stop."""

    def __init__(self, name):
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down = False
        self.received = []  # (index, the simulated time it arrived)
        self.now = 0.0

    def send_runtest_some(self, indices):
        self.received += [(i, self.now) for i in indices]

    def shutdown(self):
        self.shutting_down = True

    def __repr__(self):
        return self.gateway.id


def config():
    return types.SimpleNamespace(getvalue=lambda name: ["2*popen"], option=types.SimpleNamespace(loadscopereorder=True))


def simulate(scheduler_class, tests: dict[str, float], groups: dict[str, str]):
    """Runs ``tests`` ({test id: seconds}, in collection order) on two simulated workers as
    pytest-xdist does (a worker runs a test once it holds the next one, or was told to stop; the
    controller stops every worker once less than two tests are pending on each): (the time the
    last test ends, {worker: [the tests it ran]})."""
    class Scheduler(scheduler_class):
        def _split_scope(self, nodeid):
            return groups.get(nodeid, nodeid)

        def estimates(self):
            return conftest.Estimates(tests, set())

    nodes = [Node("gw0"), Node("gw1")]
    sched = Scheduler(config(), Producer("schedule", enabled=False))
    ids = list(tests)
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, ids)
    sched.schedule()
    clock, ran, now = {n: 0.0 for n in nodes}, {n: [] for n in nodes}, 0.0
    while True:
        ready = {}
        for n in nodes:
            if len(n.received) >= 2 or (n.received and n.shutting_down):
                start = max(clock[n], n.received[1][1] if len(n.received) >= 2 else now)
                ready[n] = start + tests[ids[n.received[0][0]]]
        if not ready:
            if any(n.received for n in nodes) and sched.tests_finished:
                for n in nodes:  # DSession.triggershutdown
                    n.shutdown()
                continue
            break
        node = min(ready, key=ready.get)
        now = clock[node] = ready[node]
        for n in nodes:
            n.now = now
        index, _ = node.received.pop(0)
        ran[node].append(ids[index])
        sched.mark_test_complete(node, index)
    assert not any(n.received for n in nodes), "tests sent and never run"
    return max(clock.values()), {n.gateway.id: r for n, r in ran.items()}


def suite_like_the_real_one():
    """The shape of the issue's measured suite: 1,900 short tests, the tiny workflow's group (a
    74 s fixture and long reruns), a timing group, the golden runs and long workflow tests in
    tests/repo/ and tests/workflow/, collected last."""
    tests, groups = {}, {}
    for i in range(1900):
        tests[f"tests/a/test_unit.py::test_{i}"] = 0.05 + (i % 7) * 0.1
    tests["tests/optimizers/test_optimizers.py::test_timed"] = 8.0
    tests["tests/repo/test_golden.py::test_the_golden_runs_reproduce"] = 98.0
    tests["tests/repo/test_golden.py::test_the_tolerant_comparison_passes_on_other_kernels"] = 94.0
    for name, seconds in (("plugin", 65), ("finetune", 59), ("tuning", 44), ("lm", 42), ("encoder", 30)):
        tests[f"tests/workflow/test_{name}.py::test_end_to_end"] = float(seconds)
    tests["tests/workflow/test_setups.py::test_timed"] = 6.0
    for i, seconds in enumerate((74 + 15, 68, 55, 40, 30, 24, 8, 8, 8, 8, 8, 8)):
        tests[f"tests/workflow/test_reruns.py::test_{i}"] = float(seconds)
    for nodeid in tests:
        if "test_reruns.py" in nodeid:
            groups[nodeid] = "tiny_workflow"
        elif nodeid.endswith("::test_timed"):
            groups[nodeid] = "timing"
    return tests, groups


def test_longest_first_ends_with_both_workers_busy_and_keeps_every_group_on_one_worker():
    from xdist.scheduler import LoadScopeScheduling

    tests, groups = suite_like_the_real_one()
    total, longest_group = sum(tests.values()), sum(s for t, s in tests.items() if groups.get(t) == "tiny_workflow")
    lower_bound = max(total / 2, longest_group)
    ours, ran = simulate(conftest._longest_first_class(), tests, groups)
    xdists, _ = simulate(LoadScopeScheduling, tests, groups)
    # every test once; each group on one worker
    assert sorted(ran["gw0"] + ran["gw1"]) == sorted(tests)
    for group in ("tiny_workflow", "timing"):
        members = {t for t, g in groups.items() if g == group}
        assert members <= set(ran["gw0"]) or members <= set(ran["gw1"]), group
    # within a few seconds of the best possible end (half the total), where xdist's order leaves
    # one worker idle for about a minute (the long tests collected last, each held behind another)
    assert ours <= lower_bound + 5, (ours, lower_bound)
    assert xdists >= ours + 50, (xdists, ours)
    # the longest scopes first: the group and the two golden runs start at once
    first = {ran["gw0"][0], ran["gw1"][0]}
    assert "tests/workflow/test_reruns.py::test_0" in first
    assert first & {"tests/repo/test_golden.py::test_the_golden_runs_reproduce"}


def test_a_test_not_in_the_table_is_short_unless_marked_slow():
    estimate = conftest.Estimates({"tests/x.py::test_known": 12.5}, {"tests/x.py::test_new_workflow"})
    assert estimate["tests/x.py::test_known"] == 12.5
    assert estimate["tests/x.py::test_new_workflow"] == conftest.SLOW_S
    assert estimate["tests/x.py::test_new_unit"] == conftest.SHORT_S
    order = conftest.longest_first_order({"a": {"tests/x.py::test_new_unit": False},
                                          "g": {"tests/x.py::test_known": False, "tests/x.py::test_new_unit": False},
                                          "b": {"tests/x.py::test_new_workflow": False},
                                          "c": {"tests/x.py::test_new_unit": False}}, estimate)
    assert order == ["b", "g", "a", "c"]  # 30, 12.6, then the short ones in collection order


def test_the_durations_table_round_trips_and_refuses_a_bad_line(tmp_path):
    durations = load_file(REPO / "scripts" / "suite_durations.py")
    table = tmp_path / "durations.tsv"
    durations.write_table(table, {"tests/a.py::test_b": (1.25, "passed"), "tests/a.py::test_c[x y]": (98.0, "passed")},
                          ["# a header"])
    lines = table.read_text().splitlines()
    assert lines[:3] == ["# a header", "test\tseconds\toutcome", "tests/a.py::test_c[x y]\t98.000\tpassed"]
    assert durations.estimates(table) == {"tests/a.py::test_b": 1.25, "tests/a.py::test_c[x y]": 98.0}
    table.write_text(table.read_text() + "tests/a.py::test_d 3.0\n")
    with pytest.raises(SystemExit, match=r"durations.tsv, line 5: not 'test<TAB>seconds<TAB>outcome'"):
        durations.estimates(table)
    assert durations.estimates(tmp_path / "none.tsv") == {}


def test_the_committed_table_names_collected_tests_and_its_measurement():
    """Every test in the committed table is one the suite has (a renamed test would silently fall
    back to short), and the header says how and where it was measured."""
    durations = load_file(REPO / "scripts" / "suite_durations.py")
    comments, rows = durations.read_table(durations.TABLE)
    assert any(c.startswith("# command: ") for c in comments) and any(c.startswith("# date: ") for c in comments)
    assert len(rows) >= 10 and all(seconds >= 0.5 for seconds, _ in rows.values())
    files = {test.split("::")[0] for test in rows}
    assert [f for f in sorted(files) if not (REPO / f).is_file()] == []
    for test in rows:
        path, _, name = test.partition("::")
        function = name.split("[")[0].split("::")[-1]
        assert f"def {function}(" in (REPO / path).read_text(), test


def test_the_durations_script_times_each_test_and_merges(tmp_path):
    """scripts/suite_durations.py on a generated test file: the test of 0.6 s in the table with
    its time, the fast and the skipped one left out; --merge keeps a row not run again."""
    import subprocess
    import sys

    (tmp_path / "test_generated.py").write_text(
        "import time, pytest\n"
        "def test_fast():\n    pass\n"
        "def test_slow():\n    time.sleep(0.6)\n"
        "@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n")
    out = tmp_path / "durations.tsv"

    import os

    # not as a worker of an outer run (pytest-xdist's or the script's own variables would reach the inner one)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "DPBENCH_DURATIONS_PARTIAL"}

    def run(*args):
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "suite_durations.py"), "--out", str(out), *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    run("--note", "a generated file", "--", "-q", str(tmp_path / "test_generated.py"))
    durations = load_file(REPO / "scripts" / "suite_durations.py")
    comments, rows = durations.read_table(out)
    (test, (seconds, outcome)), = rows.items()
    assert test.endswith("test_generated.py::test_slow") and 0.6 <= seconds < 5 and outcome == "passed"
    assert any(c.startswith("# command: python scripts/suite_durations.py -- -q") for c in comments)
    assert "# note: a generated file" in comments and any(c.startswith("# date: ") and "CPU: " in c for c in comments)
    assert not out.with_name("durations.tsv.partial").exists()
    run("--merge", "--", "-q", str(tmp_path / "test_generated.py"), "-k", "fast")
    assert durations.read_table(out)[1] == rows
