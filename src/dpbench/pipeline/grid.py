"""The experiment grid: a readable config expanded into training cells, in one place.

A config's ``grid`` is a list of blocks. Each block is a product over its axes (problems x optimizers x each
optimizer's learning rates and hyperparameters x batch sizes x epsilons x epochs x seeds); cells that several
blocks share run once. Non-private optimizers ignore epsilon. Seeds are derived from ``root_seed`` with numpy's SeedSequence,
so seed i is the same integer in every block and every setup.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import re
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from dpbench.pipeline.configfile import ConfigError, check_configfiles, configfiles_of, read_yaml  # noqa: F401
from dpbench.pipeline.configfile import closest as _closest
from dpbench.pipeline import blocks, catalog, searches
from dpbench.pipeline.blocks import BLOCK_SETTINGS, block_settings, check_train_data  # noqa: F401
from dpbench.pipeline.starts import CONTEXT, SCRATCH, TextData, pretrain_recipe, starts_of, text_data  # noqa: F401
from dpbench.problems import facts
from dpbench.problems.modes import Start
from dpbench.training.config import RunConfig
from dpbench.training.recipes import Recipe


# The config schema ships inside the package (package data), so an installed dpbench validates
# a config wherever it is; the workflow validates through this module too.
SCHEMA_PATH = resources.files("dpbench.pipeline") / "config.schema.yaml"


def fmt(x: float) -> str:
    """The form of a number in cell ids: the short ``%g`` form where it reads back as the same
    number (0.001, 1e-05, 10.0 -> 10), else the shortest exact one (0.1000001), so that two
    values never share an id and an id's number is exactly the cell's."""
    if isinstance(x, bool):
        return "true" if x else "false"
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


@dataclass(frozen=True, order=True)
class Cell:
    problem: str
    optimizer: str
    batch_size: int
    epochs: int
    epsilon: float | None  # None: non-private
    lr: float
    seed_index: int
    seed: int
    hyperparameters: tuple[tuple[str, Any], ...] = ()
    tuning: tuple[tuple[str, Any], ...] = ()  # a search's candidate (pipeline.searches): its pairs
    # a problem that starts from a public checkpoint (its facts name one): where the cell starts
    # (dpbench.problems.modes.Start: a fine-tuning mode, or its twin trained from random
    # initialisation); None for the problems that train from scratch only (P1-P4), whose ids
    # have no -ft part
    start: Start | None = None
    recipe: Recipe | None = None  # the pretraining recipe of the checkpoint a fine-tuning cell reads
    # its block's own values of BLOCK_SETTINGS where they differ from the config's train: section,
    # (key, value) pairs in BLOCK_SETTINGS' order; () where the cell's run takes train:'s values
    train_settings: tuple[tuple[str, Any], ...] = ()
    # an encoder problem's fine-tuning cell reading the config's text_file (starts.TextData): its
    # records, N and classes are the file's; None: the problem's own records
    data: TextData | None = None

    @property
    def facts(self):
        """The problem's facts (``dpbench.problems.facts``), with the records of ``data`` where given."""
        f = facts(self.problem)
        return f if self.data is None else self.data.facts(f)

    @property
    def id(self) -> str:
        eps = "nonprivate" if self.epsilon is None else f"eps{fmt(self.epsilon)}"
        hp = "".join(f"-{k}{fmt(v) if isinstance(v, (int, float)) else v}" for k, v in self.hyperparameters)
        return (f"{self.problem}/{self.optimizer}/L{self.batch_size}-E{self.epochs}-{eps}-lr{fmt(self.lr)}{hp}"
                f"{searches.id_part(self.tuning)}{self.finetune_part}{self.settings_part}-s{self.seed_index}")

    @property
    def settings_part(self) -> str:
        """The id's part of the block's own train settings (``blocks.id_part``): ``-ntrain4000``."""
        return blocks.id_part(self.train_settings)

    def train_section(self, train: dict[str, Any] | None) -> dict[str, Any]:
        """The config's ``train`` section as this cell's run has it: its block's own settings
        (``train_settings``) over it. Everything that reads a cell's N, steps, subsets or
        validation split reads them from here."""
        return {**(train or {}), **dict(self.train_settings)}

    @property
    def finetune_part(self) -> str:
        """The id's part of the start (``Start.id_part``): ``-ftfull``, ``-ftlora16``, ``-ftscratch``; empty where none is set."""
        return "" if self.start is None else self.start.id_part

    @property
    def fine_tunes(self) -> bool:
        """Whether the cell starts from a public checkpoint (a mode, not the scratch twin)."""
        return self.start is not None and self.start.public

    @property
    def trainable_parameters(self) -> int:
        """d, the parameters this cell trains, which a matrix mechanism's noise rows are as wide
        as: under a fine-tuning mode, of the public start's model (``ProblemFacts.trainable``);
        from scratch, the problem's own model (``ProblemFacts.parameters``)."""
        f = self.facts
        if not self.fine_tunes:
            return f.parameters
        return f.trainable(None if self.recipe is None else self.recipe.model_dims, self.start.mode)

    @property
    def dataset(self) -> str:
        return self.facts.dataset

    def n_train(self, train: dict[str, Any]) -> int:
        """N, the examples the run trains on: the official training set (or its ``train_subset``)
        less the ``validation_size`` held out before batches are cut, plus the canary copies a
        language-model run plants (they are training records: q = L / N counts them); counted
        by ``catalog.training_examples``, as the run counts its own. ``train``: the config's
        section, which the cell's own settings override (``train_section``)."""
        train = self.train_section(train)
        return self.facts.n_train(train.get("train_subset"), train.get("validation_size") or 0)

    def cache_files(self, train: dict[str, Any], cache_dir: str | Path) -> dict[str, Path]:
        """The cached files this cell's run reads, under ``cache_dir`` (nothing is computed here),
        as its mechanism declares them (``files``: dpbench.mechanisms.files, read from the torch-free
        catalog): a dense matrix mechanism's factorization and noise file, a streamed mechanism's
        factorization (it writes no noise file), nothing for the other optimizers."""
        from dpbench.mechanisms.base import PlanRequest
        from dpbench.privacy import accounting

        files = catalog.optimizer(self.optimizer).files
        if files is None:
            return {}
        request = PlanRequest(self.n_train(train), self.batch_size, self.epochs,
                              hyperparameters=dict(self.hyperparameters), target_epsilon=self.epsilon,
                              delta=train.get("delta", accounting.DELTA), cache_dir=Path(cache_dir))
        return files.paths(request, cache_dir, self.trainable_parameters, self.seed)

    def run_config(self, train: dict[str, Any]) -> RunConfig:
        """The settings of this cell's run under the config's ``train`` section (whose keys are
        RunConfig's ``train`` settings: the schema and RunConfig are held to each other), with
        its block's own settings over it (``train_section``)."""
        return RunConfig(problem=self.problem, optimizer=self.optimizer, lr=self.lr, batch_size=self.batch_size,
                         epochs=self.epochs, seed=self.seed, epsilon=self.epsilon,
                         hyperparameters=dict(self.hyperparameters), tuning=dict(self.tuning) or None,
                         **(self.start.settings() if self.fine_tunes else Start().settings()),
                         **(self.data.settings() if self.data is not None else {}),
                         **self.train_section(train))

    def train_args(self, train: dict[str, Any]) -> list[str]:
        """The ``dpbench train`` arguments of this cell under the config's ``train`` section."""
        return self.run_config(train).to_args()


