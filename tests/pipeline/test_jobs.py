"""Every job of a config (dpbench.pipeline.jobs), without Snakemake: audits, figures, the
workflow's merged configs, the files each job writes, and `dpbench grid --jobs`."""

import copy
from collections import Counter

import pytest
import yaml

from conftest import REPO
from dpbench import cli
from dpbench.pipeline.grid import ConfigError, validate
from dpbench.pipeline.jobs import (figure_options, load_jobs, own_audit, plan, refuse_inherited_grid,
                                   workflow_jobs)

GRID = [{"problems": ["P2"], "batch_sizes": [100], "epochs": [1], "epsilons": [1, 10],
         "optimizers": {"dpsgd": {"lr": 0.5}, "sgd": {"lr": 0.1}}}]


def jobs_of(grid=GRID, **config):
    """The jobs of the config given (a train_subset of 1000 examples), as ``load_jobs`` makes them."""
    given = "figures" in config
    config = validate({"train": {"train_subset": 1000}, "grid": copy.deepcopy(grid), **copy.deepcopy(config)})
    return plan(config, config.get("audit"), figures_given=given)


def write(path, **config):
    path.write_text(yaml.safe_dump(config))
    return path


def test_audits_are_one_per_private_optimizer_and_claimed_epsilon():
    grid = jobs_of(audit={"optimizers": "grid", "epsilons": "grid"})
    assert grid.audits == ("dpsgd-eps1", "dpsgd-eps10")  # sgd trains, but claims nothing
    named = jobs_of(audit={"optimizers": ["dpsgd", "dpdice", "dpsgd"], "epsilons": [8, 2, 2.0, 0.5]})
    assert named.audits == ("dpdice-eps0.5", "dpdice-eps2", "dpdice-eps8", "dpsgd-eps0.5", "dpsgd-eps2", "dpsgd-eps8")
    every = jobs_of(audit={"optimizers": "all", "epsilons": [1]})
    assert {"dpsgd-eps1", "dpmatrix-blt-eps1", "opacus-dpsgd-eps1"} <= set(every.audits) and len(every.audits) >= 19
    assert not {"sgd-eps1", "adam-eps1", "adamw-eps1"} & set(every.audits)
    assert every.audit == {"optimizers": "all", "epsilons": [1], "trials": 2000, "beta": 0.05, "seed": 0}
    assert jobs_of().audits == () and jobs_of().audit is None


def test_audits_of_several_seeds_keep_seed_zero_names():
    seeded = jobs_of(audit={"optimizers": ["dpsgd"], "epsilons": [1, 0.5], "seed": [2, 0, 1]})
    assert seeded.audits == ("dpsgd-eps0.5", "dpsgd-eps0.5-seed1", "dpsgd-eps0.5-seed2",
                             "dpsgd-eps1", "dpsgd-eps1-seed1", "dpsgd-eps1-seed2")
    assert [seeded.audit_job(n) for n in seeded.audits[:3]] == [("dpsgd", 0.5, 0), ("dpsgd", 0.5, 1), ("dpsgd", 0.5, 2)]
    assert jobs_of(audit={"optimizers": ["dpmatrix-me-lambda"], "epsilons": [1e-3], "seed": 7}).audits == \
        ("dpmatrix-me-lambda-eps0.001-seed7",)
    assert seeded.audit_job("dpmatrix-me-lambda-eps0.001-seed7") == ("dpmatrix-me-lambda", 0.001, 7)
    with pytest.raises(ValueError, match="not an audit's name"):
        seeded.audit_job("dpsgd-1")
    with pytest.raises(ConfigError, match="audit.seed"):
        jobs_of(audit={"optimizers": ["dpsgd"], "epsilons": [1], "seed": [1, 1]})


