"""Plugins: optimizers, problems and figures from other installed packages, beside the built-ins.

A plugin is a pip-installed distribution that declares Python entry points in the group
``dpbench.optimizers`` (each names an ``OptimizerSpec``), ``dpbench.problems`` (each names a
problem spec, a ``dpbench.problems.Problem``) or ``dpbench.figures`` (each names a
``dpbench.reporting.figures.FigureSpec``); the entry point's name is the id the spec carries. A
``Registry`` (``dpbench.optimizers.OPTIMIZERS``, ``dpbench.problems.PROBLEMS``,
``dpbench.reporting.figures.FIGURES``) is a read-only mapping id -> spec holding the built-ins
and, from its first read on, the plugins of its group (found with
``importlib.metadata.entry_points``, each loaded once per process).

Every loaded plugin carries its provenance (``Plugin``): distribution, version, entry point
and the SHA-256 of its source (every .py file of the top-level import package its entry point's
module lives in). A run records it (``record_of``), the code fingerprint of its cells covers
that hash (``dpbench.pipeline.fingerprint``), and ``mechanism_origin`` says whether the
optimizer's mechanism (sigma calibration, accounting) is dpbench's own class or the plugin's.

A plugin that fails is one line, ``plugin <distribution> <version>, entry point <group>:<name>:
<what is wrong>``, raised as a ``PluginError`` (a ValueError), and never stops the built-ins:

* its entry point does not import, its object is not a spec of the group's kind, or the
  spec is malformed (its id differs from the entry point's name, a field has the wrong type):
  the plugin is left out; the line is printed once to stderr, prefixed ``dpbench: warning:``,
  when the registry is first read, and raised when its id is used (``Registry.lookup``,
  config validation) and listed by ``dpbench list`` (which then exits 1);
* its id is a built-in's: the built-in keeps the id (the plugin is left out, as above, but
  using the id gives the built-in); its id is another plugin's: neither is loaded, and the id
  raises the line.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

from dpbench import log

_LOG = log.get(__name__)

ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # an id is part of file names and cell ids
BUILT_IN = "built-in"


class PluginError(ValueError):
    """A plugin that cannot be used; the message is one line naming its distribution and entry point."""

    def __init__(self, line: str, plugin_id: str):
        super().__init__(line)
        self.line, self.id = line, plugin_id


@dataclass(frozen=True)
class Group:
    """An entry-point group and the kind of spec its entry points name."""

    name: str  # the entry-point group, e.g. "dpbench.optimizers"
    kind: str  # "optimizer", "problem": the word in messages
    spec_type: type  # what each entry point's object must be an instance of
    id_field: str  # the spec's attribute holding its id ("name", "id")
    # further checks of a plugin's spec: raises ValueError saying what is malformed
    check: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class Plugin:
    """Where a plugin's spec comes from."""

    group: str
    entry_point: str  # its name: the spec's id
    value: str  # "module:attribute"
    distribution: str
    version: str
    package: str  # the top-level import package the entry point's module lives in
    source_sha256: str  # of every .py file of that package (``source_sha256``)

    @property
    def origin(self) -> str:
        return f"plugin {self.distribution} {self.version}"

    def record(self) -> dict[str, str]:
        """What a run file records of the plugin."""
        return {"distribution": self.distribution, "version": self.version, "entry_point": self.entry_point,
                "group": self.group, "value": self.value, "package": self.package,
                "source_sha256": self.source_sha256}


# id(spec) -> (spec, its Plugin): specs are compared by identity (a dataclass with a dict field
# has no hash), the spec held so that its id is never reused
_PROVENANCE: dict[int, tuple[Any, Plugin]] = {}


def plugin_of(spec: Any) -> Plugin | None:
    """The plugin a spec was loaded from; None for a built-in."""
    held = _PROVENANCE.get(id(spec))
    return held[1] if held is not None and held[0] is spec else None


def record_of(spec: Any) -> dict[str, str] | None:
    """The provenance a run records of a spec: its plugin's ``record()``, None for a built-in."""
    plugin = plugin_of(spec)
    return plugin.record() if plugin is not None else None


def mechanism_origin(mechanism: Any) -> str:
    """"built-in" where a mechanism (sigma calibration, accounting, sampling, noise) is an
    instance of one of dpbench's classes, "plugin" where its class is a plugin's own (its
    privacy claim is then the plugin's, not dpbench's)."""
    module = type(mechanism).__module__
    return BUILT_IN if module == "dpbench" or module.startswith("dpbench.") else "plugin"


