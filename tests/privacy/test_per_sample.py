"""Per-sample gradients (norms, weighted sums, inner products) against torch.func, on the CPU
and on a CUDA GPU (``device`` fixture)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from dpbench.privacy.per_sample import LayerGrads, Tape, UnsupportedLayerError, layer_grads
from dpbench.privacy.per_sample_layers import LAYER_GRADS, register_per_sample
from dpbench.problems import PROBLEMS

B = 12


def reference(model, loss_one, *batch):
    """Per-sample gradients by vmap(grad) over single examples: the plain dense reference."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = vmap(grad(lambda p, *xs: loss_one(p, *xs)), in_dims=(None,) + (0,) * len(batch))(params, *batch)
    return {dict(model.named_parameters())[k]: v for k, v in g.items()}


def check(model, loss_batch, loss_one, *batch):
    ref = reference(model, loss_one, *batch)
    ref_norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in ref.values()))
    tape = Tape(model)
    with tape:
        losses = loss_batch(*batch)
    psg = tape.per_sample_gradients(losses)
    # float32 on a GPU: other kernels (cuDNN, cuBLAS) than the reference's, summing in other orders
    gpu32 = ref_norms.device.type == "cuda" and ref_norms.dtype == torch.float32
    torch.testing.assert_close(psg.norms(), ref_norms, rtol=1e-4 if gpu32 else 1e-5, atol=1e-6 if gpu32 else 1e-7)
    coef = torch.rand(B, dtype=ref_norms.dtype, device=ref_norms.device)
    for p, w in psg.weighted_sum(coef).items():
        torch.testing.assert_close(w, torch.einsum("b,b...->...", coef, ref[p]), rtol=1e-4, atol=1e-5 if gpu32 else 1e-6)
    return psg, ref


LAYERS = [
    nn.Linear(7, 5),
    nn.Linear(7, 5, bias=False),
    nn.Conv2d(3, 4, 3),
    nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False),
    nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
    nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
    nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=0, bias=False),
    nn.ConvTranspose2d(2, 3, 2, stride=1),
]


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost", "materialised"])
@pytest.mark.parametrize("layer", LAYERS, ids=repr)
def test_single_layer_both_paths(layer, ghost, monkeypatch, device):
    monkeypatch.setattr(LayerGrads, "use_ghost", property(lambda self: ghost))
    layer = copy.deepcopy(layer).double().to(device)  # float64: both paths must agree to rounding, not to float32 noise
    shape = (B, 7) if isinstance(layer, nn.Linear) else (B, layer.in_channels, 9, 8)
    x = torch.randn(shape, dtype=torch.float64, device=device)
    target = torch.randn_like(layer(x))

    def loss_batch(x, t):
        return ((layer(x) - t) ** 2).flatten(1).sum(1) * 0.5

    def loss_one(p, x, t):
        return 0.5 * ((functional_call(layer, p, (x[None],)) - t[None]) ** 2).sum()

    check(layer, loss_batch, loss_one, x, target)


def test_linear_on_sequences(device):
    """A Linear layer applied per token: per-sample gradients sum over positions."""
    layer = nn.Linear(6, 4).to(device)
    x = torch.randn(B, 5, 6, device=device)
    loss_batch = lambda x: layer(x).tanh().sum((1, 2))  # noqa: E731
    loss_one = lambda p, x: functional_call(layer, p, (x[None],)).tanh().sum()  # noqa: E731
    check(layer, loss_batch, loss_one, x)


