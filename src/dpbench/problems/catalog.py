"""The facts of every benchmark problem, without torch: what the grid, the cluster cost model,
the matrix cache and the reports need to know about a problem without building its model or
reading its data.

* ``TaskFacts`` (``TASKS``): per task (classification, VAE, language model) the metric it
  reports and selects on, whether validation selection takes the highest or the lowest value,
  and whether a run plants canaries. The task objects of ``dpbench.problems.tasks`` carry them.
* ``ProblemFacts`` (``FACTS``): per problem its dataset and task, the sizes of its official
  training and test splits, its model's parameter count d (a dense matrix mechanism's noise
  rows are d wide), the canary records its runs plant, and the constants of the cluster cost
  model (``dpbench.pipeline.cluster``).
* ``training_examples``: N, the number of examples a run trains on, the one function both the
  training run and the grid use (the grid keys a matrix mechanism's factorization by N, so the
  two must agree: tested for every problem, canaries included).
* ``pretrained``: the public pretraining recipe a problem starts from (P5, P6: ``PRETRAINED``,
  the transformer pretrained on WordNet's glosses), or None where it trains from scratch; the
  workflow makes such a problem's runs depend on the pretraining, and only such a problem takes
  a fine-tuning mode (``dpbench.problems.modes``, whose ``trainable_parameters`` is d under a
  mode: ``ProblemFacts.trainable``).
* ``SENTIMENT``: P8's and P9's classes (movie-review polarity).
* ``FORTUNE_FILES``: P6's classes, the files of Debian's fortunes package (version
  ``FORTUNES_VERSION``): public facts of the package, not counted from the private records.
* ``CANARY_REPEATS``, ``CANARIES_PER_REPEAT``, ``PLANTED``: the canaries a language-model run
  plants (``dpbench.problems.language``) and the runs table's columns per repetition count.

A plugin's problem brings its own ``ProblemFacts`` in its spec; ``dpbench.problems.facts(id)``
reads a built-in's here (no torch) and a plugin's through the registry, so everything that reads
facts reads the plugin's too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dpbench.problems.architectures import FAMILIES, Architecture

# Canaries (Carlini et al. 2019, arXiv:1802.08232): CANARIES_PER_REPEAT canaries for each
# repetition count k (25 as in Gong, Pavliv & Peng; k = 0: never inserted, the reference), so a
# run adds PLANTED canary records to its training split.
CANARY_REPEATS = (0, 1, 5, 25)
CANARIES_PER_REPEAT = 3
PLANTED = CANARIES_PER_REPEAT * sum(CANARY_REPEATS)  # 93

# The public pretraining recipe P5 and P6 start from: a TransformerLM trained without privacy on
# WordNet's glosses and examples (the fortunes records removed from them first).
PRETRAINED = "wordnet-lm"
# The public encoder P7 starts from: all-MiniLM-L6-v2's files from PyPI (dpbench.problems.encoders.MINILM)
ENCODER = "all-MiniLM-L6-v2"

# P6's classes: the plain-text files of Debian's fortunes package 1:1.99.1-7.3 (the keys of
# dpbench.data.fortunes.SHA256 for that PACKAGE_VERSION; tests/problems/test_problems_finetune.py checks
# both), in sorted order: class c is the c-th name.
FORTUNES_VERSION = "1:1.99.1-7.3"
FORTUNE_FILES = (
    "art", "ascii-art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs", "education",
    "ethnic", "food", "goedel", "humorists", "kids", "knghtbrd", "law", "linux", "linuxcookie", "love", "magic",
    "medicine", "men-women", "miscellaneous", "news", "paradoxum", "people", "perl", "pets", "platitudes",
    "politics", "pratchett", "science", "songs-poems", "sports", "startrek", "tao", "translate-me", "wisdom",
    "work", "zippy",
)

# P8's and P9's classes: the movie-review sets' labels 0 and 1 (dpbench.data.labelled_text's label_names)
SENTIMENT = ("negative", "positive")

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # ids name directories of runs and parts of cell ids


@dataclass(frozen=True)
class TaskFacts:
    """What a task reports: ``metric`` ("accuracy" or "loss") is the problem's reported metric and
    what validation selects an epoch or a configuration on; ``select_higher``: the highest value
    is best (else the lowest); ``plants_canaries``: a run inserts canaries into its training
    split and measures their exposure."""

    name: str
    metric: str
    select_higher: bool
    plants_canaries: bool
    summary: str

    def __post_init__(self):
        if self.metric not in ("accuracy", "loss"):
            raise ValueError(f"task {self.name!r}: metric must be 'accuracy' or 'loss', got {self.metric!r}")

    @property
    def measures_accuracy(self) -> bool:
        """Whether evaluation counts correct predictions (else the accuracy columns are NaN)."""
        return self.metric == "accuracy"


CLASSIFICATION = TaskFacts("classification", "accuracy", True, False,
                           "per-sample cross-entropy; accuracy reported and selected on")
VAE = TaskFacts("vae", "loss", False, False,
                "per-sample reconstruction BCE + KL; the loss reported and selected on (lowest)")
LANGUAGE_MODEL = TaskFacts("language-model", "loss", False, True,
                           "per-record mean next-token cross-entropy; planted canaries' exposure measured")
TASKS: dict[str, TaskFacts] = {t.name: t for t in (CLASSIFICATION, VAE, LANGUAGE_MODEL)}


def task_facts(name: str) -> TaskFacts:
    try:
        return TASKS[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; choose one of {sorted(TASKS)}") from None


def training_examples(available: int, train_subset: int | None = None, validation_size: int = 0,
                      planted: int = 0) -> int:
    """N, the examples a run trains on: of the ``available`` training records, a
    ``train_subset`` of them (if given), less the ``validation_size`` held out before batches
    are cut, plus the ``planted`` canary records (training records too: the sample rate
    q = L / N counts them)."""
    drawn = available if train_subset is None else min(available, train_subset)
    return drawn - validation_size + planted


@dataclass(frozen=True)
class ProblemFacts:
    """One problem's facts (see the module docstring). The three cost constants feed
    ``dpbench.pipeline.cluster``: ``features`` values per example in its memory model (the
    files as uint8 plus the used examples as float32), ``gpu_s_per_example`` and
    ``cpu_s_per_example`` the seconds one example adds to a DP step (forward and per-sample
    backward) where nothing was measured on a GPU, and on the CPU."""

    id: str
    dataset: str
    task: str  # a TASKS name; recorded as the run's problem.task
    train_size: int  # records of the official training split (canaries not included)
    test_size: int
    parameters: int  # d, the model's parameter count (checked by the tests); from a checkpoint: mode full's
    features: float
    gpu_s_per_example: float
    cpu_s_per_example: float
    pretrained: str | None = None  # the public start: a pretraining recipe, or a catalogued encoder (None: from scratch)
    classes: tuple[str, ...] | None = None  # a classifier's class names, where they are public facts
    family: str = "transformer-lm"  # the public start's model family (dpbench.problems.architectures.FAMILIES)

    def __post_init__(self):
        if not isinstance(self.id, str) or not _ID.fullmatch(self.id):
            raise ValueError(f"problem id {self.id!r}: letters, digits and _ . + - only, starting with a "
                             "letter or digit (it names run directories and is part of cell ids)")
        for name in ("train_size", "test_size", "parameters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"problem {self.id!r}: {name} must be a positive integer, got {value!r}")
        for name in ("features", "gpu_s_per_example", "cpu_s_per_example"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"problem {self.id!r}: {name} must be a positive number, got {value!r}")
        if self.pretrained is not None and not (isinstance(self.pretrained, str) and _ID.fullmatch(self.pretrained)):
            raise ValueError(f"problem {self.id!r}: pretrained must name a pretraining recipe, got {self.pretrained!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"problem {self.id!r}: family {self.family!r} is not one of {', '.join(FAMILIES)}")

    @property
    def metric(self) -> str:
        return task_facts(self.task).metric

    @property
    def planted(self) -> int:
        """Canary records a run adds to its training split (0 unless the task plants canaries)."""
        return PLANTED if task_facts(self.task).plants_canaries else 0

    def architecture(self, model_dims: dict | None) -> Architecture:
        """The parameter table of this problem's model from a public start of ``model_dims``
        (its family's; a classifier's head has one output per class). An encoder problem's
        default start is its catalogued encoder (``dpbench.problems.encoders.CATALOG``)."""
        if model_dims is None and self.family == "bert-encoder":
            from dpbench.problems.encoders import CATALOG

            model_dims = dict(CATALOG[self.pretrained].dims)
        return FAMILIES[self.family](model_dims, None if self.classes is None else len(self.classes))

    def trainable(self, model_dims: dict | None, mode) -> int:
        """d of a run that fine-tunes this problem's model from a start of ``model_dims`` under
        ``mode`` (a ``dpbench.problems.modes.Mode``; None: the whole model). A mode for a problem that starts from no checkpoint is
        refused."""
        if mode is not None and self.pretrained is None:
            raise ValueError(f"finetune mode {mode.name!r}: problem {self.id} trains from scratch (no pretrained "
                             "checkpoint); fine-tuning modes apply to problems that start from one")
        arch = self.architecture(model_dims)
        return arch.total if mode is None else mode.trainable_parameters(arch)

    def n_train(self, train_subset: int | None = None, validation_size: int = 0) -> int:
        """N of a run on the official data under a config's ``train_subset`` and ``validation_size``."""
        return training_examples(self.train_size, train_subset, validation_size, self.planted)


