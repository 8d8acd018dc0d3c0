"""Code fingerprints: what an optimizer's (or a figure's) results depend on."""

import shutil
import subprocess
import sys

from conftest import REPO
from dpbench.pipeline import fingerprint


def test_harness_closure_excludes_the_registry_and_other_optimizers():
    harness = fingerprint.module_closure(fingerprint.HARNESS)
    assert {"dpbench.training.train", "dpbench.training.config", "dpbench.training.splits",
            "dpbench.training.calibration", "dpbench.training.checkpoint", "dpbench.training.harness",
            "dpbench.seeds", "dpbench.privacy.per_sample", "dpbench.privacy.accounting",
            "dpbench.privacy.clipping", "dpbench.mechanisms.sampling", "dpbench.mechanisms.noise", "dpbench.optimizers.base"} <= harness
    assert "dpbench.optimizers" not in harness and "dpbench.optimizers.sgd" not in harness
    assert "dpbench.reporting.figures" not in harness and "dpbench.reporting.aggregate" not in harness


def test_editing_an_optimizer_module_changes_only_its_fingerprint(tmp_path):
    """In a copy of the sources: the fingerprints of every optimizer, after an edit of sgd.py
    (only the optimizers built there change), after an edit of the harness (all change). One
    fresh interpreter reads the copy, its caches cleared after each edit."""
    from dpbench.optimizers import OPTIMIZERS

    src = tmp_path / "src"
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    names = sorted(OPTIMIZERS)
    code = f"""
from pathlib import Path
from dpbench.pipeline import fingerprint


def prints():
    fingerprint._imports.cache_clear()
    fingerprint.optimizer_fingerprint.cache_clear()
    print(" ".join(fingerprint.optimizer_fingerprint(n) for n in {names!r}))


def edit(path):
    path = Path({str(src / "dpbench")!r}) / path
    path.write_text(path.read_text() + "\\n# an edit\\n")


prints()
edit("optimizers/sgd.py")
prints()
edit("privacy/per_sample.py")
prints()
"""
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(src)}, capture_output=True,
                         text=True, check=True)
    before, after_opt, after_harness = (dict(zip(names, line.split())) for line in out.stdout.splitlines())
    changed = {n for n in names if before[n] != after_opt[n]}
    assert changed == {n for n in names if OPTIMIZERS[n].build.__module__ == "dpbench.optimizers.sgd"}
    assert changed and all(after_harness[n] != after_opt[n] for n in names)


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
     "    s = scored(runs, select_by)  # an edit\\n    if s.empty:")
edit("selection.py", "    s = scored(runs, select_by)\\n    extra = [",
     "    s = scored(runs, select_by)  # an edit\\n    extra = [")
prints()
edit("thesis.py", "np.nan)\\n    for _, c in cells.iterrows():", "np.nan)  # an edit\\n    for _, c in cells.iterrows():")
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
