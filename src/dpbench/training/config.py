"""A run's settings: ``RunConfig``, the one declaration of what ``dpbench train`` takes.

Each field is a setting (``dpbench.training.settings.setting``): its value type, flag, help and
scope travel with it, so the ``train`` command's options (``cli.arguments.add_settings``), a
grid cell's command line (``pipeline.grid.Cell.run_config``, then ``to_args``) and the checks
of its values (``validate``) are all made from these fields. Adding a setting is one field here
plus its use (and, for a ``train`` setting, its key in the config schema: a test holds the two
together); its declaration also places it in the grid (a ``cell`` axis, a setting a grid block
may set, a configuration key: ``settings``), which the pipeline and the tables read. ``check_data`` is the one check that needs the problem's facts; the config check
calls it too. Importable without torch: the workflow reads it to build its jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dpbench.privacy import accounting
from dpbench.problems import facts, modes
from dpbench.training.schedules import DEFAULT as DEFAULT_SCHEDULE, SCHEDULES
from dpbench.problems.layout import STORED_MODES
from dpbench.training.settings import (BlockKey, SettingError, check_values, choice, hyperparameter,
                                       noise_multiplier, nonnegative_int, path, positive_float, positive_int,
                                       probability, search_candidate, setting, switch, text, to_args, torch_device)

if TYPE_CHECKING:
    from dpbench.optimizers.spec import OptimizerSpec


# The field order is the order of a cell's arguments (to_args): kept as it was written before
# settings were declared here, so that no cell's command line, and so no cell, changes.
@dataclass(frozen=True)
class RunConfig:
    # -- a grid cell's own values ------------------------------------------------------------
    problem: str = setting(type=text, scope="cell", help="P1-P9 or a plugin's problem (dpbench list)")
    optimizer: str = setting(type=text, scope="cell", help="an optimizer of the registry (dpbench list)")
    lr: float = setting(type=positive_float, scope="cell", help="learning rate")
    batch_size: int = setting(type=positive_int, scope="cell", metavar="L",
                              help="expected batch size L; sample rate q = L / N")
    epochs: int = setting(type=positive_int, scope="cell", metavar="E", help="E; T = round(E N / L) steps")
    # not a configuration key: a configuration's runs are its seeds
    seed: int = setting(type=nonnegative_int, scope="cell", configuration=False,
                        help="the run's root seed (dpbench.seeds)")
    epsilon: float | None = setting(None, type=positive_float, scope="cell",
                                    help="target epsilon (private optimizers; sigma is calibrated to it): not "
                                         "with --noise-multiplier. The run file records the epsilon achieved")
    hyperparameters: dict[str, Any] = setting(default_factory=dict, type=hyperparameter, scope="cell", flag="--hp",
                                              metavar="KEY=VALUE", repeated=True,
                                              help="optimizer hyperparameter (repeat the flag for several)")
    # a candidate of a hyperparameter search (training.tuning): sigma is then calibrated for the whole search;
    # not a configuration key (the candidate's setting is: its lr and hyperparameters)
    tuning: dict[str, Any] | None = setting(
        None, type=search_candidate, scope="cell", metavar="JSON", configuration=False,
        help='this run is candidate j of K of a hyperparameter search, sigma calibrated for the whole search: '
             '{"distribution": "negative_binomial"|"poisson"|"composition", "mean": .., "shape": .., '
             '"repetitions": K, "candidate": j}')
    # fine-tuning a public checkpoint (dpbench.problems.modes; docs/finetune.md): the mode and LoRA's rank;
    # the checkpoint itself is --pretrained (a command setting, below)
    finetune: str | None = setting(None, type=choice(tuple(modes.MODES)), scope="cell",
                                   help="fine-tune the public start (--pretrained) in this mode (P5, P6, P7); "
                                        "not given: the model trains from random initialisation")
    lora_rank: int | None = setting(None, type=positive_int, scope="cell", metavar="R",
                                    help=f"--finetune lora: the adapters' rank r (default {modes.DEFAULT_LORA_RANK})")
    # -- a workflow config's train: section (config/README.md) --------------------------------
    # always: every cell's command line has carried these three, at their defaults too
    delta: float = setting(accounting.DELTA, type=probability, scope="train", always=True,
                           help="delta of the (epsilon, delta) guarantee")
    clip_norm: float = setting(1.0, type=positive_float, scope="train", always=True, metavar="C",
                               help="C, the clipping norm")
    accountant: str = setting(accounting.DEFAULT_ACCOUNTANT, type=choice(accounting.ACCOUNTANTS), scope="train",
                              always=True, help="the accountant sigma is calibrated with and epsilon reported by")
    # block: a grid block may set its own value (pipeline.blocks; the word of the cells' id part)
    max_steps: int | None = setting(None, type=positive_int, scope="train", metavar="N", block=BlockKey("Tmax", "none"),
                                    help="stop after N steps (epsilon is reported for them)")
    train_subset: int | None = setting(None, type=positive_int, scope="train", metavar="N", block=BlockKey("ntrain"),
                                       help="train on a random subset of N examples")
    test_subset: int | None = setting(None, type=positive_int, scope="train", metavar="N", block=BlockKey("ntest"),
                                      help="evaluate on a random subset of N examples")
    validation_size: int = setting(0, type=nonnegative_int, scope="train", metavar="N", block=BlockKey("nval"),
                                   help="hold N training examples out as a validation split for model selection")
    normalize_clipping: bool = setting(True, type=switch, scope="train", flag="--flat-clipping",
                                       help="g/max(1,|g|/C) instead of normalised clipping")
    # replay each step as a CUDA graph on Poisson batches padded to a few sizes (training.capture);
    # off until measured on a GPU; a no-op, with a message, on a CPU
    cuda_graphs: bool = setting(False, type=switch, scope="train",
                                help="replay each step as a CUDA graph on padded batches (a GPU only; docs/gpu.md)")
    # performance only (not a configuration key): a logical batch of L expected rows, drawn as ever, is
    # processed in pieces of at most P rows; one noise draw, one update and one accountant step per logical
    # step (optimizers.base.step_passes; docs/privacy.md)
    physical_batch_size: int | None = setting(
        None, type=positive_int, scope="train", metavar="P", configuration=False,
        help="process each sampled batch in pieces of at most P records (bounded memory; the same step, "
             "sigma, T and epsilon); not given: one piece")
    # the learning rate of step t of T: lr times the schedule's factor (training.schedules), every optimizer
    lr_schedule: str = setting(DEFAULT_SCHEDULE, type=choice(tuple(SCHEDULES)), scope="train",
                               configuration=True,
                               help="the learning rate over the T planned steps: constant, or linear decay to 0 "
                                    "(lr (1 - t/T) at step t = 0..T-1)")
    # -- given where dpbench train is called (the workflow's rule gives the same to every cell) --
    # matrix mechanisms: the factorization and noise files (computed into cache_dir if absent)
    factorization: str | None = setting(None, type=path, scope="command",
                                        help="matrix mechanisms: the factorization file, .npz (dense) or .json "
                                             "(streamed), made by dpbench factorize")
    noise_file: str | None = setting(None, type=path, scope="command",
                                     help="matrix mechanisms: the correlated noise .npy (dpbench noise)")
    pretrained: str | None = setting(None, type=path, scope="command", metavar="CHECKPOINT",
                                     help="--finetune: the public checkpoint (.pt, its sidecar .pt.json beside it), "
                                          "made by dpbench pretrain")
    pretrained_dir: str | None = setting(None, type=path, scope="command", metavar="DIR",
                                         help="--finetune of an encoder problem (P7): a local Hugging Face encoder "
                                              "directory (config.json, model.safetensors, tokenizer) instead of the "
                                              "catalogued one; its files' SHA-256 are recorded")
    text_file: str | None = setting(None, type=path, scope="command", metavar="FILE",
                                    help="--finetune of an encoder problem (P7-P9): its records from this labelled "
                                         "text file (.csv, .jsonl, .parquet, a GLUE .tsv) instead of its own; "
                                         "its SHA-256 is recorded")
    text_column: str | None = setting(None, type=text, scope="command", metavar="COLUMN",
                                      help="--text-file: the text column (default text; a GLUE TSV's own)")
    text_pair_column: str | None = setting(None, type=text, scope="command", metavar="COLUMN",
                                           help="--text-file: a pair's second text column (none: single texts)")
    label_column: str | None = setting(None, type=text, scope="command", metavar="COLUMN",
                                       help="--text-file: the label column (default label; a GLUE TSV's own)")
    text_sha256: str | None = setting(None, type=text, scope="command", metavar="HEX",
                                      help="--text-file: the SHA-256 it must have (the workflow gives the one it "
                                           "read with the config: a file changed since is refused)")
    noise_multiplier: float | None = setting(None, type=noise_multiplier, scope="command", metavar="SIGMA",
                                             help="use this sigma instead of calibrating it from epsilon")
    data_dir: str | None = setting(None, type=path, scope="command", help="directory with the official dataset files")
    cache_dir: str | None = setting(None, type=path, scope="command",
                                    help="matrix mechanisms: where missing factorization/noise files are made "
                                         "(default $DPBENCH_CACHE_DIR or <tmp>/dpbench-cache)")
    # modes head and last-block of an encoder problem: the frozen prefix's output read from a store
    # (dpbench.problems.prefix_store), made there under a lock if absent; a layout, never a result
    prefix_store: str | None = setting(None, type=path, scope="command", metavar="FILE",
                                       help="--finetune head or last-block of an encoder problem (P7): read the "
                                            "frozen prefix's output from this prefix store (.npy; made there if "
                                            "absent: dpbench prefix-store)")
    device: str = setting("auto", type=torch_device, scope="command", help="auto, cpu, cuda, cuda:1, ...")
    eval_batch_size: int = setting(1000, type=positive_int, scope="command", metavar="N",
                                   help="examples per forward pass of an evaluation")
    progress_every_s: float = setting(10.0, type=positive_float, scope="command", flag="--progress-every",
                                      metavar="SECONDS", help="seconds between progress lines")

    def to_args(self) -> list[str]:
        """The ``dpbench train`` arguments that give these settings (``settings.to_args``)."""
        return to_args(self)

    def validate(self, spec: OptimizerSpec) -> None:
        """Raises ValueError naming the first bad setting (SettingError where it is one setting's
        value); ``spec`` is this run's optimizer."""
        if spec.name != self.optimizer:
            raise ValueError(f"optimizer {self.optimizer!r} was given the spec of {spec.name!r}")
        from dpbench.problems import get_problem  # the registry (it imports torch)

        get_problem(self.problem)
        check_values(self)
        if self.noise_multiplier is not None and self.epsilon is not None:
            # sigma given is used as is: the run would carry a target it may not meet
            raise ValueError("give --epsilon (sigma calibrated to it) or --noise-multiplier (epsilon accounted "
                             "for it), not both")
        if spec.private and self.noise_multiplier is None and self.epsilon is None:
            raise ValueError(f"optimizer {self.optimizer!r} is private: give --epsilon or --noise-multiplier")
        self.check_text_file()
        if self.text_file is None:  # a user's file's sizes are checked once it is read (train.run)
            check_data(self.problem, self.train_subset, self.test_subset, self.validation_size)
        if self.cuda_graphs:  # a graph replays one pass's fixed shapes and a fixed lr
            for name, default in (("physical_batch_size", None), ("lr_schedule", DEFAULT_SCHEDULE)):
                if getattr(self, name) != default:
                    raise SettingError(name, "not with `cuda_graphs`, whose graph replays one pass of fixed shapes "
                                             "at a fixed learning rate")
        spec.hyperparameters(self.hyperparameters)
        self.check_finetune()
        if self.prefix_store is not None and self.finetune not in STORED_MODES:
            raise SettingError("prefix_store", f"a prefix store serves --finetune {' or '.join(STORED_MODES)} (a frozen "
                                               f"prefix of the encoder), not {self.finetune or 'training from scratch'}")
        if self.tuning is not None:  # refused as the config check refuses it, in the same words
            from dpbench.training.tuning import check_search

            try:
                check_search(self.tuning, spec, self.validation_size)
            except ValueError as exc:
                raise ValueError(f"tuning: {exc}") from None

    @property
    def mode(self) -> modes.Mode | None:
        """The fine-tuning mode of ``finetune`` and its options' settings (``modes.parse``);
        None: from random initialisation. ValueError where they do not make a mode."""
        if self.finetune is None:
            return None
        return modes.parse(self.finetune, **{s: getattr(self, s) for s in modes.option_settings()})

    @property
    def text_source(self):
        """The user's labelled text file (``dpbench.data.labelled_text.LocalFile``), or None."""
        if self.text_file is None:
            return None
        from dpbench.data.labelled_text import LocalFile

        return LocalFile(self.text_file, text=self.text_column, label=self.label_column,
                         text_pair=self.text_pair_column)

    def check_text_file(self) -> None:
        """A text file's settings only with a text file, and a text file only for a mode of an
        encoder problem (its records are tokenized by the public encoder). SettingError naming it."""
        if self.text_file is None:
            for name in ("text_column", "text_pair_column", "label_column", "text_sha256"):
                if getattr(self, name) is not None:
                    raise SettingError(name, "it describes `text_file`, which is not given")
            return
        if facts(self.problem).family != "bert-encoder":
            raise SettingError("text_file", f"problem {self.problem} does not read its records through a public "
                                            "encoder (P7-P9 do)")
        if self.finetune is None or self.finetune == modes.SCRATCH:
            raise SettingError("text_file", "a text file is read through the public encoder's tokenizer: give a "
                                            f"`finetune` mode ({', '.join(modes.MODES)})")

    def check_finetune(self, model_dims: dict | None = None) -> None:
        """A mode needs a public start (and a start a mode), a problem that starts from one
        (its facts name it), and its options only; with ``model_dims`` (the loaded start's), a
        model that reads the problem's records whole and a mode that fits it (a LoRA rank within
        every adapted layer's width). SettingError naming the flag."""
        f = facts(self.problem)
        if self.finetune is None:
            given = [s for s in modes.option_settings() if getattr(self, s) is not None]
            if given:
                owner = " or ".join(n for n, c in modes.MODES.items() if given[0] in c.options.values())
                raise SettingError(given[0], f"it belongs to `finetune` {owner}, not to no mode")
            for name in ("pretrained", "pretrained_dir"):
                if getattr(self, name) is not None:
                    raise SettingError(name, "a public start is fine-tuned in a mode: give `finetune` "
                                             f"({', '.join(modes.MODES)})")
            return
        try:
            mode = self.mode
        except ValueError as exc:
            raise SettingError(_option_named(str(exc)), str(exc)) from None
        if f.pretrained is None:
            raise SettingError("finetune", f"finetune mode {mode.name!r}: problem {self.problem} trains from scratch "
                                           "(no pretrained checkpoint)")
        if self.pretrained is not None and f.family != "transformer-lm":
            raise SettingError("pretrained", f"problem {self.problem} starts from a public encoder ({f.pretrained} "
                                             "unless `pretrained_dir` names another), not a pretrained checkpoint")
        if self.pretrained_dir is not None and f.family == "transformer-lm":
            raise SettingError("pretrained_dir", f"problem {self.problem} starts from a pretrained checkpoint "
                                                 "(`pretrained`), not an encoder directory")
        if self.pretrained is None and f.family == "transformer-lm":
            raise SettingError("finetune", f"mode {mode.name!r} fine-tunes a checkpoint: give `pretrained` "
                                           "(dpbench pretrain makes one)")
        if model_dims is None:
            return
        if f.family == "transformer-lm":
            from dpbench.problems.architectures import DEFAULT_DIMS, dims_of

            context, needed = dims_of(model_dims)["context"], DEFAULT_DIMS["context"]
            if context < needed:  # the records are P4's, cut to its model's context
                raise SettingError("pretrained", f"the checkpoint's model reads {context} tokens, fewer than the "
                                                 f"{needed} of {self.problem}'s records")
        try:
            mode.check(f.architecture(model_dims))
        except ValueError as exc:
            raise SettingError(_option_named(str(exc)), str(exc)) from None


