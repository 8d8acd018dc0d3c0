"""Every non-matrix optimizer against its paper.

One table (``OPTIMIZERS_UNDER_TEST``, after optax's ``_OPTIMIZERS_UNDER_TEST``) lists each
optimizer with a literal implementation of its paper's pseudocode written here on flat
vectors; the tests that apply to all optimizers run over it:

* reference steps: noise off, a fixed batch, several steps equal the literal pseudocode
  (per-sample gradients by autograd one example at a time, not from dpbench), under both clipping rules;
* noise: on zero gradients, the injected noise has the std its calibration promises;
* accounting: a real ``dpbench.training.train.run`` records an achieved epsilon <= the target;
* checkpoints: the state is plain tensors/ints and restoring it reproduces the run.

Then equivalences with the same seed and noise on (DiSK kappa = 1, Dice C2 = 0, AdamW-BC
lambda = 0, AdamW lambda = 0), the privacy constants (Phi, Dice's std, the projection bound s,
delta_fail, the decaying schedule), and the fast RDP accountant against Opacus. The projections
themselves are tested in test_projection.py.
"""

from __future__ import annotations

import copy
import functools
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from conftest import run_cell
from dpbench.privacy import accounting
from dpbench.privacy.clipping import Clipping
from dpbench.mechanisms import projection as proj
from dpbench.mechanisms.base import Plan, PlanRequest, PrivacyClaim, Target
from dpbench.mechanisms.poisson_gaussian import PoissonSubsampledGaussian, inverse_sqrt_schedule
from dpbench.optimizers import OPTIMIZERS, get_optimizer
from dpbench.optimizers.base import Context
from dpbench.training.train import RunConfig

DELTA = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one thread


# -- the literal pseudocode, on flat parameter vectors ----------------------------------------
# ``grad_fn(theta)`` gives the (B, d) per-sample gradients at theta; ``st`` is the optimizer's
# state between steps; ``env`` the run's constants. Each returns the new theta.

@dataclass
class Env:
    lr: float
    L: int  # expected batch size (the divisor; deliberately != the batch's B)
    C: float
    normalize: bool
    h: dict
    sigma: float = 0.0
    projection_seeds: Callable[[], int] | None = None  # the step's projection seeds, in order


def clip(G, C, normalize):
    """Thesis eq. 2.8 (normalised) or Abadi et al.'s clipping, row by row."""
    f = 1 / torch.clamp(G.norm(dim=1, keepdim=True) / C, min=1)
    return G * f / (C if normalize else 1)


def sens(env):
    return 1.0 if env.normalize else env.C


def ref_sgd(th, grad_fn, st, env):
    return th - env.lr * grad_fn(th).sum(0) / env.L


def ref_dpsgd(th, grad_fn, st, env):  # thesis Alg. 1 (noise off)
    return th - env.lr * clip(grad_fn(th), env.C, env.normalize).sum(0) / env.L


def _moments(g, st, h):
    st["t"] = t = st.get("t", 0) + 1
    st["m"] = h["beta1"] * st.get("m", torch.zeros_like(g)) + (1 - h["beta1"]) * g
    st["v"] = h["beta2"] * st.get("v", torch.zeros_like(g)) + (1 - h["beta2"]) * g * g
    return st["m"] / (1 - h["beta1"] ** t), st["v"] / (1 - h["beta2"] ** t)


def _private_mean(th, grad_fn, env):
    return clip(grad_fn(th), env.C, env.normalize).sum(0) / env.L


def ref_adam(th, grad_fn, st, env):  # Kingma & Ba, Alg. 1
    m, v = _moments(grad_fn(th).sum(0) / env.L, st, env.h)
    return th - env.lr * m / (v.sqrt() + env.h["eps"])


def ref_adamw(th, grad_fn, st, env):  # Loshchilov & Hutter 2019 (arXiv:1711.05101) Alg. 2, eta_t = 1
    m, v = _moments(grad_fn(th).sum(0) / env.L, st, env.h)
    return th - env.lr * (m / (v.sqrt() + env.h["eps"]) + env.h["weight_decay"] * th)


def ref_opacus_dpsgd(th, grad_fn, st, env):  # Opacus 1.6 DPOptimizer: clip factor min(1, C / (||g|| + 1e-6))
    G = grad_fn(th)
    f = torch.clamp(env.C / (G.norm(dim=1, keepdim=True) + 1e-6), max=1.0)
    return th - env.lr * (G * f).sum(0) / env.L * (sens(env) / env.C)  # rescaled to the run's clipping


