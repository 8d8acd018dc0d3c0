"""Per-sample gradients through a public BERT encoder (EncoderClassifier on the tiny BERT
fixture), against single-record backward passes: norms and the clipped weighted sum with every
parameter trained, with only the biases, with only the head; Opacus 1.6's hooks and its ghost
clipping on the same model; the library-class declarations (declare_per_sample) and their
refusals."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpbench.privacy.per_sample import (DECLARED_PER_SAMPLE, LayerGrads, SampleMixingError, Tape,
                                        UnsupportedLayerError, check_per_sample, declare_per_sample)

TEXTS = ["the fortune cookie is wise", "love", "time is life and day is night, you fool!", "you are wise",
         "he was the one with his cookies", "at night"]
CLASSES = 5
MODES = {
    "all": lambda name: True,
    "biases": lambda name: name.endswith(".bias"),
    "head": lambda name: name.startswith("head."),
}


@pytest.fixture(scope="module")
def loaded(tiny_bert_dir):
    from dpbench.problems.encoder_model import load_encoder

    return load_encoder(tiny_bert_dir)


def classifier(loaded, trained):
    from dpbench.problems.encoder_model import EncoderClassifier

    torch.manual_seed(0)
    # a fresh copy of the encoder (the loaded one is shared by the module's tests), in float64
    model = EncoderClassifier(type(loaded.model)(loaded.model.config, add_pooling_layer=False), loaded.pooling,
                              CLASSES, loaded.pad_id)
    model.encoder.load_state_dict(loaded.model.state_dict())
    model = model.double().train()
    for name, p in model.named_parameters():
        p.requires_grad_(trained(name))
    return model


def batch(loaded):
    from dpbench.problems.encoder_model import encode

    tokens = encode(loaded.tokenizer, TEXTS, max_length=12)
    return tokens, torch.arange(len(TEXTS)) % CLASSES


def reference(model, tokens, labels):
    """{parameter: (B, *shape)} from one backward pass per record (each with its padding)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(len(tokens)):
        loss = F.cross_entropy(model(tokens[i:i + 1]), labels[i:i + 1], reduction="sum")
        rows.append(torch.autograd.grad(loss, params))
    return {p: torch.stack(g) for p, g in zip(params, zip(*rows))}


def norms_of(per_sample: dict) -> torch.Tensor:
    return torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost", "materialised"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_engine_matches_single_record_backward_passes(loaded, mode, ghost, monkeypatch):
    monkeypatch.setattr(LayerGrads, "use_ghost", property(lambda self: ghost))
    model = classifier(loaded, MODES[mode])
    tokens, labels = batch(loaded)
    assert tokens.eq(loaded.pad_id).any()  # records of several lengths: padding is in play
    ref = reference(model, tokens, labels)
    tape = Tape(model)
    with tape:
        losses = F.cross_entropy(model(tokens), labels, reduction="none")
    psg = tape.per_sample_gradients(losses)
    norms = psg.norms()
    torch.testing.assert_close(norms, norms_of(ref), rtol=1e-9, atol=1e-12)
    assert norms.min() > 0.1
    # the clipped sum (clip norm below every record's norm, so every record is clipped)
    clip = 0.5 * float(norms.min())
    coef = (clip / norms).clamp(max=1.0)
    summed = psg.weighted_sum(coef)
    assert set(summed) == set(ref)
    for p, g in summed.items():
        torch.testing.assert_close(g, torch.einsum("b,b...->...", coef, ref[p]), rtol=1e-9, atol=1e-12)
    if mode == "all":  # the pad row of the word embeddings gets no gradient, as autograd gives it none
        word = model.encoder.embeddings.word_embeddings
        assert word.padding_idx == loaded.pad_id and summed[word.weight][loaded.pad_id].eq(0).all()
        assert len(ref) == sum(1 for _ in model.parameters())


def test_frozen_parameters_get_no_gradient_and_are_not_taped(loaded):
    model = classifier(loaded, MODES["biases"])
    tape = Tape(model)
    assert all(not m.weight.requires_grad for m in tape.layers if getattr(m, "weight", None) is not None)
    head_only = Tape(classifier(loaded, MODES["head"]))
    assert [type(m) for m in head_only.layers] == [nn.Linear] and head_only.layers[0].out_features == CLASSES


