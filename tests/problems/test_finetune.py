"""Fine-tuning modes (dpbench.problems.modes, dpbench.problems.finetune) on a tiny TransformerLM:
which parameters each mode trains and their count d against the torch-free formula, the
refusals, per-sample gradients for trainable parameters only, and, for every optimizer of the
registry in every mode, that a step changes exactly the trainable parameters (the frozen ones
stay bit for bit), that LoRA's adapters do change and move the model's output, and that d of the
mechanisms (a dense matrix mechanism's noise file, D2P2's projection) is the trainable count."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

from dpbench.mechanisms.base import PlanRequest
from dpbench.optimizers import OPTIMIZERS
from dpbench.optimizers.base import Context
from dpbench.privacy.clipping import Clipping, NoClipping
from dpbench.privacy.per_sample import Tape, trainable_layers
from dpbench.problems import architectures, facts, get_problem, language, modes, tokenizer
from dpbench.problems.architectures import transformer_lm
from dpbench.problems.finetune import LoRALinear, start_record
from dpbench.problems.modes import Bias, Full, Head, LastBlock, LoRA
from dpbench.problems.transformer import TransformerLM
from dpbench.training.harness import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

from conftest import assert_moves_exactly_the_trained, stand_in_checkpoint  # noqa: E402

TINY = {"vocab_size": 258, "context": 16, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_mlp": 32}
MODES = [Full(), LastBlock(), LoRA(4), Bias(), Head()]
MODE_IDS = [f.name for f in MODES]


def trainable_parameters(dims, head, mode):
    """d from the architecture's table (the torch-free count the grid uses)."""
    arch = transformer_lm(dims, head)
    return arch.total if mode is None else mode.trainable_parameters(arch)


def checkpoint(dims=TINY, seed=0):
    """A stand-in for a loaded public checkpoint (conftest.stand_in_checkpoint)."""
    return stand_in_checkpoint(dims, seed, "ab" * 32)


def tokens(n=6, width=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, width), generator=gen)
    for i in range(n):  # records of different lengths: [BOS] + bytes + [EOS] + PAD
        length = 4 + (i * 3) % (width - 4)
        x[i, 0], x[i, length - 1], x[i, length:] = tokenizer.BOS, tokenizer.EOS, tokenizer.PAD
    return x