def ref_dpadam(th, grad_fn, st, env):  # Tang et al. 2024, DP-Adam
    m, v = _moments(_private_mean(th, grad_fn, env), st, env.h)
    return th - env.lr * m / (v.sqrt() + env.h["eps"])


def ref_dpadambc(th, grad_fn, st, env):  # thesis Alg. 2, line 14
    m, v = _moments(_private_mean(th, grad_fn, env), st, env.h)
    phi = (env.sigma * sens(env) / env.L) ** 2
    return th - env.lr * m / torch.sqrt(torch.clamp(v - phi, min=env.h["zeta"]))


def ref_dpadamw(th, grad_fn, st, env):  # Chooi et al. 2025 (arXiv:2511.07843) Alg. 1, line 10
    m, v = _moments(_private_mean(th, grad_fn, env), st, env.h)
    return th - env.lr * (m / torch.sqrt(v + env.h["eps0"]) + env.h["weight_decay"] * th)


def ref_dpadamw_bc(th, grad_fn, st, env):  # Chooi et al. 2025 Alg. 2, line 10
    m, v = _moments(_private_mean(th, grad_fn, env), st, env.h)
    phi = (env.sigma * sens(env) / env.L) ** 2
    return th - env.lr * (m / torch.sqrt(torch.clamp(v - phi, min=env.h["gamma"])) + env.h["weight_decay"] * th)


def ref_dpdice(th, grad_fn, st, env):  # thesis Alg. 3, the residual on the mean-gradient scale
    # Normalised clipping at C is Abadi clipping at 1 of the gradients divided by C, so the
    # algorithm runs on g / C with thresholds 1 and C2 / C; flat clipping runs it as written.
    u = 1 / env.C if env.normalize else 1.0
    G = grad_fn(th) * u
    C, C2 = env.C * u, env.h["c2"] * u
    e = st.get("e", torch.zeros_like(th))
    g = G.sum(0) / env.L  # line 11, raw mean
    gbar = clip(G, C, False).sum(0) / env.L  # line 12, clipped mean
    if C2 > 0 and e.norm() > 0:
        gbar = gbar + e * min(1.0, C2 / e.norm().item())  # line 14, clip(e, C2)
    st["e"] = e + g - gbar  # line 18
    return th - env.lr * gbar  # line 16, noise off


def ref_dpdisk(th, grad_fn, st, env):  # Zhang et al. 2025 (arXiv:2410.03883) Alg. 3 (thesis Alg. 4), noise off
    kappa, gamma = env.h["kappa"], env.h["gamma"]
    a = (1 - kappa) / (kappa * gamma)
    d = st.get("d", torch.zeros_like(th))
    combined = a * grad_fn(th + gamma * d) + (1 - a) * grad_fn(th)  # line 5
    g = clip(combined, env.C, env.normalize).sum(0) / env.L
    g_tilde = g if "g_tilde" not in st else (1 - kappa) * st["g_tilde"] + kappa * g  # line 6; g~_{-1} = g_0
    new = th - env.lr * g_tilde  # line 7 (SGD)
    st["g_tilde"], st["d"] = g_tilde, new - th  # line 8
    return new


def _auto_clipped_mean(th, grad_fn, env):  # Jiang et al. 2025 (arXiv:2509.09485) Alg. 1, lines 4-5
    G = grad_fn(th)
    return (sens(env) * G / (G.norm(dim=1, keepdim=True) + env.h["auto_clip_gamma"])).sum(0) / env.L


def ref_d2p2sgd(th, grad_fn, st, env):  # Jiang et al. 2025 Alg. 1 line 6 (noise off): P (P^T g)
    g = _auto_clipped_mean(th, grad_fn, env)
    p = round(env.h["projection_rate"] * th.numel())
    P = proj.matrix(env.h["projection"], env.projection_seeds(), th.numel(), p, dtype=th.dtype, device=th.device)
    return th - env.lr * P @ (P.t() @ g)


def ref_d2psgd(th, grad_fn, st, env):  # Jiang et al. 2025 Alg. 2, D2P-SGD (noise off)
    return th - env.lr * _auto_clipped_mean(th, grad_fn, env)


@dataclass
class Row:
    name: str
    ref: Callable
    lr: float
    hp: Callable[[float], dict] = lambda C: {}  # hyperparameter overrides, given C
    id: str | None = None


