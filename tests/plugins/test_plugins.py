"""Plugins (dpbench.plugins): optimizers and problems of other installed distributions.

Fake distributions are made by writing a package and its ``<name>-<version>.dist-info`` (METADATA,
entry_points.txt) into a temporary folder put on sys.path: ``importlib.metadata`` finds them as it
finds an installed one. The last test installs examples/plugin into a temporary virtual
environment (never into the project's) and runs it through the CLI and the workflow."""

import hashlib
import re
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import REPO, copy_repo, run_cell
from dpbench import cli, plugins
from dpbench.optimizers import OPTIMIZERS, get_optimizer
from dpbench.pipeline import cluster, fingerprint
from dpbench.pipeline.grid import ConfigError, expand, load_config
from dpbench.cli import listing
from dpbench.mechanisms.base import PlanRequest, PrivacyClaim, Target
from dpbench.plugins import PluginError
from dpbench.privacy import accounting
from dpbench.problems import PROBLEMS, get_problem
from dpbench.reporting.figures import FIGURES

OPTIMIZER = """
from dpbench.optimizers.base import SGD, DPStep
from dpbench.optimizers.spec import OptimizerSpec

SPEC = OptimizerSpec(name={name!r}, build=lambda ctx: DPStep(ctx, SGD(ctx.lr)), private=True,
                     description="a test plugin", reference="none")
"""
# a mechanism of its own class: sigma and epsilon come from the plugin (here DP-SGD's, by the
# protocol: calibrate(plan, target) -> sigma, report(claim, steps) -> Spent)
OWN_MECHANISM = """
from dpbench.plugin import (SGD, DPStep, OptimizerSpec, PoissonSubsampledGaussian, PrivacyClaim, Spent, Target,
                            get_accountant)


class OwnAccounting(PoissonSubsampledGaussian):
    name = "own-accounting"

    def calibrate(self, plan, target: Target) -> float:
        return target.accountant.noise_multiplier(lambda s: self.history(plan, s, plan.steps), target.epsilon,
                                                  target.delta)

    def report(self, claim: PrivacyClaim, steps: int) -> Spent:
        plan, sigma, accountant = claim.plan, claim.noise_multiplier, claim.accountant
        history = self.history(plan, sigma, steps)
        done = accountant.epsilon(history, claim.delta)
        planned = accountant.epsilon(self.history(plan, sigma, plan.steps), claim.delta)
        rdp = get_accountant("rdp").epsilon(history, claim.delta)  # the cross-check
        return Spent(done, planned, rdp, {"accounted_by": accountant.name})


SPEC = OptimizerSpec(name="dpsgd-own", build=lambda ctx: DPStep(ctx, SGD(ctx.lr)), private=True,
                     description="a plugin with its own mechanism", reference="none", mechanism=OwnAccounting())
"""
PROBLEM = """
import dataclasses

from dpbench.problems.images import P2

SPEC = dataclasses.replace(P2, facts=dataclasses.replace(P2.facts, id={id!r}))
"""
FAKE_PACKAGES = set()


def install(site: Path, dist: str, version: str, entry_points: dict[str, dict[str, str]],
            files: dict[str, str]) -> None:
    """A distribution in ``site`` as pip would leave it: its files and its dist-info."""
    for name, text in files.items():
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        FAKE_PACKAGES.add(name.split("/")[0].removesuffix(".py"))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in entry_points.items()))


def forget() -> None:
    """The registries discover again at their next read; fingerprints are recomputed."""
    OPTIMIZERS.reset()
    PROBLEMS.reset()
    fingerprint.optimizer_fingerprint.cache_clear()
    fingerprint.problem_fingerprint.cache_clear()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for fake distributions; afterwards the registries hold only what
    is really installed."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    forget()
    yield site
    for name in list(sys.modules):
        if name.split(".")[0] in FAKE_PACKAGES:
            del sys.modules[name]
    forget()


def fake_optimizer(site, name="dpsgd-fake", dist="fake-plugin", version="1.0", package="fakeopt", source=None):
    install(site, dist, version, {"dpbench.optimizers": {name: f"{package}.opt:SPEC"}},
            {f"{package}/__init__.py": "", f"{package}/opt.py": source or OPTIMIZER.format(name=name)})


