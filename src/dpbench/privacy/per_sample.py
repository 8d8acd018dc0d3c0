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

How each layer type does this is registered by type in ``dpbench.privacy.per_sample_layers``
(``Linear``, ``Conv2d``, ``ConvTranspose2d``, ``Embedding``, ``LayerNorm`` built in;
``register_per_sample`` adds a type). This module tapes a model's layers and sums over them,
after checking that no module may mix samples (``check_per_sample``; a library's classes that
never do, a BERT's layers, are declared with ``declare_per_sample``).

Only trainable parameters (``requires_grad``) get per-sample gradients: a layer whose
parameters are all frozen is not taped at all (a LoRA adapter's frozen base), and a layer with
some frozen is taped for the others (a bias-only fine-tuning's Linear: its bias), where the
layer's rule says it can (``LayerGrads.partly_frozen``; the built-in rules can).

A parameter shared by two layers (tied weights) is refused: its per-sample gradient is the sum
of the two layers' contributions, whose squared norm is not the sum of their squared norms.

This is the "book-keeping" approach of Bu et al. (2023): one forward and one backward pass,
whatever the clipping, and per-sample gradients materialised only where that is cheaper.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import nn

# LayerGrads, UnsupportedLayerError and unfold are imported from here too; importing the
# convolutions' rules registers them
from dpbench.privacy.per_sample_conv import unfold  # noqa: F401
from dpbench.privacy.per_sample_layers import (  # noqa: F401
    LAYER_GRADS, WRITES_INTO_OUT, LayerGrads, UnsupportedLayerError)


def layer_grads(module: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> LayerGrads:
    """The per-sample gradients of one layer for a batch, by the class registered for its exact type."""
    try:
        grads = LAYER_GRADS[type(module)]
    except KeyError:
        raise UnsupportedLayerError(_unregistered(type(module))) from None
    return grads(module, x, gy)


def _unregistered(layer_type: type) -> str:
    name = layer_type.__name__
    return (f"no per-sample gradients are registered for {name} (registered, by exact type: "
            f"{', '.join(t.__name__ for t in LAYER_GRADS)}); register them with "
            f"@dpbench.privacy.per_sample_layers.register_per_sample({name}) (docs/privacy.md)")


class SampleMixingError(UnsupportedLayerError):
    """The model has a layer whose forward may make one sample's output depend on others."""


# Parameter-free layers whose forward treats every sample on its own (axis 0 is the batch).
# Per-sample gradients and the clipping bound assume exactly that: per-sample loss i may
# depend on example i only. A layer that mixes samples (batch normalisation in training mode,
# with or without affine parameters or running statistics) lets one example move every other
# example's gradient, so the clipped sum's sensitivity is no longer the clipping norm (with one
# BatchNorm1d(affine=False) between two Linear layers, removing one example from a batch of 32
# moved the normalised-clipped sum by 5.5 instead of at most 1; tests/privacy/test_integrity.py).
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


DECLARED_PER_SAMPLE: dict[type[nn.Module], frozenset[str]] = {}
"""Classes of other libraries declared per-sample (``declare_per_sample``): exact type -> the names of
the constant index buffers its modules may hold."""


def declare_per_sample(module_type: type[nn.Module], constant_buffers: tuple[str, ...] = ()) -> None:
    """Declares that the forward of modules of exactly ``module_type`` (the code around their
    submodules) never combines different samples: for a library's class, which cannot carry
    ``per_sample_forward = True`` (a BERT's layers, ``dpbench.problems.encoders``). Each
    declaration is a reviewed claim about that class's forward. ``constant_buffers`` names the
    buffers it may hold that are constant integer indices, never statistics of the data (BERT's
    embeddings hold ``position_ids`` and ``token_type_ids``); any other buffer, and a floating
    one under a declared name, is still refused. Declaring the same type again with the same
    buffers is a no-op; with others, an error."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"declare_per_sample takes a torch.nn.Module subclass, got {module_type!r}")
    buffers = frozenset(constant_buffers)
    if DECLARED_PER_SAMPLE.get(module_type, buffers) != buffers:
        raise ValueError(f"{module_type.__name__} is already declared per-sample with constant buffers "
                         f"{sorted(DECLARED_PER_SAMPLE[module_type])}, not {sorted(buffers)}")
    DECLARED_PER_SAMPLE[module_type] = buffers


def _buffer_reason(module: nn.Module) -> str | None:
    """Why ``module``'s own buffers may carry batch statistics, or None: only the integer buffers
    its type declares constant (``declare_per_sample``) pass."""
    allowed = DECLARED_PER_SAMPLE.get(type(module), frozenset())
    bad = [n for n, b in module.named_buffers(recurse=False)
           if n not in allowed or b.is_floating_point() or b.is_complex()]
    if not bad:
        return None
    return (f"it has buffers ({', '.join(bad)}): statistics such as running means are computed from the whole "
            "batch (and released with the model without noise)")


def _mixing_reason(module: nn.Module) -> str | None:
    """Why ``module``'s own forward may mix samples, or None if it is known not to."""
    if any(True for _ in module.buffers(recurse=False)):
        reason = _buffer_reason(module)
        if reason is not None:
            return reason
    if type(module) in LAYER_GRADS or isinstance(module, CONTAINERS) or type(module) in DECLARED_PER_SAMPLE:
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
            "attribute `per_sample_forward = True` (a library's class: "
            "dpbench.privacy.per_sample.declare_per_sample)")


def check_per_sample(model: nn.Module) -> None:
    """Refuses a model any of whose modules may mix samples (see PER_SAMPLE_LAYERS): allowed are
    layers of a registered type (``LAYER_GRADS``), the parameter-free per-sample layers, containers,
    model classes that declare ``per_sample_forward = True`` (the dpbench problems do) and library
    classes declared with ``declare_per_sample``; nothing with buffers (running statistics) but
    the constant index buffers a declaration names."""
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
        if type(module) not in LAYER_GRADS:
            raise UnsupportedLayerError(f"layer {name!r} ({type(module).__name__}) has trainable parameters, but "
                                        + _unregistered(type(module)))
        if any(not p.requires_grad for p in module.parameters(recurse=False)) and \
                not LAYER_GRADS[type(module)].partly_frozen:
            raise UnsupportedLayerError(f"layer {name!r} has partly frozen parameters, and the per-sample rule of "
                                        f"{type(module).__name__} forms every parameter's gradients")
        reason = LAYER_GRADS[type(module)].unsupported_option(module)
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
    """The per-sample gradients of one batch, held per layer (``layers``: one ``LayerGrads``
    per trainable layer, in model order) and formed only as far as asked: ``norms()`` (B,) the
    per-sample norms over the whole parameter vector, ``sq_norms()`` their squares,
    ``inner(other)`` (B,) the per-sample inner products with another pass's,
    ``weighted_sum(coef)`` {parameter: sum_i coef_i g_i} (into ``out`` where given). The
    tensors belong to the step that made them and are valid until its next pass."""

    def __init__(self, layers: list[LayerGrads]):
        self.layers = layers
        self.batch_size = layers[0].batch_size if layers else 0

    def sq_norms(self) -> torch.Tensor:
        """Per-sample squared norms over all layers, (B,): the same floats as summing each
        layer's ``inner(self)`` in order, from few operators: every layer's norm terms
        (``LayerGrads.norm_terms``) squared in one call, each layer's weight and bias terms
        added in one call, then the layers' sums added in order (a reduction over stacked
        layers would add them in another order, and change the last bits)."""
        if not self.layers:
            raise ValueError("no layers: the per-sample norms of an empty model are undefined")
        terms = [layer.norm_terms() for layer in self.layers]
        norms = [t for layer in terms for squared, t in layer if squared]
        squares = iter(torch.stack(norms).square_().unbind(0) if len(norms) > 1 else [n.square() for n in norms])
        values = [[next(squares) if squared else t for squared, t in layer] for layer in terms]
        return functools.reduce(operator.add, (_layer_sum(v) for v in _pair_terms(values)))

    def norms(self) -> torch.Tensor:
        sq = self.sq_norms()
        # in place where sq_norms made a new tensor by adding layers (one layer's own term may be
        # a tensor its rule keeps)
        return sq.sqrt_() if len(self.layers) > 1 else sq.sqrt()

    def inner(self, other: "PerSampleGradients") -> torch.Tensor:
        return sum(a.inner(b) for a, b in zip(self.layers, other.layers))

    def weighted_sum(self, coef: torch.Tensor, out: dict | None = None) -> dict[nn.Parameter, torch.Tensor]:
        """sum_i coef_i grad_i for every parameter; written into ``out`` ({parameter: tensor
        shaped like it}) where given, which is then returned."""
        if out is None:
            summed: dict[nn.Parameter, torch.Tensor] = {}
            for layer in self.layers:
                summed.update(layer.weighted_sum(coef))
            return summed
        for layer in self.layers:
            if type(layer).weighted_sum in WRITES_INTO_OUT:
                layer.weighted_sum(coef, out)
            else:  # a plugin's rule without ``out``: its result copied in
                for p, g in layer.weighted_sum(coef).items():
                    out[p].copy_(g)
        return out


class GroupedGradients:
    """The per-sample gradients of one batch taken in several passes, one per group of its rows
    (``parts[k]`` the ``PerSampleGradients`` of rows ``index[k]``; the groups are disjoint and
    cover the batch): the same interface as ``PerSampleGradients``, every per-sample value in
    the batch's row order. Each row's gradient is its own whichever pass computed it, so this is
    the one-pass batch's, up to floating-point order (``Task.groups``: a token batch run in groups
    of similar length sheds its padding). ``weighted_sum`` adds the groups' sums in group order."""

    def __init__(self, parts: list[PerSampleGradients], index: list[torch.Tensor], batch_size: int):
        if sorted(torch.cat(index).tolist()) != list(range(batch_size)):
            raise ValueError("the groups of a batch must be disjoint and cover its rows")
        self.parts, self.index, self.batch_size = parts, index, batch_size

    @property
    def layers(self):
        raise TypeError("a batch taken in groups (Task.groups: P7 on the CPU) has one list of layers per group "
                        "(GroupedGradients.parts, rows GroupedGradients.index), not one: use norms(), sq_norms(), "
                        "inner() and weighted_sum(), which are the batch's")

    def sq_norms(self) -> torch.Tensor:
        return in_rows([part.sq_norms() for part in self.parts], self.index)

    def norms(self) -> torch.Tensor:
        return self.sq_norms().sqrt_()

    def inner(self, other: "GroupedGradients") -> torch.Tensor:
        if len(other.parts) != len(self.parts) or any(not torch.equal(a, b) for a, b in zip(self.index, other.index)):
            raise ValueError("inner products of two passes need the same groups")
        return in_rows([a.inner(b) for a, b in zip(self.parts, other.parts)], self.index)

    def weighted_sum(self, coef: torch.Tensor, out: dict | None = None) -> dict[nn.Parameter, torch.Tensor]:
        summed = self.parts[0].weighted_sum(coef[self.index[0]], out)
        for part, idx in zip(self.parts[1:], self.index[1:]):
            more = part.weighted_sum(coef[idx])
            torch._foreach_add_(list(summed.values()), [more[p] for p in summed])
        return summed


def in_rows(values: list[torch.Tensor], groups: list[torch.Tensor]) -> torch.Tensor:
    """Per-row values computed group by group (``values[k]`` those of rows ``groups[k]``), in the
    batch's row order."""
    out = values[0].new_empty((sum(len(g) for g in groups),) + tuple(values[0].shape[1:]))
    for idx, v in zip(groups, values):
        out[idx] = v
    return out


def _pair_terms(values: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Each layer's terms, the first two of every two-term layer (weight and bias) added in
    one call over those layers (elementwise: the same floats as adding them one by one)."""
    pairs = [i for i, v in enumerate(values) if len(v) == 2]
    if len(pairs) < 2:
        return values
    summed = (torch.stack([values[i][0] for i in pairs]) + torch.stack([values[i][1] for i in pairs])).unbind(0)
    out = list(values)
    for i, s in zip(pairs, summed):
        out[i] = [s]
    return out


def _layer_sum(values: list[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(operator.add, values)


def _keep_part(parts: dict, module: nn.Module, part, gy: torch.Tensor) -> None:
    """A tensor hook: record ``part(gy)`` as ``module``'s kept output gradient (gy unchanged)."""
    parts[module] = part(gy)


class Tape:
    """Records the inputs and outputs of every trainable layer during one forward pass.

    Usage::

        tape = Tape(model)
        with tape:
            losses = per_sample_loss(model, x, y)   # shape (B,)
        grads = tape.per_sample_gradients(losses)

    A layer whose rule keeps only part of its output gradient (``LayerGrads.output_grad_part``: a
    bias-only layer, its sum over positions) gets a tensor hook on its output in the forward pass
    and keeps nothing else: neither its input (``reads_input``) nor its output, which the backward
    pass may then free as a non-private one does, and autograd is asked for the layer's trained
    parameters rather than its output, so its whole gy is never captured.
    """

    def __init__(self, model: nn.Module):
        self.layers = trainable_layers(model)
        self._reads_input = {m: LAYER_GRADS[type(m)].reads_input(m) for m in self.layers}
        self._part = {m: LAYER_GRADS[type(m)].output_grad_part(m) for m in self.layers}
        self._records: list[tuple[nn.Module, torch.Tensor, torch.Tensor | None]] = []
        self._parts: dict[nn.Module, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, module, inputs, output):
        # .data: the input outside autograd, as detach() gives it, without dispatching an operator
        x = inputs[0].data
        if not self._reads_input[module]:  # its rule needs gy alone: x is not kept past the forward pass
            x = x.new_empty((x.shape[0], 0))
        part = self._part[module]
        if part is not None and output.requires_grad:  # its part of gy comes from the hook; output not kept
            output.register_hook(functools.partial(_keep_part, self._parts, module, part))
            output = None
        self._records.append((module, x, output))

    def __enter__(self) -> "Tape":
        self._records, self._parts = [], {}
        self._handles = [m.register_forward_hook(self._hook) for m in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def per_sample_gradients(self, losses: torch.Tensor) -> PerSampleGradients:
        """Backpropagates sum(losses) to the recorded layer outputs (and to the trained parameters
        of the layers that keep part of gy, whose hooks take it on the way)."""
        records, self._records = self._records, []
        parts, self._parts = self._parts, {}
        used = [m for m, _, _ in records]
        if len(used) != len(set(map(id, used))):
            raise UnsupportedLayerError("a trainable layer was called more than once in one forward pass")
        if len(used) != len(self.layers):
            raise UnsupportedLayerError("some trainable layers were not used in the forward pass")
        wanted, own = [], {}
        for m, _, out in records:
            if out is None:
                own[m] = [p for p in m.parameters(recurse=False) if p.requires_grad]
                wanted.extend(own[m])
            else:
                wanted.append(out)
        grads = iter(torch.autograd.grad(losses.sum(), wanted))
        layers = []
        for m, x, out in records:
            if out is None:
                for _ in own[m]:  # the parameters' summed gradients: not used
                    next(grads)
                layers.append(layer_grads(m, x, parts.pop(m)))
            else:
                layers.append(layer_grads(m, x, next(grads)))
        return PerSampleGradients(layers)
