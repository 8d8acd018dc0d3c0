"""Private hyperparameter tuning: the privacy of a whole search, not of one run.

Training k candidates on the private data and publishing the best is k runs composed. Papernot
& Steinke ("Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022, arXiv:2110.03620)
make the search itself private: run a *random* number K of candidates, each with
hyperparameters drawn at random and fresh randomness, and release only the best. With K from a
truncated negative binomial (shape eta > 0, eta = 1: geometric; Theorem 2) or a Poisson
distribution (Theorem 6), the procedure's RDP is that of one candidate plus a term that grows
with log E[K], not with E[K]. Google's ``dp_accounting`` accounts for exactly this
(``RepeatAndSelectDpEvent`` in its RDP accountant), and we use it rather than the bound by hand
(the tests check it against the closed forms).

Here, for a candidate given as an accounting history (a list of (sigma, q, steps) segments of
the Poisson-subsampled Gaussian; a Gaussian release of sensitivity s with noise sigma is
[(sigma / s, 1, 1)]):

* ``candidate_event`` / ``procedure_event``: the DpEvent of one candidate and of the procedure
  (random repetition, or k candidates composed: ``Tuning.distribution == "composition"``);
* ``procedure_epsilon``: its (epsilon, delta) from the RDP accountant, at the project's orders;
* ``candidate_noise_multiplier``: the smallest candidate sigma with which the *whole procedure*
  meets a target epsilon (bisection, ``accounting.smallest_sigma``);
* ``draw_candidates``: K and each candidate's rate index and seed, from a seed alone, so that
  the number of repetitions is random, recorded and reproducible from the root seed.

A composition of k candidates is accounted with the run's own accountant (PRV by default) on the
k-fold history, the tightest bound the project has for it; the random repetition has only its
RDP analysis. Both are also available in the same RDP accountant (``rdp_epsilon`` of
``procedure_event``), which the tests use to compare the procedures alone. Which one is cheaper
depends on the candidate: a Gaussian release (the matrix mechanisms) gains from random
repetition from a mean of about 3 to 10 candidates on, while DP-SGD with a small sample rate
(Setup 2: q = 32 / N, one epoch) has so flat an RDP curve that composing k candidates costs
less than repeating a random number with the same mean (docs/privacy.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from dpbench.privacy import accounting

DISTRIBUTIONS = ("negative_binomial", "poisson", "composition")
# Entropy word that keeps a tuning procedure's random streams apart from every run's streams
# (which are SeedSequence(seed)'s children, dpbench.seeds): SeedSequence([seed, TUNING_WORD]).
TUNING_WORD = 0x74756E65  # "tune"
# Bounds on a search's size: every candidate is a full training run. The mean number of
# candidates is at most MAX_MEAN, the number drawn at most MAX_REPETITIONS (a draw above it is
# refused, not redrawn: the accounting assumes the distribution as stated); the truncated
# negative binomial redraws K = 0, and is refused where that takes more than 1 / MIN_ACCEPTANCE
# draws on average, so that no draw loops without end (MAX_REDRAWS bounds it even then).
MAX_MEAN = 100
MAX_REPETITIONS = 1000
MIN_ACCEPTANCE = 1e-4
MAX_REDRAWS = 10**6


@dataclass(frozen=True)
class Tuning:
    """How a search draws its candidates. ``negative_binomial``: K ~ truncated negative binomial
    with mean ``mean`` and shape eta = ``shape`` (1: geometric); ``poisson``: K ~ Poisson(``mean``)
    (K = 0 releases nothing); ``composition``: each of the ``mean`` candidates exactly once, k
    runs composed (``mean`` is then k, an integer)."""

    distribution: str
    mean: float
    shape: float = 1.0

    def __post_init__(self):
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"tuning distribution {self.distribution!r} is not one of {DISTRIBUTIONS}")
        if not (isinstance(self.mean, (int, float)) and 1 <= self.mean < math.inf):
            raise ValueError(f"tuning mean must be a finite number >= 1, got {self.mean!r}")
        if self.mean > MAX_MEAN:
            raise ValueError(f"tuning mean {self.mean:g} is above {MAX_MEAN} candidates, each a full training run")
        if self.distribution == "composition" and self.mean != int(self.mean):
            raise ValueError(f"composition runs a whole number of candidates, got {self.mean!r}")
        if self.distribution == "negative_binomial" and not (0 < self.shape < math.inf):
            raise ValueError(f"tuning shape (eta) must be positive and finite, got {self.shape!r}")
        if self.distribution == "negative_binomial" and acceptance(self.mean, self.shape) < MIN_ACCEPTANCE:
            raise ValueError(f"tuning shape {self.shape:g} with mean {self.mean:g}: the negative binomial draws K = 0 "
                             f"(redrawn) with probability 1 - {acceptance(self.mean, self.shape):.3g}, more than "
                             f"{1 / MIN_ACCEPTANCE:g} draws a search on average; give a larger shape or mean")

    @property
    def label(self) -> str:
        """A short name for ids and captions: nb3x1 (mean 3, shape 1), poisson3, composed5."""
        mean = f"{self.mean:g}"
        if self.distribution == "negative_binomial":
            return f"nb{mean}x{self.shape:g}"
        return f"poisson{mean}" if self.distribution == "poisson" else f"composed{mean}"

    def record(self) -> dict:
        return {"distribution": self.distribution, "mean": float(self.mean),
                "shape": float(self.shape) if self.distribution == "negative_binomial" else None}


@dataclass(frozen=True)
class Candidate:
    """A run's ``tuning`` setting, one typed value parsed by ``parse`` alone (the run's
    ``--tuning``, a grid cell's id, its record and its checks read it through here): the search
    (``Tuning``), K drawn and this candidate's index j (None in a grid block's search, checked
    before its candidates are drawn), and the split the release is chosen on where given."""

    search: Tuning
    repetitions: int | None = None
    candidate: int | None = None
    select_by: str | None = None

    KEYS = ("distribution", "mean", "shape", "select_by", "repetitions", "candidate")

    @classmethod
    def parse(cls, tuning: Mapping[str, Any], *, drawn: bool = False) -> Candidate:
        """The candidate of a ``tuning`` object; ``drawn``: K and j must be given (a run's). A
        bad one is a ValueError naming the first fault."""
        if not isinstance(tuning, Mapping):
            raise ValueError(f"expected an object with keys {', '.join(cls.KEYS)}, got {tuning!r}")
        unknown = sorted(set(tuning) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r} (keys: {', '.join(cls.KEYS)})")
        distribution = tuning.get("distribution")
        if tuning.get("shape") is not None and distribution != "negative_binomial":
            raise ValueError(f"shape is the negative binomial's eta; a {distribution} search takes none")
        if tuning.get("mean") is None:
            raise ValueError(f"a {distribution} search needs the mean number of candidates")
        search = Tuning(distribution, tuning["mean"], tuning.get("shape") or 1.0)
        k, j = tuning.get("repetitions"), tuning.get("candidate")
        if drawn or k is not None or j is not None:
            if not (type(k) is int and type(j) is int and 0 <= j < k):
                raise ValueError(f"candidate must be an index below repetitions, got {j!r} of {k!r}")
            if search.distribution == "composition" and k != search.mean:
                raise ValueError(f"a composition runs each of its {search.mean:g} settings once, not {k} (repetitions "
                                 "must equal mean: sigma is calibrated for the k composed)")
        return cls(Tuning(search.distribution, float(search.mean), float(search.shape)), k, j, tuning.get("select_by"))

    @property
    def id_part(self) -> str:
        """``-tune<search>-k<K>c<j>`` (e.g. -tunenb3x1-k4c2): the part of a cell id that names it."""
        return f"-tune{self.search.label}-k{self.repetitions}c{self.candidate}"


# -- accounting ------------------------------------------------------------------------------


def candidate_event(history: accounting.History):
    """The DpEvent of one candidate run: each segment (sigma, q, n) is n self-composed
    Poisson-subsampled Gaussians (q = 1: plain Gaussians), the segments composed."""
    import dp_accounting as dpa

    events = []
    for sigma, q, n in history:
        if n <= 0:
            continue
        if not sigma > 0:
            raise ValueError(f"a candidate without noise (sigma = {sigma}) has no finite privacy")
        step = dpa.GaussianDpEvent(float(sigma))
        if q < 1:
            step = dpa.PoissonSampledDpEvent(float(q), step)
        events.append(dpa.SelfComposedDpEvent(step, int(n)))
    if not events:
        return dpa.NoOpDpEvent()
    return events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)


def procedure_event(history: accounting.History, tuning: Tuning):
    """The DpEvent of the search: RepeatAndSelect around the candidate (shape inf: Poisson), or
    the candidate self-composed k times."""
    import dp_accounting as dpa
    from dp_accounting import dp_event

    event = candidate_event(history)
    if tuning.distribution == "composition":
        return dpa.SelfComposedDpEvent(event, int(tuning.mean))
    shape = math.inf if tuning.distribution == "poisson" else float(tuning.shape)
    return dp_event.RepeatAndSelectDpEvent(event, float(tuning.mean), shape)


def rdp_epsilon(event, delta: float = accounting.DELTA) -> float:
    """(epsilon, delta) of a DpEvent from dp_accounting's RDP accountant, at the project's orders
    (``accounting.RDP_ORDERS``, to 1024; the add/remove neighbour relation)."""
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(orders=accounting.RDP_ORDERS)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def procedure_epsilon(history: accounting.History, tuning: Tuning, delta: float = accounting.DELTA,
                      accountant: str = accounting.DEFAULT_ACCOUNTANT) -> float:
    """The epsilon of the whole search whose candidates each have ``history``: the random
    repetition from the RDP accountant (its only analysis); k candidates composed from the run's
    own ``accountant`` (PRV by default), each segment's steps times k, the tightest bound the
    project has for a composition (``rdp_epsilon(procedure_event(...))`` gives its RDP bound)."""
    if tuning.distribution == "composition":
        k = int(tuning.mean)
        return accounting.epsilon([(s, q, n * k) for s, q, n in history], delta, accountant)
    return rdp_epsilon(procedure_event(history, tuning), delta)


def candidate_noise_multiplier(history_of: Callable[[float], accounting.History], tuning: Tuning,
                               target_epsilon: float, delta: float = accounting.DELTA,
                               accountant: str = accounting.DEFAULT_ACCOUNTANT, rel_tol: float = 1e-3) -> float:
    """The smallest sigma (to ``rel_tol``) such that the search over candidates with history
    ``history_of(sigma)`` is (target_epsilon, delta)-DP (``procedure_epsilon``)."""
    accounting.check_target(target_epsilon, delta)
    return accounting.smallest_sigma(lambda s: procedure_epsilon(history_of(s), tuning, delta, accountant),
                                     target_epsilon, rel_tol)


# -- the random number of candidates ---------------------------------------------------------


def negative_binomial_gamma(mean: float, shape: float) -> float:
    """gamma of the truncated negative binomial with this mean and shape eta (Papernot & Steinke,
    Definition 1: P[K = k] proportional to C(k + eta - 1, k) (1 - gamma)^k, k >= 1), whose mean is
    eta (1 - gamma) / (gamma (1 - gamma^eta)): decreasing in gamma, found by bisection."""
    if mean == 1:
        return 1.0
    if shape == 1:
        return 1.0 / mean

    def mean_of(g: float) -> float:
        return shape * (1 - g) / (g * -math.expm1(shape * math.log(g)))

    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mean_of(mid) > mean:
            lo = mid
        else:
            hi = mid
    return hi


def acceptance(mean: float, shape: float) -> float:
    """P[K >= 1] of the negative binomial before truncation, 1 - gamma^eta: the share of draws
    that ``draw_repetitions`` keeps."""
    gamma = negative_binomial_gamma(mean, shape)
    return 1.0 if gamma >= 1 else -math.expm1(shape * math.log(gamma))


def draw_repetitions(tuning: Tuning, rng: np.random.Generator) -> int:
    """K, the number of candidates: exactly ``mean`` for composition; Poisson(mean) (possibly 0);
    the truncated negative binomial by rejection of K = 0 (numpy's negative binomial counts
    failures before eta successes of probability gamma: Definition 1 before truncation), at
    most MAX_REDRAWS draws (``Tuning`` refuses a shape that would need more than 1 /
    MIN_ACCEPTANCE on average). A K above MAX_REPETITIONS is refused."""
    if tuning.distribution == "composition":
        k = int(tuning.mean)
    elif tuning.distribution == "poisson":
        k = int(rng.poisson(tuning.mean))
    else:
        gamma = negative_binomial_gamma(tuning.mean, tuning.shape)
        k = 1 if gamma >= 1 else 0
        for _ in range(MAX_REDRAWS if k == 0 else 0):
            k = int(rng.negative_binomial(tuning.shape, gamma))
            if k >= 1:
                break
        if k == 0:
            raise ValueError(f"the {tuning.label} search drew K = 0 {MAX_REDRAWS} times in a row")
    if k > MAX_REPETITIONS:
        raise ValueError(f"the {tuning.label} search drew K = {k} candidates, above the cap of {MAX_REPETITIONS} "
                         "full training runs; give a smaller mean")
    return k


def draw_candidates(tuning: Tuning, seed: int, choices: int) -> list[tuple[int, int]]:
    """The candidates of a search from its seed: one (choice index, candidate seed) each. K comes
    from one stream, the choices (uniform over ``choices`` hyperparameter settings; composition:
    each once, in order) from a second, the candidates' own seeds from a third: candidate j's
    choice and seed do not depend on K, and no two candidates share a seed (they would share
    noise, and neither composition nor Papernot & Steinke's analysis would hold)."""
    if choices < 1:
        raise ValueError("a search needs at least one hyperparameter setting to choose from")
    if tuning.distribution == "composition" and int(tuning.mean) != choices:
        raise ValueError(f"composition runs each of the {choices} settings once, not {tuning.mean:g}")
    streams = np.random.SeedSequence([int(seed), TUNING_WORD]).spawn(3)
    k = draw_repetitions(tuning, np.random.default_rng(streams[0]))
    if tuning.distribution == "composition":
        picks = list(range(k))
    else:
        picks = [int(i) for i in np.random.default_rng(streams[1]).integers(0, choices, size=k)]
    seeds = [int(c.generate_state(1)[0]) for c in streams[2].spawn(k)]
    return list(zip(picks, seeds))
