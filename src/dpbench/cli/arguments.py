"""The command line's argument types (argparse names the option in their messages) and the
check that an output location can be written (``check_output``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

from dpbench.files import refuse_special


def hyperparameter(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--hp expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def tuning_setting(text: str) -> dict:
    """``--tuning``: a JSON object with the search's distribution, mean, shape, repetitions and
    candidate (dpbench.training.tuning), checked here so that a bad one stops before any work."""
    from dpbench.privacy.tuning import Tuning

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from None
    keys = {"distribution", "mean", "shape", "repetitions", "candidate"}
    if not isinstance(value, dict) or not {"distribution", "mean", "repetitions", "candidate"} <= set(value) <= keys:
        raise argparse.ArgumentTypeError(f"expected an object with keys {sorted(keys)} (shape optional), got {text!r}")
    try:
        Tuning(value["distribution"], value["mean"], value.get("shape") or 1.0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    k, j = value["repetitions"], value["candidate"]
    if not (isinstance(k, int) and isinstance(j, int) and 0 <= j < k):
        raise argparse.ArgumentTypeError(f"candidate must be an index below repetitions, got {j!r} of {k!r}")
    return value


# Argument types shared by every command (argparse names the option in its message:
# "argument --epsilon: expected a finite positive number, got 'inf'"). Each refuses what no
# run can use, before any work starts.


def _number(text: str, ok, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def finite_float(text: str) -> float:
    return _number(text, lambda x: True, "a finite number")


def positive_float(text: str) -> float:
    """A finite number > 0 (epsilon, learning rate, clipping norm, seconds)."""
    return _number(text, lambda x: x > 0, "a finite positive number")


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (a noise multiplier)."""
    return _number(text, lambda x: x >= 0, "a finite number >= 0")


def probability(text: str) -> float:
    """A number in the open interval (0, 1) (delta)."""
    return _number(text, lambda x: 0 < x < 1, "a finite number in (0, 1)")


def _integer(text: str, ok, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, lambda n: n > 0, "a positive integer")


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (a seed: numpy's SeedSequence takes no negative entropy)."""
    return _integer(text, lambda n: n >= 0, "an integer >= 0")



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


def device(text: str) -> str:
    """auto, cpu, or a device torch has here (cuda needs a CUDA GPU: checked now, not after
    the data is loaded)."""
    if text in ("auto", "cpu"):
        return text
    from dpbench.training.config import resolve_device

    try:
        resolve_device(text)
    except (ValueError, RuntimeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
