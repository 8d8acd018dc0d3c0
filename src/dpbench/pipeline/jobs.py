"""Every job a workflow config asks for, in one place: the training cells (``grid.expand``), the
empirical privacy audits and the figures, with the file each job writes.

The Snakemake workflow builds its rules from a ``Jobs`` (workflow/rules/common.smk keeps only
what needs Snakemake: input functions, resources, environments, fingerprints), and ``dpbench
grid --jobs`` lists the same jobs, so what a config runs can be read and tested without
Snakemake. The workflow's config is the default config (config/config.yaml) with each
``--configfile`` merged over it; ``workflow_jobs`` refuses or drops what that merge would add
unasked (the default's grid, its audits).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from dpbench.pipeline import catalog
from dpbench.pipeline.grid import Cell, ConfigError, expand, read_yaml, validate
from dpbench.training import settings


# where the committed study's public checkpoints lie, relative to the workflow's directory
# (``dpbench pretrain --reuse``: one of the exact name that verifies is copied, not retrained)
COMMITTED_PRETRAINED = ("benchmarks", "results", "finetune", "pretrained")


@dataclass(frozen=True)
class Jobs:
    """The jobs of a validated config and the files they write (paths under ``results_dir``)."""

    config: dict[str, Any]  # validated, defaults filled in
    cells: dict[str, Cell]  # cell id -> cell, in id order
    audit: dict[str, Any] | None  # the config's own audit section
    audits: tuple[str, ...]  # "<optimizer>-eps<epsilon>[-seed<seed>]", one audit job each
    figures: dict[str, dict[str, Any]]  # the config's figures entry (a figure id, or a name with option figure) -> options

    @property
    def results(self) -> str:
        return self.config["results_dir"]

    def manifest(self, dataset: str) -> str:
        return f"{self.results}/data/{dataset}.json"

    def data_inputs(self, cell: Cell) -> dict[str, str]:
        """What a cell's run reads its records from: its dataset's manifest (the data rule's), or
        the config's text_file (read and checked with the config: ``starts.TextData``)."""
        return {"text_file": cell.data.path} if cell.data is not None else {"manifest": self.manifest(cell.dataset)}

    def run_file(self, cell_id: str) -> str:
        return f"{self.results}/runs/{cell_id}.parquet"

    @property
    def runs_table(self) -> str:
        return f"{self.results}/aggregate/runs.parquet"

    def audit_file(self, name: str) -> str:
        return f"{self.results}/audit/runs/{name}.parquet"

    def audit_job(self, name: str) -> tuple[str, float, int]:
        """The (optimizer, claimed epsilon, seed) of an audit, by its name."""
        return audit_job(name)

    @property
    def audit_table(self) -> str:
        return f"{self.results}/audit/audits.parquet"

    def figure_id(self, name: str) -> str:
        """The figure that the figures entry ``name`` draws (``catalog.drawn_figure``; a name the
        config does not list is a figure id)."""
        return catalog.drawn_figure(name, self.figures.get(name))

    def figure_input(self, name: str) -> str:
        """The table a figure is drawn from, as its spec names it (``table``): the audits table
        (``audit``'s) or the runs table."""
        return self.audit_table if catalog.figure(self.figure_id(name)).table == "audits" else self.runs_table

    def figure_files(self, name: str) -> list[str]:
        """The files a figures entry's job writes: <name>.png and .pdf, or <name>.md for a table."""
        return [f"{self.results}/figures/{name}.{ext}" for ext in catalog.figure(self.figure_id(name)).extensions]

    def cache_files(self, cell: Cell) -> dict[str, Path]:
        """The factorization (and noise) file a matrix-mechanism cell reads (``Cell.cache_files``)."""
        return cell.cache_files(self.config["train"], f"{self.results}/cache")

    def pretrained_file(self, recipe) -> str:
        """The checkpoint of a pretraining recipe (a ``Recipe``, or the name of one of ``RECIPES``)
        under the current pretraining code, which the rule pretrain makes:
        ``cache/pretrain/<name>-<recipe key>-<code fingerprint>.pt``, so that it is made again
        exactly when the recipe or the code changes."""
        from dpbench.training.recipes import RECIPES, checkpoint_name

        recipe = RECIPES[recipe] if isinstance(recipe, str) else recipe
        return f"{self.results}/cache/pretrain/{checkpoint_name(recipe, _pretrain_code())}"

    def pretrained_of(self, cell: Cell) -> str | None:
        """The checkpoint a fine-tuning cell starts from; None for the others (its scratch twin too)."""
        from dpbench.training.recipes import Recipe

        return self.pretrained_file(cell.recipe) if cell.fine_tunes and isinstance(cell.recipe, Recipe) else None

    def prefix_store_of(self, cell: Cell) -> str | None:
        """The prefix store a cell's run reads (``dpbench.problems.prefix_store``): where the config
        asks for stores (``prefix_store: true``) and the cell fine-tunes an encoder problem in a
        mode whose frozen part is a prefix of the encoder (head, last-block); else None, and the
        cell's command line is as without the key. ``cache/prefix/<problem>/<encoder>/<mode>.npy``:
        one per problem (its records), encoder (the catalogued one's name, or ``dir-`` and 16 hex
        digits of the SHA-256 of a local directory's files) and mode (the cut), shared by every
        cell that reads it; the store's own key (the encoder's hash, the records' hash, the token
        limit and the cut) is in its sidecar, which every run checks."""
        from dpbench.problems import facts
        from dpbench.problems.layout import STORED_MODES

        if not self.config.get("prefix_store") or not cell.fine_tunes or cell.start.mode.name not in STORED_MODES:
            return None
        f = facts(cell.problem)
        if f.family != "bert-encoder":
            return None
        directory = getattr(cell.recipe, "path", None)
        encoder = f.pretrained if directory is None else f"dir-{_directory_sha256(directory)[:16]}"
        return f"{self.results}/cache/prefix/{cell.problem}/{encoder}/{cell.start.mode.name}.npy"

    def prefix_inputs(self, cell: Cell) -> dict[str, str]:
        """The train rule's input of a cell's prefix store ({"prefix_store": path}; {} without one)."""
        store = self.prefix_store_of(cell)
        return {"prefix_store": store} if store else {}

    def prefix_store_job(self, path: str) -> tuple[str, str]:
        """The (dataset, ``dpbench prefix-store`` arguments quoted for the shell) of the store at
        ``path``, from the first cell that reads it."""
        for cell in self.cells.values():
            if self.prefix_store_of(cell) == path:
                directory = getattr(cell.recipe, "path", None)
                args = ["--problem", cell.problem, "--finetune", cell.start.mode.name]
                return cell.dataset, shlex.join(args + (["--pretrained-dir", directory] if directory else []))
        raise ValueError(f"no cell of the config reads the prefix store {path}")

    def check_pretrained(self) -> None:
        """Each public checkpoint the jobs start from that is already made (checkpoint and
        sidecar) is read once, when the workflow starts, and its SHA-256 checked against its
        sidecar (``workflow_jobs``): a changed one stops the workflow in one line naming it,
        before Snakemake reruns, and so deletes, the completed fine-tuning runs that read it (each job would
        refuse the checkpoint only after its run file was gone)."""
        import hashlib

        for path in sorted({self.pretrained_of(cell) for cell in self.cells.values()} - {None}):
            sidecar = Path(f"{path}.json")
            if not (Path(path).is_file() and sidecar.is_file()):
                continue  # not made yet (or a killed pretrain job's, which the rule makes again)
            try:
                recorded = json.loads(sidecar.read_text())["sha256"]
            except (ValueError, KeyError, TypeError) as exc:
                recorded = f"nothing readable ({type(exc).__name__})"
            actual = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            if actual != recorded:
                # a ConfigError: common.smk stops the workflow with its one line, as for a config's
                raise ConfigError(f"pretrained checkpoint {path} is damaged or swapped: its SHA-256 is {actual}, its "
                                 f"sidecar {sidecar} records {recorded}; nothing was rerun and the completed runs "
                                 "are kept: delete both files and the workflow pretrains it again")

    def recipe_of(self, name: str, key: str):
        """The recipe of the checkpoint ``<name>-<key>``: the one the config's fine-tuning cells
        read (``pretrain.fields`` may change the named recipe), else the named recipe where its
        key is ``key``; None where neither is (the command's ``--expect`` then refuses it)."""
        from dpbench.training.recipes import RECIPES, Recipe

        found = [c.recipe for c in self.cells.values() if c.fine_tunes and isinstance(c.recipe, Recipe)
                 and (c.recipe.name, c.recipe.key) == (name, key)]
        if found:
            return found[0]
        named = RECIPES.get(name)
        return named if named is not None and named.key == key else None

    def pretrain_job(self, name: str, pretrain_key: str) -> tuple[str, int]:
        """The pretrain rule's ``--recipe`` value (quoted for the shell) and threads for the
        checkpoint ``<name>-<pretrain_key>`` (``<recipe key>-<code>``)."""
        from dpbench.training.recipes import RECIPES

        key = pretrain_key.split("-")[0]
        recipe = self.recipe_of(name, key) or RECIPES[name]
        return shlex.quote(self.recipe_argument(name, key)), recipe.threads

    def recipe_argument(self, name: str, key: str) -> str:
        """``dpbench pretrain --recipe``'s value (unquoted) for the checkpoint ``<name>-<key>``:
        the name of a recipe of ``RECIPES``, or the JSON of one the config changes."""
        import json

        from dpbench.training.recipes import RECIPES, Recipe

        recipe = self.recipe_of(name, key)
        if recipe is None or recipe == RECIPES.get(name):
            return name
        # the fields away from Recipe's defaults, which the command fills in (recipes.from_json)
        defaults = Recipe(name=name).to_json()
        return json.dumps({k: v for k, v in recipe.to_json().items() if k == "name" or v != defaults[k]},
                          sort_keys=True)

    def start_code(self, cell: Cell) -> str:
        """What the train rule's ``code`` param adds for a cell's own start: for a fine-tuning cell
        of a local encoder directory (``pretrained_dir``), ``-start`` and 16 hex digits of the
        SHA-256 of its files' hashes (the run's ``checkpoint_sha256``,
        ``encoders.directory_sha256``), so that replacing its weights reruns its cells and
        nothing else; "" for every other cell (their param, and so their runs, unchanged)."""
        path = getattr(cell.recipe, "path", None) if cell.fine_tunes else None
        return "" if path is None else f"-start{_directory_sha256(str(path))[:16]}"

    def train_args(self, cell: Cell) -> str:
        """The ``dpbench train`` arguments of a cell, quoted for the shell, with the files it reads."""
        files = self.cache_files(cell)
        run = replace(cell.run_config(self.config["train"]),
                      factorization=str(files["factorization"]) if "factorization" in files else None,
                      noise_file=str(files["noise"]) if "noise" in files else None,
                      pretrained=self.pretrained_of(cell),
                      pretrained_dir=getattr(cell.recipe, "path", None) if cell.fine_tunes else None,
                      prefix_store=self.prefix_store_of(cell))
        return shlex.join(run.to_args())

    def listing(self) -> list[tuple[str, str]]:
        """Every job, as (its rule, the file it writes: the first where it writes several), stage
        by stage: datasets, public pretraining, prefix stores, the matrix mechanisms' factorizations and noise
        files, training, aggregation, audits, figures. The jobs ``snakemake -n`` counts, less its
        target ``all``."""
        cells = list(self.cells.values())
        files = [self.cache_files(cell) for cell in cells]
        dense = [f for f in files if "noise" in f]  # a streamed mechanism's cell has no noise file
        jobs = [("data", self.manifest(d)) for d in sorted({cell.dataset for cell in cells if cell.data is None})]
        jobs += [("pretrain", p) for p in sorted({self.pretrained_of(cell) for cell in cells} - {None})]
        jobs += [("prefix_store", p) for p in sorted({self.prefix_store_of(cell) for cell in cells} - {None})]
        jobs += [("factorize", p) for p in sorted({str(f["factorization"]) for f in dense})]
        jobs += [("noise", p) for p in sorted({str(f["noise"]) for f in dense})]
        jobs += [("factorize_streamed", p) for p in sorted({str(f["factorization"]) for f in files
                                                              if f and "noise" not in f})]
        jobs += [("train", self.run_file(cell_id)) for cell_id in self.cells]
        jobs += [("aggregate", self.runs_table)] if cells else []
        jobs += [("audit", self.audit_file(name)) for name in self.audits]
        jobs += [("audit_table", self.audit_table)] if self.audits else []
        return jobs + [(f"plot_{figure}", self.figure_files(figure)[0]) for figure in self.figures]


@lru_cache(maxsize=None)
def _directory_sha256(path: str) -> str:
    """An encoder directory's files hashed once per process (the workflow's every cell of it asks)."""
    from dpbench.problems.encoders import directory_sha256

    return directory_sha256(path)


@lru_cache(maxsize=1)
def _pretrain_code() -> str:
    """The pretraining code's fingerprint, hashed once per process (a workflow names every
    fine-tuning cell's checkpoint by it; its sources do not change while Snakemake runs)."""
    from dpbench.pipeline.fingerprint import pretrain_fingerprint

    return pretrain_fingerprint()


def dpbench_command(src: str, python: str) -> str:
    """The command that runs dpbench in a job, for the shell: ``src`` put before the caller's
    PYTHONPATH, not in its place (a plugin the caller sees, the job sees), then ``python -m dpbench``."""
    return f"PYTHONPATH={shlex.quote(src)}${{PYTHONPATH:+:$PYTHONPATH}} {shlex.quote(python)} -m dpbench"


def named_plugins(jobs: Jobs) -> list[tuple[str, str, str]]:
    """The plugins the config names, as (registry: optimizers, problems or figures; id; its
    origin, "plugin <distribution> <version>"): its cells' optimizers and problems, the
    optimizers it audits and its figures that an installed plugin registers."""
    named = {("optimizers", c.optimizer) for c in jobs.cells.values()} | {("problems", c.problem)
                                                                         for c in jobs.cells.values()}
    named |= {("optimizers", audit_job(a)[0]) for a in jobs.audits} | {("figures", jobs.figure_id(f)) for f in jobs.figures}
    named = {(kind, name) for kind, name in named if catalog.is_plugin(kind, name)}  # no registry for built-ins
    if not named:
        return []
    from dpbench.optimizers import OPTIMIZERS
    from dpbench.problems import PROBLEMS
    from dpbench.reporting.figures import FIGURES

    registries = {"optimizers": OPTIMIZERS, "problems": PROBLEMS, "figures": FIGURES}
    return sorted((kind, name, registries[kind].origin(name)) for kind, name in named
                  if registries[kind].plugin(name) is not None)


_SEEN_BY_JOBS = """import json, sys
from dpbench.optimizers import OPTIMIZERS
from dpbench.problems import PROBLEMS
from dpbench.reporting.figures import FIGURES
r = {"optimizers": OPTIMIZERS, "problems": PROBLEMS, "figures": FIGURES}
print(json.dumps([[k, n] for k, n in json.loads(sys.argv[1]) if n not in r[k]]))
"""


def check_plugins_visible(jobs: Jobs, python: str, src: str, environ: dict[str, str] | None = None) -> None:
    """Every plugin the config names (``named_plugins``) must be found by the interpreter the
    jobs run, ``python`` in the environment they get: ``environ`` (this process's by default)
    with ``src`` put before its PYTHONPATH, as the rules put it. Else the config check passes
    here and the first job fails naming no plugin: refused naming the plugin and the interpreter."""
    plugins = named_plugins(jobs)
    if not plugins:
        return
    environ = dict(os.environ if environ is None else environ)
    env = {**environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, environ.get("PYTHONPATH")]))}
    asked = json.dumps([[kind, name] for kind, name, _ in plugins])
    try:
        proc = subprocess.run([python, "-c", _SEEN_BY_JOBS, asked], env=env, capture_output=True, text=True,
                              timeout=300)
    except OSError as exc:
        raise ConfigError(f"the jobs' interpreter {python} cannot be run ({exc})") from None
    lines = (proc.stdout or "").strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = ((proc.stderr or "").strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"the jobs' interpreter {python} cannot import dpbench to look for the plugins the config "
                          f"names ({why})")
    missing = {tuple(m) for m in json.loads(lines[-1])}
    for kind, name, origin in plugins:
        if (kind, name) in missing:
            raise ConfigError(f"{kind} {name!r} is {origin}, which the jobs' interpreter {python} does not find "
                              f"(PYTHONPATH={env.get('PYTHONPATH', '')}): install it where the jobs run")


