"""D2P2's projections (``dpbench.mechanisms.projection``): each fast path against an explicit
dense matrix, E[P P^T] = I, the operator norm s_P the noise is scaled by, the released vector's
noise against its calibration, seeds, lanes, checkpoints; and the frozen privacy plan."""

from __future__ import annotations

import copy
import itertools
import math
import dataclasses

import pytest
import torch
from torch import nn

from dpbench.mechanisms import projected_gaussian, projection as proj
from dpbench.mechanisms.base import PlanRequest
from dpbench.privacy.clipping import Clipping
from dpbench.optimizers import get_optimizer
from dpbench.optimizers.base import Context

DELTA = 1e-5
F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one thread


def dense_hartley(n: int) -> torch.Tensor:
    j = torch.arange(n, dtype=F64)
    angle = 2 * math.pi * torch.outer(j, j) / n
    return (torch.cos(angle) + torch.sin(angle)) / math.sqrt(n)


def dense_srht_transpose(p: proj.SRHT, lane: int = 0) -> torch.Tensor:
    """P^T = sqrt(d'/p) S H D restricted to the first d coordinates, as a (p, d) matrix."""
    n, d, k = p.padded_dimension, p.dimension, p.projection_dim
    full = dense_hartley(n)[p.index[lane]] * p.signs[lane].to(F64)  # S H D: rows of H, columns signed
    return math.sqrt(n / k) * full[:, :d]


# -- srht ------------------------------------------------------------------------------------------

def test_hartley_is_the_dense_orthonormal_involution():
    for n in (1, 2, 3, 6, 7, 9, 12):
        H = dense_hartley(n)
        torch.testing.assert_close(H @ H, torch.eye(n, dtype=F64), rtol=0, atol=1e-13)
        x = torch.randn(4, n, dtype=F64)
        torch.testing.assert_close(proj.hartley(x), x @ H.t(), rtol=0, atol=1e-13)


def test_fast_size_is_the_next_7_smooth_integer():
    def smooth(m):
        for q in (2, 3, 5, 7):
            while m % q == 0:
                m //= q
        return m == 1

    for n in range(1, 400):
        assert proj.fast_size(n) == next(m for m in itertools.count(n) if smooth(m))
    assert proj.fast_size(225_034) == 225_792 == 2**9 * 3**2 * 7**2  # P2: d'/d = 1.0034
    assert proj.fast_size(10_000) == 10_000


def test_srht_fast_path_equals_the_explicit_dense_matrix():
    d, k = 61, 40  # d' = 63: two padded coordinates
    p = proj.draw("srht", [7, 8], d, k, dtype=F64)
    assert p.padded_dimension == 63 and p.signs.shape == (2, 63) and p.index.shape == (2, k)
    assert set(p.signs.unique().tolist()) == {-1.0, 1.0}
    assert all(lane.unique().numel() == k for lane in p.index)  # p rows without replacement
    g, e, w = torch.randn(2, d, dtype=F64), torch.randn(2, k, dtype=F64), torch.randn(2, k, dtype=F64)
    for lane in range(2):
        PT = dense_srht_transpose(p, lane)
        torch.testing.assert_close(p.t(g)[lane], PT @ g[lane], rtol=0, atol=1e-12)
        torch.testing.assert_close(p.apply(w)[lane], PT.t() @ w[lane], rtol=0, atol=1e-12)
        torch.testing.assert_close(p.back(g, e)[lane], PT.t() @ (PT @ g[lane] + e[lane]), rtol=0, atol=1e-12)
        seed = (7, 8)[lane]
        torch.testing.assert_close(proj.matrix("srht", seed, d, k), PT.t(), rtol=0, atol=1e-12)
        torch.testing.assert_close(proj.transpose("srht", seed, g[lane], k), PT @ g[lane], rtol=0, atol=1e-12)


