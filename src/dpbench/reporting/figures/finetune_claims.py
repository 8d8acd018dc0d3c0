"""The papers' headline claims about private fine-tuning, answered one by one from the fine-tuning
study (P6, P5; docs/finetune.md) with numbers and intervals: ``finetune_claims``, a Markdown table.

Every number is one of ``finetune_data``'s: per (optimizer, ε, mode) the configuration with the
best mean validation score over its seeds, among that mode's runs alone, and its test value
(``chosen_runs``: P6 the accuracy, P5 the perplexity, or the exposure of the canaries inserted k
times). A claim compares two of them, A and B; the difference A − B gets a 95 % interval
(``intervals.record_contrast_interval``): paired by seed where both have the same seeds (runs of
one seed share their data order and noise draws across optimizers), else Welch's, and for a test
accuracy counting the test records' noise as well as the seeds', paired on the same records,
from the runs' per-record outcomes (``test_correct_at_best_val``), or where a run lacks them the
least record noise the accuracies allow; never of width 0 (docs/figures.md). A configuration
chosen from a tie on validation (``selection.TIE_TOLERANCE``) brings the configurations it tied
with (``finetune.tied_runs``): the verdict is recomputed under each choice they allow and marked
"tie-sensitive" where one changes it. ``sizing`` gives, from each row's variance components, the
seeds and test records a ±2-point interval needs. A claim's verdict:

* ``holds``: the interval excludes 0 on the claimed side and, for a claimed size, reaches it;
* ``direction only``: excludes 0 on the claimed side, but lies short of the claimed size;
* ``not supported``: the interval contains 0; ``reversed``: excludes 0 on the other side;
* for a claim of no difference ("about as much"): ``no difference found`` (contains 0, which
  is not a proof of equality: the interval's width is what it leaves open) or ``differs``;
* ``–``: fewer than two seeds, a configuration that diverged, or an interval of width 0 (the
  seeds alone, equal on every seed: no noise measured).

An end of the interval within 1e-12 of 0 counts as 0 (``ZERO``: equal differences on every seed
give an interval of width 0 whose ends are 0 up to rounding).

A claim with no runs in the table says "not run".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from dpbench.problems.modes import SCRATCH, Full, Head, LastBlock, LoRA
from dpbench.problems.catalog import task_facts
from dpbench.reporting.figures.finetune import (chosen_runs, mode_name, mode_label, number, ordered_modes,
                                                record_outcomes, tied_runs)
from dpbench.reporting.figures.intervals import (Contrast, contrast_interval, record_contrast_interval,
                                                 records_needed, seeds_needed)
from dpbench.reporting.figures.selection import select_runs
from dpbench.reporting.figures.style import fmt_tick, label, legend_labels

# the modes the papers' claims are about, by their objects' names
FULL, LAST_BLOCK, LORA, HEAD_MODE = Full.name, LastBlock.name, LoRA.name, Head.name


@dataclass(frozen=True)
class Claim:
    """A paper's claim: ``direction`` the sign of A − B it asserts (0: no difference), ``size``
    the magnitude it asserts per ε (absent: none)."""

    number: str
    paper: str
    text: str
    direction: int
    size: dict | None = None


CLAIMS = (
    Claim("1", "Chooi et al. 2025", "DP-AdamW beats DP-Adam by more than 15 points at every ε", 1, {None: 0.15}),
    Claim("2a", "Chooi et al. 2025", "DP-AdamW-BC trails DP-AdamW by 2–3 points", -1, {None: 0.02}),
    Claim("2b", "Chooi et al. 2025", "DP-AdamBC beats DP-Adam (the bias correction's contrast)", 1),
    Claim("3", "DiSK", "DiSK beats DP-AdamW by 3.8 points at ε = 1 (1.3 at ε = 6.7)", 1, {1.0: 0.038, 6.7: 0.013}),
    Claim("4a", "DiSK", "DP-LoRA with DiSK beats plain DP-LoRA (DP-AdamW)", 1),
    Claim("4b", "DiSK", "DP-LoRA with DiSK beats DP-LoRA with DP-SGD", 1),
    Claim("5", "Li et al. 2022; Yu et al. 2022", "with public pretraining the cost of privacy nearly vanishes: "
          "the gap to non-private AdamW shrinks", 1),
    Claim("6a", "arXiv 2502.13313", "LoRA alone cuts memorisation (non-private)", -1),
    Claim("6b", "arXiv 2502.13313", "DP-SGD cuts memorisation", -1),
    Claim("6c", "arXiv 2502.13313", "LoRA alone cuts memorisation about as much as DP-SGD", 0),
    Claim("7", "Tramèr & Boneh 2021", "a DP linear probe of good public features (mode head) beats DP "
          "fine-tuning of the whole model (mode full)", 1),
)


def claimed_size(claim: Claim, eps: float) -> float | None:
    """The size ``claim`` asserts at ``eps``: its ε-free size, or the one at the paper's ε within
    10 % of ``eps`` (this study's ε = 7 answers DiSK's ε = 6.7), else None (the direction alone)."""
    if not claim.size:
        return None
    if None in claim.size:
        return claim.size[None]
    near = [v for e, v in claim.size.items() if math.isfinite(eps) and abs(eps - e) <= 0.1 * e]
    return near[0] if near else None


ZERO = 1e-12  # an end of an interval nearer 0 than this is 0 (rounding of equal differences)


def verdict(low: float, high: float, n: int, direction: int, size: float | None = None) -> str:
    """A claim's verdict from the interval [low, high] of A − B over n seeds (module docstring);
    "–" for an interval of width 0, which measured no noise (equal differences on every seed,
    without test records to count: ``record_contrast_interval`` never gives one)."""
    if n < 2 or not (np.isfinite(low) and np.isfinite(high)) or high - low <= ZERO:
        return "–"
    low, high = (0.0 if abs(v) < ZERO else v for v in (low, high))
    contains = low <= 0.0 <= high
    if direction == 0:
        return "no difference found" if contains else "differs"
    if contains:
        return "not supported"
    if (low > 0) != (direction > 0):
        return "reversed"
    if size is not None and not (high >= size if direction > 0 else low <= -size):
        return "direction only"
    return "holds"


@dataclass
class _Config:
    """One chosen configuration's values by seed; ``diverged``: its choice was a diverged one;
    for a test accuracy its runs' per-record outcomes and test records by seed (None: not
    known), whether the seeds share their test records, and the configurations tied with it
    that the tie rule passed over (``alternatives``, each a ``_Config``)."""

    values: pd.Series
    diverged: bool = False
    outcomes: pd.Series | None = None
    n_test: pd.Series | None = None
    shared: bool = True
    alternatives: list = field(default_factory=list)


def _config(chosen: pd.DataFrame, optimizer, eps: float, mode: str, column: str = "test_value"):
    """The chosen configuration of (optimizer, ε, mode) in ``chosen`` (``claims_data``'s runs:
    ``choice`` 0 the chosen, 1, 2, ... the tied ones passed over), None where it has none."""
    tied = None
    if "choice" in chosen:
        tied, chosen = chosen[chosen["choice"] > 0], chosen[chosen["choice"] == 0]
    c = chosen[(chosen["optimizer"] == optimizer) & (chosen["epsilon"] == eps) & (chosen["mode"] == mode)]
    if c.empty:
        return None
    if not np.isfinite(c["chosen_score"].iloc[0]):
        return _Config(pd.Series(dtype=float), bool(c["chosen_diverged"].iloc[0]))
    if column not in c:
        return None
    values = c[column].astype(float)
    if column.startswith("exposure_k"):
        values = values.where(c[f"canaries_k{column[len('exposure_k'):]}"].astype(float).fillna(0) > 0)
        if not values.notna().any():
            return None
    out = _Config(pd.Series(values.to_numpy(), index=c["seed"].to_numpy()))
    if column == "test_value" and task_facts(str(c["task"].iloc[0])).measures_accuracy:
        out.outcomes, out.n_test, out.shared = record_outcomes(c)
    if tied is not None and len(tied):
        others = tied[(tied["optimizer"] == optimizer) & (tied["epsilon"] == eps) & (tied["mode"] == mode)]
        for _, alt in others.groupby("choice", sort=True):
            a = _config(alt.drop(columns="choice"), optimizer, eps, mode, column)
            if a is not None:
                out.alternatives.append(a)
    return out


def _contrast(terms) -> Contrast:
    """A − B's interval over [(w, _Config)] (``record_contrast_interval``)."""
    return record_contrast_interval([(w, c.values, c.outcomes, c.n_test) for w, c in terms],
                                    shared_records=all(c.shared for _, c in terms))


