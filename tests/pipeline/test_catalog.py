"""The torch-free catalog of optimizers and figures (dpbench.pipeline.catalog): the optimizers'
facts read from the (torch-free) registry's one declaration each, the jobs of every committed
config built without torch or matplotlib, and a mechanism's declared files and a figure's
declared table read where the workflow once named closed sets."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dpbench.mechanisms.files import DenseFiles, StreamedFiles
from dpbench.pipeline import catalog, jobs
from dpbench.pipeline.grid import Cell, ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_the_optimizer_facts_are_the_registry_declarations():
    """No second list: the catalog's facts are read from the registry's one declaration per
    built-in, in its order; a build named by import string resolves to a function of the
    module the code fingerprint reads, and the matrix mechanisms declare their files."""
    from dpbench.optimizers import OPTIMIZERS
    from dpbench.optimizers.spec import Imported

    assert list(catalog.OPTIMIZERS) == list(OPTIMIZERS.builtins)
    for name, spec in OPTIMIZERS.builtins.items():
        assert catalog.OPTIMIZERS[name] == catalog.OptimizerFacts.of(spec), name
        assert isinstance(spec.build, Imported), name  # torch only when a run builds the step
        module = importlib.import_module(spec.build.__module__)
        assert callable(getattr(module, spec.build.__name__)), name
        assert catalog.optimizer_spec(name) is spec
    declared = {n: type(f.files).__name__ for n, f in catalog.OPTIMIZERS.items() if f.files is not None}
    assert declared == {**{n: "DenseFiles" for n in ("dpmatrix-se", "dpmatrix-se-lambda", "dpmatrix-me",
                                                      "dpmatrix-me-lambda")},
                        **{n: "StreamedFiles" for n in ("dpmatrix-band", "dpmatrix-band-amp", "dpmatrix-blt")}}
    assert [n for n, f in catalog.OPTIMIZERS.items() if f.no_guarantee] == ["dpdice", "d2p2sgd", "dp2sgd"]
    with pytest.raises(ValueError, match="not an import string"):
        Imported("dpbench.optimizers.sgd")


def test_a_built_in_is_declared_once():
    """Each built-in's declaration is the registry's ``OptimizerSpec(...)`` of its name (what its
    code fingerprint hashes), and no optimizer module declares a spec of its own."""
    from dpbench.optimizers import OPTIMIZERS
    from dpbench.pipeline import fingerprint

    for name in OPTIMIZERS.builtins:
        assert f'name="{name}"' in fingerprint.declaration(name)
    package = ROOT / "src" / "dpbench" / "optimizers"
    assert [p.name for p in package.glob("*.py") if "OptimizerSpec(" in p.read_text()] == ["__init__.py"]


def test_figure_facts_equal_the_registry_specs():
    """The built-in figures' facts, read from their declarations and drawing functions' sources
    (no second list), are the live specs' facts."""
    from dpbench.reporting.figures import FIGURES, extensions

    assert list(catalog.FIGURES) == list(FIGURES.builtins)
    for name, spec in FIGURES.builtins.items():
        assert catalog.FIGURES[name] == catalog.FigureFacts.of(spec), name
        assert catalog.FIGURES[name].extensions == extensions(name)
    assert [n for n, f in catalog.FIGURES.items() if f.table == "audits"] == ["audit"]
    assert catalog.FIGURES["fig5_3"].min_seeds == 2
    assert catalog.FIGURES["lm_ranking"] == catalog.FigureFacts(
        "lm_ranking", ("problem", "k", "optimizers", "filters"), {"problem": "P4"}, "table", needs_validation=True)
    assert catalog.FIGURES["fig5_4"].defaults == {"problem": "P1", "ys": ("batch_size", "epochs")}