def load_jobs(path: str | Path) -> Jobs:
    """The jobs of one config file (``dpbench grid``), validated as the workflow validates it;
    every error is one line naming the key and the file."""
    config = read_yaml(path)
    figures_given = "figures" in config  # before the schema's default fills it in
    try:
        validate(config)
        return plan(config, config.get("audit"), figures_given)
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({path})") from None


def workflow_jobs(config: dict[str, Any], files: list[str | Path], configfiles,
                  given: dict[str, Any], runner: tuple[str, str] | None = None) -> Jobs:
    """The workflow's jobs (common.smk calls it): ``config`` is what Snakemake merged from
    ``files`` (the default config, then the ``configfiles`` given with --configfile, whose
    merged content is ``given``); validated in place, as ``load_jobs`` validates one file;
    ``runner``: (the jobs' interpreter, the src/ they run), to check that the plugins the config
    names are found there (``check_plugins_visible``)."""
    figures_given = "figures" in config
    refuse_inherited_grid(configfiles, given)
    try:
        validate(config)
        found = plan(config, own_audit(config, configfiles, given), figures_given)
        if runner is not None:
            check_plugins_visible(found, *runner)
    except ConfigError as exc:
        raise naming_file(exc, files) from None
    found.check_pretrained()  # before Snakemake decides what to rerun
    return found


