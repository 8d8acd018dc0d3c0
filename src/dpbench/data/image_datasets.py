"""The benchmark datasets (Fashion-MNIST, CIFAR-10), read from their official files.

Files are located on disk (or downloaded on request), verified against the official MD5
checksums and parsed here (IDX format; the CIFAR-10 python tarball). Nothing is ever
replaced by synthetic data: a missing or corrupt file is a DataError.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import http.client
import io
import math
import os
import pickle
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Mapping

import numpy as np

from dpbench.data.dataset import DataError, Dataset, first_complete
from dpbench.files import refuse_special, umask

DATASETS = ("fashion-mnist", "cifar10")
SYSTEM_DIRS: dict[str, list[Path]] = {
    "fashion-mnist": [Path("/usr/share/datasets/fashion-mnist")],
    "cifar10": [],
}

FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"

# Fashion-MNIST is checked by the MD5 of the decompressed IDX payloads: Debian's
# dataset-fashion-mnist recompresses the .gz files, so only the payloads are the same
# bytes for both sources. Keys are payload names; the files on disk are <key>.gz.
FASHION_MNIST_MD5 = {
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}
# MD5 of the official .gz files as published upstream; documentation only (see above).
FASHION_MNIST_GZ_MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
CIFAR10_MD5 = {"cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a"}
OFFICIAL_MD5: dict[str, dict[str, str]] = {
    "fashion-mnist": FASHION_MNIST_MD5,
    "cifar10": CIFAR10_MD5,
}

_CIFAR_TARBALL = "cifar-10-python.tar.gz"
_CIFAR_TRAIN = tuple(f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = "cifar-10-batches-py/test_batch"
_NUM_CLASSES = 10


# --------------------------------------------------------------------------- locating


def _files(name: str) -> tuple[str, ...]:
    """The files (names on disk) that make up a dataset."""
    if name == "fashion-mnist":
        return tuple(f"{key}.gz" for key in FASHION_MNIST_MD5)
    if name == "cifar10":
        return (_CIFAR_TARBALL,)
    raise DataError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}")


def _url(name: str, filename: str) -> str:
    return FASHION_MNIST_URL + filename if name == "fashion-mnist" else CIFAR10_URL


def _how_to_get(name: str) -> str:
    if name == "fashion-mnist":
        return (
            "To obtain Fashion-MNIST: `apt-get install dataset-fashion-mnist` (installs "
            "/usr/share/datasets/fashion-mnist), or run "
            "`dpbench data --download --dataset fashion-mnist --data-dir DIR`, or fetch the "
            f"four .gz files from {FASHION_MNIST_URL}<file> into DIR/fashion-mnist/."
        )
    return (
        "To obtain CIFAR-10: run `dpbench data --download --dataset cifar10 --data-dir DIR`, "
        f"or fetch {CIFAR10_URL} into DIR/cifar10/."
    )


def _candidates(name: str, data_dir: str | Path | None) -> list[Path]:
    dirs = []
    if data_dir is not None:
        base = Path(data_dir).expanduser()
        dirs += [base, base / name]
    return dirs + [Path(d) for d in SYSTEM_DIRS.get(name, [])]


def locate(name: str, data_dir: str | Path | None = None) -> Path:
    """Return the first directory holding all files of `name`.

    Searched in order: data_dir, data_dir/<name>, then SYSTEM_DIRS[name].
    """
    files = _files(name)
    found, searched = first_complete(_candidates(name, data_dir), files)
    if found is not None:
        return found
    raise DataError(
        f"{name}: required file(s) not found: {', '.join(files)}.\n"
        f"Searched:\n{searched}\n{_how_to_get(name)}"
    )


# --------------------------------------------------------------------------- checksums


def _expected(name: str, checksums: Mapping[str, str] | None) -> dict[str, str]:
    _files(name)  # rejects unknown dataset names with a DataError
    table = OFFICIAL_MD5[name] if checksums is None else checksums
    return {k: v.lower().removeprefix("md5:") for k, v in table.items()}


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _read_checked(
    name: str, path: Path, filename: str, expected: Mapping[str, str]
) -> tuple[str, bytes]:
    """Read one file, check its MD5 and return (checksum key, verified payload).

    `filename` is the file's final name; `path` may be a temporary file while downloading.
    Fashion-MNIST files are decompressed once here and the payload is both hashed and
    returned for parsing.
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e}") from None
    key = filename
    if name == "fashion-mnist":
        key = filename.removesuffix(".gz")
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: not a valid gzip file ({e}). {_how_to_get(name)}") from None
    if key not in expected:
        raise DataError(f"no expected checksum for {key} ({path}) in the checksum table")
    actual = _md5(data)
    if actual != expected[key]:
        what = f"{key} (decompressed from {path})" if key != filename else str(path)
        raise DataError(
            f"checksum mismatch for {what}: expected md5:{expected[key]}, got md5:{actual}. "
            f"The file is corrupt or not the official one; remove it and obtain it again. "
            + _how_to_get(name)
        )
    return key, data


