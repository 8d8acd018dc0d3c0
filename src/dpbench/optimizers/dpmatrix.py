"""Matrix-factorization mechanisms (thesis 2.2.5, Setups 2 and 3): plain SGD on the
privatised gradients G + sigma s C^-1 Z, with fixed batches and one exact Gaussian release.
The mechanism (dpbench.mechanisms.dense_matrix) does the rest; see docs/matrix.md."""

from dpbench.optimizers.base import SGD, Context, DPStep


def sgd_step(ctx: Context) -> DPStep:
    """Plain SGD on the privatised gradient (the four dpmatrix-* optimizers' step)."""
    return DPStep(ctx, SGD(ctx.lr))
