"""Config validation and grid expansion."""

import copy

import numpy as np
import pytest
import yaml

from conftest import REPO
from dpbench.pipeline.grid import Cell, ConfigError, expand, load_config, seeds_from_root, validate

BASE = {"grid": [{"problems": ["P2"], "batch_sizes": [256, 512], "epsilons": [1, 10], "epochs": [2], "seeds": 2,
                  "optimizers": {"dpsgd": {"lr": [0.1, 1.0]}, "sgd": {"lr": 0.1}}}]}


def test_defaults_are_filled_in():
    cfg = validate(copy.deepcopy(BASE))
    assert cfg["data_dir"] == "data" and cfg["results_dir"] == "results" and cfg["root_seed"] == 20250731
    assert cfg["train"]["delta"] == 1e-5 and cfg["train"]["clip_norm"] == 1.0 and cfg["train"]["validation_size"] == 0


@pytest.mark.parametrize("key,value,match", [
    ("software_env", "cuda", "envs/train-cuda.yaml where it gives rule train a GPU"),
    ("train.device", "cuda", "the profile chooses the device"),
    ("train.threads", 4, "set-threads: train: N"),
])
def test_deployment_keys_are_refused_with_where_they_went(key, value, match):
    cfg = copy.deepcopy(BASE)
    section, _, name = key.rpartition(".")
    (cfg.setdefault(section, {}) if section else cfg)[name] = value
    with pytest.raises(ConfigError, match=f"config key {key}: deployment settings are not config keys; .*{match}"):
        validate(cfg)


def test_expansion_counts_and_dedupes():
    cells = expand(validate(copy.deepcopy(BASE)))
    # dpsgd: 2 L x 2 eps x 2 lr x 2 seeds; sgd ignores epsilon: 2 L x 1 lr x 2 seeds
    assert len(cells) == 16 + 4
    assert len({c.id for c in cells}) == len(cells)
    twice = copy.deepcopy(BASE)
    twice["grid"].append(copy.deepcopy(BASE["grid"][0]))
    assert expand(validate(twice)) == cells
    sgd = [c for c in cells if c.optimizer == "sgd"]
    assert all(c.epsilon is None and "nonprivate" in c.id for c in sgd)


def test_seeds_come_from_seedsequence():
    seeds = seeds_from_root(123, 3)
    assert seeds == [int(c.generate_state(1)[0]) for c in np.random.SeedSequence(123).spawn(3)]
    assert len(set(seeds)) == 3 and seeds_from_root(123, 1) == seeds[:1]
    cells = expand(validate({**copy.deepcopy(BASE), "root_seed": 123}))
    assert {c.seed for c in cells} == set(seeds[:2])


def test_cell_ids_and_cli_args():
    c = Cell("P2", "dpsgd", 256, 2, 1.0, 0.001, 0, 99, (("kappa", 0.7),))
    assert c.id == "P2/dpsgd/L256-E2-eps1-lr0.001-kappa0.7-s0"
    args = c.train_args({"delta": 1e-5, "max_steps": None, "normalize_clipping": False})
    assert args[args.index("--lr") + 1] == "0.001" and "--max-steps" not in args
    assert args[args.index("--hp") + 1] == "kappa=0.7" and "--flat-clipping" in args


@pytest.mark.parametrize("mutate,match", [
    (lambda c: c["grid"][0].update(batch_sizes=[0]), r"grid\.0\.batch_sizes\.0"),
    (lambda c: c["grid"][0].update(problems=["P10"]), r"grid\.0\.problems\.0"),
    (lambda c: c.update(train={"delta": 2}), r"train\.delta"),
    (lambda c: c.update(colour="red"), r"colour"),
    (lambda c: c["grid"][0]["optimizers"].update(adamx={"lr": 1}), r"grid\.0\.optimizers\.adamx: unknown optimizer"),
    (lambda c: c["grid"][0]["optimizers"]["dpsgd"].update(kappa=1), r"grid\.0\.optimizers\.dpsgd: .*'kappa'"),
    (lambda c: c["grid"][0].update(epsilons=[]), r"grid\.0\.epsilons"),
    (lambda c: c["grid"][0]["optimizers"]["dpsgd"].pop("lr"), r"grid\.0\.optimizers\.dpsgd"),
])
def test_bad_values_name_the_key(mutate, match):
    cfg = copy.deepcopy(BASE)
    mutate(cfg)
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


@pytest.mark.parametrize("results_dir", ["", "  ", "/", "//", "/tmp/.."])
def test_a_results_dir_at_the_filesystem_top_is_refused(results_dir):
    """Outputs go under results_dir: empty or the root would write /runs, /logs, ... (as root)."""
    cfg = {**copy.deepcopy(BASE), "results_dir": results_dir}
    with pytest.raises(ConfigError, match=r"^config key results_dir: .*(empty|filesystem root)") as info:
        validate(cfg)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("results_dir", ["~", "~/dpbench-results", "~someone/results"])
