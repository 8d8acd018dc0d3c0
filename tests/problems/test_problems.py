"""The problems: P1-P3's architectures, parameter counts, preprocessing and losses; the
torch-free catalog of every problem's facts against the built problems; N counted by one
function for the run and the grid; the registry that takes a plugin's spec."""

import dataclasses
import importlib.util
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, tree_env
from dpbench.problems import encoders
from dpbench.problems import facts as problems_facts
from dpbench.data.dataset import Dataset
from dpbench.problems import PROBLEMS, catalog, get_problem, registry
from dpbench.problems.convnets import CHANNEL_STATS


@pytest.mark.parametrize("pid,params,shape", [("P1", 258_762, (3, 32, 32)), ("P2", 225_034, (1, 28, 28)),
                                              ("P3", 1_875_265, (1, 28, 28))])
def test_parameter_counts_and_shapes(pid, params, shape):
    problem = PROBLEMS[pid]
    model = problem.build()
    assert sum(p.numel() for p in model.parameters()) == params
    x = torch.rand(5, *shape)
    if problem.task.name == "classification":
        assert model(x).shape == (5, 10)
    else:
        recon, mu, logvar = model(x, torch.zeros(5, 32))
        assert recon.shape == x.shape and mu.shape == logvar.shape == (5, 32)
        assert recon.min() >= 0 and recon.max() <= 1  # Sigmoid output


def test_preprocessing():
    images = np.array([[[[0, 255]]], [[[128, 64]]]], dtype=np.uint8)  # (2, 1, 1, 2)
    x = get_problem("P2").preprocess(images)
    mean, std = CHANNEL_STATS["fashion-mnist"]
    torch.testing.assert_close(x[0, 0, 0], (torch.tensor([0.0, 1.0]) - mean[0]) / std[0])
    # the VAE sees pixels in [0, 1], not normalised values (thesis code defect 6)
    v = get_problem("P3").preprocess(images)
    torch.testing.assert_close(v[0, 0, 0], torch.tensor([0.0, 1.0]))
    rgb = get_problem("P1").preprocess(np.full((1, 3, 2, 2), 255, np.uint8))
    m, s = CHANNEL_STATS["cifar10"]
    torch.testing.assert_close(rgb[0, :, 0, 0], (1 - torch.tensor(m)) / torch.tensor(s))


def test_classification_refuses_features_and_the_wrong_channels_instead_of_broadcasting():
    """Feature vectors (N, F) given to the image task used to broadcast against the per-channel
    constants into an (N, F, N, F)-like 4-D tensor; now a one-line error naming the shape."""
    with pytest.raises(ValueError, match=r"takes images \(N, C, H, W\), got an array of shape \(5, 30\) "
                                         r"\(feature vectors: use TabularClassification\)"):
        get_problem("P2").preprocess(np.zeros((5, 30)))
    with pytest.raises(ValueError, match=r"mean and std for 3 channels, the images have 1"):
        get_problem("P1").preprocess(np.zeros((2, 1, 4, 4), np.uint8))
    with pytest.raises(ValueError, match=r"got an array of shape \(2, 4, 4\)$"):
        get_problem("P2").preprocess(np.zeros((2, 4, 4), np.uint8))


