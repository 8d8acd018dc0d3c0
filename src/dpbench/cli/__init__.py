"""Command line: ``dpbench train | prefix-store | data | aggregate | plot | grid | cost | list | factorize | noise | audit | audits |
pretrain``.

``main`` and the parser's assembly are here; the commands are grouped by concern, and each
group adds its own sub-commands (``add_parsers``): ``training`` (train, prefix-store, data), ``reporting``
(aggregate, plot, grid, cost, list), ``matrix`` (factorize, noise), ``audit`` (audit, audits), ``pretrain`` (pretrain);
``arguments`` holds the argument types every command shares and the options made from a
settings dataclass (``dpbench train``'s, from ``RunConfig``). Diagnostics (progress, what a
command wrote, warnings) go to stderr through ``dpbench.log`` (``--quiet``: warnings and errors
only); results (tables, ``dpbench list``, a factorization's report) to stdout."""

from __future__ import annotations

import argparse
import logging
import sys

from dpbench import log
from dpbench.cli import audit, matrix, pretrain, reporting, training


def build_parser() -> argparse.ArgumentParser:
    """The ``dpbench`` parser: each group of commands adds its own sub-commands."""
    parser = argparse.ArgumentParser(prog="dpbench", description="Benchmark differentially private optimizers.")
    parser.add_argument("-q", "--quiet", action="store_const", const=logging.WARNING, dest="log_level",
                        help="only warnings and errors on stderr, no progress lines (default: the level "
                             "DPBENCH_LOG_LEVEL names, else info)")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (training, reporting, matrix, audit, pretrain):
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from dpbench.pipeline import watch
    from dpbench.data.dataset import DataError

    args = build_parser().parse_args(argv)
    log.setup(args.log_level)  # the one format of every diagnostic line (dpbench.log)
    watch.start()  # started by the workflow: stop when it is gone (dpbench.pipeline.watch)
    try:
        return args.func(args)
    except (ValueError, KeyError, DataError) as exc:
        # configuration mistakes: one clear line, no traceback
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"dpbench {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:
        # the system refused (a full disk, a missing or unreadable file): one line naming the file
        message = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror or str(exc)
        print(f"dpbench {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dpbench {args.command}: interrupted", file=sys.stderr)
        return 130