def test_a_results_dir_starting_with_a_tilde_is_refused(results_dir):
    """results_dir "~" wrote into a literal ./~/ in the checkout: nothing expands it, so it is refused
    in one line saying the path it would have meant."""
    import os

    cfg = {**copy.deepcopy(BASE), "results_dir": results_dir}
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value) == (f"config key results_dir: {results_dir!r} starts with ~, which is not expanded (the "
                               f"outputs would go to a folder named ~ here): give the path itself, e.g. "
                               f"{os.path.expanduser(results_dir)!r}")


def test_default_config_is_the_small_p2_experiment():
    cfg = load_config(REPO / "config" / "config.yaml")
    cells = expand(cfg)
    assert {c.problem for c in cells} == {"P2"} and {c.optimizer for c in cells} == {"dpsgd", "sgd"}
    assert {c.epsilon for c in cells if c.optimizer == "dpsgd"} == {1.0, 10.0}
    assert all(len({c.lr for c in cells if c.optimizer == o}) == 2 for o in ("dpsgd", "sgd"))
    assert cfg["train"]["train_subset"] is None  # full Fashion-MNIST
    yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def _schema_keys(schema: dict, prefix: str = "") -> list[str]:
    """Every key path of the config schema: `train.delta`, `grid[].optimizers.<id>.lr`, ..."""
    keys = []
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        keys.append(path)
        if sub.get("type") == "array" and "items" in sub:
            keys += _schema_keys(sub["items"], f"{path}[].")
        keys += _schema_keys(sub, f"{path}.")
        if isinstance(sub.get("additionalProperties"), dict) and "properties" in sub["additionalProperties"]:
            keys += _schema_keys(sub["additionalProperties"], f"{path}.<id>.")
    return keys


def test_config_readme_documents_every_key():
    from dpbench.pipeline.grid import config_schema

    keys = _schema_keys(config_schema())
    assert {"train.delta", "grid[].seeds", "grid[].optimizers.<id>.lr", "grid[].max_steps"} <= set(keys)
    assert len(keys) > 20
    readme = (REPO / "config" / "README.md").read_text()
    assert [k for k in keys if f"`{k}`" not in readme] == []
    # and the settings that are deployment, not configuration, say where they went
    for key in ("software_env", "train.device", "train.threads"):
        assert f"`{key}`" in readme


def test_run_sh_names_the_file_and_line_of_a_configfile_snakemake_cannot_parse(tmp_path, capsys):
    """scripts/run.sh checks each --configfile before Snakemake (which would stop on a YAML
    syntax error without naming the file or the line)."""
    from dpbench.pipeline.grid import check_configfiles, configfiles_of

    assert "check_configfiles" in (REPO / "scripts" / "run.sh").read_text()
    assert configfiles_of(["--cores", "2", "--configfile", "a.yaml", "b.yaml", "-n", "--configfile=c.yaml"]) == \
        ["a.yaml", "b.yaml", "c.yaml"]
    (tmp_path / "ok.yaml").write_text("grid: []\n")
    (tmp_path / "bad.yaml").write_text("grid:\n  - {problems: [P2\n")
    assert check_configfiles(["--configfile", str(tmp_path / "ok.yaml")]) == 0
    assert check_configfiles(["-n", "--configfile", str(tmp_path / "ok.yaml"), str(tmp_path / "bad.yaml")]) == 2
    assert capsys.readouterr().err == (f"error: config file {tmp_path / 'bad.yaml'}, line 3, column 1: YAML syntax "
                                       "error: while parsing a flow sequence expected ',' or ']', but got '<stream end>'\n")


def test_config_readme_counts_the_training_runs_of_every_config_it_lists():
    """The table of config/README.md: each listed config expands to the number of training runs
    it states (a config changed without its row is caught)."""
    import re

    from dpbench.pipeline.grid import expand, load_config

    rows = re.findall(r"^\| `([\w.-]+\.yaml)` \|.*\| (\d+) \|$", (REPO / "config" / "README.md").read_text(), re.M)
    assert {"config.yaml", "thesis.yaml", "lm.yaml", "lm-pilot.yaml"} <= {name for name, _ in rows}
    assert [(name, len(expand(load_config(REPO / "config" / name)))) for name, _ in rows] == \
        [(name, int(count)) for name, count in rows]


def test_a_yaml_alias_bomb_is_refused_within_seconds(tmp_path):
    """Nine levels of nine aliases (9^9 values from a few hundred bytes): refused naming the
    file, in well under a second (the duplicate-key check walked every expansion for minutes);
    a config's ordinary aliases still read, and a duplicate key under an alias is still found."""
    import time

    from dpbench.pipeline.configfile import read_yaml

    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"^config file {bomb}: expands through its aliases .* more than 1,000,000"):
        read_yaml(bomb)
    assert time.perf_counter() - t0 < 2.0
    fine = tmp_path / "fine.yaml"
    fine.write_text("base: &b {lr: 0.1, seeds: 2}\ngrid: [*b, *b, {<<: *b, lr: 1}]\n")
    assert read_yaml(fine)["grid"] == [{"lr": 0.1, "seeds": 2}] * 2 + [{"lr": 1, "seeds": 2}]
    twice = tmp_path / "twice.yaml"
    twice.write_text("base: &b {lr: 0.1, lr: 1}\ngrid: [*b]\n")
    with pytest.raises(ConfigError, match=r"config key base\.lr: given twice"):
        read_yaml(twice)