def seeds_from_root(root_seed: int, n: int) -> list[int]:
    """The first n seeds of the root seed: distinct, non-overlapping SeedSequence streams."""
    return [int(c.generate_state(1)[0]) for c in np.random.SeedSequence(root_seed).spawn(n)]


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def load_config(path: str | Path) -> dict[str, Any]:
    """Reads a YAML config (``read_yaml``), validates it against the JSON schema and fills in
    defaults; every error is one line naming the key and the file."""
    config = read_yaml(path)
    try:
        return validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({path})") from None


# Deployment settings that configs no longer hold: where each went.
MOVED_TO_PROFILE = {
    ("software_env",): "the profile chooses the training environment: envs/train-cuda.yaml where it gives "
                       "rule train a GPU (set-resources: train: gpu: 1), envs/train-cpu.yaml otherwise",
    ("train", "device"): "the profile chooses the device: cuda where it gives rule train a GPU "
                         "(set-resources: train: gpu: 1), cpu otherwise",
    ("train", "threads"): "set the torch threads of training jobs in the profile (set-threads: train: N) "
                          "or on the command line (--set-threads train=N)",
}


def refuse_deployment_keys(config: dict[str, Any]) -> None:
    """A config that still sets a deployment key is refused with where that setting lives now
    (the workflow calls this before its schema validation, whose message would only say
    "unexpected")."""
    for path, where in MOVED_TO_PROFILE.items():
        section = config.get(path[0]) if len(path) > 1 else config
        if isinstance(section, dict) and path[-1] in section:
            raise ConfigError(f"config key {'.'.join(path)}: deployment settings are not config keys; "
                              f"{where} (see workflow/profiles and config/README.md)")


