"""The figures: the registry ``FIGURES`` (figure id -> ``FigureSpec``) and how a figure is drawn
and written. Every figure is a pure function of an aggregated table (the runs table; the audits
table for ``audit``, whose spec names it): ``plot(figure_id, runs_path, out_stem, **options)`` reads the table, builds
the figure named by its id (a thesis figure's is its number) and writes ``<out_stem>.png`` and
``.pdf`` (a table: ``<out_stem>.md``).

One module per idea:

* ``selection``: which runs a figure is about, and the best run of a group (``select_by``);
* ``style``: the optimizers' names and privacy marks, their order and colours, the plot style;
* ``thesis``: thesis chapter 5 and Appendix B (comparison, seed sensitivity, heatmaps, best
  settings), each a data function (runs -> the numbers drawn) and a draw function;
* ``audit``: the empirical privacy audit;
* ``language_model``: the language model P4 (loss, canary exposure, a ranking table);
* ``tuning``: results at the privacy the whole hyperparameter search spent;
* ``finetune``: fine-tuning from a public checkpoint (P5, P6): per optimizer and ε one bar per
  fine-tuning mode, from scratch beside; the numbers as a table; P5's canary exposure per mode;
* ``finetune_claims``: the papers' headline claims on private fine-tuning tested one by one
  (differences with paired or Welch intervals, a verdict each);
* ``spec``: ``FigureSpec``, what the registry holds of a figure.

``FIGURES`` is a ``dpbench.plugins.Registry``: the built-ins below and, from its first read on,
the figures of installed plugins (entry points of the group ``dpbench.figures``, each naming a
``FigureSpec`` whose id is the entry point's name; docs/plugins.md). A figure is drawn from the
table its spec names (``table``: the runs table, or the audits table). The public names of the
modules above are importable from here too.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before any pyplot import (this package's modules import it)
from pathlib import Path  # noqa: E402
from typing import Iterable  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from dpbench.files import refuse_special  # noqa: E402
from dpbench.plugins import Registry  # noqa: E402
from dpbench.reporting import figure_options  # noqa: E402
# every public name of the modules, as the single module figures.py had them (callers import them from here)
from dpbench.reporting.figures.audit import audit_figure, draw_audit  # noqa: E402
from dpbench.reporting.figures.language_model import (  # noqa: E402
    LM_REPEATS, draw_lm_exposure, draw_lm_loss, draw_lm_ranking, lm_configurations, lm_exposure_data,
    lm_exposure_figure, lm_loss_data, lm_loss_figure, lm_ranking_data, lm_ranking_table)
from dpbench.reporting.figures.selection import (  # noqa: E402
    CONFIG_KEYS, by_privacy, privacy_epsilon, scored, select_best, select_runs, selection_columns)
from dpbench.reporting.figures.spec import GROUP, KINDS, FigureSpec, option_names  # noqa: E402
from dpbench.reporting.figures.style import (  # noqa: E402
    AUDIT_MARK, AXIS_LABELS, DATASETS, LABELS, NO_GUARANTEE_MARK, apply_style, empty_figure, fmt_tick, label,
    legend_labels, ordered, palette)
from dpbench.reporting.figures.tuning import tuning_data, tuning_figure, tuning_table  # noqa: E402
from dpbench.reporting.figures.finetune import (  # noqa: E402
    draw_finetune, draw_finetune_table, finetune_data, finetune_exposure_figure, finetune_figure, finetune_table)
from dpbench.reporting.figures.finetune_claims import claims_data, draw_claims_table, finetune_claims  # noqa: E402
from dpbench.reporting.figures.thesis import (  # noqa: E402
    THESIS_FILTERS, best_per_setting, best_settings_data, best_settings_figure, comparison_figure,
    draw_best_settings, draw_comparison, draw_heatmaps, draw_seed_sensitivity, heatmap_data, heatmap_figure,
    seed_sensitivity_data, seed_sensitivity_figure)

BUILT_IN = (
    FigureSpec("fig5_1", comparison_figure, "Setup 1: best test accuracy per optimizer and ε"),
    FigureSpec("fig5_2", comparison_figure, "Setups 2 & 3: matrix mechanisms, best utility per optimizer and ε",
               {"problems": ["P1", "P3", "P2"]}),
    FigureSpec("fig5_3", seed_sensitivity_figure, "Setup 1: seed sensitivity"),
    FigureSpec("fig5_4", heatmap_figure, "Setup 1, P1: best test accuracy over lr × batch size and lr × epochs",
               {"problem": "P1", "ys": ("batch_size", "epochs")}),
    FigureSpec("fig5_5", best_settings_figure, "Setup 1, P1: best epochs and lr per batch size", {"problem": "P1"}),
    FigureSpec("fig5_6", heatmap_figure, "Setup 2, P2: best test accuracy over lr × batch size", {"problem": "P2"}),
    FigureSpec("fig5_7", heatmap_figure, "Setup 3, P1: best test accuracy over lr × batch size", {"problem": "P1"}),
    FigureSpec("fig5_8", heatmap_figure, "Setup 3, P3: best log10 test loss over lr × batch size", {"problem": "P3"}),
    FigureSpec("figB_1", heatmap_figure, "Setup 1, P2: best test accuracy over lr × batch size and lr × epochs",
               {"problem": "P2", "ys": ("batch_size", "epochs")}),
    FigureSpec("figB_2", best_settings_figure, "Setup 1, P2: best epochs and lr per batch size", {"problem": "P2"}),
    # drawn from the audits table (results/audit/audits.parquet), not the runs table
    FigureSpec("audit", audit_figure, "Empirical privacy audit: claimed ε against the measured lower bound",
               table="audits"),
    # the language model (config/lm.yaml; Gong, Pavliv & Peng)
    # (each selects an optimizer's configuration on the validation loss, whatever its options)
    FigureSpec("lm_loss", lm_loss_figure, "P4: training and validation loss per optimizer and ε", {"problem": "P4"},
               needs_validation=True),
    FigureSpec("lm_exposure", lm_exposure_figure, "P4: canary exposure against ε per repetition count k",
               {"problem": "P4"}, needs_validation=True),
    FigureSpec("lm_ranking", lm_ranking_table, "P4: optimizers ranked by validation perplexity per ε",
               {"problem": "P4"}, kind="table", needs_validation=True),
    # results at the privacy the whole hyperparameter search spent (grid blocks with `tuning`)
    FigureSpec("tuning", tuning_figure, "Untuned, tuned by composition and tuned privately at the same total ε",
               {"problem": "P2", "select_by": "val"}),
    FigureSpec("tuning_table", tuning_table, "Untuned, tuned by composition and tuned privately: values, K, σ, total ε",
               {"problem": "P2", "select_by": "val"}, kind="table"),
    # fine-tuning from the public checkpoint (config/finetune.yaml; docs/finetune.md): each mode's
    # configuration chosen on validation among its own runs, the from-scratch twin beside
    FigureSpec("finetune", finetune_figure, "P6: test accuracy per optimizer, ε and fine-tuning mode, from scratch "
               "beside", {"problem": "P6", "select_by": "val"}),
    FigureSpec("finetune_table", finetune_table, "Fine-tuning modes against from scratch and non-private: values, "
               "intervals, gaps", {"problem": "P6", "select_by": "val"}, kind="table"),
    FigureSpec("finetune_exposure", finetune_exposure_figure, "P5: exposure of the k = 25 canaries per optimizer, ε "
               "and fine-tuning mode", {"problem": "P5", "select_by": "val"}),
    # the papers' claims (DP-AdamW, DiSK, Li et al. 2022, Yu et al. 2022, arXiv 2502.13313) tested on P6 and P5
    FigureSpec("finetune_claims", finetune_claims, "The papers' fine-tuning claims tested: differences, intervals, "
               "verdicts", {"select_by": "val", "problem": "P6"}, kind="table"),
)
FIGURES: Registry = Registry(GROUP, {spec.id: spec for spec in BUILT_IN})
THESIS_FIGURES = [f for f in FIGURES.builtins if f.startswith("fig")]
LM_FIGURES = [f for f in FIGURES.builtins if f.startswith("lm_")]  # the ones drawn from the runs table
FINETUNE_FIGURES = [f for f in FIGURES.builtins if f.startswith("finetune")]


def extensions(figure_id: str) -> tuple[str, ...]:
    """The files `plot` writes for a figure: ("png", "pdf"), or ("md",) for a table."""
    return ("md",) if FIGURES[figure_id].kind == "table" else ("png", "pdf")


def save(fig: Figure | str, out_stem: str | Path) -> tuple[Path, ...]:
    """Writes <stem>.png (200 dpi) and <stem>.pdf (vector, no creation date, so reruns give the
    same bytes) and closes the figure; a table (Markdown string) as <stem>.md. A .png/.pdf/.md
    suffix on `out_stem` is dropped."""
    stem = Path(out_stem)
    if stem.suffix in (".png", ".pdf", ".md"):
        stem = stem.with_suffix("")
    stem.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(fig, str):
        from dpbench.files import atomic_write

        md = stem.with_name(stem.name + ".md")
        atomic_write(md, lambda f: f.write(fig), mode="w")
        return (md,)
    png, pdf = stem.with_name(stem.name + ".png"), stem.with_name(stem.name + ".pdf")
    for out in (png, pdf):
        refuse_special(out)
    fig.savefig(png, dpi=200, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(pdf, bbox_inches="tight", metadata={"CreationDate": None, "Creator": None, "Producer": None})
    plt.close(fig)
    return png, pdf


def spec_of(figure_id: str) -> FigureSpec:
    """The spec of a figure id: a ValueError naming the known ones for an unknown id, the one-line
    ``dpbench.plugins.PluginError`` (a ValueError) of a plugin figure that failed to load."""
    if figure_id in FIGURES:
        return FIGURES[figure_id]
    raise FIGURES.error(figure_id) or ValueError(f"unknown figure {figure_id!r}; known: {', '.join(FIGURES)}")


def check_options(figure_id: str, options: dict) -> None:
    """Refuses an option the figure does not take (naming it and the closest one it does) and
    a ``select_by`` other than test or val, before any drawing (``figure_options.check_options``)."""
    figure_options.check_options(figure_id, option_names(spec_of(figure_id).build), options)


def validation_needed(figure_id: str, options: dict) -> tuple[str, str] | None:
    """Why the figure needs a validation split under ``options`` (``figure_options.validation_needed``),
    or None."""
    spec = spec_of(figure_id)
    return figure_options.validation_needed(figure_id, spec.defaults, spec.needs_validation, options)


def check_validation(figure_id: str, runs: pd.DataFrame, options: dict, where: str) -> None:
    """Refuses a figure that needs a validation split (``validation_needed``) when none of the
    runs it draws (those of its problem or problems) has one; no such runs: the figure says so."""
    need = validation_needed(figure_id, options)
    if need is None:
        return
    merged = {**spec_of(figure_id).defaults, **options}
    drawn = merged.get("problem") or merged.get("problems")
    if drawn is not None and "problem" in runs:
        runs = runs[runs["problem"].isin([drawn] if isinstance(drawn, str) else list(drawn))]
    if runs.empty:
        return
    n_val = runs["n_val"] if "n_val" in runs else runs.get("best_val_loss", pd.Series(dtype=float)).notna()
    if not (n_val > 0).any():
        option, why = need
        raise ValueError(f"{f'option {option}: ' if option else ''}{why}, and no run in {where} has one "
                         "(train with --validation-size)")


def build(figure_id: str, runs: pd.DataFrame, **options) -> Figure | str:
    """The figure `figure_id` (a key of FIGURES) of a runs table; options override the
    figure's defaults; filters="thesis" uses THESIS_FILTERS[figure_id]."""
    spec = spec_of(figure_id)
    check_options(figure_id, options)
    if isinstance(options.get("filters"), str):
        if options["filters"] != "thesis":
            raise ValueError(f"filters must be a dict or 'thesis', got {options['filters']!r}")
        if figure_id not in THESIS_FILTERS:
            raise ValueError(f"filters='thesis': {figure_id} is not a thesis figure ({', '.join(THESIS_FILTERS)})")
        options["filters"] = THESIS_FILTERS[figure_id]
    check_one_delta(figure_id, runs, {**spec.defaults, **options})
    apply_style()
    return spec.build(runs, **{**spec.defaults, **options})


