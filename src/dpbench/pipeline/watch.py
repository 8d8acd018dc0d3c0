"""Jobs that die with the workflow that started them.

Snakemake runs each local job as a child process. ``kill -9`` of the Snakemake process (or
its sudden death) cannot be caught, so it cannot stop its jobs: they go on as orphans,
training for hours into files no workflow waits for, and a rerun started meanwhile trains
the same cells beside them. So the workflow (``workflow/rules/common.smk``) puts ``token()``,
its process id and start time, in the environment variable ``DPBENCH_WATCH_PID`` that every
job inherits, and ``start()``, which every ``dpbench`` command calls first, watches that
process from a daemon thread. Once it has exited, the command is interrupted as by Ctrl-C
(SIGINT: temporary files are removed on the way out; a training run keeps its last
checkpoint and continues from it when the workflow is run again) and killed if it has not
stopped ``GRACE_S`` seconds later. The start time tells the workflow from a later process
that reuses its id. A command run by hand (no variable) watches nothing.

Linux ``/proc`` gives the start time and tells an exited (zombie) process from a live one;
elsewhere only the process id is checked.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from dpbench import log

_LOG = log.get(__name__)

ENV = "DPBENCH_WATCH_PID"
POLL_S = 1.0  # seconds between checks: a job outlives its workflow by about this much
GRACE_S = 10.0  # seconds from the interrupt to SIGKILL


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22), or None
    if it has exited (including a zombie not yet reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def token(pid: int | None = None) -> str:
    """``pid:start time`` of a process (this one by default): what the workflow hands its jobs."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_time(pid) or ''}"


def alive(tok: str) -> bool:
    """Whether the process a ``token`` names is still running (and is still that process)."""
    pid_text, _, start = tok.partition(":")
    pid = int(pid_text)
    if Path("/proc/self/stat").exists():
        now = _start_time(pid)
        return now is not None and (not start or now == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _stop_when_gone(tok: str) -> None:
    while alive(tok):
        time.sleep(POLL_S)
    _LOG.warning(f"the workflow process {tok.partition(':')[0]} that started this job has exited; stopping "
                 "(a training run continues from its checkpoint when the workflow runs again)")
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def start(environ=os.environ) -> threading.Thread | None:
    """Watch the process named by ``DPBENCH_WATCH_PID``, if set (module docstring)."""
    tok = environ.get(ENV)
    if not tok:
        return None
    try:
        alive(tok)
    except ValueError:
        _LOG.warning(f"ignoring {ENV}={tok!r} (expected pid:start time)")
        return None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started in the background of a non-interactive shell (or by a tool that does so), the
        # job inherited SIGINT ignored, and the interrupt below would do nothing: let it stop
        signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=_stop_when_gone, args=(tok,), name="dpbench-watch", daemon=True)
    thread.start()
    return thread