def test_tabular_classification_standardises_by_its_fixed_constants_and_trains_per_sample():
    from dpbench.problems.tasks import TabularClassification

    task = TabularClassification(mean=[10.0, 0.0, -1.0], std=[2.0, 0.5, 4.0])
    raw = np.array([[12.0, 0.5, 3.0], [10.0, -1.0, -1.0]])
    x = task.preprocess(raw)
    torch.testing.assert_close(x, torch.tensor([[1.0, 1.0, 1.0], [0.0, -2.0, 0.0]]))
    assert x.dtype == torch.float32 and task.facts is catalog.CLASSIFICATION and task.capture_refusal is None
    for bad in (np.zeros((2, 4)), np.zeros((2, 3, 1))):
        with pytest.raises(ValueError, match=r"TabularClassification takes feature vectors \(N, 3\)"):
            task.preprocess(bad)
    with pytest.raises(ValueError, match="one mean and one std per feature, got 2 and 1"):
        TabularClassification([0.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="std positive"):
        TabularClassification([0.0], [0.0])
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    losses, correct = task.per_sample_loss(model, x, torch.tensor([0, 1]))
    assert losses.shape == correct.shape == (2,)
    torch.testing.assert_close(losses, F.cross_entropy(model(x), torch.tensor([0, 1]), reduction="none"))
    spec = dataclasses.replace(tiny_spec(features=3), task=task)
    registry.check(spec)  # a tabular problem is a well-formed problem spec


def test_published_normalisation_constants_match_real_data(fmnist_dir):
    from dpbench.data import image_datasets

    ds = image_datasets.load("fashion-mnist", fmnist_dir)
    x = ds.x_train.astype(np.float64) / 255
    mean, std = CHANNEL_STATS["fashion-mnist"]
    assert x.mean() == pytest.approx(mean[0], abs=1e-3)
    assert x.std() == pytest.approx(std[0], abs=1e-3)


def test_classification_loss_is_per_sample_cross_entropy():
    problem = get_problem("P2")
    model = problem.build()
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 3, 9, 1])
    losses, correct = problem.per_sample_loss(model, x, y)
    logits = model(x)
    torch.testing.assert_close(losses, F.cross_entropy(logits, y, reduction="none"))
    assert torch.equal(correct, logits.argmax(1) == y)


def test_vae_loss_is_summed_per_sample():
    """Per-sample loss = BCE summed over the 784 pixels + KL summed over the 32 latent dims;
    one sample's loss does not depend on the others (no batch-mean reduction)."""
    problem = get_problem("P3")
    model = problem.build()
    x = torch.rand(3, 1, 28, 28)
    g = torch.Generator().manual_seed(0)
    losses, correct = problem.per_sample_loss(model, x, None, g)
    assert correct is None and losses.shape == (3,)
    noise = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    recon, mu, logvar = model(x, noise)
    rec = -(x * torch.log(recon) + (1 - x) * torch.log(1 - recon)).sum((1, 2, 3))
    kl = 0.5 * (mu ** 2 + logvar.exp() - 1 - logvar).sum(1)
    torch.testing.assert_close(losses, rec + kl, rtol=1e-4, atol=1e-3)
    # the reconstruction term alone is of the order of 784 * log 2 for an untrained decoder
    assert rec.mean().item() > 300


# -- the catalog: each problem's facts, without torch ---------------------------------------------


def test_catalog_holds_the_facts_of_every_registered_problem():
    assert list(catalog.FACTS) == list(PROBLEMS) == ["P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P9"]
    for pid, problem in PROBLEMS.items():
        facts = problems_facts(pid)
        assert problem.facts is facts and problem.task.facts is catalog.TASKS[facts.task]
        if facts.family == "bert-encoder" and importlib.util.find_spec(encoders.CATALOG[facts.pretrained].module) is None:
            continue  # its twin is the catalogued encoder's architecture (tests/problems/test_problems_encoder.py)
        assert sum(p.numel() for p in problem.build().parameters()) == facts.parameters
    sizes = {pid: (f.dataset, f.task, f.metric, f.train_size, f.test_size, f.planted) for pid, f in catalog.FACTS.items()}
    assert sizes == {"P1": ("cifar10", "classification", "accuracy", 50_000, 10_000, 0),
                     "P2": ("fashion-mnist", "classification", "accuracy", 60_000, 10_000, 0),
                     "P3": ("fashion-mnist", "vae", "loss", 60_000, 10_000, 0),
                     "P4": ("fortunes", "language-model", "loss", 12_979, 1_417, 93),
                     "P5": ("fortunes", "language-model", "loss", 12_979, 1_417, 93),
                     "P6": ("fortunes", "classification", "accuracy", 12_979, 1_417, 0),
                     "P7": ("fortunes", "classification", "accuracy", 12_979, 1_417, 0),
                     "P8": ("rotten-tomatoes", "classification", "accuracy", 5_930, 1_736, 0),
                     "P9": ("imdb", "classification", "accuracy", 17_423, 5_017, 0)}
    with pytest.raises(KeyError, match="unknown problem 'P10'; choose one of"):
        problems_facts("P10")
    with pytest.raises(KeyError, match="unknown problem 'P10'; choose one of"):
        get_problem("P10")


