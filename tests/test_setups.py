"""The thesis grids (Zaki 2025, section 4.1: Setups 1-3, 2,476 runs) as configs, and the DAG they build."""

import json
import subprocess
import time

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, snakemake_exe
from dpbench import figures
from dpbench.grid import expand, load_config

SETUP_RUNS = {"setup1": 2272, "setup2": 60, "setup3": 144}


@pytest.mark.parametrize("name,runs", SETUP_RUNS.items())
def test_setup_run_counts(name, runs):
    assert len(expand(load_config(REPO / "config" / f"{name}.yaml"))) == runs


def test_setup1_shares_dpsgd_cells_between_its_two_grids():
    cfg = load_config(REPO / "config" / "setup1.yaml")
    first = set(expand({**cfg, "grid": cfg["grid"][:1]}))
    second = set(expand({**cfg, "grid": cfg["grid"][1:]}))
    assert (len(first), len(second), len(first & second)) == (1920, 480, 128)
    assert {c.optimizer for c in first & second} == {"dpsgd"}


def test_thesis_is_the_union_of_the_three_setups():
    thesis = load_config(REPO / "config" / "thesis.yaml")
    union = set()
    for name in SETUP_RUNS:
        cfg = load_config(REPO / "config" / f"{name}.yaml")
        union |= set(expand(cfg))
        assert all(block in thesis["grid"] for block in cfg["grid"])
    cells = expand(thesis)
    assert set(cells) == union and len(cells) == 2476


def test_thesis_dry_run_lists_2476_training_jobs_quickly():
    """The DAG of the whole thesis builds in under 60 s on 2 cores."""
    t = time.perf_counter()
    proc = subprocess.run([snakemake_exe(), "-n", "--quiet", "rules", "--configfile", REPO / "config" / "thesis.yaml",
                           "--cores", "2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - t
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    assert counts["train"] == 2476
    assert elapsed < 60, f"DAG took {elapsed:.1f} s"


def synthetic_runs(cells):
    """An aggregated runs table with the columns the figures read, one row per cell."""
    rng = np.random.default_rng(0)
    rows = []
    for c in cells:
        acc = rng.uniform(0.3, 0.9)
        loss = rng.uniform(200, 400) if c.problem == "P3" else 1.5 - acc
        if c.problem == "P3":
            acc = np.nan
        rows.append({"run_id": c.id, "problem": c.problem, "dataset": c.dataset,
                     "task": "vae" if c.problem == "P3" else "classification", "optimizer": c.optimizer,
                     "private": c.epsilon is not None, "lr": c.lr, "batch_size": c.batch_size, "epochs": c.epochs,
                     "seed": c.seed, "hyperparameters": json.dumps(dict(c.hyperparameters)),
                     "target_epsilon": np.nan if c.epsilon is None else c.epsilon, "status": "completed",
                     "best_test_accuracy": acc, "best_test_loss": loss})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("name", ["setup1", "setup2", "setup3", "thesis"])
def test_every_configured_figure_draws_its_setup(name):
    """Each config's `figures` (the thesis's figures of that setup) draw from a table of its cells;
    with `filters: thesis` each figure of the union sees only its own setup's runs."""
    cfg = load_config(REPO / "config" / f"{name}.yaml")
    expected = {"setup1": {"fig5_1", "fig5_3", "fig5_4", "fig5_5", "figB_1", "figB_2"},
                "setup2": {"fig5_2", "fig5_6"}, "setup3": {"fig5_2", "fig5_7", "fig5_8"},
                "thesis": set(figures.THESIS_FIGURES)}[name]
    assert set(cfg["figures"]) == expected
    runs = synthetic_runs(expand(cfg))
    for figure_id, options in cfg["figures"].items():
        fig = figures.build(figure_id, runs, **options)
        assert not any("no runs" in t.get_text() for t in fig.texts), figure_id
        figures.plt.close(fig)
    if name == "thesis":
        data = figures.heatmap_data(figures.select_runs(runs, figures.THESIS_FILTERS["fig5_7"]), "P1")
        assert set(data.optimizer) == {"dpsgd", "dpmatrix-me", "dpmatrix-me-lambda"}
        assert set(data.batch_size) == {1024, 2048}
