"""Command line: ``dpbench train | data | aggregate | plot | grid``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _hp(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--hp expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def cmd_train(args) -> int:
    import torch

    from dpbench.fingerprint import optimizer_fingerprint
    from dpbench.optimizers import get_optimizer
    from dpbench.results import write_run
    from dpbench.train import RunConfig, run

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = RunConfig(
        problem=args.problem, optimizer=args.optimizer, lr=args.lr, batch_size=args.batch_size,
        epochs=args.epochs, seed=args.seed, epsilon=args.epsilon, noise_multiplier=args.noise_multiplier,
        delta=args.delta, clip_norm=args.clip_norm, normalize_clipping=not args.flat_clipping,
        accountant=args.accountant, hyperparameters=dict(args.hp or []), max_steps=args.max_steps,
        train_subset=args.train_subset, test_subset=args.test_subset, validation_size=args.validation_size,
        data_dir=args.data_dir,
        factorization=args.factorization, noise_file=args.noise_file, cache_dir=args.cache_dir,
        device=args.device, progress_every_s=args.progress_every,
    )
    checkpoint = args.checkpoint or f"{args.out}.ckpt"
    # the optimizer and the hash of the code that trains it (a checkpoint of other code is stale)
    spec = get_optimizer(args.optimizer)
    result = run(cfg, spec, checkpoint=checkpoint, checkpoint_every_s=args.checkpoint_every,
                 code_key=optimizer_fingerprint(spec.name))
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
    from dpbench import data

    manifest = data.prepare(args.dataset, args.data_dir, allow_download=args.download)
    text = json.dumps(manifest, indent=2, sort_keys=True)
    if args.manifest:
        Path(args.manifest).parent.mkdir(parents=True, exist_ok=True)
        Path(args.manifest).write_text(text + "\n")
    print(text)
    return 0


def cmd_aggregate(args) -> int:
    from dpbench.aggregate import aggregate

    aggregate(args.runs, args.out_runs, args.out_epochs)
    return 0


def cmd_plot(args) -> int:
    from dpbench import figures

    png, pdf = figures.plot(args.figure, args.runs, args.out, **figures.parse_options(args.option or []))
    print(f"wrote {png} and {pdf}", file=sys.stderr)
    return 0


def cmd_factorize(args) -> int:
    from dpbench.matrix import factorization, streaming_file
    from dpbench.matrix.noise_file import log_stderr

    if streaming_file.is_key(args.key):  # a streamed mechanism's: one JSON file, no noise file
        from dpbench.matrix import streaming

        if args.tol is not None or args.report:
            raise ValueError(f"--tol and --report apply to dense factorizations, not to {args.key!r}")
        streaming_file.save(streaming.compute(args.key), args.out)
        print(Path(args.out).read_text(), end="")
        return 0
    fact = factorization.factorize(args.key, tol=args.tol, log=log_stderr)
    factorization.save(fact, args.out, args.report)
    print(factorization.report_json(fact.report), end="")
    return 0


def cmd_noise(args) -> int:
    from dpbench.matrix import factorization, noise_file

    if args.estimate:
        return noise_estimate(args.estimate)
    missing = [f"--{n.replace('_', '-')}" for n in ("factorization", "dim", "seed", "out") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"writing a noise file needs {', '.join(missing)} (or --estimate CONFIG)")
    fact = factorization.load(args.factorization)
    info = noise_file.write_noise(args.out, fact.noising, args.dim, args.seed, log=noise_file.log_stderr,
                                  meta={"factorization_key": fact.key, "factorization_digest": fact.digest})
    print(json.dumps(info, indent=2, sort_keys=True))
    return 0


def noise_estimate(config_path: str) -> int:
    """The disk the matrix mechanisms of a workflow config need, before anything runs: each
    noise file (T x d float32) and factorization the dense mechanisms' cells read, with the cells
    that read it, the total, and the free space where they go. Streamed mechanisms write no
    noise file; their factorizations are listed by count."""
    import shutil

    from dpbench.grid import expand, load_config
    from dpbench.matrix import cache, factorization, noise_file

    config = load_config(config_path)
    cache_dir = Path(config["results_dir"]) / "cache"
    noise, dense, streamed = {}, {}, set()
    for cell in expand(config):
        files = cell.cache_files(config["train"], cache_dir)
        if "noise" in files:
            _, k, b, _ = factorization.parse_key(files["factorization"].parent.name)
            steps, dim = k * b, cache.PARAMETER_COUNTS[cell.problem]
            entry = noise.setdefault(files["noise"], {"steps": steps, "dim": dim, "cells": 0})
            entry["cells"] += 1
            dense[files["factorization"]] = 3 * 8 * steps * steps  # C, C^-1, B in float64
        elif "factorization" in files:
            streamed.add(files["factorization"])
    rows = [(path, e["steps"], e["dim"], noise_file.file_bytes(e["steps"], e["dim"]), e["cells"])
            for path, e in sorted(noise.items())]
    total_noise = sum(r[3] for r in rows)
    total = total_noise + sum(dense.values())
    print(f"{config_path}: {len(expand(config))} cells; the dense matrix mechanisms read {len(rows)} noise files "
          f"and {len(dense)} factorizations under {cache_dir}")
    if rows:
        print(f"\n| noise file | T | d | size (GB) | cells reading it |\n| --- | ---: | ---: | ---: | ---: |")
        for path, steps, dim, size, cells in rows:
            print(f"| {path.relative_to(cache_dir)} | {steps} | {dim} | {size / 1e9:.2f} | {cells} |")
    print(f"\nnoise files: {total_noise / 1e9:.2f} GB; dense factorizations: {sum(dense.values()) / 1e9:.2f} GB; "
          f"total: {total / 1e9:.2f} GB")
    if streamed:
        print(f"streamed mechanisms: {len(streamed)} factorizations of a few kB each, no noise files")
    sizes = {**{r[0]: r[3] for r in rows}, **dense}
    to_write = sum(size for path, size in sizes.items() if not path.exists())
    where = next(p for p in (cache_dir, *cache_dir.parents) if p.exists())
    free = shutil.disk_usage(where).free
    short = "" if free >= to_write else f" -- NOT ENOUGH, {(to_write - free) / 1e9:.2f} GB short"
    print(f"still to write: {to_write / 1e9:.2f} GB (the files not made yet); free at {where.resolve()}: "
          f"{free / 1e9:.2f} GB{short}")
    return 0


def cmd_grid(args) -> int:
    from dpbench.grid import expand, load_config

    for cell in expand(load_config(args.config)):
        print(cell.id)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpbench", description="Benchmark differentially private optimizers.")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train one grid cell and write one Parquet file")
    t.add_argument("--problem", required=True, choices=["P1", "P2", "P3"])
    t.add_argument("--optimizer", required=True)
    t.add_argument("--lr", type=float, required=True, help="learning rate")
    t.add_argument("--batch-size", type=_positive_int, required=True, help="expected batch size L (q = L/N)")
    t.add_argument("--epsilon", type=float, help="target epsilon (private optimizers)")
    t.add_argument("--epochs", type=_positive_int, required=True, help="E; T = round(E N / L) steps")
    t.add_argument("--seed", type=int, required=True)
    t.add_argument("--out", required=True, help="output .parquet file (written atomically)")
    t.add_argument("--run-id", help="name recorded in the run (default: the output file's stem)")
    t.add_argument("--noise-multiplier", type=float, help="use this sigma instead of calibrating it from epsilon")
    t.add_argument("--delta", type=float, default=1e-5)
    t.add_argument("--clip-norm", type=float, default=1.0, help="C")
    t.add_argument("--flat-clipping", action="store_true", help="g/max(1,|g|/C) instead of normalised clipping")
    t.add_argument("--accountant", default="prv", choices=["prv", "rdp"])
    t.add_argument("--hp", type=_hp, action="append", metavar="KEY=VALUE", help="optimizer hyperparameter")
    t.add_argument("--max-steps", type=_positive_int, help="stop after N steps (epsilon is reported for them)")
    t.add_argument("--train-subset", type=_positive_int, help="train on a random subset of N examples")
    t.add_argument("--test-subset", type=_positive_int, help="evaluate on a random subset of N examples")
    t.add_argument("--validation-size", type=int, default=0,
                   help="hold N training examples out as a validation split for model selection")
    t.add_argument("--checkpoint", help="checkpoint file (default OUT.ckpt): saved every epoch and every "
                                        "--checkpoint-every seconds; a killed run resumes from it")
    t.add_argument("--checkpoint-every", type=float, default=600.0, help="seconds between mid-epoch checkpoints")
    t.add_argument("--data-dir", help="directory with the official dataset files")
    t.add_argument("--factorization", help="matrix mechanisms: the factorization file, .npz (dense) or .json "
                                           "(streamed), made by dpbench factorize")
    t.add_argument("--noise-file", help="matrix mechanisms: the correlated noise .npy (dpbench noise)")
    t.add_argument("--cache-dir", help="matrix mechanisms: where missing factorization/noise files are made "
                                       "(default $DPBENCH_CACHE_DIR or <tmp>/dpbench-cache)")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    t.add_argument("--threads", type=_positive_int, help="torch CPU threads")
    t.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("data", help="find (or download) a dataset, verify its checksums, write a manifest")
    d.add_argument("--dataset", required=True, choices=["fashion-mnist", "cifar10"])
    d.add_argument("--data-dir", help="where to look first and where downloads go")
    d.add_argument("--download", action=argparse.BooleanOptionalAction, default=True)
    d.add_argument("--manifest", help="write the manifest JSON here")
    d.set_defaults(func=cmd_data)

    a = sub.add_parser("aggregate", help="collect run files into a runs table and a per-epoch table")
    a.add_argument("runs", nargs="+", help="run .parquet files")
    a.add_argument("--out-runs", required=True)
    a.add_argument("--out-epochs", required=True)
    a.set_defaults(func=cmd_aggregate)

    p = sub.add_parser("plot", help="a figure of thesis chapter 5 / appendix B, as PNG and PDF")
    p.add_argument("figure", help="fig5_1 ... fig5_8, figB_1, figB_2")
    p.add_argument("--runs", required=True, help="the aggregated runs table")
    p.add_argument("--out", required=True, help="output stem: writes STEM.png and STEM.pdf")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE",
                   help="figure option, e.g. problem=P2, select_by=val, filters=thesis, filter.epochs=250,500")
    p.set_defaults(func=cmd_plot)

    f = sub.add_parser("factorize", help="matrix mechanisms: factorize A = B C for a key, e.g. me-k30-b48 or "
                                         "band-n1875-b64")
    f.add_argument("--key", required=True, help="dense: <kind>-k<epochs>-b<batches>[-tau<tau>], kind in se, "
                                                "se-lambda, me, me-lambda, identity; streamed: band-n<T>-b<b>, "
                                                "blt-n<T>-sep<b'>-k<k>-m<m|auto>, "
                                                "band-auto-N<N>-L<L>-n<T>-eps<eps>-delta<delta>")
    f.add_argument("--out", required=True, help="output .npz (dense) or .json (streamed), written atomically")
    f.add_argument("--report", help="the report as JSON (default: next to --out)")
    f.add_argument("--tol", type=float, help="relative duality gap to stop at")
    f.set_defaults(func=cmd_factorize)

    n = sub.add_parser("noise", help="matrix mechanisms: write the correlated noise C^-1 Z (T x d, float32), "
                                     "or --estimate the disk a config's noise files need")
    n.add_argument("--estimate", metavar="CONFIG", help="print the noise files (and dense factorizations) a workflow "
                                                        "config needs, their sizes and the total; writes nothing")
    n.add_argument("--factorization", help="the factorization .npz")
    n.add_argument("--dim", type=_positive_int, help="d, the number of model parameters")
    n.add_argument("--seed", type=int, help="the run's noise seed (dpbench.seeds.stream_seeds)")
    n.add_argument("--out", help="output .npy (written atomically, JSON sidecar next to it)")
    n.set_defaults(func=cmd_noise)

    g = sub.add_parser("grid", help="list the cells a workflow config expands to")
    g.add_argument("config")
    g.set_defaults(func=cmd_grid)
    return parser


def main(argv: list[str] | None = None) -> int:
    from dpbench.data import DataError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError, DataError) as exc:
        # configuration mistakes: one clear line, no traceback
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"dpbench {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
