"""What the harness needs to know about an optimizer besides its step."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from dpbench import hyperparameters
from dpbench.mechanisms.base import AuditSpec, Mechanism
from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian

if TYPE_CHECKING:  # annotations only: a spec is declared without torch (the workflow reads it)
    from dpbench.optimizers.base import Context, DPStep


class Imported:
    """A step's builder named by its import string ``"module:function"``, as an entry point names
    its object, imported on its first call: the built-ins' declarations (dpbench.optimizers)
    import no torch. Like the function it names, it carries its ``__module__`` (the module that
    builds the step: the optimizer's code fingerprint)."""

    def __init__(self, target: str):
        module, _, name = target.partition(":")
        if not module or not name:
            raise ValueError(f"{target!r} is not an import string 'module:function'")
        self.target, self.__module__, self.__name__ = target, module, name

    def __call__(self, ctx: Context) -> DPStep:
        return getattr(importlib.import_module(self.__module__), self.__name__)(ctx)

    def __repr__(self) -> str:
        return f"Imported({self.target!r})"


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, as the registry holds it and a ``dpbench.optimizers`` entry point names it
    (its ``name`` is the entry point's). ``build(ctx)`` makes its step from a ``Context`` (a
    built-in's is ``Imported``: its declaration stays torch-free): a
    ``DPStep`` (or subclass) with its update rule where ``private``, else a ``NonPrivateStep``;
    it is called once per run (and by the audit per chunk of trials), so it must not share state
    between calls. ``defaults`` are its hyperparameters (configs and ``--hp`` override them, of
    the same kind). ``mechanism`` (default DP-SGD's ``PoissonSubsampledGaussian``) draws the
    batches, makes the noise and computes sigma and epsilon: a plugin's own class makes the claim
    the plugin's (``mechanism_origin: plugin``). ``caveat`` is recorded in every run; ``audit``
    overrides the mechanism's ``AuditSpec``; ``cost_class`` is for built-ins (a plugin leaves it
    None). The stages its step defines itself are read from the step's class, never declared
    here (``dpbench.optimizers.stages``)."""

    name: str  # the identifier used in configs and results
    build: Callable[[Context], DPStep]
    private: bool
    description: str
    reference: str  # the paper / algorithm it implements
    defaults: dict[str, Any] = field(default_factory=dict)  # optimizer-specific hyperparameters
    # how batches are drawn, where noise comes from, how sigma and epsilon are computed
    mechanism: Mechanism = field(default_factory=PoissonSubsampledGaussian)
    caveat: str | None = None  # a limit of the privacy guarantee, recorded in every run
    audit: AuditSpec | None = None  # how dpbench.audit attacks it (None: its mechanism's AuditSpec)
    # The measured step whose GPU time stands for this one's in the cluster cost model
    # (dpbench.pipeline.cluster: a class of gpu_costs.json, measured by benchmarks/bench_gpu.py
    # costs: "sgd", "dpsgd", "dpadambc", "dpdice", "dpdisk", "dpmatrix-se"); None: not measured,
    # the cost model's assumed (conservative) time per step.
    cost_class: str | None = None

    def hyperparameters(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """The defaults overridden by ``given``; an unknown name, or a value of another kind than
        its default (a number for a number, true/false for a flag), is an error that names it.
        Hyperparameters whose default is a word or None (``bands: auto``, ``tau``) are checked
        by their optimizer."""
        return hyperparameters.merged(self.name, self.defaults, given)
