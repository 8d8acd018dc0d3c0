"""``dpbench list``: every optimizer, problem and figure, one line each, with where it comes from,
and every plugin that could not be loaded, with its one-line error."""

from __future__ import annotations

from dpbench.optimizers import OPTIMIZERS
from dpbench.optimizers.stages import describe, own_stages, step_class
from dpbench.plugins import mechanism_origin
from dpbench.problems import PROBLEMS
from dpbench.reporting.figures import FIGURES

OWN_CLAIM = "privacy claim: the plugin's own"
HEADER = ("kind", "id", "private", "origin")


def rows() -> list[tuple[str, str, str, str]]:
    """(kind, id, private, origin) of every optimizer, problem and figure, then (``error``, id, ``-``,
    the line) of every broken plugin. A private plugin optimizer whose mechanism is the plugin's
    own class (its own sigma calibration or accountant) has ``OWN_CLAIM`` after its origin, and
    a private optimizer whose step defines stages of its own names them (``stages_note``)."""
    out = []
    for name, spec in OPTIMIZERS.items():
        origin = OPTIMIZERS.origin(name)
        if spec.private and OPTIMIZERS.plugin(name) and mechanism_origin(spec.mechanism) == "plugin":
            origin += f"; {OWN_CLAIM}"
        if spec.private:
            origin += stages_note(spec)
        out.append(("optimizer", name, "private" if spec.private else "non-private", origin))
    out += [("problem", pid, "-", PROBLEMS.origin(pid)) for pid in PROBLEMS]
    out += [("figure", fid, "-", FIGURES.origin(fid)) for fid in FIGURES]
    out += [("error", e.id, "-", e.line) for e in OPTIMIZERS.errors + PROBLEMS.errors + FIGURES.errors]
    return out


def stages_note(spec) -> str:
    """``; stages: clip_and_sum (plugin)``: the stages of the private step that the optimizer's
    step class defines itself (``dpbench.optimizers.stages``); empty where all are DPStep's."""
    try:
        own = own_stages(step_class(spec))
    except ValueError as exc:
        return f"; stages: unknown ({exc})"
    return f"; stages: {describe(own)}" if own else ""


def render(table: list[tuple[str, ...]]) -> str:
    """The rows under ``HEADER`` in aligned columns (the last one as it is)."""
    table = [HEADER, *table]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]) for row in table) + "\n"


def main() -> int:
    """Prints the list; 1 where a plugin is broken, else 0."""
    table = rows()
    print(render(table), end="")
    return 1 if any(kind == "error" for kind, *_ in table) else 0
