"""What every file the package writes shares: its permissions and its failure messages.

Files are written to a temporary name (``tempfile.mkstemp``) and renamed into place, so a
reader never sees a partial file. ``mkstemp`` creates its file with mode 0600; on a lab's
shared results directory that makes results, aggregates and caches unreadable to everyone
else, so each writer gives the file the mode ``open()`` would, 0666 masked by the umask
(``chmod_like_open``), before renaming it. A writer removes its temporary file on every
failure it sees; a killed writer cannot, so temporary names carry the host and the process id
(``partial_prefix``) and the next writer removes those of dead processes on its host
(``remove_stale_partials``). ``no_space`` words a full disk as one line naming the file and
the fix. Standard library only: the data and matrix environments import it.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

_UMASK_LOCK = threading.Lock()
HOST = socket.gethostname().replace(".", "_")


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status,
    kernel >= 4.7); elsewhere set and restored at once, under a lock."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def chmod_like_open(fd: int) -> None:
    """Give a file made by ``mkstemp`` (0600) the mode ``open()`` gives a new file."""
    os.fchmod(fd, 0o666 & ~umask())


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space(exc: OSError, what: str, path: str | Path, fix: str) -> OSError:
    """One line for a full disk (or quota): what was being written, where, and what to do."""
    return OSError(exc.errno, f"no space left on device while writing {what} {path} ({exc.strerror}); "
                              f"its partial file was removed: {fix}")


def partial_prefix(path: Path) -> str:
    """The start of this process's temporary names for ``path`` (in its directory)."""
    return f".{path.name}.{HOST}.{os.getpid()}."


def remove_stale_partials(path: Path) -> None:
    """Delete temporary files of writers of ``path`` on this host that died (a killed job
    would otherwise leave them behind); live writers' files are kept."""
    for tmp in path.parent.glob(f".{path.name}.{HOST}.*.tmp"):
        try:
            pid = int(tmp.name[len(f".{path.name}.{HOST}."):].split(".")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def special_kind(path: str | Path) -> str | None:
    """What ``path`` is where it exists and is not a regular file ("a FIFO", "a character
    device", ...; through a symlink: "a symlink to a FIFO"), else None (a regular file, a
    symlink to one, or nothing there)."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"a symlink to {kind}" if os.path.islink(path) else kind


def refuse_special(path: str | Path, what: str = "output") -> None:
    """Outputs are regular files: a ``path`` that exists as anything else (a device such as
    /dev/full or /dev/null, a FIFO, a socket, a directory, a symlink to one) is refused, naming
    it, before any work; a rename would otherwise replace the device node or FIFO itself."""
    kind = special_kind(path)
    if kind is not None:
        raise ValueError(f"{what} {path} is {kind}, not a regular file; refusing to write over it: "
                         f"give the path of a regular file")


def atomic_write(path: Path, write: Callable[[Any], None], mode: str = "wb", private: bool = False) -> None:
    """Write ``path`` through ``write(f)`` atomically: a temporary name beside it (those of dead
    writers removed first), the umask's mode (``private``: 0600, readable by its owner only),
    fsync, rename; a failure removes the temporary file. A reader sees the complete file or none.
    A ``path`` that exists and is not a regular file is refused (``refuse_special``), never
    renamed over."""
    path = Path(path)
    refuse_special(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=partial_prefix(path), suffix=".tmp")
    try:
        if not private:  # mkstemp made it 0600
            chmod_like_open(fd)
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