def _read_verified(
    name: str, directory: Path, checksums: Mapping[str, str] | None
) -> tuple[dict[str, str], dict[str, bytes]]:
    expected = _expected(name, checksums)
    verified, payloads = {}, {}
    for filename in _files(name):
        key, data = _read_checked(name, Path(directory) / filename, filename, expected)
        verified[key] = f"md5:{expected[key]}"
        payloads[key] = data
    return verified, payloads


def verify(
    name: str, directory: Path, *, checksums: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Verify the dataset's files in `directory`; return {name: "md5:<hex>"} of what was checked.

    For Fashion-MNIST the names are the IDX payloads (the .gz files minus ".gz") and the
    checksums those of the decompressed payloads.
    """
    return _read_verified(name, directory, checksums)[0]


# --------------------------------------------------------------------------- parsing

_IDX_DTYPES = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(data: bytes) -> np.ndarray:
    """Parse an IDX file (as used by MNIST/Fashion-MNIST) into a native-endian array."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        magic = bytes(data[:4]).hex()
        raise DataError(f"not an IDX file: magic {magic} does not start with two zero bytes")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise DataError(f"IDX header: unknown data type code 0x{code:02x}")
    offset = 4 + 4 * ndim
    if len(data) < offset:
        raise DataError(f"IDX header truncated: {ndim} dims need {offset} bytes, got {len(data)}")
    dims = tuple(int(d) for d in np.frombuffer(data, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[code])
    count = math.prod(dims)
    if len(data) != offset + count * dtype.itemsize:
        raise DataError(
            f"IDX size mismatch: header declares {dims} x {dtype.itemsize} bytes "
            f"({offset + count * dtype.itemsize} bytes in all) but the data has {len(data)} bytes"
        )
    array = np.frombuffer(data, dtype, count=count, offset=offset).reshape(dims)
    return array.astype(dtype.newbyteorder("="))  # a writable native-endian copy


def _check_labels(labels: np.ndarray, what: str) -> np.ndarray:
    if labels.dtype.kind not in "iu":
        raise DataError(f"{what}: labels have non-integer type {labels.dtype}")
    if labels.size and (labels.min() < 0 or labels.max() >= _NUM_CLASSES):
        raise DataError(
            f"{what}: label values {labels.min()}..{labels.max()} outside 0..{_NUM_CLASSES - 1}"
        )
    return labels.astype(np.int64)


def _fashion_split(
    payloads: Mapping[str, bytes], prefix: str, directory: Path
) -> tuple[np.ndarray, np.ndarray]:
    names = {kind: f"{prefix}-{kind}-idx{nd}-ubyte" for kind, nd in (("images", 3), ("labels", 1))}
    arrays = {}
    for kind, key in names.items():
        try:
            arrays[kind] = read_idx(payloads[key])
        except DataError as e:
            raise DataError(f"{directory / key}.gz: {e}") from None
    images, labels = arrays["images"], arrays["labels"]
    if images.dtype != np.uint8 or images.ndim != 3:
        raise DataError(
            f"{directory / names['images']}.gz: expected uint8 images (N, H, W), "
            f"got {images.dtype} {images.shape}"
        )
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataError(
            f"{directory / names['labels']}.gz: header declares {labels.shape} labels "
            f"for {len(images)} images in {names['images']}.gz"
        )
    labels = _check_labels(labels, f"{directory / names['labels']}.gz")
    return images.reshape(len(images), 1, *images.shape[1:]), labels


class _BatchUnpickler(pickle.Unpickler):
    """Resolves only the globals a CIFAR-10 batch (a dict with a numpy array) needs.

    The tarball's checksum is verified before unpickling; this additionally refuses any
    other callable, so a substituted file cannot execute code.
    """

    _reconstruct = np.empty(0).__reduce__()[0]  # numpy's _reconstruct, whatever its module
    _ALLOWED = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("_codecs", "encode"): codecs.encode,
    }

    def find_class(self, module: str, name: str) -> object:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}") from None


