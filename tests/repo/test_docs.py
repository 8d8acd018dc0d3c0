"""The manual: README.md is a front page (at most 15 KB, every relative link resolves), and the
documentation site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: no broken link or
anchor, no page left out of the navigation, the API reference generated from the docstrings."""

import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, load_file
from dpbench.problems import facts as problems_facts

README = REPO / "README.md"


def test_readme_is_a_front_page_of_at_most_15_kb():
    assert README.stat().st_size <= 15 * 1024


def test_every_relative_link_in_the_readme_points_at_an_existing_file():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+://|#|mailto:", link)]
    assert len(relative) > 10
    missing = [link for link in relative if not (REPO / link.split("#")[0]).exists()]
    assert missing == []


def test_every_docs_page_is_in_the_navigation_and_every_figure_is_shown():
    import yaml

    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)

    def pages(nav):
        for item in nav:
            for value in item.values():
                yield from (pages(value) if isinstance(value, list) else [value])

    listed = set(pages(config["nav"]))
    present = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert listed == present
    shown = "".join((REPO / "docs" / p).read_text() for p in present)
    for image in (REPO / "docs" / "img").iterdir():
        assert image.exists(), f"{image} links to a file that is not there"
        assert f"](img/{image.name})" in shown, image.name


def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    site = tmp_path / "site"
    assert (site / "index.html").exists() and (site / "img" / "audit.png").stat().st_size > 10_000
    # config/README.md is part of the configuration page, and the API pages carry the docstrings
    assert "train.delta" in (site / "configuration" / "index.html").read_text()
    assert "choose_noise_multiplier" in (site / "api" / "training" / "index.html").read_text()


def test_bench_step_reports_every_ratio_as_a_median_of_per_repeat_ratios_with_its_range():
    """docs/speed.md quotes benchmarks/bench_step.py: medians over >= 5 repeats with their range,
    each ratio taken repeat by repeat against the baseline of the same run."""
    bench_step = load_file(REPO / "benchmarks" / "bench_step.py")

    times = {bench_step.DP: [1.1, 1.2, 1.3, 1.4, 3.0], bench_step.BASELINE: [1.0, 1.0, 1.0, 1.0, 1.0],
             "Opacus hooks (same batches)": [2.2, 2.4, 2.6, 2.8, 3.0]}
    out = bench_step.report(times, steps=10, epoch_steps=100, L=256, threads=2, repeats=5, started="2026-01-01 00:00",
                            load_before="0.00 0.00 0.00")
    assert "machine: " in out and "date: 2026-01-01 00:00" in out and "WARNING" not in out
    assert "| dpbench DP-SGD step | 1300.0 | 1100.0-3000.0 | 1.30 | 1.10-3.00 |" in out
    assert "DP step / non-private step: 1.30x, range 1.10-3.00 over 5 repeats" in out
    assert "Opacus hooks (same batches) / DP step: 2.00x, range 1.00-2.00" in out
    assert bench_step.MIN_REPEATS >= 5
    short = bench_step.report({k: v[:3] for k, v in times.items()}, steps=10, epoch_steps=100, L=256, threads=2,
                              repeats=3, started="2026-01-01 00:00", load_before="0")
    assert "WARNING: 3 repeats < 5" in short


def test_bench_step_lists_an_unsupported_method_without_ratios():
    bench_step = load_file(REPO / "benchmarks" / "bench_step.py")

    times = {bench_step.DP: [1.2] * 5, bench_step.BASELINE: [1.0] * 5, "Opacus ghost clipping (same batches)": []}
    out = bench_step.report(times, steps=2, epoch_steps=100, L=8, threads=2, repeats=5, started="2026-01-01 00:00",
                            load_before="0", problem="P4",
                            unsupported={"Opacus ghost clipping (same batches)": "RuntimeError: no"})
    assert out.startswith("P4, L = 8, 2 steps")
    assert "| Opacus ghost clipping (same batches) | not supported: RuntimeError: no | | | | | |" in out
    assert "ghost clipping (same batches) / DP step" not in out


def test_bench_step_p4_batches_are_the_fortunes_training_records():
    """bench_step.py --problem P4 draws its Poisson batches from the real corpus's token rows."""
    from dpbench.data import fortunes
    from dpbench.problems import catalog, tokenizer

    if not fortunes.SYSTEM_DIRS[0].is_dir():
        pytest.skip("Debian's fortunes package is not installed")
    bench_step = load_file(REPO / "benchmarks" / "bench_step.py")

    x, y = bench_step.data("P4", None)
    assert x.shape == (problems_facts("P4").train_size, 129) and x.dtype == torch.int64
    assert (x[:, 0] == tokenizer.BOUNDARY).all() and (y == 0).all()
    first = fortunes.load(None).train[0].encode("utf-8")[:127]
    assert bytes(x[0, 1:1 + len(first)].tolist()) == first
