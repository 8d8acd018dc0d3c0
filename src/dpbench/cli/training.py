"""``dpbench train`` (one grid cell, one run file) and ``dpbench data`` (a dataset, verified)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dpbench.cli.arguments import check_output
from dpbench.files import refuse_special


def cmd_train(args) -> int:
    # the output location first: a run that cannot be written is refused before any work
    check_output(args.out, "--out")
    check_output(args.checkpoint or f"{args.out}.ckpt", "--checkpoint" if args.checkpoint else "--out (its checkpoint)")
    import torch

    from dpbench.pipeline.fingerprint import optimizer_fingerprint, problem_fingerprint
    from dpbench.optimizers import get_optimizer
    from dpbench.reporting.results import write_run
    from dpbench.training.train import RunConfig, run

    if args.train_subset or args.test_subset or args.validation_size:
        from dpbench.problems import facts

        problem = facts(args.problem)  # subsets are refused, never clamped
        for option, value, size, split in (("--train-subset", args.train_subset, problem.train_size, "training"),
                                           ("--test-subset", args.test_subset, problem.test_size, "test")):
            if value and value > size:
                raise ValueError(f"argument {option}: {value} is above the {size} {split} examples of "
                                 f"{problem.dataset}")
        drawn = min(args.train_subset or problem.train_size, problem.train_size)
        if args.validation_size >= drawn:
            raise ValueError(f"argument --validation-size: {args.validation_size} is not below the {drawn} training "
                             f"examples of {problem.dataset}: none would be left to train on")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = RunConfig(
        problem=args.problem, optimizer=args.optimizer, lr=args.lr, batch_size=args.batch_size,
        epochs=args.epochs, seed=args.seed, epsilon=args.epsilon, noise_multiplier=args.noise_multiplier,
        delta=args.delta, clip_norm=args.clip_norm, normalize_clipping=not args.flat_clipping,
        accountant=args.accountant, hyperparameters=dict(args.hp or []), max_steps=args.max_steps,
        tuning=args.tuning,
        train_subset=args.train_subset, test_subset=args.test_subset, validation_size=args.validation_size,
        data_dir=args.data_dir,
        factorization=args.factorization, noise_file=args.noise_file, cache_dir=args.cache_dir,
        device=args.device, progress_every_s=args.progress_every, cuda_graphs=args.cuda_graphs,
    )
    checkpoint = args.checkpoint or f"{args.out}.ckpt"
    # the optimizer and the hash of the code that trains it (a checkpoint of other code is stale)
    spec = get_optimizer(args.optimizer)
    for key, value in args.hp or []:
        try:
            spec.hyperparameters({key: value})
        except ValueError as exc:
            raise ValueError(f"--hp {key}={value if isinstance(value, str) else json.dumps(value)}: {exc}") from None
    result = run(cfg, spec, checkpoint=checkpoint, checkpoint_every_s=args.checkpoint_every,
                 code_key=optimizer_fingerprint(spec.name) + problem_fingerprint(args.problem))
    result.meta["run_id"] = args.run_id or Path(args.out).stem
    write_run(args.out, result.metrics, result.meta)
    Path(checkpoint).unlink(missing_ok=True)  # the run file now holds everything
    r, p = result.meta["result"], result.meta["privacy"]
    print(f"wrote {args.out}: status={r['status']} best test accuracy={r['best_test_accuracy']:.4f} "
          f"best test loss={r['best_test_loss']:.4g} sigma={p['noise_multiplier']:.4g} "
          f"epsilon target={p['target_epsilon']} achieved={p['epsilon']:.4g}", file=sys.stderr)
    if p.get("caveat"):  # e.g. "not a valid DP guarantee: ..." (dpdice, D2P2's paper mode)
        print(f"privacy caveat: {p['caveat']}", file=sys.stderr)
    return 0


def cmd_data(args) -> int:
    from dpbench.data import fortunes, image_datasets

    if args.manifest:
        refuse_special(args.manifest, "argument --manifest:")
    if args.dataset == fortunes.NAME:  # a Debian package: verified, never downloaded
        manifest = fortunes.prepare(args.data_dir, args.context)
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
