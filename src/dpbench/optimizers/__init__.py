"""The optimizer registry. To add an optimizer, write a module with an ``OptimizerSpec`` and
add it to the list below (see README, "Adding an optimizer")."""

from dpbench.optimizers import sgd
from dpbench.optimizers.registry import OptimizerSpec

OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in [
        sgd.SGD_REFERENCE,
        sgd.DPSGD,
    ]
}


def get_optimizer(name: str) -> OptimizerSpec:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise KeyError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}") from None
