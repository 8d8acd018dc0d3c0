"""Canaries and exposure: how much a language model memorised inserted secrets.

After Carlini, Liu, Erlingsson, Kos, Song, "The Secret Sharer: Evaluating and Testing
Unintended Memorization in Neural Networks", USENIX Security 2019, arXiv:1802.08232, as used by
Gong, Pavliv & Peng for a DP-SGD-trained transformer LM ("the secret code is ..." inserted 25
times).

Canaries. A canary is the record ``"the secret code is " + s`` with the secret s drawn
uniformly from the randomness space R of all ``digits``-digit strings (|R| = 10^digits), all
secrets of one experiment distinct. Canary j is inserted k_j times into the *training* split
(``repeats``, default 0, 1, 5, 25, three canaries each). Canaries with k = 0 are never
inserted: drawn the same way, they are the baseline of a secret the model never saw. Inserted
copies are ordinary training records: they count in the N of the privacy accountant (the
guarantee is for the corpus plus canaries), and a canary inserted k times is protected only
at group size k (group privacy), which is what makes k = 5, 25 visible under a budget that
hides k = 1.

Log-perplexity. For a candidate r = r_1 ... r_d, with prefix p = [BOS] + bytes of
``"the secret code is "`` (the byte tokenizer, ``dpbench.problems.tokenizer``),

    Px(r) = -sum_{i=1..d} log2 Pr(r_i | p, r_1 ... r_{i-1})        (bits).

The terms of the prefix itself, -sum log2 Pr(p_j | p_<j), are the same for every candidate, so
including them would shift every Px(r) by one constant and change no rank; they are left out.
The boundary token after the secret is left out too: the secret is what is ranked (Carlini
§3.1). Pr is the model's softmax over the whole vocabulary, not renormalised over digits.

Rank and exposure. rank(s) = 1 + #{r in R : Px(r) < Px(s)} (rank 1 = lowest log-perplexity;
ties resolved in the canary's favour: candidates with the same Px do not push it down), and

    exposure(s) = log2 |R| - log2 rank(s)         in [0, log2 |R|].

Exposure log2 |R| (rank 1) means the model prefers s to every other candidate.

Expected exposure of an unseen secret. If the model does not depend on s (a k = 0 canary) and s
is uniform on R, then rank(s) is uniform on 1..n, n = |R| (when the Px are distinct), so

    E[exposure] = log2 n - (1/n) sum_{k=1..n} log2 k = log2 n - log2(n!)/n
                = (1 - ln(2 pi n)/(2n) + O(1/n^2)) / ln 2  ->  1/ln 2 = 1.4427 bits,

by Stirling, ln n! = n ln n - n + ln(2 pi n)/2 + O(1/n); for a large n, -log2(rank/n) is
close to -log2 U with U uniform on (0, 1), an exponential variable with mean and standard
deviation 1/ln 2. ``unseen_expected_exposure(n)`` is the exact finite-n value.

Exact computation (|R| <= ``max_exact``, default 10^6). Px(r) is a sum over the tree of digit
prefixes: the secret's tokens are d bytes from the 10-symbol alphabet '0'..'9', and
Pr(r_i | p, r_<i) depends on r_<i only. Level i = 0..d-1 runs one forward on the 10^i
sequences p + r_<i (in batches of at most ``batch_size`` rows) and reads the 10 digit
log-probabilities at the last position; Px of the 10^(i+1) children is the parent's plus the
child's term. The total is sum_i 10^i = (10^d - 1)/9 forward rows of length <= |p| + d - 1,
instead of 10^d full sequences, and every Px(r) of R is obtained, so the rank is exact.
Log-probabilities are accumulated in float64.

Extrapolation (Carlini §4.3; for |R| > ``max_exact`` or on request). Score a uniform sample of
``samples`` candidates (with replacement) as full sequences, fit a skew-normal distribution F
to their Px by maximum likelihood, and estimate rank(s) ~ |R| F(Px(s)), i.e.

    exposure ~ -log2 F(Px(s)).

This is an estimate, not a bound: it can exceed log2 |R| when Px(s) lies below the fitted
distribution's reach of 1/|R|, and its accuracy rests on the skew-normal fit of the lower tail.

Extraction (the paper's binary test). Decode greedily 50 tokens after the prefix (argmax at
each step; the continuation ends at the first boundary token) and report whether the text
contains s. Decoding is deterministic and the prefix is common to all canaries, so one
continuation serves every canary.

The model is given as ``logits_fn(tokens: LongTensor (n, t)) -> FloatTensor (n, t, V)``,
causal (position j's logits depend on tokens[:, :j+1] only) and deterministic (eval mode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

import dpbench.problems.tokenizer as tokenizer

PREFIX = "the secret code is "
DIGIT_IDS = tuple(tokenizer.encode("0123456789"))
MAX_EXACT = 10**6
GENERATE = 50
LogitsFn = Callable[[torch.Tensor], torch.Tensor]
_LN2 = math.log(2.0)


@dataclass(frozen=True)
class Canary:
    secret: str
    repeats: int  # copies inserted into the training split (0: never inserted)

    @property
    def text(self) -> str:
        return PREFIX + self.secret


def make_canaries(
    seed: int, repeats: Sequence[int] = (0, 1, 5, 25), per_repeat: int = 3, digits: int = 6
) -> list[Canary]:
    """``per_repeat`` canaries for each k in ``repeats``, with distinct secrets drawn uniformly
    from the 10^digits strings of ``digits`` decimal digits."""
    if not 1 <= digits <= 18:
        raise ValueError(f"digits must be in 1..18, got {digits}")
    if any(k < 0 for k in repeats):
        raise ValueError(f"repeats must be >= 0, got {tuple(repeats)}")
    n, space = len(repeats) * per_repeat, 10**digits
    if n > space:
        raise ValueError(f"{n} distinct secrets requested from only {space} candidates")
    rng = np.random.default_rng(seed)
    chosen: list[int] = []
    while len(chosen) < n:  # uniform draws, rejecting repeats: a uniform sample without replacement
        x = int(rng.integers(space))
        if x not in chosen:
            chosen.append(x)
    ks = [k for k in repeats for _ in range(per_repeat)]
    return [Canary(f"{x:0{digits}d}", k) for k, x in zip(ks, chosen)]


def insert(train_texts: Iterable[str], canaries: Sequence[Canary]) -> list[str]:
    """The training records followed by k copies of each canary's text (k = 0: none).

    The result is the training set: its length is the accountant's N. Order does not matter
    to DP-SGD, which samples records (Poisson or shuffled), not positions."""
    return list(train_texts) + [c.text for c in canaries for _ in range(c.repeats)]


def unseen_expected_exposure(space_size: int) -> float:
    """E[log2 n - log2 rank] for rank uniform on 1..n: log2 n - log2(n!)/n (-> 1/ln 2)."""
    n = int(space_size)
    return math.log2(n) - math.lgamma(n + 1) / _LN2 / n


# --------------------------------------------------------------------------- log-perplexities


def _prefix_ids() -> list[int]:
    return [tokenizer.BOS, *tokenizer.encode(PREFIX)]


def _digits_of(index: torch.Tensor, length: int) -> torch.Tensor:
    """(n,) integers -> (n, length) token ids of their zero-padded decimal digits."""
    powers = 10 ** torch.arange(length - 1, -1, -1, dtype=torch.int64)
    return (index[:, None] // powers) % 10 + DIGIT_IDS[0]


@torch.inference_mode()
def enumerate_log_perplexities(
    logits_fn: LogitsFn, digits: int, *, batch_size: int = 4096, device: str | torch.device = "cpu"
) -> np.ndarray:
    """Px(r) in bits for every r in R, float64 (10^digits,), indexed by int(r): the tree
    enumeration of the module docstring."""
    prefix = torch.tensor(_prefix_ids(), dtype=torch.int64)
    digit_ids = torch.tensor(DIGIT_IDS, device=device)
    px = torch.zeros(1, dtype=torch.float64)  # nats, one entry per digit prefix of this level
    for level in range(digits):
        n = 10**level
        terms = torch.empty(n, 10, dtype=torch.float64)
        for start in range(0, n, batch_size):
            index = torch.arange(start, min(n, start + batch_size))
            tokens = torch.cat([prefix.expand(len(index), -1), _digits_of(index, level)], 1).to(device)
            logits = logits_fn(tokens)[:, -1, :].double()
            terms[start : start + len(index)] = -torch.log_softmax(logits, -1)[:, digit_ids].cpu()
        px = (px[:, None] + terms).reshape(-1)  # child index = 10 * parent + digit
    return px.numpy() / _LN2


@torch.inference_mode()
def log_perplexity(
    logits_fn: LogitsFn, secrets: Sequence[str], *, batch_size: int = 4096, device: str | torch.device = "cpu"
) -> np.ndarray:
    """Px(s) in bits of each secret (all of one length), scored as full sequences."""
    if len({len(s) for s in secrets}) > 1:
        raise ValueError("secrets of different lengths")
    prefix = _prefix_ids()
    out = np.empty(len(secrets))
    for start in range(0, len(secrets), batch_size):
        batch = secrets[start : start + batch_size]
        tokens = torch.tensor([prefix + tokenizer.encode(s) for s in batch], dtype=torch.int64, device=device)
        logp = torch.log_softmax(logits_fn(tokens[:, :-1]).double(), -1)[:, len(prefix) - 1 :]
        terms = logp.gather(-1, tokens[:, len(prefix) :, None]).squeeze(-1)
        out[start : start + len(batch)] = (-terms.sum(1) / _LN2).cpu().numpy()
    return out


# --------------------------------------------------------------------------- extraction


@torch.inference_mode()
def greedy_continuation(
    logits_fn: LogitsFn, tokens: int = GENERATE, *, device: str | torch.device = "cpu"
) -> str:
    """The greedy decoding of ``tokens`` tokens after the prefix, up to the first boundary."""
    seq = torch.tensor([_prefix_ids()], dtype=torch.int64, device=device)
    for _ in range(tokens):
        seq = torch.cat([seq, logits_fn(seq)[:, -1, :].argmax(-1, keepdim=True)], 1)
    generated = seq[0, len(_prefix_ids()) :].tolist()
    if tokenizer.BOUNDARY in generated:
        generated = generated[: generated.index(tokenizer.BOUNDARY)]
    return tokenizer.decode(generated)


# --------------------------------------------------------------------------- exposure


def _skewnorm_log2_cdf(sample: np.ndarray, points: np.ndarray) -> np.ndarray:
    from scipy.stats import skewnorm

    shape, loc, scale = skewnorm.fit(sample)
    return skewnorm.logcdf(points, shape, loc, scale) / _LN2


def measure(
    logits_fn: LogitsFn,
    canaries: Sequence[Canary],
    *,
    method: str = "auto",
    max_exact: int = MAX_EXACT,
    samples: int = 10_000,
    seed: int = 0,
    batch_size: int = 4096,
    generate: int = GENERATE,
    device: str | torch.device = "cpu",
) -> list[dict]:
    """One row per canary: secret, repeats, log_perplexity (bits), rank, exposure (bits),
    space_size, method ("exact" or "extrapolated"), extracted.

    ``method="auto"`` is exact when |R| <= ``max_exact``; the extrapolated rank is the float
    |R| F(Px(s)) (see the module docstring)."""
    if not canaries:
        return []
    lengths = {len(c.secret) for c in canaries}
    if len(lengths) > 1 or not all(c.secret.isdigit() and c.secret.isascii() for c in canaries):
        raise ValueError("canary secrets must be decimal digit strings of one length")
    digits = lengths.pop()
    space = 10**digits
    if method == "auto":
        method = "exact" if space <= max_exact else "extrapolated"
    if method == "exact":
        px_all = enumerate_log_perplexities(logits_fn, digits, batch_size=batch_size, device=device)
        px = px_all[[int(c.secret) for c in canaries]]
        ranks = [int(r) + 1 for r in np.searchsorted(np.sort(px_all), px, side="left")]
        exposures = [math.log2(space) - math.log2(r) for r in ranks]
    elif method == "extrapolated":
        px = log_perplexity(logits_fn, [c.secret for c in canaries], batch_size=batch_size, device=device)
        rng = np.random.default_rng(seed)
        sample = [f"{int(x):0{digits}d}" for x in rng.integers(space, size=samples)]
        log2_cdf = _skewnorm_log2_cdf(log_perplexity(logits_fn, sample, batch_size=batch_size, device=device), px)
        exposures = [float(-v) for v in log2_cdf]
        ranks = [float(space * 2.0**v) for v in log2_cdf]
    else:
        raise ValueError(f"method must be 'auto', 'exact' or 'extrapolated', got {method!r}")
    continuation = greedy_continuation(logits_fn, generate, device=device)
    return [
        {
            "secret": c.secret,
            "repeats": c.repeats,
            "log_perplexity": float(p),
            "rank": r,
            "exposure": float(e),
            "space_size": space,
            "method": method,
            "extracted": c.secret in continuation,
        }
        for c, p, r, e in zip(canaries, px, ranks, exposures)
    ]
