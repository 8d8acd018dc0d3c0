"""A start's files and their bounds, without torch (docs/encoders.md, "A start's files"): what
may be read from an encoder directory before anything is built from it.

* ``MAX_BYTES``: the largest file of each kind (settings, the weights' index, a vocabulary,
  tokenizer.json, the weights); ``MAX_DIMS`` and ``MAX_ENCODER_PARAMETERS``: the largest
  dimensions config.json may give.
* ``directory_files(root)``: every regular file under a directory, refusing one that is not a
  regular file (a FIFO, a device, a socket) or a symlink that leads outside it; nothing opened.
* ``within``: a file another file names (an index's shard, the Pooling folder), refused unless
  inside the directory; ``bounded``: a file's size within its kind's bound.
* ``load_json``/``read_json``: a settings file read only if regular and bounded, nesting too deep
  for the parser one line naming it.
* ``weight_tensors(path)``: a safetensors file's tensors from its header alone, floating dtypes only.

``dpbench.problems.encoders`` (``start_files``, ``check_directory``) applies them.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from types import MappingProxyType


class EncoderError(ValueError):
    """A public encoder's files are missing, damaged or not of a supported kind (one line)."""


# -- what a start's files are, and their bounds (docs/encoders.md, "A start's files") --------------
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# The files transformers' tokenizer loader (AutoTokenizer, 5.24.0) reads from a directory where
# they are present, beside its type's vocabulary files (EncoderType.tokenizers)
TOKENIZER_SETTINGS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
# The largest file of each kind a start may hold, in bytes: a bound on what is read (and so on
# memory) stated before any file is opened. Settings (config.json, modules.json, the Pooling
# folder's config.json, the tokenizer's settings): 1 MiB (all-MiniLM-L6-v2's are under 1 KiB);
# the weights' index: 16 MiB; a vocabulary (vocab.txt, vocab.json, merges.txt): 16 MiB (RoBERTa's
# vocab.json is 0.9 MiB); tokenizer.json: 64 MiB (XLM-R's is 17 MiB); the weights (model.safetensors,
# or an index's shards together): 8 GiB (twice a model of MAX_ENCODER_PARAMETERS float32 weights).
MAX_BYTES = MappingProxyType({"settings": 1 * MIB, "index": 16 * MIB, "vocabulary": 16 * MIB,
                              "tokenizer.json": 64 * MIB, "weights": 8 * GIB})
# The largest dimensions config.json may give, checked before anything is allocated (the grid's
# parameter table is built row by row, a model layer by layer): far above every BERT-family
# encoder published (BERT-large: 24 layers, hidden 1024; XLM-R: a vocabulary of 250,002)
MAX_DIMS = MappingProxyType({"hidden_size": 16384, "num_hidden_layers": 256, "num_attention_heads": 1024,
                             "intermediate_size": 65536, "vocab_size": 1 << 21, "max_position_embeddings": 1 << 16,
                             "type_vocab_size": 1024})
MAX_ENCODER_PARAMETERS = 10**9  # an encoder's parameters (BERT-large: 3.4e8), counted from config.json
# safetensors' dtypes of floating weights: each is loaded as float32 (exactly: every F16 and BF16
# value is a float32); no other dtype is a weight (an integer one would be cast into nonsense)
FLOAT_DTYPES = ("F32", "F16", "BF16")
# integer tensors a checkpoint may carry beside its weights: the embeddings' constant index
# buffers, which transformers does not load from the file (encoders.ENCODER_TYPES declare them)
INDEX_BUFFERS = ("position_ids", "token_type_ids")
MAX_SAFETENSORS_HEADER = 100 * MIB  # safetensors' own limit on a file's JSON header


SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")


def kind_of(name: str) -> str:
    """The kind of a start's file (``MAX_BYTES``) by its name."""
    base = name.rsplit("/", 1)[-1]
    if base.endswith(".safetensors"):
        return "weights"
    if base == SAFETENSORS[1]:
        return "index"
    if base in ("vocab.txt", "vocab.json", "merges.txt"):
        return "vocabulary"
    if base == "tokenizer.json":
        return "tokenizer.json"
    return "settings"


