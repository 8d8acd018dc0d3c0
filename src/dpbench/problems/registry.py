"""The problem registry: problem id -> its spec (``dpbench.problems.spec.Problem``).

The built-in problems are listed in ``BUILT_IN``; a plugin's problem joins at run time through
``register(spec)``, which also adds its facts to the torch-free catalog
(``dpbench.problems.catalog``), so the grid, the cluster cost model and the matrix cache see
it as they see a built-in.
"""

from __future__ import annotations

# module imports, not `from dpbench.problems import ...`: the package's __init__ loads this module
import dpbench.problems.catalog as catalog
import dpbench.problems.images as images
import dpbench.problems.language as language
from dpbench.problems.spec import Problem
from dpbench.problems.tasks import Task

PROBLEMS: dict[str, Problem] = {}


def register(spec: Problem) -> Problem:
    """Adds a problem spec to the registry and its facts (and its task's) to the catalog;
    returns it. A spec that is not a well-formed ``Problem``, or whose id is taken, is an error
    (TypeError or ValueError) saying what is wrong, and nothing is registered."""
    if not isinstance(spec, Problem):
        raise TypeError(f"a problem spec must be a dpbench.problems.Problem, got {type(spec).__name__}")
    if not isinstance(spec.facts, catalog.ProblemFacts):
        raise TypeError(f"a problem spec's facts must be a dpbench.problems.catalog.ProblemFacts, got "
                        f"{type(spec.facts).__name__}")
    if not isinstance(spec.task, Task):
        raise TypeError(f"problem {spec.facts.id!r}: its task must be a dpbench.problems.tasks.Task, got "
                        f"{type(spec.task).__name__}")
    for name in ("build", "load"):
        if not callable(getattr(spec, name)):
            raise TypeError(f"problem {spec.facts.id!r}: {name} must be callable")
    if spec.id in PROBLEMS:
        raise ValueError(f"problem id {spec.id!r} is already registered (dataset {PROBLEMS[spec.id].dataset!r})")
    catalog.add(spec.facts, spec.task.facts)
    PROBLEMS[spec.id] = spec
    return spec


def get_problem(problem_id: str) -> Problem:
    try:
        return PROBLEMS[problem_id]
    except KeyError:
        raise KeyError(f"unknown problem {problem_id!r}; choose one of {sorted(PROBLEMS)}") from None


BUILT_IN = (images.P1, images.P2, images.P3, language.P4)
for _spec in BUILT_IN:
    register(_spec)
