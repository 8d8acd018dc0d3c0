"""Matrix-factorization mechanisms (thesis 2.2.5, Setups 2 and 3): plain SGD on the
privatised gradients G + sigma s C^-1 Z, with fixed batches and one exact Gaussian release.
The mechanism (dpbench.mechanisms.dense_matrix) does the rest; see docs/matrix.md."""

from dpbench.mechanisms.dense_matrix import MatrixMechanism
from dpbench.optimizers.base import SGD, DPStep
from dpbench.optimizers.spec import OptimizerSpec


def _build(ctx):
    return DPStep(ctx, SGD(ctx.lr))


def _spec(name, single_epoch, convergence_aware, description, reference):
    return OptimizerSpec(
        name=name,
        build=_build,
        private=True,
        description=description,
        reference=reference,
        defaults={"tau": None} if convergence_aware else {},  # tau None: tau = T
        mechanism=MatrixMechanism(single_epoch=single_epoch, convergence_aware=convergence_aware),
        cost_class="dpmatrix-se",
    )


DPMATRIX_SE = _spec(
    "dpmatrix-se", single_epoch=True, convergence_aware=False,
    description="single-epoch matrix mechanism: fixed batches, correlated noise C^-1 Z, SGD step",
    reference="Denisov et al. 2022 (fixed-point factorization); thesis 2.2.5 method 1")

DPMATRIX_SE_LAMBDA = _spec(
    "dpmatrix-se-lambda", single_epoch=True, convergence_aware=True,
    description="single-epoch matrix mechanism with the convergence-aware objective Lambda_tau A",
    reference="Koloskova et al. 2023 objective, Denisov et al. 2022 fixed point; thesis 2.2.5 method 3")

DPMATRIX_ME = _spec(
    "dpmatrix-me", single_epoch=False, convergence_aware=False,
    description="multi-epoch matrix mechanism for (k, b) participation: fixed batches, correlated noise, SGD step",
    reference="Choquette-Choo et al. 2023 (dual optimization); thesis 2.2.5 method 2")

DPMATRIX_ME_LAMBDA = _spec(
    "dpmatrix-me-lambda", single_epoch=False, convergence_aware=True,
    description="multi-epoch matrix mechanism with the convergence-aware objective Lambda_tau A",
    reference="Koloskova et al. 2023 objective, Choquette-Choo et al. 2023 dual; thesis 2.2.5 method 3")
