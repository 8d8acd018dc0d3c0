"""The install is the route: no code edits the module search path, and the package carries
what it reads (the config schema, as package data), so an installed dpbench validates a
config wherever it is."""

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import resources

import pytest
import yaml

from conftest import REPO

SCANNED = ("src", "tests", "benchmarks", "scripts", "workflow", "Snakefile")
# The module search path changed in place or rebound, or prepended to by pytest's monkeypatch
# (the pattern is spelled in parts so that this file holds no match). The workflow's jobs and
# the tests' subprocesses get the tree they run on PYTHONPATH, in their environment.
PATH_EDIT = re.compile("sys" + r"\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\s*\(|\[[^\]]*\]\s*=(?!=)"
                       r"|\+?=(?!=))|syspath" + "_prepend")
# The one exception: the plugin tests (and a block-settings test of a plugin problem) install fake
# distributions (dist-info and package) into a temporary site folder, which must be on the search
# path as pip's site-packages is; so does the test of a catalogued text file's package (found, never imported).
INSTALLS_FAKE_DISTRIBUTIONS = {"tests/plugins/test_plugins.py", "tests/plugins/test_figure_plugins.py",
                               "tests/pipeline/test_block_settings.py", "tests/data/test_labelled_text.py"}


def test_nothing_edits_sys_path():
    files = [REPO / "Snakefile"] + [p for root in SCANNED[:-1] for p in sorted((REPO / root).rglob("*"))
                                    if p.is_file() and p.suffix in (".py", ".smk", ".sh")]
    assert len(files) > 100 and REPO / "workflow" / "rules" / "common.smk" in files
    edits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if PATH_EDIT.search(line)
             and str(path.relative_to(REPO)) not in INSTALLS_FAKE_DISTRIBUTIONS]
    assert edits == []
    # the pattern finds each kind of edit, and not a reading
    for edit in ("sys" + ".path.insert(0, 'src')", "sys" + ".path[:0] = ['src']", "sys" + ".path += ['src']",
                 "monkeypatch.syspath" + "_prepend('benchmarks')", "sys" + ".path.append (x)"):
        assert PATH_EDIT.search(edit), edit
    assert not PATH_EDIT.search("print(sys" + ".path)") and not PATH_EDIT.search("sys" + ".path[0] == x")


def test_the_config_schema_is_package_data():
    from dpbench.pipeline import grid

    schema = resources.files("dpbench.pipeline") / "config.schema.yaml"
    assert schema.is_file() and grid.SCHEMA_PATH == schema
    assert yaml.safe_load(schema.read_text())["properties"]["train"]["properties"]["delta"]["default"] == 1e-5
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "config.schema.yaml" in package_data["dpbench.pipeline"]
    assert not (REPO / "workflow" / "schemas").exists()  # one copy


VALIDATE = """
import sys
from pathlib import Path
import dpbench
from dpbench.pipeline.grid import SCHEMA_PATH, ConfigError, expand, load_config
site = Path(sys.argv[1])
assert Path(dpbench.__file__).is_relative_to(site) and Path(str(SCHEMA_PATH)).is_relative_to(site), dpbench.__file__
config = load_config("mine.yaml")
print(config["train"]["delta"], config["root_seed"], len(expand(config)))
try:
    load_config("bad.yaml")
except ConfigError as exc:
    print(exc)
"""


def test_an_installed_package_validates_a_config_outside_the_repository(tmp_path):
    """A normal (not editable) install: the wheel built from pyproject.toml, unpacked away from
    any checkout, finds its schema with importlib.resources and validates a config there."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__}: pyproject.toml's build needs setuptools >= 77")
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info next to its sources
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_wheel(sys.argv[1]))", str(tmp_path / "dist")],
                           cwd=source, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = tmp_path / "dist" / build.stdout.split()[-1]
    with zipfile.ZipFile(wheel) as archive:
        assert "dpbench/pipeline/config.schema.yaml" in archive.namelist()
        archive.extractall(tmp_path / "site")
    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "mine.yaml").write_text(yaml.safe_dump({"grid": [{"problems": ["P2"], "batch_sizes": [64], "epochs": [1],
                                                             "epsilons": [1, 8], "optimizers": {"dpsgd": {"lr": 0.5}}}]}))
    (work / "bad.yaml").write_text(yaml.safe_dump({"grid": [], "train": {"delta": 2}}))
    proc = subprocess.run([sys.executable, "-c", VALIDATE, str(tmp_path / "site")], cwd=work, capture_output=True,
                          text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["1e-05 20250731 2",
                                        "config key train.delta: 2 is greater than or equal to the maximum of 1 "
                                        "(bad.yaml)"]
