import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
# read when cuBLAS first runs in this process, which may be before any test configures it
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import dpbench
from dpbench.privacy import accounting
from dpbench.training import cuda
from dpbench.data import image_datasets  # noqa: E402
from dpbench.data.dataset import Dataset  # noqa: E402


def pytest_configure(config):
    """The tests test this checkout's package, imported through the install (scripts/setup.sh
    installs src/ editable into .venv) or PYTHONPATH: refused where another copy would be tested."""
    if Path(dpbench.__file__).resolve().parent != REPO / "src" / "dpbench":
        pytest.exit(f"the tests import dpbench from {Path(dpbench.__file__).parent}, not this checkout's "
                    f"{REPO / 'src'}: install it (scripts/setup.sh: pip install -e .), or set PYTHONPATH={REPO / 'src'}",
                    returncode=4)
    # pytest-xdist (scripts/test.sh runs one worker per core): the folder of the groups
    # (GROUPS_FOLDER below), which the workers inherit; each worker's torch takes its share of
    # the cores, not all of them (two workers of two threads each on two cores only synchronise)
    if config.getoption("dist", "no") == "loadgroup" and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[GROUPS_FOLDER] = tempfile.mkdtemp(prefix="dpbench-xdist-groups-")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))


# Fixtures that are expensive to make or that must exist once: with pytest-xdist each worker
# makes its own session- or module-scoped fixtures, so every test that uses one of these gets an
# ``xdist_group`` named after it, and scripts/test.sh's `--dist loadgroup` runs each group on one
# worker: the tiny workflow's Snakemake run (tests/workflow/: test_workflow, test_reruns) and the
# local SLURM cluster (tests/pipeline/test_slurm.py). Fixtures that only cache (a module's cache
# folder of factorizations) are made per worker: the same values, computed again.
SHARED_FIXTURES = ("tiny_workflow", "slurm_cluster")
# pytest-xdist 3.8 marks a group by renaming the test's node id, which pytest 9 no longer lets it
# do: the workers write each test's group into this folder (made by the controller) and the
# controller's scheduler (pytest_xdist_make_scheduler below) reads them.
GROUPS_FOLDER = "DPBENCH_XDIST_GROUPS"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        names = getattr(getattr(item, "_fixtureinfo", None), "names_closure", ())
        shared = [name for name in SHARED_FIXTURES if name in names]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
    worker, folder = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(GROUPS_FOLDER)
    if worker and folder:
        groups = {item.nodeid: "_".join(sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                                                for m in item.iter_markers("xdist_group")}))
                  for item in items}
        write_slow_marks(Path(folder), worker, items)  # before the groups: the scheduler reads both once these are there
        tmp = Path(folder) / f".{worker}.json"
        tmp.write_text(json.dumps({nodeid: group for nodeid, group in groups.items() if group}))
        tmp.replace(Path(folder) / f"{worker}.json")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: the tests of one ``xdist_group`` on one worker, every other test
    wherever a worker is free (xdist's LoadScopeScheduling, a test's scope being its group),
    the longest first (``_longest_first_class``)."""
    if config.getoption("dist") != "loadgroup":
        return None
    folder = Path(os.environ[GROUPS_FOLDER])

    class FixtureGroups(_longest_first_class()):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid):  # called once every worker has collected
            if self.groups is None:
                self.groups = {k: v for f in sorted(folder.glob("gw*.json")) for k, v in json.loads(f.read_text()).items()}
            return self.groups.get(nodeid, nodeid)

        def estimates(self) -> dict[str, float]:
            return expected_times(slow_marked(folder))

    return FixtureGroups(config, log)


# ---------------------------------------------------------------- longest first
# Balance (scripts/test.sh on two workers): a worker that finishes while the other works through
# a queue of long tests idles. The scheduler sends each group (or lone test) in order of its
# expected time, longest first (Graham's LPT rule, whose end is within 4/3 of the best), and a worker
# holds no more than it needs: the test it runs, the next one (pytest-xdist runs a test only once
# it knows the next) and short tests up to PREFETCH_S seconds. The expected times: the committed
# table of benchmarks/results/suite/durations.tsv (scripts/suite_durations.py writes it); a test
# not in it is short (SHORT_S), or, marked slow, SLOW_S (a new workflow test is not left for last).
# DPBENCH_TEST_DURATIONS names another table (one just measured, to try before committing it).
DURATIONS = Path(os.environ.get("DPBENCH_TEST_DURATIONS", REPO / "benchmarks" / "results" / "suite" / "durations.tsv"))
SHORT_S = 0.1
SLOW_S = 30.0
PREFETCH_S = 2.0


def write_slow_marks(folder: Path, worker: str, items) -> None:
    """A worker's collected tests marked ``slow``, for the controller's estimates (``slow_marked``)."""
    tmp = folder / f".slow-{worker}.json"
    tmp.write_text(json.dumps([item.nodeid for item in items if item.get_closest_marker("slow")]))
    tmp.replace(folder / f"slow-{worker}.json")


def slow_marked(folder: Path) -> set[str]:
    return {nodeid for f in sorted(folder.glob("slow-gw*.json")) for nodeid in json.loads(f.read_text())}


def expected_times(slow: set[str] = frozenset(), table: Path = DURATIONS) -> "Estimates":
    """Each test's expected seconds: the table's, else SLOW_S for a test in ``slow``, else SHORT_S."""
    return Estimates(load_file(REPO / "scripts" / "suite_durations.py").estimates(table), slow)


class Estimates(dict):
    def __init__(self, known: dict[str, float], slow: set[str]):
        super().__init__(known)
        self.slow = set(slow)

    def __missing__(self, nodeid: str) -> float:
        return SLOW_S if nodeid in self.slow else SHORT_S


def longest_first_order(workqueue: dict[str, dict[str, bool]], estimate) -> list[str]:
    """The scopes (a group's tests, or one test) by their expected time, longest first; equal
    times in collection order."""
    total = {scope: sum(estimate[nodeid] for nodeid in tests) for scope, tests in workqueue.items()}
    return sorted(workqueue, key=lambda scope: -total[scope])  # sorted is stable


def _longest_first_class():
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirst(LoadScopeScheduling):
        """LoadScopeScheduling (a scope: an xdist_group, or one test) with the scopes in
        ``longest_first_order`` and each worker given work only while it holds less than two
        tests or less than PREFETCH_S seconds of them."""
        _estimate: dict | None = None

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self._pending: dict = {}  # node -> {its tests not yet done: expected seconds}

        def estimates(self) -> dict[str, float]:
            return expected_times()

        def _expected(self, nodeid):
            if self._estimate is None:
                self._estimate = self.estimates()
            return self._estimate[nodeid]

        def _wants_more(self, node) -> bool:
            pending = self._pending.setdefault(node, {})
            return len(pending) < 2 or (sum(pending.values()) < PREFETCH_S and len(pending) < 200)

        def _assign_work_unit(self, node) -> None:
            unit = next(iter(self.workqueue.values()))  # the one super() sends
            super()._assign_work_unit(node)
            self._pending.setdefault(node, {}).update({n: self._expected(n) for n, done in unit.items() if not done})

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            self._pending.get(node, {}).pop(self.registered_collections[node][item_index], None)
            super().mark_test_complete(node, item_index, duration)

        def remove_node(self, node):
            self._pending.pop(node, None)
            return super().remove_node(node)

        def _reschedule(self, node) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            while self.workqueue and self._wants_more(node):
                self._assign_work_unit(node)

        def schedule(self) -> None:
            assert self.collection_is_completed
            if self.collection is not None:
                for node in self.nodes:
                    self._reschedule(node)
                return
            if not self._check_nodes_have_same_collection():
                self.log("**Different tests collected, aborting run**")
                return
            self.collection = list(next(iter(self.registered_collections.values())))
            if not self.collection:
                return
            units: dict[str, dict[str, bool]] = {}
            for nodeid in self.collection:
                units.setdefault(self._split_scope(nodeid), {})[nodeid] = False
            estimate = self._estimate = self.estimates()
            for scope in longest_first_order(units, estimate):
                self.workqueue[scope] = units[scope]
            for _ in range(len(self.nodes) - len(self.workqueue)):  # more workers than scopes
                unused, _assigned = self.assigned_work.popitem()
                unused.shutdown()
            # round by round, one scope each, so that the longest go to different workers
            while self.workqueue and any(self._wants_more(node) for node in self.nodes):
                for node in self.nodes:
                    if self.workqueue and self._wants_more(node):
                        self._assign_work_unit(node)
            if not self.workqueue:
                for node in self.nodes:
                    if len(self._pending.get(node, {})) < 2:
                        node.shutdown()

    return LongestFirst


def pytest_unconfigure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(GROUPS_FOLDER):
        shutil.rmtree(os.environ.pop(GROUPS_FOLDER), ignore_errors=True)


def tree_env(root: Path = REPO, **variables) -> dict[str, str]:
    """The environment of a subprocess (python -m dpbench, snakemake) that must run the package of
    the tree ``root``, this checkout or a copy that a test edits: its src/ first on PYTHONPATH
    (the Snakefile refuses a dpbench other than its own src/), and ``variables`` set."""
    path = os.pathsep.join(filter(None, [str(Path(root) / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **variables, "PYTHONPATH": path}

FMNIST_DIRS = [Path(os.environ["DPBENCH_DATA_DIR"]) / "fashion-mnist"] if os.environ.get("DPBENCH_DATA_DIR") else []
FMNIST_DIRS += [REPO / "data" / "fashion-mnist", *image_datasets.SYSTEM_DIRS["fashion-mnist"]]


def _fmnist_dir():
    for d in FMNIST_DIRS:
        if all((d / f"{k}.gz").is_file() for k in image_datasets.FASHION_MNIST_MD5):
            return d
    return None


@pytest.fixture(scope="session")
def fmnist_dir():
    """The real Fashion-MNIST files; tests that need them skip (with the reason) when absent."""
    d = _fmnist_dir()
    if d is None:
        pytest.skip("real Fashion-MNIST not found (apt-get install dataset-fashion-mnist, "
                    "or `dpbench data --download --dataset fashion-mnist --data-dir data`)")
    return d


@pytest.fixture
def tiny_fmnist(monkeypatch):
    """In-process unit tests of the training loop: a small random dataset in Fashion-MNIST's
    shapes, patched into dpbench.data.image_datasets.load. Never used by the product, only by loop tests."""
    def fake_load(name, data_dir=None, **kw):
        assert name == "fashion-mnist"
        rng = np.random.default_rng(0)
        return Dataset(name, rng.integers(0, 256, (600, 1, 28, 28), dtype=np.uint8),
                            rng.integers(0, 10, 600), rng.integers(0, 256, (200, 1, 28, 28), dtype=np.uint8),
                            rng.integers(0, 10, 200), "generated-for-tests")

    monkeypatch.setattr(image_datasets, "load", fake_load)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    """Each test that takes it runs on the CPU and, marked ``cuda`` (``pytest -m cuda`` selects
    only those), on a CUDA GPU with the training harness's GPU numerics (dpbench.training.cuda: no TF32,
    deterministic kernels); without a GPU the CUDA case skips with the reason."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)")
        cuda.configure()
    return torch.device(request.param)


