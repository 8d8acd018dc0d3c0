"""The matrix-factorization mechanism behind the ``dpmatrix-*`` optimizers.

Privacy argument. With fixed batches (sampling.FixedBatchSampler) the gradients G (T x d, rows the
clipped sums, each example contributing a vector of norm <= s at the steps of its pattern)
are privatised once, as a whole, by the Gaussian mechanism C G + sigma s Z with
Z ~ N(0, I): its L2 sensitivity is s sens(C) (sensitivity.py), and sigma is calibrated
exactly for ONE release (Balle & Wang's analytic Gaussian mechanism, thesis eq. 2.4,
accounting.gaussian_noise_multiplier) with sens(C) = 1 after scaling. Training uses
G_hat = C^-1 (C G + sigma s Z) = G + sigma s C^-1 Z, row t at step t: post-processing, and
causal because C^-1 is lower triangular, which is what makes the guarantee hold for
adaptively chosen gradients (Denisov et al. 2022). SGD then releases A G_hat (prefix sums)
whatever workload the factorization was optimised for: the lambda variants only change C.
Adjacency: one example's gradients replaced by zeros in its batch slot (the zero-out notion
the matrix-mechanism papers use); under replace-one adjacency the sensitivity doubles.

A run stopped after t steps has released (C G + sigma s Z)[:t], whose sensitivity is that of
C[:t, :t] (<= sens(C)); its achieved epsilon is computed for that.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dpbench import log
from dpbench.matrix.dense_factorization import Factorization
from dpbench.matrix.store import cache, dense_files, noise_files
from dpbench.matrix.store.noise_files import NoiseFile
from dpbench.matrix.sensitivity import prefix_sensitivity
from dpbench.mechanisms.files import DenseFiles
from dpbench.mechanisms.base import AuditSpec, Plan, PlanRequest, PrivacyClaim, Spent, Target, one_release_spent
from dpbench.privacy import accounting, profiles

if TYPE_CHECKING:  # annotations only: a mechanism is declared and accounted without torch (the workflow)
    from dpbench.mechanisms.noise import CorrelatedNoise
    from dpbench.mechanisms.sampling import FixedBatchSampler

_LOG = log.get(__name__)


def _log(message: str) -> None:
    _LOG.info(f"[matrix] {message}")


@dataclass(frozen=True, kw_only=True)
class DenseMatrixPlan(Plan):
    """A dense matrix mechanism's plan: the verified factorization (C, C^-1, sens(C)) and its
    file, (k, b) = (E, N // L), and where the noise file comes from (a given one, or the
    cache's, made at the first step when d is known)."""

    factorization: Factorization
    factorization_file: Path
    key: str  # (kind, k, b, tau): keys.dense_key
    epochs: int  # k
    batches: int  # b = N // L
    unused_examples: int  # N - b L: never in a batch
    noise_file: Path | None  # given (dpbench train --noise-file), else the cache's
    cache_dir: Path


class MatrixMechanism:
    """Mechanism (dpbench.mechanisms.base) for the single-epoch (``single_epoch=True``) and the
    multi-epoch matrix mechanisms, optionally convergence-aware (Lambda_tau objective)."""

    audit = AuditSpec("matrix", neighbours="zero-out")

    def __init__(self, single_epoch: bool, convergence_aware: bool):
        self.single_epoch, self.convergence_aware = single_epoch, convergence_aware
        self.kind = ("se" if single_epoch else "me") + ("-lambda" if convergence_aware else "")
        self.name = (f"matrix-factorization-{'single' if single_epoch else 'multi'}-epoch"
                     f"{'-convergence-aware' if convergence_aware else ''}")
        self.files = DenseFiles(self.kind)  # the factorization and noise file a run reads (the workflow's)

    @property
    def event_hyperparameters(self) -> tuple[str, ...]:
        """tau picks the convergence-aware C (hence sens(C)); the others read no hyperparameter."""
        return ("tau",) if self.convergence_aware else ()

    def key(self, request: PlanRequest) -> str:
        """The factorization a run needs: (kind, k = E, b = N // L, tau) (``files``)."""
        return self.files.key(request)

    def plan(self, request: PlanRequest) -> DenseMatrixPlan:
        n_train, batch_size, epochs = request.n_train, request.batch_size, request.epochs
        key = self.key(request)
        batches = n_train // batch_size
        path = request.factorization or cache.ensure_factorization(request.cache_dir, key, _log)
        fact = dense_files.load(path)
        if (fact.epochs, fact.batches) != (epochs, batches) or fact.kind not in (self.kind, "identity") or \
                (fact.kind != "identity" and fact.key != key):
            raise ValueError(f"factorization {path} is {fact.key!r}, but this run needs {key!r} "
                             f"(k = {epochs} epochs, b = N // L = {n_train} // {batch_size} = {batches} batches)")
        return DenseMatrixPlan(batch_size=batch_size, steps=epochs * batches, sample_rate=None, factorization=fact,
                               factorization_file=path, key=key, epochs=epochs, batches=batches,
                               unused_examples=n_train - batches * batch_size, noise_file=request.noise_file,
                               cache_dir=request.cache_dir)

    def calibrate(self, plan: DenseMatrixPlan, target: Target) -> float:
        """Exact: the smallest sigma making one Gaussian release of sensitivity sens(C)
        (epsilon, delta)-DP (Balle & Wang; the target's accountant does not apply)."""
        return accounting.gaussian_noise_multiplier(target.epsilon, target.delta,
                                                    sensitivity=plan.factorization.sensitivity)

    def privacy_profile(self, claim: PrivacyClaim):
        """The claim at every epsilon: one Gaussian release with mu = sens(C) / sigma (exact)."""
        return profiles.gaussian_profile(claim.plan.factorization.sensitivity / claim.noise_multiplier)

    def strategy_matrix(self, plan: DenseMatrixPlan):
        """C, the dense T x T strategy the release C G + sigma s Z uses."""
        return plan.factorization.strategy

    def strategy_sensitivity(self, plan: DenseMatrixPlan) -> float:
        return plan.factorization.sensitivity

    def report(self, claim: PrivacyClaim, steps: int) -> Spent:
        plan = claim.plan
        fact = plan.factorization
        k, b, r = fact.epochs, fact.batches, fact.report
        return one_release_spent(claim, steps, fact.sensitivity, lambda t: prefix_sensitivity(fact.strategy, k, b, t),
                                 f"b = {b}", {
            "key": fact.key, "kind": fact.kind, "epochs": k, "batches": b, "steps": fact.steps,
            "tau": r.get("tau"), "objective": r.get("objective"), "prefix_sum_error": r.get("prefix_sum_error"),
            "relative_duality_gap": r.get("relative_duality_gap"), "method": r.get("method"),
            "digest": fact.digest, "factorization_file": str(plan.factorization_file),
            "common_random_numbers": "noise depends only on (factorization, d, run seed): runs that differ "
                                     "only in learning rate or epsilon share it",
        })

    def sampler(self, plan: DenseMatrixPlan, n_train: int, seed: int, device, lanes: int = 1) -> FixedBatchSampler:
        from dpbench.mechanisms.sampling import FixedBatchSampler  # torch: only where a run draws
        return FixedBatchSampler(n_train, plan.batch_size, seed, device, lanes)

    def noise(self, plan: DenseMatrixPlan, seed: int, device) -> CorrelatedNoise:
        from dpbench.mechanisms.noise import CorrelatedNoise  # torch: only where a run draws
        fact = plan.factorization

        def resolve(dim: int) -> NoiseFile:
            """The run's noise file (given, else the cache's, written if missing), open and verified
            to be the one for (C, d, seed) before the first noisy update."""
            path = plan.noise_file or cache.ensure_noise(plan.cache_dir, fact, dim, seed, _log)
            return noise_files.open_verified(path, fact, dim, seed, _log)

        return CorrelatedNoise(resolve, device)