OPTIMIZERS_UNDER_TEST = [
    Row("sgd", ref_sgd, 0.5),
    Row("dpsgd", ref_dpsgd, 0.5),
    Row("opacus-dpsgd", ref_opacus_dpsgd, 0.5),
    Row("adam", ref_adam, 0.05),
    Row("adamw", ref_adamw, 0.05, lambda C: {"weight_decay": 0.5}),
    Row("dpadam", ref_dpadam, 0.05),
    Row("dpadambc", ref_dpadambc, 0.01),
    Row("dpadamw", ref_dpadamw, 0.05, lambda C: {"weight_decay": 0.5}),
    Row("dpadamw-bc", ref_dpadamw_bc, 0.01, lambda C: {"weight_decay": 0.5}),
    Row("dpdice", ref_dpdice, 0.5, lambda C: {"c2": 0.05 * C}),
    Row("dpdice", ref_dpdice, 0.5, lambda C: {"c2": 50 * C}, id="dpdice-unclipped-residual"),
    Row("dpdice-strict", ref_dpdice, 0.5, lambda C: {"c2": 0.05 * C}),  # the same algorithm, other noise
    Row("dpdisk", ref_dpdisk, 0.5),
    Row("dpdisk", ref_dpdisk, 0.5, lambda C: {"kappa": 0.6, "gamma": 0.4 / 0.6}, id="dpdisk-one-pass"),
    Row("dpdisk", ref_dpdisk, 0.3, lambda C: {"kappa": 0.5, "gamma": -1.0}, id="dpdisk-storm"),
    Row("d2p2sgd", ref_d2p2sgd, 0.5, lambda C: {"projection": "gaussian"}, id="d2p2sgd-gaussian"),
    Row("d2p2sgd", ref_d2p2sgd, 0.5),
    Row("d2psgd", ref_d2psgd, 0.5),
    Row("dp2sgd", ref_d2p2sgd, 0.5),
]
ROW_IDS = [r.id or r.name for r in OPTIMIZERS_UNDER_TEST]
ROWS = {r.name: r for r in reversed(OPTIMIZERS_UNDER_TEST)}  # one row per optimizer: its default
PRIVATE = [n for n in ROWS if OPTIMIZERS[n].private]
PROJECTED = ("d2p2sgd", "dp2sgd")


def test_every_poisson_optimizer_is_under_test():
    """A new optimizer on the Poisson-subsampled Gaussian is tested by adding one row."""
    poisson = {n for n, s in OPTIMIZERS.builtins.items() if isinstance(s.mechanism, PoissonSubsampledGaussian)}
    assert poisson == set(ROWS)


# The cost class of every built-in optimizer as pipeline/cluster.cost_class guessed it from name
# prefixes before it became a field of the spec (main at df9e1e6): the cluster's time requests
# stay as they were. adamw had none (the prefixes matched only "adam" exactly).
COST_CLASSES = {
    "sgd": "sgd", "adam": "sgd", "adamw": None, "dpsgd": "dpsgd", "d2psgd": "dpsgd", "opacus-dpsgd": None,
    "dpadam": "dpadambc", "dpadambc": "dpadambc", "dpadamw": "dpadambc", "dpadamw-bc": "dpadambc",
    "dpdice": "dpdice", "dpdice-strict": "dpdice", "dpdisk": "dpdisk", "d2p2sgd": None, "dp2sgd": None,
    "dpmatrix-se": "dpmatrix-se", "dpmatrix-se-lambda": "dpmatrix-se", "dpmatrix-me": "dpmatrix-se",
    "dpmatrix-me-lambda": "dpmatrix-se", "dpmatrix-band": "dpmatrix-se", "dpmatrix-band-amp": "dpmatrix-se",
    "dpmatrix-blt": "dpmatrix-se",
}


def test_every_built_in_spec_keeps_its_cost_class():
    assert {name: spec.cost_class for name, spec in OPTIMIZERS.items()} == COST_CLASSES


# -- a small model, its per-sample gradients by torch.func ------------------------------------

class Tiny(nn.Module):
    per_sample_forward = True  # its forward treats each sample on its own (per_sample.check_per_sample)

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc1 = nn.Linear(32, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(F.relu(self.conv(x)).flatten(1))))


def ce_loss(m, x, y):
    logits = m(x)
    return F.cross_entropy(logits, y, reduction="none"), logits.argmax(1) == y


