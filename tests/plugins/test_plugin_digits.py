"""The example plugin's problem (examples/plugin/src/dpbench_example/digits.py), read from its
file without installing the plugin: its digits file checked and parsed (a generated file in the
official format, its checksum put in place of the real one), its fixed split, its facts against
its model, and a dpbench run of it once registered. With scikit-learn installed, also the real
bundled file: its checksum and the parse against ``sklearn.datasets.load_digits``."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util

import numpy as np
import pytest

from conftest import REPO, run_cell
from dpbench.problems import facts as problems_facts
from dpbench.data.dataset import DataError
from dpbench.plugins import Registry
from dpbench.problems import registry
from dpbench.training.train import RunConfig

DIGITS_PY = REPO / "examples" / "plugin" / "src" / "dpbench_example" / "digits.py"


@pytest.fixture(scope="module")
def digits():
    spec = importlib.util.spec_from_file_location("dpbench_example_digits", DIGITS_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def generated(digits, monkeypatch, tmp_path):
    """A digits file in the official format (64 pixels 0-16 and a label per line), standing in
    for scikit-learn's: returns (pixels (1797, 64), labels)."""
    rng = np.random.default_rng(5)
    pixels, labels = rng.integers(0, 17, (1797, 64)), np.arange(1797) % 10
    text = "\n".join(",".join(f"{v:.1f}" for v in row) + f",{label:.1f}" for row, label in zip(pixels, labels))
    path = tmp_path / "digits.csv.gz"
    path.write_bytes(gzip.compress(text.encode() + b"\n"))
    monkeypatch.setattr(digits, "bundled_file", lambda: path)
    monkeypatch.setattr(digits, "SHA256", hashlib.sha256(path.read_bytes()).hexdigest())
    return pixels, labels


def test_the_file_is_parsed_into_the_fixed_split(digits, generated):
    pixels, labels = generated
    ds = digits.load("ignored")
    train, test = digits.split()
    assert ds.x_train.shape == (1497, 1, 8, 8) and ds.x_test.shape == (300, 1, 8, 8) and ds.x_train.dtype == np.uint8
    assert ds.y_train.dtype == np.int64 and ds.name == "sklearn-digits"
    np.testing.assert_array_equal(ds.x_train.reshape(1497, 64), pixels[train])
    np.testing.assert_array_equal(ds.y_test, labels[test])
    # a fixed split of every image: disjoint, complete, in file order, the same on every load
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(1797))
    assert (np.diff(train) > 0).all() and (np.diff(test) > 0).all()
    assert test[:5].tolist() == [1, 3, 4, 6, 7] and int(test.sum()) == 260_233  # pinned: default_rng(0)
    np.testing.assert_array_equal(digits.load().x_test, ds.x_test)


def test_another_file_or_no_scikit_learn_is_an_error(digits, generated, monkeypatch, tmp_path):
    path = digits.bundled_file()
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(DataError, match="SHA-256 .* is not that of the digits file of scikit-learn 1.9.1"):
        digits.load()
    with pytest.raises(DataError, match=r"expected 1797 lines of 64 pixels and a label, got a table of \(2, 65\)"):
        digits.parse(gzip.compress(b"0" + b",0" * 64 + b"\n1" + b",1" * 64 + b"\n"), "small")
    with pytest.raises(DataError, match="pixel values outside the integers 0..16"):
        digits.parse(gzip.compress(("\n".join(["17" + ",0" * 64] * 1797)).encode()), "bright")
    monkeypatch.undo()  # the real bundled_file (the fixture replaced it), with scikit-learn hidden
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match=r"scikit-learn is not installed.*pip install scikit-learn==1.9.1"):
        digits.bundled_file()


def test_the_spec_states_its_own_facts(digits):
    spec = digits.DIGITS
    model = spec.build()
    assert sum(p.numel() for p in model.parameters()) == spec.facts.parameters == 64 * 64 + 64 + 64 * 10 + 10
    assert (spec.id, spec.task.name, spec.metric) == ("digits", "classification", "accuracy")
    assert (spec.facts.train_size, spec.facts.test_size, spec.facts.planted) == (1497, 300, 0)
    x = spec.preprocess(np.array([[[[0, 8], [16, 4]]]], np.uint8))
    assert x.tolist() == [[[[0.0, 0.5], [1.0, 0.25]]]]  # scaled by 16, not normalised
    logits = model(spec.preprocess(np.zeros((3, 1, 8, 8), np.uint8)))
    assert logits.shape == (3, 10)


def test_a_registered_digits_problem_trains_in_dpbench(digits, generated, monkeypatch):
    # registered beside the built-ins, as its entry point registers it once installed
    registry.check(digits.DIGITS)
    monkeypatch.setattr(registry, "PROBLEMS", Registry(registry.GROUP, {**registry.PROBLEMS.builtins,
                                                                        "digits": digits.DIGITS}))
    # the workflow's data rule (`dpbench data --dataset sklearn-digits`) verifies it through its loader
    assert registry.dataset_manifest("sklearn-digits") == {"dataset": "sklearn-digits", "problem": "digits",
                                                           "source": digits.DIGITS.load(None).source,
                                                           "n_train": 1497, "n_test": 300}
    with pytest.raises(ValueError, match=r"unknown dataset 'mnist'; choose one of \['cifar10', 'fashion-mnist', "
                                         r"'fortunes', 'imdb', 'rotten-tomatoes', 'sklearn-digits'\]"):
        registry.dataset_manifest("mnist")
    res = run_cell(RunConfig(problem="digits", optimizer="dpsgd", lr=0.5, batch_size=64, epochs=1, seed=0,
                             epsilon=2.0, max_steps=3, validation_size=97, progress_every_s=1e9))
    meta = res.meta
    assert meta["problem"] == {"id": "digits", "dataset": "sklearn-digits", "task": "classification",
                               "metric": "accuracy", "parameters": 4810, "plugin": None}
    assert meta["data"]["n_train"] == 1400 == problems_facts("digits").n_train(validation_size=97)
    assert meta["data"]["n_test"] == 300 and meta["privacy"]["sample_rate"] == pytest.approx(64 / 1400)
    assert meta["result"]["status"] == "completed" and 0 <= meta["result"]["final_test_accuracy"] <= 1


def test_the_real_bundled_digits(digits):
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    ds = digits.load()
    real = sklearn_datasets.load_digits()
    train, test = digits.split()
    np.testing.assert_array_equal(ds.x_train[:, 0], real.images[train])
    np.testing.assert_array_equal(ds.y_test, real.target[test])
    assert np.bincount(ds.y_train).tolist() == [145, 149, 135, 161, 144, 156, 150, 156, 152, 149]
