"""Audit trials run through the training harness itself.

An audit of one optimizer at one claim runs R trials of its mechanism on a small synthetic
problem, half with a canary example ("in") and half without ("out"), and records what a
white-box adversary sees: the releases r_t, i.e. the privatised mean gradients that the
harness hands to the optimizer's update rule (Nasr et al. 2023, arXiv 2302.07956).

Nothing of the mechanism is re-implemented here: ``dpbench.training`` (calibration.calibrate, harness.assemble)
builds it exactly as for a training cell, from the optimizer's own ``OptimizerSpec``, which builds
its step from a ``Context`` exactly as a training cell does: its mechanism plans the run,
calibrates sigma, draws the batches and the noise; its step forms per-sample gradients with
the harness's tape, clips, adds noise and keeps its state (Dice's residual, DiSK's filter,
D2P2's projection, the matrix mechanisms' factorization and noise). Only the problem is
synthetic, so that the per-sample gradients are controlled:

* the model is linear, loss_i = <theta, x_i>, so example i's gradient is x_i whatever theta;
* coordinate c = 0 is reserved for the canary: every other example has 0 there (and norm
  <= C; D2P2's projection mixes coordinates, so there they are 0 altogether: DP is a
  worst case over datasets, so choosing them is allowed);
* the canary's gradient is M e_c with M >= 10 C, so clipping acts.

Trials run side by side as lanes (``Context.lanes``): the linear model holds one row of
parameters per trial, examples are indexed lane-major, and the harness's samplers, noise
sources and per-lane norms/projections make the lanes independent replicas. A chunk of
lanes is one pass through the harness; chunks get fresh seeds (every random stream of
every trial is fresh: matrix noise files are written per chunk, never shared).

Neighbours are those of the claim: add/remove for Poisson-sampled mechanisms (the canary is
an extra example N + 1 with its own Bernoulli(q) each step; out-trials have no canary, which
for the release is the same as a zero gradient), zero-out for the matrix mechanisms (the
canary occupies a batch slot; out-trials give it a zero gradient).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dpbench.audit.statistics import get_statistic
from dpbench.privacy import accounting
from dpbench.privacy.clipping import Clipping
from dpbench.matrix.store.cache import default_cache_dir
from dpbench.mechanisms.base import AuditSpec, Plan, PlanRequest, PrivacyClaim
from dpbench.training.calibration import calibrate
from dpbench.training.harness import assemble
from dpbench.optimizers.spec import OptimizerSpec



AUDIT_LR = 0.1  # the update rule's step size: irrelevant to the releases of a linear loss


@dataclass(frozen=True)
class AuditProblem:
    """The synthetic problem every audit runs on: d coordinates, N other examples, expected
    batch size L, T steps (multi-epoch mechanisms: E = T L / N epochs; single-epoch ones:
    N = T L examples, one epoch). Small on purpose: the power of the test does not depend on
    d or N (isotropic noise, the canary alone in its coordinate), only on the claim and R."""

    dimension: int = 9
    examples: int = 100
    batch_size: int = 5
    steps: int = 200

    def __post_init__(self):
        if self.dimension < 2:
            raise ValueError("the audit problem needs d >= 2 (one coordinate is the canary's)")
        if (self.steps * self.batch_size) % self.examples:
            raise ValueError(f"T L = {self.steps * self.batch_size} must be a multiple of N = {self.examples}")


@dataclass(frozen=True)
class Claim:
    """What the harness promises for the audited run: its own ``PrivacyClaim`` (``privacy``:
    plan, sigma, delta, accountant, read from it, never restated; its profile is what the audit
    tests), the epsilon it is audited at, and the release's sensitivities."""

    privacy: PrivacyClaim
    epsilon: float  # the target asked for, or what the claim reports for a given sigma
    clip_sensitivity: float  # s: the norm bound of one clipped per-sample gradient
    strategy: np.ndarray | None = None  # C (T x T) of correlated-noise mechanisms: the release is C G + sigma s Z
    strategy_sensitivity: float | None = None  # sens(C) the noise is calibrated for
    clip_norm: float = 1.0  # C (normalised clipping: every clipped gradient has norm <= 1)

    @property
    def plan(self) -> Plan:
        return self.privacy.plan

    @property
    def noise_multiplier(self) -> float:
        return self.privacy.noise_multiplier

    @property
    def delta(self) -> float:
        return self.privacy.delta

    @property
    def accountant(self) -> str:
        """The accountant the run names (a mechanism may account with its own: its record says so)."""
        return self.privacy.accountant.name


