"""The optimizer registry: the built-ins below and the plugins of the entry-point group
``dpbench.optimizers`` (``dpbench.plugins``, docs/plugins.md). To add a built-in optimizer,
write a module with an ``OptimizerSpec`` and add it to the list below (see
docs/adding-an-optimizer.md)."""

from dpbench.optimizers import adam, d2p2, dice, dice_strict, disk, dpmatrix, opacus_dpsgd, sgd, streamed
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.plugins import Group, Registry
from dpbench.mechanisms.base import AuditSpec

# every method of the Mechanism protocol that the harness (plan, calibrate, report, sampler,
# noise) and the audit (privacy_profile) call; the audit also reads ``audit`` (an AuditSpec,
# unless the spec brings its own)
MECHANISM_METHODS = ("plan", "calibrate", "report", "sampler", "noise", "privacy_profile")


def check_spec(spec: OptimizerSpec) -> None:
    """What the harness relies on in a plugin's spec (a dataclass checks no types): raises
    ValueError naming the first malformed field."""
    if not callable(spec.build):
        raise ValueError(f"build is a {type(spec.build).__name__}, not a function of a Context")
    if not isinstance(spec.private, bool):
        raise ValueError(f"private is {spec.private!r}, not true or false")
    for field in ("description", "reference"):
        if not isinstance(getattr(spec, field), str) or not getattr(spec, field).strip():
            raise ValueError(f"{field} is {getattr(spec, field)!r}, not a text")
    if not isinstance(spec.defaults, dict) or not all(isinstance(k, str) for k in spec.defaults):
        raise ValueError("defaults is not a dict of hyperparameter names to values")
    missing = [m for m in MECHANISM_METHODS if not callable(getattr(spec.mechanism, m, None))]
    if missing or not isinstance(getattr(spec.mechanism, "name", None), str):
        raise ValueError(f"mechanism {type(spec.mechanism).__name__} is not a Mechanism (it lacks "
                         f"{', '.join(missing or ['a name'])})")
    if spec.audit is None and not isinstance(getattr(spec.mechanism, "audit", None), AuditSpec):
        raise ValueError(f"mechanism {type(spec.mechanism).__name__} is not a Mechanism (its audit is "
                         f"{getattr(spec.mechanism, 'audit', None)!r}, not an AuditSpec; or give the OptimizerSpec an audit)")
    if spec.caveat is not None and not isinstance(spec.caveat, str):
        raise ValueError(f"caveat is {spec.caveat!r}, not a text or None")
    if spec.audit is not None and not isinstance(spec.audit, AuditSpec):
        raise ValueError(f"audit is a {type(spec.audit).__name__}, not an AuditSpec or None")


GROUP = Group("dpbench.optimizers", "optimizer", OptimizerSpec, "name", check_spec)

OPTIMIZERS: Registry = Registry(GROUP, {
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
        streamed.DPMATRIX_BAND,
        streamed.DPMATRIX_BAND_AMP,
        streamed.DPMATRIX_BLT,
    ]
})


def get_optimizer(name: str) -> OptimizerSpec:
    """The spec of ``name``: a KeyError naming the choices for an unknown one, a one-line
    ``dpbench.plugins.PluginError`` (a ValueError) for a plugin that failed to load."""
    return OPTIMIZERS.lookup(name)
