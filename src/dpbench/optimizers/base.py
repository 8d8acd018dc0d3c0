"""The pieces every optimizer is made of, and the fixed sequence of a DP step.

A DP step is (per-sample gradients) -> (clip and sum) -> (add noise) -> (scale to the mean)
-> (update rule). ``DPStep`` runs those stages as named methods; an optimizer picks its
update rule and, only where its paper demands it, overrides one stage (DiSK the gradients,
Dice the clipped sum, D2P2 the noise). The update rule owns the optimizer state.

The clipped sum is written into one flat buffer over all parameters, allocated at the first
step and reused (``GradBuffer``): the noise is added to it and it is scaled to the mean in one
call each, where each used to take one call per parameter tensor (on a GPU, one kernel launch
each). The noise is still drawn one ``randn`` per tensor, in order, into a flat noise buffer:
one draw of d values would give other numbers (torch's normal sampler fills blocks of 16 and
redraws a tensor's tail, so a draw of a + b values is not a draw of a then b; docs/speed.md).
The tensors the clip-and-sum stage returns are views into the buffer: valid until the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import nn

from dpbench.privacy.clipping import Clipping, NoClipping
from dpbench.mechanisms.base import NoiseSource
from dpbench.privacy.per_sample import GroupedGradients, PerSampleGradients, Tape, in_rows

# (model, x, y) -> (per-sample losses (B,), per-sample correctness (B,) or None)
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class Context:
    """Everything the harness hands an optimizer when it builds one."""

    model: nn.Module
    loss_fn: LossFn
    lr: float
    expected_batch_size: int  # L
    noise_multiplier: float  # sigma
    clipping: Clipping | NoClipping
    noise: NoiseSource
    steps: int  # planned number of steps T
    hyperparameters: dict[str, Any] = field(default_factory=dict)  # defaults filled in
    # Independent replicas of the mechanism held side by side (the empirical audit runs its
    # trials this way; training uses 1): every parameter's first axis indexes the lane, and
    # a stage that computes something over the whole parameter vector (a norm, a projection)
    # computes it per lane. Element-wise stages need not care.
    lanes: int = 1
    # The task's grouping of a batch's rows into passes that cost less than one pass over all of
    # them (``Task.groups``: a token batch by length), or None: one pass. Every row's loss and
    # gradient are its own in any pass, so the groups change the cost, not the step.
    groups: Callable[[torch.Tensor], list[torch.Tensor] | None] | None = None
    # The physical batch size P: the most rows one pass takes (a logical batch of more is cut into
    # pieces of at most P rows, in row order, each piece into the task's groups), or None: one
    # piece. Performance only: a step in pieces is the same step (one sampled batch, one noise
    # draw, one update, one accountant step), up to floating-point order (``step_passes``).
    piece_size: int | None = None

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def per_lane(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors (shaped like the parameters) as one (lanes, n) matrix: row r is lane r's
        part of the flattened parameter vector."""
        return torch.cat([t.reshape(self.lanes, -1) for t in tensors], dim=1)


@dataclass
class StepOutput:
    """What one step returns to the training loop: ``losses`` (B,), the per-sample training
    losses at the parameters before the step (detached; the loop logs their mean), ``correct``
    (B,) or None, and ``stats``, the step's diagnostics (floats, by name), which the loop sums
    over the run's steps (``dpbench.training.checkpoint.Trace.record``; the run records the sums
    under ``optimizer.stats``): return per-step counts or totals, never means or maxima."""

    losses: torch.Tensor  # per-sample training losses at the parameters before the step
    correct: torch.Tensor | None
    stats: dict[str, float] = field(default_factory=dict)  # optimizer diagnostics