def test_task_facts_say_what_is_reported_and_selected():
    c, v, lm = (catalog.task_facts(n) for n in ("classification", "vae", "language-model"))
    assert (c.metric, c.select_higher, c.measures_accuracy, c.plants_canaries) == ("accuracy", True, True, False)
    assert (v.metric, v.select_higher, v.measures_accuracy, v.plants_canaries) == ("loss", False, False, False)
    assert (lm.metric, lm.select_higher, lm.measures_accuracy, lm.plants_canaries) == ("loss", False, False, True)
    from dpbench.training.train import summarize

    # validation picks epoch 2 by accuracy (highest) for a classifier, epoch 1 by loss (lowest) otherwise
    metrics = pd.DataFrame({"split": ["val", "val", "test", "test"], "epoch": [1, 2, 1, 2], "loss": [0.5, 0.9, 0.6, 1.0],
                            "accuracy": [0.7, 0.8, 0.71, 0.79]})
    assert summarize(metrics, c)["test_accuracy_at_best_val"] == 0.79
    assert summarize(metrics, v)["test_loss_at_best_val"] == summarize(metrics, lm)["test_loss_at_best_val"] == 0.6


def test_the_catalog_and_what_reads_it_need_no_torch():
    """The grid, the cluster cost model, the matrix cache and the reports read problem facts
    in processes without torch (the workflow's analysis and data environments)."""
    code = f"""
import sys


class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "opacus"):
            raise ImportError(name)


sys.meta_path.insert(0, NoTorch())
from dpbench.problems import catalog
from dpbench.pipeline import cluster, grid
from dpbench.matrix.store import cache
from dpbench.reporting import aggregate
assert cluster.train_size("P4", {{"validation_size": 10}}) == 12_979 - 10 + 93
assert grid.Cell("P1", "dpsgd", 256, 1, None, 0.1, 0, 0).dataset == "cifar10"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=tree_env())
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-2000:]


def test_n_is_counted_by_one_function_for_the_run_and_the_grid(monkeypatch):
    """For every problem, canaries included: the training split a run builds has as many
    examples as the grid (matrix keys) and the cluster cost model count, under subsets and
    validation splits (datasets of 120 records standing in for the official ones)."""
    from dpbench.pipeline import cluster
    from dpbench.pipeline.grid import Cell
    from dpbench.problems import language
    from dpbench.seeds import stream_seeds
    from dpbench.training.config import RunConfig
    from dpbench.training.splits import load_splits

    shapes = {"P1": (3, 32, 32), "P2": (1, 28, 28), "P3": (1, 28, 28)}
    rng = np.random.default_rng(0)
    for pid, problem in PROBLEMS.items():
        facts = dataclasses.replace(problem.facts, train_size=120)
        monkeypatch.setitem(catalog.FACTS, pid, facts)
        shape = shapes.get(pid, (language.CONTEXT + 1,))
        x = rng.integers(0, 256, (150, *shape)).astype(np.uint8 if pid in shapes else np.int64)
        data = Dataset(facts.dataset, x[:120], rng.integers(0, 10, 120), x[120:], rng.integers(0, 10, 30), "generated")
        spec = dataclasses.replace(problem, facts=facts, load=lambda data_dir, data=data: data)
        for train in ({}, {"train_subset": 50}, {"validation_size": 20}, {"train_subset": 70, "validation_size": 9},
                      {"train_subset": 500}):
            n = Cell(pid, "dpsgd", 8, 1, 1.0, 0.1, 0, 0).n_train(train)
            assert n == cluster.train_size(pid, train)
            cfg = RunConfig(problem=pid, optimizer="dpsgd", lr=0.1, batch_size=8, epochs=1, seed=0, epsilon=1.0,
                            train_subset=train.get("train_subset"), validation_size=train.get("validation_size", 0))
            splits = load_splits(cfg, spec, stream_seeds(0), "cpu")
            expected = min(120, train.get("train_subset", 120)) - train.get("validation_size", 0) + facts.planted
            assert splits.x_train.shape[0] == n == expected, (pid, train)
    assert catalog.training_examples(100, None, 0, 93) == 193


def test_a_task_that_plants_other_than_its_facts_say_is_refused():
    """The run checks its training split against the one count: a task that planted other
    records than the problem's facts declare would give the grid another N."""
    from dpbench.seeds import stream_seeds
    from dpbench.training.config import RunConfig
    from dpbench.training.splits import load_splits

    rng = np.random.default_rng(0)
    data = Dataset("fashion-mnist", rng.integers(0, 256, (40, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, 40),
                   rng.integers(0, 256, (10, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, 10), "generated")

    class Planting(type(get_problem("P2").task)):
        def make_canaries(self, seed):
            return ["one"]

        def canary_records(self, canaries):
            return np.zeros((1, 1, 28, 28), np.uint8)

    spec = dataclasses.replace(get_problem("P2"), task=Planting(*CHANNEL_STATS["fashion-mnist"]),
                               load=lambda data_dir: data)
    cfg = RunConfig(problem="P2", optimizer="sgd", lr=0.1, batch_size=8, epochs=1, seed=0)
    with pytest.raises(RuntimeError, match="training split has 41 examples where catalog.training_examples counts 40"):
        load_splits(cfg, spec, stream_seeds(0), "cpu")


# -- the registry: a plugin's problem is one spec ---------------------------------------------------


def tiny_spec(problem_id="tiny", **facts):
    from dpbench.problems.spec import Problem
    from dpbench.problems.tasks import Classification

    fields = dict(id=problem_id, dataset="tiny-images", task="classification", train_size=100, test_size=20,
                  parameters=650, features=64, gpu_s_per_example=1e-6, cpu_s_per_example=1e-5)
    return Problem(catalog.ProblemFacts(**{**fields, **facts}), Classification(scale=16.0),
                   lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)),
                   lambda data_dir=None: None)


