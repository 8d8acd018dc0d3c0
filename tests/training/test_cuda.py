"""The GPU numerics (dpbench.training.cuda) and what a checkpoint restores onto a GPU, checked on any
machine; the GPU cases of the other test files run with ``pytest -m cuda`` (docs/gpu.md)."""

import os

import numpy as np
import pytest
import torch

from conftest import run_cell
from dpbench.training import cuda
from dpbench.training.checkpoint import Checkpoint, step_state_on
from dpbench.training.config import RunConfig


def test_configure_turns_tf32_off_and_kernels_deterministic(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    try:
        torch.backends.cudnn.allow_tf32 = True  # PyTorch's default for convolutions
        assert cuda.configure() == {"tf32_matmul": False, "tf32_cudnn": False, "deterministic": True,
                                    "cudnn_deterministic": True, "cudnn_benchmark": False,
                                    "cublas_workspace_config": ":4096:8"}
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own setting wins
        s = cuda.configure(deterministic=False, tf32=True)
        assert s["tf32_matmul"] and s["tf32_cudnn"] and not s["deterministic"] and s["cublas_workspace_config"] == ":16:8"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[:2]
        torch.use_deterministic_algorithms(before[2])
        torch.backends.cudnn.deterministic = before[3]


def test_checkpoint_puts_optimizer_state_on_the_run_device(tiny_fmnist, tmp_path):
    """A checkpoint is read to the CPU; when it is restored, the optimizer state (here Adam's
    moments) goes to the run's device, the noise source's generator state stays a CPU byte
    tensor (``set_state`` takes only those). The "meta" device stands in for a GPU."""
    cfg = RunConfig(problem="P2", optimizer="dpadambc", lr=1e-3, batch_size=60, epochs=2, seed=0, epsilon=3.0,
                    progress_every_s=1e9)
    run_cell(cfg, checkpoint=tmp_path / "run.ckpt", checkpoint_every_s=1e9)  # completes: checkpoint after epoch 1
    saved = Checkpoint(tmp_path / "run.ckpt", cfg).load()  # verified, read to the CPU
    state = step_state_on(saved["step_fn"], "meta")
    rule, noise = state["rule"], state["noise"]
    assert rule["t"] == 10 and all(t.device.type == "meta" for t in rule["m"] + rule["v"])
    assert noise["generator"].device.type == "cpu" and noise["generator"].dtype == torch.uint8
    assert noise == saved["step_fn"]["noise"]


def _private_optimizers():
    from dpbench.optimizers import OPTIMIZERS

    return sorted(name for name, spec in OPTIMIZERS.items() if spec.private)


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer", _private_optimizers())
def test_every_private_optimizer_trains_on_the_gpu_with_the_cpu_calibration(tiny_fmnist, tmp_path, optimizer):
    """Every private optimizer of the registry (the streamed mechanisms, D2P2's projections and
    DP-Dice-strict included) runs on a CUDA GPU: the same sigma and achieved epsilon as on the
    CPU (calibration is device-free), a finite loss, and as many steps."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU (torch.cuda.is_available() is False)")
    cuda.configure()
    results = {}
    for device in ("cpu", "cuda"):
        cfg = RunConfig(problem="P2", optimizer=optimizer, lr=1e-3 if "adam" in optimizer else 0.05, batch_size=60,
                        epochs=1, seed=0, epsilon=4.0, max_steps=4, progress_every_s=1e9,
                        cache_dir=str(tmp_path / "cache"), device=device)
        results[device] = run_cell(cfg)
    cpu, gpu = results["cpu"].meta, results["cuda"].meta
    assert gpu["privacy"]["noise_multiplier"] == pytest.approx(cpu["privacy"]["noise_multiplier"], rel=1e-12)
    assert gpu["privacy"]["epsilon"] == pytest.approx(cpu["privacy"]["epsilon"], rel=1e-9)
    assert gpu["privacy"]["epsilon"] <= 4.0 * (1 + 1e-9)
    m = results["cuda"].metrics
    assert len(m[m.split == "train"]) == len(results["cpu"].metrics.query("split == 'train'")) == 4
    assert np.isfinite(m.loss.dropna()).all()
