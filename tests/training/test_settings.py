"""A run's settings are declared once, as RunConfig's fields (dpbench.training.settings): the
config schema's train: keys are its `train` fields, `dpbench train`'s options are made from the
fields and read back into the same RunConfig, a cell's command line is its RunConfig's
``to_args`` (unchanged for the cells run before: a changed command line reruns a cell), and a
refused value names its flag on the command line and its key in a config."""

import subprocess
import sys

import pytest
import yaml

from dpbench import cli
from dpbench.cli.arguments import settings_of
from dpbench.pipeline.grid import SCHEMA_PATH, Cell, ConfigError, validate
from dpbench.training import settings
from dpbench.training.config import RunConfig, check_data
from dpbench.training.settings import SettingError

# RunConfig's settings that are not config keys: a cell's own values, and what is given where
# `dpbench train` is called (the workflow's rule: data_dir, device; Jobs: the matrix files and
# a fine-tuning cell's public checkpoint).
CELL = {"problem", "optimizer", "lr", "batch_size", "epochs", "seed", "epsilon", "hyperparameters", "tuning",
        "finetune", "lora_rank"}
COMMAND = {"factorization", "noise_file", "pretrained", "pretrained_dir", "text_file", "text_column",
           "text_pair_column", "label_column", "text_sha256", "noise_multiplier", "data_dir", "cache_dir", "device", "eval_batch_size",
           "progress_every_s", "prefix_store"}

# A value away from the default for each value type: a new setting of an existing type is
# round-tripped without editing this test.
SAMPLES = {
    settings.text: "P3", settings.positive_float: 0.25, settings.noise_multiplier: 0.75,
    settings.probability: 1e-6, settings.positive_int: 7, settings.nonnegative_int: 3, settings.path: "some/dir",
    settings.torch_device: "cpu", settings.hyperparameter: {"kappa": 0.5, "bands": "auto", "paper_sensitivity": True},
    settings.search_candidate: {"candidate": 1, "distribution": "poisson", "mean": 2.0, "repetitions": 3,
                                "shape": None},
}


def schema_train() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())["properties"]["train"]["properties"]


def by_scope(scope: str) -> set[str]:
    return {s.name for s in settings.settings(RunConfig) if s.scope == scope}


def test_the_schemas_train_keys_are_runconfigs_train_settings_with_their_defaults():
    assert set(schema_train()) == by_scope("train")
    assert by_scope("cell") == CELL and by_scope("command") == COMMAND
    for s in settings.settings(RunConfig):
        if s.scope == "train":
            assert schema_train()[s.name]["default"] == s.default, s.name