def check_one_delta(figure_id: str, runs: pd.DataFrame, options: dict) -> None:
    """Refuses to draw private runs of different δ in one figure (those its filters, optimizers
    and problems select): figures show runs under their ε, and an ε at another δ is another
    guarantee, so pooling them would count them as seeds of one setting. Names the δs and the
    filter that draws one."""
    if not {"private", "delta"} <= set(runs.columns):
        return  # the audits' table: each audit is its own claim
    drawn = options.get("problems", options.get("problem"))
    chosen = select_runs(runs, options.get("filters") if isinstance(options.get("filters"), dict) else None,
                         options.get("optimizers"), None if drawn is None else
                         [drawn] if isinstance(drawn, str) else drawn)
    deltas = sorted(set(chosen.loc[chosen["private"].astype(bool), "delta"].astype(float).dropna()))
    if len(deltas) > 1:
        raise ValueError(f"{figure_id}: the runs have δ {', '.join(f'{d:g}' for d in deltas)}, and a figure shows "
                         "runs under their ε, which at another δ is another guarantee: draw one δ at a time "
                         f"(-o filter.delta={_yaml_float(deltas[0])})")


def _yaml_float(x: float) -> str:
    """``x`` as a YAML float that ``parse_options`` reads back as ``x`` (1.0e-05, not 1e-05,
    which YAML reads as a string)."""
    text = repr(float(x))
    return text if "e" not in text or "." in text.split("e")[0] else text.replace("e", ".0e", 1)