def _option_named(message: str) -> str:
    """The setting a mode's refusal names (an option such as ``lora_rank``), else ``finetune``."""
    return next((s for s in modes.option_settings() if f"{s}=" in message), "finetune")


def check_data(problem: str, train_subset: int | None = None, test_subset: int | None = None,
               validation_size: int = 0, problem_facts=None) -> None:
    """The subsets within the problem's dataset (they are refused, never clamped), and a
    validation split that leaves records to train on (the canaries a language-model run plants
    are not its data, and would keep N positive on their own). SettingError naming the setting;
    the problem's facts come from the torch-free catalog (``problem_facts``: those of a problem
    reading a user's text file, as ``PublicEncoder.bind`` makes them)."""
    f = facts(problem) if problem_facts is None else problem_facts
    for name, value, size, split in (("train_subset", train_subset, f.train_size, "training"),
                                     ("test_subset", test_subset, f.test_size, "test")):
        if value and value > size:
            raise SettingError(name, f"{value} is above the {size} {split} examples of {f.dataset}")
    held, drawn = validation_size or 0, min(train_subset or f.train_size, f.train_size)
    if held >= drawn:
        raise SettingError("validation_size", f"{held} is not below the {drawn} training examples of {problem} "
                                              f"({f.dataset}{' after `train_subset`' if train_subset else ''}): "
                                              "none would be left to train on")
