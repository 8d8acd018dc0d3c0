"""RoBERTa as a local encoder (``--pretrained-dir``), on the tiny RoBERTa fixture
(tests/tiny_roberta.py: byte-level BPE, pad id 1, positions after it, one token type): the encoder
types (``encoders.ENCODER_TYPES``), the directory's checks and refusals, the features against
transformers' own forward (BERT's too), the bert-encoder table in RoBERTa's order (at
roberta-base's size as well), Opacus's per-sample gradients, a `dpbench train` run and the grid's
d. tests/problems/test_problems_encoder.py runs every test of a start on both fixtures: every
mode's trained set and count, every optimizer in every mode, per-sample gradients against
autograd, the Opacus peer, the cached features and the steps in groups."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import copy_of, one_line, tree_env
from dpbench.privacy.per_sample import DECLARED_PER_SAMPLE
from dpbench.problems import encoders, facts, get_problem, modes
from dpbench.problems.encoder_classification import PublicEncoder
from dpbench.problems.encoders import EncoderError
from dpbench.training.harness import build_model
from tiny_roberta import DIMS, PAD, TOKENS

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = [modes.Full(), modes.LastBlock(), modes.LoRA(4), modes.Bias(), modes.Head()]
IDS = [m.name for m in MODES]
TEXTS = ["the fortune cookie is wise", "love", "time is life and day is night, you fool!", "you are wise",
         "he was the one with his cookies", "at night"]
# roberta-base's config.json (FacebookAI/roberta-base): its dimensions
ROBERTA_BASE = {"vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1, "hidden_size": 768,
                "num_hidden_layers": 12, "intermediate_size": 3072, "num_attention_heads": 12, "pad_token_id": 1}


@pytest.fixture(scope="module")
def start(tiny_roberta_dir):
    return PublicEncoder.load(tiny_roberta_dir)


def built(start, mode, seed=0):
    return build_model(get_problem("P7"), seed, "cpu", start, mode)


# -- the encoder types ---------------------------------------------------------------------------

def test_the_encoder_types_are_bert_and_roberta_and_place_positions_as_transformers_does():
    assert list(encoders.ENCODER_TYPES) == ["bert", "roberta"]
    bert, roberta = encoders.ENCODER_TYPES["bert"], encoders.ENCODER_TYPES["roberta"]
    assert (bert.model_class, roberta.model_class) == ("BertModel", "RobertaModel")
    assert bert.first_position(0) == 0 and bert.usable_positions(512, 0) == 512
    # roberta-base: 514 positions, pad 1, so a record's tokens sit at 2..513: 512 of them
    assert roberta.first_position(1) == 2 and roberta.usable_positions(514, 1) == 512
    assert roberta.tokenizers == (("tokenizer.json",), ("vocab.json", "merges.txt"))


def test_roberta_classes_are_declared_with_the_embeddings_buffers_they_hold(start):
    from transformers.models.roberta import modeling_roberta

    declared = {t.__name__: sorted(b) for t, b in DECLARED_PER_SAMPLE.items()
                if t.__module__ == modeling_roberta.__name__}
    assert declared == {"RobertaModel": [], "RobertaEmbeddings": ["position_ids", "token_type_ids"],
                        "RobertaEncoder": [], "RobertaLayer": [], "RobertaAttention": [],
                        "RobertaSelfAttention": [], "RobertaSelfOutput": [], "RobertaIntermediate": [],
                        "RobertaOutput": []}
    model = start.loaded.model
    assert sorted(name for name, _ in model.named_buffers()) == ["embeddings.position_ids",
                                                                 "embeddings.token_type_ids"]
    # every module of the built model is a declared class, a registered layer or a container
    types = {type(m).__name__ for m in model.modules()}
    assert types - set(declared) <= {"Embedding", "LayerNorm", "Dropout", "Linear", "ModuleList", "GELUActivation"}


# -- the directory ---------------------------------------------------------------------------------

def test_a_roberta_directory_is_checked_and_its_facts_read_without_torch(tiny_roberta_dir):
    f = encoders.config_facts(tiny_roberta_dir)
    assert (f.model_type, f.pad_token_id, f.type_vocab_size, f.max_position_embeddings) == ("roberta", PAD, 1,
                                                                                             TOKENS + 2)
    assert f.usable_positions == TOKENS and f.hidden_size == DIMS["hidden_size"]
    code = (f"import sys; from dpbench.problems import encoders; f = encoders.config_facts({str(tiny_roberta_dir)!r}); "
            "print(f.usable_positions, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=tree_env(), check=True)
    assert out.stdout.strip() == f"{TOKENS} []", out.stderr


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "model_type": "distilbert"})),
     r"config\.json: model_type 'distilbert' is not a BERT-family encoder \(supported: bert, roberta\)$"),
    (lambda d: [(d / f).unlink() for f in ("tokenizer.json", "vocab.json", "merges.txt")],
     r"/tokenizer\.json: missing \(and no vocab\.json with merges\.txt\), so .* has no tokenizer$"),
    (lambda d: [(d / f).unlink() for f in ("tokenizer.json", "merges.txt")],
     r"/merges\.txt: missing \(with vocab\.json it defines the tokenizer\), so .* has no tokenizer$"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "max_position_embeddings": 2})),
     r"config\.json: max_position_embeddings 2 leaves no position for a token \(roberta's positions start at "
     r"pad_token_id \+ 1 = 2\)$"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "pad_token_id": None})),
     r"config\.json: pad_token_id must be a non-negative integer \(a roberta numbers positions after it\), "
     r"got None$"),
])
def test_a_roberta_directory_lacking_a_file_or_of_another_type_is_refused_in_one_line(
        tiny_roberta_dir, tmp_path, damage, message):
    directory = copy_of(tiny_roberta_dir, tmp_path)
    damage(directory)
    with pytest.raises(EncoderError) as e:
        encoders.config_facts(directory)
    assert re.search(message, one_line(e)), str(e.value)


def test_vocab_and_merges_alone_are_a_roberta_tokenizer(tiny_roberta_dir, tmp_path):
    """roberta-base's own files (vocab.json, merges.txt) without tokenizer.json or its config:
    AutoTokenizer builds the same tokenizer."""
    from dpbench.problems.encoder_model import encode, load_encoder

    directory = copy_of(tiny_roberta_dir, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).unlink()
    bare, full = load_encoder(directory), load_encoder(tiny_roberta_dir)
    assert bare.pad_id == full.pad_id == PAD
    assert torch.equal(encode(bare.tokenizer, TEXTS, 12), encode(full.tokenizer, TEXTS, 12))


def test_a_tokenizer_padding_with_another_id_than_the_configs_is_refused(tiny_roberta_dir, tmp_path):
    """A RoBERTa numbers positions after config.json's pad_token_id and masks the tokenizer's pad:
    the two must be one id."""
    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(tiny_roberta_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "pad_token_id": 3}))
    with pytest.raises(EncoderError) as e:
        load_encoder(directory)
    assert one_line(e) == (f"{directory}: the tokenizer's pad id 1 is not config.json's pad_token_id 3, after "
                           "which a roberta numbers positions")


@pytest.mark.parametrize("fixture", ["tiny_bert_dir", "tiny_roberta_dir"])
def test_a_zeroed_tokenizer_file_is_refused_in_one_line_naming_it(fixture, request, tmp_path):
    """A user's directory has no catalogued hashes: a damaged tokenizer.json is named when read."""
    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(request.getfixturevalue(fixture), tmp_path)
    (directory / "tokenizer.json").write_bytes(bytes(100))
    with pytest.raises(EncoderError) as e:
        load_encoder(directory)
    assert re.fullmatch(re.escape(str(directory / "tokenizer.json")) + r": not a readable tokenizer \(with "
                        r"(vocab\.txt|vocab\.json, merges\.txt); JSONDecodeError: .*\)", one_line(e))


