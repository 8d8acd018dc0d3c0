"""Per-sample gradients of each layer type, one class per type, registered by type.

A layer's per-sample gradients for a batch are formed from what one forward and one backward
pass leave: its input x and its output gradient gy (both batch-first). ``LAYER_GRADS`` maps a
layer type to the ``LayerGrads`` class that forms them; ``register_per_sample`` adds one, so a
model with a new layer type needs no change here (Opacus's ``register_grad_sampler``, in
dpbench's form). A rule is looked up by the layer's exact type: a subclass of a registered type
is refused until it is registered itself, since its forward may differ from its parent's (and a
gradient formula is only right for the forward it was derived from). Registering a type also
declares that its forward treats each sample on its own (``per_sample.check_per_sample`` then
accepts it; a layer with buffers is still refused).

The simplest rule is a function that materialises every parameter's per-sample gradients::

    @register_per_sample(Scale)            # y = x * scale, scale of shape (d,)
    def scale_grads(module, x, gy):
        return {module.scale: (x * gy).reshape(len(x), -1, x.shape[-1]).sum(1)}

A class (a ``LayerGrads`` subclass) may do better; the built-in layers, with x and gy at
positions p (tokens of a sequence, pixels of an image):

* ``nn.Linear`` on (B, ..., d_in) inputs: ``grad_i = sum_p gy_p^T x_p``, i.e. ``G_i^T A_i``
  with A = x, G = gy (``FactorGrads``): squared norms either from the materialised per-sample
  weight gradients or, where a layer has few positions, from the "ghost" identity
  ``||sum_p G_p^T A_p||^2 = sum_{p,q} (A_p . A_q)(G_p . G_q)`` (Li et al., 2022); any
  weighted sum ``sum_i c_i grad_i`` (clipping is such a sum) as one native weight-gradient
  call on ``c * gy``;
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
"""

from __future__ import annotations

import functools
import math
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class UnsupportedLayerError(TypeError):
    """The model has trainable parameters in a layer whose per-sample gradients we cannot form."""


