"""The thesis grids (Zaki 2025, section 4.1: Setups 1-3, 2,476 runs) as configs, and the DAG they build;
the beyond-thesis configs (Setups 2 and 3 with the streamed mechanisms)."""

import json
import subprocess
import time

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, snakemake_exe, tree_env
from dpbench.reporting import figures
from dpbench.pipeline.grid import expand, load_config

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


@pytest.mark.xdist_group("timing")  # a measured time: not beside another timed test
def test_thesis_dry_run_lists_2476_training_jobs_quickly(repo_copy):
    """The DAG of the whole thesis builds in under 60 s on 2 cores."""
    t = time.perf_counter()
    proc = subprocess.run([snakemake_exe(), "-n", "--quiet", "rules", "--configfile", REPO / "config" / "thesis.yaml",
                           "--cores", "2"], cwd=repo_copy, capture_output=True, text=True, timeout=300,
                          env=tree_env(repo_copy))
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
                     "target_epsilon": np.nan if c.epsilon is None else c.epsilon,
                     "epsilon": np.inf if c.epsilon is None else 0.999 * c.epsilon, "status": "completed",
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


STREAMED = {"dpmatrix-band", "dpmatrix-band-amp", "dpmatrix-blt"}
BEYOND = {"beyond-setup2": ("setup2", 120, {"fig5_2", "fig5_6"}),
          "beyond-setup3": ("setup3", 288, {"fig5_2", "fig5_7", "fig5_8"})}


@pytest.mark.parametrize("name", BEYOND)
def test_beyond_configs_are_their_setup_plus_the_streamed_mechanisms(name):
    setup, runs, figure_ids = BEYOND[name]
    cells, base = set(expand(load_config(REPO / "config" / f"{name}.yaml"))), set(
        expand(load_config(REPO / "config" / f"{setup}.yaml")))
    assert len(cells) == runs and base <= cells  # the setup's cells, same ids and seeds
    new = cells - base
    assert {c.optimizer for c in new} == STREAMED and len(new) == len(base)
    # the same grid otherwise: every (problem, L, epsilon, E, lr, seed) of the setup, for each new optimizer
    axes = {(c.problem, c.batch_size, c.epsilon, c.epochs, c.lr, c.seed) for c in base}
    for optimizer in STREAMED:
        assert {(c.problem, c.batch_size, c.epsilon, c.epochs, c.lr, c.seed) for c in new
                if c.optimizer == optimizer} == axes


@pytest.mark.slow
@pytest.mark.parametrize("name", BEYOND)
def test_beyond_figures_draw_every_mechanism_of_their_grid(name):
    """Each figure of a beyond config draws from its grid, the streamed mechanisms included (a
    bar per optimizer and epsilon in Fig. 5.2, a heatmap column per optimizer in 5.6-5.8)."""
    _, _, figure_ids = BEYOND[name]
    cfg = load_config(REPO / "config" / f"{name}.yaml")
    assert set(cfg["figures"]) == figure_ids
    cells = expand(cfg)
    runs = synthetic_runs(cells)
    optimizers = {c.optimizer for c in cells}
    for figure_id, options in cfg["figures"].items():
        fig = figures.build(figure_id, runs, **options)
        assert not any("no runs" in t.get_text() for t in fig.texts), figure_id
        titles = " ".join(ax.get_title() for ax in fig.axes) + " ".join(
            t.get_text() for ax in fig.axes for t in (ax.get_legend().get_texts() if ax.get_legend() else []))
        titles += " ".join(label.get_text() for ax in fig.axes for label in ax.get_xticklabels())
        for optimizer in STREAMED:
            assert figures.label(optimizer) in titles, (figure_id, optimizer)
        figures.plt.close(fig)
    problems = {c.problem for c in cells}
    best = figures.best_per_setting(runs)
    assert set(zip(best.problem, best.optimizer)) == {(p, o) for p in problems for o in optimizers}
    for problem in problems:
        heat = figures.heatmap_data(runs, problem)
        assert set(heat.optimizer) == optimizers
        assert len(heat) == len({(c.optimizer, c.epsilon, c.batch_size, c.lr) for c in cells if c.problem == problem})


def test_lm_config_expands_to_the_study():
    """config/lm.yaml: P4 x {sgd, adamw} x 2 lrs x 3 seeds + {dpsgd, opacus-dpsgd, dpadamw,
    dpmatrix-band-amp} x 1 lr x eps {1, 10, 50} x 3 seeds = 48 cells at L = 64 for one epoch,
    with a validation split and the three LM figures."""
    cfg = load_config(REPO / "config" / "lm.yaml")
    cells = expand(cfg)
    assert len(cells) == 48 and {c.problem for c in cells} == {"P4"}
    assert cfg["train"]["validation_size"] > 0 and set(cfg["figures"]) == set(figures.LM_FIGURES)
    by = {}
    for c in cells:
        by.setdefault(c.optimizer, set()).add((c.epsilon, c.lr, c.seed_index))
    assert set(by) == {"sgd", "adamw", "dpsgd", "opacus-dpsgd", "dpadamw", "dpmatrix-band-amp"}
    assert by["sgd"] == {(None, lr, s) for lr in (0.3, 1.0) for s in range(3)}
    assert by["adamw"] == {(None, lr, s) for lr in (1e-3, 3e-3) for s in range(3)}
    for name, lr in (("dpsgd", 1.0), ("opacus-dpsgd", 1.0), ("dpmatrix-band-amp", 1.0), ("dpadamw", 3e-3)):
        assert by[name] == {(e, lr, s) for e in (1.0, 10.0, 50.0) for s in range(3)}, name
    assert {(c.batch_size, c.epochs) for c in cells} == {(64, 1)}


def test_lm_pilot_is_part_of_the_study():
    """config/lm-pilot.yaml: 7 cells (AdamW; DP-SGD, Opacus's DP-SGD and DP-AdamW at eps 1 and 10),
    each one of the study's (same optimizer, epsilon, learning rate, L = 64, one epoch), one seed."""
    pilot = expand(load_config(REPO / "config" / "lm-pilot.yaml"))
    study = expand(load_config(REPO / "config" / "lm.yaml"))
    assert len(pilot) == 7 and {(c.batch_size, c.epochs, c.seed_index) for c in pilot} == {(64, 1, 0)}
    assert {(c.optimizer, c.epsilon) for c in pilot} == {("adamw", None)} | {
        (o, e) for o in ("dpsgd", "opacus-dpsgd", "dpadamw") for e in (1.0, 10.0)}
    key = lambda c: (c.optimizer, c.epsilon, c.lr, c.batch_size, c.epochs)  # noqa: E731
    assert {key(c) for c in pilot} <= {key(c) for c in study}