def plan(config: dict[str, Any], audit: dict[str, Any] | None, figures_given: bool) -> Jobs:
    """The jobs of a validated config; ``audit``: its own audit section, if any;
    ``figures_given``: whether it names its figures (else the schema's default stands)."""
    cells = expand(config)
    audits = tuple(audit_names(audit, cells)) if audit else ()
    if not cells and not audits:
        raise ConfigError("config key grid: the grid is empty and the config audits nothing: nothing to run")
    figures = figures_of(config["figures"], bool(cells), bool(audits), figures_given)
    return Jobs(config, {cell.id: cell for cell in cells}, audit, audits, figures)


def naming_file(exc: ConfigError, files: list[str | Path]) -> ConfigError:
    """``exc`` with the file that sets its key: the last of ``files`` with that top-level key,
    else all of them (Snakemake merged them into one config)."""
    message = str(exc)
    key = message[len("config key "):].split(":")[0].split(".")[0] if message.startswith("config key ") else ""
    setting = [f for f in files if key and Path(f).is_file() and key in _top_keys(f)]
    return ConfigError(f"{message} ({setting[-1] if setting else ', '.join(map(str, files))})")


def _top_keys(path) -> set:
    try:
        return set(yaml.safe_load(Path(path).read_text()) or {})
    except (yaml.YAMLError, TypeError, ValueError):
        return set()


