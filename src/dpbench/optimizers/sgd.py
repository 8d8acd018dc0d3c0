"""DP-SGD (thesis Alg. 1, Abadi et al. 2016) and its non-private reference."""

from dpbench.optimizers.base import SGD, Context, DPStep, NonPrivateStep


def sgd(ctx: Context) -> NonPrivateStep:
    return NonPrivateStep(ctx, SGD(ctx.lr))


def dpsgd(ctx: Context) -> DPStep:
    return DPStep(ctx, SGD(ctx.lr))
