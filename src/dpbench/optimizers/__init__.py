"""The optimizer registry: the built-ins declared below, one ``OptimizerSpec`` each, and the
plugins of the entry-point group ``dpbench.optimizers`` (``dpbench.plugins``, docs/plugins.md).
A built-in names the function that builds its step by import string (``Imported``, as an entry
point names its object): the step's module imports torch when a run builds it, and this module
imports none, so the workflow reads the declarations themselves (dpbench.pipeline.catalog).
To add a built-in optimizer, write a module with its step and its build function, and declare
it below (see docs/adding-an-optimizer.md)."""

from dpbench.mechanisms.amplified_banded import AmplifiedBandedMechanism
from dpbench.mechanisms.base import AuditSpec
from dpbench.mechanisms.dense_matrix import MatrixMechanism
from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian, inverse_sqrt_schedule
from dpbench.mechanisms.projected_gaussian import PLAN_HYPERPARAMETERS, RandomProjectionGaussian
from dpbench.mechanisms.streamed import BandedMechanism, BLTMechanism
from dpbench.mechanisms.unamplified import UnamplifiedGaussian
from dpbench.optimizers.spec import Imported, OptimizerSpec
from dpbench.plugins import Group, Registry
from dpbench.privacy import accounting

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

# Each built-in, declared once: its step's build (by import string), whether it is private, its
# hyperparameters' defaults, its mechanism, caveat, audit and cost class (``OptimizerSpec``).
# Its code fingerprint covers its declaration's text and the modules of its build and mechanism
# (dpbench.pipeline.fingerprint): write values here, not names bound elsewhere in this module.
BUILT_IN = (
    OptimizerSpec(
        name="sgd",
        build=Imported("dpbench.optimizers.sgd:sgd"),
        private=False,
        description="non-private SGD on the same Poisson batches (no clipping, no noise)",
        reference="Robbins & Monro 1951",
        cost_class="sgd",
    ),
    OptimizerSpec(
        name="dpsgd",
        build=Imported("dpbench.optimizers.sgd:dpsgd"),
        private=True,
        description="DP-SGD: Poisson sampling, clipped per-sample gradients, Gaussian noise, SGD step",
        reference="Abadi et al. 2016; thesis Alg. 1",
        cost_class="dpsgd",
    ),
    OptimizerSpec(
        name="opacus-dpsgd",
        build=Imported("dpbench.optimizers.opacus_dpsgd:opacus_dpsgd"),
        private=True,
        description="DP-SGD computed by Opacus 1.6 (GradSampleModule, DPOptimizer) on our Poisson batches, "
                    "sigma and noise stream; Opacus's gradient rescaled to the run's clipping (s / C)",
        reference="Abadi et al. 2016; Yousefpour et al. 2021 (Opacus, arXiv:2109.12298)",
    ),
    OptimizerSpec(
        name="adam",
        build=Imported("dpbench.optimizers.adam:adam"),
        private=False,
        description="non-private Adam on the same Poisson batches (no clipping, no noise)",
        reference="Kingma & Ba 2015",
        defaults={"beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
        cost_class="sgd",
    ),
    OptimizerSpec(
        name="adamw",
        build=Imported("dpbench.optimizers.adam:adamw"),
        private=False,
        description="non-private AdamW on the same Poisson batches: decoupled weight decay, "
                    "m^ / (sqrt(v^) + eps) + lambda theta (no clipping, no noise)",
        reference="Loshchilov & Hutter 2019 (arXiv:1711.05101), Alg. 2",
        defaults={"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-5},  # weight decay as dpadamw's
    ),
    OptimizerSpec(
        name="dpadam",
        build=Imported("dpbench.optimizers.adam:dpadam"),
        private=True,
        description="DP-Adam: DP-SGD's privatised gradient into Adam, m^ / (sqrt(v^) + eps)",
        reference="Kingma & Ba 2015 on DP-SGD's gradient; Tang et al. 2024 (DP-Adam); thesis Sec. 2.2.2",
        defaults={"beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
        cost_class="dpadambc",
    ),
    OptimizerSpec(
        name="dpadambc",
        build=Imported("dpbench.optimizers.adam:dpadambc"),
        private=True,
        description="DP-AdamBC: DP-Adam with the noise variance Phi = (sigma s / L)^2 subtracted, "
                    "m^ / sqrt(max(v^ - Phi, zeta'))",
        reference="Tang et al. 2024; thesis Alg. 2",
        defaults={"beta1": 0.9, "beta2": 0.999, "zeta": 1e-8},
        cost_class="dpadambc",
    ),
    OptimizerSpec(
        name="dpadamw",
        build=Imported("dpbench.optimizers.adam:dpadamw"),
        private=True,
        description="DP-AdamW: decoupled weight decay, m^ / sqrt(v^ + eps0) + lambda theta",
        reference="Chooi et al. 2025 (DP-AdamW, arXiv:2511.07843), Alg. 1",
        defaults={"beta1": 0.9, "beta2": 0.999, "eps0": 1e-8, "weight_decay": 1e-5},
        cost_class="dpadambc",
    ),
    OptimizerSpec(
        name="dpadamw-bc",
        build=Imported("dpbench.optimizers.adam:dpadamw_bc"),
        private=True,
        description="DP-AdamW-BC: DP-AdamW with Phi subtracted, m^ / sqrt(max(v^ - Phi, gamma)) + lambda theta",
        reference="Chooi et al. 2025 (DP-AdamW-BC, arXiv:2511.07843), Alg. 2",
        defaults={"beta1": 0.9, "beta2": 0.999, "gamma": 1e-8, "weight_decay": 1e-5},
        cost_class="dpadambc",
    ),
    OptimizerSpec(
        name="dpdice",
        build=Imported("dpbench.optimizers.dice:dpdice"),
        private=True,
        description="DP-Dice: DP-SGD with error feedback, g_bar = mean clip(g_i) + clip(e, C2), "
                    "e <- e + g - g_bar, noise std sigma s sqrt(1 + 2 C2 / C) on the sum (the authors' "
                    "calibration: not a valid DP guarantee for C2 > 0)",
        reference="Zhang et al. 2024 (DiceSGD); thesis Alg. 3",
        defaults={"c2": 1.0},
        caveat=(  # why: dpbench.optimizers.dice's docstring
            "not a valid DP guarantee (for C2 > 0): DP-Dice's noise std sigma*s*sqrt(1 + 2*C2/C) on the clipped "
            "sum follows the authors' reference code, but the residual e accumulates every earlier raw gradient, "
            "so one changed example moves L*clip(e, C2) by up to 2*L*C2/C (times s) at every later step, sampled "
            "or not: the released sum's sensitivity is s*(1 + 2*L*C2/C) and subsampling does not amplify it; the "
            "recorded epsilon does not hold for this run (dpdice-strict calibrates to the true bound)"),
        # the clipped-away part of a large gradient returns later through clip(e, C2): sum the releases
        audit=AuditSpec("sum", canary_factor=100.0),
        cost_class="dpdice",
    ),
    OptimizerSpec(
        name="dpdice-strict",
        build=Imported("dpbench.optimizers.dice_strict:dpdice_strict"),
        private=True,
        description="DP-Dice (error feedback, g_bar = mean clip(g_i) + clip(e, C2)) with noise std "
                    "sigma s (1 + 2 L C2 / C) on the sum, the release's true sensitivity, accounted as T Gaussian "
                    "mechanisms without amplification",
        reference="Zhang et al. 2024 (DiceSGD); thesis Alg. 3; calibration: dpbench.optimizers.dice_strict",
        defaults={"c2": 1.0},
        mechanism=UnamplifiedGaussian(),
        audit=AuditSpec("sum", canary_factor=100.0),  # as dpdice: the same release, honest noise
        cost_class="dpdice",
    ),
    OptimizerSpec(
        name="dpdisk",
        build=Imported("dpbench.optimizers.disk:dpdisk"),
        private=True,
        description="DP-DiSK: per-sample a grad f(theta + gamma d) + (1 - a) grad f(theta), a = (1-kappa)/(kappa gamma), "
                    "clipped once, DP-SGD noise, Kalman filter g~ <- (1-kappa) g~ + kappa g, SGD step",
        reference="Zhang et al. 2025 (DiSK, ICLR 2025, arXiv:2410.03883), Alg. 3; thesis Alg. 4",
        defaults={"kappa": 0.7, "gamma": 0.5},
        cost_class="dpdisk",
    ),
    # D2P2's decaying noise sigma_k = sigma / sqrt(k) is accounted in segments where sigma_k varies
    # by at most 0.3% (bucket_rel 0.003): the bucketed epsilon is within about 0.6% of the exact
    # per-step composition (an upper bound), at a few seconds of calibration
    OptimizerSpec(
        name="d2p2sgd",
        build=Imported("dpbench.optimizers.d2p2:d2p2sgd"),
        private=True,
        description="D2P2-SGD: automatic clipping, random projection P_k drawn every step (srht: sqrt(d'/p) S H D, "
                    "or the paper's Gaussian A_k/sqrt(p)), noise sigma/sqrt(k) * s_P / L in the projected space",
        reference="Jiang et al. 2025 (arXiv:2509.09485) Alg. 1",
        defaults={"auto_clip_gamma": 0.01, "projection_rate": 0.7, **PLAN_HYPERPARAMETERS},
        mechanism=RandomProjectionGaussian(inverse_sqrt_schedule, "inverse-sqrt", 0.003,
                                           accountant=accounting.RDP_INTEGER),
    ),
    OptimizerSpec(
        name="d2psgd",
        build=Imported("dpbench.optimizers.d2p2:d2psgd"),
        private=True,
        description="D2P-SGD: automatic clipping and decaying noise sigma/sqrt(k) / L, no projection",
        reference="Jiang et al. 2025 (arXiv:2509.09485) Alg. 2 (D2P-SGD: no projection)",
        defaults={"auto_clip_gamma": 0.01},
        mechanism=PoissonSubsampledGaussian(inverse_sqrt_schedule, "inverse-sqrt", 0.003,
                                            accountant=accounting.RDP_INTEGER),
        cost_class="dpsgd",
    ),
    OptimizerSpec(
        name="dp2sgd",
        build=Imported("dpbench.optimizers.d2p2:dp2sgd"),
        private=True,
        description="DP2-SGD: automatic clipping, random projection (srht or Gaussian), static noise sigma s_P / L "
                    "in the projected space",
        reference="Jiang et al. 2025 (arXiv:2509.09485) Alg. 3 (DP2-SGD: static noise)",
        defaults={"auto_clip_gamma": 0.01, "projection_rate": 0.7, **PLAN_HYPERPARAMETERS},
        mechanism=RandomProjectionGaussian(),
    ),
    OptimizerSpec(
        name="dpmatrix-se",
        build=Imported("dpbench.optimizers.dpmatrix:sgd_step"),
        private=True,
        description="single-epoch matrix mechanism: fixed batches, correlated noise C^-1 Z, SGD step",
        reference="Denisov et al. 2022 (fixed-point factorization); thesis 2.2.5 method 1",
        mechanism=MatrixMechanism(single_epoch=True, convergence_aware=False),
        cost_class="dpmatrix-se",
    ),
    OptimizerSpec(
        name="dpmatrix-se-lambda",
        build=Imported("dpbench.optimizers.dpmatrix:sgd_step"),
        private=True,
        description="single-epoch matrix mechanism with the convergence-aware objective Lambda_tau A",
        reference="Koloskova et al. 2023 objective, Denisov et al. 2022 fixed point; thesis 2.2.5 method 3",
        defaults={"tau": None},  # tau None: tau = T
        mechanism=MatrixMechanism(single_epoch=True, convergence_aware=True),
        cost_class="dpmatrix-se",
    ),
    OptimizerSpec(
        name="dpmatrix-me",
        build=Imported("dpbench.optimizers.dpmatrix:sgd_step"),
        private=True,
        description="multi-epoch matrix mechanism for (k, b) participation: fixed batches, correlated noise, SGD step",
        reference="Choquette-Choo et al. 2023 (dual optimization); thesis 2.2.5 method 2",
        mechanism=MatrixMechanism(single_epoch=False, convergence_aware=False),
        cost_class="dpmatrix-se",
    ),
    OptimizerSpec(
        name="dpmatrix-me-lambda",
        build=Imported("dpbench.optimizers.dpmatrix:sgd_step"),
        private=True,
        description="multi-epoch matrix mechanism with the convergence-aware objective Lambda_tau A",
        reference="Koloskova et al. 2023 objective, Choquette-Choo et al. 2023 dual; thesis 2.2.5 method 3",
        defaults={"tau": None},  # tau None: tau = T
        mechanism=MatrixMechanism(single_epoch=False, convergence_aware=True),
        cost_class="dpmatrix-se",
    ),
    OptimizerSpec(
        name="dpmatrix-band",
        build=Imported("dpbench.optimizers.streamed:sgd_step"),
        private=True,
        description="banded Toeplitz matrix mechanism (BandMF), fixed epoch order, streamed correlated noise, SGD step",
        reference="Choquette-Choo et al. 2023 (arXiv 2306.08153); McKenna 2024 (arXiv 2405.15913)",
        defaults={"bands": "auto"},  # auto: min(64, N // L, T)
        mechanism=BandedMechanism(),
        cost_class="dpmatrix-se",
    ),
    OptimizerSpec(
        name="dpmatrix-band-amp",
        build=Imported("dpbench.optimizers.streamed:sgd_step"),
        private=True,
        description="amplified BandMF: cyclic Poisson sampling over b groups, streamed banded correlated noise, SGD step",
        reference="Choquette-Choo et al. 2023, Alg. 2 and Thm. 4 (arXiv 2306.08153)",
        defaults={"bands": "auto"},  # auto: b minimising sigma_b sqrt(err_mean) for the target epsilon
        mechanism=AmplifiedBandedMechanism(),
        cost_class="dpmatrix-se",
    ),
    OptimizerSpec(
        name="dpmatrix-blt",
        build=Imported("dpbench.optimizers.streamed:sgd_step"),
        private=True,
        description="buffered linear Toeplitz (BLT) matrix mechanism, fixed epoch order, streamed noise, SGD step",
        reference="Dvijotham et al. 2024 (arXiv 2404.16706); McMahan et al. 2024 (arXiv 2408.08868)",
        defaults={"buffers": "auto"},  # auto: grow m while the loss improves by > 1% (at most 8)
        mechanism=BLTMechanism(),
        cost_class="dpmatrix-se",
    ),
)

OPTIMIZERS: Registry = Registry(GROUP, {spec.name: spec for spec in BUILT_IN})


def get_optimizer(name: str) -> OptimizerSpec:
    """The spec of ``name``: a KeyError naming the choices for an unknown one, a one-line
    ``dpbench.plugins.PluginError`` (a ValueError) for a plugin that failed to load."""
    return OPTIMIZERS.lookup(name)
