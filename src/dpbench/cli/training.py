"""``dpbench train`` (one grid cell, one run file), ``dpbench prefix-store`` (an encoder problem's frozen
prefix computed once per record, ``dpbench.problems.prefix_store``) and ``dpbench data`` (a dataset,
verified)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dpbench import log
from dpbench.cli.arguments import add_settings, check_output, nonnegative_float, positive_int, settings_of
from dpbench.files import refuse_special
from dpbench.problems.layout import STORED_MODES

_LOG = log.get(__name__)


def add_parsers(sub) -> None:
    from dpbench.training.config import RunConfig

    t = sub.add_parser("train", help="train one grid cell and write one Parquet file",
                       description="Train one grid cell and write one Parquet file. The run's settings are "
                                   "RunConfig's fields (dpbench.training.config), a workflow config's train: keys "
                                   "among them (config/README.md).")
    add_settings({"cell": t.add_argument_group("a grid cell's own settings"),
                  "train": t.add_argument_group("the settings a workflow config's train: section holds"),
                  "command": t.add_argument_group("the settings of where the run is made")}, RunConfig)
    problem = next(a for a in t._actions if a.dest == "problem")
    problem.help = problem_help()
    o = t.add_argument_group("this invocation (not settings of the run)")
    o.add_argument("--out", required=True, help="output .parquet file (written atomically)")
    o.add_argument("--run-id", help="name recorded in the run (default: the output file's stem)")
    o.add_argument("--checkpoint", help="checkpoint file (default OUT.ckpt): saved every epoch and every "
                                        "--checkpoint-every seconds; a killed run resumes from it")
    o.add_argument("--checkpoint-every", type=nonnegative_float, default=600.0,
                   help="seconds between mid-epoch checkpoints (default: %(default)s)")
    o.add_argument("--threads", type=positive_int, help="torch CPU threads")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("prefix-store", help="compute an encoder problem's frozen prefix once per record and store it "
                                            "(modes head and last-block)",
                       description="Compute the frozen public prefix of an encoder problem's model once per record "
                                   "(mode head: the pooled feature; last-block: the hidden states entering the last "
                                   "block) and write the store (dpbench.problems.prefix_store) that runs read with "
                                   "--prefix-store. An existing store is verified and kept.")
    s.add_argument("--problem", required=True, help="an encoder problem (P7)")
    s.add_argument("--finetune", required=True, choices=STORED_MODES, help="the mode whose frozen prefix is stored")
    s.add_argument("--pretrained-dir", metavar="DIR", help="a local encoder directory instead of the catalogued one")
    s.add_argument("--data-dir", help="directory with the official dataset files")
    s.add_argument("--out", required=True, help="the store's .npy (its records .records.npy and sidecar .json beside it)")
    s.add_argument("--threads", type=positive_int, help="torch CPU threads")
    s.set_defaults(func=cmd_prefix_store)

    d = sub.add_parser("data", help="find (or download) a dataset, verify its checksums, write a manifest")
    d.add_argument("--dataset", required=True,
                   help="fashion-mnist, cifar10, fortunes, or a plugin problem's dataset (dpbench list)")
    d.add_argument("--data-dir", help="where to look first and where downloads go")
    d.add_argument("--download", action=argparse.BooleanOptionalAction, default=True,
                   help="image datasets only; fortunes comes from Debian (apt-get install fortunes)")
    d.add_argument("--context", type=positive_int, default=128,
                   help="fortunes: the context length at which truncated records are counted")
    d.add_argument("--manifest", help="write the manifest JSON here")
    d.set_defaults(func=cmd_data)


def cmd_train(args) -> int:
    # the output location first: a run that cannot be written is refused before any work
    check_output(args.out, "--out")
    check_output(args.checkpoint or f"{args.out}.ckpt", "--checkpoint" if args.checkpoint else "--out (its checkpoint)")
    import torch

    from dpbench.machine import keep_freed_memory
    from dpbench.pipeline.fingerprint import optimizer_fingerprint, problem_fingerprint
    from dpbench.optimizers import get_optimizer
    from dpbench.reporting.results import write_run
    from dpbench.training.config import RunConfig
    from dpbench.training.settings import SettingError, flag_of
    from dpbench.training.train import run

    cfg = settings_of(args, RunConfig)
    # the optimizer and the hash of the code that trains it (a checkpoint of other code is stale)
    spec = get_optimizer(cfg.optimizer)
    for key, value in cfg.hyperparameters.items():
        try:
            spec.hyperparameters({key: value})
        except ValueError as exc:
            raise ValueError(f"--hp {key}={value if isinstance(value, str) else json.dumps(value)}: {exc}") from None
    try:  # every check of the settings, before any work; a bad value named by its flag
        cfg.validate(spec)
    except SettingError as exc:
        raise ValueError(exc.as_given(lambda name: flag_of(RunConfig, name), "argument ")) from None
    pretrained = load_public_start(cfg)
    if pretrained is not None:  # verified; its dimensions bound LoRA's rank
        try:
            cfg.check_finetune(pretrained.model_dims)
        except SettingError as exc:
            raise ValueError(exc.as_given(lambda name: flag_of(RunConfig, name), "argument ")) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # each step reuses the last one's buffers (no page faults; numbers unchanged)
    checkpoint = args.checkpoint or f"{args.out}.ckpt"
    # a resume file of a run from another public checkpoint is stale too
    code_key = optimizer_fingerprint(spec.name) + problem_fingerprint(cfg.problem)
    if pretrained is not None:
        code_key += f"-start{pretrained.sha256[:16]}"
    result = run(cfg, spec, checkpoint=checkpoint, checkpoint_every_s=args.checkpoint_every, code_key=code_key,
                 pretrained=pretrained)
    result.meta["run_id"] = args.run_id or Path(args.out).stem
    write_run(args.out, result.metrics, result.meta)
    Path(checkpoint).unlink(missing_ok=True)  # the run file now holds everything
    r, p = result.meta["result"], result.meta["privacy"]
    _LOG.info(f"wrote {args.out}: status={r['status']} best test accuracy={r['best_test_accuracy']:.4f} "
              f"best test loss={r['best_test_loss']:.4g} sigma={p['noise_multiplier']:.4g} "
              f"epsilon target={p['target_epsilon']} achieved={p['epsilon']:.4g}")
    if p.get("caveat"):  # e.g. "not a valid DP guarantee: ..." (dpdice, D2P2's paper mode)
        _LOG.warning(f"privacy caveat: {p['caveat']}")
    return 0


def load_public_start(cfg):
    """The public start a run fine-tunes (None: it trains from random initialisation), verified
    before any data is read: the ``--pretrained`` checkpoint (``load_public_checkpoint``), or an
    encoder problem's encoder, ``--pretrained-dir`` or the catalogued one its facts name
    (``PublicEncoder``: the files checked, their hashes recorded, every layer checked)."""
    if cfg.finetune is None:
        return None
    from dpbench.problems import facts

    f = facts(cfg.problem)
    if f.family == "transformer-lm":
        return load_public_checkpoint(cfg.pretrained)
    from dpbench.problems.encoder_classification import PublicEncoder
    from dpbench.problems.encoders import EncoderError

    flag = "--pretrained-dir" if cfg.pretrained_dir else "--finetune"
    try:
        return PublicEncoder.load(cfg.pretrained_dir or f.pretrained)
    except EncoderError as exc:
        raise ValueError(f"argument {flag}: {exc}") from None


def cmd_prefix_store(args) -> int:
    check_output(args.out, "--out")
    from dpbench.problems import facts, get_problem, modes
    from dpbench.problems import prefix_store
    from dpbench.problems.encoder_classification import PublicEncoder
    from dpbench.problems.encoders import EncoderError

    f = facts(args.problem)
    if f.family != "bert-encoder":
        raise ValueError(f"argument --problem: {args.problem} is not an encoder problem (its start is {f.pretrained!r})")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        start = PublicEncoder.load(args.pretrained_dir or f.pretrained)
    except EncoderError as exc:
        raise ValueError(f"argument {'--pretrained-dir' if args.pretrained_dir else '--problem'}: {exc}") from None
    mode = modes.parse(args.finetune)
    problem = start.bind(get_problem(args.problem), mode)
    out = Path(args.out)
    if out.exists():  # verified and kept (a damaged or foreign one is refused, naming it)
        prefix_store.PrefixStore.open(out, encoder_sha256=start.sha256, max_tokens=start.max_tokens,
                                      cut=prefix_store.cut_of(mode, start.loaded.facts.num_hidden_layers),
                                      log=_LOG.info)
        return 0
    prefix_store.ensure_store(out, lambda path: prefix_store.make_store(path, start, problem, mode, args.data_dir,
                                                                       log=_LOG.info), log=_LOG.info)
    return 0


def problem_help() -> str:
    """--problem's help: the problems of the registry, its built-ins (their torch-free facts)
    and the installed plugins' (their entry points' names; nothing is imported)."""
    from dpbench.plugins import entry_points
    from dpbench.problems.catalog import FACTS

    # the group of dpbench.problems.registry.GROUP, named here so that --help imports no torch
    plugins = [ep.name for ep in entry_points("dpbench.problems") if ep.name not in FACTS]
    return ("the problem: " + ", ".join(FACTS) + (f"; plugins': {', '.join(plugins)}" if plugins else "")
            + " (dpbench list)")


def load_public_checkpoint(path: str):
    """``--pretrained``: the checkpoint verified against its sidecar (``load_pretrained``: a
    damaged or swapped file, or one without its sidecar, is refused naming it), as a
    ``PublicCheckpoint`` carrying its file, SHA-256 and recipe into the run's start record."""
    from dpbench.problems.finetune import PublicCheckpoint
    from dpbench.training.pretrain import load_pretrained

    try:
        loaded = load_pretrained(path)
    except ValueError as exc:
        raise ValueError(f"argument --pretrained: {exc}") from None
    record = loaded.record
    return PublicCheckpoint(loaded.state_dict, loaded.model_dims, str(path), record["sha256"],
                            (record.get("recipe") or {}).get("name"), record)


def cmd_data(args) -> int:
    from dpbench.data import fortunes, image_datasets, labelled_text

    if args.manifest:
        refuse_special(args.manifest, "argument --manifest:")
    if args.dataset == fortunes.NAME:  # a Debian package: verified, never downloaded
        manifest = fortunes.prepare(args.data_dir, args.context)
    elif args.dataset in labelled_text.CATALOG:  # a catalogued package file: hash and counts checked
        data = labelled_text.load(labelled_text.CATALOG[args.dataset])
        manifest = {"dataset": args.dataset, **data.record()}
    elif args.dataset in image_datasets.DATASETS:
        manifest = image_datasets.prepare(args.dataset, args.data_dir, allow_download=args.download)
    else:  # a plugin problem's dataset: its own loader verifies it
        from dpbench.problems.registry import dataset_manifest

        manifest = dataset_manifest(args.dataset, args.data_dir)
    text = json.dumps(manifest, indent=2, sort_keys=True)
    if args.manifest:
        Path(args.manifest).parent.mkdir(parents=True, exist_ok=True)
        Path(args.manifest).write_text(text + "\n")
    print(text)
    return 0
