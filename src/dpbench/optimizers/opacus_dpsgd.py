"""DP-SGD computed by Opacus: a peer implementation of ``dpsgd`` (Abadi et al. 2016) on the
same batches, sigma and noise stream, to check ours against a professional implementation
(Gong, Pavliv & Peng, "Evaluating Differentially Private SGD Optimizers for Training
Transformer Language Models", compare a hand-written DP-SGD with Opacus's; Yousefpour et al.
2021, "Opacus: User-Friendly Differential Privacy Library in PyTorch", arXiv:2109.12298).

Per-sample gradients come from Opacus's ``GradSampleModule`` (its per-layer grad samplers,
hooks on the model's layers); the clipped sum, the noise and the 1/L averaging from its
``DPOptimizer`` (``clip_and_accumulate``, ``add_noise``, ``scale_grad``). Only the batches
(our Poisson sampler), sigma (our accountant, through the spec's mechanism, exactly as for
``dpsgd``) and the noise generator (the run's noise stream) are ours. Opacus computes, with
max_grad_norm C, noise_multiplier sigma and expected_batch_size L::

    S = sum_i g_i min(1, C / (||g_i|| + 1e-6)),     g = (S + N(0, (sigma C)^2 I)) / L

(the 1e-6 is Opacus's; it only shrinks the clip factor, so every clipped vector still has norm
< C). That is our flat clipping (``Clipping(C, normalize=False)``, sensitivity C) exactly. Under
normalised clipping (sensitivity 1, ``dpbench.privacy.clipping``) our clipped vectors are
Opacus's divided by C, so this step multiplies Opacus's gradient by u = s / C (s the
sensitivity: u = 1/C normalised, 1 flat): the clipped sum becomes ours, the noise std becomes
sigma C u = sigma s, the privatised mean gradient ((S + N(0, (sigma s)^2 I)) / L) and the
update are ours. The privacy guarantee is unchanged by a post-processing scale.

* L is the *expected* batch size of the plan, never the realised one (Opacus's DPOptimizer
  divides by ``expected_batch_size``); an empty Poisson batch still releases noise (Opacus's
  empty-batch path: zero per-sample gradients, then ``add_noise``).
* The noise comes from Opacus's ``_generate_noise`` with ``generator`` = the run's noise
  generator (``GaussianNoise.generator``, on the run's device), so runs are reproducible and
  checkpoint with the noise source. ``secure_mode`` is off, as for ``dpsgd`` (neither defends
  against floating-point attacks on the Gaussian sampler, Mironov 2012).
* ``GradSampleModule`` is built with ``strict=True``: a layer Opacus refuses (a trainable
  layer with buffers, e.g. BatchNorm; or one its ``ModuleValidator`` rejects) is an
  ``UnsupportedLayerError`` naming it. Layers without an Opacus grad sampler are computed by
  its functorch fallback; they are named in the run's privacy record
  (``opacus_functorch_layers``).
* Opacus's hooks are enabled only inside the step's own forward and backward pass: any other
  pass through the model (evaluation, a memorisation test) records no activations.
* A logical batch in pieces (``Context.piece_size``, the run setting ``physical_batch_size``) runs
  one forward and backward pass per piece, each piece's clipped sum added into Opacus's
  ``summed_grad`` by ``clip_and_accumulate`` and its ``grad_sample`` dropped, then one
  ``add_noise`` and one ``scale_grad``: the step Opacus's ``BatchMemoryManager`` takes, with
  one noise draw and one accountant step per logical batch.
* Lanes (``Context.lanes`` > 1, the empirical audit's replicas) need nothing of Opacus: an
  example's loss depends on its own lane's parameters only, so its per-sample gradient is zero
  outside that lane, its norm over the whole vector is its lane's norm, and Opacus's clipping is
  per lane; the noise is element-wise.
"""

from __future__ import annotations

import warnings

import torch

from dpbench.optimizers.base import SGD, Context, DPStep, StepOutput, output_in_rows, pieces
from dpbench.privacy.clipping import Clipping
from dpbench.mechanisms.noise import GaussianNoise
from dpbench.privacy.per_sample import UnsupportedLayerError


# Opacus is imported where a step is built, not with the registry: importing it configures the
# root logger (opacus.utils.module_utils calls logging.basicConfig), which would make every
# process that lists the optimizers (the workflow itself) print each log line twice.


def wrap(model: torch.nn.Module):
    """Opacus's ``GradSampleModule`` around ``model`` (hooks on its layers, summed losses), or
    an ``UnsupportedLayerError`` naming every layer Opacus refuses."""
    from opacus.grad_sample import GradSampleModule
    from opacus.utils.module_utils import trainable_modules
    from opacus.validators import ModuleValidator

    # ModuleValidator.validate's checks, layer by layer, so that each refusal names its layer
    refused = [] if model.training else ["the model must be in training mode"]
    for name, module in trainable_modules(model):
        check = ModuleValidator.VALIDATORS.get(type(module))
        refused += [f"layer {name!r} ({type(module).__name__}): {e}" for e in (check(module) if check else [])]
    if not refused:
        try:
            return GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
        except NotImplementedError as e:  # strict validation: a list of errors, one per layer
            refused = [str(x) for x in (e.args[0] if e.args and isinstance(e.args[0], list) else [e])]
    raise UnsupportedLayerError("opacus-dpsgd: Opacus cannot compute per-sample gradients of this model: "
                                + "; ".join(refused))


