"""The frozen public prefix of an encoder, computed once per record and stored: mode ``head``'s
pooled feature, mode ``last-block``'s hidden states entering the last block. A frozen prefix is a
fixed map of one record, so a run that trains only what follows it can read the prefix's output
instead of computing it at every step; every run with the same encoder, records, token limit and
cut shares one store.

Key (``StoreKey``): the encoder (``PublicEncoder.sha256``), the records (``records_sha256``: the
SHA-256 of the token rows, their shape and dtype: any encoder problem's records, whatever their
source), the token limit and the cut: ``pooled`` (mode head) or ``block<k>`` (the hidden states
entering block k, counted from 0: MiniLM's last-block store is ``block5``); its name
``prefix-<encoder 16 hex>-<records 16 hex>-T<limit>-<cut>``. The float width (float32 for runs)
is recorded and checked too.

Files (``store_files``), for a store ``S.npy``:

* ``S.npy``: the activations, a standard ``.npy`` (C order), memory-mapped when read. Cut
  ``pooled``: (N, H), row i record i's pooled (and, where the encoder was trained so,
  normalised) vector. Cut ``block<k>``: (sum of n_i, H), ragged: record i's n_i real tokens'
  hidden states are rows offsets[i] .. offsets[i+1] - 1, offsets the running sum of the
  records' lengths (their tokens that are not padding); padding is not stored.
* ``S.records.npy``: the token rows (N, T) int64 the activations were computed from (the
  problem's training then test rows), so the store names its records itself: a run finds a
  record's row by its tokens, and a record the store lacks is refused.
* ``S.json``: the sidecar: the key, shapes, dtype, the SHA-256 of both files.

Size: H x (4 bytes in float32) per stored row: MiniLM (H = 384) 1,536 bytes per record for
``pooled``, 1,536 bytes per token for ``block5`` (196,608 bytes for a record at the limit of 128
tokens); the records file 8 T bytes per record. docs/encoders.md gives the stores of P7.

Built (``build_store``) record by record, each alone (a batch of one, its own length: no
padding), so a record's stored activations are the same bits whichever other records exist;
cut ``pooled`` is exactly ``CachedFeatureClassifier``'s computation. Written atomically (temporary
names, fsync, renames, the activations last) under an exclusive lock (``ensure_store``: two jobs
never both write one), with progress lines. Verified when opened (``PrefixStore.open``): the
sidecar must carry the run's key (encoder, limit, cut, dtype) and both files their recorded
SHA-256 and sizes: a damaged or swapped store is refused in one line naming it and the fix.

Privacy: the store is an intermediate of training, like the activations of a forward pass, and
is never released: a run's record names it, its contents stay in the cache. The records stay the
privacy unit: a run samples, clips and noises exactly as without the store (``StoredPrefixClassifier``
changes where the frozen prefix's output comes from, never which records a step sees).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dpbench.files import chmod_like_open, partial_prefix, refuse_special, remove_stale_partials
from dpbench.problems.encoders import sha256 as _sha256_file

FORMAT_VERSION = 1
POOLED = "pooled"


class PrefixStoreError(ValueError):
    """A prefix store that must not be used; the message names the file and the fix."""


@dataclass(frozen=True)
class StoreKey:
    """What determines a store's contents (module docstring)."""

    encoder_sha256: str
    records_sha256: str
    max_tokens: int
    cut: str  # "pooled" or "block<k>"
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return (f"prefix-{self.encoder_sha256[:16]}-{self.records_sha256[:16]}-T{self.max_tokens}-{self.cut}"
                + ("" if self.dtype == "float32" else f"-{self.dtype}"))

    @property
    def block(self) -> int | None:
        """The block whose input the store holds (None: the pooled feature)."""
        return None if self.cut == POOLED else int(self.cut[len("block"):])


def cut_of(mode, layers: int) -> str:
    """The cut a run in ``mode`` reads from a store: ``pooled`` (head), ``block<layers-1>`` (last-block)."""
    name = getattr(mode, "name", None)
    if name == "head":
        return POOLED
    if name == "last-block":
        return f"block{layers - 1}"
    raise ValueError(f"mode {name} has no frozen prefix to store (the modes head and last-block have)")


def records_sha256(rows: np.ndarray) -> str:
    """SHA-256 of token rows: their dtype, shape and bytes (C order, int64)."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    h = hashlib.sha256(f"int64{rows.shape}".encode())
    h.update(rows.tobytes())
    return h.hexdigest()


def lengths(rows: np.ndarray, pad_id: int) -> np.ndarray:
    """Each right-padded row's real tokens; a row with padding before a real token is refused."""
    real = rows != pad_id
    n = real.sum(1)
    inside = real & (np.arange(rows.shape[1])[None, :] >= n[:, None])
    if inside.any():
        row = int(np.flatnonzero(inside.any(1))[0])
        raise ValueError(f"token row {row} has padding before a real token (rows must be right-padded)")
    return n.astype(np.int64)


