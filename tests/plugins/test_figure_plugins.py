"""Figures from plugins (entry-point group ``dpbench.figures``): registered beside the built-in
figures, drawn, validated in configs, listed, fingerprinted with their source; a broken one is
one line naming it, and the built-ins keep working. Fake distributions are a package and its
dist-info in a temporary folder on sys.path, as in tests/plugins/test_plugins.py."""

import copy
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from dpbench.optimizers import OPTIMIZERS
from dpbench.pipeline import fingerprint
from dpbench.pipeline.grid import ConfigError, validate
from dpbench.pipeline.jobs import plan
from dpbench.cli import listing
from dpbench.plugins import PluginError
from dpbench.problems import PROBLEMS
from dpbench.reporting import figures
from dpbench.reporting.figures import FIGURES

# a figure of its own: the number of runs of each optimizer, drawn with dpbench's selection
FIGURE = """
import matplotlib.pyplot as plt

from dpbench.reporting.figures import FigureSpec, ordered, select_runs


def run_counts(runs, optimizers=None, status="completed", filters=None):
    runs = select_runs(runs, {{**(filters or {{}}), "status": status}}, optimizers)
    names = ordered(runs["optimizer"], optimizers)
    counts = runs.groupby("optimizer").size()
    fig, ax = plt.subplots()
    ax.bar(names, [counts[n] for n in names])
    return fig


SPEC = FigureSpec({id!r}, run_counts, "runs per optimizer", {{"status": "completed"}})
"""
PACKAGES = ("fakefig", "badfig")
GRID = [{"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [1, 10],
         "optimizers": {"dpsgd": {"lr": 0.5}, "sgd": {"lr": 0.1}}}]


def install(site: Path, dist: str, entry_points: dict[str, str], files: dict[str, str], version="1.0") -> None:
    """A distribution with entry points of the group dpbench.figures, as pip would leave it."""
    for name, text in files.items():
        path = site / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[dpbench.figures]\n" + "".join(f"{k} = {v}\n" for k, v in
                                                                             entry_points.items()))


def forget() -> None:
    for registry in (FIGURES, OPTIMIZERS, PROBLEMS):
        registry.reset()
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    forget()
    yield site
    forget()


def fake_figure(site, figure_id="run_counts", source=None):
    install(site, "fake-figures", {figure_id: "fakefig.counts:SPEC"},
            {"fakefig/__init__.py": "", "fakefig/counts.py": source or FIGURE.format(id=figure_id)})


def runs_table() -> pd.DataFrame:
    """Five dpsgd runs (one diverged) and two sgd runs."""
    return pd.DataFrame({"optimizer": ["dpsgd"] * 5 + ["sgd"] * 2,
                         "status": ["completed"] * 4 + ["diverged"] + ["completed"] * 2})


def test_a_plugin_figure_is_registered_drawn_and_written(site, tmp_path):
    fake_figure(site)
    assert "run_counts" in FIGURES and "run_counts" not in FIGURES.builtins and FIGURES.errors == []
    assert len(FIGURES) == len(FIGURES.builtins) + 1 and "run_counts" not in figures.THESIS_FIGURES
    assert FIGURES.origin("run_counts") == "plugin fake-figures 1.0" and FIGURES.origin("fig5_1") == "built-in"
    fig = figures.build("run_counts", runs_table())
    assert [p.get_height() for p in fig.axes[0].patches] == [4, 2]  # the diverged run left out by the default
    figures.plt.close(fig)
    fig = figures.build("run_counts", runs_table(), status="diverged", optimizers=["dpsgd"])
    assert [p.get_height() for p in fig.axes[0].patches] == [1]
    figures.plt.close(fig)
    runs = tmp_path / "runs.parquet"
    runs_table().to_parquet(runs)
    png, pdf = figures.plot("run_counts", runs, tmp_path / "figs" / "run_counts")
    assert figures.extensions("run_counts") == ("png", "pdf")
    assert png.name == "run_counts.png" and png.stat().st_size > 5_000 and pdf.stat().st_size > 1_000
    with pytest.raises(ValueError, match=r"unknown option 'statuss' of figure run_counts \(did you mean 'status'\?\)"):
        figures.check_options("run_counts", {"statuss": "completed"})
    with pytest.raises(ValueError, match="filters='thesis': run_counts is not a thesis figure"):
        figures.build("run_counts", runs_table(), filters="thesis")