@pytest.mark.parametrize("optimizers,line", [
    (["sgd"], "config key audit.optimizers: 'sgd' is not private: there is no claim to audit"),
    (["dpsgdd"], "config key audit.optimizers: unknown optimizer 'dpsgdd' (choose from ["),
])
def test_an_audit_of_nothing_private_is_one_line_naming_the_key_and_the_file(tmp_path, optimizers, line):
    path = write(tmp_path / "c.yaml", grid=GRID, audit={"optimizers": optimizers, "epsilons": [1]})
    with pytest.raises(ConfigError) as err:
        load_jobs(path)
    assert str(err.value).startswith(line) and str(err.value).endswith(f" ({path})")


def test_a_config_with_audits_draws_them_and_an_audit_only_config_only_them():
    assert list(jobs_of(figures={"fig5_2": {}}).figures) == ["fig5_2"]
    assert list(jobs_of().figures) == ["fig5_1"]  # the schema's default
    audited = jobs_of(figures={"fig5_2": {}, "fig5_1": {}}, audit={"optimizers": ["dpsgd"], "epsilons": [1]})
    assert list(audited.figures) == ["fig5_2", "fig5_1", "audit"]
    only = jobs_of(grid=[], audit={"optimizers": ["dpsgd"], "epsilons": [1]})
    assert only.cells == {} and only.figures == {"audit": {}}
    assert jobs_of(grid=[], figures={"audit": {"x": 1}}, audit={"optimizers": ["dpsgd"], "epsilons": [1]}).figures \
        == {"audit": {"x": 1}}


@pytest.mark.parametrize("config,line", [
    ({"grid": []}, "config key grid: the grid is empty and the config audits nothing: nothing to run"),
    ({"grid": [], "audit": {"optimizers": "grid", "epsilons": [1]}},
     "config key grid: the grid is empty and the config audits nothing: nothing to run"),
    ({"figures": {"audit": {}}}, "config key figures.audit: the figure of the audits needs audits"),
    ({"grid": [], "figures": {"fig5_1": {}, "audit": {}}, "audit": {"optimizers": ["dpsgd"], "epsilons": [1]}},
     "config key figures.fig5_1: figures ['fig5_1'] need training runs, but the grid is empty"),
])
def test_configs_that_run_nothing_or_draw_nothing_are_refused(config, line):
    with pytest.raises(ConfigError, match="^" + line.replace("[", r"\[").replace("]", r"\]")):
        jobs_of(**config)


def test_the_workflow_gets_neither_the_default_configs_grid_nor_its_audits(tmp_path):
    """Snakemake merges each --configfile over config/config.yaml: a config without grid: is
    refused, one without audit: audits nothing (not the default's DP-SGD and DP-Dice)."""
    default = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    mine = write(tmp_path / "mine.yaml", grid=GRID, train={"train_subset": 1000})
    given = yaml.safe_load(mine.read_text())
    merged = {**copy.deepcopy(default), **copy.deepcopy(given)}
    jobs = workflow_jobs(merged, [str(REPO / "config" / "config.yaml"), str(mine)], [mine], given)
    assert jobs.audits == () and jobs.audit is None and len(jobs.cells) == 3
    assert own_audit(default, [], {}) == default["audit"]  # the default workflow audits
    with pytest.raises(ConfigError, match=rf"^config {mine} has no grid: .*config/config.yaml"):
        refuse_inherited_grid([mine], {"train": {}})
    # an error names the file that sets the key
    bad = yaml.safe_load(write(mine, **given, audit={"optimizers": ["sgd"], "epsilons": [1]}).read_text())
    with pytest.raises(ConfigError, match=rf"'sgd' is not private: there is no claim to audit \({mine}\)$"):
        workflow_jobs({**copy.deepcopy(default), **bad}, [str(REPO / "config" / "config.yaml"), str(mine)], [mine], bad)


