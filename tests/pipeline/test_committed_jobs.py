"""Every committed config's jobs, cell ids and command lines, byte for byte as recorded in
tests/golden/jobs.json (one SHA-256 per config of its job listing and each cell's
``dpbench train`` arguments): a refactoring of the grid, the settings or the modes that changed
one of them would rerun or rename committed cells. The pretraining code's fingerprint in a
checkpoint's name is left out (it changes, by design, with that code: the checkpoint is made
again). Record anew only when a change of jobs is intended (say why in the commit):
``python tests/pipeline/test_committed_jobs.py``."""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "jobs.json"
CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in [*REPO.glob("config/*.yaml"), *REPO.glob(".test/config/*.yaml")])
_CODE = re.compile(r"(cache/pretrain/[\w.+-]+-[0-9a-f]{16})-[0-9a-f]{16}\.pt")


def digest(config: str) -> str:
    from dpbench.pipeline.jobs import load_jobs

    jobs = load_jobs(REPO / config)
    lines = [f"{rule} {Path(f).relative_to(REPO) if Path(f).is_absolute() else f}" for rule, f in jobs.listing()]
    lines += [f"{cell_id} :: {jobs.train_args(cell)}" for cell_id, cell in sorted(jobs.cells.items())]
    return hashlib.sha256(_CODE.sub(r"\1-<code>.pt", "\n".join(lines)).encode()).hexdigest()


@pytest.mark.parametrize("config", CONFIGS)
def test_a_committed_configs_jobs_are_unchanged(config, monkeypatch):
    monkeypatch.chdir(REPO)
    recorded = json.loads(GOLDEN.read_text())
    assert config in recorded, f"{config} has no recorded jobs: record them (module docstring)"
    assert digest(config) == recorded[config], f"{config}: its jobs, ids or command lines changed"


if __name__ == "__main__":
    import os

    os.chdir(REPO)
    GOLDEN.write_text(json.dumps({c: digest(c) for c in CONFIGS}, indent=1) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
