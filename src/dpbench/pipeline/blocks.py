"""A grid block's own train settings: ``max_steps``, ``train_subset``, ``test_subset`` and
``validation_size`` given in a block (config key ``grid.<i>.<key>``) are that block's cells'
values over the config's ``train:`` section. A cell carries the values in which its block
differs from train: (``grid.Cell.train_settings``; ``Cell.train_section`` merges them), so its
command line, N, steps, cache files and cluster estimates are its own; its id carries a part
per such value (``id_part``), so blocks that differ only in a setting never share an id, and a
config whose blocks set none keeps its ids. Their values are checked as train:'s are
(``check_train_data``), naming the key each came from."""

from __future__ import annotations

from typing import Any

from dpbench.pipeline.configfile import ConfigError
from dpbench.training.config import RunConfig, check_data
from dpbench.training.settings import SettingError, block_settings as declared_block_settings, settings

# The train: settings a grid block may give its own values of (config key grid.<i>.<key>), over
# the config's train: section for that block's cells, in RunConfig's field order: those its
# fields declare with ``block`` (training.settings.BlockKey, the word its cells' ids carry where
# the block's value differs from train:'s: -ntrain4000; a null value, where train: sets one:
# -ntrainall, the whole set, or -Tmaxnone, no cap). A cell that takes train:'s values has no such
# part, so a config whose blocks set none keeps its ids.
BLOCK_SETTINGS = declared_block_settings(RunConfig)
_DEFAULTS = {s.name: s.default for s in settings(RunConfig) if s.name in BLOCK_SETTINGS}


def id_part(train_settings: tuple[tuple[str, Any], ...]) -> str:
    """The cell id's part of a cell's own train settings, in ``BLOCK_SETTINGS``' order:
    ``-Tmax5-ntrain4000-ntest500-nval200``; a null value (train: sets one, the block none):
    ``-Tmaxnone`` (no cap), ``-ntrainall``, ``-ntestall`` (the whole set); "" for none."""
    return "".join(BLOCK_SETTINGS[k].id_part(v) for k, v in train_settings)


def check_train_data(config: dict[str, Any], problem: str, block: dict[str, Any] | None = None,
                     where: str = "", problem_facts=None) -> None:
    """``train.train_subset``, ``test_subset`` and ``validation_size`` against the problem's
    dataset (``dpbench.training.config.check_data``: the run's own check, without torch), with
    the values a grid block (config key ``where``) gives over them; refused naming the key that
    gave the value: ``<where>.<key>`` or ``train.<key>``. ``problem_facts``: those of a problem
    reading the config's text_file (``starts.TextData.facts``)."""
    block = block or {}
    train = {**(config.get("train") or {}), **{k: block[k] for k in BLOCK_SETTINGS if k in block}}
    try:
        check_data(problem, train.get("train_subset"), train.get("test_subset"), train.get("validation_size") or 0,
                   problem_facts)
    except SettingError as exc:
        raise ConfigError(exc.as_given(lambda name: f"{where}.{name}" if name in block else f"train.{name}",
                                       "config key ")) from None


def block_settings(config: dict[str, Any], block: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A block's own values of ``BLOCK_SETTINGS`` that differ from the config's ``train:``
    section (``Cell.train_settings``): a value equal to train:'s is train:'s, so the block's
    cells (and their ids) are those of a block that leaves the key out."""
    train = config.get("train") or {}
    current = {k: _DEFAULTS[k] if train.get(k) is None else train[k] for k in BLOCK_SETTINGS}
    return tuple((k, block[k]) for k in BLOCK_SETTINGS if k in block and block[k] != current[k])
