"""Per-block settings: a grid block's own max_steps, train_subset, test_subset and
validation_size, over the config's train: section for that block's cells alone.

Each reader of a cell's settings takes the block's values: the run's command line, N (so q,
the steps, a matrix mechanism's cache key), the cluster's estimates, the data checks; a cell
that takes train:'s values keeps its id, and one that does not has a part naming its value;
the figures never pool runs on different data as seeds of one configuration."""

import copy
import shlex
import sys
import textwrap

import pandas as pd
import pytest

from conftest import REPO
from dpbench.pipeline import cluster
from dpbench.pipeline.grid import BLOCK_SETTINGS, Cell, ConfigError, expand, load_config, validate
from dpbench.pipeline.jobs import plan
from dpbench.problems import PROBLEMS, facts
from dpbench.reporting import aggregate
from dpbench.reporting.figures.selection import CONFIG_KEYS, select_best_config


def block(problems, optimizer="dpsgd", lr=1.0, L=64, E=1, **settings):
    return {"problems": problems, "batch_sizes": [L], "epochs": [E], "epsilons": [1],
            "optimizers": {optimizer: {"lr": lr}}, **settings}


def by_problem(cells):
    return {c.problem: c for c in cells}


def test_a_blocks_settings_reach_the_command_line_n_and_the_cluster_estimates():
    config = validate({"train": {"validation_size": 100}, "grid": [
        block(["P2"], train_subset=4000, test_subset=500, max_steps=5, validation_size=200),
        block(["P4"])]})
    cells = by_problem(expand(config))
    p2, p4 = cells["P2"], cells["P4"]
    assert p2.train_settings == (("max_steps", 5), ("train_subset", 4000), ("test_subset", 500),
                                 ("validation_size", 200))
    assert p2.id == "P2/dpsgd/L64-E1-eps1-lr1-Tmax5-ntrain4000-ntest500-nval200-s0"
    assert p4.train_settings == () and p4.id == "P4/dpsgd/L64-E1-eps1-lr1-s0"
    # N = 4000 drawn - 200 held out; P4: all its records (and canaries) less train:'s 100 held out
    assert p2.n_train(config["train"]) == 3800
    assert p4.n_train(config["train"]) == facts("P4").n_train() - 100
    jobs = plan(config, None, False)
    args = shlex.split(jobs.train_args(p2))
    for flag, value in (("--max-steps", "5"), ("--train-subset", "4000"), ("--test-subset", "500"),
                        ("--validation-size", "200")):
        assert args[args.index(flag) + 1] == value
    args4 = shlex.split(jobs.train_args(p4))
    assert "--train-subset" not in args4 and "--max-steps" not in args4
    assert args4[args4.index("--validation-size") + 1] == "100"
    run = p2.run_config(config["train"])
    assert (run.max_steps, run.train_subset, run.test_subset, run.validation_size) == (5, 4000, 500, 200)
    # the cluster's estimates: as for a config whose train: section sets the block's values
    same = {**config["train"], "max_steps": 5, "train_subset": 4000, "test_subset": 500, "validation_size": 200}
    plain = Cell("P2", "dpsgd", 64, 1, 1.0, 1.0, 0, p2.seed)
    assert cluster.compute_seconds(p2, config["train"], on_gpu=False) == cluster.compute_seconds(plain, same,
                                                                                                  on_gpu=False)
    assert cluster.memory_mb(p2, config["train"]) == cluster.memory_mb(plain, same) < cluster.memory_mb(plain, {})
    # five steps: far less than the round(60,000 / 64) of train:'s settings
    assert cluster.compute_seconds(p2, config["train"], on_gpu=False) < cluster.compute_seconds(
        plain, config["train"], on_gpu=False) / 50


