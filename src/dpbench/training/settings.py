"""What a run setting is: a field of ``RunConfig`` declared with ``setting``, which carries
everything the package does with it, so that adding a setting is one field plus its use.

A setting's field metadata holds
* its value type (``ValueType``): what reads the flag's text, checks a value given in Python or
  a config, and writes the value back as text (``positive_float``, ``probability``, ...);
* its flag of ``dpbench train`` (``--`` and the name with hyphens, unless given) and its help:
  the command's options are made from the fields (``dpbench.cli.arguments.add_settings``);
* its scope: ``cell`` (a grid cell's own value: ``pipeline.grid.Cell``), ``train`` (a key of a
  workflow config's ``train:`` section, which the config schema holds too: a test holds the
  two to each other) or ``command`` (given where ``dpbench train`` is called: on the command
  line, or by the workflow's rule for every cell);
* ``always``: written on a cell's command line even at its default (``to_args``);
* its place in the grid: a ``cell`` setting is a grid axis, each cell's own value; a ``train``
  setting declared with ``block`` (a ``BlockKey``: the word of its part of a cell id) is one a
  grid block may give its own value of (``pipeline.blocks``); both are ``configuration`` keys
  (what a run is, apart from its seed: runs that differ in one are never pooled as seeds of one
  configuration, ``reporting.figures.selection.CONFIG_KEYS``) unless declared otherwise.

The pipeline's block settings and id parts, the runs table's setting columns and the figures'
configuration keys are read from these declarations (``block_settings``,
``configuration_keys``), never listed by hand: a new axis is one field plus its use.

``to_args`` writes a config's settings as ``dpbench train`` arguments, ``SettingError`` is a
refused value naming its setting, which the command line shows as a flag and the config
check as a config key. Standard library only: the workflow reads settings without torch.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable

from dpbench.privacy.accounting import MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER

SCOPES = ("cell", "train", "command")


class SettingError(ValueError):
    """A setting's value refused: ``name`` is the field, ``reason`` the rest of the line, in
    which a backquoted field name (`train_subset`) stands for another setting. ``str`` names
    settings by their fields; ``as_given`` as the reader gave them (a flag, a config key)."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason
        super().__init__(self.as_given(lambda n: n))

    def as_given(self, named: Callable[[str], str], prefix: str = "") -> str:
        """The one-line message with each setting as ``named`` calls it, e.g. ``--train-subset``."""
        return f"{prefix}{named(self.name)}: " + re.sub(r"`(\w+)`", lambda m: named(m.group(1)), self.reason)


@dataclass(frozen=True)
class ValueType:
    """The values a setting takes. ``what`` says them ("a finite positive number"); ``parse``
    reads a flag's text (ValueError: "expected <what>, got '<text>'"); ``ok`` checks a value
    given in Python or a config; ``text`` writes a value as the text ``parse`` reads back.
    Each raises ValueError, which the command line shows naming the flag (cli.arguments)."""

    what: str
    parse: Callable[[str], Any]
    ok: Callable[[Any], bool]
    text: Callable[[Any], str] = str
    choices: tuple[str, ...] = ()  # where the values are a few words (shown in the usage)

    def check(self, name: str, value: Any) -> None:
        if not self.ok(value):
            raise SettingError(name, f"expected {self.what}, got {value!r}")


