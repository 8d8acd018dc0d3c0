"""machine.keep_freed_memory: glibc keeps freed buffers for the next step instead of faulting them
in again (each case in a fresh interpreter: the setting lasts for the process)."""
import platform
import subprocess
import sys

import pytest

from dpbench import machine

ROUNDS = """
import resource, numpy as np
from dpbench.machine import keep_freed_memory
kept = keep_freed_memory() if {keep} else None
def step():  # what a training step does: allocate 8 x 16 MiB, touch every page, free them all
    buffers = [np.empty(4 * 2**20, np.float32) for _ in range(8)]
    for b in buffers:
        b.fill(1.0)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(keep: bool) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS.format(keep=keep)], capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split()
    return kept, int(faults)


def test_glibc_constants():
    # malloc.h: M_TRIM_THRESHOLD -1, M_TOP_PAD -2, M_MMAP_THRESHOLD -3; the mmap threshold's
    # ceiling on 64-bit is 4 MiB * sizeof(long)
    assert (machine.M_TRIM_THRESHOLD, machine.M_TOP_PAD, machine.M_MMAP_THRESHOLD) == (-1, -2, -3)
    assert machine.MMAP_THRESHOLD_MAX == 4 * 2**20 * 8


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_buffers_are_reused_not_faulted_in_again():
    kept, faults = page_faults(True)
    assert kept == "True"
    default_kept, default_faults = page_faults(False)
    # 5 steps x 128 MiB: by default glibc hands the freed heap back and faults thousands of pages
    # in again; kept, the next steps reuse it (a wrong parameter number makes mallopt refuse it,
    # or leaves the trimming on)
    assert default_faults > 2_000, default_faults
    assert faults < default_faults / 20, (faults, default_faults)


def test_elsewhere_nothing_changes(monkeypatch):
    monkeypatch.setattr(machine.platform, "system", lambda: "Darwin")
    assert machine.keep_freed_memory() is False