def trainable_names(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


# -- the trainable sets and their counts ------------------------------------------------------

def test_default_dims_are_the_transformers():
    sig = inspect.signature(TransformerLM)
    assert architectures.DEFAULT_DIMS == {k: v.default for k, v in sig.parameters.items()}


@pytest.mark.parametrize("problem", ["P5", "P6"])
@pytest.mark.parametrize("dims", [TINY, {}], ids=["tiny", "default"])
@pytest.mark.parametrize("finetune", MODES + [LoRA(), LoRA(1), None],
                         ids=MODE_IDS + ["lora-default-rank", "lora-1", "none"])
def test_trainable_count_is_the_built_models(problem, dims, finetune):
    spec = get_problem(problem)
    model = build_model(spec, 0, "cpu", checkpoint({**architectures.DEFAULT_DIMS, **dims}), finetune)
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert d == facts(problem).trainable(dims, finetune)
    head = None if problem == "P5" else len(facts(problem).classes)
    assert d == trainable_parameters(dims, head, finetune)
    if finetune is None or finetune.name == "full":
        assert d == sum(p.numel() for p in model.parameters())
        if not dims:
            assert d == facts(problem).parameters  # the catalog's d is the full model's


def test_default_counts_pinned():
    """P4's default dimensions (d_model 128, 4 layers, vocab 258), P6's head of 40 classes."""
    counts = {(p, f.name, getattr(f, "rank", None)): facts(p).trainable({}, f) for p in ("P5", "P6")
              for f in (Full(), LastBlock(), LoRA(), LoRA(4), Bias(), Head())}
    # lora: per block r (4 (128 + 128) + (128 + 512) + (512 + 128)) = 2304 r; bias: per block
    # 2*128 + 4*128 + 512 + 128 = 1408, 4 blocks + the final LayerNorm's 128
    assert counts == {
        ("P5", "full", None): 876_034, ("P5", "last-block", None): 198_272 + 256 + 33_282,
        ("P5", "lora", 16): 4 * 2304 * 16, ("P5", "lora", 4): 4 * 2304 * 4, ("P5", "bias", None): 4 * 1408 + 128 + 258,
        ("P6", "full", None): 847_912, ("P6", "last-block", None): 198_272 + 256 + 5160,
        ("P6", "lora", 16): 4 * 2304 * 16 + 5160, ("P6", "lora", 4): 4 * 2304 * 4 + 5160,
        ("P6", "bias", None): 4 * 1408 + 128 + 5160,
        ("P5", "head", None): 33_282, ("P6", "head", None): 5160,
    }


@pytest.mark.parametrize("problem", ["P5", "P6"])
def test_each_mode_trains_its_set(problem):
    new_head = {"head.weight", "head.bias"} if problem == "P6" else set()
    built = {f.name: build_model(get_problem(problem), 0, "cpu", checkpoint(), f) for f in MODES}
    everything = {n for n, _ in built["full"].named_parameters()}
    assert trainable_names(built["full"]) == everything
    assert trainable_names(built["last-block"]) == {n for n in everything
                                                    if n.startswith(("blocks.1.", "ln_f.", "head."))}
    lora = built["lora"]
    adapters = {f"blocks.{b}.{layer}.lora_{ab}.weight" for b in range(2) for ab in "ab"
                for layer in ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.0", "mlp.2")}
    assert trainable_names(lora) == adapters | new_head
    assert all(type(m.lora_a) is nn.Linear and type(m.lora_b) is nn.Linear and not m.base.weight.requires_grad
               for m in lora.modules() if isinstance(m, LoRALinear))
    assert sum(isinstance(m, LoRALinear) for m in lora.modules()) == 12
    assert all(torch.equal(m.lora_b.weight, torch.zeros_like(m.lora_b.weight)) for m in lora.modules()
               if isinstance(m, LoRALinear))  # B = 0: the adapted model starts as the pretrained one
    assert next(m for m in lora.modules() if isinstance(m, LoRALinear)).scale == modes.LORA_ALPHA / 4
    bias = {n for n in everything if n.endswith(".bias")} | new_head
    assert trainable_names(built["bias"]) == bias and "ln_f.bias" in bias and "blocks.0.ln1.bias" in bias
    assert trainable_names(built["head"]) == {"head.weight", "head.bias"}


@pytest.mark.parametrize("problem", ["P5", "P6"])
@pytest.mark.parametrize("dims", [TINY, {}], ids=["tiny", "default"])
def test_the_architecture_table_is_the_built_models(problem, dims):
    """The torch-free table every mode counts over: the model's parameters, names, sizes and order."""
    model = get_problem(problem).build_pretrained(architectures.dims_of(dims))
    arch = facts(problem).architecture(dims)
    assert list(arch.parameters) == [(n, p.numel()) for n, p in model.named_parameters()]
    assert arch.total == sum(p.numel() for p in model.parameters())
    for prefix in arch.blocks:
        for name, d_in, d_out in arch.adapted:
            layer = model.get_submodule(prefix + name)
            assert (layer.in_features, layer.out_features) == (d_in, d_out)


def test_lora_starts_as_the_pretrained_model_and_the_head_from_the_seed():
    ck = checkpoint()
    x = tokens()
    pretrained = TransformerLM(**TINY)
    pretrained.load_state_dict(ck.state_dict)
    for f in MODES:
        model = build_model(get_problem("P5"), 3, "cpu", ck, f)
        assert torch.equal(model(x), pretrained(x)), f.name  # every mode starts at the checkpoint
    a, b, c = (build_model(get_problem("P6"), s, "cpu", ck, LoRA(4)) for s in (3, 3, 4))
    assert torch.equal(a.head.weight, b.head.weight) and not torch.equal(a.head.weight, c.head.weight)
    assert torch.equal(a.blocks[0].attn.q.lora_a.weight, b.blocks[0].attn.q.lora_a.weight)
    assert torch.equal(a.tok_emb.weight, ck.state_dict["tok_emb.weight"])


def test_start_record():
    ck = checkpoint()
    model = build_model(get_problem("P5"), 0, "cpu", ck, LoRA(4))
    rec = start_record(ck, LoRA(4), model)
    assert rec["kind"] == "public checkpoint" and rec["checkpoint_sha256"] == "ab" * 32
    assert rec["recipe"] == "wordnet-lm" and rec["pretraining_epsilon"] == 0.0
    assert (rec["mode"], rec["lora_rank"], rec["lora_alpha"]) == ("lora", 4, 16)
    # 2 blocks of r (4 (16 + 16) + (16 + 32) + (32 + 16)) adapter weights, r = 4
    assert rec["trainable_parameters"] == trainable_parameters(TINY, None, LoRA(4)) == 2 * 4 * 224
    scratch = start_record(None, None, build_model(get_problem("P4"), 0, "cpu"))
    assert scratch["kind"] == "scratch" and scratch["trainable_parameters"] == 876_034 == scratch["parameters"]


# -- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make,match", [
    (lambda: modes.parse("adapters"), "finetune mode 'adapters' is unknown"),
    (lambda: LoRA(0), "finetune lora_rank must be an integer >= 1"),
    (lambda: modes.parse("lora", lora_rank=0), "finetune lora_rank must be an integer >= 1"),
    (lambda: modes.parse("bias", lora_rank=4), "finetune lora_rank=4 is given with mode 'bias'"),
    (lambda: LoRA(17).check(transformer_lm(TINY, None)),
     r"finetune lora_rank=17 exceeds the width 16 of layer blocks.\*.attn.q"),
    (lambda: LoRA(17).check(transformer_lm({**TINY, "d_model": 32, "d_mlp": 16}, None)),
     r"finetune lora_rank=17 exceeds the width 16 of layer blocks.\*.mlp.0"),
    (lambda: build_model(get_problem("P5"), 0, "cpu", checkpoint(), LoRA(17)), "lora_rank=17 exceeds"),
    (lambda: build_model(get_problem("P4"), 0, "cpu", checkpoint(), LoRA(4)),
     "finetune mode 'lora': problem P4 trains from scratch"),
    (lambda: build_model(get_problem("P4"), 0, "cpu", None, Full()),
     "finetune mode 'full': no public start given; problem P4 trains from scratch"),
    (lambda: facts("P2").trainable({}, Bias()), "finetune mode 'bias': problem P2 trains from scratch"),
    (lambda: build_model(get_problem("P5"), 0, "cpu", None, Bias()), "finetune mode 'bias': no public start"),
    (lambda: architectures.dims_of({"width": 3}), "model dimension 'width'"),
    (lambda: modes.register_mode(Full), "mode 'full' is already registered"),
])
def test_refusals_name_the_key(make, match):
    with pytest.raises(ValueError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_a_checkpoint_that_does_not_fit_is_refused():
    ck = checkpoint()
    del ck.state_dict["blocks.1.ln2.bias"]
    with pytest.raises(ValueError, match="checkpoint parameter 'blocks.1.ln2.bias' is missing"):
        build_model(get_problem("P6"), 0, "cpu", ck, None)
    ck = checkpoint()
    ck.model_dims = {**TINY, "d_mlp": 64}
    with pytest.raises(ValueError, match="checkpoint parameter 'blocks.0.mlp.0.weight' has shape"):
        build_model(get_problem("P5"), 0, "cpu", ck, None)


# -- per-sample gradients for trainable parameters only -----------------------------------------

def autograd_rows(model, x):
    """Per-sample gradients of the trainable parameters, one example at a time (no dpbench)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        loss = language.per_sample_loss(model, x[i:i + 1])[0].sum()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows), params


@pytest.mark.parametrize("finetune", MODES, ids=MODE_IDS)
def test_per_sample_gradients_of_trainable_parameters_match_autograd(finetune):
    model = build_model(get_problem("P5"), 0, "cpu", checkpoint(), finetune).double()
    with torch.no_grad():  # B != 0, so LoRA's A gets gradients too
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.weight.normal_(0, 0.1)
    x = tokens()
    want, params = autograd_rows(model, x)
    tape = Tape(model)
    assert {p for m in tape.layers for p in m.parameters(recurse=False)} >= set(params)
    assert all(any(p.requires_grad for p in m.parameters(recurse=False)) for m in tape.layers)
    with tape:
        losses, _ = language.per_sample_loss(model, x)
    psg = tape.per_sample_gradients(losses)
    torch.testing.assert_close(psg.norms(), want.norm(dim=1), rtol=1e-10, atol=1e-12)
    coef = torch.linspace(0.5, 1.5, x.shape[0], dtype=torch.float64)
    summed = psg.weighted_sum(coef)
    assert set(summed) == set(params)  # nothing formed for a frozen parameter
    torch.testing.assert_close(torch.cat([summed[p].reshape(-1) for p in params]), coef @ want,
                               rtol=1e-10, atol=1e-12)
    if finetune.name == "bias":  # Linear and LayerNorm layers with a frozen weight and a trained bias
        frozen_weight = [m for m in tape.layers
                         if isinstance(m, (nn.Linear, nn.LayerNorm)) and not m.weight.requires_grad]
        # per block 2 LayerNorms and 6 Linear layers; ln_f; the head
        assert len(frozen_weight) == 2 * 8 + 2 and all(m.bias.requires_grad for m in frozen_weight)
    if finetune.name == "lora":
        assert all(type(m) is nn.Linear and not m.bias for m in tape.layers if m is not model.head)


def test_a_plugin_rule_without_frozen_support_refuses_a_partly_frozen_layer():
    from dpbench.privacy import per_sample_layers

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.shift = nn.Parameter(torch.ones(3)), nn.Parameter(torch.zeros(3))

        def forward(self, x):
            return x * self.scale + self.shift

    class ScaleGrads(per_sample_layers.LayerGrads):
        pass

    per_sample_layers.LAYER_GRADS[Scale] = ScaleGrads
    try:
        model = nn.Sequential(Scale())
        model[0].scale.requires_grad_(False)
        with pytest.raises(TypeError, match="layer '0' has partly frozen parameters"):
            trainable_layers(model)
    finally:
        del per_sample_layers.LAYER_GRADS[Scale]


# -- every optimizer in every mode: exactly the trainable parameters move -----------------------

N_TRAIN, L = 24, 6


def lm_loss(m, x, y):
    return language.per_sample_loss(m, x, y)


def make_step(name, model, cache_dir, seed=5):
    """``name``'s step on ``model``, planned and noised by its own mechanism (as the harness does)."""
    spec = OPTIMIZERS[name]
    epochs = 1 if "-se" in name else 2  # the single-epoch matrix mechanisms: one epoch
    plan = spec.mechanism.plan(PlanRequest(N_TRAIN, L, epochs, target_epsilon=4.0, cache_dir=cache_dir))
    ctx = Context(model=model, loss_fn=lm_loss, lr=0.05 if "adam" in name else 0.5, expected_batch_size=L,
                  noise_multiplier=0.7 if spec.private else 0.0,
                  clipping=Clipping(1.0) if spec.private else NoClipping(),
                  noise=spec.mechanism.noise(plan, seed, "cpu"), steps=plan.steps,
                  hyperparameters=spec.hyperparameters(None))
    return spec.build(ctx), ctx


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("finetune", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS.builtins))
def test_a_step_changes_exactly_the_trainable_parameters(name, finetune, cache_dir):
    model = build_model(get_problem("P5"), 0, "cpu", checkpoint(), finetune)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = tokens()
    with torch.no_grad():
        out_before = model(x)
    step, ctx = make_step(name, model, cache_dir)
    d = sum(p.numel() for p in ctx.params)
    assert d == trainable_parameters(TINY, None, finetune)
    for _ in range(2):  # two steps: LoRA's A has a zero gradient while B is still 0
        step(x, torch.zeros(x.shape[0], dtype=torch.int64))
    assert_moves_exactly_the_trained(model, before, f"{name} {finetune.name}", "attn.k.bias", OPTIMIZERS[name].private)
    with torch.no_grad():
        assert not torch.equal(model(x), out_before)  # the updates reach the model's output
    # d of the mechanisms is the trainable count
    if getattr(ctx.noise, "file", None) is not None:  # a dense matrix mechanism's T x d noise file
        assert ctx.noise.file.dim == d
    if getattr(step, "dimension", None) is not None:  # D2P2's projection
        assert step.dimension == d and step.privacy_record().get("dimension", d) == d
    rule_state = [t for t in _tensors(step.state_dict()["rule"]) if t.dim() > 0 and t.numel() > 1]
    assert sum(t.numel() for t in rule_state) % d == 0  # moments, residuals: shaped like the trained ones


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@pytest.mark.parametrize("finetune", MODES, ids=MODE_IDS)
def test_resuming_a_finetuning_run_continues_it(finetune, cache_dir):
    """A checkpoint of a fine-tuning run (the model's state dict, adapters and frozen base included,
    and the step's) put into a freshly built model continues it bit for bit."""
    x, y = tokens(), torch.zeros(6, dtype=torch.int64)

    def fresh():
        model = build_model(get_problem("P5"), 0, "cpu", checkpoint(), finetune)
        return model, make_step("dpadamw", model, cache_dir)[0]

    model, step = fresh()
    for _ in range(2):
        step(x, y)
    saved = copy.deepcopy({"model": model.state_dict(), "step": step.state_dict()})
    for _ in range(2):
        step(x, y)
    model2, step2 = fresh()
    model2.load_state_dict(saved["model"])
    step2.load_state_dict(saved["step"])
    for _ in range(2):
        step2(x, y)
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), n
    assert trainable_names(model2) == trainable_names(model)


