"""A text corpus read from the files a Debian package installs (``fortunes``, ``wordnet``):
located in ``DATA_DIR/<name>`` first, then in the package's system directories, and every file
verified against its SHA-256 before it is read as UTF-8 text. A missing, changed or undecodable
file is a DataError naming it, the places searched and how to get the package. Nothing is
downloaded and nothing is replaced by synthetic text."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from dpbench.data.dataset import DataError, first_complete


@dataclass(frozen=True)
class Package:
    """The corpus ``name`` (its folder under DATA_DIR) made of files of the Debian package
    ``package``; ``how_to_get``: the sentence every error ends with."""

    name: str
    package: str
    how_to_get: str

    def locate(self, data_dir: str | Path | None, system_dirs: Sequence[Path], files: Sequence[str]) -> Path:
        """The first of ``data_dir/<name>``, then ``system_dirs``, holding every one of ``files``
        as a regular file."""
        candidates = ([Path(data_dir).expanduser() / self.name] if data_dir is not None else []) + [
            Path(d) for d in system_dirs]
        found, searched = first_complete(candidates, sorted(files))
        if found is not None:
            return found
        raise DataError(f"{self.name}: required file(s) not found.\nSearched:\n{searched}\n{self.how_to_get}")

    def read_verified(self, directory: str | Path, manifest: Mapping[str, str]) -> dict[str, str]:
        """{file: text} for every file of the manifest ({file: SHA-256 hex}), each checked
        against its SHA-256, in name order."""
        texts = {}
        for name in sorted(manifest):
            path = Path(directory) / name
            try:
                data = path.read_bytes()
            except OSError as e:
                raise DataError(f"cannot read {path}: {e}. {self.how_to_get}") from None
            expected = manifest[name].lower().removeprefix("sha256:")
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise DataError(
                    f"checksum mismatch for {path}: expected sha256:{expected}, got sha256:{actual}. "
                    f"The file is damaged or not the one of Debian's {self.package} package; reinstall it "
                    f"(`apt-get install --reinstall {self.package}`) or replace the copy. {self.how_to_get}"
                )
            try:
                texts[name] = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text ({e})") from None
        return texts

    def texts(self, data_dir: str | Path | None, system_dirs: Sequence[Path],
              manifest: Mapping[str, str]) -> tuple[Path, dict[str, str]]:
        """Located and verified: the directory read and {file: text} of every file of the manifest."""
        directory = self.locate(data_dir, system_dirs, list(manifest))
        return directory, self.read_verified(directory, manifest)