# P1-P3: the thesis's (Table 4.1). P4: the fortunes corpus's hash split (12,979 training records,
# 1,417 held out; dpbench.data.fortunes), 129 int64 tokens a record. GPU seconds per example: an
# assumed 2-4x what a DP step of these models was expected to take (P2, L = 256: 17.7 ms). CPU:
# the 2-thread P2 DP-SGD step of an earlier benchmarks/bench_step.py (74.7 ms at L = 256,
# docs/speed.md: 0.29 ms per example), P1 and P3 scaled by their FLOPs; P4 a 2-thread DP step
# of the default transformer on 128-token records, measured with OMP_NUM_THREADS=2 (about 2.4 s
# of CPU time for 64 records, rounded up). P5 is P4 from the public checkpoint (the same data,
# canaries and model); P6 classifies P4's records (the same hash split) by their file, with the
# LM head replaced by one of 40 classes (876,034 - 33,282 + 128*40 + 40 = 847,912), and P4's costs.
# P8 and P9: movie-review sentiment (dpbench.data.labelled_text's Rotten Tomatoes and IMDB: their
# training and test splits after de-duplication; the hash validation split is not counted) from
# P7's encoder with a head of 2 classes (22,580,776 - 15,400 + 384*2 + 2 = 22,566,146), cut to 64
# and 256 tokens (encoder_classification.RECORDS); their costs P7's scaled by the token limit
# (assumed, not measured).
FACTS: dict[str, ProblemFacts] = {f.id: f for f in (
    ProblemFacts("P1", "cifar10", "classification", 50_000, 10_000, 258_762, 3 * 32 * 32, 40e-6, 0.45e-3),
    ProblemFacts("P2", "fashion-mnist", "classification", 60_000, 10_000, 225_034, 28 * 28, 30e-6, 0.29e-3),
    ProblemFacts("P3", "fashion-mnist", "vae", 60_000, 10_000, 1_875_265, 28 * 28, 120e-6, 1.2e-3),
    ProblemFacts("P4", "fortunes", "language-model", 12_979, 1_417, 876_034, 129 * 8 // 5, 400e-6, 40e-3),
    ProblemFacts("P5", "fortunes", "language-model", 12_979, 1_417, 876_034, 129 * 8 // 5, 400e-6, 40e-3,
                 pretrained=PRETRAINED),
    ProblemFacts("P6", "fortunes", "classification", 12_979, 1_417, 847_912, 129 * 8 // 5, 400e-6, 40e-3,
                 pretrained=PRETRAINED, classes=FORTUNE_FILES),
    ProblemFacts("P7", "fortunes", "classification", 12_979, 1_417, 22_580_776, 128 * 8 // 5, 2e-3, 0.2,
                 pretrained=ENCODER, classes=FORTUNE_FILES, family="bert-encoder"),
    ProblemFacts("P8", "rotten-tomatoes", "classification", 5_930, 1_736, 22_566_146, 64 * 8 // 5, 1e-3, 0.1,
                 pretrained=ENCODER, classes=SENTIMENT, family="bert-encoder"),
    ProblemFacts("P9", "imdb", "classification", 17_423, 5_017, 22_566_146, 256 * 8 // 5, 4e-3, 0.4,
                 pretrained=ENCODER, classes=SENTIMENT, family="bert-encoder"),
)}
