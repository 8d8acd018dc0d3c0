"""One audit, end to end: trials through the harness -> scores -> bounds -> a Parquet file.

The statistics are pre-registered before any trial runs: the primary statistic of the
mechanism's family (``AuditSpec.statistic`` names one of ``statistics.STATISTICS``) and
S_diff, at the quantile levels of ``bounds.levels``; R, beta and the seed are fixed by the caller. Nothing is tuned on the
scores (no optional stopping, no threshold from a simulation of the claimed mechanism).

Two modes:

* ``trials`` (default): R independent runs, R/2 with the canary; reports (A) epsilon_lower,
  (B) the violation test against the claim's whole privacy profile (false alarm <= beta),
  (C) epsilon_gdp (a tightness estimate; sound only for exactly Gaussian mechanisms).
* ``one-run`` (Steinke, Nasr & Jagielski 2023, arXiv 2305.08846, App. D): ONE run with m
  canaries on distinct coordinates, each in with probability 1/2; the top k+ scores are
  guessed "in", the bottom k- "out". A smoke test with a weaker bound: it never flags.

Both modes also run the deterministic white-box sensitivity check (``sensitivity``: the
optimizer's clipped sum on a model of several layers, moved by one example, against the
claimed sensitivity); its failure is a violation in either mode.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import pandas as pd

from dpbench.audit import bounds, statistics
from dpbench.audit.sensitivity import sensitivity_check
from dpbench.audit.trials import (AuditProblem, Trials, audit_spec, make_claim, participation_check,
                                  postprocessing_check, problem_size, run_chunk, run_trials)
from dpbench.matrix.store.cache import default_cache_dir
from dpbench.optimizers.spec import OptimizerSpec
from dpbench.optimizers.stages import own_stages, step_class
from dpbench.privacy import accounting
from dpbench.plugins import mechanism_origin, record_of

MODES = ("trials", "one-run")


def primary_name(trials: Trials) -> str:
    return statistics.get_statistic(trials.audit.statistic).label


def scores(trials: Trials) -> dict[str, np.ndarray]:
    """The pre-registered statistics of every trial: {primary, S_diff} -> (R,) scores."""
    statistic = statistics.get_statistic(trials.audit.statistic)
    strategy = trials.claim.strategy if statistic.whitened else None
    return {statistic.label: statistic.score(trials), "S_diff": statistics.s_diff(trials.y.T, strategy)}


def claim_record(spec: OptimizerSpec, trials_or_claim, hyper: dict, problem: AuditProblem) -> dict[str, Any]:
    claim = getattr(trials_or_claim, "claim", trials_or_claim)
    plan = claim.plan
    record = {
        "optimizer": spec.name, "hyperparameters": hyper, "mechanism": getattr(spec.mechanism, "name", None),
        "noise_multiplier": claim.noise_multiplier, "sample_rate": plan.sample_rate, "steps": plan.steps,
        "batch_size": plan.batch_size, "clip_sensitivity": claim.clip_sensitivity, "accountant": claim.accountant,
        "caveat": spec.caveat, "mechanism_origin": mechanism_origin(spec.mechanism), "plugin": record_of(spec),
        "stages": own_stages(step_class(spec)),  # the step's own stages (dpbench.optimizers.stages)
        "problem": {"dimension": problem.dimension, "examples": problem_size(spec, problem)[0],
                    "epochs": problem_size(spec, problem)[1], "batch_size": problem.batch_size,
                    "steps": problem.steps},
    }
    if claim.strategy is not None:
        fact = getattr(plan, "factorization", None)
        record.update({"factorization": getattr(fact, "key", type(fact).__name__),
                       "strategy_sensitivity": claim.strategy_sensitivity})
    return record


def audit(spec: OptimizerSpec, epsilon: float, trials: int = 2000, mode: str = "trials", beta: float = 0.05,
          seed: int = 0, hyper: dict | None = None, delta: float = accounting.DELTA,
          accountant: str = accounting.DEFAULT_ACCOUNTANT, problem: AuditProblem | None = None,
          canaries: int = 1000, lanes: int = 128, cache_dir: str | None = None,
          log=None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Audit ``spec`` at the claim (epsilon, delta). Returns the per-trial scores (columns
    trial, canary_in, statistic, score) and the audit record (the ``audit`` metadata)."""
    if mode not in MODES:
        raise ValueError(f"unknown audit mode {mode!r}; choose one of {MODES}")
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a positive finite number, got {epsilon}")
    hyper = spec.hyperparameters(hyper)
    if mode == "one-run":
        return one_run(spec, epsilon, canaries, beta, seed, hyper, delta, accountant, problem, cache_dir)
    problem = problem or AuditProblem()
    tr = run_trials(spec, epsilon, trials, seed, hyper, problem, delta, accountant, lanes=lanes,
                    cache_dir=cache_dir, log=log)
    t0 = time.perf_counter()
    scored = scores(tr)
    profile = tr.claim.privacy.profile()
    result = bounds.analyse({k: (v[tr.canary_in], v[~tr.canary_in]) for k, v in scored.items()}, profile,
                            beta=beta, delta=delta, rng=np.random.default_rng([seed, 1]))
    checks = {"postprocessing": postprocessing_check(spec, tr.claim, hyper, problem, seed),
              "sensitivity": sensitivity_check(spec, tr.claim, hyper, problem_size(spec, problem)[0], seed)}
    if tr.audit.neighbours == "zero-out" and tr.claim.strategy is not None:
        n, _ = problem_size(spec, problem)
        sampler = spec.mechanism.sampler(tr.claim.plan, n, seed, "cpu")
        checks["participation"] = participation_check(tr.claim.strategy, sampler, tr.claim.plan.steps,
                                                      tr.claim.strategy_sensitivity)
    participation_ok = checks.get("participation", {}).get("ok", True)
    sensitivity_ok = checks["sensitivity"]["ok"]
    rows = pd.concat([pd.DataFrame({"trial": np.arange(trials, dtype=np.int64), "canary_in": tr.canary_in,
                                    "statistic": name, "score": values.astype(np.float64)})
                      for name, values in scored.items()], ignore_index=True)
    record = {
        "epsilon_claimed": float(epsilon), "delta": delta, "beta": beta, "trials": trials, "mode": mode,
        "seed": seed, "statistics": list(result.statistics), "levels": list(result.levels),
        "epsilon_lower": result.epsilon_lower, "epsilon_lower_at": result.epsilon_lower_at,
        # (B) the statistical test, or a deterministic check (participation, sensitivity), failed
        "violation": bool(result.violation or not participation_ok or not sensitivity_ok),
        "violation_statistical": result.violation, "violation_at": result.violation_at,
        "epsilon_gdp": result.epsilon_gdp, "mu_lower": result.mu_lower,
        "epsilon_gdp_sound": tr.claim.plan.sample_rate is None,  # exactly Gaussian: q = 1 / matrix
        "canary_norm": tr.canary_norm, "family": dataclasses.asdict(tr.audit),
        "n_in": result.n_in, "n_out": result.n_out, "per_bound_level": result.per_bound_level,
        "max_certifiable_epsilon": bounds.max_certifiable_epsilon(trials, beta, delta, len(scored)),
        "checks": checks, "claim": claim_record(spec, tr, hyper, problem),
        "seconds": {"trials": tr.seconds, "analysis": time.perf_counter() - t0},
        "bounds": result.table.to_dict(orient="list"),
    }
    return rows, record


