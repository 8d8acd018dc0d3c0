"""opacus-dpsgd (Opacus's GradSampleModule and DPOptimizer) against our dpsgd: the same clipped
sum, the same noise stream and the same updates on the same model, batches and seed; the noise
std sigma s / L under both clippings; refused layers named; and both train P2 identically."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import run_cell
from dpbench.mechanisms.base import PlanRequest
from dpbench.optimizers import get_optimizer
from dpbench.optimizers.base import Context
from dpbench.privacy.clipping import Clipping
from dpbench.privacy.per_sample import UnsupportedLayerError
from dpbench.training.train import RunConfig
from test_optimizers import batches, ce_loss, flat, make_context, tiny


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one thread


def pair(sigma, clipping, dtype=torch.float64, lr=0.3):
    """(opacus-dpsgd, dpsgd) steps on two copies of the same model, same L and noise seed."""
    out = []
    for name in ("opacus-dpsgd", "dpsgd"):
        model, x, y = tiny(dtype)
        step, _, _ = make_context(name, model, clipping=clipping, sigma=sigma, L=10, lr=lr)
        out.append((model, step))
    return out, x, y


@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "flat"])
def test_same_clipped_sum_as_dpsgd(normalize):
    """Half the examples clipped: Opacus's clipped sum on our clipping's scale is ours, up to
    Opacus's 1e-6 in its clip factor C / (||g|| + 1e-6)."""
    [_, (_, s_d)], x, y = pair(0.0, Clipping(1.0, normalize))
    C = float(s_d.per_sample_gradients(x, y)[0].norms().median())
    [(m_o, s_o), (m_d, s_d)], x, y = pair(0.0, Clipping(C, normalize))
    psg, _ = s_d.per_sample_gradients(x, y)
    norms = psg.norms()
    assert 0 < int((norms > C).sum()) < len(norms)
    ours = s_d.clip_and_sum(psg)
    s_o.per_sample_gradients(x, y)
    theirs = s_o.clip_and_sum()
    # ||theirs - ours|| <= sum_i c_i ||g_i|| 1e-6 / (||g_i|| + 1e-6) <= 1e-6 sum over clipped i of c_i
    coef = Clipping(C, normalize).coefficients(norms)
    bound = 1e-6 * float(coef[norms > C].sum())
    diff = torch.cat([(a - b).reshape(-1) for a, b in zip(theirs, ours)]).norm().item()
    assert diff <= bound * (1 + 1e-6) + 1e-14
    assert diff > 0  # the 1e-6 is really there (float64): this is Opacus's computation, not ours


@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "flat"])
def test_same_updates_as_dpsgd_noise_on(normalize):
    """sigma = 1.3, batches of 8, 5, 0 (empty: noise only), 7, 8 with L = 10: Opacus draws its
    noise from the run's noise generator in parameter order, as our GaussianNoise does, so the
    two implementations take the same steps (float64; Opacus's 1e-6 in the clip factor)."""
    [(m_o, s_o), (m_d, s_d)], x, y = pair(1.3, Clipping(0.5, normalize))
    start = flat(m_o)
    for k, (xb, yb) in enumerate(batches(x, y)):
        before = flat(m_d)
        out_o, out_d = s_o(xb, yb), s_d(xb, yb)
        torch.testing.assert_close(out_o.losses, out_d.losses, rtol=1e-6, atol=1e-12)
        # apart from Opacus's 1e-6 (relative 1e-6 / ||g_i|| in each clip factor) the steps are equal
        gap = (flat(m_o) - flat(m_d)).abs().max().item()
        assert gap <= 1e-5 * (flat(m_d) - start).abs().max().item(), f"step {k + 1}"
        if xb.shape[0] == 0:  # the empty batch moved the model by noise alone: sigma s / L * lr per coordinate
            moved = (flat(m_d) - before) / 0.3
            assert moved.std().item() == pytest.approx(1.3 * (1.0 if normalize else 0.5) / 10, rel=0.25)
    assert (flat(m_o) - start).abs().max() > 1e-2
    # the same generator state afterwards: both drew exactly the same number of normals
    assert torch.equal(s_o.ctx.noise.generator.get_state(), s_d.ctx.noise.generator.get_state())