def test_a_config_draws_a_plugin_figure_and_dpbench_list_lists_it(site, capsys):
    fake_figure(site)
    config = validate({"train": {"train_subset": 1000}, "grid": copy.deepcopy(GRID),
                       "figures": {"run_counts": {"optimizers": ["dpsgd"]}, "fig5_1": {}}})
    jobs = plan(config, None, figures_given=True)
    assert jobs.figures == {"run_counts": {"optimizers": ["dpsgd"]}, "fig5_1": {}}
    assert ("plot_run_counts", f"{jobs.results}/figures/run_counts.png") in jobs.listing()
    with pytest.raises(ConfigError, match=r"config key figures.run_counts: unknown option 'problem' of figure"):
        validate({"grid": copy.deepcopy(GRID), "figures": {"run_counts": {"problem": "P2"}}})
    with pytest.raises(ConfigError, match=r"config key figures.run_count: unknown figure \(did you mean 'run_counts'"):
        validate({"grid": copy.deepcopy(GRID), "figures": {"run_count": {}}})
    assert listing.main() == 0
    rows = [line.split(None, 3) for line in capsys.readouterr().out.splitlines()[1:]]
    assert ["figure", "run_counts", "-", "plugin fake-figures 1.0"] in rows and ["figure", "fig5_4", "-", "built-in"] in rows
    assert len(rows) == len(OPTIMIZERS) + len(PROBLEMS) + len(FIGURES)


def test_a_plugin_figures_fingerprint_covers_its_source_and_the_dpbench_functions_it_calls(site):
    builtins = {f: fingerprint.figure_fingerprint(f) for f in FIGURES.builtins}
    fake_figure(site)
    forget()  # the registry read above found no plugin
    closure = {f"{f.__module__}.{f.__name__}" for f in fingerprint.function_closure(FIGURES["run_counts"].build)}
    assert closure == {"fakefig.counts.run_counts", "dpbench.reporting.figures.selection.select_runs",
                       "dpbench.reporting.figures.style.ordered"}
    first = fingerprint.figure_fingerprint("run_counts")
    assert {f: fingerprint.figure_fingerprint(f) for f in FIGURES.builtins} == builtins  # a plugin changes no other
    # an edit anywhere in the plugin's package (here a file the figure does not import) changes its fingerprint
    (site / "fakefig" / "__init__.py").write_text("# an edit\n")
    forget()
    assert fingerprint.figure_fingerprint("run_counts") not in (first, *builtins.values())


# each way a figure plugin can fail: (entry points, files, the id it claims, the error's reason)
BROKEN = {
    "not a spec": ({"bad_fig": "badfig:SPEC"}, {"badfig.py": "SPEC = {'id': 'bad_fig'}\n"},
                   "bad_fig", "badfig:SPEC is a dict, not a FigureSpec"),
    "id": ({"bad_fig": "fakefig.counts:SPEC"}, {"fakefig/__init__.py": "", "fakefig/counts.py": FIGURE.format(
        id="other")}, "bad_fig", "the figure's id 'other' differs from the entry point's name 'bad_fig'"),
    "defaults": ({"bad_fig": "fakefig.counts:SPEC"}, {"fakefig/__init__.py": "", "fakefig/counts.py": FIGURE.format(
        id="bad_fig").replace('{"status": "completed"})', '{"problem": "P2"})')}, "bad_fig",
        "malformed FigureSpec: defaults name 'problem', not an option of build (optimizers, status, filters)"),
    "kwargs": ({"bad_fig": "fakefig.counts:SPEC"}, {"fakefig/__init__.py": "", "fakefig/counts.py": FIGURE.format(
        id="bad_fig").replace('filters=None)', 'filters=None, **options)')}, "bad_fig",
        "malformed FigureSpec: build takes *args or **kwargs; name each of its options"),
    "collision": ({"fig5_1": "fakefig.counts:SPEC"}, {"fakefig/__init__.py": "", "fakefig/counts.py": FIGURE.format(
        id="fig5_1")}, "fig5_1", "its id 'fig5_1' is a built-in figure's; the built-in keeps it"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_figure_plugin_is_one_line_and_the_builtins_work(site, capsys, case):
    entry_points, files, claimed, reason = BROKEN[case]
    install(site, "broken-figures", entry_points, files, version="0.3")
    line = f"plugin broken-figures 0.3, entry point dpbench.figures:{claimed}: {reason}"
    assert [e.line for e in FIGURES.errors] == [line]
    assert capsys.readouterr().err == f"dpbench: warning: {line}\n"
    assert FIGURES["fig5_1"].build is figures.comparison_figure  # the built-ins work
    config = {"grid": copy.deepcopy(GRID), "figures": {claimed: {}}}
    if claimed == "fig5_1":
        validate(config)
        return
    with pytest.raises(PluginError) as exc:
        figures.build(claimed, runs_table())
    assert str(exc.value) == line
    with pytest.raises(ConfigError) as exc:
        validate(config)
    assert str(exc.value) == f"config key figures.{claimed}: {line}"
    assert listing.main() == 1
    assert [row.split(None, 3)[3] for row in capsys.readouterr().out.splitlines() if row.startswith("error")] == [line]


def test_the_builtin_specs_pass_the_plugin_check():
    from dpbench.reporting.figures.spec import check

    for figure_id, spec in FIGURES.builtins.items():
        check(spec)
        assert spec.id == figure_id
    assert sorted(FIGURES.builtins) == sorted([*figures.THESIS_FIGURES, *figures.LM_FIGURES, "audit", "tuning",
                                               "tuning_table", *figures.FINETUNE_FIGURES])
    assert figures.FINETUNE_FIGURES == ["finetune", "finetune_table", "finetune_exposure", "finetune_claims"]
