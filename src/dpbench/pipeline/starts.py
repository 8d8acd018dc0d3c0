"""Where a grid block's cells start: a problem that starts from a public checkpoint (its facts
name a pretraining recipe: P5, P6) is trained once per fine-tuning mode of the block's
``finetune`` (``dpbench.problems.modes.starts``: mode lora once per ``lora_ranks`` entry) and,
with ``scratch``, as its twin from random initialisation; ``pretrain_recipe`` is the recipe of
the checkpoint they read (the config's ``pretrain`` section over the problem's own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from dpbench.data.dataset import DataError
from dpbench.data.labelled_text import LocalFile, load
from dpbench.pipeline.configfile import ConfigError, closest
from dpbench.problems import facts
from dpbench.problems import modes
from dpbench.problems.architectures import DEFAULT_DIMS
from dpbench.training.recipes import RECIPES, Recipe, from_json as recipe_from_json

# the tokens a fine-tuning problem's model reads (P4's records: dpbench.problems.language.CONTEXT)
CONTEXT = DEFAULT_DIMS["context"]
# grid key finetune: the modes, and the twin of a fine-tuning problem trained from random initialisation
SCRATCH = modes.SCRATCH
# a block's keys of the modes' options: their values are lists (lora_ranks: each a start)
OPTION_KEYS = {"lora_rank": "lora_ranks"}


@dataclass(frozen=True)
class EncoderDirectory:
    """The local encoder directory a config names (``pretrained_dir``) for encoder problems'
    fine-tuning cells, and its config.json's dimensions (read without torch: d of each mode)."""

    path: str
    model_dims: dict = field(compare=False)
    name: str = "pretrained_dir"


def encoder_directory(config: dict[str, Any]) -> EncoderDirectory | None:
    """The config's ``pretrained_dir``, checked (an encoder directory: one line naming the file)."""
    path = config.get("pretrained_dir")
    if path is None:
        return None
    from dpbench.problems.architectures import encoder_dims
    from dpbench.problems.encoders import EncoderError, config_facts

    try:
        found = config_facts(path)
    except EncoderError as exc:
        raise ConfigError(f"config key pretrained_dir: {exc}") from None
    return EncoderDirectory(str(path), encoder_dims(found))


@dataclass(frozen=True)
class TextData:
    """The user's labelled text file a config names (``text_file``: ``path`` and its columns) for
    encoder problems' fine-tuning cells, read and checked when the config is read: its SHA-256
    (a param of every cell reading it: a changed file reruns them), its name, sizes and classes
    (the grid's N and d: a matrix mechanism is keyed by N, the head's width by the classes)."""

    path: str
    text: str | None
    label: str | None
    text_pair: str | None
    sha256: str
    name: str
    train_size: int
    test_size: int
    classes: tuple[str, ...]

    def facts(self, problem_facts):
        """An encoder problem's facts with this file's records in place of its own."""
        from dataclasses import replace

        return replace(problem_facts, dataset=self.name, train_size=self.train_size, test_size=self.test_size,
                       classes=self.classes)

    def settings(self) -> dict[str, str | None]:
        """The ``dpbench train`` settings that read this file (``RunConfig``'s)."""
        return {"text_file": self.path, "text_column": self.text, "label_column": self.label,
                "text_pair_column": self.text_pair, "text_sha256": self.sha256}


def text_data(config: dict[str, Any]) -> TextData | None:
    """The config's ``text_file``, read and checked (one line naming the key, the file and the
    column or row), or None."""
    given = config.get("text_file")
    if given is None:
        return None
    key = (given["path"], given.get("text"), given.get("label"), given.get("text_pair"))
    try:
        stat = Path(given["path"]).expanduser().stat()
        return _read_text_data(*key, stat.st_mtime_ns, stat.st_size)
    except (DataError, OSError) as exc:
        message = str(exc) if isinstance(exc, DataError) else f"{given['path']}: no such file"
        raise ConfigError(f"config key text_file: {message}") from None


@lru_cache(maxsize=8)
def _read_text_data(path, text, label, text_pair, _mtime_ns, _size) -> TextData:
    """Read once per process and file version (a workflow reads its config once per job)."""
    data = load(LocalFile(path, text=text, label=label, text_pair=text_pair))
    return TextData(str(path), text, label, text_pair, data.sha256, data.name, len(data.train), len(data.test),
                    data.classes)


