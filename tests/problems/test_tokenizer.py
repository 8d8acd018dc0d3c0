"""Tests of the fixed byte-level tokenizer of P4 (dpbench.problems.tokenizer)."""

from __future__ import annotations

import numpy as np
import pytest

from dpbench.problems import tokenizer as tok


def test_constants():
    assert (tok.PAD, tok.BOUNDARY, tok.BOS, tok.EOS, tok.VOCAB_SIZE) == (256, 257, 257, 257, 258)


@pytest.mark.parametrize("text", ["", "The secret code is 123456", "naïve café — “ok” 日本語 🙂", "tab\tnl\n\x00"])
def test_round_trip(text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_known_ids_and_decode_of_specials():
    assert tok.encode("Aé🙂") == [65, 0xC3, 0xA9, 0xF0, 0x9F, 0x99, 0x82]
    assert tok.decode([tok.BOS, 104, 105, tok.EOS, tok.PAD, tok.PAD]) == "hi"
    assert tok.decode([104, 0xC3]) == "h\ufffd"  # a generation cut inside a character
    with pytest.raises(ValueError, match="outside"):
        tok.decode([258])


def test_encode_records_shapes_truncation_padding():
    rows = tok.encode_records(["ab", "", "x" * 10, "é"], context=4)
    assert rows.dtype == np.int64 and rows.shape == (4, 5)
    B, E, P = tok.BOS, tok.EOS, tok.PAD
    assert rows.tolist() == [
        [B, 97, 98, E, P],
        [B, E, P, P, P],
        [B, 120, 120, 120, 120],  # truncated: tail and EOS cut
        [B, 0xC3, 0xA9, E, P],
    ]
    # fits iff sequence_length <= context + 1, i.e. at most context - 1 bytes
    assert tok.sequence_length("abc") == 5 and tok.encode_records(["abc"], 4)[0, -1] == E
    assert tok.encode_records([], 3).shape == (0, 4)
    with pytest.raises(ValueError):
        tok.encode_records(["a"], 0)


def test_vocabulary_depends_on_no_text():
    # every id 0..255 is its byte, whatever was encoded before: nothing is fitted
    before = [tok.encode(bytes([b]).decode("latin-1")) for b in range(128)]
    tok.encode_records(["zzz " * 50, "the secret code is 000000"] * 10, 16)
    assert [tok.encode(bytes([b]).decode("latin-1")) for b in range(128)] == before == [[b] for b in range(128)]
    assert tok.decode(range(256)).encode("utf-8", errors="surrogateescape")[:128] == bytes(range(128))
    assert not [name for name in dir(tok) if name.lower().startswith(("fit", "train", "build"))]
