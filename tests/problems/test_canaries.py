"""Tests of canaries and exposure (dpbench.problems.canaries): exact exposure against a brute-force
rank, a model made to memorise a canary, and the expected exposure of unseen secrets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dpbench.problems import canaries as cn
from dpbench.problems import tokenizer as tok

PREFIX_IDS = [tok.BOS, *tok.encode(cn.PREFIX)]


class TinyGRU(nn.Module):
    """A small causal LM with random weights, in float64 so that scores computed through
    different batchings agree to ~1e-15 and ranks are not decided by rounding."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(tok.VOCAB_SIZE, 8)
        self.gru = nn.GRU(8, 16, batch_first=True)
        self.out = nn.Linear(16, tok.VOCAB_SIZE)
        for p in self.parameters():  # spread the scores: random weights x 3
            p.data.mul_(3.0)
        self.double().eval()

    def forward(self, tokens):
        return self.out(self.gru(self.emb(tokens))[0])


@pytest.fixture(scope="module")
def gru():
    return TinyGRU()


def brute_force_px(model, digits: int) -> np.ndarray:
    """Px in bits of every candidate, each scored as a full sequence in one forward."""
    secrets = [f"{i:0{digits}d}" for i in range(10**digits)]
    tokens = torch.tensor([PREFIX_IDS + list(s.encode()) for s in secrets])
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens), -1)
    P = len(PREFIX_IDS)
    total = sum(logp[torch.arange(len(secrets)), P - 1 + i, tokens[:, P + i]] for i in range(digits))
    return (-total / math.log(2)).numpy()


def test_make_canaries_and_insert():
    cs = cn.make_canaries(7)
    assert [c.repeats for c in cs] == [0] * 3 + [1] * 3 + [5] * 3 + [25] * 3
    assert len({c.secret for c in cs}) == 12 and all(len(c.secret) == 6 and c.secret.isdigit() for c in cs)
    assert cs == cn.make_canaries(7) and cs != cn.make_canaries(8)
    assert cs[0].text == "the secret code is " + cs[0].secret
    # every one of the 10 secrets of a 1-digit space: all distinct
    assert sorted(c.secret for c in cn.make_canaries(0, repeats=(0, 1), per_repeat=5, digits=1)) == list("0123456789")
    with pytest.raises(ValueError, match="distinct"):
        cn.make_canaries(0, repeats=(0, 1), per_repeat=6, digits=1)
    train = cn.insert(["a", "b"], cs)
    assert len(train) == 2 + 3 * (1 + 5 + 25) and train[:2] == ["a", "b"]
    for c in cs:
        assert train.count(c.text) == c.repeats  # k = 0: never inserted


def test_tree_enumeration_equals_brute_force(gru):
    want = brute_force_px(gru, 3)
    rows = []

    def counting(tokens):
        rows.append(len(tokens))
        return gru(tokens)

    got = cn.enumerate_log_perplexities(counting, 3, batch_size=7)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    assert sum(rows) == 1 + 10 + 100 and max(rows) <= 7  # sum_i 10^i rows, bounded batches
    np.testing.assert_allclose(cn.log_perplexity(gru, ["042", "999"]), want[[42, 999]], atol=1e-9)
    assert np.ptp(want) > 5 and len(np.unique(want)) == 1000  # spread, no ties


def test_exact_exposure_equals_brute_force_rank(gru):
    px = brute_force_px(gru, 3)
    canaries = cn.make_canaries(3, repeats=(0, 1), per_repeat=5, digits=3)
    rows = cn.measure(gru, canaries)
    for c, row in zip(canaries, rows):
        rank = 1 + int(np.sum(px < px[int(c.secret)]))
        assert row["rank"] == rank and row["method"] == "exact" and row["space_size"] == 1000
        assert row["exposure"] == pytest.approx(math.log2(1000) - math.log2(rank), abs=1e-12)
        assert row["log_perplexity"] == pytest.approx(px[int(c.secret)], abs=1e-9)
        assert (row["secret"], row["repeats"]) == (c.secret, c.repeats)
    # lowest Px -> rank 1, highest -> rank 1000
    best, worst = f"{int(np.argmin(px)):03d}", f"{int(np.argmax(px)):03d}"
    r = cn.measure(gru, [cn.Canary(best, 0), cn.Canary(worst, 0)])
    assert (r[0]["rank"], r[1]["rank"]) == (1, 1000)
    assert r[0]["exposure"] == pytest.approx(math.log2(1000)) and r[1]["exposure"] == pytest.approx(0.0, abs=1e-12)