def test_srht_expectation_is_the_identity_exactly():
    """E over every sign pattern D and every p-subset S of (d'/p) E^T D H S^T S H D E is I_d:
    all 2^6 * C(6, 4) = 960 draws as lanes, exactly; also for d = 5 padded to d' = 6."""
    n, k = 6, 4
    combos = list(itertools.product(itertools.product((-1.0, 1.0), repeat=n), itertools.combinations(range(n), k)))
    for d in (6, 5):
        p = proj.draw("srht", range(len(combos)), d, k, dtype=F64)
        p.padded_dimension, p.scale = n, math.sqrt(n / k)  # 5 is 7-smooth: pad by hand
        p.signs = torch.tensor([s for s, _ in combos], dtype=F64)
        p.index = torch.tensor([list(c) for _, c in combos])
        acc = torch.zeros(d, d, dtype=F64)
        for i in range(d):  # column i of P P^T for every draw at once
            e_i = torch.zeros(len(combos), d, dtype=F64)
            e_i[:, i] = 1
            acc[:, i] = p.apply(p.t(e_i)).mean(0)
        torch.testing.assert_close(acc, torch.eye(d, dtype=F64), rtol=0, atol=1e-13)


def test_srht_expectation_from_seeds():
    """The seeds' draws are uniform: Monte Carlo E[P P^T] = I within 4.5 standard errors."""
    d, k, draws = 6, 4, 20_000
    p = proj.draw("srht", range(draws), d, k, dtype=F64)
    cols = []
    for i in range(d):
        e_i = torch.zeros(draws, d, dtype=F64)
        e_i[:, i] = 1
        cols.append(p.apply(p.t(e_i)))
    ppt = torch.stack(cols, dim=2)  # (draws, d, d)
    err = (ppt.mean(0) - torch.eye(d, dtype=F64)).abs()
    se = ppt.std(0) / math.sqrt(draws)
    assert (err <= 4.5 * se + 1e-12).all() and err.max() < 0.02, (err, se)


def test_srht_operator_norm_is_exactly_sqrt_padded_over_p():
    # d = d': every singular value of P^T is sqrt(d/p) (S H D has orthonormal rows)
    sv = torch.linalg.svdvals(proj.matrix("srht", 3, 60, 42))
    torch.testing.assert_close(sv, torch.full((42,), math.sqrt(60 / 42), dtype=F64), rtol=1e-12, atol=0)
    assert proj.sensitivity_factor("srht", 60, 42) == pytest.approx(math.sqrt(60 / 42), rel=1e-15)
    # padded (d' = 63 > d = 61): the norm is still sqrt(d'/p) since d + p > d', the others below it
    for seed in range(5):
        sv = torch.linalg.svdvals(proj.matrix("srht", seed, 61, 40))
        assert sv.max().item() == pytest.approx(math.sqrt(63 / 40), rel=1e-12)
    assert proj.sensitivity_factor("srht", 61, 40) == pytest.approx(math.sqrt(63 / 40), rel=1e-15)
    assert proj.sensitivity_factor("srht", 225_034, 157_524) == pytest.approx(1.1972, abs=1e-4)


# -- gaussian ------------------------------------------------------------------------------------------

def test_gaussian_projection_is_isotropic_and_its_norm_bound_holds():
    """E[P P^T] = I (P = A / sqrt(p)); ||P||_op <= s = 1 + sqrt(d/p) + t/sqrt(p) on every draw, and
    the bound is not loose by more than its t term."""
    d, p, n = 6, 4, 3000
    acc = torch.zeros(d, d, dtype=F64)
    for seed in range(n):
        P = proj.matrix("gaussian", seed, d, p)
        acc += P @ P.t()
    torch.testing.assert_close(acc / n, torch.eye(d, dtype=F64), atol=0.06, rtol=0)
    d, p = 300, 210
    t = projected_gaussian.gaussian_tail(1, 1e-6)
    assert 2 * math.exp(-t * t / 2) == pytest.approx(1e-6)
    s = proj.sensitivity_factor("gaussian", d, p, t)
    assert s == pytest.approx(1 + math.sqrt(d / p) + t / math.sqrt(p))
    norms = [torch.linalg.matrix_norm(proj.matrix("gaussian", seed, d, p), ord=2).item() for seed in range(20)]
    assert max(norms) <= s and min(norms) >= 0.95 * (1 + math.sqrt(d / p))


