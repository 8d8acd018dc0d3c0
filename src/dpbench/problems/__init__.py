"""The benchmark problems: a dataset, a model, a task (preprocessing, per-sample loss, the metric
reported) and the facts the pipeline needs. P1-P3 are the thesis's (Table 4.1): image datasets
read by ``dpbench.data``, the networks of ``convnets`` (``images``). P4 is a private transformer
language model on the fortunes corpus with planted canaries (``language``, ``transformer``,
``tokenizer``). P5 and P6 start from a transformer pretrained on public text: P5 is P4's task
(``language``), P6 a record's fortunes file from its text (``text_classification``), in a
fine-tuning mode (``modes``: the trained parameters, torch-free; ``finetune``: the model).

* ``catalog``: every problem's facts, importable without torch (the grid, the cluster cost
  model, the matrix cache and the reports read them);
* ``tasks``: the task objects (classification, VAE; the language model's is in ``language``);
* ``spec``: ``Problem``, a problem's spec (facts, task, model builder, loader);
* ``registry``: problem id -> spec (``PROBLEMS``, ``get_problem``; plugins' problems join it
  from their entry points).

This package imports only the torch-free catalog itself, so ``facts(id)`` of a built-in needs
no torch; ``Problem``, ``PROBLEMS`` and ``get_problem`` are loaded from ``spec`` and
``registry`` when first asked for.
"""

from __future__ import annotations

import dpbench.problems.catalog as catalog

_FROM_REGISTRY = ("PROBLEMS", "get_problem")


def facts(problem_id: str) -> catalog.ProblemFacts:
    """The facts of a problem: a built-in's from the catalog (no torch), a plugin's from its spec
    (the registry, which loads the installed plugins; an unknown id is a KeyError naming the
    choices, a broken plugin's id its one-line error)."""
    if problem_id in catalog.FACTS:
        return catalog.FACTS[problem_id]
    from dpbench.problems.registry import get_problem

    return get_problem(problem_id).facts


def __getattr__(name: str):
    if name in _FROM_REGISTRY:
        from dpbench.problems import registry

        return getattr(registry, name)
    if name == "Problem":
        from dpbench.problems.spec import Problem

        return Problem
    raise AttributeError(f"module 'dpbench.problems' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_FROM_REGISTRY, "Problem"])