def store_files(path: str | Path) -> tuple[Path, Path, Path]:
    """(activations, records, sidecar) of the store at ``path`` (its .npy)."""
    path = Path(path)
    stem = path.with_suffix("")
    return path, Path(f"{stem}.records.npy"), Path(f"{stem}.json")


def _fix(path: Path) -> str:
    a, r, s = store_files(path)
    return f"delete {a}, {r.name} and {s.name}; the workflow (or `dpbench prefix-store`) makes them again"




class _Stop(Exception):
    """Raised by the hook that captures a block's input: the blocks after it are not run."""


def block_input(model, tokens: torch.Tensor, block: int) -> torch.Tensor:
    """The hidden states (B, T, H) entering ``block`` of an ``EncoderClassifier``'s encoder, as its
    own forward pass computes them (captured at that block; the blocks from it on are not run)."""
    captured = {}

    def hook(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs["hidden_states"]
        raise _Stop

    handle = model.encoder.encoder.layer[block].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model.features(tokens)
    except _Stop:
        pass
    finally:
        handle.remove()
    return captured["hidden"]


def build_store(path: str | Path, model, rows: np.ndarray, pad_id: int, key: StoreKey,
                log: Callable[[str], None] | None = None, every_s: float = 10.0) -> dict:
    """Compute and write the store of ``key`` at ``path`` from ``model`` (an ``EncoderClassifier``
    of the key's encoder, in the key's dtype) and the token ``rows`` (N, T): each record alone
    (module docstring); returns the sidecar."""
    path = Path(path)
    act_path, rec_path, meta_path = store_files(path)
    for p in (act_path, rec_path, meta_path):
        refuse_special(p)
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if records_sha256(rows) != key.records_sha256:
        raise ValueError(f"{path}: the token rows given are not the records of key {key.name}")
    n = lengths(rows, pad_id)
    dtype = getattr(torch, key.dtype)
    hidden = model.encoder.config.hidden_size
    total = len(rows) if key.block is None else int(n.sum())
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in (act_path, rec_path, meta_path):
        remove_stale_partials(p)
    temps = []

    def temp(p: Path):
        fd, name = tempfile.mkstemp(dir=p.parent, prefix=partial_prefix(p), suffix=".tmp")
        chmod_like_open(fd)
        temps.append(name)
        return fd, name

    t0 = last = time.perf_counter()
    model = model.eval()
    try:
        fd, act_tmp = temp(act_path)
        with os.fdopen(fd, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(key.dtype)),
                                                    "fortran_order": False, "shape": (total, hidden)})
            digest_rows = 0
            with torch.no_grad():
                for i, row in enumerate(rows):
                    record = torch.from_numpy(row[:n[i]]).unsqueeze(0)
                    if key.block is None:
                        out = model.features(record)[0]
                    else:
                        out = block_input(model, record, key.block)[0]
                    out = out.to(dtype).contiguous().numpy()
                    f.write(out.tobytes())
                    digest_rows += out.shape[0] if out.ndim == 2 else 1
                    if log and time.perf_counter() - last >= every_s:
                        last = time.perf_counter()
                        log(f"prefix store {path.name}: record {i + 1}/{len(rows)} ({100 * (i + 1) / len(rows):.0f}%), "
                            f"{(i + 1) / (last - t0):.1f} records/s")
            f.flush()
            os.fsync(f.fileno())
        if digest_rows != total:
            raise RuntimeError(f"{path}: wrote {digest_rows} rows, expected {total}")
        fd, rec_tmp = temp(rec_path)
        with os.fdopen(fd, "wb") as f:
            np.save(f, rows)
            f.flush()
            os.fsync(f.fileno())
        info = {"format_version": FORMAT_VERSION, **asdict(key), "key": key.name, "records": len(rows),
                "rows": total, "hidden": hidden, "pad_id": int(pad_id), "tokens": int(n.sum()),
                "bytes": os.path.getsize(act_tmp), "sha256": _sha256_file(Path(act_tmp)),
                "records_file_sha256": _sha256_file(Path(rec_tmp)), "seconds": time.perf_counter() - t0,
                "what": ("each record's pooled feature (mode head)" if key.block is None else
                         f"each record's hidden states entering block {key.block}, its real tokens only, records "
                         "one after another (offsets: the running sum of their lengths)")}
        fd, meta_tmp = temp(meta_path)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(info, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(rec_tmp, rec_path)
        os.replace(meta_tmp, meta_path)
        os.replace(act_tmp, act_path)  # last: the store's name appears only when everything is in place
    except BaseException:
        for name in temps:
            if os.path.exists(name):
                os.unlink(name)
        raise
    if log:
        log(f"prefix store {path}: {len(rows)} records, {total} x {hidden} {key.dtype} ({info['bytes'] / 1e6:.1f} MB) "
            f"in {info['seconds']:.1f} s")
    return info


def ensure_store(path: str | Path, make: Callable[[Path], None], log: Callable[[str], None] | None = None) -> Path:
    """``path``, made by ``make(path)`` if missing, under an exclusive lock (two processes make it once)."""
    from dpbench.matrix.store.cache import ensure_file

    return ensure_file(Path(path), make, log, f"making prefix store {path}")


class PrefixStore:
    """An open, verified store: its key, its records and their activations, memory-mapped."""

    def __init__(self, path: Path, meta: dict, rows: np.ndarray, values: np.ndarray):
        self.path, self.meta, self.rows, self.values = path, meta, rows, values
        self.key = StoreKey(meta["encoder_sha256"], meta["records_sha256"], meta["max_tokens"], meta["cut"],
                            meta["dtype"])
        self.pad_id = int(meta["pad_id"])
        self.lengths = lengths(rows, self.pad_id)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]) if self.key.block is not None else None
        self.index: dict[bytes, int] = {}
        for i in range(len(rows) - 1, -1, -1):  # a duplicate record's row: its first (the same activations)
            self.index[rows[i, :self.lengths[i]].tobytes()] = i

    @classmethod
    def open(cls, path: str | Path, *, encoder_sha256: str, max_tokens: int, cut: str, dtype: str = "float32",
             log: Callable[[str], None] | None = None) -> "PrefixStore":
        """The store at ``path``, after checking its sidecar names this encoder, limit, cut and
        dtype and both files their recorded sizes and SHA-256 (read once)."""
        t0 = time.perf_counter()
        act_path, rec_path, meta_path = store_files(path)
        for p in (act_path, rec_path, meta_path):
            if not p.is_file():
                raise PrefixStoreError(f"prefix store {act_path}: {p.name} is missing: {_fix(act_path)}")
        try:
            meta = json.loads(meta_path.read_text())
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            raise PrefixStoreError(f"prefix store {act_path}: its sidecar {meta_path.name} is unreadable ({exc}): "
                                   f"{_fix(act_path)}") from None
        expected = {"format_version": FORMAT_VERSION, "encoder_sha256": encoder_sha256, "max_tokens": max_tokens,
                    "cut": cut, "dtype": dtype}
        for name, value in expected.items():
            if meta.get(name) != value:
                raise PrefixStoreError(f"prefix store {act_path} has {name} = {meta.get(name)!r}, this run needs "
                                       f"{value!r}: it is another store; give this run's (or {_fix(act_path)})")
        for p, field in ((act_path, "sha256"), (rec_path, "records_file_sha256")):
            actual = _sha256_file(p)
            if actual != meta.get(field):
                raise PrefixStoreError(f"prefix store {act_path}: {p.name} is damaged or swapped: its SHA-256 is "
                                       f"{actual}, its sidecar records {meta.get(field)}: {_fix(act_path)}")
        try:
            rows = np.load(rec_path)
            values = np.load(act_path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise PrefixStoreError(f"prefix store {act_path}: not readable ({exc}): {_fix(act_path)}") from None
        if records_sha256(rows) != meta.get("records_sha256") or values.shape != (meta.get("rows"), meta.get("hidden")):
            raise PrefixStoreError(f"prefix store {act_path}: its files do not match its sidecar's key and shape: "
                                   f"{_fix(act_path)}")
        store = cls(act_path, meta, rows, values)
        if log:
            log(f"verified prefix store {act_path} ({len(rows)} records, {values.shape[0]} x {values.shape[1]} "
                f"{dtype}, {meta['bytes'] / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
        return store

    def find(self, tokens: torch.Tensor) -> list[int]:
        """Each token row's record in the store (by its tokens; a row it lacks is refused)."""
        found = []
        for row in tokens.cpu().numpy():
            record = row[row != self.pad_id]
            i = self.index.get(np.ascontiguousarray(record, dtype=np.int64).tobytes())
            if i is None:
                raise PrefixStoreError(f"prefix store {self.path} does not hold the record {record[:8].tolist()}... "
                                       f"({len(record)} tokens): it was made from other records; {_fix(self.path)}")
            found.append(i)
        return found

    def features(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cut ``pooled``: the rows' pooled features (B, H)."""
        rows = self.values[self.find(tokens)]
        return torch.from_numpy(np.array(rows)).to(device=tokens.device, dtype=dtype)

    def hidden(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A block cut: the rows' hidden states (B, T, H) entering the block, zero at padding."""
        B, T = tokens.shape
        out = np.zeros((B, T, self.values.shape[1]), dtype=self.values.dtype)
        for b, i in enumerate(self.find(tokens)):
            n = int(self.lengths[i])
            if n > T:
                raise PrefixStoreError(f"prefix store {self.path}: a record of {n} tokens in a batch {T} wide")
            out[b, :n] = self.values[self.offsets[i]:self.offsets[i + 1]]
        return torch.from_numpy(out).to(device=tokens.device, dtype=dtype)


def stored_classifier():
    """``StoredPrefixClassifier`` (its base imports transformers, so it is made on use)."""
    global _STORED
    if _STORED is None:
        from dpbench.problems.encoder_model import EncoderClassifier

        class StoredPrefixClassifier(EncoderClassifier):
            """An ``EncoderClassifier`` that reads its frozen prefix's output from a ``PrefixStore``
            (module docstring) and runs only what follows it: the head (cut ``pooled``), or the
            blocks from the cut on, then the pooling and the head."""

            def attach(self, store: PrefixStore) -> "StoredPrefixClassifier":
                self.store = store
                block = store.key.block
                layers = self.encoder.encoder.layer
                frozen = [p for p in self.encoder.parameters() if p.requires_grad] if block is None else \
                    [p for m in (self.encoder.embeddings, *layers[:block]) for p in m.parameters() if p.requires_grad]
                if frozen:
                    raise ValueError(f"a prefix store of cut {store.key.cut} serves a model whose prefix is frozen "
                                     "(modes head, last-block); this one trains it")
                return self

            def features(self, tokens: torch.Tensor) -> torch.Tensor:
                dtype = self.head.weight.dtype
                if self.store.key.block is None:
                    return self.store.features(tokens, dtype)
                B, T = tokens.shape
                mask = tokens != self.pad_id
                hidden = self.store.hidden(tokens, dtype)
                encoder = self.encoder
                # the attention mask as the encoder's own forward makes it (transformers' masking utilities)
                attention, _ = encoder._create_attention_masks(attention_mask=mask.long(), encoder_attention_mask=None,
                                                               embedding_output=hidden, encoder_hidden_states=None,
                                                               cache=None)
                first = self.first_position
                positions = torch.arange(first, first + T, device=tokens.device).expand(B, T).contiguous()
                for layer in encoder.encoder.layer[self.store.key.block:]:
                    hidden = layer(hidden, attention, None, encoder_attention_mask=None, cache=None,
                                   position_ids=positions)
                return self.pool(hidden, mask)

        _STORED = StoredPrefixClassifier
    return _STORED


_STORED = None


def records_of(problem, data_dir: str | None = None) -> np.ndarray:
    """The token rows of an encoder problem bound to its encoder (``PublicEncoder.bind``): its
    training rows, then its test rows, as ``problem.load`` reads them (validation is cut from
    the training rows, subsets drawn from them: every record a run may read)."""
    data = problem.load(data_dir)
    return np.concatenate([np.asarray(data.x_train, dtype=np.int64), np.asarray(data.x_test, dtype=np.int64)])


def key_for(start, rows: np.ndarray, mode, dtype: str = "float32") -> StoreKey:
    """The key of the store a run from ``start`` (a ``PublicEncoder``) in ``mode`` reads for ``rows``."""
    return StoreKey(start.sha256, records_sha256(rows), start.max_tokens,
                    cut_of(mode, start.loaded.facts.num_hidden_layers), dtype)


def make_store(path: str | Path, start, problem, mode, data_dir: str | None = None,
               log: Callable[[str], None] | None = None) -> dict:
    """Build the store of ``problem`` (bound to ``start``) in ``mode`` at ``path``, float32."""
    from dpbench.problems.encoder_model import EncoderClassifier

    rows = records_of(problem, data_dir)
    key = key_for(start, rows, mode)
    with torch.random.fork_rng(devices=[]):  # the head it builds is never used: the global RNG is left as it was
        model = EncoderClassifier.from_loaded(start.loaded, 1)
    return build_store(path, model, rows, start.loaded.pad_id, key, log=log)
