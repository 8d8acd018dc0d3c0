"""The tests mirror the package: each test file lives in the folder named after the package folder
it mainly tests (tests/privacy/ for src/dpbench/privacy/, ...), or in tests/workflow/ (Snakemake end
to end) or tests/repo/ (README, docs, layers, install, references, environments, golden runs);
docs/layout.md names every folder. pytest imports them in its default mode, with each test's
folder on the module search path and no __init__.py: two test files of one name would be one
module, so every name is unique."""

from collections import Counter

from conftest import REPO

TESTS = REPO / "tests"
CROSS_CUTTING = {"workflow", "repo"}


def test_every_test_file_is_in_a_folder_named_after_what_it_tests():
    package = {p.name for p in (REPO / "src" / "dpbench").iterdir() if (p / "__init__.py").is_file()}
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) >= 60
    assert [p.name for p in files if p.parent == TESTS] == []
    folders = {p.parent.relative_to(TESTS).as_posix() for p in files}
    assert folders - package - CROSS_CUTTING == set()
    assert folders >= CROSS_CUTTING | {"privacy", "optimizers", "matrix", "training"}


def test_test_file_names_are_unique_and_no_folder_is_a_package():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name != "conftest.py")
    assert [name for name, n in names.items() if n > 1] == []
    assert sorted(TESTS.rglob("__init__.py")) == []


def test_the_layout_page_names_every_test_folder():
    page = (REPO / "docs" / "layout.md").read_text()
    folders = {p.parent.name for p in TESTS.rglob("test_*.py")}
    assert [f for f in sorted(folders) if f"{f}/" not in page.split("tests/", 1)[1]] == []


def test_a_test_module_imports_test_modules_of_its_own_folder_only():
    """A folder's tests run alone (`pytest tests/problems`): shared helpers and fixtures live in
    tests/conftest.py, and a test module imports another only from its own folder (on the search
    path as its own is)."""
    import re

    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for name in re.findall(r"^\s*(?:from|import) (test_\w+)", path.read_text(), re.M):
            if not (path.parent / f"{name}.py").is_file():
                found.append(f"{path.relative_to(REPO)}: {name}")
    assert found == []
