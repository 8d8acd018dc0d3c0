"""A figure's options checked without drawing it (no matplotlib, no pandas): the one check that
``dpbench plot`` (``dpbench.reporting.figures.check_options``) and the config check (through the
torch-free ``dpbench.pipeline.catalog``) apply, from the figure's option names and defaults."""

from __future__ import annotations

import difflib
from typing import Any, Mapping, Sequence


def check_options(figure_id: str, params: Sequence[str], options: Mapping[str, Any]) -> None:
    """Refuses an option the figure does not take (``params``: its drawing function's keyword
    parameters; naming it and the closest one it does) and a ``select_by`` other than test or
    val, before any drawing."""
    for key in options:
        if key not in params:
            close = difflib.get_close_matches(key, params, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}?" if close else f"options: {', '.join(params)}"
            raise ValueError(f"unknown option {key!r} of figure {figure_id} ({hint})")
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
