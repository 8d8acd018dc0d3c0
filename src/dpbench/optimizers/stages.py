"""Which stages of the private step are an optimizer's own code, read from its step's class.

A DP step is ``DPStep``'s fixed sequence of stages (``STAGES``); an optimizer's step class may
override some of them (DiSK ``per_sample_gradients``, Dice ``clip_and_sum`` and ``noise_std``,
D2P2 ``add_noise``, Opacus the whole ``__call__``). A stage is the optimizer's own where the
class that defines it, first in the step class's method resolution order, is not ``DPStep``;
it is ``built-in`` where that class is one of dpbench's modules, ``plugin`` where it is not. The
methods are compared, not trusted: nothing a spec says about itself enters. A run records the
result (``privacy.stages``), ``dpbench list`` shows it, and the audit's sensitivity check
(``dpbench.audit.sensitivity``) tests the clipped sum whatever class computes it.
"""

from __future__ import annotations

import torch
from torch import nn

from dpbench.optimizers import base
from dpbench.optimizers.base import DPStep
from dpbench.privacy.clipping import Clipping

# the stages of DPStep.__call__, in order, and the noise scale it adds (a property)
STAGES = ("__call__", "per_sample_gradients", "clip_and_sum", "add_noise", "scale_to_mean", "noise_std")


def origin_of(cls: type) -> str:
    """"built-in" for a class of one of dpbench's modules, else "plugin"."""
    module = cls.__module__
    return "built-in" if module == "dpbench" or module.startswith("dpbench.") else "plugin"


def own_stages(step_class: type) -> dict[str, str]:
    """stage -> "built-in" or "plugin" for every stage of ``STAGES`` that ``step_class`` defines
    itself (a class between it and ``DPStep`` included); {} for ``DPStep``. A step class that
    is not a ``DPStep`` at all has every stage of its own (under ``__call__``)."""
    if not (isinstance(step_class, type) and issubclass(step_class, DPStep)):
        return {"__call__": origin_of(step_class if isinstance(step_class, type) else type(step_class))}
    own = {}
    for stage in STAGES:
        definer = next((k for k in step_class.__mro__ if stage in k.__dict__), DPStep)
        if definer is not DPStep:
            own[stage] = origin_of(definer)
    return own


def describe(stages: dict[str, str]) -> str:
    """``clip_and_sum (plugin), noise_std (plugin)``; ``none`` where every stage is DPStep's."""
    return ", ".join(f"{stage} ({origin})" for stage, origin in stages.items()) or "none"


def _probe_context(spec) -> base.Context:
    model = nn.Linear(2, 2, bias=False)
    return base.Context(model=model, loss_fn=lambda m, x, y: (m(x).sum(1), None), lr=0.1, expected_batch_size=1,
                        noise_multiplier=1.0, clipping=Clipping(), noise=None, steps=1,
                        hyperparameters=spec.hyperparameters(None))


def step_class(spec) -> type:
    """The class of the step ``spec.build`` makes, found without building one: the build is
    called on a small context while ``DPStep.__new__`` raises with the class it was asked to
    make, before any ``__init__`` runs (no model is taped, no noise file opened, no Opacus
    imported). A build that makes something other than a ``DPStep`` gives that object's class;
    a build that fails before it makes its step raises a ValueError saying why."""
    base._PROBING[0] = True
    try:
        with torch.random.fork_rng(devices=[]):  # the probe's model draws nothing from the caller's stream
            made = spec.build(_probe_context(spec))
    except base.StepClassFound as found:
        return found.cls
    except Exception as exc:
        raise ValueError(f"optimizer {spec.name!r}: its build failed before it made its step "
                         f"({type(exc).__name__}: {exc})") from None
    finally:
        base._PROBING[0] = False
    return type(made)


def spec_stages(spec) -> dict[str, str] | None:
    """``own_stages`` of a private spec's step class; None for a non-private one."""
    return own_stages(step_class(spec)) if spec.private else None

