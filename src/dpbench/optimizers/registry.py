"""What the harness needs to know about an optimizer besides its step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from dpbench.mechanisms import AuditSpec, Mechanism, PoissonSubsampledGaussian
from dpbench.optimizers.base import Context, DPStep


@dataclass(frozen=True)
class OptimizerSpec:
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

    def hyperparameters(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """The defaults overridden by ``given``; an unknown name is an error that names it."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            allowed = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(f"optimizer {self.name!r} has no hyperparameter {unknown[0]!r} (it takes: {allowed})")
        return {**self.defaults, **given}