MOST_CHOICES = 4096  # the tied choices a row's verdict is recomputed under, at most (then: each term's alone)


def _tie_verdicts(claim: Claim, eps: float, terms) -> tuple[int, list[str]]:
    """(the choices tied configurations allow, beyond the chosen one, and the verdict under each):
    every combination of each term's tied alternatives (``_Config.alternatives``), or where they
    are more than ``MOST_CHOICES`` each term's alternatives with the other terms as chosen."""
    options = [[c, *c.alternatives] for _, c in terms]
    total = math.prod(len(o) for o in options)
    if total == 1:
        return 0, []
    if total <= MOST_CHOICES:
        combos = list(itertools.product(*options))[1:]
    else:
        chosen = [o[0] for o in options]
        combos = [chosen[:i] + [a] + chosen[i + 1:] for i, o in enumerate(options) for a in o[1:]]
    size, out = claimed_size(claim, eps), []
    for combo in combos:
        ct = _contrast([(w, c) for (w, _), c in zip(terms, combo)])
        out.append(verdict(ct.low, ct.high, ct.n, claim.direction, size))
    return len(combos), out


def _reference(chosen: pd.DataFrame, mode: str) -> str | None:
    """The non-private reference of ``mode``: its best non-private configuration by the selection
    score (as ``finetune_data``'s gap_non_private)."""
    if "choice" in chosen:
        chosen = chosen[chosen["choice"] == 0]
    np_ = chosen[~chosen["private"].astype(bool) & (chosen["mode"] == mode) & np.isfinite(chosen["chosen_score"])]
    return None if np_.empty else np_.loc[np_["chosen_score"].idxmax(), "optimizer"]