def refuse_non_finite(value: Any, path: str = "") -> None:
    """No key takes an infinite or NaN number (YAML's .inf, .nan), which JSON schema's bounds
    let through (NaN compares false with every bound): refused naming the key."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key {path or '<top level>'}: {value} is not a finite number")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        refuse_non_finite(item, f"{path}.{key}" if path else str(key))


def precheck(config: dict[str, Any]) -> None:
    """The checks that come before schema validation, whose messages would be less precise:
    deployment keys (where each went) and non-finite numbers."""
    refuse_deployment_keys(config)
    refuse_non_finite(config)


def config_schema() -> dict[str, Any]:
    """The config schema (``SCHEMA_PATH``) with a grid block's keys of its own train settings
    (``BLOCK_SETTINGS``, from RunConfig's declarations) made from train:'s: the same values
    and no default, since a block that leaves one out takes train:'s value."""
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    train = schema["properties"]["train"]["properties"]
    block = schema["properties"]["grid"]["items"]["properties"]
    for key in BLOCK_SETTINGS:
        own = {k: v for k, v in train[key].items() if k not in ("default", "description")}
        block[key] = {**own, "description": f"this block's train.{key} (a value that differs from train's is "
                                            "part of its cells' ids)"}
    return schema


def validate(config: dict[str, Any]) -> dict[str, Any]:
    """Schema validation with defaults filled in, then the checks a schema cannot express."""
    import jsonschema

    precheck(config)

    schema = config_schema()
    validator_cls = jsonschema.validators.extend(
        jsonschema.Draft202012Validator,
        {"properties": _set_defaults(jsonschema.Draft202012Validator.VALIDATORS["properties"])},
    )
    errors = sorted(validator_cls(schema).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    if errors:
        raise _schema_error(errors[0])
    check_results_dir(config["results_dir"])
    check_figure_ids(config)
    if (config.get("pretrain") or {}).get("recipe") is not None:
        pretrain_recipe(config, None)
    cells = expand(config)  # semantic checks: optimizer names, hyperparameter names, data sizes, batch sizes
    check_figures(config, cells)
    return config


def check_results_dir(results_dir: str) -> None:
    """Every output goes under ``results_dir``: an empty one would put them at the filesystem's
    top (``/runs``, ``/logs``, ...; the workflow runs as root on many machines), as would the
    root itself: both refused; and a path starting with ``~``, which nothing expands."""
    if results_dir.startswith("~"):
        raise ConfigError(f"config key results_dir: {results_dir!r} starts with ~, which is not expanded (the outputs "
                          f"would go to a folder named ~ here): give the path itself, e.g. {os.path.expanduser(results_dir)!r}")
    if not results_dir.strip():
        raise ConfigError("config key results_dir: empty; every output would be written at the filesystem's "
                          "top (/runs, /logs, ...): give a directory, e.g. results")
    if Path(results_dir).resolve() == Path(Path(results_dir).resolve().anchor):
        raise ConfigError(f"config key results_dir: {results_dir!r} is the filesystem root; every output would "
                          "be written at its top (/runs, /logs, ...): give a directory below it, e.g. results")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _schema_error(e) -> ConfigError:
    """One line for a schema violation: the key's path and the problem, never the schema."""
    import jsonschema

    # oneOf/anyOf: the alternative that came closest, described by the key's own description
    # (e.g. "auto or a positive integer"), which a single alternative does not carry
    described = e.schema.get("description") if e.context and isinstance(e.schema, dict) else None
    if e.context:
        e = jsonschema.exceptions.best_match(e.context)
    path = [str(p) for p in e.absolute_path]
    key = ".".join(path) or "<top level>"
    schema = e.schema if isinstance(e.schema, dict) else {}
    if e.validator == "additionalProperties":
        allowed = list(schema.get("properties", {}))
        extra = sorted(str(k) for k in e.instance if k not in allowed)
        name = ".".join([*path, extra[0]])
        return ConfigError(f"config key {name}: unknown key ({_closest(extra[0], allowed)})")
    if "propertyNames" in e.absolute_schema_path and key == "figures":
        return ConfigError(f"config key figures.{e.instance}: unknown figure "
                           f"({_closest(e.instance, catalog.figure_names())})")
    if e.validator == "required":
        return ConfigError(f"config key {key}: {e.message}")
    if described:
        return ConfigError(f"config key {key}: {_short(e.instance)} is not valid ({described.strip()})")
    if e.validator in ("enum", "const"):
        choices = e.validator_value if e.validator == "enum" else [e.validator_value]
        return ConfigError(f"config key {key}: {_short(e.instance)} is not one of the choices "
                           f"({_closest(e.instance, choices)})")
    what = f" ({schema['description'].strip()})" if schema.get("description") else ""
    message = e.message if len(e.message) <= 200 else e.message[:197] + "..."
    return ConfigError(f"config key {key}: {message}{what}")


def check_figure_ids(config: dict[str, Any]) -> None:
    """Each figure is a built-in's or an installed plugin's (``dpbench.pipeline.catalog``);
    a broken plugin's id is its one-line error. An entry named otherwise draws the figure its
    option ``figure`` names (``catalog.drawn_figure``): a second drawing of a figure."""
    for name, options in (config.get("figures") or {}).items():
        figure = catalog.drawn_figure(name, options)
        key = f"figures.{name}" + (".figure" if "figure" in (options or {}) else "")
        if not isinstance(figure, str):
            raise ConfigError(f"config key {key}: {_short(figure)} is not a figure id")
        if figure != name and catalog.is_figure(name):
            raise ConfigError(f"config key {key}: {name} is itself a figure; a second drawing of {figure} "
                              "needs a name of its own")
        if not catalog.is_figure(figure):
            raise ConfigError(f"config key {key}: " + str(catalog.figure_error(figure) or (
                f"unknown figure ({_closest(figure, catalog.figure_names())})")))


def check_figures(config: dict[str, Any], cells: list[Cell]) -> None:
    """Each figure's options against what the figure takes and what the grid produces: no
    unknown option, ``select_by: val`` only with a validation split, and the problems and
    optimizers it draws trained by the grid (else it would be an empty figure)."""
    figures_config = config.get("figures") or {}
    if not figures_config or not cells:
        return  # an audit-only config: the workflow refuses figures other than 'audit' itself
    from dpbench.reporting.figure_options import check_options, validation_needed

    problems = sorted({c.problem for c in cells})
    optimizers = sorted({c.optimizer for c in cells})
    train = config.get("train") or {}
    for name, options in figures_config.items():
        figure = catalog.drawn_figure(name, options)
        if not catalog.is_figure(figure) or catalog.figure(figure).table != "runs":
            continue  # drawn from the audits: the workflow checks that there are audits
        spec = catalog.figure(figure)
        options = {k: v for k, v in options.items() if k != "figure"}
        try:
            check_options(figure, spec.options, options)
        except ValueError as exc:
            raise ConfigError(f"config key figures.{name}: {exc}") from None
        merged = {**spec.defaults, **options}
        need = validation_needed(figure, spec.defaults, spec.needs_validation, options)
        drawn = _as_list(merged["problem"]) if "problem" in merged else merged.get("problems")
        # the cells it may draw (of its problems; all where it draws none, refused below) and which
        # of them have no validation split (their block's validation_size, else train:'s)
        shown = [c for c in cells if drawn is None or c.problem in drawn] or cells
        without = [c for c in shown if not c.train_section(train).get("validation_size")]
        if need and without:
            where = "there is none" if len(without) == len(shown) else (
                f"cells of {without[0].id.split('/')[0]} have none, e.g. {without[0].id}")
            raise ConfigError(f"config key figures.{name}{'.' * bool(need[0])}{need[0]}: {need[1]}, and {where} "
                              "(set train.validation_size" + (")" if len(without) == len(shown) else
                                                               ", or their grid block's validation_size)"))
        if drawn is not None and not set(drawn) & set(problems):
            which = "problem" if "problem" in merged else "problems"
            given = "" if which in options else " (its default)"
            raise ConfigError(f"config key figures.{name}.{which}: {_short(merged[which])}{given} is not trained by "
                              f"the grid (its problems: {', '.join(problems)}): the figure would be empty")
        epsilons = {c.epsilon for c in cells if c.epsilon is not None}
        if merged.get("epsilons") is not None and not {float(e) for e in _as_list(merged["epsilons"])} & epsilons:
            given = "" if "epsilons" in options else " (its default)"
            raise ConfigError(f"config key figures.{name}.epsilons: {_short(merged['epsilons'])}{given} is not trained "
                              f"by the grid (its epsilons: {', '.join(map(fmt, sorted(epsilons))) or 'none'}): the "
                              "figure would be empty")
        if "min_seeds" in spec.options:
            need = merged.get("min_seeds", spec.min_seeds)
            seeds: dict = {}
            for c in cells:
                seeds.setdefault(c.id.rsplit("-s", 1)[0], set()).add(c.seed_index)
            most = max(len(v) for v in seeds.values())
            if most < need:
                raise ConfigError(f"config key figures.{name}.min_seeds: the figure needs {need} seeds of a setting and "
                                  f"the grid trains at most {most}: the figure would be empty")
        if merged.get("optimizers") and not set(merged["optimizers"]) & set(optimizers):
            raise ConfigError(f"config key figures.{name}.optimizers: none of {merged['optimizers']} is trained by "
                              f"the grid (its optimizers: {', '.join(optimizers)}): the figure would be empty")


def _set_defaults(properties_validator):
    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
        yield from properties_validator(validator, properties, instance, schema)

    return set_defaults


def expand(config: dict[str, Any]) -> list[Cell]:
    """All training cells of a config, deduplicated, in a stable order."""
    cells: dict[str, Cell] = {}
    for b, block in enumerate(config.get("grid", [])):
        where = f"grid.{b}"
        n_seeds = block.get("seeds", 1)
        seed_indices = list(range(n_seeds)) if isinstance(n_seeds, int) else list(n_seeds)
        if max(seed_indices) >= MAX_SEEDS:
            raise ConfigError(f"config key {where}.seeds: seed index {max(seed_indices)} is not below {MAX_SEEDS}, the "
                              "seeds a grid derives from root_seed")
        seeds = seeds_from_root(config.get("root_seed", 0), max(seed_indices) + 1)
        overrides = block_settings(config, block)  # the block's own train settings: its cells' runs take them
        block_config = {**config, "train": {**(config.get("train") or {}), **dict(overrides)}}
        for i, problem in enumerate(block["problems"]):
            if not catalog.is_problem(problem):  # a broken plugin's id: its one-line error
                from dpbench.problems import PROBLEMS

                raise ConfigError(f"config key {where}.problems.{i}: " + str(PROBLEMS.error(problem) or (
                    f"unknown problem {problem!r} (choose from {sorted(PROBLEMS)})")))
        for name, settings in block["optimizers"].items():
            if not catalog.is_optimizer(name):  # the torch-free catalog (plugins: the registry)
                raise ConfigError(f"config key {where}.optimizers.{name}: " + str(catalog.optimizer_error(name) or (
                    f"unknown optimizer (choose from {catalog.optimizer_names()})")))
            spec = catalog.optimizer(name)
            settings = dict(settings)
            lrs = _as_list(settings.pop("lr"))
            hp_axes = {k: _as_list(v) for k, v in sorted(settings.items())}
            for key, values in hp_axes.items():
                for value in values:
                    try:
                        spec.hyperparameters({key: value})
                    except ValueError as exc:
                        raise ConfigError(f"config key {where}.optimizers.{name}: {exc}") from None
                    if isinstance(value, str) and not _ID_WORD.fullmatch(value):
                        raise ConfigError(f"config key {where}.optimizers.{name}.{key}: {value!r} cannot be part of "
                                          f"a cell id (letters, digits and _ . + - only)")
            epsilons = [None] if not spec.private else [float(e) for e in block.get("epsilons", [])]
            if not epsilons:
                raise ConfigError(f"config key {where}.epsilons: private optimizer {name!r} needs at least one epsilon")
            data = {p: text_data(config) if facts(p).family == "bert-encoder" else None for p in block["problems"]}
            for problem, L in itertools.product(block["problems"], block["batch_sizes"]):
                check_train_data(config, problem, block, where, None if data[problem] is None
                                 else data[problem].facts(facts(problem)))
                probe = Cell(problem, name, int(L), 1, None, 1.0, 0, 0, train_settings=overrides, data=data[problem])
                n = probe.n_train(config.get("train") or {})
                if L > n:
                    after = "train_subset and validation_size of train: and the block" if overrides else (
                        "train.train_subset and validation_size")
                    raise ConfigError(f"config key {where}.batch_sizes: batch size {L} is above the {n} training "
                                      f"examples of {problem} (after {after})")
            starts = {problem: starts_of(config, block, where, problem) for problem in block["problems"]}
            settings = [(lr, hp) for lr in lrs for hp in itertools.product(*hp_axes.values())]
            search = block.get("tuning") if spec.private else None
            for problem, L, E, eps, s in itertools.product(block["problems"], block["batch_sizes"], block["epochs"],
                                                          epsilons, seed_indices):
                try:  # a search's candidates (settings drawn, seeds their own), or every setting at the cell's seed
                    runs = (searches.candidates(search, seeds[s], settings, hp_axes, f"{where}.tuning", block_config,
                                                catalog.optimizer_spec(name)) if search
                            else [(i, seeds[s], ()) for i in range(len(settings))])
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
                for i, seed, tuning in runs:
                    lr, hp = settings[i]
                    # a hyperparameter at its default is the cell that leaves it out: one cell, one id
                    given = tuple((k, v) for k, v in zip(hp_axes, hp) if not _same(v, spec.defaults[k]))
                    for start in starts[problem]:
                        cell = Cell(problem, name, int(L), int(E), eps, float(lr), s, seed, given, tuning, *start,
                                    train_settings=overrides, data=data[problem] if start[0] and start[0].public
                                    else None)
                        other = cells.setdefault(cell.id, cell)
                        if other != cell:
                            raise ConfigError(f"config key {where}.optimizers.{name}: {_difference(other, cell)} "
                                              f"give the same cell id {cell.id!r}; give values that differ in the id")
    return sorted(cells.values(), key=lambda c: c.id)


MAX_SEEDS = 10_000  # seed indices below it: deriving them all from root_seed takes a fraction of a second
_ID_WORD = re.compile(r"[A-Za-z0-9_.+-]+")



def _same(value: Any, default: Any) -> bool:
    """Whether a given hyperparameter value is its default (1 and 1.0 are; 1 and true are not)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    numbers = isinstance(value, (int, float)) and isinstance(default, (int, float))
    return (numbers or type(value) is type(default)) and value == default


def _difference(a: Cell, b: Cell) -> str:
    """The values in which two cells with the same id differ, e.g. "bands values '8' and 8":
    each field of ``Cell``, its pairs (hyperparameters, block settings) one by one."""
    pairs = []
    for f in fields(Cell):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("hyperparameters", "train_settings"):
            x, y = dict(x), dict(y)
            pairs += [(k, x.get(k), y.get(k)) for k in sorted(set(x) | set(y))]
        else:
            pairs.append((f.name, x, y))
    return ", ".join(f"{k} values {x!r} and {y!r}" for k, x, y in pairs if x != y or type(x) is not type(y))
