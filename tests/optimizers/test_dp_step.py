"""The DP step from few operators (one flat gradient buffer, norms squared and summed in batched
calls, noise drawn into a flat buffer) gives the numbers of the step it replaced.

* float64: several DP-SGD steps (noise on, both clipping rules, an empty batch among them) equal
  a literal reference written here (per-sample gradients by autograd one example at a time,
  clip, sum, the noise stream drawn one tensor at a time, mean, SGD) to 1e-12;
* float32: the same steps are bit-identical to the per-parameter composition the step used to
  run (each layer's ``inner(self)`` summed layer by layer, a coefficient formula of six
  operators, one weighted sum, one noise tensor and one ``add_`` and ``div_`` per parameter),
  on the ghost and the materialised paths;
* the noise: ``sample_into`` draws what ``sample`` draws, and one draw over the concatenation
  would not (why the step keeps one draw per tensor).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpbench.mechanisms.noise import GaussianNoise
from dpbench.optimizers.base import SGD, Context, DPStep
from dpbench.privacy.clipping import Clipping
from dpbench.privacy.per_sample import Tape
from dpbench.privacy.per_sample_layers import LayerGrads, register_per_sample, LAYER_GRADS

pytestmark = pytest.mark.usefixtures("one_thread")

L, LR, SIGMA, SEED = 6, 0.3, 0.7, 5


class Sequence(nn.Module):
    """Every sequence layer type: Embedding, LayerNorm, Linear on (B, T, d), one without bias."""

    per_sample_forward = True

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(11, 7)
        self.pos = nn.Embedding(5, 7)
        self.ln = nn.LayerNorm(7)
        self.mid = nn.Linear(7, 9)
        self.head = nn.Linear(9, 11, bias=False)

    def forward(self, t):
        pos = torch.arange(t.shape[1]).expand(t.shape[0], -1)
        return self.head(torch.tanh(self.mid(self.ln(self.tok(t) + self.pos(pos)))))


class Image(nn.Module):
    """Every image layer type: Conv2d, ConvTranspose2d, Linear on (B, d), one without bias."""

    per_sample_forward = True

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.up = nn.ConvTranspose2d(3, 2, 2, bias=False)
        self.fc = nn.Linear(2 * 6 * 6, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.up(torch.tanh(self.conv(x)))).flatten(1))))


def sequence_loss(model, x, y):
    logits = model(x)
    return nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1), None


def image_loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="none"), None


def batches(kind: str, dtype):
    """Batches of varying size (Poisson batches vary), one of them empty."""
    g = torch.Generator().manual_seed(0)
    out = []
    for b in (5, 0, 8, 3):
        if kind == "sequence":
            x = torch.randint(0, 11, (b, 4), generator=g)
            y = torch.randint(0, 11, (b, 4), generator=g)
        else:
            x = torch.randn(b, 2, 5, 5, generator=g, dtype=dtype)
            y = torch.randint(0, 3, (b,), generator=g)
        out.append((x, y))
    return out


def build(kind: str, dtype, clipping):
    torch.manual_seed(0)
    model = (Sequence() if kind == "sequence" else Image()).to(dtype)
    loss = sequence_loss if kind == "sequence" else image_loss
    ctx = Context(model=model, loss_fn=loss, lr=LR, expected_batch_size=L, noise_multiplier=SIGMA,
                  clipping=clipping, noise=GaussianNoise(SEED), steps=10)
    return DPStep(ctx, SGD(LR)), model, loss


def reference_run(kind: str, clipping: Clipping) -> list[torch.Tensor]:
    """Literal DP-SGD in float64: per-example autograd, clip, sum, noise one tensor at a time, mean."""
    _, model, loss = build(kind, torch.float64, clipping)
    params = [p for p in model.parameters()]
    noise = torch.Generator().manual_seed(SEED)
    for x, y in batches(kind, torch.float64):
        total = [torch.zeros_like(p) for p in params]
        for i in range(x.shape[0]):
            g = torch.autograd.grad(loss(model, x[i:i + 1], y[i:i + 1])[0].sum(), params)
            norm = torch.sqrt(sum((t ** 2).sum() for t in g))
            c = 1 / max(1.0, float(norm) / clipping.clip_norm)
            c = c / clipping.clip_norm if clipping.normalize else c
            total = [s + c * t for s, t in zip(total, g)]
        with torch.no_grad():
            for p, s in zip(params, total):
                z = torch.randn(p.shape, generator=noise, dtype=p.dtype)
                p -= LR * (s + SIGMA * clipping.sensitivity * z) / L
    return [p.detach() for p in params]


@pytest.mark.parametrize("kind", ["sequence", "image"])
@pytest.mark.parametrize("normalize", [True, False])
def test_dp_step_equals_the_literal_reference_in_float64(kind, normalize):
    clipping = Clipping(0.05, normalize)  # small enough that every example is clipped
    step, model, _ = build(kind, torch.float64, clipping)
    for x, y in batches(kind, torch.float64):
        step(x, y)
    for p, want in zip(model.parameters(), reference_run(kind, clipping)):
        torch.testing.assert_close(p.detach(), want, rtol=1e-12, atol=1e-12)


def unfused_run(kind: str, clipping: Clipping) -> list[torch.Tensor]:
    """The composition the step ran before it was fused, on the same layer rules."""
    _, model, loss = build(kind, torch.float32, clipping)
    params = [p for p in model.parameters() if p.requires_grad]
    noise, tape, std = GaussianNoise(SEED), Tape(model), SIGMA * clipping.sensitivity
    for x, y in batches(kind, torch.float32):
        if x.shape[0] == 0:
            grads = [torch.zeros_like(p) for p in params]
        else:
            with tape:
                losses, _ = loss(model, x, y)
            psg = tape.per_sample_gradients(losses)
            norms = sum(layer.inner(layer) for layer in psg.layers).sqrt()
            coef = 1.0 / torch.clamp(norms / clipping.clip_norm, min=1.0)
            coef = coef / clipping.clip_norm if clipping.normalize else coef
            summed = psg.weighted_sum(coef)
            grads = [summed[p] for p in params]
        grads = [g.add_(z, alpha=std) for g, z in zip(grads, noise.sample(grads))]
        grads = [g.div_(L) for g in grads]
        SGD(LR).update(params, grads)
    return [p.detach() for p in params]


@pytest.mark.parametrize("kind", ["sequence", "image"])
@pytest.mark.parametrize("path", ["ghost", "materialised", "cheaper"])
@pytest.mark.parametrize("normalize", [True, False])
def test_dp_step_is_bit_identical_to_the_unfused_composition(kind, path, normalize, monkeypatch):
    if path != "cheaper":
        monkeypatch.setattr(LayerGrads, "use_ghost", property(lambda self: path == "ghost"))
    clipping = Clipping(0.05 if normalize else 0.5, normalize)
    step, model, _ = build(kind, torch.float32, clipping)
    for x, y in batches(kind, torch.float32):
        step(x, y)
    for p, want in zip(model.parameters(), unfused_run(kind, clipping)):
        assert torch.equal(p.detach(), want)


def test_the_clipped_sum_lives_in_one_reused_buffer():
    step, model, _ = build("image", torch.float32, Clipping(0.5))
    (x, y), _ = batches("image", torch.float32)[:2]
    step(x, y)
    buffer = step.buffer
    sizes = [p.numel() for p in model.parameters()]
    assert sum(sizes) <= buffer.flat.numel() < sum(sizes) + 16 * len(sizes)
    assert all(v.data_ptr() % 64 == 0 for v in buffer.views)  # aligned as tensors of their own
    step(x, y)
    assert step.buffer is buffer  # allocated once, not per step
    grads = step.clip_and_sum(step.per_sample_gradients(x, y)[0])
    assert grads is buffer.views and all(g.data_ptr() >= buffer.flat.data_ptr() for g in grads)


def test_a_plugin_rule_without_out_still_sums_into_the_buffer():
    """A LayerGrads subclass written before ``out`` existed: its sum is copied into the buffer."""

    class Scale(nn.Module):
        per_sample_forward = True

        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))

        def forward(self, x):
            return x * self.scale

    @register_per_sample(Scale)
    class ScaleGrads(LayerGrads):
        @property
        def per_sample(self):
            return {self.module.scale: self.x * self.gy}

        def weighted_sum(self, coef):  # no out
            return {self.module.scale: torch.tensordot(coef, self.x * self.gy, dims=1)}

    try:
        model = nn.Sequential(Scale())
        noise_free = Context(model=model, loss_fn=lambda m, x, y: ((m(x) - y) ** 2).sum(1), lr=1.0,
                             expected_batch_size=1, noise_multiplier=0.0, clipping=Clipping(100.0, False),
                             noise=GaussianNoise(0), steps=1)
        step = DPStep(noise_free, SGD(1.0))
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        with step.tape:
            losses = noise_free.loss_fn(model, x, y)
        grads = step.clip_and_sum(step.tape.per_sample_gradients(losses))
        assert grads is step.buffer.views  # unclipped (C = 100): the plain sum of the gradients
        torch.testing.assert_close(grads[0], (2 * (x * model[0].scale.detach() - y) * x).sum(0))
    finally:
        del LAYER_GRADS[Scale]


def test_sample_into_draws_what_sample_draws():
    shapes = [(7, 3), (5,), (33,), (2, 2, 2)]
    like = [torch.empty(s) for s in shapes]
    drawn = GaussianNoise(3).sample(like)
    flat = torch.empty(sum(t.numel() for t in like))
    views, i = [], 0
    for t in like:
        views.append(flat[i:i + t.numel()].view(t.shape))
        i += t.numel()
    GaussianNoise(3).sample_into(views)
    assert all(torch.equal(a, b) for a, b in zip(drawn, views))


def test_one_draw_over_the_concatenation_would_be_another_stream():
    """Why the step keeps one draw per tensor: torch's CPU normal sampler fills blocks of 16 and
    redraws a tensor's tail, so one draw of a + b values differs from draws of a, then b."""
    g = torch.Generator().manual_seed(3)
    parts = torch.cat([torch.randn(33, generator=g), torch.randn(7, generator=g)])
    g.manual_seed(3)
    assert not torch.equal(parts, torch.randn(40, generator=g))
