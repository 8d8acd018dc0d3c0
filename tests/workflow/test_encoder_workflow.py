"""P7 through the workflow, from a local encoder: the tiny BERT fixture (tests/tiny_bert.py,
the Hugging Face file format, kilobytes) named by the config's ``pretrained_dir``, DP-SGD in
modes lora and head on 64 of the real fortunes records, the aggregate and the fine-tuning
table; prefix stores opt-in (config key prefix_store); and the grid's d and command lines of P7's cells (no files read but config.json)."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from conftest import REPO, copy_repo, snakemake_exe, tree_env
from dpbench.data import fortunes
from dpbench.pipeline.grid import ConfigError, expand, validate
from dpbench.problems import encoders, facts, modes
from dpbench.reporting.results import read_meta

REAL = pytest.mark.skipif(not all((fortunes.SYSTEM_DIRS[0] / f).is_file() for f in fortunes.SHA256),
                          reason="needs Debian's fortunes (apt-get install fortunes)")


def config(directory=None) -> dict:
    return {"data_dir": "data", "results_dir": "results-encoder",
            **({"pretrained_dir": str(directory)} if directory else {}),
            "train": {"accountant": "rdp", "max_steps": 2, "train_subset": 64, "test_subset": 32},
            "figures": {"finetune_table": {"problem": "P7", "select_by": "test"}},
            "grid": [{"problems": ["P7"], "batch_sizes": [16], "epsilons": [10], "epochs": [1], "seeds": [0],
                      "finetune": ["lora", "head"], "lora_ranks": [4], "optimizers": {"dpsgd": {"lr": [0.5]}}}]}


def test_p7_cells_count_d_from_the_catalogued_encoder_or_the_named_directory(tiny_bert_dir, tmp_path):
    cells = expand(validate(config()))
    assert [c.id for c in cells] == ["P7/dpsgd/L16-E1-eps10-lr0.5-fthead-s0", "P7/dpsgd/L16-E1-eps10-lr0.5-ftlora4-s0"]
    assert [c.trainable_parameters for c in cells] == [15_400, 6 * 4 * (4 * 768 + 1920 + 1920) + 15_400]
    local = expand(validate(config(tiny_bert_dir)))
    dims = {k: getattr(encoders.config_facts(tiny_bert_dir), k) for k in ("hidden_size", "num_hidden_layers",
                                                                          "intermediate_size", "vocab_size",
                                                                          "max_position_embeddings", "type_vocab_size")}
    assert [c.trainable_parameters for c in local] == [facts("P7").trainable(dims, c.start.mode) for c in local]
    assert local[1].trainable_parameters == 2 * 4 * (4 * 64 + 96 + 96) + 32 * 40 + 40
    from dpbench.pipeline.jobs import load_jobs

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config(tiny_bert_dir)))
    jobs = load_jobs(tmp_path / "c.yaml")
    args = jobs.train_args(jobs.cells[local[0].id])
    assert f"--pretrained-dir {tiny_bert_dir}" in args and "--pretrained " not in args


def test_a_changed_local_encoder_reruns_its_cells_and_nothing_else(tiny_bert_dir, tmp_path):
    """After a pretrained_dir encoder's weights were replaced the workflow said "Nothing to be done":
    the train rule's code param (common.smk's train_code) now carries JOBS.start_code, the
    directory's one hash (the run's checkpoint_sha256), for its cells; a config's other cells, and
    a config without pretrained_dir, get "" (their params unchanged: nothing else reruns)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dpbench.pipeline.jobs import load_jobs

    directory = shutil.copytree(tiny_bert_dir, tmp_path / "encoder")
    both = config(directory)
    both["grid"].append({"problems": ["P2"], "batch_sizes": [16], "epochs": [1], "seeds": [0],
                         "optimizers": {"sgd": {"lr": [0.1]}}})

    def codes():
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(both))
        jobs = load_jobs(tmp_path / "c.yaml")
        return {cell_id: jobs.start_code(cell) for cell_id, cell in jobs.cells.items()}

    before = codes()
    start = f"-start{encoders.directory_sha256(directory)[:16]}"
    assert {k: v for k, v in before.items() if k.startswith("P7/")} == dict.fromkeys(
        ["P7/dpsgd/L16-E1-eps10-lr0.5-fthead-s0", "P7/dpsgd/L16-E1-eps10-lr0.5-ftlora4-s0"], start)
    assert [v for k, v in before.items() if not k.startswith("P7/")] == [""]
    weights = directory / "model.safetensors"
    save_file({k: v * 2 for k, v in load_file(weights).items()}, weights)
    from dpbench.pipeline import jobs as jobs_module

    jobs_module._directory_sha256.cache_clear()  # a new workflow process
    after = codes()
    assert {k for k in before if before[k] != after[k]} == {k for k in before if k.startswith("P7/")}
    assert after["P7/dpsgd/L16-E1-eps10-lr0.5-fthead-s0"] == f"-start{encoders.directory_sha256(directory)[:16]}"
    rules = (REPO / "workflow" / "rules" / "common.smk").read_text()
    assert "+ JOBS.start_code(cell)" in rules.split("def train_code(wildcards):")[1].split("\ndef ")[0]


