"""DP-SGD (thesis Alg. 1, Abadi et al. 2016) and its non-private reference."""

from dpbench.optimizers.base import SGD, DPStep, NonPrivateStep
from dpbench.optimizers.spec import OptimizerSpec

DPSGD = OptimizerSpec(
    name="dpsgd",
    build=lambda ctx: DPStep(ctx, SGD(ctx.lr)),
    private=True,
    description="DP-SGD: Poisson sampling, clipped per-sample gradients, Gaussian noise, SGD step",
    reference="Abadi et al. 2016; thesis Alg. 1",
    cost_class="dpsgd",
)

SGD_REFERENCE = OptimizerSpec(
    name="sgd",
    build=lambda ctx: NonPrivateStep(ctx, SGD(ctx.lr)),
    private=False,
    description="non-private SGD on the same Poisson batches (no clipping, no noise)",
    reference="Robbins & Monro 1951",
    cost_class="sgd",
)