def test_a_matrix_mechanisms_cache_key_is_that_of_the_blocks_n():
    """A dense matrix mechanism's factorization is of T = E N / L steps: the block's subset
    gives its cells the files of N = 4000, never those of the whole training set."""
    optimizer = {"dpmatrix-band": {"lr": 1.0, "bands": 4}}
    blocks = [{**block(["P2"], L=500, train_subset=4000), "optimizers": optimizer},
              {**block(["P2"], L=500), "optimizers": optimizer}]
    config = validate({"grid": blocks})
    subset, whole = sorted(expand(config), key=lambda c: len(c.id), reverse=True)
    assert "-ntrain4000" in subset.id and whole.train_settings == ()
    as_train = validate({"train": {"train_subset": 4000}, "grid": [blocks[1]]})
    files = subset.cache_files(config["train"], "cache")
    assert files == expand(as_train)[0].cache_files(as_train["train"], "cache")
    assert files["factorization"] != whole.cache_files(config["train"], "cache")["factorization"]


PROBLEM = """
import dataclasses

from dpbench.problems.images import P2

# a plugin's small problem: 469 training examples (the model and data of P2, for the grid's sake)
SPEC = dataclasses.replace(P2, facts=dataclasses.replace(P2.facts, id="small469", train_size=469, test_size=100))
"""


@pytest.fixture
def small_problem(tmp_path, monkeypatch):
    """A plugin problem of 469 training examples, installed as a distribution in a folder on
    sys.path (as tests/plugins/test_plugins.py installs its fakes)."""
    site = tmp_path / "site"
    (site / "smallproblem").mkdir(parents=True)
    (site / "smallproblem" / "__init__.py").write_text("")
    (site / "smallproblem" / "problem.py").write_text(textwrap.dedent(PROBLEM))
    info = site / "small_problem-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: small-problem\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[dpbench.problems]\nsmall469 = smallproblem.problem:SPEC\n")
    monkeypatch.syspath_prepend(str(site))
    PROBLEMS.reset()
    yield "small469"
    for name in [m for m in sys.modules if m.split(".")[0] == "smallproblem"]:
        del sys.modules[name]
    PROBLEMS.reset()


def test_a_469_example_problem_shares_a_config_with_a_p2_block_on_a_subset(small_problem):
    grid = [block([small_problem], L=32, validation_size=69), block(["P2"], L=256, train_subset=4000)]
    # train: giving the subset to all refuses the small problem, naming the key
    with pytest.raises(ConfigError, match=r"^config key train\.train_subset: 4000 is above the 469 training "
                                          r"examples of fashion-mnist$"):
        validate({"train": {"train_subset": 4000}, "grid": copy.deepcopy(grid[:1])})
    config = validate({"grid": grid})
    cells = by_problem(expand(config))
    small, p2 = cells[small_problem], cells["P2"]
    assert small.id == "small469/dpsgd/L32-E1-eps1-lr1-nval69-s0" and small.n_train(config["train"]) == 400
    assert p2.id == "P2/dpsgd/L256-E1-eps1-lr1-ntrain4000-s0" and p2.n_train(config["train"]) == 4000
    jobs = plan(config, None, False)
    assert "--train-subset" not in jobs.train_args(small) and "--validation-size 69" in jobs.train_args(small)
    assert "--train-subset 4000" in jobs.train_args(p2) and "--validation-size" not in jobs.train_args(p2)
    # each run's sample rate is L / N of its own N: 32 / 400 and 256 / 4000
    assert small.run_config(config["train"]).train_subset is None
    assert cluster.planned_steps(small_problem, 32, 1, small.train_section(config["train"])) == round(400 / 32)
    assert cluster.planned_steps("P2", 256, 1, p2.train_section(config["train"])) == round(4000 / 256)
    # a block's subset is checked against its own problems
    with pytest.raises(ConfigError, match=r"^config key grid\.0\.train_subset: 500 is above the 469 training "
                                          r"examples of fashion-mnist$"):
        validate({"grid": [block([small_problem], L=32, train_subset=500)]})


