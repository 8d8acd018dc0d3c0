"""Mutants: real mechanisms with one known privacy bug each, for ``dpbench audit --self-test``.

Each mutant is an ``OptimizerSpec`` derived from a registered one by wrapping one piece
(noise source, clipping, accounting, sampler); everything else is the harness's own code.
They live here, in the audit package, and nothing in training imports this module: no run
can select them. The audit must flag every one of them (and none of the unmodified
mechanisms); the expected detection rates below are the simulated ones at eps* = 2.

* ``noise-over-sqrt-T`` (dpmatrix-me): the correlated noise divided by sqrt(T), which is what
  decoding with a weighted workload Lambda_tau A C^-1 gives before the last step (the thesis
  code's lambda variants did this). Caught by the matrix statistic.
* ``no-clipping`` (dpsgd): per-sample gradients enter the sum unclipped while the noise is
  calibrated for sensitivity 1 (canary norm M = 10 C).
* ``half-sample-rate`` (dpsgd): sigma calibrated (and the claim accounted) for q/2 while the
  sampler draws at q; true epsilon about twice the claim. The weakest mutant (85% at R = 2000).
* ``reused-noise`` (dpsgd): the same noise draw added at every step. The likelihood ratio
  misses it; S_diff (out-trial releases become constant) catches it.
* ``rate-L-over-N`` (dpmatrix-band-amp, b = 4): accounted at rate L/N while each step samples
  its group at p = b L / N: the amplified mechanism's characteristic pitfall.
* ``reshuffled-participation`` (dpmatrix-me): the loader reshuffles every epoch while (k, b)
  participation is accounted (the thesis code's defect 2). Not detectable statistically
  (the sensitivity grows only 1.1-1.3x): caught by the deterministic participation check.
* ``per-layer-clipping`` (dpsgd): ``clip_and_sum`` replaced by one that clips each layer at C,
  so one example moves the sum by up to C sqrt(K) over K layers. The statistical audit's model
  has one layer, where this is correct: caught by the white-box sensitivity check
  (``dpbench.audit.sensitivity``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from dpbench.mechanisms.base import Plan
from dpbench.optimizers import get_optimizer
from dpbench.optimizers.base import SGD, DPStep
from dpbench.optimizers.spec import OptimizerSpec


class _Override:
    """A mechanism with some methods replaced; everything else delegates to the original."""

    def __init__(self, base, **methods):
        self._base = base
        self.__dict__.update(methods)

    def __getattr__(self, name):
        return getattr(self._base, name)


class _ScaledNoise:
    def __init__(self, base, factor: float):
        self.base, self.factor = base, factor

    def sample(self, like):
        return [z.mul_(self.factor) for z in self.base.sample(like)]

    def state_dict(self):
        return self.base.state_dict()

    def load_state_dict(self, state):
        self.base.load_state_dict(state)


class _ReusedNoise:
    def __init__(self, base):
        self.base, self.first = base, None

    def sample(self, like):
        if self.first is None:
            self.first = [z.clone() for z in self.base.sample(like)]
        return [z.clone() for z in self.first]

    def state_dict(self):
        return self.base.state_dict()

    def load_state_dict(self, state):
        self.base.load_state_dict(state)


@dataclass(frozen=True)
class _Unclipped:
    """Claims the clipping's sensitivity but leaves every gradient as it is (scaled by 1/C
    under normalised clipping, as the real rule scales the clipped ones)."""

    clipping: object

    @property
    def sensitivity(self) -> float:
        return self.clipping.sensitivity

    @property
    def clip_norm(self) -> float:
        return self.clipping.clip_norm

    def coefficients(self, norms: torch.Tensor) -> torch.Tensor:
        return torch.full_like(norms, self.clipping.sensitivity / self.clipping.clip_norm)


class _ReshufflingSampler:
    """Fixed batches of L, but a fresh shuffle every epoch (b steps)."""

    def __init__(self, make: Callable[[int], object], per_epoch: int):
        self.make, self.per_epoch, self.step, self.current = make, per_epoch, 0, None

    @property
    def batches(self):
        """The first epoch's batches (what the loader says it uses every epoch)."""
        return self.make(0).batches

    def sample(self):
        if self.step % self.per_epoch == 0:
            self.current = self.make(self.step // self.per_epoch)
        self.step += 1
        return self.current.sample()

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


class PerLayerClipStep(DPStep):
    """DP-SGD's step with ``clip_and_sum`` replaced as a plugin might write it: each layer's
    part of a per-sample gradient clipped on its own at C (instead of the whole vector at C,
    or each of K layers at C / sqrt(K)), so one example moves the sum by up to C sqrt(K)."""

    def clip_and_sum(self, psg):
        if psg is None:
            return super().clip_and_sum(psg)
        summed = {}
        for layer in psg.layers:
            coef = self.ctx.clipping.coefficients(layer.inner(layer).clamp_min(0).sqrt())
            summed.update(layer.weighted_sum(coef))
        return [summed[p] for p in self.params]


def per_layer_clipping(name: str = "dpsgd") -> OptimizerSpec:
    spec = get_optimizer(name)
    return dataclasses.replace(spec, name=f"{name}~per-layer-clipping",
                               build=lambda ctx: PerLayerClipStep(ctx, SGD(ctx.lr)))


def noise_over_sqrt_t(name: str = "dpmatrix-me") -> OptimizerSpec:
    spec = get_optimizer(name)
    base = spec.mechanism
    mech = _Override(base, noise=lambda plan, seed, device: _ScaledNoise(base.noise(plan, seed, device),
                                                                          1 / math.sqrt(plan.steps)))
    return dataclasses.replace(spec, name=f"{name}~noise-over-sqrt-T", mechanism=mech)


def no_clipping(name: str = "dpsgd") -> OptimizerSpec:
    spec = get_optimizer(name)
    return dataclasses.replace(spec, name=f"{name}~no-clipping",
                               build=lambda ctx: spec.build(dataclasses.replace(ctx, clipping=_Unclipped(ctx.clipping))))


def half_sample_rate(name: str = "dpsgd", factor: float = 2.0, label: str = "half-sample-rate") -> OptimizerSpec:
    """The accountant believes the sample rate is q / factor; the sampler draws at q."""
    spec = get_optimizer(name)
    base = spec.mechanism

    def believed(plan: Plan) -> Plan:
        return dataclasses.replace(plan, sample_rate=plan.sample_rate / factor)

    mech = _Override(
        base,
        calibrate=lambda plan, target: base.calibrate(believed(plan), target),
        report=lambda claim, steps: base.report(dataclasses.replace(claim, plan=believed(claim.plan)), steps),
        privacy_profile=lambda claim: base.privacy_profile(dataclasses.replace(claim, plan=believed(claim.plan))),
    )
    return dataclasses.replace(spec, name=f"{name}~{label}", mechanism=mech)


def amplified_rate_l_over_n(name: str = "dpmatrix-band-amp", bands: int = 4) -> OptimizerSpec:
    """Amplified BandMF accounted with the rate L/N while each step samples its group at
    p = b L / N (the pitfall the amplified BandMF paper warns about): b = 4 times the rate."""
    spec = half_sample_rate(name, float(bands), "rate-L-over-N")
    return dataclasses.replace(spec, defaults={**spec.defaults, "bands": bands})


def reused_noise(name: str = "dpsgd") -> OptimizerSpec:
    spec = get_optimizer(name)
    base = spec.mechanism
    mech = _Override(base, noise=lambda plan, seed, device: _ReusedNoise(base.noise(plan, seed, device)))
    return dataclasses.replace(spec, name=f"{name}~reused-noise", mechanism=mech)


def reshuffled_participation(name: str = "dpmatrix-me") -> OptimizerSpec:
    spec = get_optimizer(name)
    base = spec.mechanism

    def sampler(plan, n_train, seed, device, lanes=1):
        batches = n_train // plan.batch_size
        return _ReshufflingSampler(lambda epoch: base.sampler(plan, n_train, seed + 7919 * epoch, device, lanes),
                                   batches)

    return dataclasses.replace(spec, name=f"{name}~reshuffled-participation",
                               mechanism=_Override(base, sampler=sampler))


MUTANTS: dict[str, Callable[[], OptimizerSpec]] = {
    "noise-over-sqrt-T": noise_over_sqrt_t,
    "no-clipping": no_clipping,
    "half-sample-rate": half_sample_rate,
    "reused-noise": reused_noise,
    "reshuffled-participation": reshuffled_participation,
    "rate-L-over-N": amplified_rate_l_over_n,
    "per-layer-clipping": per_layer_clipping,
}
