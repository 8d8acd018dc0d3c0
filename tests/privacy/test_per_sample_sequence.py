"""Per-sample gradients of sequence layers (Linear on (B, T, d), Embedding, LayerNorm) and of the
P4 transformer LM, against torch.func (vmap of grad over single records): squared norms,
weighted sums and inner products between two passes, on the ghost and the materialised path."""

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dpbench.privacy.per_sample import (LayerGrads, SampleMixingError, Tape, UnsupportedLayerError,
                                        check_per_sample, layer_grads, trainable_layers)
from dpbench.problems.transformer import TransformerLM, token_losses

# torch.func has no batching rule for CPU flash attention: the reference falls back to a loop (slower, same values)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")

B, T = 5, 7
PAD = 256


def reference(model, loss_one, *batch):
    """{parameter: per-sample gradients (B, *shape)} by vmap(grad) over single records."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = vmap(grad(loss_one), in_dims=(None,) + (0,) * len(batch))(params, *batch)
    return {dict(model.named_parameters())[k]: v for k, v in g.items()}


def engine(model, loss_batch, *batch):
    tape = Tape(model)
    with tape:
        losses = loss_batch(*batch)
    return tape.per_sample_gradients(losses)


def flat_dot(a, b):
    return sum((a[p].flatten(1) * b[p].flatten(1)).sum(1) for p in a)


def check_against_reference(model, loss_batch, loss_one, batch, batch2, rtol=1e-7, atol=1e-9):
    """Squared norms, a weighted sum and inner products between two passes (DiSK's use)."""
    psg, psg2 = engine(model, loss_batch, *batch), engine(model, loss_batch, *batch2)
    ref, ref2 = reference(model, loss_one, *batch), reference(model, loss_one, *batch2)
    torch.testing.assert_close(psg.sq_norms(), flat_dot(ref, ref), rtol=rtol, atol=atol)
    torch.testing.assert_close(psg.inner(psg2), flat_dot(ref, ref2), rtol=rtol, atol=atol)
    coef = torch.rand(len(batch[0]), dtype=torch.float64, device=batch[0].device)
    summed = psg2.weighted_sum(coef)
    assert set(summed) == set(model.parameters())
    for p, w in summed.items():
        torch.testing.assert_close(w, torch.einsum("b,b...->...", coef, ref2[p]), rtol=rtol, atol=atol)
    return ref


def tokens(shape, vocab, generator=None):
    return torch.randint(0, vocab, shape, generator=generator)


# (layer, input maker): each input (B, ...) of the layer's kind
LAYERS = [
    (nn.Linear(6, 4), lambda: torch.randn(B, T, 6, dtype=torch.float64)),
    (nn.Linear(6, 4, bias=False), lambda: torch.randn(B, 3, T, 6, dtype=torch.float64)),
    (nn.Embedding(5, 4), lambda: tokens((B, T), 5)),  # few rows: many repeated indices in a record
    (nn.Embedding(40, 3), lambda: tokens((B, T), 40)),
    (nn.Embedding(9, 4), lambda: tokens((B,), 9)),  # one position per record
    (nn.Embedding(5, 4, padding_idx=0), lambda: tokens((B, T), 5)),  # a BERT's word embeddings: row 0 gets none
    (nn.Embedding(9, 4, padding_idx=3), lambda: tokens((B,), 9)),
    (nn.LayerNorm(6), lambda: 1 + 2 * torch.randn(B, T, 6, dtype=torch.float64)),
    (nn.LayerNorm(6, bias=False), lambda: torch.randn(B, T, 6, dtype=torch.float64)),
    (nn.LayerNorm((3, 4), eps=0.5), lambda: torch.randn(B, T, 3, 4, dtype=torch.float64)),
    (nn.LayerNorm(6), lambda: torch.randn(B, 6, dtype=torch.float64)),  # one position per record
]


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost", "materialised"])
@pytest.mark.parametrize("layer,make", LAYERS, ids=[repr(m) + str(tuple(f().shape)) for m, f in LAYERS])
def test_sequence_layers_both_paths(layer, make, ghost, monkeypatch, device):
    monkeypatch.setattr(LayerGrads, "use_ghost", property(lambda self: ghost))
    layer = copy.deepcopy(layer).double().to(device)
    with torch.no_grad():  # weights away from LayerNorm's initial (1, 0) so every term counts
        for p in layer.parameters():
            p.add_(torch.randn_like(p))
    x, x2 = make().to(device), make().to(device)
    target = torch.randn_like(layer(x))

    def loss_batch(x, t):
        return (layer(x).tanh() * t).flatten(1).sum(1)

    def loss_one(p, x, t):
        return (functional_call(layer, p, (x[None],)).tanh() * t[None]).sum()

    check_against_reference(layer, loss_batch, loss_one, (x, target), (x2, target.flip(0)))


@pytest.mark.parametrize("positions,vocab,ghost", [(128, 258, False), (128, 50257, True), (1, 258, True),
                                                   (16, 258, True), (16, 200, False)])
def test_embedding_takes_the_cheaper_path(positions, vocab, ghost):
    """Ghost ~P^2 d per sample, materialising ~(V + P) d: the ghost path iff P^2 < V + P."""
    layer = nn.Embedding(vocab, 4)
    idx = tokens((2, positions), vocab)
    assert layer_grads(layer, idx, torch.randn(2, positions, 4)).use_ghost is ghost


@pytest.mark.parametrize("d_in,d_out,positions,ghost", [(128, 128, 128, False), (128, 512, 128, False),
                                                          (128, 128, 32, True), (512, 512, 128, True), (7, 5, 1, True)])
def test_linear_on_sequences_takes_the_cheaper_path(d_in, d_out, positions, ghost):
    """P = T positions per record: ghost ~P^2 (d_in + d_out), materialising ~P d_in d_out."""
    x = torch.randn(2, positions, d_in)
    layer = layer_grads(nn.Linear(d_in, d_out), x, torch.randn(2, positions, d_out))
    assert layer._positions == positions and layer.use_ghost is ghost


@pytest.mark.parametrize("option,value", [("max_norm", 1.0), ("scale_grad_by_freq", True),
                                          ("sparse", True)])
def test_embedding_options_are_refused_by_name(option, value):
    model = nn.Sequential(nn.Embedding(10, 4, **{option: value}), nn.Linear(4, 2))
    with pytest.raises(UnsupportedLayerError, match=rf"layer '0' \(Embedding\): option {option}="):
        Tape(model)


class Tied(nn.Module):
    per_sample_forward = True

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(self.emb(idx))


def test_tied_weights_are_refused_by_name():
    with pytest.raises(UnsupportedLayerError, match=r"parameter 'head.weight' is the same tensor as 'emb.weight'"):
        Tape(Tied())


class MeanOverBatch(nn.Module):
    def forward(self, x):
        return x - x.mean(0)


def test_a_layer_mixing_samples_is_still_refused_in_a_sequence_model():
    model = TransformerLM(vocab_size=11, context=8, d_model=8, n_layers=1, n_heads=2, d_mlp=16)
    model.blocks[0].mlp.insert(1, MeanOverBatch())
    with pytest.raises(SampleMixingError, match=r"layer 'blocks.0.mlp.1' \(MeanOverBatch\) may mix samples"):
        Tape(model)


# -- P4 ------------------------------------------------------------------------------------------


def tiny_lm(context=8):
    torch.manual_seed(0)
    return TransformerLM(vocab_size=258, context=context, d_model=16, n_layers=2, n_heads=2, d_mlp=32).double()


def padded(lengths, T, generator):
    """Byte records of the given lengths, right-padded with PAD to T: (inputs, targets)."""
    seq = torch.full((len(lengths), T + 1), PAD)
    for i, n in enumerate(lengths):
        seq[i, :n + 1] = tokens((n + 1,), 256, generator)
    return seq[:, :-1], seq[:, 1:]


def lm_losses(model):
    def loss_batch(x, y):
        return token_losses(model(x), y, PAD)

    def loss_one(p, x, y):
        return token_losses(functional_call(model, p, (x[None],)), y[None], PAD)[0]

    return loss_batch, loss_one


def test_p4_parameter_count_and_shapes():
    model = TransformerLM()
    assert sum(p.numel() for p in model.parameters()) == 876_034
    assert model(torch.zeros(2, 128, dtype=torch.int64)).shape == (2, 128, 258)
    check_per_sample(model)
    layers = trainable_layers(model)  # 2 embeddings, 4 x (2 LayerNorms + 6 Linear), final LayerNorm, head
    assert len(layers) == 36
    assert {p for m in layers for p in m.parameters(recurse=False)} == set(model.parameters())


@pytest.mark.parametrize("ghost", [None, True, False], ids=["chosen", "ghost", "materialised"])
def test_p4_per_sample_gradients_match_torch_func(ghost, monkeypatch, device):
    if ghost is not None:
        monkeypatch.setattr(LayerGrads, "use_ghost", property(lambda self: ghost))
    model = tiny_lm().to(device)
    g = torch.Generator().manual_seed(1)
    batch = [t.to(device) for t in padded([8, 3, 6], 8, g)]
    batch2 = [t.to(device) for t in padded([2, 8, 5], 8, g)]
    check_against_reference(model, *lm_losses(model), batch, batch2)


def test_padding_does_not_change_a_records_gradient():
    """The same records right-padded to 16 or to 32: identical per-sample losses and gradients
    (the model is causal, padded targets carry no loss)."""
    model = tiny_lm(context=32)
    x16, y16 = padded([16, 5, 11], 16, torch.Generator().manual_seed(2))
    x32 = torch.cat([x16, torch.full((3, 16), PAD)], 1)
    y32 = torch.cat([y16, torch.full((3, 16), PAD)], 1)
    loss_batch, loss_one = lm_losses(model)
    torch.testing.assert_close(loss_batch(x16, y16), loss_batch(x32, y32), rtol=1e-12, atol=0)
    a, b = engine(model, loss_batch, x16, y16), engine(model, loss_batch, x32, y32)
    torch.testing.assert_close(a.sq_norms(), b.sq_norms(), rtol=1e-10, atol=0)
    torch.testing.assert_close(a.inner(b), a.sq_norms(), rtol=1e-10, atol=0)
    coef = torch.tensor([0.3, 1.0, 0.7], dtype=torch.float64)
    sa, sb = a.weighted_sum(coef), b.weighted_sum(coef)
    for p in model.parameters():
        torch.testing.assert_close(sa[p], sb[p], rtol=1e-10, atol=1e-14)
    # and the reference agrees per record (the padded positions' embedding rows get nothing)
    ra, rb = reference(model, loss_one, x16, y16), reference(model, loss_one, x32, y32)
    for p in model.parameters():
        torch.testing.assert_close(ra[p], rb[p], rtol=1e-10, atol=1e-14)
    assert rb[model.pos_emb.weight][:, 16:].abs().max() == 0


def test_token_losses_are_the_mean_over_real_targets():
    logits = torch.randn(2, 4, 258, dtype=torch.float64)
    targets = torch.tensor([[5, 7, PAD, PAD], [PAD, PAD, PAD, PAD]])
    logp = logits.log_softmax(-1)
    expected = -(logp[0, 0, 5] + logp[0, 1, 7]) / 2
    torch.testing.assert_close(token_losses(logits, targets, PAD), torch.stack([expected, logp.new_zeros(())]))
