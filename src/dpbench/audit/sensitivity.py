"""The white-box sensitivity check: the clipped sum, the release before noise, moved by one example.

The statistical audit (``trials``) attacks a model with one parameter tensor, where a clipping
stage that is wrong per layer cannot show. This check builds the optimizer's own step (through the
harness, from its ``OptimizerSpec``, as a training cell does) on ``LayerwiseLinear``: K layers of
differing sizes, each a parameter tensor, with the loss linear in the parameters, so that every
example's per-sample gradient is its input, chosen layer by layer. For neighbouring batches
D and D + {x} (add/remove), built to stress a clipping stage, it compares the step's release
before noise, ``clip_and_sum(per_sample_gradients(batch))`` (the stage whose output the noise is
calibrated for: the per-step clipped sum, which is also the row of G that a matrix mechanism
releases as C G + sigma s C^-1-correlated noise), and flags a violation when

    || clip_and_sum(D + {x}) - clip_and_sum(D) ||_2  >  s (1 + RTOL),

s the claimed sensitivity (the clipping's, ``Clipping(C, normalize).sensitivity``: 1 normalised,
C flat). The batches (``cases``): x alone; x's gradient concentrated in one layer (each layer in
turn), spread over all layers with equal norms or with norms proportional to their sizes,
aligned with the others' gradients; its norm below C, just above, 100 C and 1e6 C; the others
small, at C, or huge. A step that clips each of K layers at C instead of the whole vector
(C / sqrt(K) per layer would be valid) moves the sum by up to s sqrt(K) (``spread``): flagged.

Both releases come from the same state: each is computed by a freshly assembled step (the same
seeds and initial parameters) after the same noise-free warm-up steps on a shared batch, so a
stateful stage (DiSK's previous direction, Dice's residual) is stressed at a state other than
the first without the neighbours' histories differing (the statistical audit covers those).
The check also holds the step's ``noise_std`` (the noise on the sum at the first step) to at
least sigma s. It tests the stage methods: an optimizer whose ``__call__`` is its own (Opacus's)
is checked through its ``per_sample_gradients`` and ``clip_and_sum``, which that ``__call__``
may or may not use (recorded as ``call_own``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dpbench.audit.trials import Claim
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.optimizers.stages import own_stages
from dpbench.privacy.clipping import Clipping
from dpbench.training.harness import assemble

LAYERS = (3, 40, 1, 12)  # the layers' sizes: several tensors, unequal
RTOL = 1e-6  # float64 sums: far above rounding, far below any real excess (sqrt(2) - 1 for two layers)
WARMUP_STEPS = 2
CLIP_NORM = 3.0  # C != 1, so that a stage mixing up C and the normalised scale shows
OTHERS = 5


class LayerwiseLinear(nn.Module):
    """loss_i = sum_k <w_k, x_i[slice k]>: per-sample gradient of layer k is x_i's slice k."""

    per_sample_forward = True

    def __init__(self, sizes=LAYERS, dtype=torch.float64):
        super().__init__()
        self.sizes = tuple(sizes)
        self.layers = nn.ModuleList(nn.Linear(n, 1, bias=False, dtype=dtype) for n in self.sizes)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen, dtype=dtype))

    def forward(self, x):
        parts = x.split(self.sizes, dim=1)
        return sum(layer(part) for layer, part in zip(self.layers, parts))


def layerwise_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    return model(x).squeeze(1), None


def _unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm()


