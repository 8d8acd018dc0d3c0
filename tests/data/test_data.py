"""Tests of dpbench.data.image_datasets on small files generated in the official formats, plus the real
Fashion-MNIST when it is installed."""

from __future__ import annotations

import email.message
import gzip
import hashlib
import io
import pickle
import struct
import tarfile
import urllib.error
import urllib.request
import urllib.response
from pathlib import Path

import numpy as np
import pytest

from dpbench.data import image_datasets
from dpbench.data.dataset import DataError

FMNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")


def md5(payload: bytes) -> str:
    return hashlib.md5(payload).hexdigest()


def idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.tobytes()


def make_fashion(directory: Path, n_train: int = 20, n_test: int = 10, seed: int = 0):
    """Write the four Fashion-MNIST .gz files; return (arrays, payloads, checksums)."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    payloads = {key: idx_bytes(a) for key, a in arrays.items()}
    directory.mkdir(parents=True, exist_ok=True)
    for key, payload in payloads.items():
        (directory / f"{key}.gz").write_bytes(gzip.compress(payload))
    return arrays, payloads, {key: md5(p) for key, p in payloads.items()}


CIFAR_BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def cifar_batches(per_batch: int = 3, seed: int = 0) -> dict[str, dict]:
    """Batch dicts shaped like the official ones (bytes keys, (N, 3072) uint8 data)."""
    rng = np.random.default_rng(seed)
    return {
        name: {
            b"batch_label": name.encode(),
            b"labels": [int(v) for v in rng.integers(0, 10, per_batch)],
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"filenames": [f"img_{i}.png".encode() for i in range(per_batch)],
        }
        for name in CIFAR_BATCHES
    }


def cifar_tar(batches: dict[str, object], compresslevel: int = 9) -> bytes:
    """A tarball with the real member names holding one pickle per batch."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=compresslevel) as tar:
        for name, batch in batches.items():
            raw = pickle.dumps(batch, protocol=2)  # like the official Python 2 pickles
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return buffer.getvalue()


@pytest.fixture
def no_system_dirs(monkeypatch, tmp_path):
    """Point SYSTEM_DIRS at an empty directory so tests never see installed data."""
    empty = tmp_path / "system"
    empty.mkdir()
    monkeypatch.setattr(image_datasets, "SYSTEM_DIRS", {"fashion-mnist": [empty], "cifar10": [empty]})
    return empty


def test_read_idx_round_trip():
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    out = image_datasets.read_idx(idx_bytes(images))
    assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, images)
    ints = np.array([[-5, 70000], [1, 2]], dtype=">i4")
    out = image_datasets.read_idx(idx_bytes(ints, code=0x0C))
    assert out.dtype == np.int32 and out.dtype.isnative
    np.testing.assert_array_equal(out, [[-5, 70000], [1, 2]])