@pytest.mark.parametrize("finetune", MODES, ids=MODE_IDS)
def test_opacus_dpsgd_takes_dpsgds_step_in_every_mode(finetune, cache_dir):
    """Opacus's per-sample gradients of the trainable parameters (its grad samplers on LoRA's
    adapters, on a Linear with a frozen weight) clipped at C and summed, noise off: the same update
    as ours (Opacus's clip factor divides by ||g|| + 1e-6, hence the tolerance)."""
    models = []
    for name in ("dpsgd", "opacus-dpsgd"):
        model = build_model(get_problem("P5"), 0, "cpu", checkpoint(), finetune).double()
        step, ctx = make_step(name, model, cache_dir)
        ctx.noise_multiplier, ctx.clipping = 0.0, Clipping(0.05, normalize=False)
        if name == "opacus-dpsgd":  # its DPOptimizer read sigma and C when it was built
            step.optimizer.noise_multiplier, step.optimizer.max_grad_norm, step.scale = 0.0, 0.05, 1.0
        step(tokens(), torch.zeros(6, dtype=torch.int64))
        models.append(model)
    start = build_model(get_problem("P5"), 0, "cpu", checkpoint(), finetune).double()
    for (n, p), q, p0 in zip(models[0].named_parameters(), models[1].parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7 * max(1.0, (p - p0).abs().max().item()), msg=n)
    moved = max((p - p0).abs().max().item() for p, p0 in zip(models[0].parameters(), start.parameters()))
    assert moved > 1e-3
