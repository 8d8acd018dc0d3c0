"""``dpbench audit --self-test``: the audit must flag every mutant and no correct mechanism.

Each case is audited exactly as a user's optimizer would be (``run.audit``), at eps* = 2,
beta = 0.05. The correct mechanisms are flagged with probability <= beta each (the
violation test's guarantee); the mutants (``mutants``) with the simulated power noted there,
so the weakest one (sigma for q/2, 85% at R = 2000) gets more trials. The seed is fixed, so
the table is reproducible; the exit status is non-zero if any case comes out wrong.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from dpbench.audit import mutants, run
from dpbench.optimizers import get_optimizer
from dpbench.optimizers.spec import OptimizerSpec


@dataclass(frozen=True)
class Case:
    label: str
    spec: Callable[[], OptimizerSpec]
    expect_violation: bool
    trials: int = 2000
    epsilon: float = 2.0


CASES = (
    Case("dpsgd (correct)", lambda: get_optimizer("dpsgd"), False),
    Case("dpadambc (correct)", lambda: get_optimizer("dpadambc"), False),
    Case("dpdisk (correct)", lambda: get_optimizer("dpdisk"), False),
    Case("dpmatrix-me (correct)", lambda: get_optimizer("dpmatrix-me"), False),
    Case("dpdice (published calibration)", lambda: get_optimizer("dpdice"), True),
    Case("mutant: noise std / sqrt(T) (weighted-workload decoder)", mutants.noise_over_sqrt_t, True),
    Case("mutant: clipping skipped", mutants.no_clipping, True),
    Case("mutant: sigma calibrated for q/2", mutants.half_sample_rate, True, trials=6000),
    Case("mutant: one noise draw reused every step", mutants.reused_noise, True),
    Case("mutant: participation reshuffled every epoch", mutants.reshuffled_participation, True),
    Case("dpmatrix-band-amp, b = 4 (correct)", lambda: _with_defaults("dpmatrix-band-amp", bands=4), False),
    Case("mutant: amplified BandMF accounted at rate L/N", mutants.amplified_rate_l_over_n, True),
    # caught by the white-box sensitivity check, whatever the trials say: few trials suffice
    Case("mutant: each layer clipped at C (per-layer clipping)", mutants.per_layer_clipping, True, trials=400),
)


def _with_defaults(name: str, **defaults) -> OptimizerSpec:
    import dataclasses

    spec = get_optimizer(name)
    return dataclasses.replace(spec, defaults={**spec.defaults, **defaults})


def self_test(seed: int = 0, out=sys.stdout, log=None, cache_dir: str | None = None) -> bool:
    """Runs every case, prints the table, returns whether every verdict was right. The matrix
    cases' factorizations and noise files (tiny) go to ``cache_dir``, by default a fresh
    temporary directory, so that no file of an earlier version can stop the test."""
    if cache_dir is None:
        with tempfile.TemporaryDirectory(prefix="dpbench-selftest-") as tmp:
            return self_test(seed, out, log, tmp)
    header = f"{'case':56s} {'R':>6s} {'eps*':>5s} {'eps_lb':>7s} {'eps_gdp':>7s} {'flagged':>8s} {'expected':>8s} verdict"
    print(header, file=out)
    print("-" * len(header), file=out, flush=True)
    all_right = True
    for case in CASES:
        t0 = time.perf_counter()
        spec = case.spec()
        _, rec = run.audit(spec, case.epsilon, case.trials, seed=seed, cache_dir=cache_dir, log=log)
        right = rec["violation"] == case.expect_violation
        all_right &= right
        how = ""
        if rec["violation"]:
            part, sens = rec["checks"].get("participation", {}), rec["checks"]["sensitivity"]
            how = (f" (participation: max ||Cv|| {part['max_sign_worst_norm']:.3f} > sens {part['accounted_sensitivity']:.3f})"
                   if not part.get("ok", True) else f" ({rec['violation_at'][0]} at level {rec['violation_at'][1]})"
                   if rec["violation_statistical"] else
                   f" (sensitivity: one example moved the clipped sum by {sens['max_moved_per_sensitivity']:.3f} s)")
        print(f"{case.label:56s} {case.trials:6d} {case.epsilon:5g} {rec['epsilon_lower']:7.3f} {rec['epsilon_gdp']:7.2f} "
              f"{str(rec['violation']):>8s} {str(case.expect_violation):>8s} {'ok' if right else 'WRONG'}{how} "
              f"[{time.perf_counter() - t0:.0f}s]", file=out, flush=True)
    print(("self-test passed: every mutant flagged, no correct mechanism flagged" if all_right
           else "self-test FAILED"), file=out, flush=True)
    return all_right
