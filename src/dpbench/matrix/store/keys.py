"""The keys of the matrix mechanisms' files: a key names everything that determines a
factorization, and nothing else, so runs that need the same one share its file.

Dense factorizations (dense_factorization.py): ``<kind>-k<k>-b<b>[-tau<tau>]``, kind one of
DENSE_KINDS, k = E epochs, b = N // L batches, tau only for the convergence-aware (lambda) kinds:
``se-k1-b1875``, ``me-lambda-k30-b48-tau1440``.

Streamed factorizations (banded.py, blt.py):

* ``band-n<n>-b<b>``: banded Toeplitz with b bands for n steps, column-normalised. Its
  coefficients depend on (n, b) only (banded.optimize); the participation only has to admit
  it (b <= b'), which the run checks when it computes its sensitivity. Shared by
  ``dpmatrix-band`` and ``dpmatrix-band-amp`` with an explicit ``bands``.
* ``blt-n<n>-sep<b'>-k<k>-m<m|auto>``: the BLT optimised for Pi(b', k) over n steps with m
  buffers (``auto``: grown while it helps, blt.optimize). Canonical: k is the effective
  k' = min(k, ceil(n / b')), and with k' = 1 the separation is n (single participation does
  not depend on it).
* ``band-auto-N<N>-L<L>-n<T>-eps<epsilon>-delta<delta>``: ``dpmatrix-band-amp`` with
  ``bands: auto``. The band search (mechanisms.cyclic_poisson.choose_bands) depends on the
  training-set size N, the batch size L, the steps T and the target (epsilon, delta); its file
  holds the search (every candidate's sigma and error) and the chosen b's coefficients, so that
  the band search is a cached stage too and the workflow's graph is known before anything runs
  (no dynamic dependency on the search's result). Numbers are written in their shortest exact
  form (``repr`` of the float, a trailing ".0" dropped: eps1, eps0.5, delta1e-05).

Every parser refuses a key that is not canonical (the one its parameters make).
"""

from __future__ import annotations

import math
import re
from typing import Any


DENSE_KINDS = ("se", "se-lambda", "me", "me-lambda", "identity")
_DENSE_KEY = re.compile(r"^(?P<kind>se-lambda|me-lambda|se|me|identity)-k(?P<k>\d+)-b(?P<b>\d+)(?:-tau(?P<tau>\d+))?$")
_NUM = r"[0-9][0-9.e+-]*"
_STREAMED_KEYS = {
    "band": re.compile(r"^band-n(?P<n>\d+)-b(?P<b>\d+)$"),
    "blt": re.compile(r"^blt-n(?P<n>\d+)-sep(?P<sep>\d+)-k(?P<k>\d+)-m(?P<m>\d+|auto)$"),
    "band-auto": re.compile(rf"^band-auto-N(?P<N>\d+)-L(?P<L>\d+)-n(?P<n>\d+)"
                            rf"-eps(?P<eps>{_NUM})-delta(?P<delta>{_NUM})$"),
}


def dense_key(kind: str, epochs: int, batches: int, tau: int | None = None) -> str:
    if kind not in DENSE_KINDS:
        raise ValueError(f"unknown factorization kind {kind!r}; choose one of {DENSE_KINDS}")
    if epochs < 1 or batches < 1:
        raise ValueError(f"need k >= 1 and b >= 1, got k={epochs}, b={batches}")
    if kind.startswith("se") and epochs != 1:
        raise ValueError(f"single-epoch factorization {kind!r} needs k = 1 epoch, got k = {epochs}")
    if kind.endswith("lambda"):
        tau = epochs * batches if tau is None else int(tau)
        if not 1 <= tau <= epochs * batches:
            raise ValueError(f"tau must be in [1, T] = [1, {epochs * batches}], got {tau}")
        return f"{kind}-k{epochs}-b{batches}-tau{tau}"
    if tau is not None:
        raise ValueError(f"factorization {kind!r} takes no tau")
    return f"{kind}-k{epochs}-b{batches}"


