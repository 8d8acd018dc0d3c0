"""Content fingerprints of the code behind a result, for incremental reruns.

The workflow passes them to rules as params, and Snakemake reruns a job when its params
change. So editing one optimizer's module reruns only that optimizer's cells; editing one
problem's modules reruns only that problem's cells; editing the harness (training loop,
per-sample gradients, accounting, ...) reruns every cell; editing one figure function reruns
only that figure. Dependencies are found statically from import statements (modules) and from
references to functions (figures: ``function_closure``).

What is hashed is the code, not its text (``code_text``): a module's syntax tree without its
docstrings and bare string statements, and without line numbers, so that a comment, a
docstring or a blank line changes no fingerprint. (The pretraining code's fingerprint, which
names a committed checkpoint, still hashes the text: ``pretrain_fingerprint``.)
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

PACKAGE = "dpbench"
# Modules whose imports are not followed, and which do not count themselves: each registry imports
# every optimizer's (problem's) module (following it would make each depend on all the others, and
# adding one would rerun everything); this module only computes fingerprints.
LEAVES = ("dpbench.optimizers", "dpbench.problems.registry", "dpbench.pipeline.fingerprint")
# What every training run executes, whatever its optimizer and problem (train's stages, config,
# splits, calibration and checkpoint, are in its closure: train imports them).
HARNESS = ("dpbench.training.train", "dpbench.optimizers.base", "dpbench.optimizers.spec")
# Each problem's own modules in this package are its fingerprint, not the harness's (harness_closure)
PROBLEMS = "dpbench.problems"


ROOT = Path(__file__).resolve().parents[1]  # src/dpbench


def _module_file(name: str) -> Path | None:
    """The source file of a dpbench module, found on disk (nothing is imported)."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = ROOT.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=None)
def _imports(name: str) -> frozenset[str]:
    """dpbench modules that module `name` imports (statically, from its source; parsed once
    per process), wherever the import is written."""
    return _imports_of(name)[0] | _imports_of(name)[1]


@lru_cache(maxsize=None)
def _imports_of(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """``_imports`` of module `name` as (those at module level, those inside a function)."""
    path = _module_file(name)
    if path is None:
        return frozenset(), frozenset()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return _imports_in(path.read_text(), package, split=True)


def _imports_in(source: str, package: str, split: bool = False):
    """The dpbench modules a source text imports; ``package``: the package its relative imports
    start from; ``split``: as (those at module level, those inside a function)."""
    found: tuple[set[str], set[str]] = (set(), set())

    def visit(node, in_function: bool) -> None:
        into = found[in_function]
        if isinstance(node, ast.Import):
            into.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            into.add(base)
            into.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function)

    visit(ast.parse(source), False)
    eager, lazy = (frozenset(m for m in f if (m == PACKAGE or m.startswith(PACKAGE + ".")) and _module_file(m))
                   for f in found)
    return (eager, lazy) if split else eager | lazy


def _in_problems(module: str) -> bool:
    return module == PROBLEMS or module.startswith(PROBLEMS + ".")