def test_a_plugin_optimizer_is_registered_with_its_provenance(site):
    fake_optimizer(site)
    spec = get_optimizer("dpsgd-fake")
    assert spec.name == "dpsgd-fake" and "dpsgd-fake" in OPTIMIZERS and "dpsgd" in OPTIMIZERS
    assert len(OPTIMIZERS) == len(OPTIMIZERS.builtins) + 1 and "dpsgd-fake" not in OPTIMIZERS.builtins
    assert OPTIMIZERS.errors == []
    assert OPTIMIZERS.origin("dpsgd-fake") == "plugin fake-plugin 1.0" and OPTIMIZERS.origin("dpsgd") == "built-in"
    # the source hash: every .py of the top-level package, by sorted relative name
    h = hashlib.sha256()
    for name in ("fakeopt/__init__.py", "fakeopt/opt.py"):
        h.update(name.encode() + b"\0" + (site / name).read_bytes() + b"\0")
    record = plugins.record_of(spec)
    assert record == {"distribution": "fake-plugin", "version": "1.0", "entry_point": "dpsgd-fake",
                      "group": "dpbench.optimizers", "value": "fakeopt.opt:SPEC", "package": "fakeopt",
                      "source_sha256": h.hexdigest()}
    assert plugins.record_of(get_optimizer("dpsgd")) is None
    assert plugins.mechanism_origin(spec.mechanism) == "built-in"
    # the cost model: a plugin is costed by its spec's cost_class, never by its id's prefix; one
    # that names none gets the assumed, conservative cost
    assert cluster.cost_class("dpsgd-fake") is None
    cell = {"problem": "P2", "optimizer": "dpsgd-fake", "batch_size": 256, "epochs": 1}
    seconds = cluster.compute_seconds(cell, {}, on_gpu=True, costs=cluster.ASSUMED)
    assert seconds == pytest.approx(round(60_000 / 256) * (cluster.STEP_OVERHEAD_S + 256 * 30e-6)
                                    + 10_000 * 30e-6 * cluster.EVAL_FRACTION)


def test_discovery_is_lazy_and_loads_each_plugin_once(site, monkeypatch):
    fake_optimizer(site)
    calls = []
    real = plugins.entry_points
    monkeypatch.setattr(plugins, "entry_points", lambda group: calls.append(group) or real(group))
    assert calls == []  # nothing happens until the registry is read
    assert "dpsgd-fake" in OPTIMIZERS and get_optimizer("dpsgd-fake") is get_optimizer("dpsgd-fake")
    sorted(OPTIMIZERS), len(OPTIMIZERS)
    assert calls == ["dpbench.optimizers"]


def test_a_config_trains_a_plugin_cell_beside_a_builtin_one(site, tmp_path):
    fake_optimizer(site)
    config = {"results_dir": str(tmp_path / "out"), "train": {"max_steps": 2},
              "grid": [{"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [2],
                        "optimizers": {"dpsgd": {"lr": 0.5}, "dpsgd-fake": {"lr": [0.5, 1.0]}}}]}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cells = expand(load_config(path))
    assert sorted(c.id for c in cells) == ["P2/dpsgd-fake/L100-E1-eps2-lr0.5-s0", "P2/dpsgd-fake/L100-E1-eps2-lr1-s0",
                                           "P2/dpsgd/L100-E1-eps2-lr0.5-s0"]
    # hyperparameters are checked against the plugin's spec as for a built-in
    config["grid"][0]["optimizers"]["dpsgd-fake"]["momentum"] = 0.5
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"grid.0.optimizers.dpsgd-fake: optimizer 'dpsgd-fake' has no "
                                          r"hyperparameter 'momentum' \(it takes: none\)"):
        load_config(path)


