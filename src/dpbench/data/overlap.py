"""Removing the private text from a public corpus before pretraining on it.

Public pretraining is only public if the public corpus holds none of the private records
(Tramèr, Kamath & Carlini 2022, "Considerations for differentially private learning with
large-scale public pretraining"): a model pretrained on a private record and then fine-tuned
with DP can reveal that record through its pretrained weights, which no accounting of the
fine-tuning covers. ``remove_overlap`` drops every public record that

* contains a private record's whole text (``"record"``), or
* shares a span of ``span`` bytes or more with a private record (``"span"``),

both compared after ``normalise`` (runs of whitespace made one space, ends stripped, lowercase),
so that a quotation which one corpus breaks over lines or capitalises differently still
matches. A public record that contains a whole private record of ``span`` bytes or more also
shares a span; it is counted under ``"record"``, the first reason.

How. Every record is normalised, UTF-8 encoded and joined into one byte string; a window
``b[i : i + L]`` inside one record gets the polynomial hash ``sum_j b[i + j] Q^j mod 2^64``
(``Q`` the inverse mod 2^64 of an odd base ``P``), which one cumulative sum over the whole
string gives for every ``i`` at once: ``(S[i + L] - S[i]) * P^i`` with ``S[k] = sum_{j<k} b[j]
Q^j``. The public windows whose hash is among the private ones are candidates; each candidate
is then compared byte for byte with the private window(s) of that hash, so a hash collision can
cost time but never remove a record, and equal windows always have equal hashes, so no shared
span is missed. Spans: every window of ``span`` bytes of every private record. Whole records:
for each length below ``span`` of some private record, every public window of that length
(longer private records are found through their spans, then checked whole).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

SPAN = 50  # bytes: a public record sharing this many consecutive bytes with a private record is removed
BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible mod 2^64
_WS = re.compile(r"\s+")


def normalise(text: str) -> str:
    return _WS.sub(" ", text).strip().lower()


@dataclass(frozen=True)
class Packed:
    """Records normalised, UTF-8 encoded and joined: ``data[starts[r]:ends[r]]`` is record r."""

    data: np.ndarray  # uint8
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64
    prefix: np.ndarray  # uint64 (len(data) + 1,): S[k] = sum_{j<k} data[j] Q^j mod 2^64
    powers: np.ndarray  # uint64 (len(data) + 1,): P^k mod 2^64
    room: np.ndarray  # int64 (len(data),): bytes from each position to the end of its record

    @classmethod
    def of(cls, records: Sequence[str]) -> Packed:
        encoded = [normalise(r).encode("utf-8") for r in records]
        lengths = np.array([len(e) for e in encoded], dtype=np.int64)
        ends = np.cumsum(lengths)
        data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        with np.errstate(over="ignore"):
            inverse = _inverse(BASE)
            n = len(data) + 1
            powers = np.cumprod(np.full(n, BASE, dtype=np.uint64), dtype=np.uint64)
            powers = np.concatenate([[np.uint64(1)], powers[:-1]])
            inverse_powers = np.cumprod(np.full(n, inverse, dtype=np.uint64), dtype=np.uint64)
            inverse_powers = np.concatenate([[np.uint64(1)], inverse_powers[:-1]])
            prefix = np.concatenate([[np.uint64(0)], np.cumsum(data.astype(np.uint64) * inverse_powers[:-1],
                                                              dtype=np.uint64)])
        room = np.repeat(ends, lengths) - np.arange(len(data))
        return cls(data, ends - lengths, ends, prefix, powers, room)

    def windows(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(hashes, inside): the hash of the window of ``length`` bytes at every position ``0 ..
        len(data) - length``, and whether that window lies inside one record."""
        n = max(len(self.data) - length + 1, 0)
        with np.errstate(over="ignore"):
            hashes = (self.prefix[length:length + n] - self.prefix[:n]) * self.powers[:n]
        return hashes, self.room[:n] >= length

    def record_at(self, position: int) -> int:
        return int(np.searchsorted(self.ends, position, side="right"))

    def text(self, record: int) -> bytes:
        return self.data[self.starts[record]:self.ends[record]].tobytes()


def _inverse(a: np.uint64) -> np.uint64:
    """a^-1 mod 2^64 for odd a (Newton's iteration, each step doubling the correct low bits)."""
    a = int(a)
    x = a  # correct to 3 bits for odd a
    for _ in range(6):
        x = x * (2 - a * x) % 2**64
    assert a * x % 2**64 == 1
    return np.uint64(x)


def _filter_bits(entries: int) -> int:
    """Size (log2) of the table of flags, indexed by a hash's top bits, that screens the public
    windows: about 64 flags per private hash (few false candidates), at most 2^26 (64 MB)."""
    return int(np.clip(np.ceil(np.log2(max(entries, 1) * 64)), 12, 26))


def _matches(public: Packed, private: Packed, length: int, p_starts: np.ndarray) -> list[tuple[int, int]]:
    """(public record, private record) pairs whose windows of ``length`` bytes are equal, verified
    byte for byte; ``p_starts``: the private windows to look for (each inside one record)."""
    p_hashes = private.windows(length)[0][p_starts]
    order = np.argsort(p_hashes, kind="stable")
    p_starts, p_hashes = p_starts[order], p_hashes[order]
    bits = _filter_bits(len(p_hashes))
    table = np.zeros(2**bits, dtype=bool)
    table[p_hashes >> np.uint64(64 - bits)] = True
    q_hashes, inside = public.windows(length)
    candidates = np.flatnonzero(table[q_hashes >> np.uint64(64 - bits)] & inside)
    found = np.searchsorted(p_hashes, q_hashes[candidates])
    equal = p_hashes[np.minimum(found, len(p_hashes) - 1)] == q_hashes[candidates]
    pairs = set()
    for q, lo in zip(candidates[equal].tolist(), found[equal].tolist()):
        window = public.data[q:q + length].tobytes()
        hi = np.searchsorted(p_hashes, q_hashes[q], "right")
        for p in p_starts[lo:hi].tolist():
            if private.data[p:p + length].tobytes() == window:
                pairs.add((int(public.record_at(q)), int(private.record_at(p))))
    return sorted(pairs)


def remove_overlap(public: Sequence[str], private: Sequence[str], span: int = SPAN) -> tuple[list[str], dict]:
    """(the public records kept, in order; a report of what was removed and why)."""
    if span < 1:
        raise ValueError(f"span must be >= 1 byte, got {span}")
    pub, priv = Packed.of(public), Packed.of(private)
    lengths = priv.ends - priv.starts
    reason: dict[int, str] = {}
    # whole private records shorter than a span: every public window of their length
    for length in sorted(set(lengths[(lengths > 0) & (lengths < span)].tolist())):
        for q, _ in _matches(pub, priv, length, priv.starts[lengths == length]):
            reason[q] = "record"
    # shared spans; a public record holding the whole private record it shares a span with: "record"
    for q, p in _matches(pub, priv, span, np.flatnonzero(priv.windows(span)[1])):
        if priv.text(p) in pub.text(q):
            reason[q] = "record"
        else:
            reason.setdefault(q, "span")
    counts = Counter(reason.values())
    kept = [r for i, r in enumerate(public) if i not in reason]
    report = {"span_bytes": span, "normalisation": "whitespace runs to one space, stripped, lowercase",
              "public_records": len(public), "private_records": len(private), "kept": len(kept),
              "removed": len(reason), "removed_containing_a_private_record": counts.get("record", 0),
              "removed_sharing_a_span": counts.get("span", 0), "removed_indices": sorted(reason)}
    return kept, report
