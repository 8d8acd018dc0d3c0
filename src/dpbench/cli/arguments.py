"""The command line's argument types (argparse names the option in their messages), the options
made from a settings dataclass (``add_settings``, ``settings_of``: ``dpbench train``'s from
``RunConfig``) and the check that an output location can be written (``check_output``)."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from dpbench.files import refuse_special
from dpbench.training import settings


def argument_type(value_type: settings.ValueType):
    """A value type (``dpbench.training.settings``) as an argparse type: its ValueError becomes
    argparse's one line naming the option ("argument --epsilon: expected a finite positive
    number, got 'inf'")."""

    def parse(text: str):
        try:
            return value_type.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = value_type.what
    return parse


# Argument types shared by every command. Each refuses what no run can use, before any work starts.
positive_float = argument_type(settings.positive_float)  # epsilon, learning rate, clipping norm, seconds
nonnegative_float = argument_type(settings.nonnegative_float)  # a noise multiplier
probability = argument_type(settings.probability)  # delta
positive_int = argument_type(settings.positive_int)
nonnegative_int = argument_type(settings.nonnegative_int)  # a seed
audit_seed = argument_type(settings.audit_seed)  # an audit's seed: an int64 in its record
hyperparameter = argument_type(settings.hyperparameter)  # --hp KEY=VALUE


def add_settings(groups: dict[str, Any], cls) -> None:
    """An option for each setting of ``cls`` (``RunConfig``), from its field, in the argument
    group of its scope (``groups``: scope -> group): flag, value type, help, default (shown),
    required where the field has none; a switch flips its default, a repeated setting appends
    (``--hp``). The option's dest is the field's name."""
    for s in settings.settings(cls):
        shown = "" if s.required or s.default in (None, {}) or s.type is settings.switch else " (default: %(default)s)"
        kw = {"dest": s.name, "help": s.help + shown}
        if s.type is settings.switch:
            kw["action"] = "store_false" if s.default else "store_true"
        else:
            kw.update(type=argument_type(s.type), metavar=s.metavar, required=s.required)
            if s.repeated:
                kw["action"] = "append"
            elif not s.required:
                kw["default"] = s.default
            if s.type.choices:
                kw["choices"] = s.type.choices
        groups[s.scope].add_argument(s.flag, **kw)


def settings_of(args, cls):
    """``cls`` (``RunConfig``) from the options ``add_settings`` added, parsed into ``args``."""
    values = {}
    for s in settings.settings(cls):
        value = getattr(args, s.name)
        values[s.name] = dict(value or []) if s.repeated else value
    return cls(**values)


# Free space an output location must have before a run starts: a run file and its
# checkpoint (model, optimizer state, per-step trace) take a few MB for every problem here.
OUTPUT_SPACE = 64 * 2**20


def check_output(path: str | Path, option: str, need: int = OUTPUT_SPACE) -> None:
    """Fails at once, naming the option, where a file cannot be written at ``path``: it is a
    directory, its directory cannot be made or written in, or its file system has less than
    ``need`` bytes free. A probe file is made and removed, so nothing is left behind."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"argument {option}: {path} is a directory; give the file to write")
    refuse_special(path, f"argument {option}:")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"argument {option}: cannot create its directory {path.parent}: "
                         f"{exc.strerror or exc}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"argument {option}: cannot write in {path.parent}: {exc.strerror or exc}") from None
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise ValueError(f"argument {option}: only {free / 2**20:.1f} MiB free on its file system "
                         f"({path.parent}); a run needs {need / 2**20:.0f} MiB for its file and checkpoint")
