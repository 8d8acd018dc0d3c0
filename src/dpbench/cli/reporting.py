"""Tables, figures and projections: ``dpbench aggregate``, ``plot``, ``grid``, ``cost``, ``list``."""

from __future__ import annotations

import sys
from pathlib import Path

from dpbench.files import refuse_special


def cmd_aggregate(args) -> int:
    from dpbench.reporting.aggregate import aggregate

    aggregate(args.runs, args.out_runs, args.out_epochs, audits=args.audits)
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
