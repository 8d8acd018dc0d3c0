"""A config file read strictly, before any of it is validated: a YAML syntax error names the
file and line, a key given twice is refused, and the files a Snakemake command line gives with
--configfile are checked the same way before Snakemake parses them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad config value; the message starts with the key's path."""


def closest(word: str, choices) -> str:
    """The end of a refusal of ``word``: the choice closest to it, else the valid choices."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(map(str, choices)))}"


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A config file's YAML, strictly: a syntax error names the file and line, a key given
    twice in one mapping (which YAML would silently resolve to the last value) is refused
    naming the key and both lines, and the top level must be a mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(filter(None, (exc.context, exc.problem)))
        raise ConfigError(f"config file {path}{where}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: YAML syntax error: {str(exc).splitlines()[0]}") from None
    if node is None:
        return {}
    _refuse_alias_bomb(node, path)
    _refuse_duplicate_keys(node, "", path, set())
    config = yaml.safe_load(text)
    if not isinstance(config, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of config keys, "
                          f"got {type(config).__name__}")
    return config


# A config expands to far fewer values than this; aliases (*name) nested in aliases grow
# exponentially (nine levels of nine: 9^9 values from a few hundred bytes), and every check
# after reading walks the expanded values.
MAX_VALUES = 1_000_000


def _refuse_alias_bomb(root, path: Path) -> None:
    """The number of values the document expands to, each node counted once per reference,
    computed once per node (so in time linear in the file): more than ``MAX_VALUES`` is
    refused naming the file, before anything walks the expansion."""
    sizes: dict[int, int] = {}

    def size(node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a recursive alias counts once
        children = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                    else node.value if isinstance(node, yaml.SequenceNode) else [])
        sizes[id(node)] = total = min(1 + sum(size(child) for child in children), MAX_VALUES + 1)
        return total

    if size(root) > MAX_VALUES:
        raise ConfigError(f"config file {path}: expands through its aliases (*name) to more than {MAX_VALUES:,} "
                          "values; a config needs far fewer: write it without nested aliases")


def _refuse_duplicate_keys(node, where: str, path: Path, seen_nodes: set[int]) -> None:
    if id(node) in seen_nodes:  # an alias of a node already checked
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.start_mark)
            here = f"{where}.{key}" if where else str(key)
            line = key_node.start_mark.line + 1
            if key in seen and key != "<<":
                raise ConfigError(f"config key {here}: given twice (lines {seen[key]} and {line}); YAML would "
                                  f"silently keep the last value: keep one ({path})")
            seen[key] = line
            _refuse_duplicate_keys(value_node, here, path, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{where}.{i}" if where else str(i), path, seen_nodes)


def configfiles_of(snakemake_args: list[str]) -> list[str]:
    """The files a Snakemake command line gives with --configfile (one or more after it, or
    --configfile=FILE)."""
    files, taking = [], False
    for arg in snakemake_args:
        if arg in ("--configfile", "--configfiles"):
            taking = True
        elif arg.startswith(("--configfile=", "--configfiles=")):
            files.append(arg.split("=", 1)[1])
            taking = False
        elif taking and not arg.startswith("-"):
            files.append(arg)
        else:
            taking = False
    return files


def check_configfiles(snakemake_args: list[str]) -> int:
    """scripts/run.sh's check before Snakemake starts: each --configfile read as the workflow
    reads it (``read_yaml``). Snakemake parses a --configfile before the Snakefile runs, and
    stops on a YAML syntax error with a message naming neither the file nor the line; this
    prints the one line that names both. Returns the exit status (0: all readable)."""
    import sys

    for path in configfiles_of(snakemake_args):
        try:
            read_yaml(path)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0
