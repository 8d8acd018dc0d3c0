"""A grid axis is one RunConfig field and its declaration: the pipeline's block settings and
their id parts, the schema's grid-block keys, the runs table's setting columns, the per-epoch
table's run columns and the figures' configuration keys are read from RunConfig's fields
(dpbench.training.settings: scope, ``block``, ``configuration``), never listed by hand.

The second test declares two throwaway fields in a fresh interpreter (a RunConfig with them,
put in place before the pipeline and the reporting modules are imported) and follows them to
every place that used to hold a hand-kept list: it fails as soon as one of those lists is kept
by hand again."""

import subprocess
import sys
import textwrap

from conftest import REPO, tree_env
from dpbench.pipeline import blocks, grid
from dpbench.reporting import aggregate
from dpbench.reporting.figures.selection import CONFIG_KEYS
from dpbench.training.config import RunConfig
from dpbench.training.settings import BlockKey, block_settings, configuration_keys, settings


def test_the_grids_lists_are_runconfigs_declarations():
    declared = {s.name: s for s in settings(RunConfig)}
    assert blocks.BLOCK_SETTINGS == block_settings(RunConfig) == {
        "max_steps": BlockKey("Tmax", "none"), "train_subset": BlockKey("ntrain"), "test_subset": BlockKey("ntest"),
        "validation_size": BlockKey("nval")}
    assert all(declared[k].scope == "train" for k in blocks.BLOCK_SETTINGS)
    # the configuration keys: the grid's axes but the seed and a search's candidate, and the block settings
    assert configuration_keys(RunConfig) == (
        "problem", "optimizer", "lr", "batch_size", "epochs", "epsilon", "hyperparameters", "finetune", "lora_rank",
        "max_steps", "train_subset", "test_subset", "validation_size", "lr_schedule")
    assert CONFIG_KEYS == (*configuration_keys(RunConfig), "checkpoint_sha256")
    assert aggregate.DATA_KEYS == tuple(blocks.BLOCK_SETTINGS)
    assert list(aggregate.SETTING_COLUMNS) == [s for s in declared if s in configuration_keys(RunConfig) or s == "seed"]
    assert aggregate.SETTING_COLUMNS["epsilon"] == "target_epsilon"
    schema = grid.config_schema()
    train, block = schema["properties"]["train"]["properties"], schema["properties"]["grid"]["items"]["properties"]
    for key in blocks.BLOCK_SETTINGS:  # train:'s values, without its default (a block that leaves it out takes train:'s)
        assert block[key]["type"] == train[key]["type"] and "default" not in block[key]


# Two throwaway settings: a train setting a grid block may set (id word "wd") and a grid axis of
# the cell's own (a configuration key). The config schema's train: section holds every train
# setting (a test holds the two together), so the new one's key is added to a copy of it.
NEW_AXES = textwrap.dedent('''
    import dataclasses, json, shutil, sys
    from pathlib import Path

    import yaml

    from dpbench.training import config, settings
    from dpbench.training.settings import BlockKey, nonnegative_float, setting, text


    @dataclasses.dataclass(frozen=True)
    class RunConfig(config.RunConfig):
        weight_decay: float = setting(0.0, type=nonnegative_float, scope="train", block=BlockKey("wd"),
                                      help="a throwaway train setting a grid block may set")
        colour: str = setting("red", type=text, scope="cell", help="a throwaway grid axis of the cell's own")


    config.RunConfig = RunConfig  # before anything below reads the declarations
    from dpbench.pipeline import blocks, grid
    from dpbench.reporting import aggregate
    from dpbench.reporting.figures import selection

    schema = yaml.safe_load(grid.SCHEMA_PATH.read_text())
    schema["properties"]["train"]["properties"]["weight_decay"] = {"type": "number", "minimum": 0, "default": 0.0}
    grid.SCHEMA_PATH = Path(sys.argv[1])
    grid.SCHEMA_PATH.write_text(yaml.safe_dump(schema))
    block = {"problems": ["P2"], "batch_sizes": [64], "epochs": [1], "epsilons": [1], "optimizers": {"dpsgd": {"lr": 1}}}
    cells = grid.expand(grid.validate({"grid": [block, {**block, "weight_decay": 0.5}]}))
    refused = ""
    try:
        grid.validate({"grid": [{**block, "weight_decay": -1}]})
    except grid.ConfigError as exc:
        refused = str(exc)
    print(json.dumps({"block_settings": list(blocks.BLOCK_SETTINGS), "data_keys": list(aggregate.DATA_KEYS),
                      "run_keys": aggregate.RUN_KEYS, "config_keys": list(selection.CONFIG_KEYS),
                      "ids": [c.id for c in cells], "args": [c.train_args({}) for c in cells], "refused": refused}))
''')


def test_a_new_axis_is_one_field_and_its_declaration(tmp_path):
    out = subprocess.run([sys.executable, "-c", NEW_AXES, str(tmp_path / "schema.yaml")], cwd=REPO, env=tree_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    got = json.loads(out.stdout.splitlines()[-1])
    assert got["block_settings"][-1] == got["data_keys"][-1] == "weight_decay"
    assert {"weight_decay", "colour"} <= set(got["run_keys"]) and {"weight_decay", "colour"} <= set(got["config_keys"])
    # a block's own value: its cells' id part and command line; train:'s value: neither (the ids stay)
    assert got["ids"] == ["P2/dpsgd/L64-E1-eps1-lr1-s0", "P2/dpsgd/L64-E1-eps1-lr1-wd0.5-s0"]
    assert "--weight-decay" not in got["args"][0] and got["args"][1][-2:] == ["--weight-decay", "0.5"]
    assert got["refused"].startswith("config key grid.0.weight_decay: -1 is less than the minimum of 0")


def test_two_cells_of_one_id_are_told_apart_by_every_field_that_differs():
    a = grid.Cell("P2", "dpmatrix-band", 64, 1, 1.0, 0.5, 0, 7, (("bands", "8"),), train_settings=(("max_steps", 5),))
    b = grid.Cell("P2", "dpmatrix-band", 64, 1, 1.0, 0.5, 0, 7, (("bands", 8),), train_settings=(("max_steps", "5"),))
    assert a.id == b.id
    assert grid._difference(a, b) == "bands values '8' and 8, max_steps values 5 and '5'"
