"""The thesis grids (REFERENCE.md, "Experiment grids") as configs, and the DAG they build."""

import subprocess
import time

import pytest
import yaml

from conftest import REPO, snakemake_exe
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
