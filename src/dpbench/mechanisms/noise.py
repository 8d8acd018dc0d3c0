"""Noise sources: where the Gaussian noise of a DP step comes from.

A noise source returns unit-variance noise shaped like the gradients (``sample(like)``, in
units of the noise multiplier); the step scales it by sigma times the clipping sensitivity.
Every source draws from a seeded generator of its own, so the noise stream does not depend on
anything else the run draws (model init, sampling).

* ``GaussianNoise``: i.i.d. N(0, 1) (DP-SGD and every Poisson-subsampled Gaussian mechanism);
  ``ProjectionNoise`` is the same noise carrying the random projection's plan constants.
* ``CorrelatedNoise`` (the dense matrix mechanisms): row t of C^-1 Z read from the run's noise
  file (dpbench.matrix.store.noise_files), verified before the first noisy update.
* ``BandedNoise`` and ``BLTNoise`` (the streamed matrix mechanisms): row t of C^-1 Z generated
  on the fly, without a T x d noise file.

  - ``BandedNoise`` (BandMF, Alg. 9 of Choquette-Choo et al. 2023, arXiv 2306.08153): forward
    substitution for C x = z keeping the last b - 1 solutions,
    x_t = (z_t - sum_{r=1}^{b-1} c_r x_{t-r}) / c_0, and w_t = d_t x_t with d_t the column
    normalisation factor (C_used = C D^-1, so C_used^-1 = D C^-1). State: (b - 1) x d floats
    in a ring buffer, one (b - 1)-term GEMV per step.
  - ``BLTNoise`` (buffered linear Toeplitz, Dvijotham et al. 2024, arXiv 2404.16706; McMahan
    et al. 2024, arXiv 2408.08868, Alg. 3): with S = 0 (m x d), x = z - sum_i omega_i S_i and
    S_i <- theta_i S_i + x. State: m x d floats, O(m d) per step.

  Z is drawn exactly as ``GaussianNoise`` draws i.i.d. noise (one ``randn`` per parameter
  tensor, in order), written into one flat vector that the recurrences act on. Every
  recurrence is coordinate-wise, so each coordinate of the flattened concatenation of all
  parameters is its own stream C^-1 z[:, coordinate]: a model whose parameters stack
  independent replicas along their first axis gets independent noise for each replica, and
  with C = I (b = 1, c_0 = 1) the noise is bit-identical to DP-SGD's.

  The state is as sensitive as the noise itself (with it and the releases one can subtract
  the noise): ``state_dict`` carries it so that a resumed run continues exactly, which makes
  every checkpoint holding it a private file. Never log it, never put it in results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dpbench.matrix.store.noise_files import NoiseFile


class GaussianNoise:
    """I.i.d. N(0, 1) noise from a dedicated, seeded generator."""

    def __init__(self, seed: int, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.randn(t.shape, generator=self.generator, device=t.device, dtype=t.dtype) for t in like]

    def sample_into(self, out: list[torch.Tensor]) -> None:
        """Writes into ``out`` the noise ``sample(out)`` would return (the same draws, in order,
        without allocating; one draw per tensor: a single draw over their concatenation would
        give other numbers)."""
        for t in out:
            torch.randn(t.shape, generator=self.generator, device=t.device, dtype=t.dtype, out=t)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class ProjectionNoise(GaussianNoise):
    """I.i.d. N(0, 1) noise plus the projection's public constants fixed by the plan
    (projected_gaussian.ProjectionPlan): which projection, the Gaussian bound's tail t, and whether
    the paper's (invalid) setting is on."""

    def __init__(self, seed: int, device, kind: str, tail_t: float | None, paper_sensitivity: bool):
        super().__init__(seed, device)
        self.kind, self.tail_t, self.paper_sensitivity = kind, tail_t, paper_sensitivity


