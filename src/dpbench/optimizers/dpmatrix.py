"""Matrix-factorization mechanisms (thesis 2.2.5, Setups 2 and 3): plain SGD on the
privatised gradients G + sigma s C^-1 Z, with fixed batches and one exact Gaussian release.
The mechanism (dpbench.matrix.mechanism) does the rest; see docs/matrix.md."""

from dpbench.matrix.mechanism import MatrixMechanism
from dpbench.optimizers.base import SGD, DPStep
from dpbench.optimizers.registry import OptimizerSpec


def _build(ctx):
    return DPStep(ctx, SGD(ctx.lr))


DPMATRIX_SE = OptimizerSpec(
    name="dpmatrix-se",
    build=_build,
    private=True,
    description="single-epoch matrix mechanism: fixed batches, correlated noise C^-1 Z, SGD step",
    reference="Denisov et al. 2022 (fixed-point factorization); thesis 2.2.5 method 1",
    mechanism=MatrixMechanism(single_epoch=True, convergence_aware=False),
)

DPMATRIX_SE_LAMBDA = OptimizerSpec(
    name="dpmatrix-se-lambda",
    build=_build,
    private=True,
    description="single-epoch matrix mechanism with the convergence-aware objective Lambda_tau A",
    reference="Koloskova et al. 2023 objective, Denisov et al. 2022 fixed point; thesis 2.2.5 method 3",
    defaults={"tau": None},  # None: tau = T
    mechanism=MatrixMechanism(single_epoch=True, convergence_aware=True),
)

DPMATRIX_ME = OptimizerSpec(
    name="dpmatrix-me",
    build=_build,
    private=True,
    description="multi-epoch matrix mechanism for (k, b) participation: fixed batches, correlated noise, SGD step",
    reference="Choquette-Choo et al. 2023 (dual optimization); thesis 2.2.5 method 2",
    mechanism=MatrixMechanism(single_epoch=False, convergence_aware=False),
)

DPMATRIX_ME_LAMBDA = OptimizerSpec(
    name="dpmatrix-me-lambda",
    build=_build,
    private=True,
    description="multi-epoch matrix mechanism with the convergence-aware objective Lambda_tau A",
    reference="Koloskova et al. 2023 objective, Choquette-Choo et al. 2023 dual; thesis 2.2.5 method 3",
    defaults={"tau": None},  # None: tau = T
    mechanism=MatrixMechanism(single_epoch=False, convergence_aware=True),
)