@pytest.fixture(scope="session", autouse=True)
def _memoized_accountant():
    """accounting.epsilon is a pure function of (history, delta, accountant), and evaluating it
    is most of what many tests spend (a sigma calibration evaluates it about 20 times, and the
    training tests calibrate the same plans again and again): within the test process each
    value is computed once. The values are the accountant's own, so no assertion changes."""
    original = accounting.epsilon

    @functools.lru_cache(maxsize=None)
    def cached(history, delta, accountant):
        return original([tuple(h) for h in history], delta, accountant)

    def epsilon(history, delta=accounting.DELTA, accountant="prv"):
        return cached(tuple(tuple(h) for h in history), delta, accountant)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(accounting, "epsilon", epsilon)
        yield


def run_cell(cfg, **kwargs):
    """``dpbench.training.train.run`` with the registry's spec of ``cfg.optimizer``, as the CLI calls it."""
    from dpbench.optimizers import get_optimizer
    from dpbench.training.train import run

    return run(cfg, get_optimizer(cfg.optimizer), **kwargs)


def run_cli(*args, cwd=None, check=True, timeout=600):
    proc = subprocess.run([sys.executable, "-m", "dpbench", *map(str, args)], cwd=cwd, env=tree_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"dpbench {' '.join(map(str, args))} failed:\n{proc.stderr[-3000:]}")
    return proc