def test_prefix_stores_are_opt_in_one_per_problem_encoder_and_mode(tiny_bert_dir, tmp_path):
    """Config key prefix_store: the head cell reads its mode's store (its command line gains
    --prefix-store, its id does not change), the lora cell none; one prefix_store job per store,
    named by the encoder (a local directory by its files' hash); off, the command lines are as before."""
    import hashlib
    import json

    from dpbench.pipeline.jobs import load_jobs

    for directory in (None, tiny_bert_dir):
        listings = {}
        for on in (False, True):
            (tmp_path / "c.yaml").write_text(yaml.safe_dump({**config(directory), "prefix_store": on}))
            jobs = load_jobs(tmp_path / "c.yaml")
            listings[on] = {cell: jobs.train_args(c) for cell, c in jobs.cells.items()}, jobs.listing(), jobs
        (args_off, listing_off, _), (args_on, listing_on, jobs) = listings[False], listings[True]
        head, lora = "P7/dpsgd/L16-E1-eps10-lr0.5-fthead-s0", "P7/dpsgd/L16-E1-eps10-lr0.5-ftlora4-s0"
        assert args_on.keys() == args_off.keys() == {head, lora} and args_on[lora] == args_off[lora]
        encoder = ("all-MiniLM-L6-v2" if directory is None else "dir-" + hashlib.sha256(json.dumps(
            encoders.file_hashes(directory), sort_keys=True).encode()).hexdigest()[:16])
        store = f"results-encoder/cache/prefix/P7/{encoder}/head.npy"
        assert args_on[head] == f"{args_off[head]} --prefix-store {store}"
        assert [j for j in listing_on if j not in listing_off] == [("prefix_store", store)]
        assert jobs.prefix_store_job(store) == ("fortunes", "--problem P7 --finetune head" + (
            f" --pretrained-dir {directory}" if directory else ""))


def test_a_pretrained_dir_that_is_no_encoder_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"config key pretrained_dir: .*config.json: missing"):
        expand(validate(config(tmp_path)))
    with pytest.raises(ConfigError, match=r"config key grid.0.lora_ranks.0: finetune lora_rank=400 exceeds the width 384"):
        expand(validate({**config(), "grid": [{**config()["grid"][0], "lora_ranks": [400]}]}))


@pytest.mark.realdata
@REAL
def test_the_tiny_encoder_workflow_end_to_end(tmp_path, tiny_bert_dir):
    work = tmp_path / "repo"
    work.mkdir()
    copy_repo(work)
    (work / "enc.yaml").write_text(yaml.safe_dump(config(tiny_bert_dir)))
    command = [snakemake_exe(), "--profile", work / "workflow" / "profiles" / "default", "--configfile", "enc.yaml",
               "--cores", "2"]
    proc = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=600, env=tree_env(work))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert len(re.findall(r"\(Rule: train\)", log)) == 2 and "(Rule: pretrain)" not in log
    results = work / "results-encoder"
    hashes = encoders.file_hashes(tiny_bert_dir)
    for path in sorted(results.glob("runs/P7/dpsgd/*.parquet")):
        meta = read_meta(path)
        start = meta["start"]
        assert start["encoder_files"] == hashes and start["encoder"] is None
        mode = modes.parse(start["mode"], lora_rank=start["lora_rank"])
        assert start["trainable_parameters"] == facts("P7").trainable(start["model_dims"], mode)
        assert meta["result"]["status"] == "completed" and meta["privacy"]["epsilon"] <= 10.0
        assert meta["layout"]["prefix"] == ("memory" if start["mode"] == "head" else "none")
    table = (results / "figures" / "finetune_table.md").read_text()
    assert "LoRA (r = 4)" in table and "head (linear probe)" in table
