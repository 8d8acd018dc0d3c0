"""Code fingerprints: what an optimizer's (or a figure's) results depend on."""

import shutil
import subprocess
import sys

from conftest import REPO
from dpbench.pipeline import fingerprint


def test_harness_closure_excludes_the_registry_and_other_optimizers():
    harness = fingerprint.harness_closure(fingerprint.HARNESS)
    assert {"dpbench.training.train", "dpbench.training.config", "dpbench.training.splits",
            "dpbench.training.calibration", "dpbench.training.checkpoint", "dpbench.training.harness",
            "dpbench.seeds", "dpbench.privacy.per_sample", "dpbench.privacy.accounting",
            "dpbench.privacy.clipping", "dpbench.mechanisms.sampling", "dpbench.mechanisms.noise", "dpbench.optimizers.base"} <= harness
    assert "dpbench.optimizers" not in harness and "dpbench.optimizers.sgd" not in harness
    assert "dpbench.reporting.figures" not in harness and "dpbench.reporting.aggregate" not in harness
    assert "dpbench.problems.registry" not in harness and "dpbench.problems.images" not in harness


def test_the_harness_leaves_each_problems_own_modules_to_its_problems():
    """Found by the import graph (the problems' registry a leaf): the harness holds what every run
    imports (the modes, the catalog), no problem's spec module and not P7's encoders (shared code
    imports them inside a function); each problem's own modules are its spec's module and what it
    imports beyond the harness, P7's the encoders' and P6's text classification's (it imports it)."""
    from dpbench.problems import catalog, registry

    harness = fingerprint.harness_closure()
    assert {"dpbench.problems.modes", "dpbench.problems.catalog", "dpbench.problems.spec",
            "dpbench.problems.architectures", "dpbench.problems.finetune"} <= harness
    own = {p: fingerprint.problem_modules(fingerprint.problem_roots(p)) for p in catalog.FACTS}
    assert not harness & set().union(*own.values())
    assert {"dpbench.problems.encoders", "dpbench.problems.encoder_model",
            "dpbench.problems.text_classification"} <= own["P7"]
    assert not any("encoder" in m for p in ("P1", "P2", "P3", "P4", "P5", "P6") for m in own[p])
    assert own["P2"] == {"dpbench.problems.images", "dpbench.problems.convnets", "dpbench.data",
                         "dpbench.data.image_datasets"}
    # the registry's BUILT_IN read without importing it: every built-in, its task, build and
    # loader among its own modules or the harness's
    assert set(fingerprint._builtin_problems()) == {spec.id for spec in registry.BUILT_IN} == set(catalog.FACTS)
    for spec in registry.BUILT_IN:
        build, load = (getattr(f, "func", f) for f in (spec.build, spec.load))  # functools.partial's (P8, P9)
        used = {type(spec.task).__module__, build.__module__, load.__module__}
        assert used <= own[spec.id] | harness, spec.id
    # what the harness leaves to the problems (an import inside a function) is some problem's own
    left = {m for module in harness for m in fingerprint._imports_of(module)[1] - harness - set(fingerprint.LEAVES)
            if m.startswith("dpbench.problems.")}
    assert "dpbench.problems.encoders" in left and all(any(m in modules for modules in own.values()) for m in left)


def test_code_text_ignores_comments_docstrings_and_layout():
    source = '''"""A module."""
import math


def f(x):
    """Its docstring."""
    y = x + 1  # a comment
    return math.sqrt(y)

LIMIT = 3
"""An attribute's docstring."""
'''
    edited = source.replace("A module.", "Another module.").replace("# a comment", "").replace(
        '"""Its docstring."""', '"""Its docstring,\n    over two lines."""\n    # and a comment').replace(
        "LIMIT = 3\n", "\n\nLIMIT = (\n    3)\n")
    assert fingerprint.code_text(edited) == fingerprint.code_text(source)
    for code in (source.replace("x + 1", "x + 2"), source.replace("LIMIT = 3", "LIMIT = 4"),
                 source.replace("math.sqrt(y)", "math.sqrt(y); y = 0")):
        assert fingerprint.code_text(code) != fingerprint.code_text(source)