def test_load_fashion_round_trip(tmp_path, no_system_dirs):
    arrays, _, sums = make_fashion(tmp_path)
    ds = image_datasets.load("fashion-mnist", tmp_path, checksums=sums)
    assert ds.name == "fashion-mnist" and ds.source == str(tmp_path)
    assert ds.x_train.shape == (20, 1, 28, 28) and ds.x_test.shape == (10, 1, 28, 28)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int64
    np.testing.assert_array_equal(ds.x_train[:, 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(ds.y_train, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(ds.x_test[:, 0], arrays["t10k-images-idx3-ubyte"])
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])
    verified = image_datasets.verify("fashion-mnist", tmp_path, checksums=sums)
    assert verified == {k: f"md5:{v}" for k, v in sums.items()}


def test_load_cifar_round_trip(tmp_path, no_system_dirs):
    batches = cifar_batches(per_batch=3)
    pixel = batches["data_batch_2"][b"data"][1]  # second image of data_batch_2
    pixel[:] = 0
    pixel[1 * 1024 + 5 * 32 + 7] = 201  # channel 1 (G), row 5, column 7
    blob = cifar_tar(batches)
    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / "cifar-10-python.tar.gz").write_bytes(blob)
    ds = image_datasets.load("cifar10", tmp_path, checksums={"cifar-10-python.tar.gz": md5(blob)})
    assert ds.source == str(tmp_path / "cifar10" / "cifar-10-python.tar.gz")
    assert ds.x_train.shape == (15, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.int64
    image = ds.x_train[3 + 1]
    assert image[1, 5, 7] == 201 and int(image.sum()) == 201
    train = [batches[n] for n in CIFAR_BATCHES[:5]]
    train_x = np.concatenate([b[b"data"] for b in train])
    np.testing.assert_array_equal(ds.x_train.reshape(15, -1), train_x)
    np.testing.assert_array_equal(ds.y_train, sum((b[b"labels"] for b in train), []))
    np.testing.assert_array_equal(ds.x_test.reshape(3, -1), batches["test_batch"][b"data"])
    np.testing.assert_array_equal(ds.y_test, batches["test_batch"][b"labels"])


def test_cifar_refuses_foreign_pickle_globals(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "cifar-10-python.tar.gz"
    path.write_bytes(cifar_tar({name: {b"data": Evil(), b"labels": []} for name in CIFAR_BATCHES}))
    with pytest.raises(DataError, match="refusing to load global .*print"):
        image_datasets.read_cifar10(path)


def test_cifar_missing_member(tmp_path):
    path = tmp_path / "cifar-10-python.tar.gz"
    batches = cifar_batches()
    del batches["test_batch"]
    path.write_bytes(cifar_tar(batches))
    with pytest.raises(DataError, match="lacks member.*cifar-10-batches-py/test_batch"):
        image_datasets.read_cifar10(path)


def test_checksum_failure_names_file(tmp_path, no_system_dirs):
    make_fashion(tmp_path)
    with pytest.raises(DataError) as err:
        image_datasets.load("fashion-mnist", tmp_path)  # official table: generated files must not pass
    message = str(err.value)
    assert "train-images-idx3-ubyte" in message and str(tmp_path) in message
    assert image_datasets.FASHION_MNIST_MD5["train-images-idx3-ubyte"] in message

    blob = cifar_tar(cifar_batches())
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(blob)
    with pytest.raises(DataError, match="cifar-10-python.tar.gz.*c58f30108f718f92721af3b95e74349a"):
        image_datasets.load("cifar10", tmp_path)


def test_missing_file_names_file_and_places(tmp_path, no_system_dirs):
    make_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError) as err:
        image_datasets.locate("fashion-mnist", tmp_path)
    message = str(err.value)
    assert "missing t10k-labels-idx1-ubyte.gz" in message
    for place in (tmp_path, tmp_path / "fashion-mnist", no_system_dirs):
        assert str(place) in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "dpbench data --download" in message and image_datasets.FASHION_MNIST_URL in message

    with pytest.raises(DataError) as err:
        image_datasets.load("cifar10", tmp_path)
    assert "cifar-10-python.tar.gz" in str(err.value) and image_datasets.CIFAR10_URL in str(err.value)


def test_corrupt_idx_header(tmp_path, no_system_dirs):
    good = idx_bytes(np.zeros((2, 28, 28), dtype=np.uint8))
    with pytest.raises(DataError, match="magic"):
        image_datasets.read_idx(b"\x01" + good[1:])
    with pytest.raises(DataError, match="size mismatch"):
        image_datasets.read_idx(good[:-1])
    with pytest.raises(DataError, match="type code"):
        image_datasets.read_idx(good[:2] + b"\x42" + good[3:])

    _, payloads, sums = make_fashion(tmp_path)
    bad = payloads["t10k-images-idx3-ubyte"][:-5]  # truncated, but with a matching checksum
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(bad))
    sums["t10k-images-idx3-ubyte"] = md5(bad)
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte.gz: IDX size mismatch"):
        image_datasets.load("fashion-mnist", tmp_path, checksums=sums)


def test_label_range_and_count_checked(tmp_path, no_system_dirs):
    _, payloads, sums = make_fashion(tmp_path)
    for key, labels in [
        ("train-labels-idx1-ubyte", np.full(20, 10, dtype=np.uint8)),  # value out of range
        ("train-labels-idx1-ubyte", np.zeros(19, dtype=np.uint8)),  # count != image count
    ]:
        (tmp_path / f"{key}.gz").write_bytes(gzip.compress(idx_bytes(labels)))
        with pytest.raises(DataError, match="train-labels-idx1-ubyte"):
            image_datasets.load("fashion-mnist", tmp_path, checksums={**sums, key: md5(idx_bytes(labels))})


def test_locate_search_order(tmp_path, monkeypatch):
    system, mine = tmp_path / "system", tmp_path / "mine"
    make_fashion(system)
    monkeypatch.setattr(image_datasets, "SYSTEM_DIRS", {"fashion-mnist": [system], "cifar10": []})
    assert image_datasets.locate("fashion-mnist") == system
    assert image_datasets.locate("fashion-mnist", mine) == system  # data_dir empty: fall back
    make_fashion(mine / "fashion-mnist")
    assert image_datasets.locate("fashion-mnist", mine) == mine / "fashion-mnist"
    make_fashion(mine)
    assert image_datasets.locate("fashion-mnist", mine) == mine  # data_dir itself comes first


class _MemoryHandler(urllib.request.BaseHandler):
    """Serves URLs from a dict; checks that a file's final name is absent while its body is read."""

    handler_order = 100  # ahead of the default HTTP(S) handlers

    def __init__(self, files: dict[str, bytes], must_not_exist: Path | None = None):
        self.files, self.must_not_exist, self.requests = files, must_not_exist, []

    def _open(self, request):
        url = request.full_url
        self.requests.append(url)
        if url not in self.files:
            raise urllib.error.URLError("no route to host (test)")
        body = self.files[url]
        final = self.must_not_exist / url.rsplit("/", 1)[1] if self.must_not_exist else None

        class Body(io.BytesIO):
            def read(self, size=-1):
                assert final is None or not final.exists(), "final name before verification"
                return super().read(size)

        headers = email.message.Message()
        headers["Content-Length"] = str(len(body))
        response = urllib.response.addinfourl(Body(body), headers, url, 200)
        response.msg = "OK"
        return response

    http_open = https_open = _open