class LayerGrads:
    """One layer's per-sample gradients for a batch, held as (input x, output gradient gy).

    This base class materialises them: a subclass gives ``per_sample``, {parameter: (B,
    *parameter.shape)} over the layer's own parameters, and may refuse options of its layer
    type (``unsupported_option``) or override ``inner`` and ``weighted_sum`` with cheaper forms
    (``FactorGrads``)."""

    partly_frozen = False  # True: forms the trainable parameters' only (a partly frozen layer is accepted)

    def __init__(self, module: nn.Module, x: torch.Tensor, gy: torch.Tensor):
        reason = self.unsupported_option(module)
        if reason is not None:
            raise UnsupportedLayerError(f"{module}: {reason}")
        self.module, self.x, self.gy = module, x, gy
        self.batch_size = x.shape[0]

    @staticmethod
    def unsupported_option(module: nn.Module) -> str | None:
        """Why the options of this layer put it beyond its rule, or None."""
        return None

    @staticmethod
    def reads_input(module: nn.Module) -> bool:
        """Whether the rule reads the layer's input x (True: the tape keeps it until the step is
        done). A rule whose trained parameters' gradients are the output gradient's alone (a bias
        under a frozen weight) says False, and the tape keeps a (B, 0) stand-in instead: a
        bias-only fine-tuning then holds no layer's input past the forward pass, as a non-private
        backward would not."""
        return True

    @staticmethod
    def output_grad_part(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the rule keeps of the layer's output gradient, as a function of it applied when the
        backward pass reaches the layer (its result is the rule's ``gy``); None: the whole of gy,
        captured at the end of the pass. A bias-only rule keeps gy summed over positions,
        (B, *bias): its per-sample bias gradients, the same floats it would form later from the
        whole gy, which is then not held until the last layer's norm is known."""
        return None

    @cached_property
    def per_sample(self) -> dict[nn.Parameter, torch.Tensor]:
        """Per-sample gradients of each of the layer's parameters, (B, *parameter.shape)."""
        raise NotImplementedError(f"{type(self).__name__} does not give per_sample")

    @property
    def use_ghost(self) -> bool:
        """Whether norms and inner products come from the ghost identity, for layers that have
        one (tests and profiles force either path by replacing this property on LayerGrads)."""
        return self.ghost_is_cheaper()

    def ghost_is_cheaper(self) -> bool:
        return False

    def inner(self, other: "LayerGrads") -> torch.Tensor:
        """Per-sample inner products <grad_i, other_grad_i> over this layer's parameters, (B,)."""
        total = None
        for p, g in self.per_sample.items():
            w = _rowwise_dot(g, other.per_sample[p])
            total = w if total is None else total + w
        return total

    def norm_terms(self) -> list[tuple[bool, torch.Tensor]]:
        """The per-sample squared norm ``inner(self)`` as terms (B,) to be added in order:
        (True, t) stands for t squared (t a norm), (False, t) for t itself. Every layer's norms
        are squared in one call over all layers (``PerSampleGradients.sq_norms``), with the
        same floats as ``inner(self)``. A subclass that overrides ``inner`` gets that as one term."""
        if type(self).inner is not LayerGrads.inner:
            return [(False, self.inner(self))]
        return [(True, _rowwise_norm(g)) for g in self.per_sample.values()]

    def weighted_sum(self, coef: torch.Tensor, out: dict | None = None) -> dict[nn.Parameter, torch.Tensor]:
        """sum_i coef_i * grad_i, shaped like the parameters; written into ``out[p]`` (tensors
        shaped like the parameters) where ``out`` is given, which is returned then."""
        if out is None:
            return {p: torch.tensordot(coef, g, dims=1) for p, g in self.per_sample.items()}
        for p, g in self.per_sample.items():
            torch.tensordot(coef, g, dims=1, out=out[p])
        return out


def _rowwise_norm(a: torch.Tensor) -> torch.Tensor:
    """The norm over all but the first axis, (B,): a norm reduction (8x faster than multiplying
    and summing on 2 CPU threads). A contiguous tensor is reduced over its trailing axes
    directly, which is the flattened reduction without a flatten call (the same floats)."""
    if a.dim() == 2 or a.is_contiguous():
        return torch.linalg.vector_norm(a, dim=tuple(range(1, a.dim())))
    return torch.linalg.vector_norm(a.flatten(1), dim=1)


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum over all but the first axis of a * b, (B,), without a B x n temporary."""
    if a is b:
        return _rowwise_norm(a).square()
    return torch.einsum("bi,bi->b", a.flatten(1), b.flatten(1))


def _features(t: torch.Tensor) -> int:
    """Elements per sample (shape arithmetic: ``t[0].numel()`` would dispatch an operator)."""
    return math.prod(t.shape[1:])


# weighted_sum methods that take ``out``: a plugin's LayerGrads subclass may override
# weighted_sum without it (PerSampleGradients then copies its result into the buffer)
WRITES_INTO_OUT: set = {LayerGrads.weighted_sum}


LAYER_GRADS: dict[type[nn.Module], type[LayerGrads]] = {}
"""The registry: layer type -> the LayerGrads class that forms its per-sample gradients (looked
up by the layer's exact type; filled by ``register_per_sample``)."""

PerSampleFunction = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[nn.Parameter, torch.Tensor]]


def register_per_sample(layer_type: type[nn.Module]):
    """Decorator: form the per-sample gradients of layers of exactly ``layer_type`` with the
    decorated ``LayerGrads`` subclass, or with the decorated function ``(module, x, gy) ->
    {parameter: per-sample gradients (B, *parameter.shape)}`` for every trainable parameter of
    the module itself (x and gy batch-first). A type registers once."""
    if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
        raise TypeError(f"register_per_sample takes a torch.nn.Module subclass, got {layer_type!r}")
    if layer_type in LAYER_GRADS:
        raise ValueError(f"per-sample gradients of {layer_type.__name__} are already registered "
                         f"({LAYER_GRADS[layer_type].__qualname__})")

    def register(rule):
        if isinstance(rule, type) and issubclass(rule, LayerGrads):
            LAYER_GRADS[layer_type] = rule
        elif callable(rule) and not isinstance(rule, type):
            LAYER_GRADS[layer_type] = type(f"{layer_type.__name__}Grads", (_FunctionGrads,),
                                           {"function": staticmethod(rule), "__module__": rule.__module__})
        else:
            raise TypeError(f"register_per_sample({layer_type.__name__}) decorates a LayerGrads subclass or a "
                            f"function (module, x, gy) -> {{parameter: per-sample gradients}}, got {rule!r}")
        return rule

    return register


class _FunctionGrads(LayerGrads):
    """The per-sample gradients of a layer registered with a function, checked for shape."""

    function: PerSampleFunction

    @cached_property
    def per_sample(self) -> dict[nn.Parameter, torch.Tensor]:
        grads = self.function(self.module, self.x, self.gy)
        name, layer = getattr(self.function, "__qualname__", repr(self.function)), type(self.module).__name__
        own = [p for p in self.module.parameters(recurse=False) if p.requires_grad]
        if not isinstance(grads, dict) or set(map(id, grads)) != set(map(id, own)):
            raise UnsupportedLayerError(f"{name} (per-sample gradients of {layer}) must return a dict over the "
                                        f"layer's {len(own)} trainable parameters")
        for p, g in grads.items():
            if tuple(g.shape) != (self.batch_size, *p.shape):
                raise UnsupportedLayerError(f"{name} (per-sample gradients of {layer}) returned shape "
                                            f"{tuple(g.shape)} for a parameter of shape {tuple(p.shape)}; expected "
                                            f"{(self.batch_size, *p.shape)} (the batch first)")
        return grads


class FactorGrads(LayerGrads):
    """A layer whose per-sample weight gradient is ``G_i^T A_i`` (A: (B, P, da) inputs, G: (B, P, dg) output
    gradients at its P positions) plus an optional bias: norms and inner products by the ghost identity where
    that is cheaper, a weighted sum as one native call. A subclass gives ``factors``, ``_positions`` and
    ``_native_weighted_sum``. A frozen weight or bias gets nothing (a frozen weight: the base class's forms)."""
    partly_frozen = True

    @staticmethod
    def reads_input(module: nn.Module) -> bool:
        return module.weight.requires_grad  # a frozen weight: the bias's gradient is gy summed over positions

    @cached_property
    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, G)."""
        raise NotImplementedError

    @property
    def _positions(self) -> int:
        raise NotImplementedError

    def ghost_is_cheaper(self) -> bool:
        # Ghost norms cost ~P^2 (da + dg) per sample, materialising ~P da dg (and da dg memory),
        # with dg = weight.shape[0] and da = weight[0].numel().
        P, w = self._positions, self.module.weight
        return P == 1 or P * (w.shape[0] + _features(w)) < w.numel()

    @cached_property
    def materialised(self) -> torch.Tensor:
        """Per-sample weight gradients, (B, *weight.shape)."""
        return self._materialise()

    def _materialise(self) -> torch.Tensor:
        # one batched GEMM of the factors, G_i^T A_i
        A, G = self.factors
        w = torch.bmm(G.transpose(1, 2), A)
        shape = (self.batch_size, *self.module.weight.shape)
        return w if w.shape == shape else w.view(shape)

    @cached_property
    def bias(self) -> torch.Tensor | None:
        """Per-sample bias gradients, (B, *bias.shape): gy summed over positions (None: no bias or frozen)."""
        if getattr(self.module, "bias", None) is None or not self.module.bias.requires_grad:
            return None
        return _sum_over_positions(self.module, self.gy)

    @cached_property
    def per_sample(self) -> dict[nn.Parameter, torch.Tensor]:
        out = {self.module.weight: self.materialised} if self.module.weight.requires_grad else {}
        if self.bias is not None:
            out[self.module.bias] = self.bias
        return out

    def _ghost_inner(self, other: "FactorGrads") -> torch.Tensor:
        """sum_{p,q} (A_p . A'_q)(G_p . G'_q) per sample, (B,)."""
        one, one2 = self._single_position(), other._single_position()
        if one is not None and one2 is not None:
            (a, g), (a2, g2) = one, one2
            return (a * a2).sum(1) * (g * g2).sum(1)
        (A, G), (A2, G2) = self.factors, other.factors
        return (torch.bmm(A, A2.transpose(1, 2)) * torch.bmm(G, G2.transpose(1, 2))).sum((1, 2))

    def _single_position(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A[:, 0], G[:, 0]) of a layer with one position (else None): x and gy themselves where
        they are (B, d) already (the same values, without reshape and select operators)."""
        if self._positions != 1:
            return None
        if self.x.dim() == 2 and self.gy.dim() == 2 and type(self).factors is LinearGrads.factors:
            return self.x, self.gy
        A, G = self.factors
        return A[:, 0], G[:, 0]

    def inner(self, other: "FactorGrads") -> torch.Tensor:
        if not self.module.weight.requires_grad:
            return super().inner(other)
        if self.use_ghost:
            w = self._ghost_inner(other)
        else:
            w = _rowwise_dot(self.materialised, other.materialised)
        if self.bias is not None:
            w = w + _rowwise_dot(self.bias, other.bias)
        return w

    def norm_terms(self) -> list[tuple[bool, torch.Tensor]]:
        if type(self).inner is not FactorGrads.inner or not self.module.weight.requires_grad:
            return [(False, self.inner(self))]
        terms = [(False, self._ghost_inner(self)) if self.use_ghost else (True, _rowwise_norm(self.materialised))]
        if self.bias is not None:
            terms.append((True, _rowwise_norm(self.bias)))
        return terms

    def _native_weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        """sum_i coef_i G_i^T A_i without the per-sample gradients."""
        raise NotImplementedError

    def _native_weighted_sum_into(self, coef: torch.Tensor, out: torch.Tensor) -> None:
        """``_native_weighted_sum`` written into ``out`` (shaped like the weight)."""
        out.copy_(self._native_weighted_sum(coef).view(out.shape))

    def weighted_sum(self, coef: torch.Tensor, out: dict | None = None) -> dict[nn.Parameter, torch.Tensor]:
        m = self.module
        if not m.weight.requires_grad:
            return super().weighted_sum(coef, out)
        if out is None:
            if "materialised" in self.__dict__:  # formed for the norms already: one contraction
                w = torch.tensordot(coef, self.materialised, dims=1)
            else:
                w = self._native_weighted_sum(coef)
            out = {m.weight: w if w.shape == m.weight.shape else w.reshape(m.weight.shape)}
            if self.bias is not None:
                out[m.bias] = torch.tensordot(coef, self.bias, dims=1)
            return out
        if "materialised" in self.__dict__:
            torch.tensordot(coef, self.materialised, dims=1, out=out[m.weight])
        else:
            self._native_weighted_sum_into(coef, out[m.weight])
        if self.bias is not None:
            torch.tensordot(coef, self.bias, dims=1, out=out[m.bias])
        return out


WRITES_INTO_OUT.add(FactorGrads.weighted_sum)


def _sum_over_positions(module: nn.Module, gy: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a layer applied along the last dims: gy summed over positions
    (gy itself where it has one position: a sum of one term is that term)."""
    n = module.bias.dim()
    if gy.dim() == n + 1:
        return gy
    if gy.dim() == n + 2:
        return gy.sum(1)
    return gy.reshape(gy.shape[0], -1, *module.bias.shape).sum(1)


@register_per_sample(nn.Linear)
class LinearGrads(FactorGrads):
    """``nn.Linear`` on (B, ..., d_in): A = x, G = gy at each of the P positions."""

    @staticmethod
    def output_grad_part(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None if module.weight.requires_grad else functools.partial(_sum_over_positions, module)

    @cached_property
    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, gy, B = self.x, self.gy, self.batch_size
        if x.dim() == 3:  # (B, P, d) already
            return x, gy
        return x.reshape(B, -1, x.shape[-1]), gy.reshape(B, -1, gy.shape[-1])

    @property
    def _positions(self) -> int:
        return _features(self.x) // self.x.shape[-1]

    def _native_operands(self, coef: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum_i coef_i G_i^T A_i as one matrix product: its two operands)."""
        if self.x.dim() == 2:  # one position: the same products without the (B, 1, d) round trip
            return (self.gy * coef.view(-1, 1)).t(), self.x
        A, G = self.factors
        B, P, dg = G.shape
        return (G * coef.view(B, 1, 1)).reshape(B * P, dg).t(), A.reshape(B * P, -1)

    def _native_weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        return torch.mm(*self._native_operands(coef))

    def _native_weighted_sum_into(self, coef: torch.Tensor, out: torch.Tensor) -> None:
        torch.mm(*self._native_operands(coef), out=out)


# nn.Embedding options refused: max_norm (rows renormalised in place), scale_grad_by_freq (mixes samples), sparse
_EMBEDDING_OPTIONS = {"max_norm": None, "scale_grad_by_freq": False, "sparse": False}


@register_per_sample(nn.Embedding)
class EmbeddingGrads(FactorGrads):
    """``nn.Embedding``: A = onehot(idx), never formed (the indices (B, P) stand for it)."""

    @staticmethod
    def unsupported_option(module: nn.Module) -> str | None:
        for option, value in _EMBEDDING_OPTIONS.items():
            if getattr(module, option) != value:
                return f"option {option}={getattr(module, option)!r} is not supported (only {option}={value!r})"
        return None

    @cached_property
    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx, G = self.x.reshape(self.batch_size, -1), self.gy.reshape(self.batch_size, -1, self.gy.shape[-1])
        if self.module.padding_idx is not None:  # that row gets no gradient (a BERT's word embeddings)
            G = G * (idx != self.module.padding_idx).unsqueeze(-1).to(G.dtype)
        return idx, G

    @property
    def _positions(self) -> int:
        return _features(self.x)

    def ghost_is_cheaper(self) -> bool:
        # ghost ~P^2 d per sample; materialising: a scatter of P rows into V zero rows, ~(V + P) d
        P = self._positions
        return P * P < self.module.num_embeddings + P

    def _materialise(self) -> torch.Tensor:
        # row idx_p of sample i gets gy_p: one scatter-add into B stacked copies of the table
        B, (V, d) = self.batch_size, self.module.weight.shape
        idx, G = self.factors
        rows = (idx + torch.arange(0, B * V, V, device=idx.device).unsqueeze(1)).reshape(-1)
        return G.new_zeros(B * V, d).index_add_(0, rows, G.reshape(-1, d)).view(B, V, d)

    def _ghost_inner(self, other: "EmbeddingGrads") -> torch.Tensor:
        (A, G), (A2, G2) = self.factors, other.factors
        same = (A.unsqueeze(2) == A2.unsqueeze(1)).to(self.gy.dtype)  # one-hot rows: equal indices
        return (same * torch.bmm(G, G2.transpose(1, 2))).sum((1, 2))

    def _native_weighted_sum(self, coef: torch.Tensor) -> torch.Tensor:
        return self._native_weighted_sum_into(coef, self.gy.new_zeros(self.module.weight.shape))

    def _native_weighted_sum_into(self, coef: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        idx, G = self.factors
        return out.zero_().index_add_(0, idx.reshape(-1), (G * coef.view(-1, 1, 1)).flatten(0, 1))


@register_per_sample(nn.LayerNorm)
class LayerNormGrads(LayerGrads):
    """Affine ``nn.LayerNorm``: weight and bias gradients materialised (each one output row), if trained."""
    partly_frozen = True

    @staticmethod
    def reads_input(module: nn.Module) -> bool:
        return module.weight.requires_grad  # a frozen weight: the bias's gradient is gy summed over positions

    @staticmethod
    def output_grad_part(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None if module.weight.requires_grad else functools.partial(_sum_over_positions, module)

    @cached_property
    def per_sample(self) -> dict[nn.Parameter, torch.Tensor]:
        m, x, gy, B = self.module, self.x, self.gy, self.batch_size
        out = {} if m.bias is None or not m.bias.requires_grad else {m.bias: _sum_over_positions(m, gy)}
        if not m.weight.requires_grad:
            return out
        n = m.weight.numel()
        xhat = F.layer_norm(x, m.normalized_shape, None, None, m.eps)
        # sum over positions p of gy_p * x^_p, as a batched contraction (no (B, P, d) temporary)
        g3 = gy
        if gy.dim() != 3 or gy.shape[-1] != n:
            g3, xhat = gy.reshape(B, -1, n), xhat.reshape(B, -1, n)
        weight = torch.einsum("bpk,bpk->bk", g3, xhat)
        return {m.weight: weight if m.weight.dim() == 1 else weight.view(B, *m.weight.shape), **out}
