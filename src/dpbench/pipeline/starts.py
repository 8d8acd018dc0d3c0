"""Where a grid block's cells start: a problem that starts from a public checkpoint (its facts
name a pretraining recipe: P5, P6) is trained once per fine-tuning mode of the block's
``finetune`` (mode lora once per ``lora_ranks`` entry) and, with ``scratch``, as its twin from
random initialisation; ``pretrain_recipe`` is the recipe of the checkpoint they read (the
config's ``pretrain`` section over the problem's own)."""

from __future__ import annotations

from typing import Any

from dpbench.pipeline.configfile import ConfigError, closest
from dpbench.problems import facts
from dpbench.problems.modes import DEFAULT_DIMS, DEFAULT_LORA_RANK, Finetune, check as check_mode
from dpbench.training.recipes import RECIPES, Recipe, from_json as recipe_from_json

# the tokens a fine-tuning problem's model reads (P4's records: dpbench.problems.language.CONTEXT)
CONTEXT = DEFAULT_DIMS["context"]
# grid key finetune: the modes, and the twin of a fine-tuning problem trained from random initialisation
SCRATCH = "scratch"


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
              problem: str) -> list[tuple[str | None, int | None, Recipe | None]]:
    """(finetune, lora_rank, recipe) of each start of a block's problem (``Cell``'s last fields):
    its ``finetune`` modes (by default ``full``; ``scratch``: the twin from random
    initialisation), mode lora once per ``lora_ranks`` entry (by default ``DEFAULT_LORA_RANK``);
    a problem that starts from no checkpoint has one start, (None, None, None), and refuses the keys."""
    modes_given, ranks = block.get("finetune"), block.get("lora_ranks")
    if facts(problem).pretrained is None:
        for key in ("finetune", "lora_ranks"):
            if block.get(key) is not None:
                raise ConfigError(f"config key {where}.{key}: problem {problem} trains from scratch (its facts name "
                                  "no pretraining recipe); fine-tuning applies to problems that start from a public "
                                  "checkpoint (P5, P6): give them a block of their own")
        return [(None, None, None)]
    modes_given = modes_given or ["full"]
    if ranks is not None and "lora" not in modes_given:
        raise ConfigError(f"config key {where}.lora_ranks: ranks belong to mode lora, which {where}.finetune "
                          f"({', '.join(modes_given)}) does not train")
    recipe = pretrain_recipe(config, problem)
    starts = []
    for mode in modes_given:
        if mode == SCRATCH:
            starts.append((SCRATCH, None, None))
        elif mode == "lora":
            for i, r in enumerate(ranks or [DEFAULT_LORA_RANK]):
                try:
                    check_mode(Finetune("lora", r), recipe.model_dims)
                except ValueError as exc:
                    raise ConfigError(f"config key {where}.lora_ranks.{i}: {exc} (recipe {recipe.name})") from None
                starts.append(("lora", int(r), recipe))
        else:
            starts.append((mode, None, recipe))
    return starts