def one_run(spec: OptimizerSpec, epsilon: float, canaries: int, beta: float, seed: int, hyper: dict,
            delta: float, accountant: str, problem: AuditProblem | None, cache_dir: str | None):
    """Steinke et al.'s one-run audit: m canaries in one run, half of them in at random.

    The problem keeps the claim's (q, T) (and factorization) but has room for the canaries:
    d = m + 8 coordinates, and N = 2 m examples with L = N q (so that q and the matrix
    mechanisms' b = N / L are unchanged). Guesses: the top and bottom m/10 scores each."""
    base = problem or AuditProblem()
    scale = max(1, math.ceil(2 * canaries / base.examples))
    problem = dataclasses.replace(base, dimension=canaries + 8, examples=base.examples * scale,
                                  batch_size=base.batch_size * scale)
    audit_ = audit_spec(spec)
    claim = make_claim(spec, epsilon, hyper, problem, delta, accountant, 1.0, str(cache_dir or default_cache_dir()))
    rng = np.random.default_rng([seed, 2])
    canary_in = rng.random(canaries) < 0.5
    out = run_chunk(spec, audit_, claim, hyper, problem, canary_in[None, :], int(rng.integers(2**62)),
                    audit_.canary_factor * claim.clip_sensitivity)
    y = out["y"][:, 0, :]  # (T, m)
    tr = Trials(y, canary_in, out["noise_std"], claim, audit_, audit_.canary_factor * claim.clip_sensitivity,
                out["participation"][:, 0, :].astype(float) if audit_.neighbours == "zero-out" else None,
                claim.clip_sensitivity * out["projected_norms"][:, 0, :]
                if statistics.get_statistic(audit_.statistic).projected else None)
    primary = scores(tr)[primary_name(tr)]
    k = max(1, canaries // 10)
    order = np.argsort(primary)
    guesses = np.concatenate([order[-k:], order[:k]])
    guessed_in = np.concatenate([np.ones(k, bool), np.zeros(k, bool)])
    correct = int((canary_in[guesses] == guessed_in).sum())
    sensitivity = sensitivity_check(spec, claim, hyper, problem_size(spec, problem)[0], seed)
    eps_lb = bounds.one_run_epsilon(canaries, 2 * k, correct, delta, beta)
    rows = pd.DataFrame({"trial": np.arange(canaries, dtype=np.int64), "canary_in": canary_in,
                         "statistic": primary_name(tr), "score": primary.astype(np.float64)})
    record = {
        "epsilon_claimed": float(epsilon), "delta": delta, "beta": beta, "trials": 1, "mode": "one-run",
        "seed": seed, "statistics": [primary_name(tr)], "levels": [], "canaries": canaries,
        "guesses": 2 * k, "correct": correct, "epsilon_lower": eps_lb, "violation": not sensitivity["ok"],
        "epsilon_gdp": math.nan, "canary_norm": tr.canary_norm, "family": dataclasses.asdict(audit_),
        "checks": {"sensitivity": sensitivity}, "claim": claim_record(spec, claim, hyper, problem),
        "note": "one-run mode is a smoke test: its bound is weaker and never flags a violation (only the "
                "deterministic sensitivity check does)",
    }
    return rows, record
