"""The plugin's own tests, through dpbench's harness (the same assembly as a training cell):
momentum 0 is dpbench's DP-SGD step for step; momentum mu carries mu times the velocity;
a resumed step continues as if never stopped. Run with the plugin installed:
``python -m pytest examples/plugin/tests``."""

import torch
import torch.nn.functional as F

from dpbench.plugin import PlanRequest, assemble, get_optimizer
from dpbench_example.momentum import DPSGD_MOMENTUM

N, L, EPOCHS = 64, 8, 1  # T = 8 Poisson-sampled steps


def data(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, 6, generator=gen), torch.randint(0, 3, (N,), generator=gen)


def cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none"), None


def build(spec, hyperparameters, sigma=0.8, loss=cross_entropy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    plan = spec.mechanism.plan(PlanRequest(N, L, EPOCHS))
    parts = assemble(spec, plan, model, loss, lr=0.5, noise_multiplier=sigma, clip_norm=1.0,
                     normalize_clipping=True, hyperparameters=hyperparameters, noise_seed=1, sampler_seed=2,
                     n_train=N, device="cpu")
    return model, plan, parts


def trajectory(spec, hyperparameters, sigma=0.8):
    """The parameters after each step of one run."""
    model, plan, parts = build(spec, hyperparameters, sigma)
    x, y = data()
    out = []
    for _ in range(plan.steps):
        idx = parts.sampler.sample()
        parts.step(x[idx], y[idx])
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def test_momentum_zero_is_dpsgd_step_for_step():
    dpsgd = trajectory(get_optimizer("dpsgd"), None)
    zero = trajectory(DPSGD_MOMENTUM, {"momentum": 0.0})
    assert len(dpsgd) == len(zero) == 8
    for a, b in zip(dpsgd, zero):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    # with momentum the first step is DP-SGD's (v_1 = g_1) and the second is not
    heavy = trajectory(DPSGD_MOMENTUM, None)
    assert all(torch.equal(p, q) for p, q in zip(dpsgd[0], heavy[0]))
    assert not all(torch.equal(p, q) for p, q in zip(dpsgd[1], heavy[1]))


def test_a_constant_gradient_accelerates_by_one_plus_mu():
    """loss_i = sum of the outputs: every example's gradient is the same constant, so with
    sigma = 0 the k-th update is lr (1 + mu + ... + mu^(k-1)) g: 1, 1.9, 2.71 times the first."""
    def linear(model, x, y):
        return model(x).sum(1), None

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2, bias=False)
    plan = DPSGD_MOMENTUM.mechanism.plan(PlanRequest(N, L, EPOCHS))
    parts = assemble(DPSGD_MOMENTUM, plan, model, linear, lr=0.1, noise_multiplier=0.0, clip_norm=1.0,
                     normalize_clipping=True, hyperparameters=None, noise_seed=1, sampler_seed=2, n_train=N,
                     device="cpu")
    x = torch.ones(L, 3)  # a full batch every step: the mean gradient is the same at every step
    before, updates = model.weight.detach().clone(), []
    for _ in range(3):
        parts.step(x, None)
        updates.append(before - model.weight.detach())
        before = model.weight.detach().clone()
    ratios = [float(u.sum() / updates[0].sum()) for u in updates]
    assert abs(ratios[1] - 1.9) < 1e-6 and abs(ratios[2] - 2.71) < 1e-6


def test_a_resumed_run_continues_exactly():
    full = trajectory(DPSGD_MOMENTUM, None)
    model, plan, parts = build(DPSGD_MOMENTUM, None)
    x, y = data()
    for _ in range(3):
        idx = parts.sampler.sample()
        parts.step(x[idx], y[idx])
    state, sampler_state = parts.step.state_dict(), parts.sampler.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    model2, _, resumed = build(DPSGD_MOMENTUM, None)
    with torch.no_grad():
        for p, saved in zip(model2.parameters(), params):
            p.copy_(saved)
    resumed.step.load_state_dict(state)
    resumed.sampler.load_state_dict(sampler_state)
    for t in range(3, plan.steps):
        idx = resumed.sampler.sample()
        resumed.step(x[idx], y[idx])
    assert all(torch.equal(p.detach(), q) for p, q in zip(model2.parameters(), full[-1]))