def module_closure(roots: tuple[str, ...], follow=None) -> set[str]:
    """The dpbench modules the roots depend on, transitively (LEAVES excluded); ``follow(module,
    imported)``: whether an import written inside one of ``module``'s functions is followed
    (default: every import is)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in LEAVES:
            eager, lazy = _imports_of(name)
            todo.extend(eager)
            todo.extend(m for m in lazy if follow is None or follow(name, m))
    return seen - set(LEAVES) - {PACKAGE}


def harness_closure(roots: tuple[str, ...] = HARNESS) -> set[str]:
    """``module_closure`` of the roots, not following an import of a ``dpbench.problems`` module
    written inside a function: that is how shared code reaches what only some problems use (the
    encoders' catalogue and types, from ``ProblemFacts.architecture`` and ``bert_encoder``), and
    those problems import it themselves (``problem_modules``)."""
    return module_closure(roots, follow=lambda module, imported: not _in_problems(imported))


def problem_modules(roots: tuple[str, ...]) -> set[str]:
    """A problem's own modules: the roots (the module that declares its spec, or a plugin's
    imports) and every dpbench module they import, wherever the import is written, transitively,
    up to the harness's modules (``harness_closure``: every run's fingerprint holds them) and
    the registries (``LEAVES``)."""
    harness = harness_closure()
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name in harness:
            continue
        seen.add(name)
        if name not in LEAVES:
            todo.extend(_imports(name))
    return seen - set(LEAVES) - {PACKAGE}


@lru_cache(maxsize=None)
def code_text(source: str) -> str:
    """What a fingerprint hashes of Python source: its syntax tree (``ast.dump``, without line
    and column numbers) with every statement that is a bare string removed (docstrings of the
    module, its classes and functions, and attribute docstrings). Comments, docstrings, blank
    lines and layout change nothing; a change of code changes it. The dump is the same within a
    Python minor version (the syntax tree's classes change only between minor versions: a new
    minor version may change every fingerprint once)."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if isinstance(body, list):
                setattr(node, name, [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                                             and isinstance(s.value.value, str))])
    return ast.dump(tree)


def _module_code(name: str) -> str:
    """``code_text`` of a dpbench module's file (parsed once per version of its text)."""
    return code_text(_module_file(name).read_text())


def _modules_digest(modules, extra: list[tuple[str, str]] = ()) -> str:
    """Hash of the modules' code (``code_text``) and ``extra`` (key, text) pairs."""
    return _digest([(n, _module_code(n)) for n in modules] + list(extra))