def test_editing_a_module_reruns_only_the_cells_whose_code_it_is(tmp_path):
    """In a copy of the sources, every (optimizer, problem) cell's code (common.smk's train_code:
    optimizer_fingerprint + problem_fingerprint) and every audit's: after comments and docstrings
    edited in an optimizer, a problem, the harness and a figure-free shared module (nothing
    changes), after a code edit of sgd.py (only the optimizers built there change), of P7's
    encoders (only P7's cells: every P1-P6 cell and every audit unchanged), of the harness (every
    cell). One fresh interpreter reads the copy, its caches cleared after each edit."""
    from dpbench.optimizers import OPTIMIZERS
    from dpbench.problems import catalog

    src = tmp_path / "src"
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    names, problems = sorted(OPTIMIZERS), sorted(catalog.FACTS)
    code = f"""
from pathlib import Path
from dpbench.pipeline import fingerprint


def prints():
    for cached in (fingerprint._imports, fingerprint._imports_of, fingerprint.optimizer_fingerprint,
                   fingerprint.problem_fingerprint, fingerprint._builtin_problems):
        cached.cache_clear()
    audit = fingerprint.modules_fingerprint(("dpbench.audit.run",))
    print(" ".join(audit + fingerprint.optimizer_fingerprint(n) + fingerprint.problem_fingerprint(p)
                   for n in {names!r} for p in {problems!r}))


def edit(path, old, new):
    path = Path({str(src / "dpbench")!r}) / path
    text = path.read_text()
    assert old is None or old in text, (path, old)
    path.write_text(text + new if old is None else text.replace(old, new, 1))


prints()
edit("optimizers/sgd.py", None, "\\n# a comment\\n")
edit("problems/encoders.py", '\"\"\"Public encoders read', '# a comment\\n\"\"\"Public encoders, read')
edit("problems/encoders.py", '\"\"\"Catalogued encoders by name.\"\"\"', '\"\"\"The catalogued encoders.\"\"\"')
edit("training/train.py", "def epoch_ends(", "# a comment\\n\\n\\ndef epoch_ends(")
edit("problems/catalog.py", "from dataclasses import dataclass", "from dataclasses import dataclass  # a comment")
prints()
edit("optimizers/sgd.py", None, "\\n_AN_EDIT = 1\\n")
prints()
edit("problems/encoders.py", "\\ndef package_directory(", "\\n_AN_EDIT = 1\\n\\n\\ndef package_directory(")
prints()
edit("training/train.py", "def epoch_ends(", "_AN_EDIT = 1\\n\\n\\ndef epoch_ends(")
prints()
"""
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(src)}, capture_output=True,
                         text=True, check=True)
    cells = [(n, p) for n in names for p in problems]
    before, commented, after_opt, after_problem, after_harness = (dict(zip(cells, line.split()))
                                                                   for line in out.stdout.splitlines())
    assert commented == before

    def changed(a, b):
        return {c for c in cells if a[c] != b[c]}

    assert changed(commented, after_opt) == {(n, p) for n, p in cells
                                             if OPTIMIZERS[n].build.__module__ == "dpbench.optimizers.sgd"}
    # the encoder problems (P7, and P8, P9 built on its modules)
    assert changed(after_opt, after_problem) == {(n, p) for n, p in cells if p in ("P7", "P8", "P9")}
    assert all(a[:16] == b[:16] for a, b in zip(after_opt.values(), after_problem.values()))  # the audits
    assert changed(after_problem, after_harness) == set(cells)


def test_figure_fingerprints_follow_each_figures_own_code():
    from dpbench.reporting import figures

    closure = {f.__name__ for f in fingerprint.function_closure(figures.FIGURES["fig5_4"].build)}
    assert {"heatmap_figure", "heatmap_data", "draw_heatmaps"} <= closure
    assert "seed_sensitivity_data" not in closure
    prints = {fid: fingerprint.figure_fingerprint(fid) for fid in figures.FIGURES}
    # the same builder with other defaults (5.6 vs 5.7: P2 vs P1 heatmaps) is another figure
    assert len(set(prints.values())) == len(prints)
    assert prints["fig5_1"] == fingerprint.figure_fingerprint("fig5_1")


def test_figure_fingerprints_follow_helpers_into_other_reporting_modules(tmp_path):
    """In a copy of the sources: editing ``select_best`` and ``select_best_config`` (dpbench.reporting.figures.selection,
    reached from the thesis figures through their data functions) changes the fingerprint of
    every figure that selects a best run (the thesis's and the fine-tuning figures), and not those of seed sensitivity (5.3: means over
    seeds), the audit or the language model; editing the heatmap panel changes the heatmaps' alone."""
    from dpbench.reporting import figures

    src = tmp_path / "src"
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    ids = sorted(figures.FIGURES.builtins)
    code = f"""
from pathlib import Path
from dpbench.pipeline import fingerprint

FIGURES = Path({str(src / "dpbench" / "reporting" / "figures")!r})


def prints():
    print(" ".join(fingerprint.figure_fingerprint(f) for f in {ids!r}))


def edit(module, old, new):
    path = FIGURES / module
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


prints()
edit("selection.py", "    s = scored(runs, select_by)\\n    if s.empty:",
     "    s = scored(runs, select_by); _ = None\\n    if s.empty:")
edit("selection.py", "    s = scored(runs, select_by)\\n    extra = [",
     "    s = scored(runs, select_by); _ = None\\n    extra = [")
prints()
edit("thesis.py", "np.nan)\\n    for _, c in cells.iterrows():", "np.nan); _ = None\\n    for _, c in cells.iterrows():")
prints()
"""
    # (edits within a line: the functions below keep their line numbers, which inspect.getsource
    # reads the edited file at)
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(src)}, capture_output=True,
                         text=True, check=True)
    before, after_selection, after_panel = (dict(zip(ids, line.split())) for line in out.stdout.splitlines())
    changed = {f for f in ids if before[f] != after_selection[f]}
    # the fine-tuning figures choose each mode's configuration with select_best_config too
    assert changed == (set(figures.THESIS_FIGURES) - {"fig5_3"}) | set(figures.FINETUNE_FIGURES)
    assert {f for f in ids if after_panel[f] != after_selection[f]} == {"fig5_4", "fig5_6", "fig5_7", "fig5_8",
                                                                         "figB_1"}