def _number(kind: type, ok: Callable[[Any], bool], what: str) -> ValueType:
    """A finite number (``kind``: int or float) for which ``ok`` holds."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"expected {what}, got {text!r}") from None
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"expected {what}, got {text!r}")
        return value

    numbers_of_kind = numbers.Integral if kind is int else numbers.Real
    return ValueType(what, parse, lambda v: (isinstance(v, numbers_of_kind) and not isinstance(v, bool)
                                             and math.isfinite(v) and ok(v)))


positive_float = _number(float, lambda x: x > 0, "a finite positive number")  # epsilon, lr, C, seconds
nonnegative_float = _number(float, lambda x: x >= 0, "a finite number >= 0")  # seconds between checkpoints
# a given sigma: 0 (no noise) or within the range the accountants compute (privacy.accounting)
noise_multiplier = _number(float, lambda x: x == 0 or MIN_NOISE_MULTIPLIER <= x <= MAX_NOISE_MULTIPLIER,
                           f"a finite number, 0 (no noise) or from {MIN_NOISE_MULTIPLIER:g} to {MAX_NOISE_MULTIPLIER:g}")
probability = _number(float, lambda x: 0 < x < 1, "a finite number in (0, 1)")  # delta
positive_int = _number(int, lambda n: n > 0, "a positive integer")
nonnegative_int = _number(int, lambda n: n >= 0, "an integer >= 0")  # a seed: SeedSequence takes no negative entropy
MAX_AUDIT_SEED = 2**63 - 1  # the largest seed an audit's record holds (an int64 column)
audit_seed = _number(int, lambda n: 0 <= n <= MAX_AUDIT_SEED, "an integer from 0 to 2**63 - 1")  # an audit's seed
text = ValueType("a text", str, lambda v: isinstance(v, str))
path = ValueType("a path", str, lambda v: isinstance(v, (str, os.PathLike)))
switch = ValueType("true or false", lambda t: t, lambda v: isinstance(v, bool))  # its flag flips the default


def choice(values: tuple[str, ...]) -> ValueType:
    what = "one of " + ", ".join(values)

    def parse(t: str) -> str:
        if t not in values:
            raise ValueError(f"expected {what}, got {t!r}")
        return t

    return ValueType(what, parse, lambda v: v in values, choices=values)


def _hp_text(value: Any) -> str:
    """A hyperparameter value as ``--hp KEY=VALUE`` reads it back exactly (JSON, so true stays
    a bool and 0.30000000000000004 a float; a plain word as itself)."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError:
            return value
    return json.dumps(value)