def _digest(parts: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for key, text in sorted(parts):
        h.update(key.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


@lru_cache(maxsize=None)
def optimizer_fingerprint(optimizer: str) -> str:
    """Hash of the code that determines an optimizer's runs: for a built-in, the harness's modules
    (``harness_closure``), those of its build and its mechanism, and its declaration in the
    registry (its defaults, its mechanism's arguments: ``declaration``); for a plugin's optimizer,
    the harness, the dpbench modules the plugin imports and the plugin's source hash
    (``dpbench.plugins.Plugin.source_sha256``)."""
    from dpbench.pipeline import catalog

    if optimizer in catalog.OPTIMIZERS:  # a built-in: its declaration (torch-free) names its modules
        spec = catalog.optimizer_spec(optimizer)
        roots = (*HARNESS, spec.build.__module__, type(spec.mechanism).__module__)
        return _modules_digest(harness_closure(roots), [("declaration", code_text(declaration(optimizer)))])
    from dpbench.optimizers import OPTIMIZERS, get_optimizer

    get_optimizer(optimizer)  # an unknown id: its KeyError; a broken plugin: its one-line error
    return _plugin_digest(OPTIMIZERS.plugin(optimizer), HARNESS)


@lru_cache(maxsize=None)
def _declarations() -> dict[str, str]:
    """The text of each built-in optimizer's ``OptimizerSpec(...)`` in the registry, by its name
    (the registry is a leaf: its text as a whole would rerun every optimizer for any edit)."""
    source = _module_file(LEAVES[0]).read_text()
    return {next(k.value.value for k in node.keywords if k.arg == "name"): ast.get_source_segment(source, node)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "OptimizerSpec"}


def declaration(optimizer: str) -> str:
    """A built-in optimizer's declaration, as written in the registry (``_declarations``)."""
    return _declarations()[optimizer]


@lru_cache(maxsize=None)
def problem_fingerprint(problem: str) -> str:
    """``-`` and a hash of a problem's own modules (``problem_modules``): for a built-in, those of
    the module that declares its spec (``problem_roots``); for a plugin's problem, those the
    plugin imports, and its source hash. A cell's code is ``optimizer_fingerprint +
    problem_fingerprint``, so that editing one problem's modules reruns exactly its cells (and
    editing the harness, every cell)."""
    from dpbench.problems import catalog

    if problem in catalog.FACTS:  # a built-in (no registry: it imports torch)
        return "-" + _modules_digest(problem_modules(problem_roots(problem)))
    from dpbench.problems import PROBLEMS, get_problem

    get_problem(problem)
    plugin = PROBLEMS.plugin(problem)
    return "" if plugin is None else "-" + _plugin_digest(plugin, (), problem=True)


def problem_roots(problem: str) -> tuple[str, ...]:
    """The module that declares a built-in problem's spec (its task, build and loader are what it
    imports), read from the registry's ``BUILT_IN`` without importing it (``_builtin_problems``);
    a built-in declared otherwise is found through the registry."""
    found = _builtin_problems().get(problem)
    if found is not None:
        return (found,)
    from dpbench.problems import get_problem

    spec = get_problem(problem)
    return tuple(sorted({type(spec.task).__module__, spec.build.__module__, spec.load.__module__}))


@lru_cache(maxsize=None)
def _builtin_problems() -> dict[str, str]:
    """Built-in problem id -> the module declaring its spec, from the registry's source: each
    ``module.NAME`` (or ``NAME`` imported from a module) listed in ``BUILT_IN``, whose id is the
    ``FACTS["id"]`` its ``NAME = Problem(...)`` names, or else ``NAME``."""
    registry = f"{PROBLEMS}.registry"
    lines, _, bound = _parsed(registry)  # name -> (module, None) or (module, name imported from it)
    listed = next((n.value for n in ast.parse("".join(lines)).body if isinstance(n, ast.Assign)
                   and any(getattr(t, "id", None) == "BUILT_IN" for t in n.targets)), None)
    found = {}
    for item in getattr(listed, "elts", ()):
        if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id in bound:
            owner, attribute = bound[item.value.id]
            module, name = owner if attribute is None else f"{owner}.{attribute}", item.attr
        elif isinstance(item, ast.Name) and bound.get(item.id, (None, None))[1] is not None:
            module, name = bound[item.id]
        else:
            continue
        if _module_file(module) is not None:
            found[_declared_id(module, name)] = module
    return found


def _declared_id(module: str, name: str) -> str:
    """The problem id ``NAME = Problem(FACTS["id"], ...)`` in ``module`` declares, else ``NAME``."""
    for node in ast.parse(_module_file(module).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            for sub in ast.walk(node.value):
                if (isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant)
                        and isinstance(sub.slice.value, str) and getattr(sub.value, "id", getattr(sub.value, "attr", None)) == "FACTS"):
                    return sub.slice.value
    return name


def _plugin_digest(plugin, roots: tuple[str, ...], problem: bool = False) -> str:
    """Hash of the roots, the dpbench modules the plugin's sources import, and the plugin's source
    hash; for a problem (``problem``), the modules its imports reach beyond the harness
    (``problem_modules``)."""
    from dpbench.plugins import source_files

    imported: set[str] = set()
    for name, path in source_files(plugin.package):
        module = name.removesuffix(".py").replace("/", ".")
        package = module.removesuffix(".__init__") if name.endswith("__init__.py") else module.rpartition(".")[0]
        imported |= _imports_in(path.read_text(), package)
    wanted = (*roots, *sorted(imported))
    modules = problem_modules(wanted) if problem else harness_closure(wanted)
    return _modules_digest(modules, [(f"plugin {plugin.distribution} {plugin.entry_point}", plugin.source_sha256)])


# Functions of these packages are followed from any module that references them (figures share
# their selection, names and style): a figure's fingerprint covers every function that draws it.
FOLLOWED = ("dpbench.reporting",)


def _followed(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in FOLLOWED)


def _referenced(f) -> list:
    """The functions f's source names: module-level names of its module (``g``, and names bound
    there by ``from dpbench.reporting.x import g``), ``module.g`` where ``module`` is a followed
    module bound there, and names f imports itself from a followed module."""
    module = sys.modules[f.__module__]
    found = []
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(f)))):
        if isinstance(node, ast.Name):
            found.append(getattr(module, node.id, None))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = getattr(module, node.value.id, None)
            if inspect.ismodule(owner) and _followed(owner.__name__):
                found.append(getattr(owner, node.attr, None))
        elif isinstance(node, ast.ImportFrom) and not node.level and _followed(node.module or ""):
            owner = importlib.import_module(node.module)
            found += [getattr(owner, a.name, None) for a in node.names]
    return [g for g in found if inspect.isfunction(g) and (g.__module__ == f.__module__ or _followed(g.__module__))]