# -- the model ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["tiny_bert_dir", "tiny_roberta_dir"])
def test_features_are_transformers_own_forward_on_a_right_padded_batch(fixture, request):
    """EncoderClassifier passes position ids itself ((B, T), for Opacus): the pooled features of a
    right-padded batch of records of different lengths are those of the model's own forward with
    only input_ids and attention_mask (transformers' default positions: 0.. for a BERT,
    pad_id + 1 + i for a RoBERTa's i-th real token), and a RoBERTa numbered from 0 is not."""
    from dpbench.problems.encoder_model import EncoderClassifier, encode, load_encoder

    loaded = load_encoder(request.getfixturevalue(fixture))
    model = EncoderClassifier.from_loaded(loaded, classes=3)
    x = encode(loaded.tokenizer, TEXTS, 16)
    mask = x != loaded.pad_id
    assert len(set(mask.sum(1).tolist())) > 3 and not mask[:, -1].all()  # lengths differ; padding on the right
    with torch.no_grad():
        ours = model.features(x)
        hidden = loaded.model(input_ids=x, attention_mask=mask.long()).last_hidden_state
        m = mask.unsqueeze(-1).float()
        theirs = (hidden * m).sum(1) / m.sum(1)
        theirs = F.normalize(theirs, dim=1) if loaded.pooling.normalize else theirs
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        if loaded.facts.model_type == "roberta":
            assert model.first_position == PAD + 1
            model.first_position = 0  # BERT's numbering: every position two rows off
            assert (model.features(x) - theirs).abs().max() > 1e-2


