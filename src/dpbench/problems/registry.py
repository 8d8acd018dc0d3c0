"""The problem registry: problem id -> its spec (``dpbench.problems.spec.Problem``).

The built-in problems are listed in ``BUILT_IN``; a plugin's problem is the object an installed
distribution's ``dpbench.problems`` entry point names (``dpbench.plugins``), found on the
registry's first read and checked by ``check`` like a built-in. The grid, the cluster cost model
and the reports read a problem's facts through ``dpbench.problems.facts``, which holds the
built-ins' without torch and asks this registry for a plugin's.
"""

from __future__ import annotations

# module imports, not `from dpbench.problems import ...`: the package's __init__ loads this module
import dpbench.problems.catalog as catalog
import dpbench.problems.encoder_classification as encoder_classification
import dpbench.problems.images as images
import dpbench.problems.language as language
import dpbench.problems.text_classification as text_classification
from dpbench.plugins import Group, Registry
from dpbench.problems.spec import Problem
from dpbench.problems.tasks import Task


def check(spec: Problem) -> None:
    """A well-formed problem spec, or a ValueError saying what is not: facts of the catalog's
    kind, a task object whose facts are one of the catalog's tasks and the ones its facts name
    (the reports look a run's task up by the name it records), a model builder and a loader."""
    if not isinstance(spec.facts, catalog.ProblemFacts):
        raise ValueError(f"its facts must be a dpbench.problems.catalog.ProblemFacts, got {type(spec.facts).__name__}")
    if not isinstance(spec.task, Task):
        raise ValueError(f"its task must be a dpbench.problems.tasks.Task, got {type(spec.task).__name__}")
    if catalog.TASKS.get(spec.task.facts.name) != spec.task.facts:
        raise ValueError(f"its task's facts must be one of the catalog's tasks ({', '.join(sorted(catalog.TASKS))}), "
                         f"got {spec.task.facts.name!r}")
    if spec.task.facts.name != spec.facts.task:
        raise ValueError(f"its facts name task {spec.facts.task!r}, its task is {spec.task.facts.name!r}")
    for name in ("build", "load"):
        if not callable(getattr(spec, name)):
            raise ValueError(f"{name} must be callable")
    if spec.facts.pretrained is not None and spec.facts.family == "transformer-lm" and not callable(spec.build_pretrained):
        raise ValueError(f"its facts start from pretraining recipe {spec.facts.pretrained!r}: build_pretrained "
                         "(model dimensions -> the model to load the checkpoint into) must be callable")


BUILT_IN = (images.P1, images.P2, images.P3, language.P4, language.P5, text_classification.P6,
            encoder_classification.P7, encoder_classification.P8, encoder_classification.P9)
for _spec in BUILT_IN:
    check(_spec)
    assert catalog.FACTS[_spec.id] is _spec.facts, f"{_spec.id}: a built-in's facts are the catalog's row"

GROUP = Group("dpbench.problems", "problem", Problem, "id", check=check)
PROBLEMS: Registry = Registry(GROUP, {spec.id: spec for spec in BUILT_IN})


def dataset_manifest(dataset: str, data_dir: str | None = None) -> dict:
    """The manifest of a dataset that no built-in reader knows (a plugin problem's): loaded,
    and so verified, by the loader of the first registered problem that reads it; an unknown
    dataset is a ValueError naming the known ones."""
    readers = [spec for spec in PROBLEMS.values() if spec.dataset == dataset]
    if not readers:
        known = sorted({spec.dataset for spec in PROBLEMS.values()})
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {known}")
    data = readers[0].load(data_dir)
    return {"dataset": dataset, "problem": readers[0].id, "source": data.source,
            "n_train": int(len(data.y_train)), "n_test": int(len(data.y_test))}


def get_problem(problem_id: str) -> Problem:
    """The spec of a problem id; an unknown id is a KeyError naming the choices, a broken
    plugin's id its one-line error."""
    return PROBLEMS.lookup(problem_id)