@dataclass
class Trials:
    """The adversary's view of R trials: y[t, r] = L <r_t, e_c> (sum units) for trial r."""

    y: np.ndarray  # (T, R)
    canary_in: np.ndarray  # (R,) bool
    noise_std: np.ndarray  # (T,) claimed std of the noise on the clipped sum at each step
    claim: Claim
    audit: AuditSpec
    canary_norm: float
    pattern: np.ndarray | None = None  # zero-out families: each canary's steps (T, R), 0/1
    signal: np.ndarray | None = None  # claimed per-step canary signal a_t where it is not s (projections)
    participation_check: dict[str, Any] | None = None
    postprocessing: bool | None = None  # the update rule read nothing but the releases
    seconds: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)


class LinearAudit(nn.Module):
    """loss_i = <theta_{lane(i)}, x_i>: one parameter row per lane, no bias."""

    per_sample_forward = True  # example i's output depends on x_i only

    def __init__(self, dimension: int, lanes: int, dtype=torch.float64):
        super().__init__()
        self.linear = nn.Linear(dimension, lanes, bias=False, dtype=dtype)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return self.linear(x)


def linear_loss(model: nn.Module, x: torch.Tensor, lane: torch.Tensor):
    """Per-sample loss <theta_lane, x> (the harness's loss signature: (model, x, y))."""
    return model(x).gather(1, lane.view(-1, 1)).squeeze(1), None


class ReleaseRecorder:
    """Wraps an update rule: records the canaries' coordinates of every lane's release (the mean gradient
    the rule is given) and, for the first ``keep`` lanes, the whole release (for the
    post-processing check), then updates as the rule would."""

    def __init__(self, rule, lanes: int, steps: int, canaries: int = 1, keep: int = 0):
        self.rule = rule
        self.canaries = canaries
        self.y = torch.zeros(steps, lanes, canaries, dtype=torch.float64)
        self.kept: list[list[torch.Tensor]] = []
        self.keep = keep
        self.t = 0

    def __getattr__(self, name):  # DiSK reads its filter's direction through step.rule
        return getattr(self.rule, name)

    def update(self, params, grads):
        self.y[self.t] = grads[0][:, : self.canaries].detach().to(torch.float64)
        if self.keep:
            self.kept.append([g[: self.keep].detach().clone() for g in grads])
        self.t += 1
        return self.rule.update(params, grads)

    def state_dict(self):
        return self.rule.state_dict()

    def load_state_dict(self, state):
        self.rule.load_state_dict(state)


def audit_spec(spec: OptimizerSpec) -> AuditSpec:
    """Which release and statistic audit this optimizer: the spec's own, else its mechanism's."""
    if not spec.private:
        raise ValueError(f"optimizer {spec.name!r} is not private: there is no privacy claim to audit")
    audit = spec.audit or getattr(spec.mechanism, "audit", None)
    if audit is None or not hasattr(spec.mechanism, "privacy_profile"):
        raise ValueError(f"optimizer {spec.name!r}: its mechanism {type(spec.mechanism).__name__} does not say how "
                         "to audit it (its mechanism needs a `privacy_profile` method and an `audit` AuditSpec, "
                         "or its OptimizerSpec an `audit`)")
    try:
        get_statistic(audit.statistic)
    except ValueError as exc:
        raise ValueError(f"optimizer {spec.name!r}: AuditSpec.statistic: {exc}") from None
    return audit