def function_closure(fn) -> list:
    """fn and the functions it references, transitively: module-level functions of its own
    module, and functions of the ``FOLLOWED`` packages (``_referenced``)."""
    seen, todo = {}, [fn]
    while todo:
        f = todo.pop()
        key = f"{f.__module__}.{f.__qualname__}"
        if key in seen:
            continue
        seen[key] = f
        todo.extend(_referenced(f))
    return list(seen.values())


def figure_fingerprint(figure_id: str) -> str:
    """Hash of what draws one figure: its builder and the functions it calls, wherever in
    dpbench.reporting they are; the shared plotting path; its defaults; for a plugin's figure,
    the plugin's source hash. A built-in's is read from the sources (``_static_closure``), so
    that the workflow's start imports no matplotlib; a plugin's through the registry."""
    from dpbench.pipeline import catalog

    if figure_id in catalog.FIGURES:
        return _builtin_figure_fingerprint(figure_id)
    from dpbench.reporting import figures

    spec = figures.spec_of(figure_id)
    functions = {f"{f.__module__}.{f.__qualname__}": f for f in function_closure(spec.build) + _plot_closure()}
    parts = [(name, code_text(inspect.getsource(f))) for name, f in functions.items()]
    filters = figures.THESIS_FILTERS.get(figure_id)
    plugin = figures.FIGURES.plugin(figure_id)
    if plugin is not None:
        parts.append((f"plugin {plugin.distribution} {plugin.entry_point}", plugin.source_sha256))
    return _digest(parts + [("defaults", repr(spec.defaults)), ("thesis_filters", repr(filters))])


@lru_cache(maxsize=1)
def _plot_closure() -> list:
    """The shared plotting path of every figure (dpbench.reporting.figures.plot and what it calls)."""
    from dpbench.reporting import figures

    return function_closure(figures.plot)


# -- the same closure read from the sources, nothing imported ---------------------------------
FIGURES_PACKAGE = "dpbench.reporting.figures"


def _parsed(module: str) -> tuple[list[str], dict[str, ast.AST], dict[str, tuple[str, str | None]]]:
    """A module's source lines, its module-level functions (name -> def) and its import bindings
    (name -> (module, attribute), attribute None for ``import module``), parsed once per version
    of its file."""
    path = _module_file(module)
    stat = path.stat()
    return _parse(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=None)