def test_a_run_and_its_tables_record_the_plugin_and_whose_mechanism(site, tiny_fmnist, tmp_path):
    from dpbench.reporting.aggregate import aggregate_runs
    from dpbench.reporting.results import write_run
    from dpbench.training.train import RunConfig

    install(site, "own-mechanism", "2.5", {"dpbench.optimizers": {"dpsgd-own": "ownmech:SPEC"}},
            {"ownmech.py": OWN_MECHANISM})
    assert plugins.mechanism_origin(get_optimizer("dpsgd-own").mechanism) == "plugin"
    paths = []
    for optimizer in ("dpsgd-own", "dpsgd"):
        res = run_cell(RunConfig(problem="P2", optimizer=optimizer, lr=0.5, batch_size=60, epochs=1, seed=0,
                                 noise_multiplier=1.0, max_steps=2, accountant="rdp", test_subset=50,
                                 progress_every_s=1e9))
        paths.append(write_run(tmp_path / f"{optimizer}.parquet", res.metrics, res.meta))
        if optimizer == "dpsgd-own":
            meta = res.meta
    assert meta["optimizer"]["plugin"]["distribution"] == "own-mechanism"
    assert meta["optimizer"]["plugin"]["source_sha256"] == hashlib.sha256(
        b"ownmech.py\0" + (site / "ownmech.py").read_bytes() + b"\0").hexdigest()
    assert meta["privacy"]["mechanism_origin"] == "plugin" and meta["problem"]["plugin"] is None
    assert meta["privacy"]["stages"] == {} and meta["privacy"]["step_class"] == "dpbench.optimizers.base.DPStep"
    # its report's numbers and facts are what the run file records: DP-SGD's RDP epsilon, q = 0.1, 2 steps
    assert meta["privacy"]["accounted_by"] == meta["privacy"]["accountant"] == "rdp"
    assert meta["privacy"]["epsilon"] == meta["privacy"]["epsilon_rdp"] == res.meta["privacy"]["epsilon_rdp"]
    assert meta["privacy"]["epsilon"] == pytest.approx(accounting.epsilon([(1.0, 0.1, 2)], 1e-5, "rdp"), rel=1e-12)
    own = get_optimizer("dpsgd-own").mechanism  # its calibration through the protocol, by the target's accountant
    plan = own.plan(PlanRequest(600, 60, 1))
    assert own.calibrate(plan, Target(2.0, 1e-5, "rdp")) == get_optimizer("dpsgd").mechanism.calibrate(
        plan, Target(2.0, 1e-5, "rdp"))
    runs, epochs = aggregate_runs(paths, tmp_path / "runs.parquet", tmp_path / "epochs.parquet")
    by = runs.set_index("optimizer")
    assert by.loc["dpsgd-own", "mechanism_origin"] == "plugin" and by.loc["dpsgd", "mechanism_origin"] == "built-in"
    assert by.loc["dpsgd-own", "optimizer_origin"] == "plugin own-mechanism 2.5"
    assert by.loc["dpsgd", "optimizer_origin"] == "built-in" and set(runs.problem_origin) == {"built-in"}
    assert set(zip(epochs.optimizer, epochs.mechanism_origin)) == {("dpsgd-own", "plugin"), ("dpsgd", "built-in")}


@pytest.mark.parametrize("reported", ["-0.717", "float('nan')", "'0.5'", "True"])
def test_a_plugin_mechanism_reporting_an_epsilon_that_is_no_epsilon_is_refused_naming_it(site, reported):
    """A plugin's report returning a negative, NaN or non-number epsilon is refused when the run's
    claim is asked (before anything is recorded or labelled), naming the mechanism."""
    source = OWN_MECHANISM.replace("return Spent(done, planned, rdp,", f"return Spent({reported}, planned, rdp,")
    install(site, "own-mechanism", "2.5", {"dpbench.optimizers": {"dpsgd-own": "ownmech:SPEC"}},
            {"ownmech.py": source})
    own = get_optimizer("dpsgd-own").mechanism
    claim = PrivacyClaim(own, own.plan(PlanRequest(600, 60, 2)), 1.0, 1e-5, "rdp")
    with pytest.raises(ValueError, match=r"^mechanism 'own-accounting': report returned epsilon_spent = .*; an "
                                         r"epsilon is a number >= 0"):
        claim.spent(2)
    # the built-in DP-SGD's claim at the same plan passes the same check
    dpsgd = get_optimizer("dpsgd").mechanism
    assert PrivacyClaim(dpsgd, dpsgd.plan(PlanRequest(600, 60, 2)), 1.0, 1e-5, "rdp").spent(2).epsilon_spent > 0


