"""What the workflow reads of the optimizers and the figures, without torch or matplotlib, as
``dpbench.problems.catalog`` holds the problems' facts: building the DAG of a config (the grid,
the jobs, the config check, the cluster cost model, the fingerprints) imports neither.

* ``OptimizerFacts`` (``OPTIMIZERS``): per built-in optimizer whether it is private, its
  hyperparameters' defaults (``hyperparameters`` checks a config's values as the run does),
  its cost class (``dpbench.pipeline.cluster``), the module that builds its step (its code
  fingerprint) and the cached files its mechanism reads (``files``, a
  ``dpbench.mechanisms.files`` declaration: the factorization and noise files the workflow makes):
  read from the optimizer's one declaration in the registry (``dpbench.optimizers.BUILT_IN``),
  which imports no torch (a built-in names its step's build by import string, and a mechanism
  imports torch only to draw).
* ``FigureFacts`` (``FIGURES``): per built-in figure its kind (the files it writes), the table
  it is drawn from (``runs`` or ``audits``), its options and their defaults, and whether it
  selects on the validation split: read from the figure's one declaration in
  ``dpbench.reporting.figures.BUILT_IN`` and its drawing function's signature, statically
  (``ast``: nothing of the figures package is imported, which imports matplotlib), so a figure
  is declared once.

``optimizer(id)`` and ``figure(id)`` read a built-in here and a plugin's from its spec through
the registry (which imports the plugin, and so may import torch: only where a config names a
plugin). A search's config check reads the built-in's spec itself (``optimizer_spec``: its
mechanism), without torch as well.
"""

from __future__ import annotations

import ast
import importlib.metadata
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from dpbench import hyperparameters
from dpbench.mechanisms.files import DenseFiles, StreamedFiles

TABLES = ("runs", "audits")  # what a figure is drawn from: the runs table, the audits table


