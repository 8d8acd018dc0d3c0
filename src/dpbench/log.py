"""The package's diagnostics, on stderr in one format: progress lines, what a command wrote, warnings.

A module logs through ``log.get(__name__)``, a child of the ``dpbench`` logger. That logger has
one handler, which writes each record as one line on the current ``sys.stderr`` (a test or a
caller may replace it): the message itself, so a progress line reads as it always did
(``[P2 dpsgd lr=0.1 ...] step 40/100 (40%) ...``), and a warning or an error behind the prefix
the command line's own errors use (``dpbench: warning: ...``). Records do not travel on to the
root logger: an application that configures its own logging sees no line twice.

The level: ``setup(level)``, which ``dpbench``'s entry point calls, with ``logging.WARNING``
for ``--quiet`` (warnings and errors only); otherwise the environment's ``DPBENCH_LOG_LEVEL``
(``debug``, ``info``, ``warning`` or ``error``; ``info`` where unset). The first ``get`` sets the
handler up, so scripts and tests that call the package directly see the lines the command shows.
Not through here: the lines of the modules a pretrained checkpoint's name hashes
(``dpbench.training.pretrain``, ``dpbench.data``), whose every edit would rename it; they print to
stderr as before.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "dpbench"
ENV = "DPBENCH_LOG_LEVEL"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record comes."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _) -> None:  # StreamHandler.__init__ sets it; the current sys.stderr wins
        pass


class _Format(logging.Formatter):
    """The message; a warning or an error behind ``dpbench: <level>:``."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        return f"{ROOT}: {record.levelname.lower()}: {line}" if record.levelno >= logging.WARNING else line


def _env_level() -> tuple[int, str | None]:
    """(the level DPBENCH_LOG_LEVEL asks for, or info; the complaint about a value it cannot be)."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value or value in LEVELS:
        return LEVELS.get(value, logging.INFO), None
    return logging.INFO, f"ignoring {ENV}={value!r} (expected one of {', '.join(LEVELS)})"


def setup(level: int | None = None) -> logging.Logger:
    """The ``dpbench`` logger with its one handler (installed once) at ``level`` (None: the
    environment's, module docstring)."""
    logger = logging.getLogger(ROOT)
    complaint = None
    if level is None:
        level, complaint = _env_level()
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(_Format())
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    if complaint:
        logger.warning(complaint)
    return logger


def get(name: str) -> logging.Logger:
    """The logger of module ``name`` (``dpbench.<...>``), the handler set up if it is not yet."""
    if name != ROOT and not name.startswith(ROOT + "."):
        raise ValueError(f"logger {name!r} is not dpbench's (expected a name under {ROOT!r})")
    if not any(isinstance(h, _Stderr) for h in logging.getLogger(ROOT).handlers):
        setup()
    return logging.getLogger(name)
