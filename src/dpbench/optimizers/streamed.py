"""Streamed correlated-noise mechanisms (BandMF, amplified BandMF, BLT; no noise files): plain
SGD on the privatised gradients G + sigma s C^-1 Z, with the noise generated step by step from
O(b d) or O(m d) state. The mechanisms (dpbench.mechanisms.streamed, amplified_banded) do the
rest; see docs/matrix.md.

No convergence-aware (lambda) variants: Lambda_tau A is not Toeplitz, so neither the banded
Toeplitz objective (err_mean from the coefficients beta = C^-1 1) nor the BLT closed forms
apply to it (docs/matrix.md, "Streamed mechanisms")."""

from dpbench.optimizers.base import SGD, Context, DPStep


def sgd_step(ctx: Context) -> DPStep:
    """Plain SGD on the privatised gradient (dpmatrix-band, dpmatrix-band-amp, dpmatrix-blt's step)."""
    return DPStep(ctx, SGD(ctx.lr))
