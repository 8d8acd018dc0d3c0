"""Per-sample gradients, formed only as far as each use needs them.

A forward pass records every trainable layer's input x; one backward pass to the layer
outputs (autograd forms no weight gradients) gives their output gradients gy. From
(x, gy) alone, per layer and per sample, we get:

* squared gradient norms, either from the materialised per-sample weight gradients or,
  where a layer has few positions, from the "ghost" identity
  ``||sum_p G_p^T A_p||^2 = sum_{p,q} (A_p . A_q)(G_p . G_q)`` (Li et al., 2022), with A the
  (unfolded) inputs and G the output gradients at each position p;
* any weighted sum ``sum_i c_i grad_i`` (clipping is such a sum, c_i the clip factors) as one
  native weight-gradient call on ``c * gy``;
* per-sample inner products between two passes (DiSK combines gradients at two points).

The layers, with x and gy at positions p (tokens of a sequence, pixels of an image):

* ``nn.Linear`` on (B, ..., d_in) inputs: ``grad_i = sum_p gy_p^T x_p``, A = x, G = gy;
* ``nn.Conv2d`` / ``nn.ConvTranspose2d``: the same with A the unfolded input patches (for the
  transposed convolution, the roles of x and gy exchanged);
* ``nn.Embedding`` (V rows of width d) on integer inputs: ``grad_i = sum_p onehot(idx_p)^T gy_p``,
  i.e. A = onehot(idx). The ghost identity needs only ``A_p . A_q = [idx_p = idx_q]``, so
  ``||grad_i||^2 = sum_{p,q} [idx_p = idx_q] (gy_p . gy_q)`` (~P^2 d per sample) against
  materialising the (V, d) gradient with one scatter-add (~(V + P) d per sample); a weighted
  sum is one ``index_add`` of ``c * gy`` into the rows;
* ``nn.LayerNorm`` (elementwise affine): with x^ the input normalised over the last dims (the
  layer's eps, recomputed from x), ``weight_i = sum_p gy_p * x^_p`` and ``bias_i = sum_p gy_p``,
  materialised always (each is the size of one output row; there is nothing cheaper).

A parameter shared by two layers (tied weights) is refused: its per-sample gradient is the sum
of the two layers' contributions, whose squared norm is not the sum of their squared norms.

This is the "book-keeping" approach of Bu et al. (2023): one forward and one backward pass,
whatever the clipping, and per-sample gradients materialised only where that is cheaper.
"""

from __future__ import annotations

from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.grad import conv2d_weight

SUPPORTED_LAYERS = (nn.Linear, nn.Conv2d, nn.ConvTranspose2d, nn.Embedding, nn.LayerNorm)


def unfold(x: torch.Tensor, kernel_size, dilation, padding, stride) -> torch.Tensor:
    """``F.unfold(x, ...)``, (B, C kh kw, L), as strided views and one copy: CUDA's im2col
    launches one kernel per sample (2048 launches per layer at L = 2048), this launches a
    few whatever the batch. Values are identical (pure data movement)."""
    if tuple(dilation) != (1, 1):
        return F.unfold(x, kernel_size, dilation, padding, stride)
    (kh, kw), (sh, sw), (ph, pw) = kernel_size, stride, padding
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    patches = x.unfold(2, kh, sh).unfold(3, kw, sw)  # (B, C, H', W', kh, kw), a view
    B, C, Ho, Wo = patches.shape[:4]
    return patches.permute(0, 1, 4, 5, 2, 3).reshape(B, C * kh * kw, Ho * Wo)


class UnsupportedLayerError(TypeError):
    """The model has trainable parameters in a layer whose per-sample gradients we cannot form."""


# nn.Embedding options (and their supported values) that change its gradient: padding_idx zeroes
# one row's gradient, max_norm renormalises rows in place during the forward pass,
# scale_grad_by_freq divides by each index's frequency in the whole batch (which mixes samples),
# sparse makes the gradient a sparse tensor.
_EMBEDDING_OPTIONS = {"padding_idx": None, "max_norm": None, "scale_grad_by_freq": False, "sparse": False}


