"""What a figure's number spent: a number chosen as the best of k candidate runs trained on the
same private data is published at the privacy of the k runs composed, not at one run's
(``dpbench.privacy.selection``). ``selection_privacy`` gives, for the runs a bar or a table row
chose among, k, the configurations and seeds among them, and that composed epsilon; ``caption``
says it under a figure, with the split that chose.

A run's accounted event is read from its row of the runs table, torch-free (figures never
import torch), only where the row determines it:

* ``accounted_history``, the event the run's own mechanism accounted its steps as (segments
  [sigma, q, n] of Poisson-subsampled Gaussian steps; ``dpbench.mechanisms.base.recorded_history``,
  written into every run record), where that mechanism is one of dpbench's classes
  (``mechanism_origin`` built-in): whatever the optimizer, plugins' included, and decaying
  noise schedules too;
* one Gaussian release (accountant ``analytic-gaussian ...``: the matrix mechanisms):
  mu is the one that is exactly (epsilon, delta)-DP;
* rows of runs recorded before ``accounted_history`` existed: the optimizers of
  ``POISSON_HISTORY`` (T steps at the recorded sigma and q) and amplified BandMF (ceil(T / b)
  steps at rate p = b L / N, b = p T / E), by id, as those built-ins were accounted.

Any other run (a plugin's own mechanism, a bound that may fail) has no composed epsilon here
(NaN, its optimizer named in the caption) rather than a guessed one.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import numpy as np
import pandas as pd

from dpbench.privacy import accounting, selection

# Rows recorded before accounted_history: the optimizers whose run is T steps of the
# Poisson-subsampled Gaussian at the recorded sigma and q (constant noise, no sensitivity bound
# that can fail). dpdice: its authors' claim.
POISSON_HISTORY = frozenset({"dpsgd", "opacus-dpsgd", "dpadam", "dpadambc", "dpadamw", "dpadamw-bc", "dpdisk",
                             "dpdice"})
CYCLIC_POISSON = frozenset({"dpmatrix-band-amp"})
# Beyond this many composed steps the PLD (about a minute per 10^4 steps on 2 busy cores) gives way to RDP.
PLD_MAX_STEPS = 20_000
EPS_ERROR = 0.05  # the PLD's rounding adds at most this much to a composed epsilon (pessimistic)


def run_history(row) -> accounting.History | None:
    """The accounted event of one run (a row of the runs table), or None where the row does not
    determine it."""
    if not bool(row.get("private", False)):
        return None
    # figures keep the achieved epsilon as achieved_epsilon (selection.by_privacy)
    eps = float(row["achieved_epsilon"] if "achieved_epsilon" in row else row.get("epsilon", math.nan))
    delta = float(row.get("delta", math.nan))
    if not (np.isfinite(eps) and eps > 0 and 0 < delta < 1):
        return None
    recorded = row.get("accounted_history")
    if isinstance(recorded, str) and row.get("mechanism_origin", "built-in") == "built-in":
        return [(float(s), float(q), int(n)) for s, q, n in json.loads(recorded)]
    accountant = str(row.get("accountant") or "")
    if accountant.startswith("analytic-gaussian"):
        return selection.gaussian_history(selection.gaussian_mu(eps, delta))
    if isinstance(recorded, str) or any(pd.isna(row.get(c)) for c in ("noise_multiplier", "sample_rate", "steps",
                                                                        "epochs")):
        return None  # a plugin's own mechanism; or a row that determines no event
    sigma, q, steps = float(row["noise_multiplier"]), float(row["sample_rate"]), int(row["steps"])
    if row["optimizer"] in POISSON_HISTORY and accountant in accounting.ACCOUNTANTS:
        return [(sigma, q, steps)]
    if row["optimizer"] in CYCLIC_POISSON and accountant in accounting.ACCOUNTANTS:
        epochs = int(row["epochs"])
        bands = max(1, round(q * steps / epochs))
        return [(sigma, q, -(-steps // bands))]
    return None


@lru_cache(maxsize=256)
def _composed(histories: tuple, delta: float) -> tuple[float, str]:
    total = sum(n for h in histories for _, _, n in h)
    accountant = "pld" if total <= PLD_MAX_STEPS else "rdp"
    return selection.composed_epsilon_of([list(h) for h in histories], delta, accountant, EPS_ERROR), accountant


SHARED_SEEDS = "candidates share seeds"


def selection_privacy(candidates: pd.DataFrame, config_keys: list[str]) -> dict:
    """For the runs one number was chosen among: ``k`` (runs composed), ``n_configs`` (settings
    other than the seed), ``n_seeds``, ``selection_epsilon`` (the k runs composed at their delta;
    NaN where a run's event is not in the table, the runs are not private, or configurations
    share a seed), ``selection_accountant`` and ``not_composed`` (what prevented it: the
    optimizers without an event, or ``SHARED_SEEDS``). Candidates of different configurations
    on the same seed draw the same noise and batches: the composition theorems assume
    independent randomness, and two such runs released together can cancel their noise (their
    difference is a noiseless function of the data), so no composed epsilon is claimed for them."""
    keys = [k for k in config_keys if k in candidates.columns]
    out = {"k": len(candidates), "n_configs": len(candidates.drop_duplicates(keys)) if keys else len(candidates),
           "n_seeds": int(candidates["seed"].nunique()) if "seed" in candidates else 1,
           "selection_epsilon": math.nan, "selection_accountant": "", "not_composed": ""}
    if candidates.empty or not candidates["private"].astype(bool).all():
        return out
    if "seed" in candidates and keys and candidates.drop_duplicates([*keys, "seed"])["seed"].duplicated().any():
        # configurations run on one seed share their noise and batches: composition needs
        # independent randomness, and releasing both can cancel the noise; no bound holds
        out["not_composed"] = SHARED_SEEDS
        return out
    histories = [run_history(r) for _, r in candidates.iterrows()]
    if any(h is None for h in histories):
        out["not_composed"] = ", ".join(sorted(set(candidates["optimizer"])))
        return out
    # candidates at different deltas: at the smallest (the composed epsilon is larger there)
    delta = float(candidates["delta"].astype(float).min())
    eps, accountant = _composed(tuple(sorted(tuple(h) for h in histories)), delta)
    out.update(selection_epsilon=eps, selection_accountant=accountant)
    return out


def split_words(select_by: str) -> str:
    """How the figure chose, for its caption; choosing on test is said to be optimistic."""
    if select_by == "val":
        return "chosen on the validation split"
    if select_by == "test":
        return "chosen on the TEST split (optimistic: the test set both chooses and reports)"
    return f"chosen by {select_by}"


def caption(select_by: str, n_seeds: int, interval: str | None = None, extra: str = "") -> str:
    """The caption line every selecting figure carries: which split chose, the seeds and
    what the interval is, and what the selection epsilon means."""
    seeds = ("one seed: no interval" if n_seeds <= 1 else
             f"{n_seeds} seeds: mean and {interval or 'its 95 % interval'}")
    return (f"Each number is the best configuration among k candidate runs (every setting and seed of its cell), "
            f"{split_words(select_by)}; {seeds}. ε_sel: the privacy of that choice, the k runs on the same data "
            "composed (PLD, at the runs' δ); none (–) where candidates of different settings share a seed (the "
            "same noise: composition does not bound them)." + (f" {extra}" if extra else ""))