def problem_size(spec: OptimizerSpec, problem: AuditProblem) -> tuple[int, int]:
    """(N, E) for a mechanism: single-epoch mechanisms see every example once."""
    if getattr(spec.mechanism, "single_epoch", False):
        return problem.steps * problem.batch_size, 1
    return problem.examples, problem.steps * problem.batch_size // problem.examples


def make_claim(spec: OptimizerSpec, epsilon: float | None, hyper: dict, problem: AuditProblem, delta: float,
               accountant: str, clip_norm: float, cache_dir: str, noise_multiplier: float | None = None) -> Claim:
    """Plan the audited run and calibrate sigma exactly as a training cell does (or take the
    given sigma; the claim is then the epsilon the mechanism's accountant reports for it)."""
    n, epochs = problem_size(spec, problem)
    plan = spec.mechanism.plan(PlanRequest(n, problem.batch_size, epochs, hyperparameters=hyper,
                                           target_epsilon=epsilon, delta=delta, cache_dir=cache_dir))
    if plan.steps != problem.steps:
        raise ValueError(f"{spec.name}: the mechanism plans {plan.steps} steps, the audit problem {problem.steps}")
    privacy = calibrate(spec, plan, target_epsilon=epsilon, noise_multiplier=noise_multiplier, delta=delta,
                        accountant=accountant)
    if noise_multiplier is not None:  # the claim is what the accountant reports for the given sigma
        epsilon = privacy.epsilon()
    strategy = sens = None
    if hasattr(spec.mechanism, "strategy_matrix"):
        strategy = np.asarray(spec.mechanism.strategy_matrix(plan), dtype=np.float64)
        sens = spec.mechanism.strategy_sensitivity(plan) if hasattr(spec.mechanism, "strategy_sensitivity") else None
    return Claim(privacy, epsilon, Clipping(clip_norm).sensitivity, strategy, sens, clip_norm)


def _worst_batch(strategy: np.ndarray, batches: int) -> int:
    """j* = argmax_j ||C u_j||: the fixed batch whose participation pattern C stretches most."""
    steps = strategy.shape[0]
    u = np.zeros((steps, batches))
    u[np.arange(steps), np.arange(steps) % batches] = 1.0
    return int(np.argmax(np.linalg.norm(strategy @ u, axis=0)))


def _canary_slots(audit: AuditSpec, claim: Claim, sampler, n_lane: int, lanes: int, canaries: int) -> torch.Tensor:
    """(lanes, m): the example index of each canary. Add/remove: m extra examples at the end
    of each lane. Zero-out: m of the lane's N slots; with one canary, the slot that the
    loader puts in the worst batch j* (all other examples are alike, so choosing which example
    is the canary after the shuffle is the same as the loader putting it there)."""
    base = torch.arange(lanes).view(-1, 1) * n_lane
    if audit.neighbours == "add/remove":
        return base + (n_lane - canaries) + torch.arange(canaries)
    if canaries == 1 and hasattr(sampler, "batches"):
        worst = _worst_batch(claim.strategy, sampler.batches.shape[0])
        return sampler.batches[worst].cpu().view(lanes, -1)[:, :1].clone()
    return base + torch.arange(canaries)