def test_a_figure_is_read_from_its_declaration_alone(tmp_path, monkeypatch):
    """A figure declared in a (copied) figures package, with a drawing function imported from one
    of its modules, is read with its options, defaults and keywords; a name with no function is
    refused naming it."""
    (tmp_path / "mine.py").write_text("def my_figure(runs, problem='P2', *, min_seeds=3, filters=None):\n    pass\n")
    (tmp_path / "__init__.py").write_text(
        "from dpbench.reporting.figures.mine import my_figure\n"
        "BUILT_IN = (FigureSpec('mine', my_figure, 'a title', {'problem': 'P1'}, kind='table', table='audits'),)\n")
    monkeypatch.setattr(catalog, "FIGURES_PACKAGE", tmp_path)
    catalog._source.cache_clear()
    try:
        assert catalog._figure_facts() == {"mine": catalog.FigureFacts(
            "mine", ("problem", "min_seeds", "filters"), {"problem": "P1"}, "table", "audits", False, 3)}
        (tmp_path / "__init__.py").write_text("BUILT_IN = (FigureSpec('x', nowhere, 'a title'),)\n")
        catalog._source.cache_clear()
        with pytest.raises(ValueError, match="no function 'nowhere' found for a built-in figure"):
            catalog._figure_facts()
    finally:
        catalog._source.cache_clear()


def test_the_declared_files_name_the_mechanisms_keys():
    """The key a declaration gives is the one the mechanism's plan reads (its ``key``), for
    each kind, and the errors are the mechanism's."""
    from dpbench.mechanisms.base import PlanRequest
    from dpbench.optimizers import OPTIMIZERS

    request = PlanRequest(50_000, 1000, 3, target_epsilon=2.0, cache_dir=Path("cache"))
    for name, facts in catalog.OPTIMIZERS.items():
        if facts.files is None or name.startswith("dpmatrix-se"):
            continue
        mechanism = OPTIMIZERS[name].mechanism
        assert facts.files.key(request) == mechanism.key(request), name
    assert DenseFiles("me").key(request) == "me-k3-b50"
    assert StreamedFiles("band").key(request) == "band-n150-b50"  # min(64, b' = 50, T = 150)
    with pytest.raises(ValueError, match="cannot train for E = 3 epochs"):
        DenseFiles("se").key(request)
    with pytest.raises(ValueError, match="exceeds the steps per epoch"):
        StreamedFiles("band").key(PlanRequest(50_000, 1000, 3, {"bands": 51}, cache_dir=Path("c")))


def test_a_plugin_mechanism_that_declares_files_gets_them(monkeypatch):
    """No isinstance set: a plugin's mechanism of its own class that carries a declaration reads
    the same files as the built-in of that kind, and one that declares none reads none."""
    def spec(name, files):
        return SimpleNamespace(name=name, private=True, build=lambda ctx: None, defaults={}, cost_class=None,
                               mechanism=SimpleNamespace(files=files) if files else SimpleNamespace())

    plugins = {"my-mf": spec("my-mf", DenseFiles("me")), "my-sgd": spec("my-sgd", None)}
    monkeypatch.setattr(catalog, "_optimizer_registry", lambda: SimpleNamespace(lookup=plugins.__getitem__))
    train = {"train_subset": 1000, "delta": 1e-5}
    builtin = Cell("P1", "dpmatrix-me", 100, 2, 1.0, 0.1, 0, 7).cache_files(train, "cache")
    assert set(builtin) == {"factorization", "noise"}
    assert Cell("P1", "my-mf", 100, 2, 1.0, 0.1, 0, 7).cache_files(train, "cache") == builtin
    assert Cell("P1", "my-sgd", 100, 2, 1.0, 0.1, 0, 7).cache_files(train, "cache") == {}


