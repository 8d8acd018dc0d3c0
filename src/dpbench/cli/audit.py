"""``dpbench audit`` (the empirical privacy audit of one optimizer, ``AUDIT_HELP``) and
``dpbench audits`` (audit files collected into one table)."""

from __future__ import annotations

import argparse

from dpbench import log
from dpbench.cli.arguments import (audit_seed, check_output, hyperparameter, positive_float, positive_int,
                                   probability)

_LOG = log.get(__name__)


def add_parsers(sub) -> None:
    from dpbench.privacy import accounting

    au = sub.add_parser("audit", help="empirical privacy audit of an optimizer (lower bound on epsilon, "
                                      "violation test)", description=AUDIT_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    au.add_argument("--optimizer", help="a private optimizer of the registry")
    au.add_argument("--epsilon", type=positive_float, help="the claimed epsilon (sigma is calibrated for it)")
    au.add_argument("--hp", type=hyperparameter, action="append", metavar="KEY=VALUE", help="optimizer hyperparameter")
    au.add_argument("--trials", type=positive_int, default=2000, help="R: trials, half with the canary (even)")
    au.add_argument("--mode", default="trials", choices=["trials", "one-run"],
                    help="trials (default) or one-run (Steinke et al. 2023: 1000 canaries in one run; a smoke "
                         "test, never flags)")
    au.add_argument("--beta", type=probability, default=0.05, help="false-alarm probability of the audit")
    au.add_argument("--delta", type=probability, default=accounting.DELTA)
    au.add_argument("--accountant", default=accounting.DEFAULT_ACCOUNTANT, choices=accounting.ACCOUNTANTS,
                    help="the accountant sigma is calibrated with and whose privacy profile is tested")
    au.add_argument("--seed", type=audit_seed, default=0, help="the audit's seed, at most 2**63 - 1 (its record's "
                    "int64 column, as the config's audit.seed)")
    au.add_argument("--out", help="output .parquet (written atomically)")
    au.add_argument("--cache-dir", help="where matrix factorizations are cached (as for dpbench train)")
    au.add_argument("--threads", type=positive_int, help="torch CPU threads")
    au.add_argument("--self-test", action="store_true", help="audit the built-in mutants and correct mechanisms")
    au.set_defaults(func=cmd_audit)

    at = sub.add_parser("audits", help="collect audit files (dpbench audit) into one table")
    at.add_argument("audits", nargs="+", help="audit .parquet files")
    at.add_argument("--out", required=True)
    at.set_defaults(func=cmd_audits)


def cmd_audits(args) -> int:
    from dpbench.reporting.audits import aggregate_audits, markdown

    table = aggregate_audits(args.audits, args.out)
    print(markdown(table), end="")
    _LOG.info(f"wrote {args.out}: {len(table)} audits, {int(table['violation'].sum())} with a violation")
    return 0


def cmd_audit(args) -> int:
    if args.out:
        check_output(args.out, "--out")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.self_test:
        from dpbench.audit.selftest import self_test

        return 0 if self_test(seed=args.seed, cache_dir=args.cache_dir) else 1
    missing = [flag for flag, value in (("--optimizer", args.optimizer), ("--epsilon", args.epsilon),
                                        ("--out", args.out)) if value is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} required (or --self-test)")
    from dpbench.audit.run import audit
    from dpbench.optimizers import get_optimizer
    from dpbench.reporting.results import write_table

    spec = get_optimizer(args.optimizer)
    rows, record = audit(spec, args.epsilon, args.trials, args.mode, args.beta, args.seed, dict(args.hp or []),
                         args.delta, args.accountant, cache_dir=args.cache_dir,
                         log=lambda m: _LOG.info(f"[audit] {m}"))
    write_table(rows, args.out, meta={"audit": record})
    verdict = ("VIOLATION: the claim is refuted" if record["violation"] else "no violation found")
    sens = record["checks"]["sensitivity"]
    own = ", ".join(f"{stage} ({origin})" for stage, origin in record["claim"]["stages"].items()) or "none"
    _LOG.info(f"sensitivity check: one example moved the clipped sum by at most "
              f"{sens['max_moved_per_sensitivity']:.6g} times the claimed sensitivity ({sens['cases']} cases, "
              f"{len(sens['layers'])} layers; worst: {sens['worst_case']}): {'ok' if sens['ok'] else 'VIOLATION'}; "
              f"the step's own stages: {own}")
    _LOG.info(f"wrote {args.out}: {spec.name} claimed eps = {record['epsilon_claimed']:g} "
              f"(delta = {record['delta']:g}); eps_lower = {record['epsilon_lower']:.3f}, "
              f"eps_gdp = {record['epsilon_gdp']:.3f}; {verdict} (beta = {record['beta']:g}, R = {record['trials']})")
    return 0


AUDIT_HELP = """Empirical privacy audit of one optimizer at one claim (epsilon, delta), through the same
harness a training cell uses (its sampler, per-sample gradients, clipping, noise, sigma
calibration, optimizer state, factorization), on a synthetic audit problem whose per-sample
gradients are controlled: a linear loss <theta, x_i>, d = 9, N = 100 other examples, L = 5,
T = 200 steps, and a canary whose gradient is M e_c (M = 10 C; 100 C for DP-Dice) in a
coordinate no other example touches. R trials, R/2 with the canary and R/2 without
(add/remove neighbours; zero-out for matrix mechanisms), each with fresh seeds.

Reports, with confidence 1 - beta jointly (Clopper-Pearson bounds with a union bound over the
pre-registered statistics {primary, S_diff} and quantile levels {1, 2, 4, ...}):
  (A) epsilon_lower: an assumption-free lower bound on the epsilon of the mechanism;
  (B) violation: true if the measured error rates leave the claim's whole privacy profile
      delta*(eps) (from the run's own accountant), or if the loader's realised participation
      exceeds the accounted sensitivity (matrix mechanisms), or if one example moves the
      optimizer's clipped sum by more than the claimed sensitivity on a model of several
      layers (the white-box sensitivity check, every mode); a correct mechanism is flagged
      with probability <= beta;
  (C) epsilon_gdp: a tightness estimate from Gaussian DP (sound only for exactly Gaussian
      mechanisms; a heuristic under subsampling: reported, never used to flag).
An audit can only refute a claim or give a lower bound; it never proves privacy. With R
trials no epsilon above max_certifiable_epsilon (recorded) can be certified.

Output: Parquet, one row per trial and statistic (trial int64, canary_in bool, statistic
string, score float64); metadata JSON under the key "dpbench", object "audit": epsilon_claimed,
delta, beta, trials, mode, statistics, levels, epsilon_lower, violation, epsilon_gdp,
canary_norm, checks (post-processing, participation, sensitivity), claim (sigma, q, T,
sensitivity, accountant, the step's own stages, ...), the per-(statistic, level) bounds table.

--self-test audits built-in mutants (noise / sqrt(T), no clipping, sigma for q/2, reused
noise, participation reshuffled every epoch), DP-Dice at its published calibration and
unmodified mechanisms, prints a table, and exits non-zero unless every mutant (and DP-Dice)
is flagged and no correct mechanism is.
"""
