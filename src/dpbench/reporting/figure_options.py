"""A figure's options checked without drawing it (no matplotlib, no pandas): the one check that
``dpbench plot`` (``dpbench.reporting.figures.check_options``) and the config check (through the
torch-free ``dpbench.pipeline.catalog``) apply, from the figure's option names and defaults."""

from __future__ import annotations

import difflib
import math
from typing import Any, Mapping, Sequence


def _name(v: Any) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _epsilon(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _names(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_name(x) for x in v)


# The values each option of the built-in figures takes (a plugin's option of the same name too):
# checked before any drawing, so that a value of the wrong type is one line naming the option,
# never a traceback nor a figure silently drawn without it (k=abc marked claims "not run").
OPTION_TYPES: dict[str, tuple[Any, str]] = {
    "non_private": (lambda v: isinstance(v, bool), "true or false"),
    "k": (_positive_int, "a positive integer"),
    "min_seeds": (_positive_int, "a positive integer"),
    "epsilons": (lambda v: isinstance(v, (list, tuple)) and all(_epsilon(x) for x in v),
                 "finite positive numbers, comma-separated"),
    "optimizers": (_names, "optimizer names, comma-separated"),
    "problems": (_names, "problem ids, comma-separated"),
    "modes": (_names, "fine-tuning mode names, comma-separated"),
    "ys": (_names, "column names, comma-separated"),
    "problem": (_name, "a problem id"),
    "x": (_name, "a column name"),
    "fmt": (_name, "a format, e.g. .2f"),
    "filters": (lambda v: isinstance(v, dict) or v == "thesis",
                "filter.COLUMN=v1,v2 (a mapping of columns to values) or thesis"),
}


def check_options(figure_id: str, params: Sequence[str], options: Mapping[str, Any]) -> None:
    """Refuses an option the figure does not take (``params``: its drawing function's keyword
    parameters; naming it and the closest one it does), a value of the wrong type
    (``OPTION_TYPES``) and a ``select_by`` other than test or val, before any drawing."""
    for key in options:
        if key not in params:
            close = difflib.get_close_matches(key, params, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"options: {', '.join(params)}"
            raise ValueError(f"unknown option {key!r} of figure {figure_id} ({hint})")
    for key, value in options.items():
        ok, what = OPTION_TYPES.get(key, (None, ""))
        if ok is not None and value is not None and not ok(value):
            shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            raise ValueError(f"option {key} of figure {figure_id}: expected {what}, got {shown!r}")
    if options.get("select_by", "test") not in ("test", "val"):
        raise ValueError(f"select_by must be test or val, got {options['select_by']!r}")


def validation_needed(figure_id: str, defaults: Mapping[str, Any], needs_validation: bool,
                      options: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why the figure needs a validation split under ``options``: (the option that asks for it,
    "" for the figure itself; the reason), or None. The config check and ``dpbench plot`` refuse
    it where there is none (the figure would select on NaN: an empty panel, an arbitrary lr)."""
    if {**defaults, **options}.get("select_by") == "val":
        return "select_by", "'val' selects on the validation split"
    if needs_validation:
        return "", f"{figure_id} selects each optimizer's configuration on the validation split"
    return None