def functorch_layers(model: torch.nn.Module) -> list[str]:
    """The names of trainable layers that Opacus has no grad sampler for (its functorch fallback)."""
    from opacus.grad_sample import GradSampleModule

    return sorted(name or type(model).__name__ for name, m in model.named_modules()
                  if any(p.requires_grad for p in m.parameters(recurse=False))
                  and type(m) not in GradSampleModule.GRAD_SAMPLERS)


class OpacusDPStep(DPStep):
    """DP-SGD's step with Opacus's per-sample gradients, clipping, noise and averaging."""

    def __init__(self, ctx: Context, rule):
        if not isinstance(ctx.clipping, Clipping):
            raise TypeError(f"opacus-dpsgd is private: it needs a Clipping, got {ctx.clipping!r}")
        if not isinstance(ctx.noise, GaussianNoise):
            raise TypeError(f"opacus-dpsgd adds i.i.d. noise from the run's GaussianNoise generator, "
                            f"got {type(ctx.noise).__name__}")
        self.ctx, self.model, self.params, self.rule = ctx, ctx.model, ctx.params, rule
        self.functorch_layers = functorch_layers(ctx.model)
        self.gsm = wrap(ctx.model)
        self.gsm.disable_hooks()  # on only inside this step: other passes (evaluation) record nothing
        from opacus.optimizers import DPOptimizer

        # the DPOptimizer needs an optimizer to wrap; the update itself is ``rule`` (on p.grad)
        self.optimizer = DPOptimizer(
            torch.optim.SGD(self.params, lr=ctx.lr), noise_multiplier=ctx.noise_multiplier,
            max_grad_norm=ctx.clipping.clip_norm, expected_batch_size=ctx.expected_batch_size,
            loss_reduction="mean", generator=ctx.noise.generator, secure_mode=False)
        # Opacus's gradient times u = s / C is ours (module docstring)
        self.scale = ctx.clipping.sensitivity / ctx.clipping.clip_norm

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        cut = pieces(self.ctx, x.shape[0], x.device)
        if cut is None:
            _, out = self.per_sample_gradients(x, y)
            self.optimizer.clip_and_accumulate()
        else:  # a logical batch in pieces: each piece's clipped sum into summed_grad, then one noise draw
            self.optimizer.zero_grad(set_to_none=True)
            losses, correct = [], []
            for idx in cut:
                out_k = self._backward(x[idx], None if y is None else y[idx])
                self.optimizer.clip_and_accumulate()  # adds into p.summed_grad
                for p in self.params:  # this piece's per-sample gradients go before the next piece's
                    p.grad_sample, p.grad = None, None
                losses.append(out_k.losses)
                correct.append(out_k.correct)
            for p in self.params:  # one accumulated iteration for scale_grad (it divides by L times their count)
                p.grad_sample = p.new_zeros((0, *p.shape))
            out = output_in_rows(losses, correct, cut)
        self.optimizer.add_noise()
        self.optimizer.scale_grad()
        grads = [p.grad.detach() * self.scale for p in self.params]
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.rule.update(self.params, grads)
        if stats:
            out.stats.update(stats)
        return out

    # -- stages ------------------------------------------------------------------------------
    def per_sample_gradients(self, x, y) -> tuple[None, StepOutput]:
        """Opacus's per-sample gradients into ``p.grad_sample`` (B, *p.shape)."""
        self.optimizer.zero_grad(set_to_none=True)
        if x.shape[0] == 0:  # an empty Poisson batch still releases noise
            for p in self.params:
                p.grad_sample = p.new_zeros((0, *p.shape))
            return None, StepOutput(x.new_zeros(0), None)
        return None, self._backward(x, y)

    def _backward(self, x, y) -> StepOutput:
        """One forward and backward pass of Opacus's hooks on the rows ``x`` (B > 0), its
        per-sample gradients into ``p.grad_sample``; ``summed_grad`` is left as it is."""
        self.gsm.enable_hooks()
        try:
            losses, correct = self.ctx.loss_fn(self.gsm, x, y)
            with warnings.catch_warnings():  # the first layer's input needs no gradient: expected
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                losses.sum().backward()
        finally:
            self.gsm.disable_hooks()
        return StepOutput(losses.detach(), correct)

    def clip_and_sum(self, psg=None) -> list[torch.Tensor]:
        """Opacus's clipped sum (``clip_and_accumulate``) on our clipping's scale: sum_i c_i g_i."""
        self.optimizer.clip_and_accumulate()
        return [p.summed_grad.detach() * self.scale for p in self.params]

    def privacy_record(self) -> dict:
        return {**super().privacy_record(), "opacus_functorch_layers": self.functorch_layers}


def opacus_dpsgd(ctx: Context) -> OpacusDPStep:
    return OpacusDPStep(ctx, SGD(ctx.lr))
