"""What the harness needs to know about an optimizer besides its step."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from dpbench.mechanisms.base import AuditSpec, Mechanism
from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian
from dpbench.optimizers.base import Context, DPStep


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer, as the registry holds it and a ``dpbench.optimizers`` entry point names it
    (its ``name`` is the entry point's). ``build(ctx)`` makes its step from a ``Context``: a
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
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            allowed = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(f"optimizer {self.name!r} has no hyperparameter {unknown[0]!r} (it takes: {allowed})")
        for name, value in given.items():
            default = self.defaults[name]
            if isinstance(default, bool) and not isinstance(value, bool):
                raise ValueError(f"hyperparameter {name!r} of {self.name!r} takes true or false "
                                 f"(default {str(default).lower()}), got {value!r}")
            if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                    isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)):
                raise ValueError(f"hyperparameter {name!r} of {self.name!r} takes a finite number "
                                 f"(default {default}), got {value!r}")
        return {**self.defaults, **given}