def test_every_job_and_the_file_it_writes():
    """The tiny config of CI: its 19 jobs (snakemake -n counts 20 with its target `all`:
    tests/workflow/test_workflow.py compares them)."""
    jobs = load_jobs(REPO / ".test" / "config" / "config.yaml")
    listing = jobs.listing()
    assert Counter(rule for rule, _ in listing) == {
        "data": 1, "factorize": 2, "noise": 2, "train": 6, "aggregate": 1, "audit": 4, "audit_table": 1,
        "plot_fig5_1": 1, "plot_fig5_2": 1, "plot_fig5_6": 1, "plot_audit": 1}
    assert [rule for rule, _ in listing][:3] == ["data", "factorize", "factorize"]  # stage by stage
    files = dict((path, rule) for rule, path in listing)
    # N = 1000 - 100 held out, b = N // L = 9 batches; k = E epochs
    assert files["results/cache/matrix/se-k1-b9/factorization.npz"] == "factorize"
    assert files["results/cache/matrix/me-lambda-k2-b9-tau4/factorization.npz"] == "factorize"
    assert files["results/runs/P3/dpmatrix-me-lambda/L100-E2-eps10-lr0.01-tau4-s0.parquet"] == "train"
    assert files["results/audit/runs/dpdice-eps10.parquet"] == "audit"  # seed 0
    assert files["results/audit/runs/dpdice-eps10-seed1.parquet"] == "audit"
    assert jobs.figure_files("fig5_1") == ["results/figures/fig5_1.png", "results/figures/fig5_1.pdf"]
    noise = [path for rule, path in listing if rule == "noise"]
    assert noise[1].startswith("results/cache/matrix/se-k1-b9/noise-d225034-seed")  # d: P2's parameters
    cell = jobs.cells["P2/dpmatrix-se/L100-E1-eps10-lr0.5-s0"]
    args = jobs.train_args(cell).split()
    assert args[args.index("--noise-file") + 1] == noise[1]
    assert args[args.index("--factorization") + 1] == "results/cache/matrix/se-k1-b9/factorization.npz"
    # the streamed mechanisms: one factorization per key (shared by both epsilons), no noise file;
    # a config that names no figures (figures: {}) draws none
    streamed = jobs_of(grid=[{**GRID[0], "optimizers": {"dpmatrix-band": {"lr": 0.5},
                                                        "dpmatrix-blt": {"lr": 0.5, "buffers": 1}}}], figures={})
    assert streamed.listing() == [
        ("data", "results/data/fashion-mnist.json"),
        ("factorize_streamed", "results/cache/streaming/band-n10-b10.json"),  # b = min(64, N // L, T)
        ("factorize_streamed", "results/cache/streaming/blt-n10-sep10-k1-m1.json"),
        *[("train", f"results/runs/P2/{o}/L100-E1-eps{e}-lr0.5{hp}-s0.parquet")
          for o, hp in (("dpmatrix-band", ""), ("dpmatrix-blt", "-buffers1")) for e in (1, 10)],
        ("aggregate", "results/aggregate/runs.parquet")]


def test_figure_options_are_the_plot_commands_options_quoted():
    assert figure_options({}) == ""
    assert figure_options({"problems": ["P3", "P2"], "filters": {"kappa": [0.5, 0.7], "bands": 8},
                           "title": "a b"}) == \
        "-o problems=P3,P2 -o filter.kappa=0.5,0.7 -o filter.bands=8 -o 'title=a b'"


