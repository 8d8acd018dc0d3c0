"""An optimizer's hyperparameters against its defaults, without torch: the one check that both
the registry's spec (``OptimizerSpec.hyperparameters``) and the workflow's catalog
(``dpbench.pipeline.catalog``) apply, so a config and a run refuse the same values."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping


def merged(optimizer: str, defaults: Mapping[str, Any], given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The defaults overridden by ``given``; an unknown name, or a value of another kind than
    its default (a number for a number, true/false for a flag), is an error that names it.
    Hyperparameters whose default is a word or None (``bands: auto``, ``tau``) are checked
    by their optimizer."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        allowed = ", ".join(sorted(defaults)) or "none"
        raise ValueError(f"optimizer {optimizer!r} has no hyperparameter {unknown[0]!r} (it takes: {allowed})")
    for name, value in given.items():
        default = defaults[name]
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ValueError(f"hyperparameter {name!r} of {optimizer!r} takes true or false "
                             f"(default {str(default).lower()}), got {value!r}")
        if isinstance(default, (int, float)) and not isinstance(default, bool) and (
                isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)):
            raise ValueError(f"hyperparameter {name!r} of {optimizer!r} takes a finite number "
                             f"(default {default}), got {value!r}")
    return {**defaults, **given}