def test_gaussian_blocks_equal_the_dense_product(monkeypatch):
    d, k = 50, 35
    g, e = torch.randn(1, d, dtype=F64), torch.randn(1, k, dtype=F64)
    P = proj.matrix("gaussian", 7, d, k)
    p = proj.draw("gaussian", [7], d, k, dtype=F64)
    torch.testing.assert_close(p.back(g, e)[0], P @ (P.t() @ g[0] + e[0]))
    torch.testing.assert_close(p.t(g)[0], P.t() @ g[0])
    torch.testing.assert_close(p.apply(e)[0], P @ e[0])
    monkeypatch.setattr(proj, "BLOCK_ELEMENTS", 3 * d)  # 12 blocks of 3 columns
    assert proj.block_columns(d) == 3
    P = proj.matrix("gaussian", 7, d, k)  # blocks are seeded by their index: another A
    for workers in (1, 2, 5):  # blocks drawn ahead by threads: the same A
        p = proj.GaussianProjection([7], d, k, dtype=F64, workers=workers)
        torch.testing.assert_close(p.back(g, e)[0], P @ (P.t() @ g[0] + e[0]))
    torch.testing.assert_close(p.back(g)[0], P @ (P.t() @ g[0]))
    assert proj.block_columns(10**9) == 1 and proj.block_columns(225_034) * 225_034 <= 1 << 24


def test_gaussian_projection_draws_what_it_always_drew():
    """The Gaussian projection and the step seeds are the pre-srht code's (these numbers come from
    that code, on this machine), so a run with projection: gaussian reproduces older runs. The
    tolerance only allows for another CPU's vectorised normal sampler and matrix-vector kernel:
    another draw would differ in the first digit."""
    P = proj.matrix("gaussian", 123, 5, 3, dtype=torch.float32)
    expected = torch.tensor([[0.12292565405368805, 0.7244285941123962, 0.21824510395526886],
                             [-0.19519270956516266, -0.3353853225708008, 0.2999499440193176],
                             [-0.30230167508125305, -0.09867753833532333, 1.1827728748321533],
                             [0.7134779095649719, 0.20523639023303986, -0.854372501373291],
                             [0.038402434438467026, 0.32956039905548096, 0.05255712941288948]])
    torch.testing.assert_close(P, expected, rtol=1e-5, atol=1e-6)
    gen = torch.Generator().manual_seed(7)
    assert proj.step_seeds(gen) == [1407639518939636932] and proj.step_seeds(gen) == [551904368352831990]
    gen = torch.Generator().manual_seed(1)
    g, e = torch.randn(1, 40, generator=gen), torch.randn(1, 28, generator=gen)
    out = proj.draw("gaussian", [99], 40, 28).back(g, e)[0].double()
    assert out.sum().item() == pytest.approx(-2.892925590276718, rel=1e-5)
    assert out.norm().item() == pytest.approx(13.979074702745844, rel=1e-6)


# -- both ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", projected_gaussian.KINDS)
def test_projection_is_determined_by_its_seed(kind):
    torch.manual_seed(0)
    a = proj.matrix(kind, 11, 40, 25)
    torch.manual_seed(1)  # the global generator plays no part
    torch.testing.assert_close(proj.matrix(kind, 11, 40, 25), a, rtol=0, atol=0)
    assert not torch.equal(proj.matrix(kind, 12, 40, 25), a)
    gen = torch.Generator().manual_seed(3)
    seeds = proj.step_seeds(gen, 4)
    assert len(set(seeds)) == 4 and all(0 <= s < 2**62 for s in seeds)
    assert proj.step_seeds(torch.Generator().manual_seed(3), 4) == seeds