def test_noise_std_normalised_clipping():
    """Zero gradients, normalised clipping at C = 4: the privatised mean gradient is pure noise
    with std sigma * 1 / L (Opacus's own std would be sigma C / L = 4x larger)."""
    sigma, L = 1.7, 32
    spec = get_optimizer("opacus-dpsgd")
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    plan = spec.mechanism.plan(PlanRequest(1000, L, 2))
    ctx = Context(model=model, loss_fn=lambda m, xb, yb: ((m(xb) * 0).sum(1), None), lr=1.0, expected_batch_size=L,
                  noise_multiplier=sigma, clipping=Clipping(4.0), noise=spec.mechanism.noise(plan, 3, "cpu"),
                  steps=plan.steps, hyperparameters={})
    step = spec.build(ctx)
    seen = []
    update = step.rule.update
    step.rule.update = lambda params, grads: (seen.append(torch.cat([g.reshape(-1) for g in grads])),
                                              update(params, grads))[1]
    step(torch.randn(L, 100), None)
    step(torch.randn(0, 100), None)  # an empty batch: the same noise
    for g in seen:
        assert g.numel() == 10_100
        assert g.double().std().item() == pytest.approx(sigma / L, rel=0.03)


def test_refused_layer_is_named():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(32, 3))
    with pytest.raises(UnsupportedLayerError, match=r"opacus-dpsgd.*layer '1' \(BatchNorm2d\)"):
        make_context("opacus-dpsgd", model, clipping=Clipping(1.0), sigma=1.0, L=10, lr=0.1)

    class Attention(nn.Module):  # nn.MultiheadAttention: Opacus asks for its DPMultiheadAttention
        def __init__(self):
            super().__init__()
            self.emb, self.att, self.out = nn.Embedding(10, 8), nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 10)

        def forward(self, x):
            h = self.emb(x)
            return self.out(self.att(h, h, h)[0])

    with pytest.raises(UnsupportedLayerError, match=r"layer 'att' \(MultiheadAttention\): .*DPMultiheadAttention"):
        make_context("opacus-dpsgd", Attention(), clipping=Clipping(1.0), sigma=1.0, L=10, lr=0.1)


def test_functorch_fallback_layers_are_recorded():
    class Scaled(nn.Module):  # a parameter directly on a module Opacus has no grad sampler for
        def __init__(self):
            super().__init__()
            self.scale, self.fc = nn.Parameter(torch.ones(4)), nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(x * self.scale)

    step, _, _ = make_context("opacus-dpsgd", Scaled(), clipping=Clipping(1.0), sigma=1.0, L=10, lr=0.1)
    assert step.privacy_record() == {"opacus_functorch_layers": ["Scaled"]}
    out = step(torch.randn(6, 4), torch.randint(0, 3, (6,)))
    assert out.losses.shape == (6,)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # torch's note on the outside pass
def test_hooks_only_inside_the_step():
    """An outside forward/backward (evaluation with gradients, a canary's score) leaves no
    activations or per-sample gradients behind."""
    model, x, y = tiny(torch.float32)
    step, _, _ = make_context("opacus-dpsgd", model, clipping=Clipping(1.0), sigma=1.0, L=10, lr=0.1)
    ce_loss(model, x, y)[0].sum().backward()
    assert all(not getattr(m, "activations", None) for m in model.modules())
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    step(x, y)
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_trains_p2_like_dpsgd(tiny_fmnist):
    """A real run on P2 (tiny data): sigma calibrated by our accountant, recorded as for dpsgd,
    and the same training losses step for step (float32: Opacus's 1e-6 and its summation order)."""
    runs = {}
    for name in ("opacus-dpsgd", "dpsgd"):
        runs[name] = run_cell(RunConfig(problem="P2", optimizer=name, lr=1.0, batch_size=60, epochs=1, seed=0,
                                        epsilon=8.0, max_steps=4, test_subset=50, device="cpu",
                                        progress_every_s=1e9))
    o, d = runs["opacus-dpsgd"], runs["dpsgd"]
    po, pd_ = o.meta["privacy"], d.meta["privacy"]
    assert po["noise_multiplier"] == pd_["noise_multiplier"] > 0
    assert po["epsilon"] == pd_["epsilon"] <= 8.0
    assert po["opacus_functorch_layers"] == []  # every P2 layer has an Opacus grad sampler
    lo = o.metrics[o.metrics.split == "train"]["loss"].to_numpy()
    ld = d.metrics[d.metrics.split == "train"]["loss"].to_numpy()
    assert len(lo) == 4 and all(math.isfinite(v) for v in lo)
    assert lo == pytest.approx(ld, rel=1e-4)