def tiny(dtype=torch.float64, seed=0, device="cpu"):
    torch.manual_seed(seed)
    model = Tiny().to(dtype)
    x = torch.randn(8, 1, 6, 6, dtype=dtype) * 2
    y = torch.randint(0, 3, (8,))
    return model.to(device), x.to(device), y.to(device)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def functional(model, x, y):
    """(grad_fn, loss_fn) of flat parameter vectors, independent of dpbench."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]

    def unflatten(theta):
        return {n: t.view(s) for n, t, s in zip(names, theta.split(sizes), shapes)}

    def grad_fn(theta):  # one example at a time (faster than vmap for a model this small)
        rows = []
        for xi, yi in zip(x, y):
            leaf = theta.detach().clone().requires_grad_(True)
            loss = F.cross_entropy(functional_call(model, unflatten(leaf), (xi[None],)), yi[None])
            rows.append(torch.autograd.grad(loss, leaf)[0])
        return torch.stack(rows)

    def losses(theta):
        return F.cross_entropy(functional_call(model, unflatten(theta), (x,)), y, reduction="none")

    return grad_fn, losses


def make_context(name, model, *, clipping, sigma, L, lr, hp=None, seed=5, n_train=1000, steps=20):
    spec = get_optimizer(name)
    mech = spec.mechanism
    plan = mech.plan(PlanRequest(n_train, L, max(1, round(steps * L / n_train)), hyperparameters=hp, delta=DELTA))
    noise = mech.noise(plan, seed, next(model.parameters()).device)
    ctx = Context(model=model, loss_fn=ce_loss, lr=lr, expected_batch_size=L, noise_multiplier=sigma,
                  clipping=clipping, noise=noise, steps=plan.steps, hyperparameters=spec.hyperparameters(hp))
    return spec.build(ctx), ctx, plan


def projection_seeds(ctx):
    """The seeds the step will draw, from a copy of its noise generator (noise off: nothing else)."""
    gen = torch.Generator(device=ctx.noise.generator.device)
    gen.set_state(ctx.noise.generator.get_state())
    return lambda: proj.step_seeds(gen)[0]


# -- reference steps ----------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "flat"])
@pytest.mark.parametrize("row", OPTIMIZERS_UNDER_TEST, ids=ROW_IDS)
def test_reference_steps(row, normalize, device):
    """Noise off, fixed batch: four steps equal the paper's pseudocode, and the logged losses
    are those at the parameters before each step."""
    model, x, y = tiny(device=device)
    grad_fn, losses_at = functional(model, x, y)
    theta = flat(model)
    C = float(grad_fn(theta).norm(dim=1).median())  # about half the examples are clipped
    L = 10
    step, ctx, _ = make_context(row.name, model, clipping=Clipping(C, normalize), sigma=0.0, L=L, lr=row.lr,
                                hp=row.hp(C))
    env = Env(row.lr, L, C, normalize, ctx.hyperparameters,
              projection_seeds=projection_seeds(ctx) if row.name in PROJECTED else None)
    st: dict = {}
    for k in range(4):
        out = step(x, y)
        torch.testing.assert_close(out.losses, losses_at(theta).detach(), rtol=1e-10, atol=1e-12)
        theta = row.ref(theta, grad_fn, st, env)
        moved = (theta - flat(model)).abs().max()
        torch.testing.assert_close(flat(model), theta, rtol=1e-6, atol=1e-9,
                                   msg=lambda m: f"step {k + 1}, max diff {moved}: {m}")
    assert (flat(model) - flat(tiny(device=device)[0])).abs().max() > 1e-3  # it did move


# -- equivalences, noise on, same seed ------------------------------------------------------------

def batches(x, y, sizes=(8, 5, 0, 7, 8)):
    g = torch.Generator().manual_seed(1)
    for n in sizes:
        idx = torch.randperm(x.shape[0], generator=g)[:n]
        yield x[idx], y[idx]


def run_steps(name, hp=None, sigma=1.3, clipping=Clipping(1.0), lr=0.1, capture=False, dtype=torch.float32,
              device="cpu"):
    model, x, y = tiny(dtype, device=device)
    step, ctx, _ = make_context(name, model, clipping=clipping, sigma=sigma, L=10, lr=lr, hp=hp)
    seen = []
    if capture:  # the privatised gradient going into the update rule, and theta before it
        update = step.rule.update

        def recording(params, grads):
            seen.append((flat(model).clone(), torch.cat([g.reshape(-1) for g in grads]).clone()))
            return update(params, grads)

        step.rule.update = recording
    thetas, stats = [], []
    for xb, yb in batches(x, y):
        stats.append(step(xb, yb).stats)
        thetas.append(flat(model).clone())
    return thetas, seen, stats


@pytest.mark.parametrize("name,hp,twin", [
    ("dpdisk", {"kappa": 1.0}, "dpsgd"),
    ("dpdice", {"c2": 0.0}, "dpsgd"),
    ("dpadamw-bc", {"weight_decay": 0.0}, "dpadambc"),
])
def test_equivalent_step_for_step(name, hp, twin, device):
    a, _, _ = run_steps(name, hp, lr=0.01 if "adam" in name else 0.1, device=device)
    b, _, _ = run_steps(twin, lr=0.01 if "adam" in name else 0.1, device=device)
    for k, (ta, tb) in enumerate(zip(a, b)):
        assert torch.equal(ta, tb), f"step {k + 1}: max diff {(ta - tb).abs().max()}"


def test_dpadamw_without_decay_is_adam_with_eps_inside_the_sqrt():
    thetas, seen, _ = run_steps("dpadamw", {"weight_decay": 0.0}, lr=0.01, capture=True, dtype=torch.float64)
    h = get_optimizer("dpadamw").hyperparameters(None)
    st: dict = {}
    for (theta, g), after in zip(seen, thetas):
        m, v = _moments(g, st, h)
        torch.testing.assert_close(after, theta - 0.01 * m / torch.sqrt(v + h["eps0"]), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["dpadambc", "dpadamw-bc"])
def test_bias_correction_subtracts_the_noise_variance(name):
    """Noise on, flat clipping at C = 2 (sensitivity 2): Phi = (sigma * 2 / L)^2, and the floor
    count equals the number of coordinates where v^ - Phi < floor."""
    sigma, L, lr = 0.4, 10, 0.01
    thetas, seen, stats = run_steps(name, {"weight_decay": 0.1} if "adamw" in name else None, sigma=sigma,
                                    clipping=Clipping(2.0, normalize=False), lr=lr, capture=True, dtype=torch.float64)
    h = get_optimizer(name).hyperparameters({"weight_decay": 0.1} if "adamw" in name else None)
    floor, wd = h.get("zeta", h.get("gamma")), h.get("weight_decay", 0.0)
    phi = (sigma * 2.0 / L) ** 2
    st: dict = {}
    total_hits = 0
    for (theta, g), after, s in zip(seen, thetas, stats):
        m, v = _moments(g, st, h)
        hits = int((v - phi < floor).sum())
        assert s == {"floor_hits": hits, "floor_coordinates": theta.numel()}
        total_hits += hits
        expect = theta - lr * (m / torch.sqrt(torch.clamp(v - phi, min=floor)) + wd * theta)
        torch.testing.assert_close(after, expect, rtol=1e-6, atol=1e-8)
    assert 0 < total_hits < len(seen) * seen[0][0].numel()  # the floor matters here, but not everywhere
    model = tiny(torch.float32)[0]
    for clipping, s in [(Clipping(3.0), 1.0), (Clipping(3.0, normalize=False), 3.0)]:
        step, _, _ = make_context(name, model, clipping=clipping, sigma=1.7, L=64, lr=lr)
        assert step.rule.phi == pytest.approx((1.7 * s / 64) ** 2, rel=1e-12)


# -- DiSK's passes --------------------------------------------------------------------------------

def test_disk_restores_parameters_exactly_and_counts_passes():
    model, x, y = tiny(torch.float32)
    step, _, _ = make_context("dpdisk", model, clipping=Clipping(1.0), sigma=1.0, L=10, lr=0.1)
    assert step(x, y).stats == {"passes": 1.0}  # d_{-1} = 0: one pass
    before = [p.detach().clone() for p in model.parameters()]
    _, out = step.per_sample_gradients(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert out.stats == {"passes": 2.0}
    model, x, y = tiny(torch.float32)
    step, _, _ = make_context("dpdisk", model, clipping=Clipping(1.0), sigma=1.0, L=10, lr=0.1,
                              hp={"kappa": 0.5, "gamma": 1.0})  # a = 1
    step(x, y)
    assert step(x, y).stats == {"passes": 1.0, "loss_only_passes": 1.0}


# -- noise: the std each calibration promises ------------------------------------------------------

def expected_noise_std(name, k, sigma, s, L, h, ctx, plan):
    """Std per coordinate of the noise in the gradient the update rule receives at step k."""
    base = sigma * s / L
    if name == "dpdice":
        return base * math.sqrt(1 + 2 * h["c2"] / ctx.clipping.clip_norm)
    if name == "dpdice-strict":  # the release's true sensitivity s (1 + 2 L C2 / C)
        return base * (1 + 2 * L * h["c2"] / ctx.clipping.clip_norm)
    if name in ("d2p2sgd", "d2psgd", "dp2sgd"):
        if name != "d2psgd":
            d = sum(p.numel() for p in ctx.model.parameters())
            p = round(0.7 * d)
            # P (P^T 0 + e): each coordinate ~ N(0, tau^2 ||row of P||^2), E ||row||^2 = 1 (E[P P^T] = I)
            if h["projection"] == "gaussian":
                t = math.sqrt(2 * math.log(2 * plan.steps / (DELTA / 10)))  # T * 2 exp(-t^2/2) = delta / 10
                base *= 1 + math.sqrt(d / p) + t / math.sqrt(p)
            else:  # srht: exactly sqrt(d'/p), d' the padded size
                base *= math.sqrt(proj.fast_size(d) / p)
        if name != "dp2sgd":
            base /= math.sqrt(k)
    return base


@pytest.mark.parametrize("name", PRIVATE)
def test_noise_std_on_zero_gradients(name, device):  # the Gaussian projection's noise: test_projection.py
    sigma, L, C = 1.7, 32, 2.0  # flat clipping: sensitivity 2
    torch.manual_seed(0)
    model = nn.Linear(100, 100).to(device)  # d = 10,100
    spec = get_optimizer(name)
    plan = spec.mechanism.plan(PlanRequest(1000, L, 2))
    ctx = Context(model=model, loss_fn=lambda m, xb, yb: ((m(xb) * 0).sum(1), None), lr=1.0, expected_batch_size=L,
                  noise_multiplier=sigma, clipping=Clipping(C, normalize=False),
                  noise=spec.mechanism.noise(plan, 3, device), steps=plan.steps,
                  hyperparameters=spec.hyperparameters(None))
    step = spec.build(ctx)
    seen = []
    update = step.rule.update
    step.rule.update = lambda params, grads: (seen.append(torch.cat([g.reshape(-1) for g in grads]).clone()),
                                              update(params, grads))[1]
    ratios = []
    for k in range(1, 4):
        step(torch.randn(L, 100, device=device), None)
        g = seen[-1].double()
        expect = expected_noise_std(name, k, sigma, C, L, ctx.hyperparameters, ctx, plan)
        assert abs(g.mean().item()) < 5 * expect / math.sqrt(g.numel())
        assert g.std().item() == pytest.approx(expect, rel=0.06), f"step {k}"
        ratios.append(g / expect)
    assert torch.cat(ratios).std().item() == pytest.approx(1.0, rel=0.03)


# -- accounting ----------------------------------------------------------------------------------

_epsilon = accounting.epsilon


@functools.lru_cache(maxsize=None)
def _cached(history, delta, accountant):
    return _epsilon(list(history), delta, accountant)


@pytest.fixture
def cached_accountant(monkeypatch):
    """The accountants are deterministic and the same history recurs across optimizers: compute
    each epsilon once per test session."""
    monkeypatch.setattr(accounting, "epsilon", lambda history, delta=DELTA, accountant="prv": _cached(
        tuple(tuple(h) for h in history), delta, accountant))


@pytest.mark.parametrize("name", list(ROWS))
def test_run_meets_its_target_epsilon(name, tiny_fmnist, cached_accountant):
    spec = get_optimizer(name)
    res = run_cell(RunConfig(problem="P2", optimizer=name, lr=0.01, batch_size=60, epochs=2, seed=0,
                        epsilon=2.0 if spec.private else None, max_steps=2, test_subset=50, progress_every_s=1e9))
    p, meta = res.meta["privacy"], res.meta
    assert meta["optimizer"]["hyperparameters"] == spec.defaults
    if not spec.private:
        assert p["epsilon"] == math.inf and p["noise_multiplier"] == 0.0
        return
    assert p["steps"] == 2 and p["planned_steps"] == 20
    assert p["epsilon"] <= p["epsilon_planned"] <= 2.0
    assert p["epsilon_rdp"] >= p["epsilon"] * (1 - 1e-9)
    assert p["caveat"] == spec.caveat
    if name in ("d2p2sgd", "d2psgd"):
        assert p["accountant"] == "rdp" and p["noise_schedule"] == "inverse-sqrt"
    if name in PROJECTED:  # srht (the default): an exact bound, no delta_fail
        assert p["projection"] == "srht" and "delta_fail" not in p and "projection_tail_t" not in p
        assert p["dimension"] == 225_034 and p["projection_dim"] == round(0.7 * 225_034) == 157_524
        assert p["padded_dimension"] == 225_792 == 2**9 * 3**2 * 7**2  # the next 7-smooth size
        assert p["projection_sensitivity_factor"] == pytest.approx(math.sqrt(225_792 / 157_524), rel=1e-12)
        assert p["noise_std_mean_gradient"] == pytest.approx(
            p["noise_multiplier"] * math.sqrt(225_792 / 157_524) / 60, rel=1e-12)
    if name == "dpdice":
        assert p["caveat"].startswith("not a valid DP guarantee")
        assert p["noise_std_mean_gradient"] == pytest.approx(p["noise_multiplier"] * math.sqrt(3) / 60)
    if name == "dpdice-strict":  # sqrt(T) Gaussian compositions, no amplification, sensitivity 1 + 2 L C2 / C
        assert p["noise_multiplier"] == pytest.approx(accounting.gaussian_noise_multiplier(2.0, DELTA, math.sqrt(20)))
        assert p["epsilon_planned"] == pytest.approx(2.0, rel=1e-6) and p["caveat"] is None
        assert p["noise_std_mean_gradient"] == pytest.approx(p["noise_multiplier"] * (1 + 2 * 60) / 60)


def test_gaussian_projection_run_records_its_bound(tiny_fmnist, cached_accountant, monkeypatch):
    """projection: gaussian: s_P = 1 + sqrt(d/p) + t/sqrt(p), delta_fail = delta/10, recorded."""
    name = "d2p2sgd"
    # the P2 model's d x p Gaussian matrix takes a minute per step on a CPU; the accounting does
    # not depend on it (the projection is tested in test_projection.py)
    monkeypatch.setattr(proj.GaussianProjection, "back", lambda self, g, e=None: g.clone())
    res = run_cell(RunConfig(problem="P2", optimizer=name, lr=0.01, batch_size=60, epochs=2, seed=0, epsilon=2.0,
                        max_steps=1, test_subset=50, hyperparameters={"projection": "gaussian"},
                        progress_every_s=1e9))
    p = res.meta["privacy"]
    assert p["projection"] == "gaussian" and p["epsilon_planned"] <= 2.0
    assert p["delta_fail"] == pytest.approx(DELTA / 10) and p["delta_fail"] <= DELTA / 10 * (1 + 1e-9)
    assert p["delta_accounted"] == pytest.approx(0.9 * DELTA)
    assert p["dimension"] == 225_034 and p["projection_dim"] == 157_524 and "padded_dimension" not in p
    assert p["projection_sensitivity_factor"] == pytest.approx(
        1 + math.sqrt(225_034 / 157_524) + p["projection_tail_t"] / math.sqrt(157_524))
    with pytest.raises(ValueError, match="projection must be one of srht, gaussian, got 'dense'"):
        run_cell(RunConfig(problem="P2", optimizer=name, lr=0.01, batch_size=60, epochs=1, seed=0, epsilon=2.0,
                      max_steps=1, hyperparameters={"projection": "dense"}, progress_every_s=1e9))


def test_paper_sensitivity_is_marked_invalid(tiny_fmnist, cached_accountant):
    res = run_cell(RunConfig(problem="P2", optimizer="d2p2sgd", lr=0.01, batch_size=60, epochs=2, seed=0, epsilon=2.0,
                        max_steps=1, test_subset=50, hyperparameters={"paper_sensitivity": True},
                        progress_every_s=1e9))
    p = res.meta["privacy"]
    assert p["caveat"].startswith("not a valid DP guarantee")
    assert "delta_fail" not in p and p["projection_sensitivity_factor"] == 1.0
    with pytest.raises(ValueError, match="'paper_sensitivity' of 'dp2sgd' takes true or false"):
        run_cell(RunConfig(problem="P2", optimizer="dp2sgd", lr=0.01, batch_size=60, epochs=1, seed=0, epsilon=2.0,
                      max_steps=1, hyperparameters={"paper_sensitivity": "yes"}, progress_every_s=1e9))


def test_projection_accounts_at_delta_minus_the_bound_failure():
    """dp2sgd (static noise, the run's accountant) and d2p2sgd (decaying, fast RDP), Gaussian
    projection: calibration and report both use delta - delta_fail, which costs epsilon;
    T * 2 exp(-t^2/2) = delta / 10. srht's bound always holds: accounted at the full delta."""
    q, T = 0.01, 300
    for name, eps_of in [("dp2sgd", lambda s, d: accounting.epsilon([(s, q, T)], d, "rdp")),
                         ("d2p2sgd", lambda s, d: accounting.fast_rdp_epsilon(
                             [(s * inverse_sqrt_schedule(k), q, 1) for k in range(1, T + 1)], d))]:
        mech = get_optimizer(name).mechanism
        plan = mech.plan(PlanRequest(10_000, 100, 3))  # srht
        assert mech.delta_fail(plan) == 0.0 and plan.tail_t is None
        r = PrivacyClaim(mech, plan, 1.0, DELTA, "rdp").spent(T)
        assert "delta_fail" not in r.facts and r.facts["projection"] == "srht"
        assert eps_of(1.0, DELTA) * (1 - 1e-12) <= r.epsilon_spent <= eps_of(1.0, DELTA) * 1.01
        plan = mech.plan(PlanRequest(10_000, 100, 3, hyperparameters={"projection": "gaussian"}, delta=DELTA))
        t = plan.tail_t
        assert T * 2 * math.exp(-t * t / 2) == pytest.approx(DELTA / 10, rel=1e-9)
        assert mech.delta_fail(plan) == pytest.approx(DELTA / 10, rel=1e-9)
        sigma = mech.calibrate(plan, Target(3.0, DELTA, "rdp"))
        r = PrivacyClaim(mech, plan, sigma, DELTA, "rdp").spent(T)
        assert r.facts["delta_accounted"] == pytest.approx(0.9 * DELTA)
        assert r.epsilon_spent <= 3.0
        # accounted at 0.9 delta: more than at delta; buckets are an upper bound of the per-step sum
        exact = eps_of(sigma, 0.9 * DELTA)
        assert exact > eps_of(sigma, DELTA)
        assert exact * (1 - 1e-12) <= r.epsilon_spent <= exact * 1.01
        assert PrivacyClaim(mech, plan, sigma * (1 - 3e-3), DELTA, "rdp").epsilon(T) > 3.0  # the smallest sigma


def test_decaying_schedule_costs_more_than_static_noise():
    mech = get_optimizer("d2psgd").mechanism
    plan = mech.plan(PlanRequest(60_000, 256, 5))
    sigma = mech.calibrate(plan, Target(10.0, DELTA))
    static = accounting.noise_multiplier_for(10.0, plan.sample_rate, plan.steps, accountant="rdp")
    # sigma_k = sigma / sqrt(k) must compose to the target: its first-step sigma is far larger
    assert sigma > 5 * static
    assert accounting.fast_rdp_epsilon(mech.history(plan, sigma, plan.steps)) <= 10.0


# -- the fast RDP accountant ----------------------------------------------------------------------

@pytest.mark.parametrize("q,sigma,T", [(256 / 60000, 1.0, 469), (0.01, 0.6, 1000), (0.2, 3.0, 10),
                                       (1.0, 5.0, 7), (0.001, 20.0, 5), (0.5, 0.3, 3)])
def test_fast_rdp_equals_opacus_at_integer_orders(q, sigma, T):
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    orders = list(accounting.RDP_INTEGER_ORDERS)
    ours = accounting.rdp_subsampled_gaussian([q], [sigma])[0] * T
    theirs = compute_rdp(q=q, noise_multiplier=sigma, steps=T, orders=orders)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-8, atol=0)
    history = [(sigma, q, T), (sigma * 1.5, q / 2, 3)]
    acc = RDPAccountant()
    acc.history = history
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        expect = acc.get_epsilon(DELTA, alphas=orders)
    assert accounting.fast_rdp_epsilon(history) == pytest.approx(expect, rel=1e-9)
    # integer orders are a subset of the run's RDP orders: never below Opacus with all of them
    assert accounting.fast_rdp_epsilon(history) >= accounting.epsilon(history, accountant="rdp") * (1 - 1e-12)


