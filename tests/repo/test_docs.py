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


def test_adding_a_problem_shows_every_built_in_problem_with_its_catalog_row():
    from dpbench.problems import catalog
    from dpbench.problems.registry import BUILT_IN

    page = (REPO / "docs" / "adding-a-problem.md").read_text()
    rows = set(re.findall(r'ProblemFacts\("(P\d+)", "[^"]*", "[^"]*", ([\d_]+), ([\d_]+), ([\d_]+)', page))
    assert rows == {(f.id, f"{f.train_size:_}", f"{f.test_size:_}", f"{f.parameters:_}")
                    for f in catalog.FACTS.values()}
    assert set(re.findall(r"^(P\d+) = Problem\(", page, flags=re.M)) == {spec.id for spec in BUILT_IN}
    listed = re.search(r"BUILT_IN = \(([^)]*)\)", page).group(1)
    assert re.findall(r"\.(P\d+)", listed) == [spec.id for spec in BUILT_IN]


def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    site = tmp_path / "site"
    assert (site / "index.html").exists() and (site / "img" / "audit.png").stat().st_size > 10_000
    # config/README.md is part of the configuration page, and the API pages carry the docstrings
    assert "train.delta" in (site / "configuration" / "index.html").read_text()
    assert "calibrate" in (site / "api" / "training" / "index.html").read_text()


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


# -- docs/layout.md lists the repository's files: the package's modules, the benchmark scripts,
# the configs and the rule files; nothing missing, nothing that is not there ------------------

LAYOUT = REPO / "docs" / "layout.md"


def layout_entries(block: str) -> dict[str, str]:
    """name (``config/``, ``files.py``) -> its text, of a listing block: an entry starts in the
    first column, its lines after the first are indented."""
    entries: dict[str, str] = {}
    name = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            name, _, text = line.partition(" ")
            entries[name] = text.strip()
        elif name and line.strip():
            entries[name] += " " + line.strip()
    return entries


def listed_items(text: str) -> list[tuple[str, str]]:
    """(sub-folder or "", item) listed in an entry's text. The grammar: parentheses explain and are
    skipped; ";" separates groups; a group is ``[what it holds:] item, item and item``, where
    what it holds may end in a sub-folder (``store/ (...): keys, cache``)."""
    flat, depth = [], 0
    for char in text:
        depth += char == "("
        if depth == 0:
            flat.append(char)
        depth -= char == ")" and depth > 0
    items = []
    for group in "".join(flat).split(";"):
        head, colon, tail = group.rpartition(":")
        sub = re.search(r"(\w+)/\s*$", head).group(1) if colon and re.search(r"\w/\s*$", head) else ""
        items += [(sub, item.strip()) for item in re.split(r",| and ", tail) if item.strip()]
    return items


def code_block_after(text: str, marker: str) -> str:
    start = text.index("```\n", text.index(marker)) + 4
    return text[start:text.index("```", start)]


def layout_problems(text: str) -> list[str]:
    """What docs/layout.md (``text``) says that the repository contradicts: a package module,
    benchmark script, config file or rule file it does not list, or lists and that is not there."""
    problems = []

    def compare(listed: set[str], present: set[str], where: str) -> None:
        problems.extend(f"docs/layout.md does not list {where}{p}" for p in sorted(present - listed))
        problems.extend(f"docs/layout.md lists {where}{p}, which does not exist" for p in sorted(listed - present))

    def names(entry: str, text: str, pattern: str) -> set[str]:
        found = set()
        for sub, item in listed_items(text):
            if not re.fullmatch(pattern, item):
                problems.append(f"docs/layout.md, entry {entry}: {item!r} is not a file's name")
            found.add(f"{sub}/{item}" if sub else item)
        return found

    top = layout_entries(code_block_after(text, "# Layout"))
    config = names("config/", top["config/"], r"[\w.-]+\.(yaml|md)")
    compare(config, {p.name for p in (REPO / "config").iterdir() if p.is_file()}, "config/")
    scripts = names("benchmarks/", top["benchmarks/"], r"\w+|results/")
    compare({f"{s}.py" for s in scripts if s != "results/"}, {p.name for p in (REPO / "benchmarks").glob("*.py")},
            "benchmarks/")
    if "results/" in scripts and not (REPO / "benchmarks" / "results").is_dir():
        problems.append("docs/layout.md lists benchmarks/results/, which does not exist")
    rules = names("workflow/rules/", top["workflow/rules/"], r"\w+(\.smk)?")
    compare({r if r.endswith(".smk") else f"{r}.smk" for r in rules},
            {p.name for p in (REPO / "workflow" / "rules").glob("*.smk")}, "workflow/rules/")

    package = REPO / "src" / "dpbench"
    listed = set()
    for entry, body in layout_entries(code_block_after(text, "The package, `src/dpbench/`")).items():
        if entry.endswith(".py"):
            listed.add(entry)
            continue
        folder = entry.rstrip("/")
        for module in names(entry, body, r"\w+"):
            listed.add(f"{folder}/{module}.py")
        for data in (package / folder).glob("*.*"):  # package data (a schema, a cost table) is named in its entry
            if data.suffix not in (".py", ".pyc") and data.name not in body:
                problems.append(f"docs/layout.md, entry {entry}: does not name {data.name}")
    inits = {str(p.relative_to(package)) for p in package.rglob("__init__.py")}  # listed where they hold more
    compare(listed - inits, {str(p.relative_to(package)) for p in package.rglob("*.py")} - inits, "src/dpbench/")
    return problems


def test_layout_lists_every_module_benchmark_config_and_rule_file_and_no_other():
    assert layout_problems(LAYOUT.read_text()) == []


def test_the_layout_check_catches_a_missing_and_an_invented_file():
    text = LAYOUT.read_text()
    planted = (text.replace(" bench_pins,", " bench_pins, bench_nothing,")
               .replace("log.py        diagnostics", "logs.py       diagnostics")
               .replace(", finetune-eps1.yaml", "")
               .replace("spec (OptimizerSpec), ", "spec (OptimizerSpec), registry, "))
    assert sorted(layout_problems(planted)) == sorted([
        "docs/layout.md lists benchmarks/bench_nothing.py, which does not exist",
        "docs/layout.md does not list src/dpbench/log.py",
        "docs/layout.md lists src/dpbench/logs.py, which does not exist",
        "docs/layout.md does not list config/finetune-eps1.yaml",
        "docs/layout.md lists src/dpbench/optimizers/registry.py, which does not exist",
    ])
    prose = text.replace("grid (config -> cells", "grid for the config (config -> cells")
    assert layout_problems(prose) == ["docs/layout.md, entry pipeline/: 'grid for the config' is not a file's name",
                                      "docs/layout.md does not list src/dpbench/pipeline/grid.py",
                                      "docs/layout.md lists src/dpbench/pipeline/grid for the config.py, which does "
                                      "not exist"]