def test_dpbench_list_says_where_each_comes_from_and_whose_claim(site, capsys):
    fake_optimizer(site)
    install(site, "own-mechanism", "2.5", {"dpbench.optimizers": {"dpsgd-own": "ownmech:SPEC"}},
            {"ownmech.py": OWN_MECHANISM})
    assert listing.main() == 0
    lines = [line.split(None, 3) for line in capsys.readouterr().out.splitlines()]
    assert lines[0] == ["kind", "id", "private", "origin"]
    rows = {(kind, name): (private, origin) for kind, name, private, origin in lines[1:]}
    assert rows[("optimizer", "dpsgd")] == ("private", "built-in")
    assert rows[("optimizer", "sgd")] == ("non-private", "built-in")
    assert rows[("optimizer", "dpsgd-fake")] == ("private", "plugin fake-plugin 1.0")
    assert rows[("optimizer", "dpsgd-own")] == ("private", "plugin own-mechanism 2.5; privacy claim: the plugin's own")
    assert rows[("problem", "P2")] == ("-", "built-in")
    assert rows[("figure", "fig5_1")] == ("-", "built-in")
    assert len(rows) == len(OPTIMIZERS) + len(PROBLEMS) + len(FIGURES)


# a stage of the private step replaced by the plugin: each of the K layers clipped at C / ROOT
# (ROOT = 1: the per-layer clipping bug, one example moves the sum by up to C sqrt(K); ROOT =
# sqrt(K): valid)
PER_LAYER = """
import math

from dpbench.optimizers.base import SGD, DPStep
from dpbench.optimizers.spec import OptimizerSpec


class PerLayer(DPStep):
    def clip_and_sum(self, psg):
        if psg is None:
            return super().clip_and_sum(psg)
        root = {root}
        summed = {{}}
        for layer in psg.layers:
            norms = layer.inner(layer).clamp_min(0).sqrt() * root
            summed.update(layer.weighted_sum(self.ctx.clipping.coefficients(norms)))
        return [summed[p] for p in self.params]


SPEC = OptimizerSpec(name={name!r}, build=lambda ctx: PerLayer(ctx, SGD(ctx.lr)), private=True,
                     description="per-layer clipping", reference="none")
"""