def run_chunk(spec: OptimizerSpec, audit: AuditSpec, claim: Claim, hyper: dict, problem: AuditProblem,
              canary_in: np.ndarray, seed: int, canary_norm: float, keep: int = 0) -> dict[str, Any]:
    """One pass through the harness with ``canary_in.shape[0]`` lanes of m = canary_in.shape[1]
    canaries each (canary j's gradient is M e_j; m = 1 in trials mode). Returns y (T, lanes, m)
    in sum units, the canaries' realised participation (T, lanes, m), the claimed noise std
    per step, and the recorder, step and sampler."""
    canary_in = np.asarray(canary_in, dtype=bool).reshape(len(canary_in), -1)
    lanes, m = canary_in.shape
    streams = np.random.SeedSequence(seed).generate_state(4, np.uint64) >> np.uint64(1)
    sampler_seed, noise_seed, data_seed, _ = (int(s) for s in streams)
    n_total, _ = problem_size(spec, problem)
    n_lane = n_total + (m if audit.neighbours == "add/remove" else 0)
    d, L, T = problem.dimension, claim.plan.batch_size, claim.plan.steps
    if m >= d:
        raise ValueError(f"{m} canaries need d > {m} coordinates (the problem has d = {d})")
    model = LinearAudit(d, lanes)
    parts = assemble(spec, claim.plan, model, linear_loss, lr=AUDIT_LR, noise_multiplier=claim.noise_multiplier,
                     clip_norm=claim.clip_norm, normalize_clipping=True, hyperparameters=hyper,
                     noise_seed=noise_seed, sampler_seed=sampler_seed, n_train=n_lane, device="cpu", lanes=lanes)
    step, sampler = parts.step, parts.sampler
    slots = _canary_slots(audit, claim, sampler, n_lane, lanes, m)

    # the data: the others have 0 in the canaries' coordinates and norm in [C/2, C] (0 for
    # projected mechanisms); canary j is M e_j in its in-lanes and 0 elsewhere
    gen = torch.Generator().manual_seed(data_seed)
    x = torch.zeros(lanes * n_lane, d, dtype=torch.float64)
    if not audit.others_zero:
        direction = torch.randn(lanes * n_lane, d - m, generator=gen, dtype=torch.float64)
        norms = claim.clip_sensitivity * (0.5 + 0.5 * torch.rand(lanes * n_lane, 1, generator=gen,
                                                                    dtype=torch.float64))
        x[:, m:] = direction / direction.norm(dim=1, keepdim=True) * norms
    flat = slots.reshape(-1)
    x[flat] = 0.0
    present = torch.from_numpy(canary_in.reshape(-1))
    x[flat[present], torch.arange(m).repeat(lanes)[present]] = canary_norm
    lane_of = torch.arange(lanes).repeat_interleave(n_lane)

    recorder = ReleaseRecorder(step.rule, lanes, T, m, keep)
    step.rule = recorder
    noise_std = np.empty(T)
    participation = np.zeros((T, lanes, m), dtype=bool)
    projected = np.ones((T, lanes, m))  # ||P_t^T e_j|| (1 without a projection)
    std_at = getattr(step, "noise_std_at", None)
    statistic = get_statistic(audit.statistic)
    for t in range(T):
        idx = sampler.sample()
        participation[t] = torch.isin(slots, idx).numpy()
        step(x[idx], lane_of[idx])
        noise_std[t] = std_at(t + 1) if std_at else step.noise_std
        if statistic.projected:
            projected[t] = _projected_canary_norms(step, m)
    y = recorder.y.numpy() * L
    if statistic.projected:
        # the recorder sees P_t r_t; its canary coordinate is <r_t, P_t^T e_j>: divided by
        # ||P_t^T e_j|| it is the release projected on u = P_t^T e_j / ||P_t^T e_j||, whose
        # noise has the claimed std and whose canary signal is s ||P_t^T e_j||
        y = y / projected
    groups = None
    if statistic.grouped:  # cyclic Poisson: the canaries' groups (a public partition)
        groups = sampler.groups.cpu()[slots].numpy()
    return {"y": y, "participation": participation, "noise_std": noise_std, "projected_norms": projected,
            "groups": groups, "recorder": recorder, "step": step, "sampler": sampler}


