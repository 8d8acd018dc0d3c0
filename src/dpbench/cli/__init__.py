"""Command line: ``dpbench train | data | aggregate | audits | plot | factorize | noise | audit | cost | grid |
pretrain | list``.

The parser and ``main`` are here; the commands are grouped by concern: ``training`` (train,
data), ``matrix`` (factorize, noise), ``audit`` (audit, audits), ``reporting`` (aggregate, plot,
grid, cost, list), ``pretrain``; ``arguments`` holds the argument types every command shares."""

from __future__ import annotations

import argparse
import sys

from dpbench.cli.arguments import (device, hyperparameter, nonnegative_float, nonnegative_int, positive_float,
                                   positive_int, probability, tuning_setting)
from dpbench.cli.audit import AUDIT_HELP, cmd_audit, cmd_audits
from dpbench.cli.matrix import cmd_factorize, cmd_noise
from dpbench.cli.pretrain import add_pretrain_parser
from dpbench.cli.reporting import cmd_aggregate, cmd_cost, cmd_grid, cmd_list, cmd_plot
from dpbench.cli.training import cmd_data, cmd_train


def build_parser() -> argparse.ArgumentParser:
    from dpbench.privacy import accounting

    parser = argparse.ArgumentParser(prog="dpbench", description="Benchmark differentially private optimizers.")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train one grid cell and write one Parquet file")
    t.add_argument("--problem", required=True, help="P1, P2, P3, P4 or a plugin's problem (dpbench list)")
    t.add_argument("--optimizer", required=True)
    t.add_argument("--lr", type=positive_float, required=True, help="learning rate")
    t.add_argument("--batch-size", type=positive_int, required=True, help="expected batch size L (q = L/N)")
    t.add_argument("--epsilon", type=positive_float, help="target epsilon (private optimizers)")
    t.add_argument("--epochs", type=positive_int, required=True, help="E; T = round(E N / L) steps")
    t.add_argument("--seed", type=nonnegative_int, required=True)
    t.add_argument("--out", required=True, help="output .parquet file (written atomically)")
    t.add_argument("--run-id", help="name recorded in the run (default: the output file's stem)")
    t.add_argument("--noise-multiplier", type=nonnegative_float,
                   help="use this sigma instead of calibrating it from epsilon")
    t.add_argument("--delta", type=probability, default=accounting.DELTA)
    t.add_argument("--clip-norm", type=positive_float, default=1.0, help="C")
    t.add_argument("--flat-clipping", action="store_true", help="g/max(1,|g|/C) instead of normalised clipping")
    t.add_argument("--accountant", default=accounting.DEFAULT_ACCOUNTANT, choices=accounting.ACCOUNTANTS)
    t.add_argument("--hp", type=hyperparameter, action="append", metavar="KEY=VALUE", help="optimizer hyperparameter")
    t.add_argument("--tuning", type=tuning_setting, metavar="JSON",
                   help='this run is candidate j of K of a hyperparameter search, sigma calibrated for the whole search: '
                        '{"distribution": "negative_binomial"|"poisson"|"composition", "mean": .., "shape": .., '
                        '"repetitions": K, "candidate": j}')
    t.add_argument("--max-steps", type=positive_int, help="stop after N steps (epsilon is reported for them)")
    t.add_argument("--train-subset", type=positive_int, help="train on a random subset of N examples")
    t.add_argument("--test-subset", type=positive_int, help="evaluate on a random subset of N examples")
    t.add_argument("--validation-size", type=nonnegative_int, default=0,
                   help="hold N training examples out as a validation split for model selection")
    t.add_argument("--checkpoint", help="checkpoint file (default OUT.ckpt): saved every epoch and every "
                                        "--checkpoint-every seconds; a killed run resumes from it")
    t.add_argument("--checkpoint-every", type=nonnegative_float, default=600.0,
                   help="seconds between mid-epoch checkpoints")
    t.add_argument("--data-dir", help="directory with the official dataset files")
    t.add_argument("--factorization", help="matrix mechanisms: the factorization file, .npz (dense) or .json "
                                           "(streamed), made by dpbench factorize")
    t.add_argument("--noise-file", help="matrix mechanisms: the correlated noise .npy (dpbench noise)")
    t.add_argument("--cache-dir", help="matrix mechanisms: where missing factorization/noise files are made "
                                       "(default $DPBENCH_CACHE_DIR or <tmp>/dpbench-cache)")
    t.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda, cuda:1, ...")
    t.add_argument("--threads", type=positive_int, help="torch CPU threads")
    t.add_argument("--cuda-graphs", action="store_true",
                   help="replay each step as a CUDA graph on padded batches (a GPU only; docs/gpu.md)")
    t.add_argument("--progress-every", type=positive_float, default=10.0, help="seconds between progress lines")
    t.set_defaults(func=cmd_train)

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

    a = sub.add_parser("aggregate", help="collect run files into a runs table and a per-epoch table")
    a.add_argument("runs", nargs="+", help="run .parquet files")
    a.add_argument("--out-runs", required=True)
    a.add_argument("--out-epochs", required=True)
    a.add_argument("--audits", help="the audits table (dpbench audits): adds the runs' audit_violation column")
    a.set_defaults(func=cmd_aggregate)

    at = sub.add_parser("audits", help="collect audit files (dpbench audit) into one table")
    at.add_argument("audits", nargs="+", help="audit .parquet files")
    at.add_argument("--out", required=True)
    at.set_defaults(func=cmd_audits)

    p = sub.add_parser("plot", help="a figure of thesis chapter 5 / appendix B, as PNG and PDF")
    p.add_argument("figure", help="fig5_1 ... fig5_8, figB_1, figB_2, lm_loss, lm_exposure, lm_ranking, audit or "
                                  "a plugin's figure (dpbench list)")
    p.add_argument("--runs", required=True, help="the aggregated runs table")
    p.add_argument("--out", required=True, help="output stem: writes STEM.png and STEM.pdf (a table: STEM.md)")
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

    c = sub.add_parser("cost", help="projected GPU-hours of workflow configs (dpbench.pipeline.cluster's cost model)")
    c.add_argument("configs", nargs="*", default=[f"config/{n}.yaml" for n in ("setup1", "setup2", "setup3", "thesis")],
                   help="workflow configs (default: the three setups and the thesis grid)")
    c.add_argument("--costs", help="a cost file of benchmarks/bench_gpu.py costs (default: src/dpbench/gpu_costs.json "
                                   "if committed, else the assumed costs)")
    c.add_argument("--cells-per-gpu", type=positive_int, default=8, help="cells sharing one GPU (measured gain)")
    c.set_defaults(func=cmd_cost)

    au = sub.add_parser("audit", help="empirical privacy audit of an optimizer (lower bound on epsilon, "
                                      "violation test)", description=AUDIT_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    au.add_argument("--optimizer", help="a private optimizer of the registry")
    au.add_argument("--epsilon", type=positive_float, help="the claimed epsilon (sigma is calibrated for it)")
    au.add_argument("--hp", type=hyperparameter, action="append", metavar="KEY=VALUE", help="optimizer hyperparameter")
    au.add_argument("--trials", type=positive_int, default=2000, help="R: trials, half with the canary (even)")
    au.add_argument("--mode", default="trials", choices=["trials", "one-run"],
                    help="trials (default) or one-run (Steinke et al. 2023: 1000 canaries in one run; a smoke "
                         "test, never flags)")
    au.add_argument("--beta", type=probability, default=0.05, help="false-alarm probability of the audit")
    au.add_argument("--delta", type=probability, default=accounting.DELTA)
    au.add_argument("--accountant", default=accounting.DEFAULT_ACCOUNTANT, choices=accounting.ACCOUNTANTS,
                    help="the accountant sigma is calibrated with and whose privacy profile is tested")
    au.add_argument("--seed", type=nonnegative_int, default=0)
    au.add_argument("--out", help="output .parquet (written atomically)")
    au.add_argument("--cache-dir", help="where matrix factorizations are cached (as for dpbench train)")
    au.add_argument("--threads", type=positive_int, help="torch CPU threads")
    au.add_argument("--self-test", action="store_true", help="audit the built-in mutants and correct mechanisms")
    au.set_defaults(func=cmd_audit)

    g = sub.add_parser("grid", help="list the cells a workflow config expands to (--jobs: every job of the workflow)")
    g.add_argument("config")
    g.add_argument("--jobs", action="store_true", help="every job the workflow runs for the config, one a line: its "
                                                       "rule and the file it writes (datasets, matrix stages, training "
                                                       "cells, aggregate, audits, figures)")
    g.set_defaults(func=cmd_grid)

    add_pretrain_parser(sub)

    ls = sub.add_parser("list", help="every optimizer, problem and figure, built-in or from a plugin (exits 1 if "
                                     "a plugin is broken)")
    ls.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    from dpbench.pipeline import watch
    from dpbench.data.image_datasets import DataError

    args = build_parser().parse_args(argv)
    watch.start()  # started by the workflow: stop when it is gone (dpbench.pipeline.watch)
    try:
        return args.func(args)
    except (ValueError, KeyError, DataError) as exc:
        # configuration mistakes: one clear line, no traceback
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"dpbench {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:
        # the system refused (a full disk, a missing or unreadable file): one line naming the file
        message = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror or str(exc)
        print(f"dpbench {args.command}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dpbench {args.command}: interrupted", file=sys.stderr)
        return 130