class UpdateRule(Protocol):
    """Turns a (privatised) mean gradient into a parameter update, in place, and owns the
    optimizer state; ``state_dict``/``load_state_dict`` make it checkpointable (the tensors it
    keeps, as they are; a resumed run must continue bit for bit).

    ``update(params, grads)``: ``params`` are the model's trainable parameters, in
    ``Context.params`` order, to be changed in place (under ``torch.no_grad``); ``grads`` are
    tensors shaped like them, the privatised mean gradient of this step, which is all a private
    rule may read (the audit replays a rule from these alone and requires bit-identical
    parameters). **The grads are views into the step's gradient buffer, which the next step
    overwrites** (``GradBuffer``): a rule that keeps them across steps (a momentum, a filter, a
    previous gradient) must keep a copy (``g.clone()``, or accumulate into a tensor of its own),
    or what it kept changes under it. A rule may return a dict of diagnostics, floats by name:
    the step puts them in ``StepOutput.stats`` and the training loop **sums them over the run's
    steps** (``optimizer.stats`` in the run record), so return counts or totals per step (e.g.
    ``floor_hits``), not means; None returns nothing."""

    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> dict[str, float] | None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class GradBuffer:
    """One flat tensor over all parameters and its views shaped like each (in parameter order,
    each view 64-byte aligned):
    the clipped sum is written into the views, noise added and the mean taken over the flat
    tensor in one call each. ``noise_views`` is a second such buffer that the noise is drawn into."""

    def __init__(self, params: list[torch.Tensor]):
        self.flat, self.views = self._allocate(params)
        self.by_param = dict(zip(params, self.views))
        self.noise_flat, self.noise_views = self._allocate(params)

    ALIGN_BYTES = 64  # where torch's CPU allocator puts every new tensor

    @classmethod
    def _allocate(cls, params) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # Each view starts 64-byte aligned, as a tensor of its own would: BLAS results written
        # into an unaligned view differ in the last bits (mm into a view at an odd offset
        # differed in 29 of 200 random shapes on this project's CPU; aligned, in none). The
        # gaps are zeros and stay zeros (noise is drawn into the views only).
        step = max(1, cls.ALIGN_BYTES // params[0].element_size())
        offsets, i = [], 0
        for p in params:
            offsets.append(i)
            i += -(-p.numel() // step) * step
        flat = torch.zeros(i, dtype=params[0].dtype, device=params[0].device)
        return flat, [flat[o:o + p.numel()].view(p.shape) for o, p in zip(offsets, params)]

    @staticmethod
    def fits(params: list[torch.Tensor]) -> bool:
        """Whether one flat tensor can hold them all (one dtype, one device)."""
        return bool(params) and len({(p.dtype, p.device) for p in params}) == 1


class StepClassFound(Exception):
    """Raised by ``DPStep.__new__`` while ``dpbench.optimizers.stages.step_class`` probes which
    class an optimizer's ``build`` makes (before any of its ``__init__`` runs)."""

    def __init__(self, cls: type):
        super().__init__(cls.__qualname__)
        self.cls = cls


_PROBING: list[bool] = [False]  # set by dpbench.optimizers.stages.step_class only


class DPStep:
    """One differentially private step, stage by stage: ``__call__`` runs
    ``per_sample_gradients`` -> ``clip_and_sum`` -> ``add_noise`` -> ``scale_to_mean`` -> the
    update rule. A subclass overrides a stage only where its paper changes it; every stage it
    overrides is recorded as the optimizer's own (``dpbench.optimizers.stages``), and the
    audit's sensitivity check holds ``clip_and_sum``'s output to the clipping's sensitivity."""

    private = True
    # Weights of the batch's rows in the clipped sum, (B,): None gives every row weight 1; a
    # padded batch (dpbench.training.capture) gives its padding rows 0.
    sample_weights: torch.Tensor | None = None

    def __new__(cls, *args, **kwargs):
        if _PROBING[0]:
            raise StepClassFound(cls)
        return super().__new__(cls)

    def __init__(self, ctx: Context, rule: UpdateRule):
        self.ctx = ctx
        self.model = ctx.model
        self.params = ctx.params
        self.rule = rule
        self.tape = Tape(ctx.model)
        self.buffer: GradBuffer | None = None  # allocated at the first clipped sum

    @property
    def noise_std(self) -> float:
        """Std of the noise added to the clipped *sum*: sigma times the sensitivity."""
        return self.ctx.noise_multiplier * self.ctx.clipping.sensitivity

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        passes = step_passes(self.ctx, x)
        if passes is not None and self._sums_by_pass():
            grads, out = self._clip_and_sum_by_pass(x, y, passes)
        else:
            psg, out = self.per_sample_gradients(x, y)
            grads = self.clip_and_sum(psg)
        grads = self.add_noise(grads)
        grads = self.scale_to_mean(grads)
        stats = self.rule.update(self.params, grads)
        if stats:
            out.stats.update(stats)
        return out

    # -- stages ------------------------------------------------------------------------------
    def per_sample_gradients(self, x, y) -> tuple[PerSampleGradients | None, StepOutput]:
        """The batch's per-sample gradients (``PerSampleGradients``, formed lazily from one
        forward and one backward pass: nothing is materialised until asked) and the step's
        output (losses, correctness); None for an empty batch (B = 0), which still releases
        noise. A replacement must keep example i's gradient a function of example i alone."""
        if x.shape[0] == 0:  # an empty Poisson batch still releases noise
            return None, StepOutput(x.new_zeros(0), None)
        groups = step_passes(self.ctx, x)
        if groups is None:
            return DPStep.pass_gradients(self, x, y)
        parts, losses, correct = [], [], []
        for idx in groups:  # one pass per group; every row's gradient is its own in any pass
            psg, out_k = DPStep.pass_gradients(self, x[idx], None if y is None else y[idx])
            parts.append(psg)
            losses.append(out_k.losses)
            correct.append(out_k.correct)
        return GroupedGradients(parts, groups, x.shape[0]), output_in_rows(losses, correct, groups)

    def pass_gradients(self, x, y) -> tuple[PerSampleGradients, StepOutput]:
        """The per-sample gradients of the rows ``x`` (B > 0) in one pass, whatever the groups
        and pieces: the form of ``per_sample_gradients`` that a step taken pass by pass
        (``_clip_and_sum_by_pass``) calls once per pass. A class that replaces
        ``per_sample_gradients`` replaces this too (DiSK), or its steps hold every pass's layer
        records at once."""
        with self.tape:
            losses, correct = self.ctx.loss_fn(self.model, x, y)
        return self.tape.per_sample_gradients(losses), StepOutput(losses.detach(), correct)

    def clip_and_sum(self, psg: PerSampleGradients | None) -> list[torch.Tensor]:
        """The release before noise: sum_i c_i g_i, shaped like the parameters, c_i the
        clipping's coefficients (``Clipping.coefficients`` of the per-sample norms over the
        *whole* parameter vector), so that one example moves it by at most the clipping's
        sensitivity s, the scale the noise is calibrated for; zeros for ``psg`` None. Written
        into the step's reused buffer (its views are returned; valid until the next step). A
        replacement is held to s by the audit's sensitivity check (``dpbench.audit.sensitivity``):
        clipping each of K layers on its own at C moves the sum by up to C sqrt(K)."""
        buffer = self._buffer()
        if psg is None:
            if buffer is None:
                return [torch.zeros_like(p) for p in self.params]
            buffer.flat.zero_()
            return buffer.views
        coef = self.ctx.clipping.coefficients(psg.norms())
        if self.sample_weights is not None:  # padded batches (training.capture): padding rows weigh 0
            coef = coef * self.sample_weights
        if buffer is None:
            summed = psg.weighted_sum(coef)
            return [summed[p] for p in self.params]
        psg.weighted_sum(coef, out=buffer.by_param)
        return buffer.views

    def sum_pass(self, psg: PerSampleGradients, first: bool) -> None:
        """Adds one pass's part of ``clip_and_sum`` into the step's buffer (``first``: writes it):
        sum_i c_i g_i over the pass's rows, c_i a function of row i's own norm, so that the passes'
        parts add up to the batch's clipped sum. The passes' parts are added in pass order,
        through the noise buffer (drawn into later). A class that replaces ``clip_and_sum``
        replaces this and ``finish_sum`` too (Dice), or its steps hold every pass at once."""
        buffer = self._buffer()
        coef = self.ctx.clipping.coefficients(psg.norms())
        if first:
            psg.weighted_sum(coef, out=buffer.by_param)
        else:
            psg.weighted_sum(coef, out=dict(zip(self.params, buffer.noise_views)))
            buffer.flat.add_(buffer.noise_flat)

    def finish_sum(self) -> list[torch.Tensor]:
        """The release before noise once every pass's part is in (``sum_pass``): the buffer's views."""
        return self._buffer().views

    def _sums_by_pass(self) -> bool:
        """Whether a batch in several passes may be clipped and summed pass by pass, each pass's
        layer records dropped as its part is in: where the buffer is there, the batch unweighted
        and, for each of ``per_sample_gradients`` and ``clip_and_sum``, the stage and its
        pass-by-pass forms (``pass_gradients``; ``sum_pass`` and ``finish_sum``) are all DPStep's,
        or, with pieces (``Context.piece_size``), all one class's (DiSK, Dice). So the forms that
        run are always those of the class whose stages the run records (``optimizers.stages``);
        a class that replaces a stage alone holds every pass (``GroupedGradients``), and without
        pieces DiSK and Dice hold their groups as they always did (the same floats as before)."""
        if self.sample_weights is not None or self._buffer() is None:
            return False
        cls = type(self)
        for names in (("per_sample_gradients", "pass_gradients"), ("clip_and_sum", "sum_pass", "finish_sum")):
            definers = {_definer(cls, name) for name in names}
            if len(definers) > 1 or (definers != {DPStep} and self.ctx.piece_size is None):
                return False
        return True

    def _clip_and_sum_by_pass(self, x, y, passes) -> tuple[list[torch.Tensor], StepOutput]:
        """``clip_and_sum(per_sample_gradients(x, y))`` with the batch in ``passes`` (pieces of at
        most ``Context.piece_size`` rows, each in the task's groups: ``step_passes``), one pass at
        a time: each pass's part is added into the buffer as the pass ends (``sum_pass``) and its
        layer records are dropped, so a step holds one pass's, as a non-private step does (the
        held form, ``GroupedGradients``, keeps every pass's until the last norm is known). The
        step's stats are its first pass's (a pass count, per logical step)."""
        losses, correct, stats = [], [], None
        for k, idx in enumerate(passes):
            psg, out_k = self.pass_gradients(x[idx], None if y is None else y[idx])
            self.sum_pass(psg, k == 0)
            del psg  # this pass's layer records go before the next pass
            losses.append(out_k.losses)
            correct.append(out_k.correct)
            stats = out_k.stats if stats is None else stats
        out = output_in_rows(losses, correct, passes)
        out.stats.update(stats)
        return self.finish_sum(), out

    def add_noise(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The clipped sum plus ``noise_std`` times the noise source's unit-variance draws (one
        per parameter tensor, in order), in place."""
        if self.noise_std == 0:
            return grads
        buffer, sample_into = self._buffer(), getattr(self.ctx.noise, "sample_into", None)
        if buffer is not None and grads is buffer.views and sample_into is not None:
            sample_into(buffer.noise_views)  # the draws sample(grads) would make, in place
            buffer.flat.add_(buffer.noise_flat, alpha=self.noise_std)
            return grads
        return [g.add_(z, alpha=self.noise_std) for g, z in zip(grads, self.ctx.noise.sample(grads))]

    def scale_to_mean(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The noisy sum divided by L, in place."""
        buffer = self._buffer()
        if buffer is not None and grads is buffer.views:
            buffer.flat.div_(self.ctx.expected_batch_size)
            return grads
        return [g.div_(self.ctx.expected_batch_size) for g in grads]

    def _buffer(self) -> GradBuffer | None:
        """The step's gradient buffer (None where the parameters do not share a dtype and device;
        subclasses that skip ``__init__``, such as the Opacus step, have none)."""
        if getattr(self, "buffer", None) is None and hasattr(self, "tape") and GradBuffer.fits(self.params):
            self.buffer = GradBuffer(self.params)
        return getattr(self, "buffer", None)

    # -- the run's privacy record ----------------------------------------------------------
    def privacy_record(self) -> dict:
        """Public facts fixed after the privacy plan (once the step saw the model, or while it
        trained), for the run's privacy record; the plan itself stays frozen. Here those of the
        noise source (``record()``, which a source may define)."""
        record = getattr(self.ctx.noise, "record", None)
        return record() if record is not None else {}

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rule": self.rule.state_dict(), "noise": self.ctx.noise.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state["rule"])
        self.ctx.noise.load_state_dict(state["noise"])


class NonPrivateStep(DPStep):
    """The non-private reference: plain autograd on sum(losses) / L, no clipping, no noise."""

    private = False

    def __init__(self, ctx: Context, rule: UpdateRule):
        self.ctx, self.model, self.params, self.rule = ctx, ctx.model, ctx.params, rule

    def __call__(self, x, y) -> StepOutput:
        if x.shape[0] == 0:
            return StepOutput(x.new_zeros(0), None)
        groups = step_passes(self.ctx, x)
        if groups is None:
            losses, correct = self.ctx.loss_fn(self.model, x, y)
            grads = torch.autograd.grad(losses.sum(), self.params)
        else:  # one pass per piece and group, as DPStep's (step_passes), the gradients added
            grads, losses, correct = None, [], []
            for idx in groups:
                losses_k, correct_k = self.ctx.loss_fn(self.model, x[idx], None if y is None else y[idx])
                more = torch.autograd.grad(losses_k.sum(), self.params)
                if grads is None:
                    grads = list(more)
                else:
                    torch._foreach_add_(grads, more)
                losses.append(losses_k.detach())
                correct.append(correct_k)
            out = output_in_rows(losses, correct, groups)
            losses, correct = out.losses, out.correct
        stats = self.rule.update(self.params, [g.div_(self.ctx.expected_batch_size) for g in grads])
        return StepOutput(losses.detach(), correct, dict(stats or {}))


def _definer(cls: type, name: str) -> type:
    """The class that defines ``name`` first in ``cls``'s method resolution order."""
    return next(k for k in cls.__mro__ if name in k.__dict__)


def pieces(ctx: Context, batch_size: int, device=None) -> list[torch.Tensor] | None:
    """A batch's pieces: row indices of at most ``ctx.piece_size`` consecutive rows each, in row
    order; None where the batch is one piece (no piece size, or B <= P)."""
    size = ctx.piece_size
    if size is None or batch_size <= size:
        return None
    return [torch.arange(start, min(start + size, batch_size), device=device)
            for start in range(0, batch_size, size)]


def step_passes(ctx: Context, x: torch.Tensor) -> list[torch.Tensor] | None:
    """The passes of a step on the rows ``x``: the batch cut into pieces (``pieces``), each piece
    into the task's groups (``Context.groups``), as row indices of ``x`` (disjoint, covering it);
    None where one pass takes the whole batch (B = 0 included). Without pieces, the task's groups
    themselves, as before pieces were."""
    if x.shape[0] == 0:
        return None
    cut = pieces(ctx, x.shape[0], x.device)
    if cut is None:
        groups = ctx.groups(x) if ctx.groups is not None else None
        return groups if groups is not None and len(groups) > 1 else None
    out = []
    for piece in cut:
        groups = ctx.groups(x[piece]) if ctx.groups is not None else None
        out.extend([piece] if groups is None or len(groups) == 1 else [piece[g] for g in groups])
    return out


def output_in_rows(losses: list[torch.Tensor], correct: list, groups: list[torch.Tensor]) -> StepOutput:
    """A step's output from its groups' passes (``losses[k]``, ``correct[k]`` those of rows
    ``groups[k]``), in the batch's row order."""
    return StepOutput(in_rows(losses, groups), None if correct[0] is None else in_rows(correct, groups))


class SGD:
    """theta <- theta - lr * g: the update rule of DP-SGD (an ``UpdateRule``; no state, so it
    keeps nothing of the grads it is handed)."""

    def __init__(self, lr: float):
        self.lr = lr

    @torch.no_grad()
    def update(self, params, grads) -> None:
        torch._foreach_add_(params, grads, alpha=-self.lr)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