def pretrain_recipe(config: dict[str, Any], problem: str | None) -> Recipe:
    """The pretraining recipe of a problem's fine-tuning cells: the config's ``pretrain.recipe``,
    else the one its facts name (one of ``RECIPES``), with the config's ``pretrain.fields`` in
    place of the named recipe's; refused naming the key: an unknown recipe or field, a bad value,
    a model whose context is shorter than the records the problems read."""
    section = config.get("pretrain") or {}
    given = section.get("recipe")
    name = given or facts(problem).pretrained
    if name not in RECIPES:
        where = "pretrain.recipe" if given else "pretrain"
        raise ConfigError(f"config key {where}: unknown pretraining recipe {name!r}"
                          f"{'' if given else f' (problem {problem} names it)'} ({closest(name, RECIPES)})")
    changes = section.get("fields") or {}
    if not changes:
        recipe = RECIPES[name]
    else:
        unknown = sorted(set(changes) - (set(RECIPES[name].to_json()) - {"name"}))
        if unknown:
            raise ConfigError(f"config key pretrain.fields.{unknown[0]}: not a field of a recipe "
                              f"({closest(unknown[0], set(RECIPES[name].to_json()) - {'name'})})")
        try:
            recipe = recipe_from_json({**RECIPES[name].to_json(), **changes, "name": name})
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"config key pretrain.fields: {exc}") from None
    if recipe.context < CONTEXT:
        raise ConfigError(f"config key {'pretrain.fields' if 'context' in changes else 'pretrain.recipe'}: recipe "
                          f"{name}'s model reads {recipe.context} tokens, fewer than the {CONTEXT} of the fine-tuning "
                          f"problems' records (set pretrain.fields.context: {CONTEXT})")
    return recipe


def starts_of(config: dict[str, Any], block: dict[str, Any], where: str,
              problem: str) -> list[tuple[modes.Start | None, Recipe | EncoderDirectory | None]]:
    """(start, recipe) of each start of a block's problem (``Cell``'s last fields): its
    ``finetune`` modes (by default ``full``; ``scratch``: the twin from random initialisation),
    each once per value of its options (``lora_ranks``: by default the mode's own); a problem
    that starts from no checkpoint has one start, (None, None), and refuses the keys."""
    given = {setting: block.get(key) for setting, key in OPTION_KEYS.items()}
    if facts(problem).pretrained is None:
        for key in ("finetune", *OPTION_KEYS.values()):
            if block.get(key) is not None:
                raise ConfigError(f"config key {where}.{key}: problem {problem} trains from scratch (its facts name "
                                  "no pretraining recipe); fine-tuning applies to problems that start from a public "
                                  "checkpoint (P5, P6, P7): give them a block of their own")
        return [(None, None)]
    names = block.get("finetune") or [modes.Full.name]  # the default: every parameter
    for setting, values in given.items():
        owners = [n for n in names if n in modes.MODES and setting in modes.MODES[n].options.values()]
        if values is not None and not owners:
            owner = next(n for n, c in modes.MODES.items() if setting in c.options.values())
            raise ConfigError(f"config key {where}.{OPTION_KEYS[setting]}: {OPTION_KEYS[setting]} belong to mode {owner}, which "
                              f"{where}.finetune ({', '.join(names)}) does not train")
    # a pretraining recipe's checkpoint (P5, P6), or an encoder problem's local encoder directory
    # (the config's pretrained_dir) or catalogued encoder (recipe None)
    recipe = (pretrain_recipe(config, problem) if facts(problem).family == "transformer-lm"
              else encoder_directory(config))
    arch = facts(problem).architecture(recipe.model_dims if recipe else None)
    out = []
    for start in modes.starts(names, given):
        if start.public:
            try:
                start.mode.check(arch)
            except ValueError as exc:
                # the mode's option that does not fit (LoRA's rank), by its block key and its index there
                key, index = "finetune", None
                for field_, setting in start.mode.options.items():
                    key = OPTION_KEYS[setting]
                    if given.get(setting) is not None:
                        index = list(given[setting]).index(getattr(start.mode, field_))
                raise ConfigError(f"config key {where}.{key}{'' if index is None else f'.{index}'}: {exc} "
                                  f"({f'recipe {recipe.name}' if recipe else facts(problem).pretrained})") from None
        out.append((start, recipe if start.public else None))
    return out