LIST_OPTIONS = ("ys", "epsilons", "optimizers", "problems", "modes")


def parse_options(items: Iterable[str]) -> dict:
    """Command-line options ``KEY=VALUE`` -> keyword arguments of `plot`: values are YAML
    scalars (``min_seeds=3``, ``select_by=val``); ``ys``, ``epsilons``, ``optimizers``,
    ``problems`` and ``modes`` take comma-separated lists; ``filter.COLUMN=v1,v2`` adds to ``filters``;
    ``filters=thesis`` uses THESIS_FILTERS."""
    import yaml

    options: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"figure option {item!r}: expected KEY=VALUE")
        if key.startswith("filter."):
            options.setdefault("filters", {})[key[len("filter."):]] = [yaml.safe_load(v) for v in value.split(",")]
        elif key in LIST_OPTIONS:
            options[key] = [yaml.safe_load(v) for v in value.split(",")]
        else:
            options[key] = yaml.safe_load(value)
    return options


def check_names(figure_id: str, runs: pd.DataFrame, options: dict, where: str) -> None:
    """Refuses an optimizer (``optimizers``) or fine-tuning mode (``modes``: ``lora`` takes
    every rank) that the table ``where`` does not hold, naming the option and the closest name
    it does: the figure would be drawn empty or without it."""
    import difflib

    from dpbench.reporting.figures.finetune import mode_name, mode_of

    present = {"optimizers": set(runs["optimizer"].dropna()) if "optimizer" in runs else set()}
    if "finetune" in runs:
        modes = {m for m in mode_of(runs) if m is not None}
        present["modes"] = modes | {mode_name(m) for m in modes}
    for option, names in present.items():
        for name in options.get(option) or ():
            if name not in names:
                close = difflib.get_close_matches(str(name), sorted(names), n=1, cutoff=0.5)
                hint = f"did you mean {close[0]!r}?" if close else f"it holds: {', '.join(sorted(names)) or 'none'}"
                raise ValueError(f"option {option} of figure {figure_id}: {name!r} is not in {where} ({hint})")


