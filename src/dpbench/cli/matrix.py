"""The matrix mechanisms' files: ``dpbench factorize``, ``dpbench noise`` (and its ``--estimate``
of the disk a config's noise files need)."""

from __future__ import annotations

import json
from pathlib import Path

from dpbench import log
from dpbench.cli.arguments import nonnegative_int, positive_float, positive_int
from dpbench.files import refuse_special

_LOG = log.get(__name__)


def add_parsers(sub) -> None:
    f = sub.add_parser("factorize", help="matrix mechanisms: factorize A = B C for a key, e.g. me-k30-b48 or "
                                         "band-n1875-b64")
    f.add_argument("--key", required=True, help="dense: <kind>-k<epochs>-b<batches>[-tau<tau>], kind in se, "
                                                "se-lambda, me, me-lambda, identity; streamed: band-n<T>-b<b>, "
                                                "blt-n<T>-sep<b'>-k<k>-m<m|auto>, "
                                                "band-auto-N<N>-L<L>-n<T>-eps<eps>-delta<delta>")
    f.add_argument("--out", required=True, help="output .npz (dense) or .json (streamed), written atomically")
    f.add_argument("--report", help="the report as JSON (default: next to --out)")
    f.add_argument("--tol", type=positive_float, help="relative duality gap to stop at")
    f.set_defaults(func=cmd_factorize)

    n = sub.add_parser("noise", help="matrix mechanisms: write the correlated noise C^-1 Z (T x d, float32), "
                                     "or --estimate the disk a config's noise files need")
    n.add_argument("--estimate", metavar="CONFIG", help="print the noise files (and dense factorizations) a workflow "
                                                        "config needs, their sizes and the total; writes nothing")
    n.add_argument("--factorization", help="the factorization .npz")
    n.add_argument("--dim", type=positive_int, help="d, the number of model parameters")
    n.add_argument("--seed", type=nonnegative_int, help="the run's noise seed (dpbench.seeds.stream_seeds)")
    n.add_argument("--out", help="output .npy (written atomically, JSON sidecar next to it)")
    n.set_defaults(func=cmd_noise)


def cmd_factorize(args) -> int:
    from dpbench.matrix import dense_factorization
    from dpbench.matrix.store import dense_files, keys, streamed_files

    for option, path in (("--out", args.out), ("--report", args.report)):
        if path:
            refuse_special(path, f"argument {option}:")
    if keys.is_streamed_key(args.key):  # a streamed mechanism's: one JSON file, no noise file
        from dpbench.mechanisms import streamed

        if args.tol is not None or args.report:
            raise ValueError(f"--tol and --report apply to dense factorizations, not to {args.key!r}")
        streamed_files.save(streamed.compute(args.key), args.out)
        print(Path(args.out).read_text(), end="")
        return 0
    fact = dense_factorization.factorize(args.key, tol=args.tol, log=_LOG.info)
    dense_files.save(fact, args.out, args.report)
    print(dense_files.report_json(fact.report), end="")
    return 0


def cmd_noise(args) -> int:
    from dpbench.matrix.store import dense_files, noise_files

    if args.estimate:
        return noise_estimate(args.estimate)
    if args.out:
        refuse_special(args.out, "argument --out:")
    missing = [f"--{n.replace('_', '-')}" for n in ("factorization", "dim", "seed", "out") if getattr(args, n) is None]
    if missing:
        raise ValueError(f"writing a noise file needs {', '.join(missing)} (or --estimate CONFIG)")
    fact = dense_files.load(args.factorization)
    info = noise_files.write_noise(args.out, fact.noising, args.dim, args.seed, log=_LOG.info,
                                  meta={"factorization_key": fact.key, "factorization_digest": fact.digest})
    print(json.dumps(info, indent=2, sort_keys=True))
    return 0


def noise_estimate(config_path: str) -> int:
    """The disk the matrix mechanisms of a workflow config need, before anything runs: each
    noise file (T x d float32) and factorization the dense mechanisms' cells read, with the cells
    that read it, the total, and the free space where they go. Streamed mechanisms write no
    noise file; their factorizations are listed by count."""
    import shutil

    from dpbench.pipeline.grid import expand, load_config
    from dpbench.matrix.store import keys, noise_files

    config = load_config(config_path)
    cache_dir = Path(config["results_dir"]) / "cache"
    noise, dense, streamed = {}, {}, set()
    for cell in expand(config):
        files = cell.cache_files(config["train"], cache_dir)
        if "noise" in files:
            _, k, b, _ = keys.parse_dense_key(files["factorization"].parent.name)
            steps, dim = k * b, cell.trainable_parameters  # a fine-tuning cell's d: the parameters its mode trains
            entry = noise.setdefault(files["noise"], {"steps": steps, "dim": dim, "cells": 0})
            entry["cells"] += 1
            dense[files["factorization"]] = 3 * 8 * steps * steps  # C, C^-1, B in float64
        elif "factorization" in files:
            streamed.add(files["factorization"])
    rows = [(path, e["steps"], e["dim"], noise_files.file_bytes(e["steps"], e["dim"]), e["cells"])
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