def load_file(path: Path):
    """A script outside the package (benchmarks/, scripts/), imported by its file as the module
    named after it (those folders are not packages)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snakemake_exe():
    exe = Path(sys.executable).with_name("snakemake")
    return str(exe) if exe.exists() else shutil.which("snakemake")


def copy_repo(dest):
    """The files the workflow runs from, copied (tests edit the copy's sources)."""
    for name in ("Snakefile", "workflow", "src", "config", "envs"):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(src, dest / name)


@pytest.fixture
def repo_copy(tmp_path):
    """A fresh copy of the workflow's files (copy_repo) to run Snakemake in: no test reads or
    depends on the working tree's results/, .snakemake/ or caches (CI runs the tests after the
    README's quick start has made them)."""
    d = tmp_path / "repo"
    d.mkdir()
    copy_repo(d)
    return d


@pytest.fixture(scope="session")
def tiny_workflow(tmp_path_factory, fmnist_dir):
    """.test/config/config.yaml run to the end by Snakemake (profile default) in a copy of the
    repository, as run.yaml with the real Fashion-MNIST: the copy's directory. One run serves
    tests/workflow/test_workflow.py (its outputs) and tests/workflow/test_reruns.py (dry runs after
    edits to the copy's sources or config, each undone)."""
    d = tmp_path_factory.mktemp("tiny-workflow")
    copy_repo(d)
    config = yaml.safe_load((REPO / ".test" / "config" / "config.yaml").read_text())
    (d / "run.yaml").write_text(yaml.safe_dump({**config, "data_dir": str(fmnist_dir)}))
    proc = subprocess.run([snakemake_exe(), "--profile", d / "workflow" / "profiles" / "default",
                           "--configfile", "run.yaml"], cwd=d, capture_output=True, text=True, timeout=1200,
                          env=tree_env(d))
    assert proc.returncode == 0, proc.stderr[-4000:]
    (d / "snakemake.log").write_text(proc.stdout + proc.stderr)  # with the shell commands it ran (printshellcmds)
    return d


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: a second thread only adds synchronisation (100x slower on a busy machine).
    Modules of such tests use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def stand_in_checkpoint(dims: dict, seed: int = 0, sha256: str = "ab" * 32):
    """A stand-in for a loaded public checkpoint (what dpbench.problems.finetune reads): a
    TransformerLM's state dict of ``dims`` drawn from ``seed``, its dimensions, and a path,
    SHA-256 and recipe to record; the caller's random stream is left as it was."""
    import types

    from dpbench.problems.transformer import TransformerLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state = TransformerLM(**dims).state_dict()
    return types.SimpleNamespace(state_dict=state, model_dims=dict(dims), path="/public/wordnet-lm.pt",
                                 sha256=sha256, recipe="wordnet-lm")


def write_fortunes(directory: Path, files: dict[str, list[str]]) -> dict[str, str]:
    """Fortune files in the official format: each file's records joined by "%" lines (as the
    package writes them, with a final "%"); returns the manifest {file: sha256}."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {}
    for name, records in files.items():
        data = "".join(f"{r}\n%\n" for r in records).encode("utf-8")
        (directory / name).write_bytes(data)
        manifest[name] = hashlib.sha256(data).hexdigest()
    return manifest


WORDS = "the of and a to in is you that it he was for on are as with his they at be this".split()


def plant_generated_corpus(root: Path, patch) -> None:
    """400 generated quotations in the official format under ``root``/fortunes, verified through
    a manifest of their own (the loader's checksum table replaced through ``patch``, a
    MonkeyPatch), the system directory hidden, |R| = 1000: exact exposure in a blink."""
    from dpbench.data import fortunes
    from dpbench.problems import language

    rng = np.random.default_rng(0)
    records = [" ".join(rng.choice(WORDS, rng.integers(3, 30))) + f" ({i})" for i in range(400)]
    patch.setattr(fortunes, "SHA256", write_fortunes(root / "fortunes", {"generated": records}))
    (root / "system").mkdir()
    patch.setattr(fortunes, "SYSTEM_DIRS", [root / "system"])
    patch.setattr(language, "DIGITS", 3)


@pytest.fixture
def generated_corpus(monkeypatch, tmp_path):
    """``plant_generated_corpus`` in the test's temporary folder, which it returns."""
    plant_generated_corpus(tmp_path, monkeypatch)
    return tmp_path


@pytest.fixture
def labelled_corpus(monkeypatch, tmp_path):
    """Three fortunes files of the package's names in the official format, P6's and P7's data."""
    from dpbench.data import fortunes

    rng = np.random.default_rng(0)
    content = {name: [" ".join(rng.choice(WORDS, rng.integers(3, 20))) + f" ({name} {i})" for i in range(60)]
               for name in ("art", "work", "zippy")}
    monkeypatch.setattr(fortunes, "SHA256", write_fortunes(tmp_path / "fortunes", content))
    (tmp_path / "system").mkdir()
    monkeypatch.setattr(fortunes, "SYSTEM_DIRS", [tmp_path / "system"])
    return tmp_path


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A tiny BERT in the Hugging Face file format with sentence-transformers' pooling files
    (tests/tiny_bert.py), written once per session; tests copy it before changing it."""
    from tiny_bert import write_tiny_bert

    return write_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_roberta_dir(tmp_path_factory) -> Path:
    """A tiny RoBERTa in the Hugging Face file format with a byte-level BPE tokenizer
    (tests/tiny_roberta.py), written once per session; tests copy it before changing it."""
    from tiny_roberta import write_tiny_roberta

    return write_tiny_roberta(tmp_path_factory.mktemp("tiny-roberta"))


@pytest.fixture
def minilm_dir() -> Path:
    """The verified directory of the real all-MiniLM-L6-v2 package; skips, saying how to install it, without it."""
    from dpbench.problems import encoders

    entry = encoders.MINILM
    try:
        return encoders.locate(entry.name)
    except encoders.EncoderError as e:
        if importlib.util.find_spec(entry.module) is None:
            pytest.skip(f"needs the package {entry.package}: {entry.install} (or scripts/setup.sh)")
        raise e


def assert_moves_exactly_the_trained(model, before: dict, label: str, key_bias: str, private: bool) -> None:
    """After steps from ``before`` ({name: tensor}): every trainable parameter of ``model``
    changed and every frozen one is bit for bit the same. The attention key projection's bias
    (names ending ``key_bias``) adds one constant to every score of a query, which the softmax
    ignores: without noise its gradient is zero in exact arithmetic, so a non-private step may
    leave it or move it by round-off, and it is not asserted either way."""
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    moot = set() if private else {n for n in trained if n.endswith(key_bias)}
    for n, p in model.named_parameters():
        if n in moot:
            continue
        if n in trained:
            assert not torch.equal(p, before[n]), f"{label}: trainable {n} did not change"
        else:
            assert torch.equal(p, before[n]), f"{label}: frozen {n} changed"


def copy_of(directory, tmp_path):
    """A copy of an encoder directory (to damage) under ``tmp_path``."""
    return shutil.copytree(directory, tmp_path / "encoder")


def one_line(e) -> str:
    """The text of a raised error (``pytest.raises``'s ``ExceptionInfo``), asserted to be one line."""
    text = str(e.value)
    assert "\n" not in text, text
    return text