def cases(scale: float, sizes=LAYERS, seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, the others D (n, d), the example x (d,)): neighbouring batches D, D + {x}; norms
    in units of ``scale`` (the clipping norm C)."""
    gen = torch.Generator().manual_seed(seed)
    d, k = sum(sizes), len(sizes)
    starts = [sum(sizes[:i]) for i in range(k)]

    def rand(n):
        return torch.randn(n, d, generator=gen, dtype=torch.float64)

    def with_norms(v, norms):
        return v / v.norm(dim=1, keepdim=True) * torch.tensor(norms, dtype=torch.float64).view(-1, 1) * scale

    def in_layer(i, v=None):
        out = torch.zeros(d, dtype=torch.float64)
        out[starts[i]:starts[i] + sizes[i]] = v if v is not None else torch.randn(sizes[i], generator=gen,
                                                                                    dtype=torch.float64)
        return _unit(out)

    def spread(weights):  # norm of layer i's part proportional to weights[i]
        parts = [_unit(torch.randn(n, generator=gen, dtype=torch.float64)) * w for n, w in zip(sizes, weights)]
        return _unit(torch.cat(parts))

    small = with_norms(rand(OTHERS), [0.3, 0.5, 0.7, 0.9, 1.0])
    huge = with_norms(rand(OTHERS), [2.0, 10.0, 100.0, 1e4, 1e6])
    equal, by_size = spread([1.0] * k), spread([math.sqrt(n) for n in sizes])
    out = [("x alone, spread over all layers, norm 100 C", small[:0], 100 * scale * equal)]
    for i in range(k):
        out.append((f"x in layer {i} alone ({sizes[i]} values), norm 100 C", small, 100 * scale * in_layer(i)))
    for norm in (0.5, 1.0 + 1e-3, 100.0, 1e6):
        out.append((f"x spread over all layers (equal norms), norm {norm:g} C", small, norm * scale * equal))
    out.append(("x spread over all layers (norms by size), norm 100 C", small, 100 * scale * by_size))
    out.append(("x spread over all layers, the others huge", huge, 100 * scale * equal))
    aligned = equal.expand(OTHERS, d) * torch.tensor([0.5, 1.0, 3.0, 10.0, 1e3], dtype=torch.float64).view(-1, 1)
    out.append(("x aligned with the others, norm 100 C", aligned * scale, 100 * scale * equal))
    out.append(("x against the others, norm 100 C", aligned * scale, -100 * scale * equal))
    return out


def _release(spec: OptimizerSpec, claim: Claim, hyper: dict, clipping: Clipping, n_train: int,
             warmup: torch.Tensor, batch: torch.Tensor, seed: int) -> tuple[torch.Tensor, Any]:
    """The flattened clipped sum of ``batch`` by a freshly assembled step, after the warm-up."""
    model = LayerwiseLinear()
    step = assemble(spec, claim.plan, model, layerwise_loss, lr=0.1, noise_multiplier=claim.noise_multiplier,
                    clip_norm=clipping.clip_norm, normalize_clipping=clipping.normalize, hyperparameters=hyper,
                    noise_seed=seed, sampler_seed=seed, n_train=n_train, device="cpu").step
    for _ in range(WARMUP_STEPS):  # every stage but the noise, as DPStep.__call__ runs them
        psg, _ = step.per_sample_gradients(warmup, torch.zeros(len(warmup)))
        step.rule.update(step.params, step.scale_to_mean(step.clip_and_sum(psg)))
    psg, _ = step.per_sample_gradients(batch, torch.zeros(len(batch)))
    released = step.clip_and_sum(psg)
    return torch.cat([g.detach().reshape(-1).to(torch.float64) for g in released]), step


def sensitivity_check(spec: OptimizerSpec, claim: Claim, hyper: dict, n_train: int, seed: int = 0) -> dict[str, Any]:
    """The step planned by ``claim`` (for ``n_train`` examples; its sampler is built, never
    drawn from) on every case of ``cases`` under normalised and flat clipping at C =
    ``CLIP_NORM``: the largest movement of the clipped sum per claimed sensitivity, the case
    that gave it, and ``ok`` (no movement above s (1 + RTOL), and ``noise_std`` >= sigma s).
    Deterministic, and it draws nothing from the caller's global random stream."""
    with torch.random.fork_rng(devices=[]):
        return _check(spec, claim, hyper, n_train, seed)


def _check(spec: OptimizerSpec, claim: Claim, hyper: dict, n_train: int, seed: int) -> dict[str, Any]:
    worst, worst_case, noise_ok, count, call_own = 0.0, None, True, 0, False
    stages = None
    for normalize in (True, False):
        clipping = Clipping(CLIP_NORM, normalize)
        s = clipping.sensitivity
        warmup = cases(CLIP_NORM, seed=seed + 1)[1][1]  # five examples of norms 0.3 C .. C, shared
        for label, others, x in cases(CLIP_NORM, seed=seed):
            without, step = _release(spec, claim, hyper, clipping, n_train, warmup, others, seed)
            with_x, _ = _release(spec, claim, hyper, clipping, n_train, warmup, torch.cat([others, x[None]]), seed)
            moved = float((with_x - without).norm()) / s
            count += 1
            if not math.isfinite(moved) or moved > worst:
                worst, worst_case = moved, f"{label} ({'normalised' if normalize else 'flat'} clipping)"
        noise_ok &= bool(step.noise_std >= claim.noise_multiplier * s * (1 - RTOL))
        stages = own_stages(type(step))
        call_own = "__call__" in stages
    ok = math.isfinite(worst) and worst <= 1 + RTOL and noise_ok
    return {"ok": bool(ok), "max_moved_per_sensitivity": worst, "worst_case": worst_case, "cases": count,
            "layers": list(LAYERS), "clip_norm": CLIP_NORM, "rtol": RTOL, "noise_std_ok": noise_ok,
            "stages": stages, "call_own": call_own}