def _hyperparameter(text_: str) -> tuple[str, object]:
    key, sep, value = text_.partition("=")
    if not sep or not key:
        raise ValueError(f"--hp expects KEY=VALUE, got {text_!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


# One KEY=VALUE pair of an optimizer's hyperparameters (a repeated flag: the field is their dict;
# their names and values are the optimizer spec's to check).
hyperparameter = ValueType("KEY=VALUE", _hyperparameter, lambda kv: isinstance(kv, tuple) and len(kv) == 2,
                           lambda kv: f"{kv[0]}={_hp_text(kv[1])}")



def _tuning(text_: str) -> dict:
    """``--tuning``: a JSON object with the search's distribution, mean, shape, repetitions and
    candidate (dpbench.training.tuning), checked here so that a bad one stops before any work."""
    from dpbench.privacy.tuning import Candidate

    try:
        value = json.loads(text_)
    except json.JSONDecodeError:
        raise ValueError(f"expected a JSON object, got {text_!r}") from None
    Candidate.parse(value, drawn=True)  # the one parser of a candidate: its keys, search, K and j
    return value


search_candidate = ValueType("a search's candidate (JSON)", _tuning, lambda v: isinstance(v, dict),
                   lambda v: json.dumps(v, sort_keys=True))


def _device(text_: str) -> str:
    """auto, cpu, or a device torch has here (cuda needs a CUDA GPU: checked now, not after
    the data is loaded)."""
    if text_ in ("auto", "cpu"):
        return text_
    from dpbench.training.cuda import resolve_device

    try:
        resolve_device(text_)
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    return text_


torch_device = ValueType("auto, cpu or a CUDA device", _device, lambda v: isinstance(v, str))


@dataclass(frozen=True)
class BlockKey:
    """A ``train`` setting that a grid block may give its own value of (config key
    ``grid.<i>.<name>``, over the config's ``train:`` section for that block's cells): where the
    block's value differs from train:'s, the cells' ids carry ``-<word><value>`` (``-ntrain4000``),
    ``-<word><null>`` for no value (``-ntrainall``: the whole set; ``-Tmaxnone``: no cap)."""

    word: str
    null: str = "all"

    def id_part(self, value: Any) -> str:
        return f"-{self.word}{self.null if value is None else value}"


def setting(default: Any = MISSING, *, type: ValueType, help: str, scope: str, flag: str | None = None,  # noqa: A002
            metavar: str | None = None, always: bool = False, repeated: bool = False,
            block: BlockKey | None = None, configuration: bool | None = None,
            default_factory: Callable[[], Any] | Any = MISSING) -> Any:
    """A field of ``RunConfig``: its default (none: the flag is required), value type, help and
    scope (``SCOPES``); ``flag`` where it is not ``--`` and the name with hyphens; ``repeated``:
    the flag is given once per item of the field's dict (``--hp``); ``always``: written on a
    cell's command line even at its default (a changed command line reruns a cell); ``block``:
    a grid block may set this ``train`` setting for its cells (``BlockKey``); ``configuration``:
    whether it tells configurations apart (by default: a ``cell`` setting or a block's)."""
    assert scope in SCOPES, scope
    assert block is None or scope == "train", "a grid block sets train settings only"
    if configuration is None:
        configuration = scope == "cell" or block is not None
    meta = {"type": type, "help": help, "scope": scope, "flag": flag, "metavar": metavar, "always": always,
            "repeated": repeated, "block": block, "configuration": configuration}
    return field(default=default, default_factory=default_factory, metadata=meta)


@dataclass(frozen=True)
class Setting:
    """One setting as read from its field."""

    name: str
    type: ValueType
    help: str
    scope: str
    flag: str
    metavar: str | None
    always: bool
    repeated: bool
    default: Any  # MISSING where the setting is required
    block: BlockKey | None  # a grid block may set it (its id word)
    configuration: bool  # a configuration key: runs that differ in it are different configurations

    @property
    def required(self) -> bool:
        return self.default is MISSING


def settings(cls) -> list[Setting]:
    """The settings of a dataclass whose fields are made by ``setting``, in field order."""
    return [_setting(f) for f in fields(cls)]


def _setting(f: Field) -> Setting:
    m = f.metadata
    default = f.default if f.default is not MISSING else (
        f.default_factory() if f.default_factory is not MISSING else MISSING)
    return Setting(f.name, m["type"], m["help"], m["scope"], m["flag"] or "--" + f.name.replace("_", "-"),
                   m["metavar"], m["always"], m["repeated"], default, m["block"], m["configuration"])


def block_settings(cls) -> dict[str, BlockKey]:
    """The ``train`` settings a grid block may set, in field order: name -> its ``BlockKey``."""
    return {s.name: s.block for s in settings(cls) if s.block is not None}


def configuration_keys(cls) -> tuple[str, ...]:
    """The settings that tell configurations apart (what a run is, apart from its seed), in
    field order: the grid's axes (``cell`` settings) and the settings a block may set."""
    return tuple(s.name for s in settings(cls) if s.configuration)


def flag_of(cls, name: str) -> str:
    """The ``dpbench train`` flag of setting ``name``."""
    return next(s.flag for s in settings(cls) if s.name == name)


def to_args(config) -> list[str]:
    """A settings dataclass as ``dpbench train`` arguments, in field order: each setting away
    from its default (or ``always``), a switch as its flag, a repeated setting once per item."""
    args: list[str] = []
    for s in settings(type(config)):
        value = getattr(config, s.name)
        if value is None or (value == s.default and not s.always):
            continue
        if s.type is switch:
            args.append(s.flag)  # the switch's flag flips its default
        elif s.repeated:
            for item in value.items():
                args += [s.flag, s.type.text(item)]
        else:
            args += [s.flag, s.type.text(value)]
    return args


def check_values(config) -> None:
    """Each setting's value against its value type (None: not given); SettingError names the first bad one."""
    for s in settings(type(config)):
        value = getattr(config, s.name)
        if value is None:
            continue
        for item in (value.items() if s.repeated else [value]):
            s.type.check(s.name, item)
