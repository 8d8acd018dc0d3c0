"""What every dataset loader shares: its result (``Dataset``), its one error (``DataError``),
and how a loader finds the directory that holds its files (``first_complete``). No loader
lives here, so a module that needs only these (a corpus, a problem) depends on no other loader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DataError(RuntimeError):
    """A dataset file is missing, corrupt, or not the official one."""


@dataclass(frozen=True)
class Dataset:
    """A dataset's training and test splits as raw arrays, in their fixed order: ``x`` the inputs
    (here images, uint8 (N, C, H, W); P4's are token ids, ``dpbench.problems.language``), ``y``
    the labels (int64 (N,); zeros where a task has none)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str  # directory or file the data was read from


def first_complete(candidates: list[Path], files: list[str]) -> tuple[Path | None, str]:
    """The first candidate directory holding every one of ``files`` as a regular file, or None
    and, one line per candidate, why it did not (for the error message)."""
    report = []
    for d in candidates:
        missing = [f for f in files if not (d / f).is_file()]
        if not missing:
            return d, ""
        why = "directory does not exist" if not d.is_dir() else "missing " + ", ".join(missing)
        report.append(f"  {d}: {why}")
    return None, "\n".join(report) or "  (nothing: no data_dir given and no system directory)"


def installed_package(what: str, package: str, version: str, module: str, error: type[Exception]) -> Path:
    """The folder of the installed package ``package``, pinned at ``version``, that holds ``what``'s
    files (a catalogued encoder, a catalogued data file): found by its distribution's metadata and
    ``find_spec`` of its top-level ``module``, which locates it without importing (running) its
    code. A missing package, another version or a package without that module is an ``error``
    naming ``what`` and the command that installs the pinned one."""
    import importlib.metadata
    import importlib.util

    install = f"pip install --no-deps {package}=={version}"
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise error(f"{what} needs the package {package}=={version}, which is not installed: {install} "
                    "(or scripts/setup.sh)") from None
    if installed != version:
        raise error(f"{what}: {package} {installed} is installed, the catalog pins {version}: {install}")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise error(f"{what}: the package {package} has no module {module}; reinstall it: {install} --force-reinstall")
    return Path(list(spec.submodule_search_locations)[0])