@pytest.fixture
def tiny(monkeypatch):
    """A problem 'tiny' registered beside the built-ins, as an installed plugin's entry point
    would register it."""
    from dpbench.plugins import Registry

    spec = tiny_spec()
    monkeypatch.setattr(registry, "PROBLEMS", Registry(registry.GROUP, {**registry.PROBLEMS.builtins, "tiny": spec}))
    return spec


def test_a_registered_spec_is_everywhere_a_built_in_is(tiny):
    from dpbench.pipeline import cluster
    from dpbench.pipeline.grid import Cell

    assert get_problem("tiny") is tiny and problems_facts("tiny") is tiny.facts
    assert Cell("tiny", "dpsgd", 10, 1, 1.0, 0.1, 0, 0).n_train({"validation_size": 5}) == 95
    assert cluster.planned_steps("tiny", 10, 2) == 20
    x = tiny.preprocess(np.array([[[[0, 16]]]], np.uint8))
    torch.testing.assert_close(x, torch.tensor([[[[0.0, 1.0]]]]))  # pixels 0-16 scaled to [0, 1], not normalised
    with pytest.raises(KeyError, match="unknown problem 'nope'"):
        problems_facts("nope")


def test_a_malformed_spec_is_refused_saying_why():
    registry.check(tiny_spec())  # well-formed
    with pytest.raises(ValueError, match="its task must be a dpbench.problems.tasks.Task, got str"):
        registry.check(dataclasses.replace(tiny_spec(), task="classification"))
    with pytest.raises(ValueError, match="build must be callable"):
        registry.check(dataclasses.replace(tiny_spec(), build=None))
    with pytest.raises(ValueError, match="its facts name task 'vae', its task is 'classification'"):
        registry.check(tiny_spec(task="vae"))
    with pytest.raises(ValueError, match="its facts must be a dpbench.problems.catalog.ProblemFacts, got dict"):
        registry.check(dataclasses.replace(tiny_spec(), facts={"id": "tiny"}))
    with pytest.raises(ValueError, match="problem id 'a/b': letters, digits"):
        tiny_spec("a/b")
    with pytest.raises(ValueError, match="problem 'tiny': train_size must be a positive integer, got 0"):
        tiny_spec(train_size=0)