def source_files(module: str) -> list[tuple[str, Path]]:
    """(relative name, path) of every .py file of the top-level import package of ``module``
    (or the module itself where it is a single file), sorted by name."""
    top = module.partition(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise ValueError(f"no importable package {top!r}")
    if spec.submodule_search_locations:  # a package (a namespace package may span folders)
        return sorted((f"{top}/{path.relative_to(root).as_posix()}", path)
                      for root in map(Path, spec.submodule_search_locations) for path in root.rglob("*.py"))
    return [(Path(spec.origin).name, Path(spec.origin))]


def source_sha256(files: list[tuple[str, Path]]) -> str:
    """SHA-256 over the files' relative names and bytes, in the given (sorted) order."""
    h = hashlib.sha256()
    for name, path in files:
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
    """The installed entry points of a group, in a stable order."""
    return sorted(importlib.metadata.entry_points(group=group),
                  key=lambda ep: (ep.name, ep.dist.name if ep.dist else "", ep.value))


def _a(word: str) -> str:
    return ("an " if word[:1] in tuple("AEIOUaeiou") else "a ") + word


def _first_line(exc: BaseException, named: bool = True) -> str:
    """An exception as one line (its message's first), by default after its type's name."""
    text = str(exc).strip().splitlines()
    if not named:
        return text[0] if text else type(exc).__name__
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load(group: Group, ep: importlib.metadata.EntryPoint) -> tuple[Any, Plugin]:
    """An entry point's spec and provenance; a PluginError (one line) where it cannot be used."""
    dist = ep.dist.name if ep.dist is not None else "(unknown distribution)"
    version = ep.dist.version if ep.dist is not None else "(unknown version)"

    def error(reason: str) -> PluginError:
        return PluginError(f"plugin {dist} {version}, entry point {group.name}:{ep.name}: {reason}", ep.name)

    try:
        spec = ep.load()
    except (Exception, SystemExit) as exc:  # whatever the plugin's import raises, the built-ins go on
        raise error(f"cannot import {ep.value} ({_first_line(exc)})") from None
    if not isinstance(spec, group.spec_type):
        raise error(f"{ep.value} is {_a(type(spec).__name__)}, not {_a(group.spec_type.__name__)}")
    spec_id = getattr(spec, group.id_field, None)
    if spec_id != ep.name:
        raise error(f"the {group.kind}'s {group.id_field} {spec_id!r} differs from the entry point's name {ep.name!r}")
    if not ID.fullmatch(ep.name):
        raise error(f"{ep.name!r} is not an id (letters, digits and _ . + -, starting with a letter or digit)")
    try:
        if group.check is not None:
            group.check(spec)
    except Exception as exc:
        raise error(f"malformed {group.spec_type.__name__}: {_first_line(exc, named=False)}") from None
    try:
        files = source_files(ep.module)
        digest = source_sha256(files)
    except (OSError, ValueError) as exc:
        raise error(f"cannot read its source to hash it ({_first_line(exc)})") from None
    package = ep.module.partition(".")[0]
    return spec, Plugin(group.name, ep.name, ep.value, dist, version, package, digest)


class Registry(Mapping):
    """id -> spec: the built-ins and, from the first read on, the plugins of ``group``."""

    def __init__(self, group: Group, builtins: Mapping[str, Any]):
        self.group = group
        self._builtins = dict(builtins)
        self._table: dict[str, Any] | None = None
        self._plugins: dict[str, Plugin] = {}
        self._errors: list[PluginError] = []
        self._loading = False

    # -- discovery ---------------------------------------------------------------------------
    def _entries(self) -> dict[str, Any]:
        if self._table is None:
            if self._loading:  # a plugin that reads the registry while it is imported sees the built-ins
                return self._builtins
            self._loading = True
            try:
                self._discover()
            finally:
                self._loading = False
        return self._table

    def _discover(self) -> None:
        loaded: dict[str, list[tuple[Any, Plugin]]] = {}
        errors: list[PluginError] = []
        for ep in entry_points(self.group.name):
            try:
                spec, plugin = load(self.group, ep)
            except PluginError as exc:
                errors.append(exc)
                continue
            loaded.setdefault(ep.name, []).append((spec, plugin))
        table, plugins = dict(self._builtins), {}
        for name, found in loaded.items():
            for spec, plugin in found:
                others = [f"{p.distribution} {p.version}" for _, p in found if p is not plugin]
                reason = (f"its id {name!r} is a built-in {self.group.kind}'s; the built-in keeps it"
                          if name in self._builtins else
                          f"its id {name!r} is also registered by {', '.join(others)}; neither is loaded"
                          if others else None)
                if reason:
                    errors.append(PluginError(f"plugin {plugin.distribution} {plugin.version}, entry point "
                                              f"{self.group.name}:{name}: {reason}", name))
                else:
                    table[name], plugins[name] = spec, plugin
                    _PROVENANCE[id(spec)] = (spec, plugin)
        self._table, self._plugins, self._errors = table, plugins, errors
        for exc in errors:
            _LOG.warning(exc.line)

    def reset(self) -> None:
        """Forget the plugins found: the next read discovers them again (tests install and
        remove plugins within one process)."""
        self._table, self._plugins, self._errors = None, {}, []

    # -- the mapping ----------------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self._entries()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())

    def __contains__(self, key: object) -> bool:
        return key in self._entries()

    def __repr__(self) -> str:
        return f"Registry({self.group.name!r}, {sorted(self._entries())})"

    # -- what else a caller asks ----------------------------------------------------------------
    @property
    def builtins(self) -> Mapping[str, Any]:
        """The built-ins alone (no discovery): what dpbench's own tests hold complete."""
        return MappingProxyType(self._builtins)

    def lookup(self, key: str) -> Any:
        """The spec of ``key``; the PluginError of a broken plugin that claimed an id no one
        holds, else a KeyError naming the choices."""
        table = self._entries()
        if key in table:
            return table[key]
        raise self.error(key) or KeyError(f"unknown {self.group.kind} {key!r}; choose one of {sorted(table)}")

    def error(self, key: str) -> PluginError | None:
        """The error of a broken plugin whose id is ``key`` and not held by any spec."""
        table = self._entries()
        return None if key in table else next((e for e in self._errors if e.id == key), None)

    @property
    def errors(self) -> list[PluginError]:
        """Every plugin of the group that was left out, in entry-point order."""
        self._entries()
        return list(self._errors)

    def plugin(self, key: str) -> Plugin | None:
        """The provenance of the spec registered under ``key``; None for a built-in."""
        self._entries()
        return self._plugins.get(key)

    def origin(self, key: str) -> str:
        """"built-in" or "plugin <distribution> <version>"."""
        plugin = self.plugin(key)
        return plugin.origin if plugin is not None else BUILT_IN