def _cell(mean: float, low: float, high: float, n: int, fmt: str, signed: bool = False) -> str:
    if not np.isfinite(mean):
        return "–"

    def f(v):
        text = number(abs(v), fmt)
        if not signed:
            return number(v, fmt).replace("-", "−")
        return ("+" if v >= 0 or float(text) == 0 else "−") + text

    return f(mean) + (f" [{f(low)}, {f(high)}]" if n >= 2 and np.isfinite(low) and np.isfinite(high) else "")


def _row(claim: Claim, problem: str, eps: float, mode: str, a_name: str, b_name: str, a_terms, b_terms,
         fmt: str) -> dict:
    """A table row: A and B each a contrast of configurations [(w, _Config)], and A − B."""
    cells = {"claim": f"{claim.number} ({claim.paper}): {claim.text}", "problem": problem,
             "ε": fmt_tick(eps) if np.isfinite(eps) else "∞", "mode": mode, "A": a_name, "B": b_name}
    diverged = any(c.diverged for _, c in (*a_terms, *b_terms))
    shown = []
    for terms in (a_terms, b_terms):
        mean, low, high, n, _ = contrast_interval([(w, c.values) for w, c in terms])
        shown.append("diverged" if any(c.diverged for _, c in terms)
                     else _cell(mean, low, high, n, fmt, signed=len(terms) > 1))
    terms = [(w, c) for w, c in a_terms] + [(-w, c) for w, c in b_terms]
    ct = _contrast(terms)
    mean, low, high, n, how = ct.mean, ct.low, ct.high, ct.n, ct.how
    size = claimed_size(claim, eps)
    said = "–" if diverged else verdict(low, high, n, claim.direction, size)
    k, others = (0, []) if diverged else _tie_verdicts(claim, eps, terms)
    flips = [v for v in others if v != said]
    if not k:
        ties = "–"
    elif flips:
        ties = f"{len(flips)} of {k}: " + ", ".join(f"{v} ({flips.count(v)})" for v in dict.fromkeys(flips))
    else:
        ties = f"{k}: same"
    return {**cells, "A value": shown[0], "B value": shown[1],
            "A − B": _cell(mean, low, high, n, fmt, signed=True),
            "seeds": (f"{n}, {how}" + (f", n = {ct.records}" if ct.records else "")) if n else "–",
            "claimed": "–" if size is None else format(claim.direction * size, "+" + fmt).replace("-", "−"),
            "verdict": said + (" · tie-sensitive" if flips else ""), "ties": ties,
            "diff": mean, "low": low, "high": high, "n": n, "tie_sensitive": bool(flips), "contrast": ct,
            "claim_number": claim.number, "scale": ct.scale}


