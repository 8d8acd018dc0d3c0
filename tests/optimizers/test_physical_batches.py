"""A logical batch in physical pieces (``Context.piece_size``, the run setting
``physical_batch_size``) is the same step as the batch in one piece, for every registered
optimizer: the same parameters after several steps (float64, the same noise seed, 1e-10: the
pieces only change the order of the clipped sum's additions), the same losses and stats, the
noise source drawn exactly as often (once per logical step: its state after the steps is the
one-piece run's, and on zero gradients the noise's std is sigma s / L, not sqrt(pieces) times
it), and at most one piece's per-sample layer records held at once (two for DiSK's two points).
Pieces compose with the task's groups (a piece is cut into groups)."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpbench.mechanisms.base import PlanRequest
from dpbench.mechanisms.noise import GaussianNoise
from dpbench.optimizers import OPTIMIZERS, get_optimizer
from dpbench.optimizers.base import Context, DPStep, step_passes
from dpbench.pipeline import catalog
from dpbench.privacy import per_sample
from dpbench.privacy.clipping import Clipping, NoClipping

pytestmark = pytest.mark.usefixtures("one_thread")

L, SIGMA, C, B = 12, 0.9, 0.5, 11
SIZES = (B, 0, 9, 11)  # Poisson batches vary; an empty one still releases noise
HP = {"dpdice": {"c2": 0.05}, "dpdice-strict": {"c2": 0.05}}  # a residual that is clipped


class Tiny(nn.Module):
    per_sample_forward = True

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


def by_sign(x):
    """A task's groups stand-in: the rows by the sign of their first pixel (a function of the rows)."""
    first = x[:, 0, 0, 0] >= 0
    groups = [torch.nonzero(first).flatten(), torch.nonzero(~first).flatten()]
    return [g for g in groups if len(g)] or None


def file_based(name) -> bool:
    return catalog.optimizer(name).files is not None


def noise_for(name, plan, seed):
    """The spec's own noise source; for a mechanism whose noise comes from cached files (the
    matrix mechanisms) the run's i.i.d. source stands in: their step is DPStep's, stage for stage,
    and the pieces change nothing before the noise."""
    spec = get_optimizer(name)
    if file_based(name):
        assert type(get_optimizer(name).build.__call__) and not file_based("dpsgd")
        return GaussianNoise(seed, "cpu")
    return spec.mechanism.noise(plan, seed, "cpu")


def build(name, piece_size=None, groups=None, model=None, hp=None):
    spec = get_optimizer(name)
    if model is None:
        torch.manual_seed(0)
        model = Tiny().double()
    hp = hp or HP.get(name)
    plan = None if file_based(name) else spec.mechanism.plan(PlanRequest(1000, L, 1, hyperparameters=hp))
    ctx = Context(model=model, loss_fn=ce_loss, lr=0.05 if "adam" in name else 0.3, expected_batch_size=L,
                  noise_multiplier=SIGMA if spec.private else 0.0,
                  clipping=Clipping(C) if spec.private else NoClipping(), noise=noise_for(name, plan, 7),
                  steps=plan.steps if plan else 80, hyperparameters=spec.hyperparameters(hp), groups=groups,
                  piece_size=piece_size)
    return spec.build(ctx), model


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64) * 2, torch.randint(0, 3, (n,), generator=g))
            for n in SIZES]


def noise_state(noise):
    state = noise.state_dict()
    return {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in state.items()}


# DiSK at a = 1 (only the shifted point, the loss by a forward pass), Dice's residual unclipped
VARIANTS = [("dpdisk", {"kappa": 0.6, "gamma": 0.4 / 0.6}), ("dpdice", {"c2": 50.0})]


@pytest.mark.parametrize("groups", [None, by_sign], ids=["rows", "groups"])
@pytest.mark.parametrize("name,hp", [(n, None) for n in OPTIMIZERS] + VARIANTS,
                         ids=list(OPTIMIZERS) + ["dpdisk-one-point", "dpdice-unclipped-residual"])
def test_a_step_in_pieces_is_the_step_in_one_piece(name, hp, groups):
    runs = {}
    for piece_size in (None, 4):
        step, model = build(name, piece_size, groups, hp=hp)
        outs = []
        for x, y in data():
            outs.append(step(x, y))
            outs[-1] = (outs[-1], [p.detach().clone() for p in model.parameters()])
        runs[piece_size] = outs, noise_state(step.ctx.noise)
    (one, noise_one), (cut, noise_cut) = runs[None], runs[4]
    moved = max((a - b).abs().max().item() for a, b in zip(one[-1][1], build(name)[1].parameters()))
    assert moved > 1e-3  # the steps moved the parameters
    for (a, pa), (b, pb) in zip(one, cut):
        for p, q in zip(pa, pb):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a.losses, b.losses, rtol=1e-12, atol=0)
        assert (a.correct is None and b.correct is None) or torch.equal(a.correct, b.correct)
        assert a.stats == b.stats  # per logical step (DiSK's passes: 2, not 2 per piece)
    assert noise_cut == noise_one  # as many draws: one per logical step


def test_a_piece_size_of_the_batch_or_more_is_one_pass_bit_for_bit():
    for piece_size in (None, B, 100):
        step, model = build("dpsgd", piece_size)
        for x, y in data():
            step(x, y)
        if piece_size is None:
            ref = [p.detach().clone() for p in model.parameters()]
        else:
            assert all(torch.equal(p, q) for p, q in zip(ref, model.parameters()))


