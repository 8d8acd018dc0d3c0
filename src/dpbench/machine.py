"""The platform a run's numbers were computed on, as far as it decides them: the CPU (vendor,
family, model, stepping, its name) and the instruction-set extensions that change floating-point
results (vector width, fused multiply-add), and the kernels each library chose for this CPU at run
time: torch's vectorised ATen kernels (its CPU capability), MKL and oneDNN (torch's BLAS and
convolutions), NumPy's SIMD dispatch and OpenBLAS's core (NumPy's and SciPy's linear algebra), and
the environment variables that pin any of these. Two machines with the same record compute the
same bits from the same code and seeds; across records, float results differ in their last digits
(docs/results.md, "What reproduces where").

Standard library and NumPy only; torch is read only where the process has already imported it
(the data and analysis environments have none). Cheap: one read of /proc/cpuinfo and a few
library queries, no benchmark."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
from typing import Any

# instruction-set extensions that change floating-point results (vector width, FMA, bf16/int8 units)
NUMERIC_ISA = re.compile(r"^(sse4_1|sse4_2|avx|avx2|fma|f16c|avx512.*|avx_vnni.*|avx_ne_convert|amx.*)$")
# environment variables that pin the kernels' instruction set or their numerical results
PINS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
        "NPY_DISABLE_CPU_FEATURES", "NPY_ENABLE_CPU_FEATURES", "OPENBLAS_CORETYPE")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_model() -> str | None:
    """The first processor's model name (/proc/cpuinfo's ``model name``; None where there is none)."""
    return _cpuinfo().get("model name")


def _openblas_cores() -> dict[str, str]:
    """The core each OpenBLAS loaded in this process chose at run time (DYNAMIC_ARCH builds pick
    their kernels per CPU): library file name -> core name."""
    cores = {}
    try:
        libs = sorted({line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()})
    except OSError:
        return cores
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                       "openblas_get_corename"):
            get = getattr(lib, symbol, None)
            if get is not None:
                get.restype = ctypes.c_char_p
                cores[os.path.basename(path)] = get().decode()
                break
    return cores


def _torch_kernels() -> dict[str, Any] | None:
    """torch's CPU capability, BLAS/LAPACK, MKL and oneDNN versions; None where torch is not loaded."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    config = torch.__config__.show()

    def find(pattern):
        m = re.search(pattern, config)
        return m.group(1) if m else None

    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "blas": find(r"BLAS_INFO=(\w+)"),
            "lapack": find(r"LAPACK_INFO=(\w+)"), "mkl": find(r"Math Kernel Library Version ([^\n]+?) for"),
            "onednn": find(r"MKL-DNN (v[\w.]+ \(Git Hash \w+\))"), "mkldnn_enabled": torch.backends.mkldnn.enabled}


def platform_record() -> dict[str, Any]:
    """What decides this process's floating-point results beyond the code and the seeds."""
    import numpy as np

    cpu = _cpuinfo()
    simd = np.show_config(mode="dicts").get("SIMD Extensions", {})
    return {
        "machine": platform.machine(),
        "cpu": {"vendor": cpu.get("vendor_id"), "model_name": cpu.get("model name"), "family": cpu.get("cpu family"),
                "model": cpu.get("model"), "stepping": cpu.get("stepping")},
        "isa": sorted(f for f in cpu.get("flags", "").split() if NUMERIC_ISA.match(f)),
        "torch": _torch_kernels(),
        "numpy_simd": {"baseline": simd.get("baseline"), "found": simd.get("found")},
        "openblas": _openblas_cores(),
        "pins": {k: os.environ[k] for k in PINS if k in os.environ},
    }


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_MAX = 32 * 2**20
KEPT_TOP_PAD = 64 * 2**20


def keep_freed_memory() -> bool:
    """Asks glibc's malloc to keep the memory this process frees for its next allocations rather
    than hand it back to the kernel: blocks up to 32 MiB come from the heap (not a fresh mmap each
    time), the heap's top is never trimmed, and it grows 64 MiB at a time. A training step frees
    and allocates the same buffers step after step; by default glibc returns them once more than
    32 MiB is free at the heap's top, and every step then pays a page fault per 4 KiB it touches
    again (on a virtual machine, a costly trap). A DP step holds more at once (every trained
    layer's output gradients), so it paid more of them: P7's DP-SGD step in mode bias measured
    1.4x the non-private step's time by default and 1.0x with this (benchmarks/results/encoder/
    speed.md). Numbers are unchanged (only where memory comes from); the process's resident size
    stays at its peak. True where set (Linux with glibc), False elsewhere (nothing changed)."""
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, 2**31 - 1), (M_TOP_PAD, KEPT_TOP_PAD)))