def _pairs(chosen, claim, pairs, bases, labels, fmt, problem="P6"):
    """Rows of ``claim``: A − B for each (A, B) optimizer pair, each ε and each mode of ``bases``."""
    rows = []
    if chosen.empty:
        return rows
    modes = [m for m in ordered_modes(chosen["mode"]) if mode_name(m) in bases]
    for eps in sorted(chosen.loc[chosen["private"].astype(bool), "epsilon"].unique()):
        for mode in modes:
            for a, b in pairs:
                ca, cb = _config(chosen, a, eps, mode), _config(chosen, b, eps, mode)
                if ca and cb:
                    rows.append(_row(claim, problem, eps, mode_label(mode), label(a, labels), label(b, labels),
                                     [(1, ca)], [(1, cb)], fmt))
    return rows


def _pretraining(chosen, claim, problem, labels, fmt) -> list[dict]:
    """Claim 5: per private optimizer and ε, (its gap to the non-private reference in full) minus
    (the same gap from scratch); the claimed side is the better one of the problem's metric."""
    return gap_contrast(claim, problem, (chosen, FULL, "full"), (chosen, SCRATCH, "from scratch"), labels, fmt)


def gap_contrast(claim, problem, a, b, labels, fmt) -> list[dict]:
    """Rows of claim 5's form: per private optimizer and ε chosen in both, (its gap to the
    non-private reference in A) minus (its gap in B). ``a``, ``b``: (chosen runs, mode, name shown);
    each side's reference is its chosen runs' best non-private configuration of its mode
    (``_reference``), so the two sides may be two problems on the same records (P7 full against
    P6 from scratch). The claimed side is the better one of the problem's metric."""
    (ca, mode_a, name_a), (cb, mode_b, name_b) = a, b
    if ca.empty or cb.empty:
        return []
    ref_a, ref_b = _reference(ca, mode_a), _reference(cb, mode_b)
    if ref_a is None or ref_b is None:
        return []
    better = 1 if problem != "P5" else -1  # a classifier's accuracy higher, P5's perplexity lower
    c = Claim(claim.number, claim.paper, claim.text, better)
    inf, rows = math.inf, []
    private = ca[ca["private"].astype(bool)]
    for eps in sorted(private["epsilon"].unique()):
        for opt in dict.fromkeys(private.loc[private["epsilon"] == eps, "optimizer"]):
            dp_a, dp_b = _config(ca, opt, eps, mode_a), _config(cb, opt, eps, mode_b)
            np_a, np_b = _config(ca, ref_a, inf, mode_a), _config(cb, ref_b, inf, mode_b)
            if dp_a and dp_b and np_a and np_b:
                rows.append(_row(c, problem, eps, f"{name_a} vs {name_b}",
                                 f"{label(opt, labels)} − {label(ref_a, labels)} ({name_a})",
                                 f"{label(opt, labels)} − {label(ref_b, labels)} ({name_b})",
                                 [(1, dp_a), (-1, np_a)], [(1, dp_b), (-1, np_b)], fmt))
    return rows