def _parse(path: Path, mtime_ns: int, size: int):
    text = path.read_text()
    defs: dict[str, ast.AST] = {}
    bound: dict[str, tuple[str, str | None]] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef):
            bound.pop(node.name, None)
            # a cached function is no plain function (the live closure leaves it out too)
            if not any("cache" in ast.unparse(d) for d in node.decorator_list):
                defs[node.name] = node
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                defs.pop(a.asname or a.name, None)
                bound[a.asname or a.name] = (node.module, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                bound[a.asname or a.name.partition(".")[0]] = (a.name if a.asname else a.name.partition(".")[0], None)
    return text.splitlines(keepends=True), defs, bound


def _resolve(module: str, name: str, depth: int = 0) -> tuple[str, str | None] | None:
    """What ``name`` is in ``module``: (its defining module, the function's name), (a module,
    None), or None (not a dpbench function or module)."""
    if _module_file(module) is None or depth > 20:
        return None
    _, defs, bound = _parsed(module)
    if name in defs:
        return module, name
    if name not in bound:
        return None
    owner, attribute = bound[name]
    if attribute is None:
        return (owner, None) if _module_file(owner) is not None else None
    if _module_file(f"{owner}.{attribute}") is not None and (owner, attribute) != (module, name):
        return f"{owner}.{attribute}", None
    return _resolve(owner, attribute, depth + 1)


def _static_referenced(module: str, name: str) -> list[tuple[str, str]]:
    """``_referenced``, read from the sources."""
    found = []
    for node in ast.walk(_parsed(module)[1][name]):
        if isinstance(node, ast.Name):
            found.append(_resolve(module, node.id))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = _resolve(module, node.value.id)
            if owner is not None and owner[1] is None and _followed(owner[0]):
                found.append(_resolve(owner[0], node.attr))
        elif isinstance(node, ast.ImportFrom) and not node.level and _followed(node.module or ""):
            found += [_resolve(node.module, a.name) for a in node.names]
    return [g for g in found if g is not None and g[1] is not None and (g[0] == module or _followed(g[0]))]


def _static_closure(module: str, name: str) -> dict[str, str]:
    """``function_closure`` of ``module.name`` read from the sources: key -> the function's
    source, as ``inspect.getsource`` gives it (its decorators included)."""
    seen, todo = {}, [(module, name)]
    while todo:
        where, what = todo.pop()
        key = f"{where}.{what}"
        if key in seen:
            continue
        lines, defs, _ = _parsed(where)
        node = defs[what]
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        seen[key] = "".join(lines[first - 1:node.end_lineno])
        todo.extend(_static_referenced(where, what))
    return seen


def _builtin_declarations() -> dict[str, tuple[str, dict]]:
    """Each built-in figure's (build function's name in the figures package, defaults), read
    from its declaration (``FigureSpec(id, build, title, defaults, ...)`` in BUILT_IN)."""
    lines, _, _ = _parsed(FIGURES_PACKAGE)
    found = {}
    for node in ast.walk(ast.parse("".join(lines))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "FigureSpec":
            given = {k.arg: k.value for k in node.keywords}
            defaults = node.args[3] if len(node.args) > 3 else given.get("defaults")
            found[ast.literal_eval(node.args[0])] = (node.args[1].id,
                                                     ast.literal_eval(defaults) if defaults is not None else {})
    return found


def _thesis_filters() -> dict:
    lines, _, _ = _parsed(f"{FIGURES_PACKAGE}.thesis")
    for node in ast.parse("".join(lines)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "THESIS_FILTERS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError("dpbench.reporting.figures.thesis declares no THESIS_FILTERS")


def _builtin_figure_fingerprint(figure_id: str) -> str:
    """``figure_fingerprint`` of a built-in figure, from the sources (the same digest)."""
    build, defaults = _builtin_declarations()[figure_id]
    functions = {**_static_closure(*_resolve(FIGURES_PACKAGE, build)), **_static_closure(FIGURES_PACKAGE, "plot")}
    return _digest([(name, code_text(text)) for name, text in functions.items()] + [("defaults", repr(defaults)),
                                              ("thesis_filters", repr(_thesis_filters().get(figure_id)))])


def modules_fingerprint(roots: tuple[str, ...]) -> str:
    """Hash of the code of some dpbench modules and everything they import (e.g. the matrix
    solvers; the audit: ``harness_closure``)."""
    return _modules_digest(harness_closure(roots))


# What a public pretraining executes (dpbench.training.pretrain): its loop, the recipes, the
# corpora's loaders, the removal of the private text, the model and the tokenizer.
PRETRAIN = ("dpbench.training.pretrain",)


def pretrain_fingerprint() -> str:
    """Hash of the code behind a pretrained checkpoint; with the recipe's key, what names it.
    It hashes the modules' text (a comment there makes the checkpoint again): the committed
    checkpoints are named by this digest, which hashing the code instead would orphan."""
    return _digest([(n, _module_file(n).read_text()) for n in module_closure(PRETRAIN)])
