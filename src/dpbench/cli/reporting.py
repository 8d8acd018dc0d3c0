"""Tables, figures and projections: ``dpbench aggregate``, ``plot``, ``grid``, ``cost``, ``list``."""

from __future__ import annotations

from pathlib import Path

from dpbench import log
from dpbench.cli.arguments import positive_int
from dpbench.files import refuse_special

_LOG = log.get(__name__)


def add_parsers(sub) -> None:
    a = sub.add_parser("aggregate", help="collect run files into a runs table and a per-epoch table")
    a.add_argument("runs", nargs="+", help="run .parquet files")
    a.add_argument("--out-runs", required=True)
    a.add_argument("--out-epochs", required=True)
    a.add_argument("--audits", help="the audits table (dpbench audits): adds the runs' audit_violation column")
    a.set_defaults(func=cmd_aggregate)

    p = sub.add_parser("plot", help="a figure of thesis chapter 5 / appendix B, as PNG and PDF")
    p.add_argument("figure", help="fig5_1 ... fig5_8, figB_1, figB_2, lm_loss, lm_exposure, lm_ranking, audit or "
                                  "a plugin's figure (dpbench list)")
    p.add_argument("--runs", required=True, help="the aggregated runs table")
    p.add_argument("--out", required=True, help="output stem: writes STEM.png and STEM.pdf (a table: STEM.md)")
    p.add_argument("-o", "--option", action="append", metavar="KEY=VALUE",
                   help="figure option, e.g. problem=P2, select_by=val, filters=thesis, filter.epochs=250,500")
    p.set_defaults(func=cmd_plot)

    g = sub.add_parser("grid", help="list the cells a workflow config expands to (--jobs: every job of the workflow)")
    g.add_argument("config")
    g.add_argument("--jobs", action="store_true", help="every job the workflow runs for the config, one a line: its "
                                                       "rule and the file it writes (datasets, matrix stages, training "
                                                       "cells, aggregate, audits, figures)")
    g.set_defaults(func=cmd_grid)

    ls = sub.add_parser("list", help="every optimizer, problem and figure, built-in or from a plugin (exits 1 if "
                                     "a plugin is broken)")
    ls.set_defaults(func=cmd_list)

    c = sub.add_parser("cost", help="projected GPU-hours of workflow configs (dpbench.pipeline.cluster's cost model)")
    c.add_argument("configs", nargs="*", default=[f"config/{n}.yaml" for n in ("setup1", "setup2", "setup3", "thesis")],
                   help="workflow configs (default: the three setups and the thesis grid)")
    c.add_argument("--costs", help="a cost file of benchmarks/bench_gpu.py costs (default: src/dpbench/gpu_costs.json "
                                   "if committed, else the assumed costs)")
    c.add_argument("--cells-per-gpu", type=positive_int, default=8, help="cells sharing one GPU (measured gain)")
    c.set_defaults(func=cmd_cost)


def cmd_aggregate(args) -> int:
    from dpbench.reporting.aggregate import aggregate_runs

    from dpbench.pipeline import catalog

    # the built-ins' privacy from the registry (torch-free), never from what a file says of it
    aggregate_runs(args.runs, args.out_runs, args.out_epochs, audits=args.audits, builtins=catalog.OPTIMIZERS)
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
    _LOG.info(f"wrote {' and '.join(map(str, paths))}")
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
    import dpbench.cli.listing as listing

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