def test_a_figure_reads_the_table_its_spec_names(monkeypatch):
    monkeypatch.setitem(catalog.FIGURES, "my_audit", catalog.FigureFacts("my_audit", ("optimizers",),
                                                                         table="audits"))
    found = jobs.Jobs({"results_dir": "r"}, {}, None, (), {})
    assert found.figure_input("my_audit") == found.audit_table == "r/audit/audits.parquet"
    assert found.figure_input("fig5_1") == found.runs_table
    with pytest.raises(ConfigError, match="figures.my_audit: the figure of the audits needs audits"):
        jobs.figures_of({"my_audit": {}}, True, False, True)
    assert set(jobs.figures_of({"my_audit": {}}, False, True, True)) == {"audit", "my_audit"}


def test_a_figure_spec_names_a_known_table():
    from dpbench.reporting.figures import FIGURES
    from dpbench.reporting.figures.spec import FigureSpec, check

    with pytest.raises(ValueError, match="table is 'epochs', not one of runs, audits"):
        check(FigureSpec("x", FIGURES["fig5_1"].build, "a title", table="epochs"))


def test_a_builtin_figures_fingerprint_read_from_the_sources_is_the_live_one():
    """The workflow hashes a built-in figure's drawing code from the sources (no matplotlib);
    the digest is the one the imported functions give (``function_closure``), so no figure
    reruns for the change, and an edit is seen in either."""
    import inspect

    from dpbench.pipeline import fingerprint
    from dpbench.reporting import figures

    for figure_id in catalog.FIGURES:
        spec = figures.spec_of(figure_id)
        live = {f"{f.__module__}.{f.__qualname__}": inspect.getsource(f)
                for f in fingerprint.function_closure(spec.build) + fingerprint._plot_closure()}
        build, defaults = fingerprint._builtin_declarations()[figure_id]
        static = {**fingerprint._static_closure(*fingerprint._resolve(fingerprint.FIGURES_PACKAGE, build)),
                  **fingerprint._static_closure(fingerprint.FIGURES_PACKAGE, "plot")}
        assert static == live, figure_id
        assert defaults == spec.defaults
        assert fingerprint.figure_fingerprint(figure_id) == fingerprint._digest(
            [(k, fingerprint.code_text(v)) for k, v in live.items()] + [("defaults", repr(spec.defaults)),
                                  ("thesis_filters", repr(figures.THESIS_FILTERS.get(figure_id)))])


# What the workflow computes to start: the jobs, every cell's arguments, files, resources and
# code fingerprints, each figure's files, table and code fingerprint.
_BUILD = """import json, sys
from dpbench.pipeline import cluster, fingerprint, jobs
for path in sys.argv[1:]:
    found = jobs.load_jobs(path)
    found.listing()
    for cell in found.cells.values():
        found.train_args(cell)
        cluster.resources(cell, found.config["train"], 1)
        fingerprint.optimizer_fingerprint(cell.optimizer) + fingerprint.problem_fingerprint(cell.problem)
    for figure in found.figures:
        found.figure_input(figure), found.figure_files(figure), fingerprint.figure_fingerprint(found.figure_id(figure))
print(json.dumps(sorted(m for m in ("torch", "matplotlib", "pandas") if m in sys.modules)))
"""


def test_the_jobs_of_the_committed_configs_build_without_torch_or_matplotlib():
    """Every committed config, its searches (tuning-*.yaml: the config check accounts them with
    the optimizer's mechanism) included, in one process."""
    configs = sorted(p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("config/*.yaml"),
                                                               *ROOT.glob(".test/config/*.yaml")])
    assert {"config/thesis.yaml", "config/tuning-lm.yaml", "config/tuning-setup2.yaml"} <= set(configs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _BUILD, *configs], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_optimizer_registry_imports_no_torch():
    """The registry (every built-in's declaration and mechanism) and a search's config check."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    code = ("import sys\n"
            "from dpbench.optimizers import OPTIMIZERS\n"
            "from dpbench.training.tuning import check_search\n"
            "for spec in OPTIMIZERS.builtins.values():\n"
            "    spec.mechanism.name\n"
            "check_search({'distribution': 'composition', 'mean': 2}, OPTIMIZERS.builtins['dpmatrix-band'], 100, [{}])\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"