def test_a_figure_drawn_twice_under_its_own_name_writes_its_own_files():
    """``finetune_p5: {figure: finetune, problem: P5}`` beside ``finetune``: a second drawing of
    one figure (e.g. P5's perplexity beside P6's accuracy) under a name of its own."""
    jobs = jobs_of(figures={"fig5_1": {}, "fig5_1_dpsgd": {"figure": "fig5_1", "optimizers": ["dpsgd"]},
                            "tuning_table": {"problem": "P2", "select_by": "test"}})
    assert jobs.figure_id("fig5_1_dpsgd") == "fig5_1" and jobs.figure_id("fig5_1") == "fig5_1"
    assert jobs.figure_files("fig5_1_dpsgd") == ["results/figures/fig5_1_dpsgd.png", "results/figures/fig5_1_dpsgd.pdf"]
    assert jobs.figure_input("fig5_1_dpsgd") == "results/aggregate/runs.parquet"
    assert figure_options(jobs.figures["fig5_1_dpsgd"]) == "-o optimizers=dpsgd"  # the figure id is not an option
    plots = {name: path for name, path in jobs.listing() if name.startswith("plot_")}
    assert plots == {"plot_fig5_1": "results/figures/fig5_1.png", "plot_fig5_1_dpsgd": "results/figures/fig5_1_dpsgd.png",
                     "plot_tuning_table": "results/figures/tuning_table.md"}


@pytest.mark.parametrize("figures,line", [
    ({"fig5_2": {"figure": "fig5_1"}}, "config key figures.fig5_2.figure: fig5_2 is itself a figure; a second "
                                       "drawing of fig5_1 needs a name of its own"),
    ({"mine": {"figure": "fig5_9"}}, "config key figures.mine.figure: unknown figure"),
    ({"mine": {"figure": ["fig5_1"]}}, "config key figures.mine.figure: ['fig5_1'] is not a figure id"),
    ({"mine": {"figure": "fig5_1", "problem": "P2"}}, "config key figures.mine: "),
    ({"mine": {"problem": "P2"}}, "config key figures.mine: unknown figure"),
])
def test_a_second_drawing_names_a_known_figure_and_takes_its_options(figures, line):
    with pytest.raises(ConfigError, match="^" + line.replace("[", r"\[").replace("]", r"\]")):
        jobs_of(figures=figures)


def test_dpbench_grid_lists_the_cells_and_with_jobs_every_job(capsys):
    tiny = str(REPO / ".test" / "config" / "config.yaml")
    assert cli.main(["grid", tiny]) == 0
    assert capsys.readouterr().out.splitlines() == list(load_jobs(tiny).cells)
    assert cli.main(["grid", "--jobs", tiny]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines] == [[rule, path] for rule, path in load_jobs(tiny).listing()]
    assert lines[0] == "data         results/data/fashion-mnist.json"
    assert cli.main(["grid", "--jobs", str(REPO / "config" / "audit.yaml")]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["audit_table  results/audit/audits.parquet",
                                                         "plot_audit   results/figures/audit.png"]


def test_a_changed_public_checkpoint_stops_the_workflow_before_anything_is_rerun(tmp_path):
    """The workflow reads each made public checkpoint once when it starts (common.smk calls
    Jobs.check_pretrained): one whose bytes no longer match its sidecar is refused in one line
    naming it, before Snakemake would rerun (deleting) the completed fine-tuning runs."""
    import hashlib
    import json

    config = yaml.safe_load((REPO / ".test" / "config" / "finetune.yaml").read_text())
    config["results_dir"] = str(tmp_path / "results")
    jobs = plan(validate(config), None, True)
    (path,) = {jobs.pretrained_of(c) for c in jobs.cells.values()} - {None}
    jobs.check_pretrained()  # not made yet: nothing to check
    checkpoint = tmp_path / path
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"weights")
    sidecar = checkpoint.with_name(checkpoint.name + ".json")
    sidecar.write_text(json.dumps({"sha256": hashlib.sha256(b"weights").hexdigest()}))
    jobs.check_pretrained()  # verified
    checkpoint.write_bytes(b"weightz")
    with pytest.raises(ValueError, match=rf"^pretrained checkpoint {path} is damaged or swapped: .*nothing was rerun"):
        jobs.check_pretrained()
    # the workflow's jobs (common.smk's workflow_jobs) are refused the same way, before any rerun
    with pytest.raises(ConfigError, match=rf"^pretrained checkpoint {path} is damaged or swapped"):
        workflow_jobs(config, [], [], config)