def supported_labels(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs table with ``private`` (and ``dp_guarantee``) kept only where the row's own
    numbers support it: epsilon finite and >= 0, delta in (0, 1), sigma > 0. ``dpbench
    aggregate`` refuses run files that contradict themselves; this holds a table edited after
    it to the same rule, so that no figure draws a run under a private label its numbers deny
    (such a row is drawn as not private)."""
    if "private" not in runs or not len(runs):
        return runs
    numbers = {c: pd.to_numeric(runs[c], errors="coerce").astype(float) if c in runs else pd.Series(np.nan, runs.index)
               for c in ("epsilon", "delta", "noise_multiplier")}
    supported = (np.isfinite(numbers["epsilon"]) & (numbers["epsilon"] >= 0) & (numbers["delta"] > 0)
                 & (numbers["delta"] < 1) & (numbers["noise_multiplier"] > 0))
    if "delta" not in runs or "noise_multiplier" not in runs:  # a table of another shape: the epsilon alone
        supported = np.isfinite(numbers["epsilon"]) & (numbers["epsilon"] >= 0)
    runs = runs.copy()
    runs["private"] = runs["private"].astype(bool) & supported
    if "dp_guarantee" in runs:
        runs["dp_guarantee"] = runs["dp_guarantee"].astype(bool) & runs["private"]
    return runs


def plot(figure_id: str, runs_path: str | Path, out_stem: str | Path, **options) -> tuple[Path, ...]:
    """Reads the aggregated runs table, draws figure `figure_id`, writes <out_stem>.png and
    .pdf (a table: <out_stem>.md); returns their paths."""
    runs = supported_labels(pd.read_parquet(runs_path))
    check_names(figure_id, runs, options, str(runs_path))
    check_validation(figure_id, runs, options, str(runs_path))
    return save(build(figure_id, runs, **options), out_stem)

