"""Streamed correlated-noise mechanisms (BandMF, amplified BandMF, BLT; no noise files): plain
SGD on the privatised gradients G + sigma s C^-1 Z, with the noise generated step by step from
O(b d) or O(m d) state. The mechanisms (dpbench.mechanisms.streamed, amplified_banded) do the
rest; see docs/matrix.md.

No convergence-aware (lambda) variants: Lambda_tau A is not Toeplitz, so neither the banded
Toeplitz objective (err_mean from the coefficients beta = C^-1 1) nor the BLT closed forms
apply to it (docs/matrix.md, "Streamed mechanisms")."""

from dpbench.mechanisms.amplified_banded import AmplifiedBandedMechanism
from dpbench.mechanisms.streamed import BandedMechanism, BLTMechanism
from dpbench.optimizers.base import SGD, DPStep
from dpbench.optimizers.spec import OptimizerSpec


def _build(ctx):
    return DPStep(ctx, SGD(ctx.lr))


DPMATRIX_BAND = OptimizerSpec(
    name="dpmatrix-band",
    build=_build,
    private=True,
    description="banded Toeplitz matrix mechanism (BandMF), fixed epoch order, streamed correlated noise, SGD step",
    reference="Choquette-Choo et al. 2023 (arXiv 2306.08153); McKenna 2024 (arXiv 2405.15913)",
    defaults={"bands": "auto"},  # auto: min(64, N // L, T)
    mechanism=BandedMechanism(),
    cost_class="dpmatrix-se",
)

DPMATRIX_BAND_AMP = OptimizerSpec(
    name="dpmatrix-band-amp",
    build=_build,
    private=True,
    description="amplified BandMF: cyclic Poisson sampling over b groups, streamed banded correlated noise, SGD step",
    reference="Choquette-Choo et al. 2023, Alg. 2 and Thm. 4 (arXiv 2306.08153)",
    defaults={"bands": "auto"},  # auto: b minimising sigma_b sqrt(err_mean) for the target epsilon
    mechanism=AmplifiedBandedMechanism(),
    cost_class="dpmatrix-se",
)

DPMATRIX_BLT = OptimizerSpec(
    name="dpmatrix-blt",
    build=_build,
    private=True,
    description="buffered linear Toeplitz (BLT) matrix mechanism, fixed epoch order, streamed noise, SGD step",
    reference="Dvijotham et al. 2024 (arXiv 2404.16706); McMahan et al. 2024 (arXiv 2408.08868)",
    defaults={"buffers": "auto"},  # auto: grow m while the loss improves by > 1% (at most 8)
    mechanism=BLTMechanism(),
    cost_class="dpmatrix-se",
)
