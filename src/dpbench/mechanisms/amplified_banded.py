"""Amplified BandMF (``dpmatrix-band-amp``): BandMF with cyclic Poisson sampling.

A column-normalised b-banded Toeplitz C (streamed.py), streamed noise (noise.BandedNoise),
cyclic Poisson sampling over b groups at p = b L / N (sampling.CyclicPoissonSampler), and the
release accounted as DP-SGD with ceil(T / b) steps at rate p and noise multiplier
sigma_Z / max_j ||C e_j|| (cyclic_poisson.py: Choquette-Choo et al. 2023, Thm. 4), with the
run's accountant (PRV by default), RDP and our own PLD as cross-checks. ``bands`` = "auto"
takes the band search's b for the target (epsilon, delta) (cyclic_poisson.choose_bands); b = 1
is DP-SGD exactly. Adjacency: add/remove (each example's group drawn independently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dpbench.mechanisms import cyclic_poisson
from dpbench.mechanisms.base import AuditSpec, PlanRequest, PrivacyClaim, Spent, Target
from dpbench.mechanisms.files import StreamedFiles
from dpbench.mechanisms.streamed import StreamedPlan, StreamedMechanism
from dpbench.privacy import accounting, pld, profiles

if TYPE_CHECKING:  # annotations only: a mechanism is declared and accounted without torch (the workflow)
    from dpbench.mechanisms.noise import BandedNoise
    from dpbench.mechanisms.sampling import CyclicPoissonSampler


@dataclass(frozen=True, kw_only=True)
class AmplifiedBandedPlan(StreamedPlan):
    """Amplified BandMF's plan: b bands (= groups), ceil(T / b) rounds, max_j ||C e_j||, and
    the band search that chose b (``bands: auto``; None for a given b)."""

    bands: int
    rounds: int  # ceil(T / b)
    max_column_norm: float  # max_j ||C e_j||
    band_search: list[dict] | None


class AmplifiedBandedMechanism(StreamedMechanism):
    """``dpmatrix-band-amp``: BandMF with cyclic Poisson sampling (module docstring)."""

    name = "amplified-banded-matrix-factorization"
    audit = AuditSpec("banded-lr")
    event_hyperparameters = ("bands",)  # b: the groups, the rate p = b L / N and the rounds
    files = StreamedFiles("band-amp")  # the factorization a run reads (the workflow's)

    def key(self, request: PlanRequest) -> str:
        """The factorization a run needs: ``band-n<T>-b<b>`` for a given b; with ``bands`` = "auto"
        the band search's key, which names (N, L, T, target epsilon, delta) (``files``)."""
        return self.files.key(request)

    def plan(self, request: PlanRequest) -> AmplifiedBandedPlan:
        key = self.key(request)
        record, path = self.factorization(key, request)
        fact = record.strategy
        steps, bands = fact.n, fact.bands
        rate = cyclic_poisson.sample_rate(bands, request.batch_size, request.n_train)
        return AmplifiedBandedPlan(batch_size=request.batch_size, steps=steps, sample_rate=rate, factorization=fact,
                                   factorization_key=key, factorization_file=path, bands=bands,
                                   rounds=cyclic_poisson.rounds(steps, bands),
                                   max_column_norm=float(fact.column_norms().max()), band_search=record.band_search)

    def accounted_sigma(self, plan: AmplifiedBandedPlan, noise_multiplier: float) -> float:
        """sigma of the accounted DP-SGD event: sigma_Z / (C_clip max_j ||C e_j||), in units
        of the clipping sensitivity (the step scales the noise by it)."""
        return noise_multiplier / plan.max_column_norm

    def history(self, plan: AmplifiedBandedPlan, noise_multiplier: float, steps: int) -> accounting.History:
        return cyclic_poisson.history(self.accounted_sigma(plan, noise_multiplier), plan.sample_rate, steps,
                                      plan.bands)

    def calibrate(self, plan: AmplifiedBandedPlan, target: Target) -> float:
        sigma = accounting.noise_multiplier_for(target.epsilon, plan.sample_rate, plan.rounds, target.delta,
                                                target.accountant)
        return sigma * plan.max_column_norm

    def privacy_profile(self, claim: PrivacyClaim):
        """delta(eps) of the accounted event (DP-SGD with ceil(T / b) steps at rate p), from the
        accountant the run is calibrated with (PRV, both directions; or RDP): the claim the
        audit tests."""
        history = self.history(claim.plan, claim.noise_multiplier, claim.plan.steps)
        return profiles.accounted_profile(claim.accountant, history, delta=claim.delta)

    def strategy_matrix(self, plan: AmplifiedBandedPlan) -> np.ndarray:
        """The dense T x T (column-normalised, banded) strategy the release whitens by."""
        return plan.factorization.matrix()

    def report(self, claim: PrivacyClaim, steps: int) -> Spent:
        plan, noise_multiplier, delta, accountant = claim.plan, claim.noise_multiplier, claim.delta, claim.accountant
        fact, bands = plan.factorization, plan.bands
        planned = accountant.epsilon(self.history(plan, noise_multiplier, plan.steps), delta)
        done_history = self.history(plan, noise_multiplier, steps)
        done = planned if steps == plan.steps else accountant.epsilon(done_history, delta)
        (sigma_acc, rate, rounds_done), = done_history or [(0.0, plan.sample_rate, 0)]
        return Spent(done, planned, accounting.RDP.epsilon(done_history, delta), {
            # an independent cross-check: our own pessimistic PLD of the same event (dpbench.privacy.pld)
            "epsilon_pld": pld.epsilon(delta, rate, sigma_acc, rounds_done) if rounds_done else 0.0,
            "noise_multiplier_streamed": noise_multiplier, "bands": bands,
            "rounds": plan.rounds, "rounds_taken": cyclic_poisson.rounds(steps, bands) if steps else 0,
            "accounted_event": (f"DP-SGD: {plan.rounds} = ceil(T / b) steps, Poisson rate p = b L / N = "
                                f"{plan.sample_rate:g}, noise multiplier sigma_Z / max_j ||C e_j|| "
                                "(Choquette-Choo et al. 2023, Thm. 4)"),
            "sampling": (f"cyclic Poisson: examples partitioned once into b = {bands} groups (each example's group "
                         f"drawn independently), step t samples group t mod b at rate p = {plan.sample_rate:g}"),
            "adjacency": "add/remove one example",
            "matrix": {"kind": "band", "steps": plan.steps, "bands": bands, "column_normalized": fact.column_normalize,
                       "max_column_norm": plan.max_column_norm,
                       "coefficients": [float(c) for c in fact.coef], "band_search": plan.band_search,
                       "key": plan.factorization_key, "factorization_file": str(plan.factorization_file),
                       "noise": "streamed (no noise file); its state is in checkpoints, which are private files",
                       **fact.report},
        }, noise_multiplier=self.accounted_sigma(plan, noise_multiplier))  # sample_rate, T: the claim's

    def sampler(self, plan: AmplifiedBandedPlan, n_train: int, seed: int, device, lanes: int = 1):
        """Cyclic Poisson over lanes n_train examples: with independent groups and inclusions,
        that is ``lanes`` independent samplers, one per lane (sampling.py)."""
        from dpbench.mechanisms.sampling import CyclicPoissonSampler  # torch: only where a run draws
        return CyclicPoissonSampler(lanes * n_train, plan.bands, plan.sample_rate, seed, device)

    def noise(self, plan: AmplifiedBandedPlan, seed: int, device) -> BandedNoise:
        from dpbench.mechanisms.noise import BandedNoise  # torch: only where a run draws
        fact = plan.factorization
        return BandedNoise(fact.coef, fact.scale(), seed, device)