def _cifar_batch(raw: bytes, what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        batch = _BatchUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # a malformed pickle can raise nearly any exception type
        raise DataError(f"{what}: cannot unpickle batch: {e}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{what}: expected a dict with b'data' and b'labels'")
    x, y = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
    if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
        raise DataError(f"{what}: expected uint8 data of shape (N, 3072), got {x.dtype} {x.shape}")
    if y.shape != (len(x),):
        raise DataError(f"{what}: {y.shape} labels for {len(x)} images")
    # Rows are channel-first RGB planes, each 32x32 row-major.
    return x.reshape(-1, 3, 32, 32), _check_labels(y, what)


def _parse_cifar(blob: bytes, source: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    wanted = {*_CIFAR_TRAIN, _CIFAR_TEST}
    members: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
            for member in tar:
                if member.name in wanted and member.isfile():
                    members[member.name] = tar.extractfile(member).read()  # type: ignore
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise DataError(f"{source}: cannot read tarball: {e}") from None
    missing = [m for m in (*_CIFAR_TRAIN, _CIFAR_TEST) if m not in members]
    if missing:
        raise DataError(f"{source}: tarball lacks member(s) {', '.join(missing)}")
    train = [_cifar_batch(members[m], f"{source}:{m}") for m in _CIFAR_TRAIN]
    test_x, test_y = _cifar_batch(members[_CIFAR_TEST], f"{source}:{_CIFAR_TEST}")
    return (
        np.concatenate([x for x, _ in train]),
        np.concatenate([y for _, y in train]),
        test_x,
        test_y,
    )


def read_cifar10(tarball: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Parse the CIFAR-10 python tarball into (train_x, train_y, test_x, test_y).

    Images are uint8 (N, 3, 32, 32), labels int64. The batches are pickles: verify the
    tarball's checksum before calling this (load() does).
    """
    try:
        blob = Path(tarball).read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {tarball}: {e}") from None
    return _parse_cifar(blob, str(tarball))


# --------------------------------------------------------------------------- loading


def _load(
    name: str, directory: Path, checksums: Mapping[str, str] | None
) -> tuple[Dataset, dict[str, str]]:
    verified, payloads = _read_verified(name, directory, checksums)
    if name == "fashion-mnist":
        train_x, train_y = _fashion_split(payloads, "train", directory)
        test_x, test_y = _fashion_split(payloads, "t10k", directory)
        source = str(directory)
    else:
        source = str(Path(directory) / _CIFAR_TARBALL)
        # Parse the very bytes that were hashed, so nothing can change between check and unpickle.
        train_x, train_y, test_x, test_y = _parse_cifar(payloads[_CIFAR_TARBALL], source)
    return Dataset(name, train_x, train_y, test_x, test_y, source), verified


def load(
    name: str,
    data_dir: str | Path | None = None,
    *,
    checksums: Mapping[str, str] | None = None,
) -> Dataset:
    """Locate, verify and parse a dataset.

    `checksums` replaces the official MD5 table ({name: hex or "md5:hex"}, keyed like
    verify()'s result); tests use it to load generated files.
    """
    return _load(name, locate(name, data_dir), checksums)[0]


# --------------------------------------------------------------------------- downloading


def _fetch(url: str, out: BinaryIO, label: str, progress: bool) -> None:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            total = int(response.headers.get("Content-Length") or 0)
            done, last = 0, 0.0
            while chunk := response.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                if progress and time.monotonic() - last >= 1.0:
                    last = time.monotonic()
                    of = f" / {total / 1e6:.1f}" if total else ""
                    print(f"{label}: {done / 1e6:.1f}{of} MB", file=sys.stderr, flush=True)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        raise DataError(f"download of {url} failed: {e}") from None
    if total and done != total:
        raise DataError(f"download of {url} failed: got {done} of {total} bytes")
    if progress:
        print(f"{label}: {done / 1e6:.1f} MB done", file=sys.stderr, flush=True)


def download(
    name: str,
    data_dir: str | Path,
    *,
    progress: bool = True,
    checksums: Mapping[str, str] | None = None,
) -> Path:
    """Download the official files into data_dir/<name>/ and return that directory.

    Each file is written to a temporary file in the same directory and renamed into
    place only after its checksum was verified. Files already present and valid are kept.
    """
    expected = _expected(name, checksums)
    dest = Path(data_dir).expanduser() / name
    dest.mkdir(parents=True, exist_ok=True)
    for filename in _files(name):
        target = dest / filename
        if target.is_file():
            try:
                _read_checked(name, target, filename, expected)
                continue
            except DataError:
                pass  # corrupt or foreign copy: fetch it again
        fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{filename}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                _fetch(_url(name, filename), out, f"{name}/{filename}", progress)
                out.flush()
                os.fsync(out.fileno())
            _read_checked(name, Path(tmp), filename, expected)
            os.chmod(tmp, 0o666 & ~umask())  # mkstemp creates 0600; data dirs are often shared
            refuse_special(target, "dataset file")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return dest


def prepare(name: str, data_dir: str | Path | None, *, allow_download: bool = True) -> dict:
    """Locate (or download into data_dir), verify and parse a dataset; return a JSON manifest."""
    try:
        directory = locate(name, data_dir)
    except DataError as e:
        if not allow_download:
            raise
        if data_dir is None:
            raise DataError(f"{e}\nCannot download: no data directory was given.") from None
        directory = download(name, data_dir)
    dataset, verified = _load(name, directory, None)
    return {
        "dataset": name,
        "directory": str(directory),
        "files": verified,
        "n_train": int(len(dataset.y_train)),
        "n_test": int(len(dataset.y_test)),
    }