def test_the_table_is_the_built_models(start):
    """The bert-encoder table with model_type roberta: the built model's parameters, names, sizes
    and order (a RoBERTa registers its position embeddings after the LayerNorm)."""
    assert start.model_dims["model_type"] == "roberta"
    model = built(start, modes.Full())
    arch = facts("P7").architecture(start.model_dims)
    assert list(arch.parameters) == [(n, p.numel()) for n, p in model.named_parameters()]
    assert list(arch.parameters)[1:5] == [
        ("encoder.embeddings.token_type_embeddings.weight", 1 * 32), ("encoder.embeddings.LayerNorm.weight", 32),
        ("encoder.embeddings.LayerNorm.bias", 32), ("encoder.embeddings.position_embeddings.weight", 66 * 32)]


def test_the_table_at_roberta_bases_size_is_robertamodels():
    """roberta-base's dimensions (514 positions, one token type), built on the meta device: the
    table is RobertaModel's without pooler, and its size roberta-base's 124,645,632 less the
    pooler's 590,592."""
    from dpbench.problems.encoder_model import EncoderClassifier, _transformers

    transformers = _transformers()
    config = transformers.RobertaConfig(**{k: v for k, v in ROBERTA_BASE.items()}, attn_implementation="eager")
    with torch.device("meta"):
        model = EncoderClassifier(transformers.RobertaModel(config, add_pooling_layer=False),
                                  encoders.Pooling(), 40, 1)
    dims = {k: v for k, v in ROBERTA_BASE.items() if k not in ("num_attention_heads", "pad_token_id")}
    arch = facts("P7").architecture({**dims, "model_type": "roberta"})
    assert list(arch.parameters) == [(n, p.numel()) for n, p in model.named_parameters()]
    assert arch.total == 124_645_632 - 590_592 + 768 * 40 + 40


def test_max_tokens_are_the_usable_positions(start):
    """P7 cuts records to 128 tokens or the encoder's usable positions: the tiny RoBERTa's 66
    position rows hold 64 tokens after the pad id's 2."""
    assert start.max_tokens == TOKENS == start.loaded.facts.max_position_embeddings - PAD - 1
    assert start.start_facts()["max_tokens"] == TOKENS
    x = torch.full((1, TOKENS), 5)
    x[0, 0], x[0, -1] = 0, 2
    with torch.no_grad():  # the longest record reaches the last position row, and no further
        assert built(start, modes.Head())(x).shape == (1, 40)


# -- a run and the grid ------------------------------------------------------------------------------

def test_a_p7_run_from_a_local_roberta(tiny_roberta_dir, labelled_corpus, tmp_path):
    from dpbench.cli import main
    from dpbench.reporting.results import read_meta

    out = tmp_path / "run.parquet"
    args = ["train", "--problem", "P7", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "8", "--epochs", "1",
            "--seed", "0", "--epsilon", "3", "--finetune", "full", "--pretrained-dir", str(tiny_roberta_dir),
            "--data-dir", str(labelled_corpus), "--max-steps", "3", "--out", str(out)]
    assert main(args) == 0
    meta = read_meta(out)
    s = meta["start"]
    assert s["kind"] == "public checkpoint" and s["encoder"] is None
    assert s["encoder_files"] == encoders.file_hashes(tiny_roberta_dir)
    assert s["model_dims"]["model_type"] == "roberta" and s["max_tokens"] == TOKENS
    assert s["trainable_parameters"] == facts("P7").trainable(s["model_dims"], modes.Full()) == sum(
        p.numel() for p in built(PublicEncoder.load(tiny_roberta_dir), modes.Full()).parameters())
    assert meta["privacy"]["epsilon"] <= 3.0 and meta["result"]["status"] == "completed"
    assert 0.0 <= meta["result"]["best_test_accuracy"] <= 1.0


def test_the_grid_counts_d_of_a_roberta_directory(tiny_roberta_dir, start):
    from dpbench.pipeline.grid import expand, validate

    config = {"data_dir": "data", "results_dir": "results-encoder", "pretrained_dir": str(tiny_roberta_dir),
              "train": {"accountant": "rdp", "max_steps": 2},
              "grid": [{"problems": ["P7"], "batch_sizes": [16], "epsilons": [10], "epochs": [1], "seeds": [0],
                        "finetune": ["full", "lora", "bias"], "lora_ranks": [4],
                        "optimizers": {"dpsgd": {"lr": [0.5]}}}]}
    cells = expand(validate(config))
    assert len(cells) == 3
    for cell in cells:
        model = built(start, cell.start.mode)
        assert cell.trainable_parameters == sum(p.numel() for p in model.parameters() if p.requires_grad)