def directory_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` (hidden ones too), sorted; one line naming the first
    entry that is not a regular file or a folder (a FIFO would hang the reader, a device never
    end) or a symlink that leads outside ``root`` (its file would be read and not be the
    directory's). Nothing is opened: entries are only stat-ed."""
    inside = root.resolve()
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink():
                target = path.resolve()
                if target != inside and inside not in target.parents:
                    raise EncoderError(f"{path}: a symlink to {target}, outside {root}: every file of a start is "
                                       "inside its directory, and so in its hash (copy the files in: cp -rL)")
            try:
                mode = os.stat(path).st_mode
            except OSError as exc:
                raise EncoderError(f"{path}: not readable ({exc.strerror or type(exc).__name__})") from None
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                from dpbench.files import special_kind

                raise EncoderError(f"{path}: {special_kind(path) or 'not a regular file'}, not a regular file: a "
                                   "start's files are regular files (a FIFO or a device is never read)")
            found.append(path)
    return sorted(found)


def within(root: Path, name: object, where: Path, key: str) -> Path:
    """``root / name`` for a file another file names (an index's shard, modules.json's Pooling
    folder), refused in one line naming ``where`` and ``key`` unless it is a relative name that
    stays inside ``root`` (no absolute path, no ``..`` out of it)."""
    if not isinstance(name, str) or "\x00" in name:
        raise EncoderError(f"{where}: {key} {name!r} is not a file name")
    path = root / name
    inside = root.resolve()
    target = path.resolve()
    if Path(name).is_absolute() or (target != inside and inside not in target.parents):
        raise EncoderError(f"{where}: {key} {name!r} is outside {root}: every file of a start is inside its "
                           "directory, and so in its hash")
    return path


def bounded(path: Path, kind: str, size: int | None = None) -> int:
    """``path``'s size, refused in one line above its kind's bound (``MAX_BYTES``)."""
    size = path.stat().st_size if size is None else size
    if size > MAX_BYTES[kind]:
        raise EncoderError(f"{path}: {size} bytes, above the {MAX_BYTES[kind]} a start's {kind} file may hold")
    return size



def load_json(path: Path, kind: str = "settings"):
    """``path``'s JSON, read only if it is a regular file within its kind's bound; nesting too
    deep for the parser (RecursionError) is one line naming the file, as any unreadable JSON."""
    if not path.is_file():
        from dpbench.files import special_kind

        raise EncoderError(f"{path}: {special_kind(path) or 'missing'}, not a regular file")
    bounded(path, kind)
    try:
        return json.loads(path.read_text())
    except RecursionError:
        raise EncoderError(f"{path}: not readable JSON (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EncoderError(f"{path}: not readable JSON ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def read_json(path: Path, kind: str = "settings") -> dict:
    value = load_json(path, kind)
    if not isinstance(value, dict):
        raise EncoderError(f"{path}: a JSON object expected, got {type(value).__name__}")
    return value


def weight_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of a safetensors file, from its header alone (8 bytes of
    length, then JSON; nothing else is read); one line naming the file and the tensor whose
    dtype is not a floating one (``FLOAT_DTYPES``; the embeddings' integer index buffers,
    ``INDEX_BUFFERS``, excepted), or a header that is not safetensors'."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= length <= min(MAX_SAFETENSORS_HEADER, size - 8):
            raise EncoderError(f"{path}: not readable weights (a safetensors header of {length} bytes does not fit "
                               f"its {size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, RecursionError, json.JSONDecodeError) as e:
            raise EncoderError(f"{path}: not readable weights (its safetensors header is not JSON: "
                               f"{type(e).__name__})") from None
    if not isinstance(header, dict):
        raise EncoderError(f"{path}: not readable weights (its safetensors header is no JSON object)")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str) and isinstance(info.get("shape"), list)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in info["shape"])):
            raise EncoderError(f"{path}: not readable weights (tensor {name} has no dtype and shape in its header)")
        if info["dtype"] not in FLOAT_DTYPES and not name.rsplit(".", 1)[-1] in INDEX_BUFFERS:
            raise EncoderError(f"{path}: tensor {name} is of dtype {info['dtype']}, not a floating weight "
                               f"({', '.join(FLOAT_DTYPES)}, each loaded as float32)")
        tensors[name] = (info["dtype"], tuple(info["shape"]))
    return tensors
