"""Command line: ``dpbench train | data | aggregate | audits | plot | factorize | noise | audit | cost | grid | list``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from dpbench.files import refuse_special


def _hp(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--hp expects KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


# Argument types shared by every command (argparse names the option in its message:
# "argument --epsilon: expected a finite positive number, got 'inf'"). Each refuses what no
# run can use, before any work starts.


def _number(text: str, ok, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def finite_float(text: str) -> float:
    return _number(text, lambda x: True, "a finite number")


def positive_float(text: str) -> float:
    """A finite number > 0 (epsilon, learning rate, clipping norm, seconds)."""
    return _number(text, lambda x: x > 0, "a finite positive number")


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (a noise multiplier)."""
    return _number(text, lambda x: x >= 0, "a finite number >= 0")


def probability(text: str) -> float:
    """A number in the open interval (0, 1) (delta)."""
    return _number(text, lambda x: 0 < x < 1, "a finite number in (0, 1)")


def _integer(text: str, ok, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, lambda n: n > 0, "a positive integer")


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (a seed: numpy's SeedSequence takes no negative entropy)."""
    return _integer(text, lambda n: n >= 0, "an integer >= 0")



# Free space an output location must have before a run starts: a run file and its
# checkpoint (model, optimizer state, per-step trace) take a few MB for every problem here.
OUTPUT_SPACE = 64 * 2**20


def check_output(path: str | Path, option: str, need: int = OUTPUT_SPACE) -> None:
    """Fails at once, naming the option, where a file cannot be written at ``path``: it is a
    directory, its directory cannot be made or written in, or its file system has less than
    ``need`` bytes free. A probe file is made and removed, so nothing is left behind."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"argument {option}: {path} is a directory; give the file to write")
    refuse_special(path, f"argument {option}:")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"argument {option}: cannot create its directory {path.parent}: "
                         f"{exc.strerror or exc}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"argument {option}: cannot write in {path.parent}: {exc.strerror or exc}") from None
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise ValueError(f"argument {option}: only {free / 2**20:.1f} MiB free on its file system "
                         f"({path.parent}); a run needs {need / 2**20:.0f} MiB for its file and checkpoint")


def device(text: str) -> str:
    """auto, cpu, or a device torch has here (cuda needs a CUDA GPU: checked now, not after
    the data is loaded)."""
    if text in ("auto", "cpu"):
        return text
    from dpbench.training.train import resolve_device

    try:
        resolve_device(text)
    except (ValueError, RuntimeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def cmd_train(args) -> int:
    # the output location first: a run that cannot be written is refused before any work
    check_output(args.out, "--out")
    check_output(args.checkpoint or f"{args.out}.ckpt", "--checkpoint" if args.checkpoint else "--out (its checkpoint)")
    import torch

    from dpbench.pipeline.fingerprint import optimizer_fingerprint, problem_fingerprint
    from dpbench.optimizers import get_optimizer
    from dpbench.reporting.results import write_run
    from dpbench.training.train import RunConfig, run

    if args.train_subset:
        from dpbench.problems import facts

        problem = facts(args.problem)
        if args.train_subset > problem.train_size:
            raise ValueError(f"argument --train-subset: {args.train_subset} is above the {problem.train_size} "
                             f"training examples of {problem.dataset}")
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


def cmd_aggregate(args) -> int:
    from dpbench.reporting.aggregate import aggregate

    aggregate(args.runs, args.out_runs, args.out_epochs, audits=args.audits)
    return 0


def cmd_audits(args) -> int:
    from dpbench.reporting.audits import aggregate, markdown

    table = aggregate(args.audits, args.out)
    print(markdown(table), end="")
    print(f"wrote {args.out}: {len(table)} audits, {int(table['violation'].sum())} with a violation", file=sys.stderr)
    return 0


def cmd_plot(args) -> int:
    from dpbench.reporting import figures

    stem = Path(args.out).with_suffix("") if Path(args.out).suffix in (".png", ".pdf", ".md") else Path(args.out)
    for suffix in (".png", ".pdf", ".md"):
        refuse_special(stem.with_name(stem.name + suffix), "argument --out:")
    options = figures.parse_options(args.option or [])
    if args.figure in figures.FIGURES:
        figures.check_options(args.figure, options)  # before reading anything
    paths = figures.plot(args.figure, args.runs, args.out, **options)
    print(f"wrote {' and '.join(map(str, paths))}", file=sys.stderr)
    return 0


def cmd_factorize(args) -> int:
    from dpbench.matrix import dense_factorization
    from dpbench.matrix.store import dense_files, keys, streamed_files
    from dpbench.matrix.store.noise_files import log_stderr

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
    fact = dense_factorization.factorize(args.key, tol=args.tol, log=log_stderr)
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
    info = noise_files.write_noise(args.out, fact.noising, args.dim, args.seed, log=noise_files.log_stderr,
                                  meta={"factorization_key": fact.key, "factorization_digest": fact.digest})
    print(json.dumps(info, indent=2, sort_keys=True))
    return 0


def cmd_audit(args) -> int:
    if args.out:
        check_output(args.out, "--out")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.self_test:
        from dpbench.audit.selftest import self_test

        return 0 if self_test(seed=args.seed, cache_dir=args.cache_dir) else 1
    missing = [flag for flag, value in (("--optimizer", args.optimizer), ("--epsilon", args.epsilon),
                                        ("--out", args.out)) if value is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} required (or --self-test)")
    from dpbench.audit.run import audit
    from dpbench.optimizers import get_optimizer
    from dpbench.reporting.results import write_table

    spec = get_optimizer(args.optimizer)
    rows, record = audit(spec, args.epsilon, args.trials, args.mode, args.beta, args.seed, dict(args.hp or []),
                         args.delta, args.accountant, cache_dir=args.cache_dir,
                         log=lambda m: print(f"[audit] {m}", file=sys.stderr, flush=True))
    write_table(rows, args.out, meta={"audit": record})
    verdict = ("VIOLATION: the claim is refuted" if record["violation"] else "no violation found")
    print(f"wrote {args.out}: {spec.name} claimed eps = {record['epsilon_claimed']:g} (delta = {record['delta']:g}); "
          f"eps_lower = {record['epsilon_lower']:.3f}, eps_gdp = {record['epsilon_gdp']:.3f}; {verdict} "
          f"(beta = {record['beta']:g}, R = {record['trials']})", file=sys.stderr)
    return 0


AUDIT_HELP = """Empirical privacy audit of one optimizer at one claim (epsilon, delta), through the same
harness a training cell uses (its sampler, per-sample gradients, clipping, noise, sigma
calibration, optimizer state, factorization), on a synthetic audit problem whose per-sample
gradients are controlled: a linear loss <theta, x_i>, d = 9, N = 100 other examples, L = 5,
T = 200 steps, and a canary whose gradient is M e_c (M = 10 C; 100 C for DP-Dice) in a
coordinate no other example touches. R trials, R/2 with the canary and R/2 without
(add/remove neighbours; zero-out for matrix mechanisms), each with fresh seeds.

Reports, with confidence 1 - beta jointly (Clopper-Pearson bounds with a union bound over the
pre-registered statistics {primary, S_diff} and quantile levels {1, 2, 4, ...}):
  (A) epsilon_lower: an assumption-free lower bound on the epsilon of the mechanism;
  (B) violation: true if the measured error rates leave the claim's whole privacy profile
      delta*(eps) (from the run's own accountant), or if the loader's realised participation
      exceeds the accounted sensitivity (matrix mechanisms); a correct mechanism is flagged
      with probability <= beta;
  (C) epsilon_gdp: a tightness estimate from Gaussian DP (sound only for exactly Gaussian
      mechanisms; a heuristic under subsampling: reported, never used to flag).
An audit can only refute a claim or give a lower bound; it never proves privacy. With R
trials no epsilon above max_certifiable_epsilon (recorded) can be certified.

Output: Parquet, one row per trial and statistic (trial int64, canary_in bool, statistic
string, score float64); metadata JSON under the key "dpbench", object "audit": epsilon_claimed,
delta, beta, trials, mode, statistics, levels, epsilon_lower, violation, epsilon_gdp,
canary_norm, checks (post-processing, participation), claim (sigma, q, T, sensitivity,
accountant, ...), the per-(statistic, level) bounds table.

--self-test audits built-in mutants (noise / sqrt(T), no clipping, sigma for q/2, reused
noise, participation reshuffled every epoch), DP-Dice at its published calibration and
unmodified mechanisms, prints a table, and exits non-zero unless every mutant (and DP-Dice)
is flagged and no correct mechanism is.
"""


def noise_estimate(config_path: str) -> int:
    """The disk the matrix mechanisms of a workflow config need, before anything runs: each
    noise file (T x d float32) and factorization the dense mechanisms' cells read, with the cells
    that read it, the total, and the free space where they go. Streamed mechanisms write no
    noise file; their factorizations are listed by count."""
    import shutil

    from dpbench.pipeline.grid import expand, load_config
    from dpbench.matrix.store import keys, noise_files
    from dpbench.problems import facts

    config = load_config(config_path)
    cache_dir = Path(config["results_dir"]) / "cache"
    noise, dense, streamed = {}, {}, set()
    for cell in expand(config):
        files = cell.cache_files(config["train"], cache_dir)
        if "noise" in files:
            _, k, b, _ = keys.parse_dense_key(files["factorization"].parent.name)
            steps, dim = k * b, facts(cell.problem).parameters
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


def cmd_grid(args) -> int:
    from dpbench.pipeline.jobs import load_jobs

    jobs = load_jobs(args.config)
    if not args.jobs:
        for cell_id in jobs.cells:
            print(cell_id)
        return 0
    listing = jobs.listing()
    width = max(len(rule) for rule, _ in listing)
    for rule, path in listing:
        print(f"{rule:<{width}}  {path}")
    return 0


def cmd_list(args) -> int:
    from dpbench.plugins import listing

    return listing.main()


def cmd_cost(args) -> int:
    from dpbench.pipeline import cluster
    from dpbench.pipeline.grid import expand, load_config

    costs = cluster.GpuCosts.from_file(args.costs) if args.costs else cluster.COSTS
    k = args.cells_per_gpu
    print(f"GPU cost model: {costs.source}; start-up {costs.startup_seconds:.0f} s per job; "
          f"throughput gain with {k} cells per GPU: "
          + ", ".join(f"{p} {costs.gain(p, 256, k):.2f}x at L = 256, {costs.gain(p, 2048, k):.2f}x at L = 2048"
                      for p in ("P1", "P2", "P3")) + "\n")
    print(f"| config | runs | GPU-hours, 1 cell per GPU | GPU-hours, {k} cells per GPU |")
    print("| --- | ---: | ---: | ---: |")
    for path in args.configs:
        config = load_config(path)
        cells = expand(config)
        one, many = (cluster.gpu_hours(cells, config.get("train", {}), n, costs) for n in (1, k))
        print(f"| {path} | {len(cells)} | {one:,.1f} | {many:,.1f} |")
    return 0


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
    t.add_argument("--hp", type=_hp, action="append", metavar="KEY=VALUE", help="optimizer hyperparameter")
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
    au.add_argument("--hp", type=_hp, action="append", metavar="KEY=VALUE", help="optimizer hyperparameter")
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


if __name__ == "__main__":
    sys.exit(main())