def refuse_inherited_grid(configfiles, given: dict[str, Any]) -> None:
    """Snakemake merges the configs given with --configfile (``given``: their merged content)
    over the Snakefile's default config, config/config.yaml, so a config without ``grid:``
    would silently train the default's cells: refused, naming the files."""
    if configfiles and "grid" not in (given or {}):
        names = ", ".join(map(str, configfiles))
        raise ConfigError(f"config {names} has no grid: (the cells to train), so the default config's grid "
                          "(config/config.yaml) would run in its place; give the grid (config/README.md; `grid: []` in a config that only audits), or "
                          "leave out --configfile to run the default workflow")


def own_audit(config: dict[str, Any], configfiles, given: dict[str, Any]) -> dict[str, Any] | None:
    """The config's ``audit`` section, unless the configs given with --configfile (``given``:
    their merged content) have none: then it would only be the default config's
    (config/config.yaml, merged under them), whose audits the user did not ask for."""
    if configfiles and "audit" not in (given or {}):
        return None
    return config.get("audit")


def audit_names(audit: dict[str, Any], cells: list[Cell]) -> list[str]:
    """One audit per optimizer, claimed epsilon and seed (its file's name): ``<optimizer>-eps<epsilon>``
    for seed 0, ``<optimizer>-eps<epsilon>-seed<seed>`` for the others (so seeds added to a
    config leave the audits already run in place)."""
    seeds = audit.get("seed", 0)
    seeds = sorted(set(seeds)) if isinstance(seeds, list) else [seeds]
    if seeds[-1] > MAX_AUDIT_SEED:
        raise ConfigError(f"config key audit.seed: {seeds[-1]} is above {MAX_AUDIT_SEED} (2**63 - 1), the largest seed "
                          "an audit's record holds (an int64 column)")
    return [f"{o}-eps{float(e):g}" + (f"-seed{s}" if s else "")
            for o in audited_optimizers(audit["optimizers"], cells)
            for e in audited_epsilons(audit["epsilons"], cells) for s in seeds]