@pytest.mark.parametrize("problem_id", ["P1", "P2", "P3"])
def test_problem_models(problem_id, device):
    problem = PROBLEMS[problem_id]
    model = problem.build().to(device)
    shape = (3, 32, 32) if problem_id == "P1" else (1, 28, 28)
    x = torch.rand(B, *shape, device=device)
    y = torch.randint(0, 10, (B,), device=device)
    noise = torch.randn(B, 32, device=device)
    if problem.task.name == "classification":
        loss_batch = lambda x, y, n: F.cross_entropy(model(x), y, reduction="none")  # noqa: E731
        loss_one = lambda p, x, y, n: F.cross_entropy(functional_call(model, p, (x[None],)), y[None])  # noqa: E731
    else:
        def vae_loss(out, x):
            recon, mu, logvar = out
            rec = F.binary_cross_entropy(recon, x, reduction="none").flatten(1).sum(1)
            return rec - 0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(1)

        loss_batch = lambda x, y, n: vae_loss(model(x, n), x)  # noqa: E731
        loss_one = lambda p, x, y, n: vae_loss(functional_call(model, p, (x[None], n[None])), x[None]).sum()  # noqa: E731
    psg, ref = check(model, loss_batch, loss_one, x, y, noise)
    # inner products between two passes (DiSK) against the dense reference
    tape = Tape(model)
    with tape:
        losses2 = loss_batch(x.flip(0), y.flip(0), noise.flip(0))
    psg2 = tape.per_sample_gradients(losses2)
    ref2 = reference(model, loss_one, x.flip(0), y.flip(0), noise.flip(0))
    expected = sum((ref[p].flatten(1) * ref2[p].flatten(1)).sum(1) for p in ref)
    torch.testing.assert_close(psg.inner(psg2), expected, rtol=1e-4, atol=1e-6)


def test_bias_only_layers_keep_no_input_and_only_their_bias_gradients(device):
    """A layer whose weight is frozen (bias-only fine-tuning) has gradients that are gy's alone: the
    tape keeps a (B, 0) stand-in, not its input (which a non-private backward frees after the
    forward pass), and of gy only its sum over positions, taken as the backward pass reaches the
    layer; the per-sample gradients are still exact."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)).double().to(device)
    for frozen in (model[0].weight, model[2].weight):
        frozen.requires_grad_(False)
    x = torch.randn(B, 5, 6, dtype=torch.float64, device=device)
    loss_batch = lambda x: model(x).tanh().sum((1, 2))  # noqa: E731
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def loss_one(p, x):
        frozen = {n: v for n, v in model.named_parameters() if not v.requires_grad}
        return functional_call(model, {**frozen, **p}, (x[None],)).tanh().sum()

    ref = vmap(grad(loss_one), in_dims=(None, 0))({n: dict(model.named_parameters())[n].detach() for n in names}, x)
    tape = Tape(model)
    with tape:
        losses = loss_batch(x)
    psg = tape.per_sample_gradients(losses)
    kept = {type(layer.module).__name__ + str(i): (tuple(layer.x.shape), tuple(layer.gy.shape))
            for i, layer in enumerate(psg.layers)}
    # bias-only layers: no input, and of gy only its sum over the 5 positions (taken during the pass)
    assert kept == {"Linear0": ((B, 0), (B, 8)), "LayerNorm1": ((B, 0), (B, 8)), "Linear2": ((B, 5, 8), (B, 5, 3))}
    ref_norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in ref.values()))
    torch.testing.assert_close(psg.norms(), ref_norms, rtol=1e-9, atol=1e-12)
    coef = torch.rand(B, dtype=torch.float64, device=device)
    by_name = {id(p): n for n, p in model.named_parameters()}
    for p, w in psg.weighted_sum(coef).items():
        torch.testing.assert_close(w, torch.einsum("b,b...->...", coef, ref[by_name[id(p)]]), rtol=1e-9, atol=1e-12)


def test_refuses_unsupported_layers():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    with pytest.raises(UnsupportedLayerError, match="BatchNorm1d"):
        Tape(model)


def test_refuses_layer_used_twice():
    lin = nn.Linear(3, 3)
    tape = Tape(lin)
    with tape:
        out = lin(lin(torch.randn(4, 3))).sum(1)
    with pytest.raises(UnsupportedLayerError, match="more than once"):
        tape.per_sample_gradients(out)


@pytest.mark.parametrize("stride, padding", [((1, 1), (0, 0)), ((2, 2), (1, 1)), ((1, 2), (2, 0))])
def test_unfold_equals_torch_unfold_exactly(stride, padding):
    """per_sample.unfold (strided views, a few kernels on a GPU) moves the same values as
    F.unfold (one im2col kernel per sample on a GPU)."""
    from dpbench.privacy.per_sample import unfold

    x = torch.randn(3, 4, 9, 8, dtype=torch.float64)
    ours = unfold(x, (3, 2), (1, 1), padding, stride)
    assert torch.equal(ours, torch.nn.functional.unfold(x, (3, 2), (1, 1), padding, stride))


@pytest.mark.parametrize("layer", [torch.nn.Conv2d(3, 5, 3, 2, 1), torch.nn.ConvTranspose2d(4, 3, 3, 2, 1, 1)])
def test_per_sample_weight_gradients_by_gemm_equal_the_grouped_convolution(layer):
    """The GPU path (one batched GEMM of the unfolded factors) and the CPU path (a grouped
    weight-gradient convolution) give the same per-sample gradients."""
    from dpbench.privacy.per_sample import layer_grads

    layer = layer.double()
    x = torch.randn(6, layer.in_channels, 7, 7, dtype=torch.float64)
    gy = torch.randn_like(layer(x))
    grouped = layer_grads(layer, x, gy).materialised
    A, G = layer_grads(layer, x, gy).factors
    gemm = torch.bmm(G.transpose(1, 2), A).view(6, *layer.weight.shape)
    torch.testing.assert_close(gemm, grouped, rtol=1e-12, atol=1e-12)


class Scale(nn.Module):
    """y = x * scale (elementwise over the last axis): a layer type dpbench does not know."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.scale