def test_unknown_projection_and_bad_dimensions_fail_with_their_name():
    with pytest.raises(ValueError, match="projection must be one of srht, gaussian, got 'fjlt'"):
        proj.draw("fjlt", [1], 10, 5)
    with pytest.raises(ValueError, match=r"projection dimension p = 11 must be in \[1, d = 10\]"):
        proj.draw("srht", [1], 10, 11)


# -- the step: released noise, lanes, checkpoints ----------------------------------------------------

def lanes_model(lanes: int, widths=(5, 16)) -> nn.Module:
    """Parameters whose first axis is the lane (as the audit holds its replicas): d = sum(w + 1)
    per lane."""
    return nn.ModuleList([nn.Linear(w, lanes) for w in widths]).to(F64)


def projected_step(name, model, kind, sigma=1.7, C=2.0, L=8, lanes=1, seed=3, n_train=1000, epochs=2):
    spec = get_optimizer(name)
    hp = {"projection": kind}
    plan = spec.mechanism.plan(PlanRequest(n_train, L, epochs, hyperparameters=hp, delta=DELTA))
    ctx = Context(model=model, loss_fn=None, lr=0.1, expected_batch_size=L, noise_multiplier=sigma,
                  clipping=Clipping(C, normalize=False), noise=spec.mechanism.noise(plan, seed, "cpu"),
                  steps=plan.steps, hyperparameters=spec.hyperparameters(hp), lanes=lanes)
    return spec.build(ctx), ctx, plan


@pytest.mark.parametrize("kind,widths", [("srht", (9_999,)), ("gaussian", (314,))])
def test_released_noise_is_the_calibrated_draw(kind, widths):
    """Zero gradients: the step's output is P_k e_k. Recover e_k = (P^T P)^-1 P^T (output) with the
    public seed and check it is exactly the noise stream's draw after the seed, times
    sigma_k s_clip s_P (flat clipping at C = 2; sigma_k = sigma / sqrt(k))."""
    torch.manual_seed(0)
    model = lanes_model(1, widths)
    d = sum(p.numel() for p in model.parameters())  # srht: 10,000 = d' (7-smooth); gaussian: 315
    step, ctx, plan = projected_step("d2p2sgd", model, kind)
    k = round(0.7 * d)
    s_p = (math.sqrt(d / k) if kind == "srht" else
           1 + math.sqrt(d / k) + projected_gaussian.gaussian_tail(plan.steps, DELTA / 10) / math.sqrt(k))
    assert step.dimension == d and step.projection_dim == k and step.factor == pytest.approx(s_p, rel=1e-12)
    gen = torch.Generator()
    gen.set_state(ctx.noise.generator.get_state())
    released = []
    for n in range(1, 4):
        out = torch.cat([t.reshape(-1) for t in step.add_noise([torch.zeros_like(p) for p in model.parameters()])])
        assert step.k == n and step.last_seeds == proj.step_seeds(gen, 1)
        expect = torch.randn(1, k, generator=gen, dtype=F64)[0] * step.noise_std_at(n)
        assert step.noise_std_at(n) == pytest.approx(1.7 * 2.0 * s_p / math.sqrt(n), rel=1e-12)
        seed = step.last_seeds[0]
        if kind == "srht":  # d = d': P^T P = (d/p) I
            e = proj.transpose(kind, seed, out, k) * (k / d)
        else:
            P = proj.matrix(kind, seed, d, k)
            e = torch.linalg.solve(P.t() @ P, P.t() @ out)
        torch.testing.assert_close(e, expect, rtol=1e-9, atol=1e-9)
        released.append(e / step.noise_std_at(n))
    z = torch.cat(released)
    assert abs(z.mean().item()) < 5 / math.sqrt(z.numel())
    assert z.std().item() == pytest.approx(1.0, abs=5 * math.sqrt(0.5 / z.numel()))
    assert step.privacy_record()["projection_sensitivity_factor"] == step.factor