MAX_AUDIT_SEED = settings.MAX_AUDIT_SEED


def audit_job(name: str) -> tuple[str, float, int]:
    """(optimizer, claimed epsilon, seed) of an audit's name (``audit_names``)."""
    m = re.fullmatch(r"(.+)-eps([0-9.e+-]+?)(?:-seed([0-9]+))?", name)
    if m is None:
        raise ValueError(f"{name!r} is not an audit's name (<optimizer>-eps<epsilon>[-seed<seed>])")
    return m[1], float(m[2]), int(m[3] or 0)


def audited_optimizers(names, cells: list[Cell]) -> list[str]:
    """``all``: every private optimizer of the registry; ``grid``: the private optimizers of the
    grid; else the ones named, each private (a non-private optimizer claims nothing to audit)."""
    if names == "all":
        return sorted(n for n in catalog.optimizer_names() if catalog.optimizer(n).private)
    if names == "grid":
        return sorted({c.optimizer for c in cells if catalog.optimizer(c.optimizer).private})
    for name in names:
        if not catalog.is_optimizer(name):
            raise ConfigError(f"config key audit.optimizers: unknown optimizer {name!r} "
                              f"(choose from {catalog.optimizer_names()})")
        if not catalog.optimizer(name).private:
            raise ConfigError(f"config key audit.optimizers: {name!r} is not private: there is no claim to audit")
    return sorted(set(names))


