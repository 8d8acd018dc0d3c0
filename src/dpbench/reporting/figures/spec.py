"""A figure's spec (``FigureSpec``): what the registry ``FIGURES`` holds of each figure, a
built-in's or a plugin's (an entry point of the group ``dpbench.figures`` names one), and the
checks a plugin's spec must pass (``check``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import pandas as pd
from matplotlib.figure import Figure

from dpbench.plugins import Group

KINDS = ("figure", "table")
TABLES = ("runs", "audits")  # results/aggregate/runs.parquet, results/audit/audits.parquet


@dataclass(frozen=True)
class FigureSpec:
    """One figure. ``build(table, **options)`` draws it from the aggregated ``table``: ``runs``
    (the runs table, by default) or ``audits`` (the audits table, as the built-in ``audit``),
    and returns a matplotlib ``Figure`` (``kind`` "figure": written as ``<id>.png`` and ``.pdf``)
    or a Markdown string ("table": ``<id>.md``). Its keyword parameters are the figure's options (config key ``figures.<id>``, ``dpbench plot
    -o KEY=VALUE``); ``defaults`` fill in those a config does not give, and are what the config
    check reads (a figure of one problem names it there, ``{"problem": "P4"}``, so that a grid
    without it is refused). ``needs_validation``: the figure selects on the validation split
    whatever its options (refused where the runs have none, as ``select_by: val`` is). ``id``
    names the figure's files and its workflow rule (``plot_<id>``); a plugin's is its entry
    point's name."""

    id: str
    build: Callable[..., Figure | str]
    title: str  # one line: what the figure shows
    defaults: dict = field(default_factory=dict)
    kind: str = "figure"
    needs_validation: bool = False
    table: str = "runs"  # the table it is drawn from: one of TABLES


def option_names(build: Callable[[pd.DataFrame], Figure | str]) -> list[str]:
    """The options a figure's build takes: its parameters after the table."""
    return list(inspect.signature(build).parameters)[1:]


def check(spec: FigureSpec) -> None:
    """A well-formed figure spec, or a ValueError saying what is not: a build taking the table
    first and its options by name (no ``**kwargs``: options are checked against its parameters
    before anything is drawn), a title, defaults that are options of build, a kind of ``KINDS``."""
    if not callable(spec.build):
        raise ValueError(f"build is a {type(spec.build).__name__}, not a function of a table")
    try:
        params = list(inspect.signature(spec.build).parameters.values())
    except (TypeError, ValueError):
        raise ValueError("build has no signature to read its options from") from None
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise ValueError("build must take the table as its first argument")
    if any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params):
        raise ValueError("build takes *args or **kwargs; name each of its options")
    if not isinstance(spec.title, str) or not spec.title.strip():
        raise ValueError(f"title is {spec.title!r}, not a text")
    if not isinstance(spec.defaults, dict) or not all(isinstance(k, str) for k in spec.defaults):
        raise ValueError("defaults is not a dict of option names to values")
    names = option_names(spec.build)
    unknown = [k for k in spec.defaults if k not in names]
    if unknown:
        raise ValueError(f"defaults name {unknown[0]!r}, not an option of build ({', '.join(names)})")
    if spec.kind not in KINDS:
        raise ValueError(f"kind is {spec.kind!r}, not one of {', '.join(KINDS)}")
    if not isinstance(spec.needs_validation, bool):
        raise ValueError(f"needs_validation is {spec.needs_validation!r}, not True or False")
    if spec.table not in TABLES:
        raise ValueError(f"table is {spec.table!r}, not one of {', '.join(TABLES)}")


GROUP = Group("dpbench.figures", "figure", FigureSpec, "id", check)
