"""A grid block's ``tuning``: the candidate cells of its hyperparameter searches (drawn by
dpbench.privacy.tuning) and the part of a cell id that names the search and the candidate."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from dpbench.privacy.tuning import Candidate, draw_candidates


def id_part(tuning: tuple[tuple[str, Any], ...]) -> str:
    """``-tune<search>-k<K>c<j>`` for candidate j of K (e.g. -tunenb3x1-k4c2), "" for a plain cell."""
    return Candidate.parse(dict(tuning), drawn=True).id_part if tuning else ""


def candidates(search: dict[str, Any], seed: int, settings: Sequence[tuple[float, tuple]], names: Iterable[str],
               where: str, config: dict[str, Any], spec) -> list[tuple[int, int, tuple]]:
    """A search's candidates (dpbench.privacy.tuning.draw_candidates) among ``settings`` (each
    its learning rate and its hyperparameters' values, in the order of ``names``) of optimizer
    ``spec``: (setting index, seed, the cell's tuning pairs) each, or a ValueError whose message
    starts with the key's path; refused as a run refuses it (dpbench.training.tuning.check_search),
    and where the settings differ in a hyperparameter the mechanism plans with (their candidates
    would not share one accounted event). K
    is drawn from the seed of the search's seed index, so the same in every block, optimizer and
    epsilon of that index (common random numbers, like the seeds)."""
    from dpbench.training.tuning import check_search

    distribution, choices = search["distribution"], len(settings)
    if distribution == "composition":
        if search.get("mean") not in (None, choices):
            raise ValueError(f"config key {where}.mean: composition runs each of the {choices} settings once; "
                              f"leave out mean (got {search['mean']})")
        mean = choices
    elif "mean" not in search:
        raise ValueError(f"config key {where}.mean: a {distribution} search needs the mean number of candidates")
    else:
        mean = search["mean"]
    try:
        how = check_search({**search, "mean": mean}, spec, (config.get("train") or {}).get("validation_size") or 0,
                           [dict(zip(tuple(names), values)) for _, values in settings])
        drawn = draw_candidates(how, seed, choices)
    except ValueError as exc:
        raise ValueError(f"config key {where}: {exc}") from None
    record = how.record()
    return [(i, candidate_seed, tuple(sorted({**record, "repetitions": len(drawn), "candidate": j}.items())))
            for j, (i, candidate_seed) in enumerate(drawn)]