def test_ties_count_only_strictly_lower():
    def uniform(tokens):  # every candidate has the same Px
        return torch.zeros(*tokens.shape, tok.VOCAB_SIZE)

    row = cn.measure(uniform, [cn.Canary("17", 1)])[0]
    assert row["rank"] == 1 and row["exposure"] == pytest.approx(math.log2(100))
    assert row["log_perplexity"] == pytest.approx(2 * math.log2(tok.VOCAB_SIZE))


def memorising(secret: str):
    """A causal logits_fn that predicts the secret's digits after the prefix, then EOS."""
    P = len(PREFIX_IDS)

    def logits_fn(tokens):
        n, t = tokens.shape
        logits = torch.zeros(n, t, tok.VOCAB_SIZE)
        for j in range(t):  # position j predicts token j + 1
            i = j + 1 - P
            target = secret.encode()[i] if 0 <= i < len(secret) else tok.EOS
            logits[:, j, target] = 20.0
        return logits

    return logits_fn


def test_memorised_canary_has_full_exposure_and_is_extracted():
    canaries = cn.make_canaries(5, repeats=(25, 0), per_repeat=2, digits=3)
    rows = cn.measure(memorising(canaries[0].secret), canaries)
    assert rows[0]["rank"] == 1 and rows[0]["exposure"] == pytest.approx(math.log2(1000))
    assert rows[0]["extracted"] is True
    assert [r["extracted"] for r in rows[1:]] == [False, False, False]
    assert all(r["rank"] > 1 for r in rows[1:])
    assert cn.greedy_continuation(memorising("123")) == "123"


def test_expected_exposure_of_unseen_secrets(gru):
    n = 1000
    e = cn.unseen_expected_exposure(n)
    assert e == pytest.approx(math.log2(n) - sum(math.log2(k) for k in range(1, n + 1)) / n, rel=1e-12)
    assert e == pytest.approx((1 - math.log(2 * math.pi * n) / (2 * n)) / math.log(2), abs=1e-5)  # Stirling
    assert cn.unseen_expected_exposure(10**12) == pytest.approx(1 / math.log(2), abs=1e-10)
    # exhaustively: with distinct scores, the mean exposure over all of R is exactly E
    px = cn.enumerate_log_perplexities(gru, 3)
    ranks = 1 + np.searchsorted(np.sort(px), px, side="left")
    assert np.mean(math.log2(n) - np.log2(ranks)) == pytest.approx(e, abs=1e-12)
    # 300 random unseen secrets: exposure is ~ exponential with mean and sd 1/ln 2, so the mean
    # of 300 has sd <= 1.44 / sqrt(300) = 0.083 (less, drawn without replacement); 0.4 is 4.8 sd
    rows = cn.measure(gru, cn.make_canaries(11, repeats=(0,), per_repeat=300, digits=3))
    mean = np.mean([r["exposure"] for r in rows])
    assert abs(mean - e) < 0.4 and e == pytest.approx(1.436, abs=1e-3)


def test_extrapolated_exposure_tracks_exact(gru):
    canaries = cn.make_canaries(2, repeats=(0,), per_repeat=20, digits=3)
    exact = cn.measure(gru, canaries)
    est = cn.measure(gru, canaries, method="extrapolated", samples=2000, seed=1)
    assert all(r["method"] == "extrapolated" for r in est)
    diff = [abs(a["exposure"] - b["exposure"]) for a, b in zip(exact, est)]
    assert np.mean(diff) < 0.3, diff
    # auto switches to extrapolation above max_exact
    auto = cn.measure(gru, canaries[:1], max_exact=100, samples=500)
    assert auto[0]["method"] == "extrapolated" and auto[0]["space_size"] == 1000
