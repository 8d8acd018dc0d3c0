"""The optimizer registry. To add an optimizer, write a module with an ``OptimizerSpec`` and
add it to the list below (see docs/adding-an-optimizer.md)."""

from dpbench.optimizers import adam, d2p2, dice, dice_strict, disk, dpmatrix, opacus_dpsgd, sgd, streaming
from dpbench.optimizers.registry import OptimizerSpec

OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in [
        sgd.SGD_REFERENCE,
        sgd.DPSGD,
        opacus_dpsgd.OPACUS_DPSGD,
        adam.ADAM,
        adam.ADAMW,
        adam.DPADAM,
        adam.DPADAMBC,
        adam.DPADAMW,
        adam.DPADAMW_BC,
        dice.DPDICE,
        dice_strict.DPDICE_STRICT,
        disk.DPDISK,
        d2p2.D2P2SGD,
        d2p2.D2PSGD,
        d2p2.DP2SGD,
        dpmatrix.DPMATRIX_SE,
        dpmatrix.DPMATRIX_SE_LAMBDA,
        dpmatrix.DPMATRIX_ME,
        dpmatrix.DPMATRIX_ME_LAMBDA,
        streaming.DPMATRIX_BAND,
        streaming.DPMATRIX_BAND_AMP,
        streaming.DPMATRIX_BLT,
    ]
}


def get_optimizer(name: str) -> OptimizerSpec:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise KeyError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}") from None