class CorrelatedNoise:
    """NoiseSource: step t gets row t of C^-1 Z, split into the shapes of the parameters.
    The file is opened at the first step, when d (the parameter count) is known: ``resolve(d)``
    returns it open (and, from ``MatrixMechanism.noise``, verified)."""

    def __init__(self, resolve: Callable[[int], NoiseFile], device: torch.device | str = "cpu"):
        self.resolve = resolve
        self.device = torch.device(device)
        self.file: NoiseFile | None = None
        self.path: Path | None = None
        self.step = 0
        self._row = None

    def sample(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.file is None:
            self.file = self.resolve(sum(t.numel() for t in like))
            self.path = self.file.path
            self._row = torch.empty(self.file.dim, dtype=torch.float32)
        self.file.row(self.step, out=self._row.numpy())
        self.step += 1
        flat = self._row.to(like[0].device, non_blocking=False) if like[0].device.type != "cpu" else self._row
        out, i = [], 0
        for t in like:
            # on the CPU, flat is the reused row buffer: copy; on a GPU it is a fresh transfer already
            out.append(flat[i:i + t.numel()].view(t.shape).to(t.dtype, copy=flat is self._row))
            i += t.numel()
        return out

    def record(self) -> dict:
        """The noise file read (known once the first step gave d), for the run's privacy record."""
        return {"noise_file": None if self.path is None else str(self.path)}

    def state_dict(self) -> dict:
        return {"step": self.step, "path": None if self.path is None else str(self.path)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class _StreamedNoise:
    """Shared plumbing: the generator, the step counter, the flat z buffer and the split."""

    private_state = True  # state_dict holds the recurrence's memory: checkpoints are private files

    def __init__(self, steps: int, seed: int, device: torch.device | str = "cpu"):
        self.steps = int(steps)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.step = 0
        self.state: torch.Tensor | None = None  # the recurrence's memory, allocated at the first step

    def _draw(self, like: list[torch.Tensor]) -> torch.Tensor:
        dim = sum(t.numel() for t in like)
        dtype = like[0].dtype
        z = torch.empty(dim, dtype=dtype, device=self.device)
        i = 0
        for t in like:  # as GaussianNoise: one randn per tensor, in order
            torch.randn(t.shape, generator=self.generator, dtype=dtype, device=self.device,
                        out=z[i:i + t.numel()].view(t.shape))
            i += t.numel()
        if self.state is None:
            self.state = self._allocate(dim, dtype)
            self._constants(dtype)
        elif self.state.shape[-1] != dim or self.state.dtype != dtype:
            raise ValueError(f"the noise state is for d = {self.state.shape[-1]} ({self.state.dtype}); "
                             f"this step asks for d = {dim} ({dtype})")
        return z

    def sample(self, like: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.step >= self.steps:
            raise RuntimeError(f"the factorization is for {self.steps} steps; step {self.step + 1} was asked for")
        w = self._next(self._draw(like))
        self.step += 1
        out, i = [], 0
        for t in like:
            out.append(w[i:i + t.numel()].view(t.shape).to(t.device))
            i += t.numel()
        return out

    def state_dict(self) -> dict:
        """Step, generator and recurrence state: a checkpoint holding this is a private file."""
        return {"step": self.step, "generator": self.generator.get_state(),
                "state": None if self.state is None else self.state.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.generator.set_state(state["generator"])
        saved = state["state"]
        if saved is None:
            self.state = None
        else:
            self.state = saved.to(self.device).clone()
            self._constants(self.state.dtype)

    @property
    def state_floats(self) -> int:
        """Floats held between steps (the recurrence's memory)."""
        return 0 if self.state is None else self.state.numel()


class BandedNoise(_StreamedNoise):
    """w_t = scale_t x_t with C x = z for a b-banded lower-triangular Toeplitz C (coefficients
    ``coef``), ``scale`` the column-normalisation factors d_t (ones without normalisation)."""

    def __init__(self, coef, scale, seed: int, device: torch.device | str = "cpu"):
        coef = np.array(coef, dtype=np.float64)  # copies: torch needs positive strides
        scale = np.array(scale, dtype=np.float64)
        if coef.ndim != 1 or coef.size < 1 or coef[0] == 0:
            raise ValueError("BandedNoise needs coefficients c with c_0 != 0")
        super().__init__(scale.size, seed, device)
        self.coef, self.scale = coef, scale
        self.bands = coef.size
        # weights[p] is the coefficient vector over ring slots when x_t goes to slot p = t mod (b - 1):
        # slot (p - r) mod (b - 1) holds x_{t-r}, weighted by c_r
        slots = max(self.bands - 1, 1)
        weights = np.zeros((slots, slots))
        for p in range(slots):
            for r in range(1, self.bands):
                weights[p, (p - r) % slots] = coef[r]
        self._weights_np = weights

    def _allocate(self, dim: int, dtype) -> torch.Tensor:
        return torch.zeros((self.bands - 1, dim), dtype=dtype, device=self.device)

    def _constants(self, dtype) -> None:
        self._weights = torch.as_tensor(self._weights_np, dtype=dtype, device=self.device)
        self._scale = torch.as_tensor(self.scale, dtype=dtype, device=self.device)

    def _next(self, z: torch.Tensor) -> torch.Tensor:
        t = self.step
        if self.bands > 1:
            slot = t % (self.bands - 1)
            z.sub_(self._weights[slot] @ self.state)  # sum_r c_r x_{t-r}: one small GEMV
            if self.coef[0] != 1.0:
                z.div_(float(self.coef[0]))
            self.state[slot].copy_(z)  # x_t replaces x_{t-b+1}, no longer needed
        elif self.coef[0] != 1.0:
            z.div_(float(self.coef[0]))
        if self.scale[t] != 1.0:
            z.mul_(self._scale[t])
        return z


class BLTNoise(_StreamedNoise):
    """x_t = (C^-1 z)_t for the BLT C = BLT(theta, omega), used for ``steps`` steps."""

    def __init__(self, theta, omega, steps: int, seed: int, device: torch.device | str = "cpu"):
        self.theta = np.array(theta, dtype=np.float64)  # copies: torch needs positive strides
        self.omega = np.array(omega, dtype=np.float64)
        if self.theta.shape != self.omega.shape or self.theta.ndim != 1:
            raise ValueError("theta and omega must be vectors of one length")
        super().__init__(steps, seed, device)

    def _allocate(self, dim: int, dtype) -> torch.Tensor:
        return torch.zeros((self.theta.size, dim), dtype=dtype, device=self.device)

    def _constants(self, dtype) -> None:
        self._theta = torch.as_tensor(self.theta, dtype=dtype, device=self.device)[:, None]
        self._omega = torch.as_tensor(self.omega, dtype=dtype, device=self.device)

    def _next(self, z: torch.Tensor) -> torch.Tensor:
        z.sub_(self._omega @ self.state)  # x = z - sum_i omega_i S_i
        self.state.mul_(self._theta).add_(z)  # S_i <- theta_i S_i + x
        return z