@pytest.mark.xdist_group("timing")  # a measured time: not beside another timed test
def test_fast_rdp_edge_cases_and_speed():
    assert accounting.fast_rdp_epsilon([]) == 0.0
    assert accounting.fast_rdp_epsilon([(0.0, 0.1, 3)]) == math.inf
    assert accounting.fast_rdp_epsilon([(1.0, 0.1, 0)]) == 0.0
    history = get_optimizer("d2p2sgd").mechanism.history(
        Plan(256, 117_188, 256 / 60000), 266.0, 117_188)  # Setup 1's longest run
    assert 1000 < len(history) < 1500
    t = time.perf_counter()
    eps = accounting.fast_rdp_epsilon(history)
    assert time.perf_counter() - t < 2.0 and 5 < eps < 15


# -- checkpoints ------------------------------------------------------------------------------------

def _plain(obj):
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_plain(v) for v in obj)
    return obj is None or isinstance(obj, (torch.Tensor, int, float, bool, str))


@pytest.mark.parametrize("name", list(ROWS))
def test_checkpoint_restores_the_run(name, device):
    def fresh():
        model, x, y = tiny(torch.float32, device=device)
        step, _, _ = make_context(name, model, clipping=Clipping(1.0), sigma=0.8, L=10,
                                  lr=0.01 if "adam" in name else 0.1)
        return model, step, x, y

    model, step, x, y = fresh()
    for _ in range(2):
        step(x, y)
    state = copy.deepcopy(step.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    assert _plain(state)
    for _ in range(2):
        step(x, y)
    model2, step2, _, _ = fresh()
    with torch.no_grad():
        for p, q in zip(model2.parameters(), params):
            p.copy_(q)
    step2.load_state_dict(state)
    for _ in range(2):
        step2(x, y)
    assert torch.equal(flat(model), flat(model2))