def test_passes_are_pieces_of_consecutive_rows_cut_into_groups():
    ctx = Context(model=Tiny(), loss_fn=ce_loss, lr=0.1, expected_batch_size=L, noise_multiplier=1.0,
                  clipping=Clipping(), noise=None, steps=1, piece_size=4, groups=by_sign)
    x = torch.randn(10, 1, 6, 6)
    passes = step_passes(ctx, x)
    assert sorted(torch.cat(passes).tolist()) == list(range(10)) and all(len(p) <= 4 for p in passes)
    for p in passes:  # each pass inside one piece, and of one sign
        assert len({int(i) // 4 for i in p}) == 1 and len(set((x[p, 0, 0, 0] >= 0).tolist())) == 1
    assert step_passes(Context(**{**ctx.__dict__, "piece_size": None, "groups": None}), x) is None
    assert step_passes(ctx, x[:0]) is None


@pytest.mark.parametrize("name", ["dpsgd", "opacus-dpsgd", "dpdisk", "dpdice-strict"])
def test_noise_on_zero_gradients_has_the_std_of_one_draw_per_logical_step(name):
    """std sigma s / L per coordinate of the mean gradient (dpdice-strict: times its release's
    1 + 2 L C2 / C): a noise drawn per piece and added would have sqrt(pieces) times it."""
    sigma, Lz, flat_c = 1.7, 32, 2.0
    torch.manual_seed(0)
    model = nn.Linear(100, 100)
    spec = get_optimizer(name)
    plan = spec.mechanism.plan(PlanRequest(1000, Lz, 2))
    ctx = Context(model=model, loss_fn=lambda m, xb, yb: ((m(xb) * 0).sum(1), None), lr=1.0, expected_batch_size=Lz,
                  noise_multiplier=sigma, clipping=Clipping(flat_c, normalize=False),
                  noise=spec.mechanism.noise(plan, 3, "cpu"), steps=plan.steps,
                  hyperparameters=spec.hyperparameters(None), piece_size=8)
    step = spec.build(ctx)
    seen = []
    update = step.rule.update
    step.rule.update = lambda params, grads: (seen.append(torch.cat([g.reshape(-1) for g in grads]).clone()),
                                              update(params, grads))[1]
    expect = sigma * flat_c / Lz * (1 + 2 * Lz * 1.0 / flat_c if name == "dpdice-strict" else 1.0)
    step(torch.randn(Lz, 100), None)  # 4 pieces of 8
    assert seen[-1].double().std().item() == pytest.approx(expect, rel=0.06)


@pytest.fixture
def live_rows(monkeypatch):
    """The most rows of per-sample layer records (``PerSampleGradients``) alive at once."""
    alive, peak = weakref.WeakSet(), [0]
    init = per_sample.PerSampleGradients.__init__

    def tracked(self, layers):
        init(self, layers)
        alive.add(self)
        peak[0] = max(peak[0], sum(p.batch_size for p in alive))

    monkeypatch.setattr(per_sample.PerSampleGradients, "__init__", tracked)
    return peak


@pytest.mark.parametrize("name", [n for n, s in OPTIMIZERS.items() if s.private])
def test_a_step_in_pieces_holds_one_pieces_records(name, live_rows, monkeypatch):
    """At most P rows of layer records at once (DiSK: its two points' of one piece), where the
    batch in one piece holds all B (Opacus: the rows of its ``grad_sample``)."""
    opacus_rows = []
    if name == "opacus-dpsgd":
        from opacus.optimizers import DPOptimizer

        real = DPOptimizer.clip_and_accumulate

        def counted(self):
            opacus_rows.append(max(p.grad_sample.shape[0] for p in self.params))
            return real(self)

        monkeypatch.setattr(DPOptimizer, "clip_and_accumulate", counted)
    points = 2 if name == "dpdisk" else 1
    for piece_size in (None, 4):
        step, _ = build(name, piece_size)
        live_rows[0] = 0
        opacus_rows.clear()
        for x, y in data()[:1] + data()[3:]:  # two batches of B; DiSK takes its two points from the second on
            step(x, y)
        held = max(opacus_rows) if opacus_rows else live_rows[0]
        assert held == (B * points if piece_size is None else 4 * points), (piece_size, held)


def test_a_plugin_that_replaces_clip_and_sum_alone_holds_its_pieces_and_is_the_same_step():
    """A class that replaces ``clip_and_sum`` without its pass-by-pass forms gets the batch held
    whole (``GroupedGradients``): its own stage runs, on every row, never bypassed."""
    calls = []

    class Halved(DPStep):
        def clip_and_sum(self, psg):
            calls.append(psg.batch_size if psg is not None else 0)
            return [g.mul_(0.5) for g in super().clip_and_sum(psg)]

    results = []
    for piece_size in (None, 4):
        torch.manual_seed(0)
        model = Tiny().double()
        step, _ = build("dpsgd", piece_size, model=model)
        step.__class__ = Halved
        for x, y in data():
            step(x, y)
        results.append([p.detach().clone() for p in model.parameters()])
    assert calls == [n for n in SIZES] * 2
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert not math.isnan(results[0][0].sum().item())


def test_a_step_in_pieces_is_never_captured():
    from dpbench.training import capture

    assert "pieces of at most 4 records" in capture.refusal(build("dpsgd", 4)[0])
    assert capture.refusal(build("dpsgd")[0]) is None