def test_a_value_equal_to_trains_is_trains_one_cell_one_id():
    train = {"train_subset": 4000, "validation_size": 100}
    left_out = expand(validate({"train": train, "grid": [block(["P2"])]}))
    repeated = expand(validate({"train": train, "grid": [block(["P2"], train_subset=4000, validation_size=100)]}))
    assert repeated == left_out and left_out[0].train_settings == ()
    assert left_out[0].id == "P2/dpsgd/L64-E1-eps1-lr1-s0"
    # null where train: sets a value: the whole set, no cap
    whole = expand(validate({"train": {**train, "max_steps": 10}, "grid": [block(["P2"], train_subset=None,
                                                                                 max_steps=None)]}))[0]
    assert whole.id == "P2/dpsgd/L64-E1-eps1-lr1-Tmaxnone-ntrainall-s0"
    run = whole.run_config({**train, "max_steps": 10})
    assert run.train_subset is None and run.max_steps is None and "--train-subset" not in run.to_args()
    assert whole.n_train(train) == 60_000 - 100


def test_blocks_that_differ_only_in_a_setting_train_different_cells():
    config = validate({"grid": [block(["P2"], train_subset=4000), block(["P2"], train_subset=8000), block(["P2"])]})
    cells = expand(config)
    assert [c.id for c in cells] == ["P2/dpsgd/L64-E1-eps1-lr1-ntrain4000-s0", "P2/dpsgd/L64-E1-eps1-lr1-ntrain8000-s0",
                                     "P2/dpsgd/L64-E1-eps1-lr1-s0"]
    assert [c.n_train(config["train"]) for c in cells] == [4000, 8000, 60_000]
    assert len(plan(config, None, False).cells) == 3


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("*.yaml")) + sorted((REPO / ".test/config").glob("*.yaml")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_configs_without_block_settings_keep_their_ids(path):
    """No config of the repository sets a block's train settings: none of their cells has
    one, so their ids, command lines and files are as before (each id without a settings part)."""
    config = load_config(path)
    assert not any(k in b for b in config.get("grid", []) for k in BLOCK_SETTINGS)
    cells = expand(config)
    for cell in cells:
        assert cell.train_settings == () and cell.settings_part == ""
        assert cell.train_section(config["train"]) == config["train"]
    # each block given train:'s values explicitly: the same cells, ids and command lines
    explicit = copy.deepcopy(config)
    for b in explicit.get("grid", []):
        b.update({k: config["train"][k] for k in BLOCK_SETTINGS})
    assert expand(validate(explicit)) == cells


@pytest.mark.parametrize("settings,match", [
    ({"train_subset": 70_000}, r"^config key grid\.0\.train_subset: 70000 is above the 60000 training examples"),
    ({"test_subset": 10_001}, r"^config key grid\.0\.test_subset: 10001 is above the 10000 test examples"),
    ({"train_subset": 500, "validation_size": 500},
     r"^config key grid\.0\.validation_size: 500 is not below the 500 training examples of P2 \(fashion-mnist "
     r"after grid\.0\.train_subset\)"),
    ({"max_steps": 0}, r"^config key grid\.0\.max_steps: 0 is less than the minimum of 1"),
    ({"validation_size": None}, r"^config key grid\.0\.validation_size: None is not of type 'integer'"),
    ({"train_subset": 50}, r"^config key grid\.0\.batch_sizes: batch size 64 is above the 50 training examples of "
                           r"P2 \(after train_subset and validation_size of train: and the block\)"),
])
def test_a_blocks_bad_value_is_refused_naming_its_key(settings, match):
    with pytest.raises(ConfigError, match=match):
        validate({"grid": [block(["P2"], **settings)]})


def test_a_refusal_names_the_key_each_value_came_from():
    """train:'s subset and the block's validation split: the message names both where they were given."""
    with pytest.raises(ConfigError, match=r"^config key grid\.1\.validation_size: 4000 is not below the 4000 "
                                          r"training examples of P2 \(fashion-mnist after train\.train_subset\)"):
        validate({"train": {"train_subset": 4000}, "grid": [block(["P2"]), block(["P2"], validation_size=4000)]})


def test_a_blocks_validation_split_serves_its_search_and_the_figures_that_select_on_it():
    search = {"distribution": "composition"}
    tuned = {**block(["P2"], lr=[0.5, 1.0], validation_size=1000, train_subset=4000), "tuning": search}
    cells = expand(validate({"grid": [tuned]}))
    assert len(cells) == 2 and all("-nval1000" in c.id and c.tuning for c in cells)
    with pytest.raises(ConfigError, match=r"^config key grid\.0\.tuning: .*validation"):
        validate({"grid": [{**tuned, "validation_size": 0}]})
    # a figure that selects on validation: every cell it may draw needs a split
    figure = {"fig5_1": {"select_by": "val"}}
    validate({"grid": [block(["P2"], validation_size=100)], "figures": figure})
    with pytest.raises(ConfigError, match=r"^config key figures\.fig5_1\.select_by: .*, and cells of P4 have none, "
                                          r"e\.g\. P4/dpsgd/L64-E1-eps1-lr1-s0 \(set train\.validation_size, or their "
                                          r"grid block's validation_size\)$"):
        validate({"grid": [block(["P2"], validation_size=100), block(["P4"])], "figures": figure})
    with pytest.raises(ConfigError, match=r"and there is none \(set train\.validation_size\)$"):
        validate({"grid": [block(["P2"])], "figures": figure})


def runs(subsets):
    """A runs table of one setting's runs (same seed) on the given train_subsets."""
    n = len(subsets)
    return pd.DataFrame({"run_id": [f"r{i}" for i in range(n)], "problem": "P2", "optimizer": "dpsgd", "lr": 1.0,
                         "batch_size": 64, "epochs": 1, "epsilon": 1.0, "hyperparameters": "{}", "seed": 7,
                         "train_subset": subsets, "test_subset": None, "validation_size": 0, "max_steps": None,
                         "task": "classification", "status": "completed",
                         "best_test_accuracy": [0.5 + 0.1 * i for i in range(n)], "best_test_loss": 1.0})


def test_runs_on_different_subsets_are_never_seeds_of_one_configuration():
    assert aggregate.DATA_KEYS == tuple(BLOCK_SETTINGS) and set(BLOCK_SETTINGS) <= set(CONFIG_KEYS)  # test_grid_axes.py
    best = select_best_config(runs([4000.0, None]), by=["problem", "optimizer"])
    assert (best["n_configs"].item(), best["n_seeds"].item(), best["value"].item()) == (2, 1, 0.6)
    same = select_best_config(runs([4000.0, 4000.0]), by=["problem", "optimizer"])
    assert (same["n_configs"].item(), same["n_seeds"].item()) == (1, 2)


def test_a_blocks_runs_carry_their_settings_into_the_runs_table_and_the_selection(tiny_fmnist, tmp_path):
    """Two blocks of one setting, one on a subset: each cell's command line runs (on a small
    generated dataset), the runs table records each run's data settings, and the selection
    counts them as two configurations, not two seeds of one."""
    from dpbench import cli
    from dpbench.reporting.aggregate import aggregate_runs

    common = {"optimizer": "sgd", "lr": 0.1, "L": 60, "max_steps": 1, "test_subset": 20}
    config = validate({"grid": [block(["P2"], train_subset=300, **common), block(["P2"], **common)]})
    jobs = plan(config, None, False)
    paths = []
    for cell in jobs.cells.values():
        paths.append(tmp_path / f"{len(paths)}.parquet")
        assert cli.main(["train", *shlex.split(jobs.train_args(cell)), "--progress-every", "1e9",
                         "--out", str(paths[-1])]) == 0
    table, _ = aggregate_runs(paths, tmp_path / "runs.parquet", tmp_path / "epochs.parquet")
    assert sorted(table["train_subset"].fillna(0)) == [0, 300]
    assert set(table["max_steps"]) == {1} and set(table["test_subset"]) == {20} and set(table["validation_size"]) == {0}
    assert set(table["steps"]) == {1}
    best = select_best_config(table.assign(epsilon=float("inf")), by=["problem", "optimizer"])
    assert (best["n_configs"].item(), best["n_seeds"].item(), best["n_runs"].item()) == (2, 1, 2)
