"""A problem on scikit-learn's bundled handwritten digits, for dpbench, as one spec: ``DIGITS``.

Data. The 1,797 images of 8x8 pixels (values 0-16, ten classes: the digits 0-9; the UCI "Optical
Recognition of Handwritten Digits" test set) that scikit-learn ships inside its package, the file
``sklearn/datasets/data/digits.csv.gz`` that ``sklearn.datasets.load_digits`` reads: one line per
image, its 64 pixels row by row, then its label. Nothing is downloaded. The file is checked
against its SHA-256 (``SHA256``, the file of scikit-learn ``SKLEARN_VERSION``) before it is
parsed, and the bytes that were hashed are the bytes parsed: another file is an error, never a
silent substitute.

Split. Fixed and public: numpy's ``default_rng(SPLIT_SEED)`` permutes the 1,797 image positions;
the first ``TRAIN_SIZE`` = 1,497 of the permutation are the training split, the last 300 the
test split, each kept in file order. The split depends on no pixel or label, so drawing it spends
no privacy; every run sees the same split whatever its seed (a run's validation split and
subsets are dpbench's, drawn from the training split by the run's seed).

Task. dpbench's classification task: the pixels scaled to [0, 1] by 16, their largest value,
and not normalised (normalising by the data's own mean and std would read the private data
without noise); per-sample cross-entropy; accuracy reported and selected on.

Model. ``DigitsMLP``: 64 pixels -> 64 ReLU units -> 10 logits, 4,810 parameters (64 x 64 + 64
+ 64 x 10 + 10), every trainable layer a ``Linear`` (per-sample gradients by dpbench's own
per-layer rules).

Registration: the entry point ``digits = "dpbench_example.digits:DIGITS"`` in the group
``dpbench.problems`` (the entry point's name is the problem id, ``DIGITS.id``).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import zlib
from pathlib import Path

import numpy as np
from torch import nn

from dpbench.plugin import Classification, DataError, Dataset, Problem, ProblemFacts

NAME = "sklearn-digits"
SKLEARN_VERSION = "1.9.1"  # the scikit-learn whose bundled file SHA256 is
SHA256 = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"  # sklearn/datasets/data/digits.csv.gz
IMAGES, PIXELS, CLASSES, LARGEST = 1_797, 8 * 8, 10, 16
TRAIN_SIZE = 1_497  # the test split: the remaining 300
SPLIT_SEED = 0


def bundled_file() -> Path:
    """Where the installed scikit-learn keeps the digits (found without importing scikit-learn)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"{NAME}: scikit-learn is not installed, and the digits ship inside it: "
                        f"pip install scikit-learn=={SKLEARN_VERSION}")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"


def parse(raw: bytes, source: str) -> tuple[np.ndarray, np.ndarray]:
    """The file's images as uint8 (1797, 1, 8, 8) and labels as int64 (1797,), as ``load_digits``
    reads them (comma-separated numbers, 64 pixels then the label per line)."""
    try:
        table = np.loadtxt(io.BytesIO(gzip.decompress(raw)), delimiter=",", ndmin=2)
    except (OSError, EOFError, zlib.error, ValueError) as e:
        raise DataError(f"{source}: not the gzipped CSV of the digits ({e})") from None
    if table.shape != (IMAGES, PIXELS + 1):
        raise DataError(f"{source}: expected {IMAGES} lines of {PIXELS} pixels and a label, got a table of {table.shape}")
    pixels, labels = table[:, :PIXELS], table[:, PIXELS]
    if not (np.all(pixels == np.round(pixels)) and pixels.min() >= 0 and pixels.max() <= LARGEST):
        raise DataError(f"{source}: pixel values outside the integers 0..{LARGEST}")
    if not (np.all(labels == np.round(labels)) and labels.min() >= 0 and labels.max() < CLASSES):
        raise DataError(f"{source}: labels outside 0..{CLASSES - 1}")
    return pixels.astype(np.uint8).reshape(IMAGES, 1, 8, 8), labels.astype(np.int64)


def split() -> tuple[np.ndarray, np.ndarray]:
    """The image positions of the training and the test split (see the module docstring)."""
    order = np.random.default_rng(SPLIT_SEED).permutation(IMAGES)
    return np.sort(order[:TRAIN_SIZE]), np.sort(order[TRAIN_SIZE:])


def load(data_dir: str | None = None) -> Dataset:
    """The verified digits in their fixed split. ``data_dir`` is not read: the data ship inside
    scikit-learn."""
    path = bundled_file()
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{NAME}: cannot read {path}: {e}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise DataError(f"{path}: SHA-256 {digest} is not that of the digits file of scikit-learn {SKLEARN_VERSION} "
                        f"({SHA256}); the file was changed or is another one")
    images, labels = parse(raw, str(path))
    train, test = split()
    return Dataset(NAME, images[train], labels[train], images[test], labels[test], str(path))


class DigitsMLP(nn.Module):
    """64 pixels -> 64 ReLU units -> 10 logits."""

    per_sample_forward = True  # its forward only calls its Sequential (dpbench.privacy.per_sample.check_per_sample)

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(PIXELS, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))

    def forward(self, x):
        return self.net(x)


# Cost constants for dpbench's cluster model, seconds one example adds to a DP step: on a GPU
# assumed (not measured; a sixth of P2's assumed 30 us for a network 1/47 of its size), on the
# CPU a 1-thread DP-SGD step at L = 256 measured on a shared, loaded 2-core machine (32 ms, all
# of it counted per example).
FACTS = ProblemFacts(id="digits", dataset=NAME, task="classification", train_size=TRAIN_SIZE,
                     test_size=IMAGES - TRAIN_SIZE, parameters=4_810, features=PIXELS,
                     gpu_s_per_example=5e-6, cpu_s_per_example=0.13e-3)
DIGITS = Problem(FACTS, Classification(scale=float(LARGEST)), DigitsMLP, load)