def test_every_setting_has_a_help_text_and_its_own_flag():
    flags = [s.flag for s in settings.settings(RunConfig)]
    assert len(set(flags)) == len(flags) and all(f.startswith("--") for f in flags)
    assert all(len(s.help) > 10 for s in settings.settings(RunConfig))
    assert settings.flag_of(RunConfig, "normalize_clipping") == "--flat-clipping"
    assert settings.flag_of(RunConfig, "train_subset") == "--train-subset"
    text = " ".join(cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    for s in settings.settings(RunConfig):
        assert s.flag in text
    assert "(default: 1e-05)" in text and "--out OUT" in text


def sample_config() -> RunConfig:
    """RunConfig with every setting away from its default."""
    values = {}
    for s in settings.settings(RunConfig):
        if s.type is settings.switch:
            values[s.name] = not s.default
        elif s.type.choices:
            values[s.name] = next(c for c in s.type.choices if c != s.default)
        else:
            values[s.name] = SAMPLES[s.type]
    return RunConfig(**values)


def test_to_args_reads_back_as_the_same_run_config():
    cfg = sample_config()
    args = cli.build_parser().parse_args(["train", *cfg.to_args(), "--out", "x.parquet"])
    back = settings_of(args, RunConfig)
    assert back == cfg
    assert type(back.hyperparameters["paper_sensitivity"]) is bool and back.tuning["shape"] is None


def test_a_setting_at_its_default_stays_off_the_command_line():
    """So adding a setting changes no cell's command line (and reruns none); the three
    ``always`` settings have been on every cell's command line from the start."""
    cfg = RunConfig(problem="P2", optimizer="sgd", lr=0.1, batch_size=8, epochs=1, seed=0)
    assert cfg.to_args() == ["--problem", "P2", "--optimizer", "sgd", "--lr", "0.1", "--batch-size", "8",
                             "--epochs", "1", "--seed", "0", "--delta", "1e-05", "--clip-norm", "1.0",
                             "--accountant", "prv"]
    assert {s.name for s in settings.settings(RunConfig) if s.always} == {"delta", "clip_norm", "accountant"}


def test_a_cells_command_line_is_as_it_was_written_before_settings_were_declared():
    """The arguments, in their order, that Cell.train_args wrote when it held its own table of
    flags (every train key set): the workflow's params of the cells already run."""
    cell = Cell("P4", "dpmatrix-band", 64, 1, 1.0, 0.3, 0, 2049812178, (("bands", 8), ("paper", True)),
                (("candidate", 0), ("distribution", "composition"), ("mean", 3.0), ("repetitions", 3),
                 ("shape", None)))
    train = {"delta": 1e-5, "clip_norm": 1, "normalize_clipping": False, "accountant": "rdp", "max_steps": 5,
             "train_subset": 4000, "test_subset": 200, "validation_size": 500, "cuda_graphs": True}
    assert cell.train_args(train) == [
        "--problem", "P4", "--optimizer", "dpmatrix-band", "--lr", "0.3", "--batch-size", "64", "--epochs", "1",
        "--seed", "2049812178", "--epsilon", "1.0", "--hp", "bands=8", "--hp", "paper=true",
        "--tuning", '{"candidate": 0, "distribution": "composition", "mean": 3.0, "repetitions": 3, "shape": null}',
        "--delta", "1e-05", "--clip-norm", "1", "--accountant", "rdp", "--max-steps", "5", "--train-subset", "4000",
        "--test-subset", "200", "--validation-size", "500", "--flat-clipping", "--cuda-graphs"]
    run = cell.run_config(train)
    assert (run.epsilon, run.hyperparameters, run.tuning["mean"], run.validation_size) == (1.0, {"bands": 8,
                                                                                               "paper": True}, 3.0, 500)


@pytest.mark.parametrize("name,value", [("lr", 0.0), ("seed", -1), ("delta", 1.0), ("batch_size", 2.5),
                                        ("accountant", "gdp"), ("max_steps", 0), ("cuda_graphs", 1)])
def test_validate_checks_each_value_by_its_type_naming_the_setting(name, value):
    from dpbench.optimizers import OPTIMIZERS

    cfg = RunConfig(**{"problem": "P2", "optimizer": "sgd", "lr": 0.1, "batch_size": 8, "epochs": 1, "seed": 0,
                       name: value})
    with pytest.raises(SettingError, match=rf"^{name}: expected .*, got {value!r}$"):
        cfg.validate(OPTIMIZERS["sgd"])


def test_the_data_check_names_the_setting_as_the_reader_gave_it():
    with pytest.raises(SettingError) as caught:
        check_data("P2", train_subset=500, validation_size=600)
    exc = caught.value
    assert str(exc) == ("validation_size: 600 is not below the 500 training examples of P2 (fashion-mnist after "
                        "train_subset): none would be left to train on")
    assert exc.as_given(lambda n: settings.flag_of(RunConfig, n), "argument ").startswith(
        "argument --validation-size: 600 is not below the 500 training examples of P2 (fashion-mnist after "
        "--train-subset)")
    with pytest.raises(ConfigError, match=r"^config key train\.test_subset: 10001 is above the 10000 test examples"):
        validate({"train": {"test_subset": 10001},
                  "grid": [{"problems": ["P2"], "batch_sizes": [8], "epochs": [1], "optimizers": {"sgd": {"lr": 0.1}}}]})
    check_data("P2", train_subset=60000, test_subset=10000, validation_size=59999)  # the largest that pass


def test_settings_and_the_parser_need_no_torch():
    """The workflow's DAG reads RunConfig (a cell's command line), and `dpbench data` runs where
    there is no torch (envs/data.yaml): neither imports it."""
    code = ("import sys; import dpbench.training.config, dpbench.pipeline.jobs, dpbench.cli; "
            "dpbench.cli.build_parser(); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