def audited_epsilons(epsilons, cells: list[Cell]) -> list[float]:
    """The claimed epsilons given, or ``grid``: every epsilon the grid trains at."""
    if epsilons == "grid":
        return sorted({c.epsilon for c in cells if c.epsilon is not None})
    return sorted(set(epsilons))


def figures_of(figures: dict[str, dict], trains: bool, audits: bool, given: bool) -> dict[str, dict]:
    """The figures drawn, id -> options: the config's, and ``audit`` wherever there are audits;
    a config that trains nothing draws only ``audit`` (by default, where it names no figures).
    A figure drawn from the audits table needs audits; one drawn from the runs table, training."""
    figures = dict(figures)
    if audits:
        figures.setdefault("audit", {})
    def table(name):
        return catalog.figure(catalog.drawn_figure(name, figures[name])).table

    on_audits = {f for f in figures if table(f) == "audits"}
    if on_audits and not audits:
        name = sorted(on_audits)[0]
        raise ConfigError(f"config key figures.{name}: the figure of the audits needs audits (the config key audit)")
    if not trains:
        if not given:
            figures = {"audit": {}}
        extra = sorted(f for f in figures if table(f) != "audits")
        if extra:
            raise ConfigError(f"config key figures.{extra[0]}: figures {extra} need training runs, but the grid is "
                              "empty")
    return figures


def figure_options(options: dict[str, Any]) -> str:
    """A figure's options as ``dpbench plot`` arguments, ``-o KEY=VALUE`` each (a list joined
    with commas; ``filters`` one ``-o filter.COLUMN=VALUES`` per column), quoted for the shell."""
    def join(value):
        return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)

    args = []
    for key, value in options.items():
        if key == "figure":
            continue  # which figure the entry draws (catalog.drawn_figure), not one of its options
        if key == "filters" and isinstance(value, dict):
            args += [f"filter.{column}={join(v)}" for column, v in value.items()]
        else:
            args.append(f"{key}={join(value)}")
    return " ".join(f"-o {shlex.quote(a)}" for a in args)