def _exposure(chosen, claims, k, labels) -> dict[str, list[dict]]:
    """Claim 6 on P5: the exposure at k of non-private AdamW in LoRA and in full, and of DP-SGD
    in full at each ε."""
    out = {c.number: [] for c in claims}
    if chosen.empty:
        return out
    col, inf, fmt = f"exposure_k{k}", math.inf, ".2f"
    loras = [m for m in ordered_modes(chosen["mode"]) if mode_name(m) == LORA]
    full = _config(chosen, "adamw", inf, FULL, col)
    adamw, dpsgd = label("adamw", labels), label("dpsgd", labels)
    c6a, c6b, c6c = claims
    for lora in loras:
        lo = _config(chosen, "adamw", inf, lora, col)
        if lo and full:
            out["6a"].append(_row(c6a, "P5", inf, f"{mode_label(lora)} vs full", f"{adamw}, {mode_label(lora)}",
                                  f"{adamw}, full", [(1, lo)], [(1, full)], fmt))
    for eps in sorted(chosen.loc[chosen["private"].astype(bool), "epsilon"].unique()):
        dp = _config(chosen, "dpsgd", eps, FULL, col)
        if dp and full:
            out["6b"].append(_row(c6b, "P5", eps, FULL, f"{dpsgd}, {FULL}", f"{adamw}, {FULL}", [(1, dp)],
                                  [(1, full)], fmt))
        for lora in loras:
            lo = _config(chosen, "adamw", inf, lora, col)
            if lo and dp:
                out["6c"].append(_row(c6c, "P5", eps, f"{mode_label(lora)} vs full", f"{adamw}, {mode_label(lora)}",
                                      f"{dpsgd}, full", [(1, lo)], [(1, dp)], fmt))
    return out


def _probe(chosen, claim, problem, labels, fmt) -> list[dict]:
    """Claim 7: per private optimizer and ε, its chosen configuration in mode head minus in full."""
    rows = []
    if chosen.empty:
        return rows
    private = chosen[chosen["private"].astype(bool)]
    for eps in sorted(private["epsilon"].unique()):
        for opt in dict.fromkeys(private.loc[private["epsilon"] == eps, "optimizer"]):
            head, full = _config(chosen, opt, eps, HEAD_MODE), _config(chosen, opt, eps, FULL)
            if head and full:
                rows.append(_row(claim, problem, eps, "head vs full", f"{label(opt, labels)}, head",
                                 f"{label(opt, labels)}, full", [(1, head)], [(1, full)], fmt))
    return rows


def claims_data(runs: pd.DataFrame, select_by: str = "val", k: int = 25,
                problem: str = "P6") -> dict[str, list[dict]]:
    """Claim number -> its rows (``_row``'s dicts: the table's cells and the difference's diff,
    low, high, n); an empty list: not run. ``problem``: the classifier the claims 1-5 and 7 are
    tested on (P6, or P7 from the public encoder); P5's are always P5's."""
    labels = legend_labels(runs)
    p6, p5 = (pd.concat([chosen_runs(runs, p, select_by=select_by).assign(choice=0),
                         tied_runs(runs, p, select_by=select_by)], ignore_index=True) for p in (problem, "P5"))
    by = {c.number: c for c in CLAIMS}
    trained = (FULL, LAST_BLOCK, LORA, HEAD_MODE)  # last-block: the DP-AdamW paper's own mode
    out = {
        "1": _pairs(p6, by["1"], [("dpadamw", "dpadam")], trained, labels, ".3f", problem),
        "2a": _pairs(p6, by["2a"], [("dpadamw-bc", "dpadamw")], trained, labels, ".3f", problem),
        "2b": _pairs(p6, by["2b"], [("dpadambc", "dpadam")], trained, labels, ".3f", problem),
        "3": _pairs(p6, by["3"], [("dpdisk", "dpadamw")], (FULL, LAST_BLOCK), labels, ".3f", problem),
        "4a": _pairs(p6, by["4a"], [("dpdisk", "dpadamw")], (LORA,), labels, ".3f", problem),
        "4b": _pairs(p6, by["4b"], [("dpdisk", "dpsgd")], (LORA,), labels, ".3f", problem),
        "5": (_pretraining(p6, by["5"], problem, labels, ".3f") + _pretraining(p5, by["5"], "P5", labels, ".2f")),
        "7": _probe(p6, by["7"], problem, labels, ".3f"),
    }
    out.update(_exposure(p5, [by["6a"], by["6b"], by["6c"]], k, labels))
    return out


HEAD = ["claim", "problem", "ε", "mode", "A", "B", "A value", "B value", "A − B", "claimed", "seeds", "ties",
        "verdict"]