def scale_grads(module, x, gy):
    """As a plugin would register it: grad_i = sum over positions of x * gy."""
    return {module.scale: (x * gy).reshape(len(x), -1, x.shape[-1]).sum(1)}


@pytest.fixture
def scale_registered():
    register_per_sample(Scale)(scale_grads)
    yield
    del LAYER_GRADS[Scale]


def test_a_registered_layer_type_gets_exact_per_sample_gradients(scale_registered, device):
    """A layer type registered from outside dpbench, with one function, is taped, clipped and
    summed like the built-in ones: norms, weighted sums and inner products against torch.func."""
    model = nn.Sequential(nn.Linear(6, 5), Scale(5), nn.Tanh(), nn.Linear(5, 3)).double().to(device)
    x = torch.randn(B, 4, 6, dtype=torch.float64, device=device)  # 4 positions a record
    loss_batch = lambda x: model(x).sin().sum((1, 2))  # noqa: E731
    loss_one = lambda p, x: functional_call(model, p, (x[None],)).sin().sum()  # noqa: E731
    psg, ref = check(model, loss_batch, loss_one, x)
    tape = Tape(model)
    with tape:
        psg2 = tape.per_sample_gradients(loss_batch(x.flip(0)))
    ref2 = reference(model, loss_one, x.flip(0))
    expected = sum((ref[p].flatten(1) * ref2[p].flatten(1)).sum(1) for p in ref)
    torch.testing.assert_close(psg.inner(psg2), expected, rtol=1e-10, atol=1e-12)
    assert ref[model[1].scale].abs().min() > 0  # the registered layer's gradients count


def test_an_unregistered_layer_with_parameters_is_refused_by_name():
    with pytest.raises(UnsupportedLayerError, match=r"layer '1' \(Scale\) has trainable parameters, but no per-sample "
                                                    r"gradients are registered for Scale .*register_per_sample\(Scale\)"):
        Tape(nn.Sequential(nn.Linear(6, 5), Scale(5)))


def test_a_subclass_of_a_registered_layer_is_not_covered_by_its_rule():
    class MyLinear(nn.Linear):  # its forward may differ: the rule is looked up by exact type
        pass

    with pytest.raises(UnsupportedLayerError, match=r"layer '0' \(MyLinear\) .*register_per_sample\(MyLinear\)"):
        Tape(nn.Sequential(MyLinear(3, 3)))


def test_a_registration_is_checked(scale_registered):
    with pytest.raises(ValueError, match="per-sample gradients of Scale are already registered"):
        register_per_sample(Scale)(scale_grads)
    with pytest.raises(TypeError, match="takes a torch.nn.Module subclass"):
        register_per_sample(len)

    class Summed(Scale):
        pass

    register_per_sample(Summed)(lambda m, x, gy: {m.scale: (x * gy).sum(0)})  # the batch summed away
    try:
        with pytest.raises(UnsupportedLayerError, match=r"returned shape \(3,\) for a parameter of shape \(3,\); "
                                                        r"expected \(4, 3\)"):
            layer_grads(Summed(3), torch.randn(4, 3), torch.randn(4, 3)).per_sample
    finally:
        del LAYER_GRADS[Summed]