@dataclass(frozen=True)
class OptimizerFacts:
    """An optimizer as the workflow reads it (module docstring); ``files``: None where its
    runs read no cached file."""

    name: str
    private: bool
    module: str  # the module that builds its step (``OptimizerSpec.build.__module__``)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    cost_class: str | None = None
    files: DenseFiles | StreamedFiles | Any = None
    caveat: str | None = None  # the spec's: recorded in every run

    @property
    def no_guarantee(self) -> bool | str:
        """Where its runs' (epsilon, delta) is no DP guarantee: True (always: its caveat says so),
        the name of a hyperparameter voiding it where true (D2P2's paper_sensitivity), or False."""
        from dpbench.reporting.results import NO_GUARANTEE  # imports pandas: only where results are read

        if (self.caveat or "").startswith(NO_GUARANTEE):
            return True
        return "paper_sensitivity" if "paper_sensitivity" in self.defaults else False

    def guarantees(self, hyperparameters: Mapping[str, Any]) -> bool:
        """Whether a private run of it with ``hyperparameters`` has the (epsilon, delta) it records."""
        if isinstance(self.no_guarantee, str):
            return self.private and not hyperparameters.get(self.no_guarantee, False)
        return self.private and not self.no_guarantee

    def hyperparameters(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """The defaults overridden by ``given``, checked as ``OptimizerSpec.hyperparameters``."""
        return hyperparameters.merged(self.name, self.defaults, given)

    @classmethod
    def of(cls, spec) -> OptimizerFacts:
        """The facts of a registry's spec (a built-in's or a plugin's)."""
        return cls(spec.name, spec.private, spec.build.__module__, dict(spec.defaults), spec.cost_class,
                   getattr(spec.mechanism, "files", None), getattr(spec, "caveat", None))


def _builtin_optimizers() -> dict[str, OptimizerFacts]:
    from dpbench.optimizers import OPTIMIZERS as registry  # torch-free: the built-ins' declarations

    return {name: OptimizerFacts.of(spec) for name, spec in registry.builtins.items()}


OPTIMIZERS: dict[str, OptimizerFacts] = _builtin_optimizers()


@dataclass(frozen=True)
class FigureFacts:
    """A figure as the workflow reads it (module docstring): ``options``, the keyword
    parameters of its drawing function; ``min_seeds``, that parameter's default where it takes
    one (the config check refuses a grid with fewer seeds of a setting)."""

    id: str
    options: tuple[str, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "figure"  # or "table"
    table: str = "runs"  # or "audits"
    needs_validation: bool = False
    min_seeds: int | None = None

    @property
    def extensions(self) -> tuple[str, ...]:
        """The files ``dpbench plot`` writes for it: ("png", "pdf"), or ("md",) for a table."""
        return ("md",) if self.kind == "table" else ("png", "pdf")

    @classmethod
    def of(cls, spec) -> FigureFacts:
        """The facts of a registry's spec (a plugin's, or a built-in's for the tests)."""
        import inspect

        params = list(inspect.signature(spec.build).parameters.values())[1:]
        min_seeds = next((p.default for p in params if p.name == "min_seeds"), None)
        return cls(spec.id, tuple(p.name for p in params), dict(spec.defaults), spec.kind, spec.table,
                   spec.needs_validation, min_seeds)


# -- the built-in figures, read from their one declaration ----------------------------------
FIGURES_PACKAGE = Path(__file__).resolve().parents[1] / "reporting" / "figures"
_SPEC_FIELDS = ("id", "build", "title", "defaults", "kind", "needs_validation", "table")  # FigureSpec's order


@lru_cache(maxsize=None)
def _source(module: str) -> ast.Module:
    """The parsed source of a module of the figures package ("": its ``__init__``), parsed once."""
    path = FIGURES_PACKAGE / (f"{module}.py" if module else "__init__.py")
    return ast.parse(path.read_text())


def _drawing_function(module: str, name: str, depth: int = 0) -> ast.FunctionDef:
    """The definition of ``name`` as the figures package's module binds it, following its
    ``from dpbench.reporting.figures.<m> import name`` statements."""
    tree = _source(module)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpbench.reporting.figures.")
                and any((a.asname or a.name) == name for a in node.names) and depth < 10):
            return _drawing_function(node.module.removeprefix("dpbench.reporting.figures."), name, depth + 1)
    raise ValueError(f"dpbench.reporting.figures: no function {name!r} found for a built-in figure")


def _figure_facts() -> dict[str, FigureFacts]:
    """Each built-in figure's facts, read from the sources (nothing imported): its declaration in
    ``dpbench.reporting.figures.BUILT_IN`` (``FigureSpec(id, build, title, defaults, kind=,
    needs_validation=, table=)``, literals) and its drawing function's keyword parameters."""
    tree = _source("")
    (declared,) = [n.value for n in tree.body if isinstance(n, ast.Assign)
                   and any(getattr(t, "id", None) == "BUILT_IN" for t in n.targets)]
    out = {}
    for call in declared.elts:
        given = {**dict(zip(_SPEC_FIELDS, call.args)), **{k.arg: k.value for k in call.keywords}}
        value = {k: ast.literal_eval(v) for k, v in given.items() if k not in ("build", "title")}
        build = _drawing_function("", given["build"].id).args
        params = [*build.posonlyargs, *build.args][1:] + build.kwonlyargs  # after the table
        defaults = dict(zip([a.arg for a in [*build.posonlyargs, *build.args]][::-1], build.defaults[::-1]))
        defaults |= {a.arg: d for a, d in zip(build.kwonlyargs, build.kw_defaults) if d is not None}
        min_seeds = ast.literal_eval(defaults["min_seeds"]) if "min_seeds" in defaults else None
        facts = FigureFacts(value["id"], tuple(a.arg for a in params), value.get("defaults", {}),
                            value.get("kind", "figure"), value.get("table", "runs"),
                            value.get("needs_validation", False), min_seeds)
        out[facts.id] = facts
    return out


FIGURES: dict[str, FigureFacts] = _figure_facts()


def plugins_installed(group: str) -> bool:
    """Whether any entry point of ``group`` is installed (read from the distributions'
    metadata; nothing is imported)."""
    return any(True for _ in importlib.metadata.entry_points(group=group))


def _optimizer_registry():
    from dpbench.optimizers import OPTIMIZERS as registry  # torch-free; a read past its built-ins imports the plugins

    return registry


def _figure_registry():
    from dpbench.reporting.figures import FIGURES as registry  # imports matplotlib: only for a plugin

    return registry


def optimizer_names() -> list[str]:
    """Every optimizer id: the built-ins, and the installed plugins' (the registry's)."""
    return sorted(_optimizer_registry() if plugins_installed("dpbench.optimizers") else OPTIMIZERS)


def figure_names() -> list[str]:
    """Every figure id: the built-ins, and the installed plugins' (the registry's)."""
    return list(_figure_registry() if plugins_installed("dpbench.figures") else FIGURES)


def is_optimizer(name: str) -> bool:
    return name in OPTIMIZERS or (plugins_installed("dpbench.optimizers") and name in _optimizer_registry())


def drawn_figure(name: str, options: dict | None) -> str:
    """The figure that the config's ``figures`` entry ``name`` draws: its option ``figure``
    where it gives one (a second drawing of a figure under a name of its own, e.g.
    ``finetune_p5: {figure: finetune, problem: P5}``), else ``name`` itself."""
    return (options or {}).get("figure", name)


def is_figure(name: str) -> bool:
    return name in FIGURES or (plugins_installed("dpbench.figures") and name in _figure_registry())


def optimizer(name: str) -> OptimizerFacts:
    """A built-in's facts, else a plugin's from its spec: an unknown id is the registry's
    KeyError naming the choices, a broken plugin's its one-line ``PluginError``."""
    return OPTIMIZERS[name] if name in OPTIMIZERS else OptimizerFacts.of(_optimizer_registry().lookup(name))


def figure(name: str) -> FigureFacts:
    """A built-in's facts, else a plugin's from its spec (``dpbench.reporting.figures.spec_of``'s errors)."""
    if name in FIGURES:
        return FIGURES[name]
    from dpbench.reporting.figures import spec_of

    return FigureFacts.of(spec_of(name))


def optimizer_spec(name: str):
    """The registry's spec of an optimizer (what a search accounts: its mechanism); a built-in's
    imports no torch, a plugin's imports the plugin."""
    registry = _optimizer_registry()
    return registry.builtins[name] if name in registry.builtins else registry.lookup(name)


def is_problem(name: str) -> bool:
    """A built-in problem (the torch-free ``dpbench.problems.catalog``) or an installed plugin's."""
    from dpbench.problems import catalog as problems

    if name in problems.FACTS:
        return True
    from dpbench.problems import PROBLEMS  # the registry: imports torch

    return name in PROBLEMS


def optimizer_error(name: str):
    """The one-line error of a broken optimizer plugin whose id is ``name``, or None."""
    return _optimizer_registry().error(name) if plugins_installed("dpbench.optimizers") else None


def figure_error(name: str):
    """The one-line error of a broken figure plugin whose id is ``name``, or None."""
    return _figure_registry().error(name) if plugins_installed("dpbench.figures") else None


def is_plugin(registry: str, name: str) -> bool:
    """Whether ``name`` of ``registry`` (optimizers, problems or figures) is an installed
    plugin's; a built-in's id never is (the built-in keeps it), and nothing is imported where
    none of the group is installed."""
    from dpbench.problems import catalog as problems

    builtins = {"optimizers": OPTIMIZERS, "problems": problems.FACTS, "figures": FIGURES}[registry]
    return name not in builtins and plugins_installed(f"dpbench.{registry}")
