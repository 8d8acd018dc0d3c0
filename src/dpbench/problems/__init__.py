"""The benchmark problems: a dataset, a model, a task (preprocessing, per-sample loss, the metric
reported) and the facts the pipeline needs. P1-P3 are the thesis's (Table 4.1): image datasets
read by ``dpbench.data``, the networks of ``convnets`` (``images``). P4 is a private transformer
language model on the fortunes corpus with planted canaries (``language``, ``transformer``,
``tokenizer``).

* ``catalog``: every problem's facts, importable without torch (the grid, the cluster cost
  model, the matrix cache and the reports read them);
* ``tasks``: the task objects (classification, VAE; the language model's is in ``language``);
* ``spec``: ``Problem``, a problem's spec (facts, task, model builder, loader);
* ``registry``: problem id -> spec (``PROBLEMS``, ``get_problem``, ``register``).

This package imports nothing itself, so ``dpbench.problems.catalog`` needs no torch;
``Problem``, ``PROBLEMS``, ``get_problem`` and ``register`` are loaded from ``spec`` and
``registry`` when first asked for.
"""

from __future__ import annotations

_FROM_REGISTRY = ("PROBLEMS", "get_problem", "register")


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