# the model a classifier's claims were tested on, for the reading paragraph's scale sentence
SCALE = {"P6": "a ~1M-parameter transformer pretrained here on WordNet's glosses",
         "P7": "all-MiniLM-L6-v2, a 22.6M-parameter public BERT encoder,",
         "P8": "all-MiniLM-L6-v2, a 22.6M-parameter public BERT encoder,",
         "P9": "all-MiniLM-L6-v2, a 22.6M-parameter public BERT encoder,"}


def _span(values, fmt: str = ",") -> str:
    """"42" or "42-168": the least and the most of ``values``."""
    low, high = min(values), max(values)
    return format(low, fmt) if low == high else f"{low:{fmt}}-{high:{fmt}}"


def regime(runs: pd.DataFrame, problem: str) -> str:
    """How long and on how many records ``problem``'s runs trained, as measured ("for 42 steps on
    5,330 training records"; N = L / q of each run's batch size and sample rate): the scale a
    verdict is about."""
    r = runs[runs["problem"] == problem] if "problem" in runs else runs.iloc[:0]
    steps = [int(s) for s in r.get("steps", pd.Series(dtype=float)).dropna()]
    if not steps:
        return "for the steps its runs took"
    out = f"for {_span(steps)} steps"
    if {"batch_size", "sample_rate"} <= set(r.columns):
        n = [int(round(b / q)) for b, q in zip(r["batch_size"], r["sample_rate"]) if q and np.isfinite(q) and q > 0]
        if n:
            out += f" on {_span(n)} training records"
    return out


def draw_claims_table(data: dict[str, list[dict]], k: int = 25, select_by: str = "val", problem: str = "P6",
                      scale: str = "for the steps its runs took") -> str:
    """``claims_data`` as Markdown: the reading paragraph, then one table, a row per claim tested
    (problem, ε, mode), "not run" for a claim without runs. ``problem``: the classifier of
    claims 1-5 and 7 (its model named in the paragraph's scale sentence)."""
    split = "the validation split" if select_by == "val" else "the TEST split (optimistic)"
    lines = ["# The papers' claims on private fine-tuning, tested", "",
             "Each row tests one paper's claim at one ε and fine-tuning mode by a difference A − B of two "
             "configurations, each the one with the best mean score over its seeds on " + split + " among that "
             f"mode's runs alone (as in finetune_table): {problem} the test accuracy (a fraction: 15 points is "
             "0.150), P5 "
             f"the test perplexity (lower is better) or the exposure (bits) of the canaries inserted k = {k} times "
             "(claim 6; a measurement of memorisation, not a private release). A value: mean over seeds [95 % t "
             "interval]; A − B: mean [95 % interval], paired by seed where A and B have the same seeds (runs of "
             "one seed share their data order and noise draws across optimizers), else Welch's, and for a test "
             "accuracy counting the test records' noise too, paired on the same records (seeds: \"seeds + "
             "records\" from each run's per-record outcomes, records drawn per seed; \"seeds × records\" the "
             "same records for every seed; \"seeds + record floor\" for runs that did not record them: the least "
             "record noise their accuracies allow, a lower bound; \"paired\": seeds alone; n the test records "
             "per seed; never of width 0: at least the exact bound on records that differ when none is seen); "
             "claimed: the difference the paper reports. ties: where a configuration was chosen from a tie on "
             "the mean selection score (broken by the lower mean validation loss, then config order), the "
             "other choices the tie allowed and how many of them give another verdict; such a verdict is marked "
             "tie-sensitive. Verdict: holds (the interval excludes 0 on the claimed side and "
             "reaches the claimed size), direction only (excludes 0 on the claimed side, short of the size), not "
             "supported (contains 0), reversed (excludes 0 on the other side); for claim 6c, of no difference, "
             "no difference found (contains 0; not a proof of equality) or differs; – with fewer than two seeds, "
             "a diverged configuration or an interval of width 0 (no noise measured). The papers fine-tune BERT-, RoBERTa- or GPT-2-sized models for "
             f"epochs on QNLI and GLUE; this study fine-tunes {SCALE.get(problem, problem + ' from its start')} "
             f"{scale}, so a verdict here is about this scale only. "
             "The choice of each configuration spent privacy of its own (ε_sel in finetune_table), which the ε here does not include.", "",
             "| " + " | ".join(HEAD) + " |",
             "| " + " | ".join("---" if h in ("claim", "mode", "A", "B", "verdict") else "---:" for h in HEAD) + " |"]
    for claim in CLAIMS:
        rows = data.get(claim.number, [])
        if not rows:
            lines.append(f"| {claim.number} ({claim.paper}): {claim.text} | " + " | ".join(["–"] * (len(HEAD) - 2))
                         + " | not run |")
        for r in rows:
            lines.append("| " + " | ".join(str(r[h]) for h in HEAD) + " |")
    size = draw_sizing(sizing(data))
    return "\n".join(lines) + "\n" + ("\n" + size if size else "")