@pytest.mark.parametrize("mode", ["all", "head"])
def test_opacus_hooks_give_the_same_per_sample_gradients(loaded, mode):
    """Opacus 1.6's GradSampleModule (hooks) on the EncoderClassifier: the same per-sample
    gradients, the word embeddings' padding_idx included."""
    from opacus.grad_sample import GradSampleModule

    model = classifier(loaded, MODES[mode])
    tokens, labels = batch(loaded)
    ref = reference(model, tokens, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # full backward hooks on modules whose inputs need no gradient
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
        F.cross_entropy(gsm(tokens), labels, reduction="sum").backward()
    for p, g in ref.items():
        torch.testing.assert_close(p.grad_sample, g, rtol=1e-9, atol=1e-12)
    gsm._close()


def test_opacus_ghost_clipping_gives_the_same_norms(loaded):
    """Opacus 1.6's fast gradient clipping (ghost norms) works on the EncoderClassifier, whose
    position ids are (B, T) and contiguous (Opacus issue #841; an expanded view fails in its
    embedding norm, which calls .view)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    model = classifier(loaded, MODES["all"])
    tokens, labels = batch(loaded)
    ref = reference(model, tokens, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="sum", max_grad_norm=1.0,
                                                   use_ghost_clipping=True)
        F.cross_entropy(gsm(tokens), labels, reduction="none").sum().backward()
    torch.testing.assert_close(gsm.get_norm_sample(), norms_of(ref), rtol=1e-9, atol=1e-12)
    gsm._close()


def test_check_encoder_accepts_the_bert_and_refuses_an_unknown_layer_in_one_line(loaded):
    from dpbench.problems.encoder_model import check_encoder

    model = classifier(loaded, MODES["all"])
    check_encoder(model)

    class Gate(nn.Module):  # trainable, not registered
        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x * self.g

    model.encoder.encoder.layer[1].output.dense = nn.Sequential(model.encoder.encoder.layer[1].output.dense, Gate())
    with pytest.raises(UnsupportedLayerError) as e:
        check_encoder(model)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("layer 'encoder.encoder.layer.1.output.dense.1' (Gate) has trainable parameters")


def test_check_encoder_refuses_a_layer_that_mixes_samples(loaded):
    from dpbench.problems.encoder_model import check_encoder

    model = classifier(loaded, MODES["head"])
    model.encoder.encoder.layer[0].intermediate.intermediate_act_fn = nn.BatchNorm1d(64, affine=False)
    with pytest.raises(SampleMixingError, match=r"^layer 'encoder\.encoder\.layer\.0\.intermediate\."
                                                r"intermediate_act_fn' \(BatchNorm1d\) may mix samples.*buffers "
                                                r"\(running_mean, running_var, num_batches_tracked\)"):
        check_encoder(model)


def test_declared_classes_are_bert_s_and_only_their_index_buffers_pass(loaded):
    from transformers.models.bert import modeling_bert

    declared = {t.__name__: sorted(b) for t, b in DECLARED_PER_SAMPLE.items() if t.__module__ == modeling_bert.__name__}
    assert declared == {"BertModel": [], "BertEmbeddings": ["position_ids", "token_type_ids"], "BertEncoder": [],
                        "BertLayer": [], "BertAttention": [], "BertSelfAttention": [], "BertSelfOutput": [],
                        "BertIntermediate": [], "BertOutput": []}
    model = classifier(loaded, MODES["all"])
    embeddings = model.encoder.embeddings
    embeddings.register_buffer("running_mean", torch.zeros(4))  # a statistic under an undeclared name
    with pytest.raises(SampleMixingError, match=r"\(BertEmbeddings\) may mix samples.*buffers \(running_mean\)"):
        check_per_sample(model)
    del embeddings.running_mean
    embeddings.token_type_ids = embeddings.token_type_ids.double()  # a declared name, but floating: refused
    with pytest.raises(SampleMixingError, match=r"buffers \(token_type_ids\)"):
        check_per_sample(model)


def test_declare_per_sample_takes_a_module_class_once():
    class Block(nn.Module):
        pass

    with pytest.raises(TypeError, match="takes a torch.nn.Module subclass"):
        declare_per_sample(object)
    try:
        declare_per_sample(Block, ("index",))
        declare_per_sample(Block, ("index",))  # the same declaration again: a no-op
        with pytest.raises(ValueError, match=r"Block is already declared per-sample with constant buffers \['index'\]"):
            declare_per_sample(Block, ())
    finally:
        DECLARED_PER_SAMPLE.pop(Block, None)