@pytest.mark.parametrize("kind", projected_gaussian.KINDS)
def test_each_lane_has_its_own_projection_and_noise(kind):
    lanes = 3
    torch.manual_seed(0)
    model = lanes_model(lanes)
    step, ctx, _ = projected_step("dp2sgd", model, kind, lanes=lanes)
    d, k = 23, round(0.7 * 23)
    assert step.dimension == d and step.projection_dim == k
    assert step.privacy_record()["dimension"] == d
    gen = torch.Generator()
    gen.set_state(ctx.noise.generator.get_state())
    grads = [torch.randn_like(p) for p in model.parameters()]
    flat = ctx.per_lane(grads)  # (lanes, d), before the step writes into grads
    out = ctx.per_lane(step.add_noise([g.clone() for g in grads]))
    seeds = proj.step_seeds(gen, lanes)
    e = torch.randn(lanes, k, generator=gen, dtype=F64) * step.noise_std_at(1)
    assert step.last_seeds == seeds and len(set(seeds)) == lanes
    for r in range(lanes):
        P = proj.matrix(kind, seeds[r], d, k)
        torch.testing.assert_close(out[r], P @ (P.t() @ flat[r] + e[r]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["d2p2sgd", "dp2sgd"])
@pytest.mark.parametrize("kind", projected_gaussian.KINDS)
def test_resume_is_exact(name, kind):
    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 9), nn.Tanh(), nn.Linear(9, 3))
        spec = get_optimizer(name)
        hp = {"projection": kind}
        plan = spec.mechanism.plan(PlanRequest(1000, 8, 2, hyperparameters=hp, delta=DELTA))
        ctx = Context(model=model, loss_fn=lambda m, x, y: (nn.functional.cross_entropy(m(x), y, reduction="none"),
                                                          None),
                      lr=0.1, expected_batch_size=8, noise_multiplier=1.3, clipping=Clipping(1.0),
                      noise=spec.mechanism.noise(plan, 5, "cpu"), steps=plan.steps,
                      hyperparameters=spec.hyperparameters(hp))
        return model, spec.build(ctx)

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    model, step = fresh()
    for x, y in batches[:2]:
        step(x, y)
    state = copy.deepcopy(step.state_dict())
    params = copy.deepcopy(model.state_dict())
    for x, y in batches[2:]:
        step(x, y)
    model2, step2 = fresh()
    model2.load_state_dict(params)
    step2.load_state_dict(state)
    for x, y in batches[2:]:
        step2(x, y)
    assert step2.k == step.k == 4 and step2.last_seeds == step.last_seeds
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_step_refuses_a_plan_for_another_projection():
    spec = get_optimizer("d2p2sgd")
    plan = spec.mechanism.plan(PlanRequest(1000, 8, 1))  # srht, the default
    ctx = Context(model=nn.Linear(4, 2), loss_fn=None, lr=0.1, expected_batch_size=8, noise_multiplier=1.0,
                  clipping=Clipping(1.0), noise=spec.mechanism.noise(plan, 1, "cpu"), steps=plan.steps,
                  hyperparameters=spec.hyperparameters({"projection": "gaussian"}))
    with pytest.raises(ValueError, match="projection 'gaussian' differs from the privacy plan's 'srht'"):
        spec.build(ctx)


# -- the plan is frozen --------------------------------------------------------------------------

def test_plan_is_not_mutable_after_construction():
    given = {"projection": "gaussian"}
    request = PlanRequest(1000, 8, 1, hyperparameters=given)
    given["projection"] = "srht"  # the request holds its own copy
    with pytest.raises(TypeError):
        request.hyperparameters["projection"] = "srht"
    mech = get_optimizer("d2p2sgd").mechanism
    plan = mech.plan(request)
    assert isinstance(plan, projected_gaussian.ProjectionPlan) and plan.projection == "gaussian" and plan.tail_t > 0
    for name, value in (("steps", 11), ("delta_fail", 0.5), ("projection", "srht")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, name, value)
    before = dataclasses.asdict(plan)
    step, _, _ = projected_step("d2p2sgd", lanes_model(1), "srht")
    step.add_noise([torch.zeros_like(p) for p in step.params])
    assert dataclasses.asdict(plan) == before
