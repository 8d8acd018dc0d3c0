"""What a private training step is built from, built one way for every caller.

A grid cell (``dpbench.training.train.run``) and the empirical privacy audit must run exactly the same
mechanism: the same noise multiplier for the same plan (both calibrate their claim with
``dpbench.training.calibration.calibrate``), the same clipping, the same noise source and
sampler seeded from the same streams. Both build them here:

* ``assemble``: the optimizer's ``Context`` (model, per-sample loss, lr, L, sigma, clipping,
  noise source, T, hyperparameters), the DP step ``spec.build(context)`` and the sampler that
  draws its batches, in this order (the order fixes which random numbers each piece sees).
  Private optimizers clip (normalised clipping: sensitivity 1; flat: C); the non-private
  references do not clip and add no noise.
* ``build_model``: the problem's model, initialised from the run's init stream; or, for a
  problem that starts from a public checkpoint, loaded from it with the parameters of a
  fine-tuning mode trainable (``dpbench.problems.finetune``: a new head and LoRA's adapters
  drawn from the init stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dpbench.privacy.clipping import Clipping, NoClipping
from dpbench.mechanisms.base import Plan, Sampler
from dpbench.optimizers.base import Context, DPStep, LossFn
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.problems import Problem
from dpbench.problems import finetune as finetuning
from dpbench.problems.modes import Full, Mode


def build_model(problem: Problem, init_seed: int, device: torch.device | str, checkpoint=None,
                mode: Mode | None = None) -> nn.Module:
    """The problem's model initialised from ``init_seed`` (the global torch RNG is left as it
    was), on ``device``, in training mode. With ``checkpoint`` (a loaded public start: a
    pretrained checkpoint, ``state_dict`` and ``model_dims``, or an encoder), the model loaded
    from it under ``mode`` (None: ``full``); a mode without a public start is refused."""
    if checkpoint is None and mode is not None:
        raise ValueError(f"finetune mode {mode.name!r}: no public start given; problem {problem.id} "
                         + (f"fine-tunes {problem.facts.pretrained!r}" if problem.facts.pretrained
                            else "trains from scratch"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        model = problem.build() if checkpoint is None else finetuning.from_public(problem, checkpoint, mode or Full())
    return model.to(device).train()


@dataclass
class Assembly:
    """A DP step, the sampler that feeds it and the context it was built from."""

    step: DPStep
    sampler: Sampler
    context: Context


def assemble(spec: OptimizerSpec, plan: Plan, model: nn.Module, loss_fn: LossFn, *, lr: float,
             noise_multiplier: float, clip_norm: float, normalize_clipping: bool,
             hyperparameters: dict | None, noise_seed: int, sampler_seed: int, n_train: int,
             device: torch.device | str, lanes: int = 1, groups=None, piece_size: int | None = None) -> Assembly:
    """The optimizer's step and sampler for one run. ``hyperparameters`` are the given ones
    (the spec's defaults fill in the rest; an unknown name is an error); ``noise_seed`` and
    ``sampler_seed`` are the run's "noise" and "sampler" streams (``dpbench.seeds``).
    ``lanes`` > 1 builds that many independent replicas side by side (``Context.lanes``; the
    empirical audit's trials): the model's parameters carry the lane on their first axis and
    the sampler draws ``lanes`` blocks of ``n_train`` examples. ``groups``: how a step splits a
    batch into passes (``Context.groups``), or None; ``piece_size``: the physical batch size P
    (``Context.piece_size``), or None: one piece."""
    mechanism = spec.mechanism
    clipping = Clipping(clip_norm, normalize_clipping) if spec.private else NoClipping()
    context = Context(
        model=model,
        loss_fn=loss_fn,
        lr=lr,
        expected_batch_size=plan.batch_size,
        noise_multiplier=noise_multiplier,
        clipping=clipping,
        noise=mechanism.noise(plan, noise_seed, device),
        steps=plan.steps,
        hyperparameters=spec.hyperparameters(hyperparameters),
        lanes=lanes,
        groups=groups,
        piece_size=piece_size,
    )
    step = spec.build(context)
    sampler = mechanism.sampler(plan, n_train, sampler_seed, device, lanes=lanes)
    return Assembly(step, sampler, context)
