"""Everything a plugin needs from dpbench, in one import: ``from dpbench.plugin import ...``.

A plugin (docs/plugins.md) is a package that declares entry points in the groups
``dpbench.optimizers``, ``dpbench.problems`` and ``dpbench.figures``; this module is its whole
interface to dpbench, as ``pytest`` is a plugin's to pytest. Every name below is dpbench's own
object, re-exported (``dpbench.plugin.DPStep is dpbench.optimizers.base.DPStep``), and each
carries its contract in its docstring. A name is imported where it is first used, so a figure
plugin that imports ``FigureSpec`` stays free of torch, as the figure environments are.

An optimizer:
  ``OptimizerSpec`` (what an entry point of ``dpbench.optimizers`` names), ``Context`` (what its
  ``build`` is given), ``DPStep`` (the private step and its stages), ``NonPrivateStep``, ``SGD``
  and ``UpdateRule`` (the update rule: what it is handed, what it may keep, what it returns),
  ``StepOutput``; for a stage of its own, ``PerSampleGradients``, ``GroupedGradients``, ``LayerGrads``,
  ``register_per_sample`` and ``UnsupportedLayerError`` (per-sample gradients), ``Clipping``.
Its mechanism:
  ``Mechanism`` (the protocol a mechanism of its own implements), ``Target`` (what its
  ``calibrate`` is given), ``PrivacyClaim`` (what its ``report`` and ``privacy_profile`` are
  given), ``Spent`` (what its ``report`` returns), ``get_accountant`` (dpbench's accountant of a
  name), ``Plan``, ``PlanRequest``, ``Sampler``, ``NoiseSource``, ``AuditSpec``; the default,
  ``PoissonSubsampledGaussian``, and its noise, ``GaussianNoise``.
A problem:
  ``Problem`` (what an entry point of ``dpbench.problems`` names), ``ProblemFacts``, the tasks
  ``Classification`` (images), ``TabularClassification`` (feature vectors) and ``VAE``, ``Dataset`` and ``DataError`` (its loader's result and
  failure), ``check_problem`` (what it must pass).
A figure:
  ``FigureSpec`` (what an entry point of ``dpbench.figures`` names), ``check_figure``,
  ``select_runs`` and ``ordered`` (runs and optimizers, in the thesis's order).
Testing it:
  ``assemble`` (the step and sampler as a training cell builds them), ``get_optimizer``,
  ``get_problem`` (the registries' specs, plugins included).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it (and, where it differs, the name there)
_SOURCES: dict[str, tuple[str, str]] = {
    "OptimizerSpec": ("dpbench.optimizers.spec", "OptimizerSpec"),
    "Context": ("dpbench.optimizers.base", "Context"),
    "DPStep": ("dpbench.optimizers.base", "DPStep"),
    "NonPrivateStep": ("dpbench.optimizers.base", "NonPrivateStep"),
    "SGD": ("dpbench.optimizers.base", "SGD"),
    "StepOutput": ("dpbench.optimizers.base", "StepOutput"),
    "UpdateRule": ("dpbench.optimizers.base", "UpdateRule"),
    "PerSampleGradients": ("dpbench.privacy.per_sample", "PerSampleGradients"),
    "GroupedGradients": ("dpbench.privacy.per_sample", "GroupedGradients"),
    "LayerGrads": ("dpbench.privacy.per_sample_layers", "LayerGrads"),
    "register_per_sample": ("dpbench.privacy.per_sample_layers", "register_per_sample"),
    "UnsupportedLayerError": ("dpbench.privacy.per_sample_layers", "UnsupportedLayerError"),
    "Clipping": ("dpbench.privacy.clipping", "Clipping"),
    "Mechanism": ("dpbench.mechanisms.base", "Mechanism"),
    "Target": ("dpbench.mechanisms.base", "Target"),
    "PrivacyClaim": ("dpbench.mechanisms.base", "PrivacyClaim"),
    "Spent": ("dpbench.mechanisms.base", "Spent"),
    "get_accountant": ("dpbench.privacy.accounting", "get_accountant"),
    "Plan": ("dpbench.mechanisms.base", "Plan"),
    "PlanRequest": ("dpbench.mechanisms.base", "PlanRequest"),
    "Sampler": ("dpbench.mechanisms.base", "Sampler"),
    "NoiseSource": ("dpbench.mechanisms.base", "NoiseSource"),
    "AuditSpec": ("dpbench.mechanisms.base", "AuditSpec"),
    "PoissonSubsampledGaussian": ("dpbench.mechanisms.poisson_gaussian", "PoissonSubsampledGaussian"),
    "GaussianNoise": ("dpbench.mechanisms.noise", "GaussianNoise"),
    "Problem": ("dpbench.problems.spec", "Problem"),
    "ProblemFacts": ("dpbench.problems.catalog", "ProblemFacts"),
    "Classification": ("dpbench.problems.tasks", "Classification"),
    "TabularClassification": ("dpbench.problems.tasks", "TabularClassification"),
    "VAE": ("dpbench.problems.tasks", "VAE"),
    "Dataset": ("dpbench.data.dataset", "Dataset"),
    "DataError": ("dpbench.data.dataset", "DataError"),
    "check_problem": ("dpbench.problems.registry", "check"),
    "FigureSpec": ("dpbench.reporting.figures.spec", "FigureSpec"),
    "check_figure": ("dpbench.reporting.figures.spec", "check"),
    "select_runs": ("dpbench.reporting.figures.selection", "select_runs"),
    "ordered": ("dpbench.reporting.figures.style", "ordered"),
    "assemble": ("dpbench.training.harness", "assemble"),
    "get_optimizer": ("dpbench.optimizers", "get_optimizer"),
    "get_problem": ("dpbench.problems", "get_problem"),
}

__all__ = list(_SOURCES)

if TYPE_CHECKING:  # for type checkers, and for dpbench.pipeline.fingerprint, which reads imports statically
    from dpbench.data.dataset import DataError, Dataset  # noqa: F401
    from dpbench.mechanisms.base import AuditSpec, Mechanism, NoiseSource, Plan, PlanRequest, Sampler  # noqa: F401
    from dpbench.mechanisms.base import PrivacyClaim, Spent, Target  # noqa: F401
    from dpbench.mechanisms.noise import GaussianNoise  # noqa: F401
    from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian  # noqa: F401
    from dpbench.optimizers import get_optimizer  # noqa: F401
    from dpbench.optimizers.base import SGD, Context, DPStep, NonPrivateStep, StepOutput, UpdateRule  # noqa: F401
    from dpbench.optimizers.spec import OptimizerSpec  # noqa: F401
    from dpbench.privacy.accounting import get_accountant  # noqa: F401
    from dpbench.privacy.clipping import Clipping  # noqa: F401
    from dpbench.privacy.per_sample import GroupedGradients, PerSampleGradients  # noqa: F401
    from dpbench.privacy.per_sample_layers import LayerGrads, UnsupportedLayerError, register_per_sample  # noqa: F401
    from dpbench.problems import get_problem  # noqa: F401
    from dpbench.problems.catalog import ProblemFacts  # noqa: F401
    from dpbench.problems.registry import check as check_problem  # noqa: F401
    from dpbench.problems.spec import Problem  # noqa: F401
    from dpbench.problems.tasks import VAE, Classification, TabularClassification  # noqa: F401
    from dpbench.reporting.figures.selection import select_runs  # noqa: F401
    from dpbench.reporting.figures.spec import FigureSpec  # noqa: F401
    from dpbench.reporting.figures.spec import check as check_figure  # noqa: F401
    from dpbench.reporting.figures.style import ordered  # noqa: F401
    from dpbench.training.harness import assemble  # noqa: F401


def __getattr__(name: str):
    """A name of ``__all__``, imported from its module at first use."""
    try:
        module, attribute = _SOURCES[name]
    except KeyError:
        raise AttributeError(f"module 'dpbench.plugin' has no attribute {name!r} (it exports: "
                             f"{', '.join(__all__)})") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
