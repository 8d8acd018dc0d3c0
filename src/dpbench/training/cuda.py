"""The numerics of a run on a CUDA GPU: full float32 precision and deterministic kernels.

TF32 is off. NVIDIA GPUs since Ampere can run float32 matrix products and convolutions in
TF32 (operands rounded to 10 mantissa bits, relative error ~5e-4 per product); PyTorch enables
it for cuDNN convolutions by default. The per-sample gradient norms that clipping divides by
come out of those products, so under TF32 a clipped gradient's true norm can exceed 1
(normalised clipping) by about the rounding error, i.e. the L2 sensitivity the accountant
assumes would be slightly violated. Privacy first: every run on a GPU computes in IEEE
float32 (``torch.backends.cuda.matmul.allow_tf32 = False``, ``torch.backends.cudnn.allow_tf32
= False``); tests/privacy/test_privacy.py measures the excess with TF32 on and off on the GPU.

Kernels are deterministic. Some CUDA kernels (cuDNN's weight-gradient algorithms, cuBLAS with
its default workspace) may sum in an order that varies between calls, so two runs of one
cell could differ in the last bits and grow apart over thousands of steps. A run that is
killed and resumed from its checkpoint, or that shares its GPU with other runs, must end
with the same metrics as one run alone: ``torch.use_deterministic_algorithms(True)`` (with
``warn_only``: an operation without a deterministic implementation warns in the run's log
instead of stopping the run), cuDNN without autotuning, and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
(read when cuBLAS first runs in the process, so it is set before any CUDA work; an explicit
setting in the environment wins). Their cost is measured by ``benchmarks/bench_gpu.py
determinism`` (docs/gpu.md).

These settings are process-wide; ``configure`` is called by the training harness whenever a
run's device is a GPU, and by the GPU benchmarks for every method they compare.
``resolve_device`` is the torch device a run's ``device`` setting names.
"""

from __future__ import annotations

import os

import torch

CUBLAS_WORKSPACE = ":4096:8"


def configure(deterministic: bool = True, tf32: bool = False) -> dict[str, object]:
    """Apply the GPU numerics above (defaults: deterministic, no TF32); returns what was set."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = deterministic
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    return settings()


def settings() -> dict[str, object]:
    """The current values of the settings ``configure`` controls (recorded with benchmarks)."""
    return {
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def resolve_device(device: str) -> torch.device:
    """The torch device of ``device`` (auto: the GPU where there is one); a CUDA device this
    machine does not have is an error saying so (not a failure after the data is loaded)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
            raise ValueError(f"{device}: no CUDA GPU is available (torch {torch.__version__}, built {build}); "
                             "use --device cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return dev