def unsupported_option(module: nn.Module) -> str | None:
    """Why the options of a supported layer type put it beyond this engine, or None."""
    if isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)):
        if module.groups != 1 or isinstance(module.padding, str):
            return "only groups=1 and numeric padding are supported"
    if isinstance(module, nn.Embedding):
        for option, value in _EMBEDDING_OPTIONS.items():
            if getattr(module, option) != value:
                return f"option {option}={getattr(module, option)!r} is not supported (only {option}={value!r})"
    return None


class LayerGrads:
    """One layer's per-sample gradients for a batch, held as (input, output gradient)."""

    def __init__(self, module: nn.Module, x: torch.Tensor, gy: torch.Tensor):
        reason = unsupported_option(module)
        if reason is not None:
            raise UnsupportedLayerError(f"{module}: {reason}")
        self.module, self.x, self.gy = module, x, gy
        self.batch_size = x.shape[0]

    # -- the factor form: grad_i = G_i^T A_i, A: (B, P, da), G: (B, P, dg) -------------------
    @cached_property
    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, G) of Linear and convolution layers; for an Embedding A is never formed, the
        indices (B, P) stand for the one-hot rows (see ``_gram_inputs``)."""
        m, x, gy, B = self.module, self.x, self.gy, self.batch_size
        if isinstance(m, nn.Embedding):
            return x.reshape(B, -1), gy.reshape(B, -1, gy.shape[-1])
        if isinstance(m, nn.Linear):
            return x.reshape(B, -1, x.shape[-1]), gy.reshape(B, -1, gy.shape[-1])
        if isinstance(m, nn.Conv2d):
            U = unfold(x, m.kernel_size, m.dilation, m.padding, m.stride)
            return U.transpose(1, 2), gy.flatten(2).transpose(1, 2)
        # ConvTranspose2d is the adjoint of a Conv2d from gy's space to x's space:
        # dW[ci, co, kh, kw] = sum_p x[ci, p] * unfold(gy)[co, kh, kw, p], p over input pixels.
        U = unfold(gy, m.kernel_size, m.dilation, m.padding, m.stride)
        return U.transpose(1, 2), x.flatten(2).transpose(1, 2)

    @property
    def _positions(self) -> int:
        m, x, gy = self.module, self.x, self.gy
        if isinstance(m, nn.Embedding):
            return x[0].numel()
        if isinstance(m, nn.Linear):
            return x[0].numel() // x.shape[-1]
        if isinstance(m, nn.LayerNorm):
            return x[0].numel() // m.weight.numel()
        if isinstance(m, nn.Conv2d):
            return gy[0, 0].numel()
        return x[0, 0].numel()

    @property
    def use_ghost(self) -> bool:
        """Whether norms and inner products come from the ghost identity (LayerNorm: never)."""
        P, m = self._positions, self.module
        if isinstance(m, nn.Embedding):
            # ghost ~P^2 d per sample; materialising: a scatter of P rows into V zero rows, ~(V + P) d
            return P * P < m.num_embeddings + P
        # Ghost norms cost ~P^2 (da + dg) per sample, materialising ~P da dg (and da dg memory).
        # For Linear and convolutions dg = weight.shape[0] and da = weight[0].numel().
        w = m.weight
        return P == 1 or P * (w.shape[0] + w[0].numel()) < w.numel()

    @property
    def _has_ghost(self) -> bool:
        return not isinstance(self.module, nn.LayerNorm)

    @cached_property
    def materialised(self) -> torch.Tensor:
        """Per-sample weight gradients, (B, *weight.shape)."""
        m, x, gy, B = self.module, self.x, self.gy, self.batch_size
        if isinstance(m, nn.Embedding):
            # row idx_p of sample i gets gy_p: one scatter-add into B stacked copies of the table
            V, d = m.weight.shape
            idx, G = self.factors
            rows = (idx + V * torch.arange(B, device=idx.device).unsqueeze(1)).reshape(-1)
            return G.new_zeros(B * V, d).index_add_(0, rows, G.reshape(-1, d)).view(B, V, d)
        if isinstance(m, nn.LayerNorm):
            xhat = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
            # sum over positions p of gy_p * x^_p, as a batched contraction (no (B, P, d) temporary)
            w = torch.einsum("bpk,bpk->bk", gy.reshape(B, -1, m.weight.numel()), xhat.reshape(B, -1, m.weight.numel()))
            return w.view(B, *m.weight.shape)
        if isinstance(m, nn.Linear) or x.device.type != "cpu":
            # one batched GEMM of the factors, G_i^T A_i (on a GPU, cuDNN runs a grouped
            # weight gradient as one kernel per group, i.e. per sample)
            A, G = self.factors
            return torch.bmm(G.transpose(1, 2), A).view(B, *m.weight.shape)
        # On the CPU: one grouped weight-gradient call (groups = B).
        if isinstance(m, nn.Conv2d):
            inp, out = x, gy
        else:
            inp, out = gy, x
        cin, cout = inp.shape[1], out.shape[1]
        w = conv2d_weight(
            inp.reshape(1, B * cin, *inp.shape[2:]), (B * cout, cin, *m.kernel_size),
            out.reshape(1, B * cout, *out.shape[2:]), m.stride, m.padding, m.dilation, groups=B,
        )
        return w.view(B, *m.weight.shape)

    @cached_property
    def bias(self) -> torch.Tensor | None:
        """Per-sample bias gradients, (B, n_bias)."""
        if getattr(self.module, "bias", None) is None:  # Embedding: none; LayerNorm(bias=False)
            return None
        gy = self.gy
        if isinstance(self.module, (nn.Linear, nn.LayerNorm)):
            return gy.reshape(self.batch_size, -1, *self.module.bias.shape).sum(1)
        return gy.sum((2, 3))

    def _gram_inputs(self, other: "LayerGrads") -> torch.Tensor:
        """(A_p . A'_q) for all positions p of this pass and q of the other, (B, P, P')."""
        A, A2 = self.factors[0], other.factors[0]
        if isinstance(self.module, nn.Embedding):  # one-hot rows: equal indices
            return (A.unsqueeze(2) == A2.unsqueeze(1)).to(self.gy.dtype)
        return torch.bmm(A, A2.transpose(1, 2))

    def inner(self, other: "LayerGrads") -> torch.Tensor:
        """Per-sample inner products <grad_i, other_grad_i> over this layer's parameters, (B,)."""
        if self.use_ghost and self._has_ghost:
            (A, G), (A2, G2) = self.factors, other.factors
            if A.shape[1] == 1 and A2.shape[1] == 1 and not isinstance(self.module, nn.Embedding):
                w = (A[:, 0] * A2[:, 0]).sum(1) * (G[:, 0] * G2[:, 0]).sum(1)
            else:
                w = (self._gram_inputs(other) * torch.bmm(G, G2.transpose(1, 2))).sum((1, 2))
        else:
            w = _rowwise_dot(self.materialised, other.materialised)
        if self.bias is not None:
            w = w + _rowwise_dot(self.bias, other.bias)
        return w

    def weighted_sum(self, coef: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        """sum_i coef_i * grad_i, shaped like the parameters."""
        m = self.module
        if "materialised" in self.__dict__ or isinstance(m, nn.LayerNorm):
            w = torch.tensordot(coef, self.materialised, dims=1)
        elif isinstance(m, nn.Embedding):
            idx, G = self.factors
            w = G.new_zeros(m.weight.shape).index_add_(0, idx.reshape(-1), (G * coef.view(-1, 1, 1)).flatten(0, 1))
        elif isinstance(m, nn.Linear):
            A, G = self.factors
            B, P, dg = G.shape
            w = (G * coef.view(B, 1, 1)).reshape(B * P, dg).t() @ A.reshape(B * P, -1)
        else:
            scaled = self.gy * coef.view(-1, 1, 1, 1)
            if isinstance(m, nn.Conv2d):
                w = conv2d_weight(self.x, m.weight.shape, scaled, m.stride, m.padding, m.dilation)
            else:
                w = conv2d_weight(scaled, m.weight.shape, self.x, m.stride, m.padding, m.dilation)
        out = {m.weight: w.reshape(m.weight.shape)}
        if self.bias is not None:
            out[m.bias] = torch.tensordot(coef, self.bias, dims=1)
        return out


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over all but the first axis of a * b, (B,), without a B x n temporary (for a squared
    norm, a norm reduction: 8x faster than multiplying and summing on 2 CPU threads)."""
    if a is b:
        return torch.linalg.vector_norm(a.flatten(1), dim=1).square()
    return torch.einsum("bi,bi->b", a.flatten(1), b.flatten(1))


class SampleMixingError(UnsupportedLayerError):
    """The model has a layer whose forward may make one sample's output depend on others."""


# Parameter-free layers whose forward treats every sample on its own (axis 0 is the batch).
# Per-sample gradients and the clipping bound assume exactly that: per-sample loss i may
# depend on example i only. A layer that mixes samples (batch normalisation in training mode,
# with or without affine parameters or running statistics) lets one example move every other
# example's gradient, so the clipped sum's sensitivity is no longer the clipping norm (with one
# BatchNorm1d(affine=False) between two Linear layers, removing one example from a batch of 32
# moved the normalised-clipped sum by 5.5 instead of at most 1; tests/test_integrity.py).
PER_SAMPLE_LAYERS = (
    nn.Identity, nn.Flatten, nn.Unflatten,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh,
    nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Hardshrink, nn.Softshrink, nn.Tanhshrink, nn.Softplus,
    nn.Softsign, nn.LogSigmoid, nn.Threshold, nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d, nn.GLU,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.LPPool1d, nn.LPPool2d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
    nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle, nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d,
    nn.ConstantPad3d, nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReplicationPad1d, nn.ReplicationPad2d,
    nn.ReplicationPad3d,
    # normalisations over each sample's own features (never over the batch), without parameters
    nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
)
# Modules that only hold others (their forward, if any, calls them in turn).
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# Layers above that work along a configurable axis: the attribute naming it, and its default.
_AXIS = {nn.Softmax: "dim", nn.LogSoftmax: "dim", nn.Softmin: "dim", nn.GLU: "dim", nn.Flatten: "start_dim",
         nn.Unflatten: "dim"}


def _mixing_reason(module: nn.Module) -> str | None:
    """Why ``module``'s own forward may mix samples, or None if it is known not to."""
    if any(True for _ in module.buffers(recurse=False)):
        names = ", ".join(n for n, _ in module.named_buffers(recurse=False))
        return (f"it has buffers ({names}): statistics such as running means are computed from the whole "
                "batch (and released with the model without noise)")
    if isinstance(module, SUPPORTED_LAYERS + CONTAINERS):
        return None
    if isinstance(module, PER_SAMPLE_LAYERS):
        attribute = _AXIS.get(type(module))
        axis = getattr(module, attribute, None) if attribute else 1
        if axis is None or not (axis >= 1 or axis == -1):
            return f"it works along axis {attribute} = {axis!r}, which may be the batch axis 0 (give an axis >= 1)"
        return None
    if getattr(type(module), "per_sample_forward", False) is True:
        return None
    return ("it is not a layer known to treat each sample on its own; if its forward (the code "
            "around its submodules) never combines different samples, declare that with the class "
            "attribute `per_sample_forward = True`")


def check_per_sample(model: nn.Module) -> None:
    """Refuses a model any of whose modules may mix samples (see PER_SAMPLE_LAYERS): allowed are
    the trainable layers of SUPPORTED_LAYERS, the parameter-free per-sample layers, containers,
    and model classes that declare ``per_sample_forward = True`` (the dpbench problems do);
    nothing with buffers (running statistics)."""
    for name, module in model.named_modules():
        reason = _mixing_reason(module)
        if reason is not None:
            raise SampleMixingError(
                f"layer {name or '<model>'!r} ({type(module).__name__}) may mix samples, which breaks the per-sample "
                f"clipping bound (the sensitivity of the clipped sum): {reason}")


def trainable_layers(model: nn.Module) -> list[nn.Module]:
    """The layers that own trainable parameters; refuses models with unsupported ones and
    models with a layer that may mix samples (``check_per_sample``)."""
    layers = []
    owner: dict[int, str] = {}  # id(parameter) -> the name under which a layer first holds it
    for name, module in model.named_modules(remove_duplicate=False):
        if not any(p.requires_grad for p in module.parameters(recurse=False)):
            continue
        if not isinstance(module, SUPPORTED_LAYERS):
            raise UnsupportedLayerError(
                f"layer {name!r} ({type(module).__name__}) has trainable parameters, but per-sample "
                f"gradients are implemented only for {', '.join(t.__name__ for t in SUPPORTED_LAYERS)}"
            )
        if any(not p.requires_grad for p in module.parameters(recurse=False)):
            raise UnsupportedLayerError(f"layer {name!r} has partly frozen parameters")
        reason = unsupported_option(module)
        if reason is not None:
            raise UnsupportedLayerError(f"layer {name!r} ({type(module).__name__}): {reason}")
        for pname, p in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            if id(p) in owner:
                raise UnsupportedLayerError(
                    f"parameter {full!r} is the same tensor as {owner[id(p)]!r} (tied weights): its per-sample "
                    "gradient sums two layers' contributions, whose squared norm is not the sum of theirs")
            owner[id(p)] = full
        layers.append(module)
    check_per_sample(model)
    return layers


class PerSampleGradients:
    """The per-sample gradients of one batch: a list of per-layer gradients."""

    def __init__(self, layers: list[LayerGrads]):
        self.layers = layers
        self.batch_size = layers[0].batch_size if layers else 0

    def sq_norms(self) -> torch.Tensor:
        return sum(layer.inner(layer) for layer in self.layers)

    def norms(self) -> torch.Tensor:
        return self.sq_norms().sqrt()

    def inner(self, other: "PerSampleGradients") -> torch.Tensor:
        return sum(a.inner(b) for a, b in zip(self.layers, other.layers))

    def weighted_sum(self, coef: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        out: dict[nn.Parameter, torch.Tensor] = {}
        for layer in self.layers:
            out.update(layer.weighted_sum(coef))
        return out


class Tape:
    """Records the inputs and outputs of every trainable layer during one forward pass.

    Usage::

        tape = Tape(model)
        with tape:
            losses = per_sample_loss(model, x, y)   # shape (B,)
        grads = tape.per_sample_gradients(losses)
    """

    def __init__(self, model: nn.Module):
        self.layers = trainable_layers(model)
        self._records: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []
        self._handles: list = []

    def _hook(self, module, inputs, output):
        self._records.append((module, inputs[0].detach(), output))

    def __enter__(self) -> "Tape":
        self._records = []
        self._handles = [m.register_forward_hook(self._hook) for m in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def per_sample_gradients(self, losses: torch.Tensor) -> PerSampleGradients:
        """Backpropagates sum(losses) to the recorded layer outputs."""
        records, self._records = self._records, []
        used = [m for m, _, _ in records]
        if len(used) != len(set(map(id, used))):
            raise UnsupportedLayerError("a trainable layer was called more than once in one forward pass")
        if len(used) != len(self.layers):
            raise UnsupportedLayerError("some trainable layers were not used in the forward pass")
        grads = torch.autograd.grad(losses.sum(), [out for _, _, out in records])
        return PerSampleGradients([LayerGrads(m, x, gy) for (m, x, _), gy in zip(records, grads)])