TARGET = 0.02  # the half-width a study's differences should reach: ±2 points of accuracy


def sizing(data: dict[str, list[dict]], target: float = TARGET) -> list[dict]:
    """Per row of ``claims_data`` whose interval counted test records: its variance components
    (``Contrast.components``, the study as a pilot), its half-width now, and the seeds needed at
    its test records per seed and the test records per seed needed at its seeds for a 95 %
    interval within ± ``target`` (``intervals.seeds_needed``, ``records_needed``; None: not
    reachable that way). From runs without per-record outcomes the record variance is a lower
    bound and the counts estimates under it (``lower_bound``: the fallback interval)."""
    out = []
    for claim in CLAIMS:
        for r in data.get(claim.number, []):
            ct = r.get("contrast")
            if ct is None or ct.components is None or not ct.records:
                continue
            comp = ct.components
            out.append({"claim": claim.number, "problem": r["problem"], "ε": r["ε"], "mode": r["mode"],
                        "A": r["A"], "B": r["B"], "half_width": (ct.high - ct.low) / 2, "seeds": ct.n,
                        "records": ct.records, "var_seed": comp.seed, "var_record": comp.record,
                        "var_residual": comp.residual, "shared": comp.shared,
                        "seeds_needed": seeds_needed(comp, ct.records, target, scale=ct.scale),
                        "records_needed": records_needed(comp, ct.n, target, scale=ct.scale),
                        "lower_bound": ct.how == "seeds + record floor"})
    return out


def draw_sizing(rows: list[dict], target: float = TARGET) -> str:
    """``sizing`` as Markdown: a section after the claims table."""
    if not rows:
        return ""
    lines = [f"## Sizing: seeds and test records for a 95 % interval within ±{target:.3f}", "",
             "Each row above whose interval counted test records, as a pilot: its variance components per "
             "seed and record (s²_seed: between seeds beyond the record noise; s²_record: of the records shared "
             "by every seed; s²_residual: per record within a seed), its half-width now, and the seeds needed at "
             "its test records per seed, or the test records per seed needed at its seeds, for a half-width of "
             f"at most {target:.3f} (– : not reachable that way; dpbench.reporting.figures.intervals."
             "seeds_needed, records_needed). Marked ~: runs without per-record outcomes, whose record variance "
             "(s²_residual) is the least their accuracies allow: the counts are estimates under that floor, "
             "not bounds (the seeds needed at the same records per seed do not depend on it where s²_seed > "
             "0; the records needed do). Runs that record their outcomes remove the mark.", "",
             "| claim | problem | ε | mode | A | B | ± now | seeds × records | s²_seed | s²_record | s²_residual "
             "| seeds needed | records needed |",
             "| --- | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        mark = "~ " if r["lower_bound"] else ""

        def count(v):
            return "–" if v is None else f"{mark}{v:,}"

        lines.append(f"| {r['claim']} | {r['problem']} | {r['ε']} | {r['mode']} | {r['A']} | {r['B']} | "
                     f"{r['half_width']:.3f} | {r['seeds']} × {r['records']} | {r['var_seed']:.2e} | "
                     f"{r['var_record']:.2e} | {mark}{r['var_residual']:.2e} | {count(r['seeds_needed'])} | "
                     f"{count(r['records_needed'])} |")
    return "\n".join(lines) + "\n"


def finetune_claims(runs: pd.DataFrame, select_by: str = "val", k: int = 25, filters: dict | None = None,
                    problem: str = "P6") -> str:
    runs = select_runs(runs, filters)
    return draw_claims_table(claims_data(runs, select_by, k, problem), k, select_by, problem, regime(runs, problem))
