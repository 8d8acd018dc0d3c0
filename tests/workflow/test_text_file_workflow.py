"""A user's own labelled text file through the workflow: the config's ``text_file`` (a CSV with
named columns, a GLUE SST-2 TSV) for P8's fine-tuning cells from the tiny BERT fixture
(tests/tiny_bert.py): read and checked when the config is read, its N and classes the grid's, its
SHA-256 on the cells' command lines (a changed file changes them), end to end through Snakemake."""

from __future__ import annotations

import hashlib
import subprocess

import pytest
import yaml

from conftest import copy_repo, snakemake_exe, tree_env
from dpbench.data import labelled_text as lt
from dpbench.pipeline.grid import ConfigError, expand, validate
from dpbench.problems import facts, modes
from dpbench.reporting.results import read_meta

WORDS = ["good", "fine", "great", "bad", "dull", "awful"]


def reviews(n=40):
    return [(f"the {WORDS[i % 6]} film number {i}", int(WORDS[i % 6] in WORDS[:3])) for i in range(n)]


def write_csv(path):
    path.write_text("stars,review\n" + "".join(f"{y},{t}\n" for t, y in reviews()))
    return {"path": str(path), "text": "review", "label": "stars"}


def write_sst2(path):
    path.write_text("sentence\tlabel\n" + "".join(f"{t} \t{y}\n" for t, y in reviews()))
    return {"path": str(path)}


def config(text_file, encoder) -> dict:
    return {"data_dir": "data", "results_dir": "results-text", "pretrained_dir": str(encoder), "text_file": text_file,
            "train": {"accountant": "rdp", "max_steps": 2},
            "grid": [{"problems": ["P8"], "batch_sizes": [8], "epsilons": [10], "epochs": [1], "seeds": [0],
                      "finetune": ["head"], "optimizers": {"dpsgd": {"lr": [0.5]}}}]}


@pytest.mark.parametrize("write", [write_csv, write_sst2], ids=["csv", "sst2"])
def test_the_grid_reads_the_files_n_classes_and_hash(tiny_bert_dir, tmp_path, write):
    given = write(tmp_path / ("mine.csv" if write is write_csv else "train.tsv"))
    data = lt.load(lt.LocalFile(given["path"], text=given.get("text"), label=given.get("label")))
    (cell,) = expand(validate(config(given, tiny_bert_dir)))
    train = {"max_steps": 2}
    assert cell.n_train(train) == len(data.train) != facts("P8").train_size
    assert cell.data.sha256 == hashlib.sha256((tmp_path / given["path"]).read_bytes()).hexdigest() == data.sha256
    assert cell.facts.classes == ("0", "1") and cell.dataset == data.name
    args = cell.train_args(train)
    assert args[args.index("--text-file") + 1] == given["path"] and args[args.index("--text-sha256") + 1] == data.sha256
    assert ("--text-column" in args) == (write is write_csv)
    # a mode's d counts the file's classes: the tiny BERT's head of 2 outputs
    assert cell.trainable_parameters == 32 * 2 + 2
    from dpbench.pipeline.jobs import load_jobs

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config(given, tiny_bert_dir)))
    jobs = load_jobs(tmp_path / "c.yaml")
    assert jobs.data_inputs(jobs.cells[cell.id]) == {"text_file": given["path"]}
    assert not [j for j in jobs.listing() if j[0] == "data"]  # the file is read by the run, not the data rule


def test_a_changed_file_changes_the_command_line_and_a_bad_one_is_refused(tiny_bert_dir, tmp_path):
    given = write_csv(tmp_path / "mine.csv")
    before = expand(validate(config(given, tiny_bert_dir)))[0].train_args({})
    with open(given["path"], "a") as f:
        f.write("1,the good film once more\n")
    after = expand(validate(config(given, tiny_bert_dir)))[0].train_args({})
    assert before != after and before[:before.index("--text-sha256")] == after[:after.index("--text-sha256")]
    with pytest.raises(ConfigError, match=r"^config key text_file: .*mine.csv: no column 'label'"):
        expand(validate(config({"path": given["path"], "text": "review"}, tiny_bert_dir)))
    (tmp_path / "bad.csv").write_text("review,stars\nfine,1\nbad,0.5\n")
    with pytest.raises(ConfigError, match=r"bad.csv: row 2, column 'stars': label '0.5'"):
        expand(validate(config({"path": str(tmp_path / "bad.csv"), "text": "review", "label": "stars"},
                               tiny_bert_dir)))
    with pytest.raises(ConfigError, match=r"config key text_file: .*missing.csv: no such file"):
        expand(validate(config({"path": str(tmp_path / "missing.csv")}, tiny_bert_dir)))


@pytest.mark.slow
@pytest.mark.parametrize("write", [write_csv, write_sst2], ids=["csv", "sst2"])
def test_a_users_file_trains_end_to_end(tmp_path, tiny_bert_dir, write):
    work = tmp_path / "repo"
    work.mkdir()
    copy_repo(work)
    given = write(tmp_path / ("mine.csv" if write is write_csv else "train.tsv"))
    data = lt.load(lt.LocalFile(given["path"], text=given.get("text"), label=given.get("label")))
    (work / "text.yaml").write_text(yaml.safe_dump(config(given, tiny_bert_dir)))
    command = [snakemake_exe(), "--profile", work / "workflow" / "profiles" / "default", "--configfile", "text.yaml",
               "--cores", "2", "results-text/aggregate/runs.parquet"]
    proc = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=600, env=tree_env(work))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "(Rule: data)" not in log
    (path,) = sorted((work / "results-text").glob("runs/P8/dpsgd/*.parquet"))
    meta = read_meta(path)
    assert meta["data"]["file"]["sha256"] == data.sha256 and meta["data"]["n_train"] == len(data.train)
    assert meta["data"]["file"]["classes"] == ["0", "1"] and meta["result"]["status"] == "completed"
    assert meta["start"]["trainable_parameters"] == facts("P8").trainable(meta["start"]["model_dims"], modes.Head())
    assert meta["privacy"]["epsilon"] <= 10.0