def _projected_canary_norms(step, canaries: int) -> np.ndarray:
    """(lanes, m): ||P^T e_j|| for this step's projection of each lane (public randomness:
    the step's seeds), canary j on coordinate j."""
    from dpbench.mechanisms import projection

    if step.kind is None:  # no projection (D2P-SGD)
        return np.ones((len(step.last_seeds) or 1, canaries))
    proj = getattr(step, "last_projection", None) or projection.draw(
        step.kind, step.last_seeds, step.dimension, step.projection_dim, "cpu", torch.float64)
    if canaries == 1:
        basis = torch.zeros(len(step.last_seeds), step.dimension, dtype=torch.float64)
        basis[:, 0] = 1.0
        return proj.t(basis).norm(dim=1, keepdim=True).numpy()
    return np.stack([proj.matrix(lane)[:canaries].norm(dim=1).numpy() for lane in range(len(step.last_seeds))])


def _remove_noise_file(step) -> None:
    path = getattr(step.ctx.noise, "path", None)
    if path is not None:
        Path(path).unlink(missing_ok=True)
        Path(path).with_suffix(".json").unlink(missing_ok=True)


def run_trials(spec: OptimizerSpec, epsilon: float, trials: int, seed: int = 0, hyper: dict | None = None,
               problem: AuditProblem = AuditProblem(), delta: float = accounting.DELTA,
               accountant: str = accounting.DEFAULT_ACCOUNTANT, clip_norm: float = 1.0, lanes: int = 128,
               cache_dir: str | None = None, log=None, noise_multiplier: float | None = None) -> Trials:
    """R trials of ``spec`` at the claim (epsilon, delta): R/2 with the canary, R/2 without, in
    chunks of ``lanes`` lanes, each chunk with fresh seeds. With ``noise_multiplier``, sigma is
    given instead of calibrated (epsilon is then ignored)."""
    if trials < 4 or trials % 2:
        raise ValueError(f"trials must be an even number >= 4 (half of them without the canary, at least 2), "
                         f"got {trials}")
    t0 = time.perf_counter()
    audit = audit_spec(spec)
    hyper = spec.hyperparameters(hyper)
    # factorizations are cached like a training cell's; noise files are fresh per chunk
    # and deleted after it
    claim = make_claim(spec, epsilon, hyper, problem, delta, accountant, clip_norm,
                       str(cache_dir or default_cache_dir()), noise_multiplier)
    canary_norm = audit.canary_factor * clip_norm
    # the in/out bits from their own stream: exactly R/2 in
    inout_seq, *chunk_seqs = np.random.SeedSequence(seed).spawn(1 + math.ceil(trials / lanes))
    canary_in = np.zeros(trials, dtype=bool)
    canary_in[np.random.default_rng(inout_seq).permutation(trials)[: trials // 2]] = True
    ys, patterns, norms, groups = [], [], [], []
    for k, start in enumerate(range(0, trials, lanes)):
        chunk_seed = int(chunk_seqs[k].generate_state(1, np.uint64)[0] >> np.uint64(1))
        out = run_chunk(spec, audit, claim, hyper, problem, canary_in[start:start + lanes], chunk_seed,
                        canary_norm)
        _remove_noise_file(out["step"])
        ys.append(out["y"][:, :, 0])
        patterns.append(out["participation"][:, :, 0])
        norms.append(out["projected_norms"][:, :, 0])
        if out["groups"] is not None:
            groups.append(out["groups"][:, 0])
        if log:
            log(f"{spec.name}: trials {min(start + lanes, trials)}/{trials} ({time.perf_counter() - t0:.1f}s)")
    # zero-out families: each trial's realised participation of its canary slot (T, R); the
    # loader's order is public for them (their claim holds for every pattern it can produce)
    pattern = np.concatenate(patterns, axis=1).astype(float) if audit.neighbours == "zero-out" else None
    # projected families: the claimed canary signal at each step, s ||P_t^T e_c|| (T, R)
    projected = get_statistic(audit.statistic).projected
    signal = claim.clip_sensitivity * np.concatenate(norms, axis=1) if projected else None
    extras = {"groups": np.concatenate(groups)} if groups else {}
    return Trials(np.concatenate(ys, axis=1), canary_in, out["noise_std"], claim, audit, canary_norm, pattern,
                  signal, seconds=time.perf_counter() - t0, extras=extras)


# -- deterministic checks ---------------------------------------------------------------------

def sign_worst_norm(strategy: np.ndarray, steps: np.ndarray, enumerate_up_to: int = 12) -> float:
    """max over signs v in {-1, +1}^pi of ||C v|| for one participation pattern pi (a set of
    steps): exact by enumeration for |pi| <= ``enumerate_up_to`` (the global sign is free, so
    2^(|pi|-1) candidates), else the bound sqrt(sum_{s,t in pi} |X_st|), X = C^T C."""
    cols = strategy[:, steps]
    gram = cols.T @ cols
    k = len(steps)
    if k == 0:
        return 0.0
    if k > enumerate_up_to:
        return float(np.sqrt(np.abs(gram).sum()))
    signs = np.array(np.meshgrid(*([[1.0, -1.0]] * (k - 1)), indexing="ij")).reshape(k - 1, -1).T if k > 1 \
        else np.zeros((1, 0))
    v = np.hstack([np.ones((signs.shape[0], 1)), signs])  # (2^(k-1), k)
    return float(np.sqrt(np.einsum("ni,ij,nj->n", v, gram, v).max()))


def participation_check(strategy: np.ndarray, sampler, steps: int, sensitivity: float,
                        rtol: float = 1e-9) -> dict[str, Any]:
    """The deterministic check of a matrix mechanism's participation: run the loader's own
    sampler for the T steps of the run, read every example's realised pattern (the steps it
    was in), and compare the sign-worst ||C v|| over those patterns with the sensitivity the
    noise was calibrated for. A loader that reshuffles every epoch while (k, b) participation
    is accounted fails it; statistics alone would not show it (the sensitivity grows only
    1.1-1.3x)."""
    seen: dict[int, list[int]] = {}
    for t in range(steps):
        for i in sampler.sample().tolist():
            seen.setdefault(i, []).append(t)
    patterns = {tuple(p) for p in seen.values()}
    repeated = [p for p in patterns if len(set(p)) != len(p)]
    worst = max((sign_worst_norm(strategy, np.array(p)) for p in patterns), default=0.0)
    return {"patterns": len(patterns), "examples": len(seen), "max_sign_worst_norm": worst,
            "accounted_sensitivity": float(sensitivity),
            "ok": not repeated and worst <= sensitivity * (1 + rtol)}


def postprocessing_check(spec: OptimizerSpec, claim: Claim, hyper: dict, problem: AuditProblem, seed: int,
                         lanes: int = 4) -> bool:
    """Is the update rule post-processing of the releases? Run ``lanes`` trials recording the
    whole releases, then re-run a fresh update rule from the recorded releases alone (no
    gradients at all): the parameters must come out bit-identical."""
    audit = audit_spec(spec)
    canary_in = np.arange(lanes) % 2 == 0
    out = run_chunk(spec, audit, claim, hyper, problem, canary_in, seed,
                    audit.canary_factor * claim.clip_sensitivity, keep=lanes)
    recorder, step = out["recorder"], out["step"]
    model = LinearAudit(problem.dimension, lanes)
    replay = assemble(spec, claim.plan, model, linear_loss, lr=AUDIT_LR, noise_multiplier=claim.noise_multiplier,
                      clip_norm=claim.clip_norm, normalize_clipping=True, hyperparameters=hyper, noise_seed=0,
                      sampler_seed=0, n_train=problem_size(spec, problem)[0], device="cpu", lanes=lanes).step
    params = [p for p in model.parameters() if p.requires_grad]
    for release in recorder.kept:
        replay.rule.update(params, [r.clone() for r in release])
    original = [p for p in step.model.parameters() if p.requires_grad]
    return all(torch.equal(a.detach(), b.detach()) for a, b in zip(original, params))