def test_a_replaced_stage_is_listed_recorded_and_held_to_its_sensitivity(site, tiny_fmnist, tmp_path, capsys):
    """A stranger's optimizer that replaces ``clip_and_sum``: ``dpbench list`` and its runs say
    the stage is the plugin's; ``dpbench audit`` flags the per-layer clipping bug (each layer at
    C) and passes the valid one (each at C / sqrt(K))."""
    from dpbench.audit import run as audit_run
    from dpbench.audit.trials import AuditProblem
    from dpbench.training.train import RunConfig

    fake_optimizer(site, "dpsgd-layers", "layers-plugin", "1.0", "perlayer",
                   PER_LAYER.format(name="dpsgd-layers", root="1.0"))
    fake_optimizer(site, "dpsgd-layers-ok", "layers-ok-plugin", "1.0", "perlayerok",
                   PER_LAYER.format(name="dpsgd-layers-ok", root="math.sqrt(len(self.tape.layers))"))
    assert listing.main() == 0
    rows = {line.split(None, 3)[1]: line.split(None, 3)[3] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["dpsgd-layers"] == "plugin layers-plugin 1.0; stages: clip_and_sum (plugin)"
    assert rows["dpsgd"] == "built-in" and rows["dpdisk"] == "built-in; stages: per_sample_gradients (built-in)"
    small = AuditProblem(dimension=5, examples=20, batch_size=5, steps=40)
    _, bad = audit_run.audit(get_optimizer("dpsgd-layers"), 2.0, 200, problem=small, lanes=200, cache_dir=tmp_path)
    assert bad["violation"] and not bad["checks"]["sensitivity"]["ok"]
    assert bad["checks"]["sensitivity"]["max_moved_per_sensitivity"] == pytest.approx(2.0)  # sqrt(4 layers)
    assert bad["claim"]["stages"] == {"clip_and_sum": "plugin"}
    _, good = audit_run.audit(get_optimizer("dpsgd-layers-ok"), 2.0, 200, problem=small, lanes=200,
                              cache_dir=tmp_path)
    assert good["checks"]["sensitivity"]["ok"] and good["checks"]["sensitivity"]["max_moved_per_sensitivity"] <= 1
    res = run_cell(RunConfig(problem="P2", optimizer="dpsgd-layers-ok", lr=0.5, batch_size=60, epochs=1, seed=0,
                             noise_multiplier=1.0, max_steps=2, accountant="rdp", test_subset=50,
                             progress_every_s=1e9))
    assert res.meta["privacy"]["stages"] == {"clip_and_sum": "plugin"}
    assert res.meta["privacy"]["step_class"] == "perlayerok.opt.PerLayer"


# each way a plugin can fail: (entry points, files, the id it claims, the error's reason)
BROKEN = {
    "import": ({"dpsgd-bad": "badimport.opt:SPEC"}, {"badimport/__init__.py": "", "badimport/opt.py": "import nowhere\n"},
               "dpsgd-bad", "cannot import badimport.opt:SPEC (ModuleNotFoundError: No module named 'nowhere')"),
    "raises": ({"dpsgd-bad": "raises:SPEC"}, {"raises.py": "raise SystemExit('needs a GPU\\nand more')\n"},
               "dpsgd-bad", "cannot import raises:SPEC (SystemExit: needs a GPU)"),
    "not a spec": ({"dpsgd-bad": "notspec:SPEC"}, {"notspec.py": "SPEC = {'name': 'dpsgd-bad'}\n"},
                   "dpsgd-bad", "notspec:SPEC is a dict, not an OptimizerSpec"),
    "name": ({"dpsgd-bad": "badname:SPEC"}, {"badname.py": OPTIMIZER.format(name="other")},
             "dpsgd-bad", "the optimizer's name 'other' differs from the entry point's name 'dpsgd-bad'"),
    "field": ({"dpsgd-bad": "badfield:SPEC"}, {"badfield.py": OPTIMIZER.format(name="dpsgd-bad").replace(
               "private=True", "private='yes'")},
              "dpsgd-bad", "malformed OptimizerSpec: private is 'yes', not true or false"),
    "mechanism without privacy_profile": (
        {"dpsgd-bad": "noprofile:SPEC"}, {"noprofile.py": """
from dpbench.plugin import SGD, DPStep, OptimizerSpec, PoissonSubsampledGaussian

BASE = PoissonSubsampledGaussian()


class Partial:  # everything the harness calls, nothing the audit calls
    name, audit = "partial", BASE.audit
    plan, calibrate, report, sampler, noise = BASE.plan, BASE.calibrate, BASE.report, BASE.sampler, BASE.noise


SPEC = OptimizerSpec(name="dpsgd-bad", build=lambda ctx: DPStep(ctx, SGD(ctx.lr)), private=True,
                     description="a test plugin", reference="none", mechanism=Partial())
"""}, "dpsgd-bad", "malformed OptimizerSpec: mechanism Partial is not a Mechanism (it lacks privacy_profile)"),
    "collision": ({"dpsgd": "collide:SPEC"}, {"collide.py": OPTIMIZER.format(name="dpsgd")},
                  "dpsgd", "its id 'dpsgd' is a built-in optimizer's; the built-in keeps it"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_plugin_is_one_line_naming_it_and_the_builtins_work(site, capsys, tmp_path, case):
    entry_points, files, claimed, reason = BROKEN[case]
    install(site, "broken-plugin", "0.3", {"dpbench.optimizers": entry_points}, files)
    line = f"plugin broken-plugin 0.3, entry point dpbench.optimizers:{claimed}: {reason}"
    assert [e.line for e in OPTIMIZERS.errors] == [line]
    # printed once, at discovery, however often the registry is read
    sorted(OPTIMIZERS), get_optimizer("sgd")
    assert capsys.readouterr().err == f"dpbench: warning: {line}\n"
    assert get_optimizer("dpsgd").build.__module__ == "dpbench.optimizers.sgd"  # the built-ins work
    config = {"grid": [{"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [2],
                        "optimizers": {"dpsgd": {"lr": 0.5}}}]}
    assert [c.optimizer for c in expand(config)] == ["dpsgd"]
    if claimed != "dpsgd":  # using the broken id is its line, wherever it is used
        with pytest.raises(PluginError) as exc:
            get_optimizer(claimed)
        assert str(exc.value) == line
        config["grid"][0]["optimizers"][claimed] = {"lr": 0.5}
        with pytest.raises(ConfigError) as exc:
            expand(config)
        assert str(exc.value) == f"config key grid.0.optimizers.{claimed}: {line}"
    assert listing.main() == 1
    out = capsys.readouterr().out.splitlines()
    assert [row for row in out if row.startswith("error")] == [f"error      {claimed.ljust(18)}  -            {line}"]


def test_the_cli_with_a_broken_plugin_installed(site, tmp_path, fmnist_dir):
    """A plugin that fails to import: `dpbench list` shows its line and exits 1, using its id is
    that line (exit 2), and `dpbench train --optimizer dpsgd` trains, warning once."""
    entry_points, files, claimed, reason = BROKEN["import"]
    install(site, "broken-plugin", "0.3", {"dpbench.optimizers": entry_points}, files)
    line = f"plugin broken-plugin 0.3, entry point dpbench.optimizers:{claimed}: {reason}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(site)])}

    def dpbench(*args):
        return subprocess.run([sys.executable, "-m", "dpbench", *map(str, args)], env=env, capture_output=True,
                              text=True, timeout=300)

    listed = dpbench("list")
    assert listed.returncode == 1 and line in listed.stdout and "optimizer  dpsgd " in listed.stdout
    train = ["train", "--problem", "P2", "--lr", "0.5", "--batch-size", "50", "--epochs", "1", "--seed", "0",
             "--noise-multiplier", "1", "--max-steps", "1", "--train-subset", "200", "--test-subset", "100",
             "--data-dir", fmnist_dir]
    bad = dpbench(*train, "--optimizer", claimed, "--out", tmp_path / "bad.parquet")
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1] == f"dpbench train: error: {line}", bad.stderr
    good = dpbench(*train, "--optimizer", "dpsgd", "--out", tmp_path / "good.parquet")
    assert good.returncode == 0, good.stderr
    assert good.stderr.count(line) == 1 and (tmp_path / "good.parquet").stat().st_size > 0


def test_two_plugins_with_one_id_are_both_refused(site):
    fake_optimizer(site, dist="first", package="firstpkg")
    fake_optimizer(site, dist="second", package="secondpkg")
    assert [e.line for e in OPTIMIZERS.errors] == [
        f"plugin {a} 1.0, entry point dpbench.optimizers:dpsgd-fake: its id 'dpsgd-fake' is also registered by "
        f"{b} 1.0; neither is loaded" for a, b in (("first", "second"), ("second", "first"))]
    with pytest.raises(PluginError, match="first 1.0, entry point dpbench.optimizers:dpsgd-fake"):
        get_optimizer("dpsgd-fake")


def test_the_problem_group_is_discovered_the_same_way(site):
    install(site, "fake-problems", "0.1", {"dpbench.problems": {"P2b": "fakeprob:SPEC", "P99": "fakeprob:WRONG"}},
            {"fakeprob.py": PROBLEM.format(id="P2b") + "WRONG = SPEC\n"})
    assert get_problem("P2b").dataset == "fashion-mnist" and PROBLEMS.origin("P2b") == "plugin fake-problems 0.1"
    assert plugins.record_of(get_problem("P2b"))["entry_point"] == "P2b"
    assert [e.line for e in PROBLEMS.errors] == [
        "plugin fake-problems 0.1, entry point dpbench.problems:P99: the problem's id 'P2b' differs from the entry "
        "point's name 'P99'"]
    with pytest.raises(PluginError, match="entry point dpbench.problems:P99"):
        get_problem("P99")
    # each problem's own modules and, for a plugin's, its source: P2b (its own file) is not P2
    assert fingerprint.problem_fingerprint("P2").startswith("-") and fingerprint.problem_fingerprint("P2b").startswith("-")
    assert fingerprint.problem_fingerprint("P2b") != fingerprint.problem_fingerprint("P2")


def test_editing_a_plugin_reruns_exactly_its_cells(site):
    """The code fingerprint of a plugin's cells covers its source: an edit of the plugin
    changes its fingerprint and no other."""
    fake_optimizer(site)
    names = sorted(OPTIMIZERS)
    before = {n: fingerprint.optimizer_fingerprint(n) for n in names}
    assert len(set(before.values())) > 1 and before["dpsgd-fake"] != before["dpsgd"]
    source = site / "fakeopt" / "opt.py"
    source.write_text(source.read_text() + "# an edit\n")
    forget()
    after = {n: fingerprint.optimizer_fingerprint(n) for n in names}
    assert {n for n in names if before[n] != after[n]} == {"dpsgd-fake"}


def test_the_example_plugins_spec_is_well_formed():
    """examples/plugin's entry point names a spec that the optimizer group accepts (its own
    tests, examples/plugin/tests, run in the installed test below)."""
    import tomllib

    project = tomllib.loads((REPO / "examples" / "plugin" / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["dpbench.optimizers"] == {
        "dpsgd-momentum": "dpbench_example.momentum:DPSGD_MOMENTUM"}
    assert project["project"]["entry-points"]["dpbench.problems"] == {"digits": "dpbench_example.digits:DIGITS"}
    assert "dpsgd-momentum" not in OPTIMIZERS and "digits" not in PROBLEMS  # not installed in the project's environment


# -- the example plugin, installed into a temporary virtual environment --------------------------

def _venv(root: Path) -> Path:
    """A virtual environment that sees the project's packages (a .pth naming the project venv's
    site-packages and this checkout's src/) and installs into its own site-packages only."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "dpbench-project.pth").write_text(f"{REPO / 'src'}\n{sysconfig.get_paths()['purelib']}\n")
    return python


@pytest.mark.slow
def test_the_example_plugin_installed_runs_through_the_workflow_and_the_audit(tmp_path, fmnist_dir):
    python = _venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*args, cwd=REPO, check=True, timeout=300, pythonpath=None):
        proc = subprocess.run([str(python), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                              env={**env, "PYTHONPATH": str(pythonpath)} if pythonpath else env, timeout=timeout)
        assert not check or proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return proc

    # pip builds in the source folder: install from a copy, so the checkout stays clean
    example = tmp_path / "plugin"
    shutil.copytree(REPO / "examples" / "plugin", example, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    project_site = sysconfig.get_paths()["purelib"]
    project_before = sorted(os.listdir(project_site))
    run("-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", example)
    assert sorted(os.listdir(project_site)) == project_before  # the project's environment is untouched
    listed = run("-m", "dpbench", "list").stdout
    assert "dpsgd-momentum      private      plugin dpbench-example-plugin 0.1.0\n" in listed, listed
    assert "digits" in listed and listed.count("plugin dpbench-example-plugin 0.1.0") == 3, listed
    assert "figure     privacy_table       -            plugin dpbench-example-plugin 0.1.0\n" in listed, listed
    run("-m", "pytest", "-q", "-p", "no:cacheprovider", example / "tests", cwd=tmp_path)

    # a plugin cell beside a built-in one, through Snakemake to a figure
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_repo(repo)
    config = {"data_dir": str(fmnist_dir), "results_dir": "results",
              "train": {"accountant": "rdp", "max_steps": 3, "train_subset": 500, "test_subset": 100},
              "figures": {"fig5_1": {}, "privacy_table": {}},
              "grid": [{"problems": ["P2"], "batch_sizes": [50], "epsilons": [4], "epochs": [1],
                        "optimizers": {"dpsgd": {"lr": 0.5}, "dpsgd-momentum": {"lr": 0.5, "momentum": 0.5}}},
                       {"problems": ["digits"], "batch_sizes": [64], "epsilons": [4], "epochs": [1],
                        "optimizers": {"dpsgd": {"lr": 0.5}, "dpsgd-momentum": {"lr": 0.5}}}]}
    (repo / "plugin.yaml").write_text(yaml.safe_dump(config))
    run("-m", "snakemake", "--profile", repo / "workflow" / "profiles" / "default", "--configfile", "plugin.yaml",
        "--cores", "2", cwd=repo, timeout=600, pythonpath=repo / "src")  # the copy's package, as the Snakefile asks
    runs = pd.read_parquet(repo / "results" / "aggregate" / "runs.parquet")
    assert sorted(zip(runs.problem, runs.optimizer)) == [("P2", "dpsgd"), ("P2", "dpsgd-momentum"),
                                                        ("digits", "dpsgd"), ("digits", "dpsgd-momentum")]
    assert (runs.status == "completed").all()
    origin = runs.set_index(["problem", "optimizer"])
    assert origin.loc[("P2", "dpsgd-momentum"), "optimizer_origin"] == "plugin dpbench-example-plugin 0.1.0"
    assert set(runs[runs.problem == "digits"].problem_origin) == {"plugin dpbench-example-plugin 0.1.0"}
    assert (repo / "results" / "data" / "sklearn-digits.json").is_file()  # the data rule verified it
    assert set(runs.mechanism_origin) == {"built-in"}  # momentum is post-processing of DP-SGD's releases
    assert (runs.epsilon <= 4).all() and (repo / "results" / "figures" / "fig5_1.png").stat().st_size > 10_000
    # the plugin's figure, drawn by the workflow's rule for it from the same runs
    table = (repo / "results" / "figures" / "privacy_table.md").read_text()
    assert "| digits | dpsgd-momentum | plugin dpbench-example-plugin 0.1.0 | built-in | 4 | 1 | 1 |" in table, table

    # the audit runs through the plugin's mechanism; no audit code in the plugin
    audit = run("-m", "dpbench", "audit", "--optimizer", "dpsgd-momentum", "--epsilon", "2", "--trials", "200",
                "--accountant", "rdp", "--out", tmp_path / "audit.parquet", "--cache-dir", tmp_path / "cache")
    assert "dpsgd-momentum claimed eps = 2" in audit.stderr and "no violation found" in audit.stderr, audit.stderr
    from dpbench.reporting.results import read_meta

    claim = read_meta(tmp_path / "audit.parquet")["audit"]["claim"]
    assert claim["plugin"]["distribution"] == "dpbench-example-plugin" and claim["mechanism_origin"] == "built-in"

    # uninstalled: gone from the list, and the built-ins still train
    run("-m", "pip", "uninstall", "--yes", "--quiet", "dpbench-example-plugin")
    listed = run("-m", "dpbench", "list").stdout
    assert "dpsgd-momentum" not in listed and "dpsgd " in listed
    run("-m", "dpbench", "train", "--problem", "P2", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "50",
        "--epochs", "1", "--seed", "0", "--noise-multiplier", "1", "--max-steps", "1", "--train-subset", "200",
        "--test-subset", "100", "--data-dir", fmnist_dir, "--out", tmp_path / "after.parquet")
    assert (tmp_path / "after.parquet").stat().st_size > 0


def test_the_config_check_asks_the_jobs_interpreter_for_the_plugins_it_names(site, tmp_path):
    """A plugin this process sees but the jobs' interpreter does not (the rules replaced the
    caller's PYTHONPATH: the check passed, then the first job failed naming no plugin) is refused
    by the config check, naming it; seen by the jobs, it passes. The rules put src/ before the
    caller's PYTHONPATH (tests/workflow/test_workflow.py runs a job that keeps it)."""
    from dpbench.pipeline.jobs import check_plugins_visible, load_jobs

    fake_optimizer(site)
    config = {"results_dir": str(tmp_path / "out"), "train": {"max_steps": 2},
              "grid": [{"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [2],
                        "optimizers": {"dpsgd": {"lr": 0.5}, "dpsgd-fake": {"lr": 0.5}}}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    jobs = load_jobs(tmp_path / "c.yaml")
    src = str(REPO / "src")
    with pytest.raises(ConfigError, match=r"optimizers 'dpsgd-fake' is plugin fake-plugin 1.0, which the jobs' "
                                          rf"interpreter {re.escape(sys.executable)} does not find"):
        check_plugins_visible(jobs, sys.executable, src, {**os.environ, "PYTHONPATH": ""})
    check_plugins_visible(jobs, sys.executable, src, {**os.environ, "PYTHONPATH": str(site)})  # the caller's kept


def test_train_help_lists_the_registrys_problems_and_the_plugins(site, capsys):
    """dpbench train --help names every problem of the registry: P1-P6 and the installed
    plugins' (read from their entry points, nothing imported)."""
    install(site, "fake-problem", "1.0", {"dpbench.problems": {"P2-fake": "fakeprob:SPEC"}},
            {"fakeprob.py": PROBLEM.format(id="P2-fake")})
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--problem PROBLEM the problem: P1, P2, P3, P4, P5, P6, P7, P8, P9; plugins': P2-fake (dpbench list)" in out
    assert "fakeprob" not in sys.modules  # listed, not imported