def parse_dense_key(key: str) -> tuple[str, int, int, int | None]:
    """(kind, k, b, tau) from a key; checks it is canonical."""
    m = _DENSE_KEY.match(key)
    if not m:
        raise ValueError(f"not a factorization key: {key!r} (expected e.g. se-k1-b1875 or me-lambda-k30-b48-tau1440)")
    kind, k, b = m["kind"], int(m["k"]), int(m["b"])
    tau = int(m["tau"]) if m["tau"] else None
    if dense_key(kind, k, b, tau) != key:
        raise ValueError(f"factorization key {key!r} is not canonical (expected {dense_key(kind, k, b, tau)!r})")
    return kind, k, b, tau


def number(x: float) -> str:
    """The shortest exact decimal of a float, without a trailing '.0' (1.0 -> '1', 1e-05 -> '1e-05')."""
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


def band_key(steps: int, bands: int) -> str:
    if not 1 <= bands <= steps:
        raise ValueError(f"a banded factorization needs 1 <= b <= n, got b = {bands}, n = {steps}")
    return f"band-n{int(steps)}-b{int(bands)}"


def blt_key(steps: int, min_separation: int, participations: int, buffers: int | None) -> str:
    if steps < 2 or min_separation < 1 or participations < 1:
        raise ValueError(f"a BLT needs n >= 2, b' >= 1 and k >= 1, got n = {steps}, b' = {min_separation}, "
                         f"k = {participations}")
    from dpbench.matrix import banded, blt  # scipy: only for a streamed key (the workflow reads dense ones without)

    if buffers is not None and not 1 <= buffers <= blt.MAX_BUFFERS:
        raise ValueError(f"buffers must be in [1, {blt.MAX_BUFFERS}] or auto, got {buffers}")
    k = banded.max_participations(steps, min_separation, participations)
    sep = steps if k == 1 else min_separation
    return f"blt-n{int(steps)}-sep{int(sep)}-k{k}-m{'auto' if buffers is None else int(buffers)}"


def band_search_key(n_train: int, batch_size: int, steps: int, epsilon: float, delta: float) -> str:
    if not (1 <= batch_size <= n_train and steps >= 1):
        raise ValueError(f"a band search needs 1 <= L <= N and T >= 1, got N = {n_train}, L = {batch_size}, "
                         f"T = {steps}")
    if not (math.isfinite(epsilon) and epsilon > 0 and 0 < delta < 1):
        raise ValueError(f"a band search needs a finite epsilon > 0 and 0 < delta < 1, got {epsilon}, {delta}")
    return (f"band-auto-N{int(n_train)}-L{int(batch_size)}-n{int(steps)}-eps{number(epsilon)}"
            f"-delta{number(delta)}")


def parse_streamed_key(key: str) -> tuple[str, dict[str, Any]]:
    """(kind, parameters) of a streamed key; refuses a key that is not canonical."""
    for kind, pattern in _STREAMED_KEYS.items():
        m = pattern.match(key)
        if not m:
            continue
        g = m.groupdict()
        if kind == "band":
            params = {"n": int(g["n"]), "bands": int(g["b"])}
            canonical = band_key(params["n"], params["bands"])
        elif kind == "blt":
            params = {"n": int(g["n"]), "min_separation": int(g["sep"]), "participations": int(g["k"]),
                      "buffers": None if g["m"] == "auto" else int(g["m"])}
            canonical = blt_key(params["n"], params["min_separation"], params["participations"], params["buffers"])
        else:
            try:
                params = {"n_train": int(g["N"]), "batch_size": int(g["L"]), "n": int(g["n"]),
                          "epsilon": float(g["eps"]), "delta": float(g["delta"])}
            except ValueError:
                break
            canonical = band_search_key(params["n_train"], params["batch_size"], params["n"], params["epsilon"],
                                        params["delta"])
        if canonical != key:
            raise ValueError(f"streamed factorization key {key!r} is not canonical (expected {canonical!r})")
        return kind, params
    raise ValueError(f"not a streamed factorization key: {key!r} (expected e.g. band-n1875-b64, "
                     "blt-n1440-sep48-k30-mauto or band-auto-N60000-L32-n1875-eps1-delta1e-05)")


def is_streamed_key(key: str) -> bool:
    return any(p.match(key) for p in _STREAMED_KEYS.values())