def _install(monkeypatch, handler: _MemoryHandler) -> None:
    monkeypatch.setattr(urllib.request, "_opener", urllib.request.build_opener(handler))


def test_download_is_atomic_and_verified(tmp_path, monkeypatch, capsys, no_system_dirs):
    arrays, payloads, sums = make_fashion(tmp_path / "upstream")
    files = {image_datasets.FASHION_MNIST_URL + f"{k}.gz": gzip.compress(p) for k, p in payloads.items()}
    handler = _MemoryHandler(files, must_not_exist=tmp_path / "dl" / "fashion-mnist")
    _install(monkeypatch, handler)

    # A corrupted body fails verification and leaves neither final nor temporary files.
    bad_url = image_datasets.FASHION_MNIST_URL + "train-images-idx3-ubyte.gz"
    good_body, files[bad_url] = files[bad_url], gzip.compress(b"\0\0\x08\x01" + b"\0" * 8)
    with pytest.raises(DataError, match="checksum mismatch for train-images-idx3-ubyte"):
        image_datasets.download("fashion-mnist", tmp_path / "dl", checksums=sums)
    assert list((tmp_path / "dl" / "fashion-mnist").iterdir()) == []

    files[bad_url] = good_body
    directory = image_datasets.download("fashion-mnist", tmp_path / "dl", checksums=sums)
    assert directory == tmp_path / "dl" / "fashion-mnist"
    assert sorted(p.name for p in directory.iterdir()) == sorted(f"{k}.gz" for k in payloads)
    assert "fashion-mnist/train-images-idx3-ubyte.gz" in capsys.readouterr().err
    ds = image_datasets.load("fashion-mnist", tmp_path / "dl", checksums=sums)
    np.testing.assert_array_equal(ds.x_train[:, 0], arrays["train-images-idx3-ubyte"])

    # Valid files already present are not fetched again.
    handler.requests.clear()
    image_datasets.download("fashion-mnist", tmp_path / "dl", checksums=sums, progress=False)
    assert handler.requests == []


def test_download_network_failure(tmp_path, monkeypatch, no_system_dirs):
    _install(monkeypatch, _MemoryHandler({}))
    with pytest.raises(DataError, match="cifar-10-python.tar.gz failed: .*no route to host"):
        image_datasets.download("cifar10", tmp_path, progress=False)
    assert list((tmp_path / "cifar10").iterdir()) == []


def test_prepare_manifest(tmp_path, monkeypatch, no_system_dirs):
    _, payloads, sums = make_fashion(tmp_path / "upstream")
    monkeypatch.setitem(image_datasets.OFFICIAL_MD5, "fashion-mnist", sums)
    with pytest.raises(DataError, match="missing train-images-idx3-ubyte.gz"):
        image_datasets.prepare("fashion-mnist", tmp_path / "dl", allow_download=False)
    with pytest.raises(DataError, match="Cannot download: no data directory"):
        image_datasets.prepare("fashion-mnist", None)
    files = {image_datasets.FASHION_MNIST_URL + f"{k}.gz": gzip.compress(p) for k, p in payloads.items()}
    _install(monkeypatch, _MemoryHandler(files))
    manifest = image_datasets.prepare("fashion-mnist", tmp_path / "dl")
    assert manifest == {
        "dataset": "fashion-mnist",
        "directory": str(tmp_path / "dl" / "fashion-mnist"),
        "files": {k: f"md5:{v}" for k, v in sums.items()},
        "n_train": 20,
        "n_test": 10,
    }


@pytest.mark.realdata
@pytest.mark.skipif(
    not all((FMNIST_SYSTEM_DIR / f"{k}.gz").is_file() for k in image_datasets.FASHION_MNIST_MD5),
    reason=f"real Fashion-MNIST not installed in {FMNIST_SYSTEM_DIR} "
    "(apt-get install dataset-fashion-mnist)",
)
def test_real_fashion_mnist():
    ds = image_datasets.load("fashion-mnist", FMNIST_SYSTEM_DIR)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_train.dtype == np.uint8
    assert ds.x_test.shape == (10000, 1, 28, 28) and ds.x_test.dtype == np.uint8
    assert ds.y_train.dtype == np.int64 and ds.y_test.dtype == np.int64
    assert np.bincount(ds.y_train, minlength=10).tolist() == [6000] * 10
    assert np.bincount(ds.y_test, minlength=10).tolist() == [1000] * 10
