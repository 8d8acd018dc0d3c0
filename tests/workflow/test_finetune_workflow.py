"""Fine-tuning through the run, the command line, the grid and the workflow: a cell's start
(mode, LoRA rank, the public checkpoint) from its config to ``dpbench train``'s flags, the
checkpoint made once by the rule pretrain (or copied from a committed one after it verifies),
the matrix mechanisms' noise width d = the parameters a mode trains, the refusals (one line
naming the flag or key), and .test/config/finetune.yaml end to end through Snakemake."""

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, copy_repo, snakemake_exe, tree_env
from dpbench.cli import main
from dpbench.data import fortunes, wordnet
from dpbench.pipeline import fingerprint
from dpbench.pipeline.grid import ConfigError, expand, validate
from dpbench.pipeline.jobs import load_jobs, plan
from dpbench.problems import facts, get_problem
from dpbench.problems.finetune import from_checkpoint, trainable_count
from dpbench.problems import modes
from dpbench.problems.modes import DEFAULT_LORA_RANK, LoRA, Start
from dpbench.problems.transformer import TransformerLM
from dpbench.reporting.results import read_meta
from dpbench.training.recipes import RECIPES, checkpoint_name, from_json

REAL = pytest.mark.skipif(
    not all((wordnet.SYSTEM_DIRS[0] / f).is_file() for f in wordnet.SHA256)
    or not all((fortunes.SYSTEM_DIRS[0] / f).is_file() for f in fortunes.SHA256),
    reason="needs Debian's wordnet-base and fortunes (apt-get install wordnet-base fortunes)")
TINY_CONFIG = REPO / ".test" / "config" / "finetune.yaml"
# the tiny recipe at the fortunes records' 128 tokens, as the tiny config changes it
TINY128 = from_json({**RECIPES["tiny"].to_json(), "context": 128})


def block(**changes) -> dict:
    return {"problems": ["P6"], "batch_sizes": [16], "epochs": [1], "epsilons": [1], "seeds": [0],
            "optimizers": {"dpsgd": {"lr": [0.5]}}, **changes}


def cells_of(*blocks, **top):
    return expand(validate({"grid": list(blocks), **top}))


# -- the grid ------------------------------------------------------------------------------------

def test_modes_scratch_and_ranks_are_axes_of_a_block_with_their_id_parts():
    cells = cells_of(block(problems=["P5", "P6"], finetune=["full", "lora", "scratch", "bias"], lora_ranks=[4, 8]))
    ids = {c.id for c in cells}
    assert ids == {f"{p}/dpsgd/L16-E1-eps1-lr0.5-{part}-s0" for p in ("P5", "P6")
                   for part in ("ftfull", "ftlora4", "ftlora8", "ftscratch", "ftbias")}
    by_id = {c.id: c for c in cells}
    lora = by_id["P6/dpsgd/L16-E1-eps1-lr0.5-ftlora8-s0"]
    assert (lora.start, lora.recipe) == (Start(LoRA(8)), RECIPES["wordnet-lm"])
    run = lora.run_config({})
    assert (run.finetune, run.lora_rank, run.pretrained) == ("lora", 8, None)  # the checkpoint: Jobs gives it
    assert run.to_args()[-10:-6] == ["--finetune", "lora", "--lora-rank", "8"]  # then --delta, --clip-norm, ...
    scratch = by_id["P5/dpsgd/L16-E1-eps1-lr0.5-ftscratch-s0"]
    assert scratch.recipe is None and not scratch.fine_tunes
    assert "--finetune" not in scratch.train_args({}) and scratch.run_config({}).finetune is None
    # every start of a cell shares its seed: the twins differ only in their start
    assert len({c.seed for c in cells}) == 1


def test_a_pretrained_problem_without_the_key_fine_tunes_in_full_and_p1_to_p4_have_no_part():
    cells = cells_of(block(problems=["P4", "P6"]))
    assert [c.id for c in cells] == ["P4/dpsgd/L16-E1-eps1-lr0.5-s0", "P6/dpsgd/L16-E1-eps1-lr0.5-ftfull-s0"]
    assert cells[0].start is None and cells[0].trainable_parameters == facts("P4").parameters
    assert cells[1].start == Start(modes.Full()) and cells[1].run_config({}).lora_rank is None


def test_a_lora_cell_gets_the_default_rank_in_its_id():
    (cell,) = cells_of(block(finetune=["lora"]))
    assert cell.start.mode.rank == DEFAULT_LORA_RANK and cell.id.endswith(f"-ftlora{DEFAULT_LORA_RANK}-s0")


# The ids and command lines of the configs run before fine-tuning existed, as the grid wrote them
# at the commit before it (sha256 of the ids, one a line, and of Jobs.train_args, one a line):
# no cell of P1-P4 is renamed or rerun.
BEFORE = {"config.yaml": (6, "f039c75ccce0385e", "96a4b73cee7ec8d8"),
          "thesis.yaml": (2476, "d81b4719b347bc81", "2a9bcbbd98272ae6"),
          "lm.yaml": (48, "11159e0eaf7d1ff0", "484f1c8ed6a74ca6"),
          "setup2.yaml": (60, "c9f8f9372c0ac3d1", "a356b8c084a4c269")}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_existing_ids_and_command_lines_are_unchanged(name, capsys):
    jobs = load_jobs(REPO / "config" / name)
    digest = lambda lines: hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]  # noqa: E731
    assert (len(jobs.cells), digest(jobs.cells), digest(jobs.train_args(c) for c in jobs.cells.values())) == BEFORE[name]
    assert main(["grid", str(REPO / "config" / name)]) == 0
    assert capsys.readouterr().out.split() == list(jobs.cells)  # `dpbench grid` prints these ids


@pytest.mark.parametrize("changes,top,line", [
    ({"problems": ["P4"], "finetune": ["full"]}, {},
     "config key grid.0.finetune: problem P4 trains from scratch (its facts name no pretraining recipe)"),
    ({"problems": ["P4", "P6"], "lora_ranks": [4]}, {}, "config key grid.0.lora_ranks: problem P4 trains from scratch"),
    ({"finetune": ["full"], "lora_ranks": [4]}, {},
     "config key grid.0.lora_ranks: lora_ranks belong to mode lora, which grid.0.finetune (full) does not train"),
    ({"finetune": ["lora"], "lora_ranks": [129]}, {},
     "config key grid.0.lora_ranks.0: finetune lora_rank=129 exceeds the width 128 of layer blocks.*.attn.q"),
    ({"finetune": ["lora"], "lora_ranks": [40]}, {"pretrain": {"recipe": "tiny", "fields": {"context": 128}}},
     "config key grid.0.lora_ranks.0: finetune lora_rank=40 exceeds the width 32"),
    ({"finetune": ["ful"]}, {}, "config key grid.0.finetune.0: 'ful' is not one of the choices (did you mean 'full'?)"),
    ({}, {"pretrain": {"recipe": "wordnet"}},
     "config key pretrain.recipe: unknown pretraining recipe 'wordnet' (did you mean 'wordnet-lm'?)"),
    ({}, {"pretrain": {"recipe": "tiny"}}, "config key pretrain.recipe: recipe tiny's model reads 64 tokens, fewer "
                                           "than the 128 of the fine-tuning problems' records"),
    ({}, {"pretrain": {"recipe": "tiny", "fields": {"contxt": 128}}},
     "config key pretrain.fields.contxt: not a field of a recipe (did you mean 'context'?)"),
    ({}, {"pretrain": {"recipe": "tiny", "fields": {"context": 128, "steps": 0}}},
     "config key pretrain.fields: recipe tiny: steps must be a positive integer, got 0"),
])
def test_the_grid_refuses_in_one_line_naming_the_key(changes, top, line):
    with pytest.raises(ConfigError) as caught:
        cells_of(block(**changes), **top)
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value), str(caught.value)


def test_the_tiny_configs_recipe_names_its_checkpoint_and_the_rule_gets_its_fields():
    jobs = load_jobs(TINY_CONFIG)
    code = fingerprint.pretrain_fingerprint()
    path = f"results-finetune/cache/pretrain/{checkpoint_name(TINY128, code)}"
    assert {jobs.pretrained_of(c) for c in jobs.cells.values()} == {path} == {jobs.pretrained_file(TINY128)}
    assert jobs.pretrained_file("wordnet-lm").endswith(checkpoint_name(RECIPES["wordnet-lm"], code))
    # the command reads back the same recipe from the fields that differ from the defaults
    argument = jobs.recipe_argument("tiny", TINY128.key)
    assert from_json(json.loads(argument)) == TINY128 and "corpus_manifest" not in argument
    assert jobs.recipe_argument("tiny", RECIPES["tiny"].key) == "tiny" and jobs.recipe_of("tiny", "0" * 16) is None
    listing = jobs.listing()
    assert [f for rule, f in listing if rule == "pretrain"] == [path]
    assert [rule for rule, _ in listing].count("train") == 4
    for cell in jobs.cells.values():
        args = jobs.train_args(cell)
        assert f"--pretrained {path} " in args + " " and f"--finetune {cell.start.mode.name}" in args


# -- d of a fine-tuning cell -----------------------------------------------------------------------

@pytest.mark.parametrize("finetune", [["full"], ["lora"], ["last-block"], ["bias"], ["scratch"]])
def test_a_dense_matrix_mechanisms_noise_file_is_as_wide_as_the_parameters_the_mode_trains(finetune, capsys,
                                                                                           tmp_path):
    config = {"results_dir": str(tmp_path / "out"), "pretrain": {"recipe": "tiny", "fields": {"context": 128}},
              "grid": [block(finetune=finetune, optimizers={"dpmatrix-se": {"lr": 1.0}},
                             **({"lora_ranks": [4]} if finetune == ["lora"] else {}))]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    jobs = load_jobs(tmp_path / "c.yaml")
    (cell,) = jobs.cells.values()
    # the model the run builds: the problem's from a checkpoint of the recipe's dims, or its own from scratch
    problem = get_problem("P6")
    if cell.fine_tunes:
        state = TransformerLM(**TINY128.model_dims).state_dict()
        ck = type("Checkpoint", (), {"state_dict": state, "model_dims": TINY128.model_dims})
        built = trainable_count(from_checkpoint(problem, ck, cell.start.mode))
    else:
        built = sum(p.numel() for p in problem.build().parameters())
    noise = jobs.cache_files(cell)["noise"]
    assert noise.name.startswith(f"noise-d{built}-") and cell.trainable_parameters == built
    assert (built < facts("P6").parameters) == cell.fine_tunes  # the tiny model is smaller than P6's own
    assert main(["noise", "--estimate", str(tmp_path / "c.yaml")]) == 0
    assert re.search(rf"\| {re.escape(str(noise.relative_to(tmp_path / 'out' / 'cache')))} \| 811 \| {built} \|",
                     capsys.readouterr().out)


def test_the_train_rules_fingerprint_covers_the_fine_tuning_code():
    """A cell's code is optimizer_fingerprint + problem_fingerprint (common.smk's train_code):
    the harness it covers imports the fine-tuning modules, P6's own modules hold P5's and P6's."""
    closure = fingerprint.harness_closure((*fingerprint.HARNESS, "dpbench.optimizers.sgd"))
    assert {"dpbench.problems.finetune", "dpbench.problems.modes", "dpbench.training.config"} <= closure
    assert {"dpbench.problems.text_classification", "dpbench.problems.language"} <= fingerprint.problem_modules(
        fingerprint.problem_roots("P6"))
    # and the pretraining code's fingerprint (the checkpoint's name) holds none of the wiring
    assert not {"dpbench.training.config", "dpbench.pipeline.grid", "dpbench.cli.training",
                "dpbench.problems.finetune"} & fingerprint.module_closure(fingerprint.PRETRAIN)


# -- dpbench train's refusals ----------------------------------------------------------------------

def write_checkpoint(path: Path, dims: dict) -> str:
    """A checkpoint as dpbench pretrain writes it (state dict bytes and a sidecar with their SHA-256)."""
    from dpbench.training.pretrain import state_bytes

    data = state_bytes(TransformerLM(**dims).state_dict())
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    Path(f"{path}.json").write_text(json.dumps({"sha256": sha, "model_dims": dims, "recipe": {"name": "test"}}))
    return sha


TRAIN = ["train", "--optimizer", "dpsgd", "--lr", "0.5", "--batch-size", "16", "--epochs", "1", "--seed", "0",
         "--epsilon", "3"]


@pytest.mark.parametrize("args,line", [
    (["--problem", "P6", "--finetune", "full"],
     "argument --finetune: mode 'full' fine-tunes a checkpoint: give --pretrained (dpbench pretrain makes one)"),
    (["--problem", "P6", "--pretrained", "{ck}"],
     "argument --pretrained: a public start is fine-tuned in a mode: give --finetune (full, last-block, lora, bias, head)"),
    (["--problem", "P4", "--finetune", "full", "--pretrained", "{ck}"],
     "argument --finetune: finetune mode 'full': problem P4 trains from scratch (no pretrained checkpoint)"),
    (["--problem", "P6", "--finetune", "full", "--lora-rank", "4", "--pretrained", "{ck}"],
     "argument --lora-rank: finetune lora_rank=4 is given with mode 'full'; it belongs to mode 'lora' only"),
    (["--problem", "P6", "--lora-rank", "4"], "argument --lora-rank: it belongs to --finetune lora, not to no mode"),
    (["--problem", "P6", "--finetune", "lora", "--lora-rank", "33", "--pretrained", "{ck}"],
     "argument --lora-rank: finetune lora_rank=33 exceeds the width 32 of layer blocks.*.attn.q (32 -> 32)"),
    (["--problem", "P6", "--finetune", "lora", "--lora-rank", "0", "--pretrained", "{ck}"],
     "argument --lora-rank: expected a positive integer, got '0'"),
    (["--problem", "P6", "--finetune", "lowrank", "--pretrained", "{ck}"], 
     "argument --finetune: expected one of full, last-block, lora, bias, head, got 'lowrank'"),
    (["--problem", "P6", "--finetune", "bias", "--pretrained", "{damaged}"],
     "argument --pretrained: pretrained checkpoint {damaged} is damaged or swapped"),
    (["--problem", "P6", "--finetune", "bias", "--pretrained", "{short}"],
     "argument --pretrained: the checkpoint's model reads 64 tokens, fewer than the 128 of P6's records"),
])
def test_dpbench_train_refuses_in_one_line_naming_the_flag(args, line, tmp_path, capsys):
    dims = {"vocab_size": 258, "context": 128, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_mlp": 64}
    files = {"ck": tmp_path / "ck.pt", "damaged": tmp_path / "damaged.pt", "short": tmp_path / "short.pt"}
    write_checkpoint(files["ck"], dims)
    write_checkpoint(files["damaged"], dims)
    data = bytearray(files["damaged"].read_bytes())
    data[-100] ^= 1
    files["damaged"].write_bytes(bytes(data))
    write_checkpoint(files["short"], {**dims, "context": 64})
    args = [a.format(**files) for a in args]
    assert status([*TRAIN, *args, "--out", str(tmp_path / "run.parquet")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert line.format(**files) in err[-1], err
    assert not (tmp_path / "run.parquet").exists()


def status(argv) -> int:
    """dpbench's exit status: what ``main`` returns, or argparse's exit (a bad choice)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


# -- dpbench pretrain --reuse ----------------------------------------------------------------------

@pytest.mark.realdata
@REAL
def test_reuse_copies_a_verified_committed_checkpoint_and_refuses_a_damaged_one(tmp_path, capsys):
    code = fingerprint.pretrain_fingerprint()
    name = checkpoint_name(RECIPES["tiny"], code)
    committed = tmp_path / "committed"
    assert main(["pretrain", "--recipe", "tiny", "--out", str(committed / name), "--reuse",
                 str(tmp_path / "none")]) == 0
    err = capsys.readouterr().err
    assert f"no committed checkpoint {tmp_path / 'none' / name}; training" in err and "step 60/60" in err
    out = tmp_path / "cache" / name
    assert main(["pretrain", "--recipe", "tiny", "--expect", f"{RECIPES['tiny'].key}-{code}", "--out", str(out),
                 "--reuse", str(committed)]) == 0
    err = capsys.readouterr().err
    assert f"reused {committed / name}" in err and "no training" in err and "step " not in err
    assert out.read_bytes() == (committed / name).read_bytes()
    assert Path(f"{out}.json").read_bytes() == Path(f"{committed / name}.json").read_bytes()
    # a damaged committed checkpoint stops the job, naming it: nobody retrains believing they reused
    data = bytearray((committed / name).read_bytes())
    data[-100] ^= 1
    (committed / name).write_bytes(bytes(data))
    assert main(["pretrain", "--recipe", "tiny", "--out", str(tmp_path / "again.pt"), "--reuse", str(committed)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"argument --reuse: pretrained checkpoint {committed / name} is damaged or swapped" in err[0]
    assert not (tmp_path / "again.pt").exists()


# -- the tiny workflow -----------------------------------------------------------------------------

@pytest.mark.realdata
@REAL
def test_the_tiny_finetune_workflow_end_to_end(tmp_path):
    """.test/config/finetune.yaml through Snakemake: pretrain `tiny` (once), P5 and P6
    fine-tuned with DP-SGD in modes full and lora, the aggregate and the figure; each run file
    records its public start (the checkpoint whose SHA-256 the sidecar holds, no privacy spent)
    and trains the parameters its mode does; a second run of Snakemake has nothing to do."""
    work = tmp_path / "repo"
    work.mkdir()
    copy_repo(work)
    (work / "ft.yaml").write_text(TINY_CONFIG.read_text())
    command = [snakemake_exe(), "--profile", work / "workflow" / "profiles" / "default", "--configfile", "ft.yaml",
               "--cores", "2"]
    proc = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=600, env=tree_env(work))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert len(re.findall(r"\(Rule: pretrain\)", log)) == 1 and len(re.findall(r"\(Rule: train\)", log)) == 4
    results = work / "results-finetune"
    (checkpoint,) = (results / "cache" / "pretrain").glob("*.pt")
    assert checkpoint.name == checkpoint_name(TINY128, fingerprint.pretrain_fingerprint())
    sidecar = json.loads(Path(f"{checkpoint}.json").read_text())
    assert sidecar["sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    runs = sorted(results.glob("runs/P*/dpsgd/*.parquet"))
    assert [f"{p.parent.parent.name}/{p.stem}" for p in runs] == [
        f"{problem}/L16-E1-eps10-lr0.5-{part}-s0" for problem in ("P5", "P6") for part in ("ftfull", "ftlora4")]
    for path in runs:
        meta = read_meta(path)
        start, problem = meta["start"], meta["config"]["problem"]
        assert start["kind"] == "public checkpoint" and start["pretraining_epsilon"] == 0.0
        assert start["checkpoint_sha256"] == sidecar["sha256"] and start["recipe"] == "tiny"
        assert Path(start["checkpoint"]).name == checkpoint.name
        mode = modes.parse(start["mode"], lora_rank=start["lora_rank"])
        assert start["trainable_parameters"] == facts(problem).trainable(TINY128.model_dims, mode)
        assert meta["config"]["finetune"] == start["mode"] and meta["privacy"]["epsilon"] <= 10.0
        assert meta["result"]["status"] == "completed"
    assert (results / "figures" / "finetune.png").stat().st_size > 0
    table = (results / "figures" / "finetune_table.md").read_text()
    assert "LoRA (r = 4)" in table and "| full |" in table  # both modes of P6, apart
    p5 = (results / "figures" / "finetune_table_p5.md").read_text()  # the same table, drawn again for P5
    assert p5.startswith("# P5: ") and "LoRA (r = 4)" in p5 and "exposure" in p5
    again = subprocess.run([*command, "-n"], cwd=work, capture_output=True, text=True, timeout=300, env=tree_env(work))
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, again.stdout[-2000:]


def test_the_docs_table_of_modes_states_each_modes_d():
    """docs/finetune.md, "Fine-tuning runs": d of each mode for P5 and P6 at wordnet-lm's dims."""
    page = (REPO / "docs" / "finetune.md").read_text().split("## Fine-tuning runs", 1)[1]
    rows = re.findall(r"^\| `([\w-]+)` \|.*\| ([\d,]+) / ([\d,]+)(?: \(r = 16\))? \|$", page, re.M)
    assert [r[0] for r in rows] == list(modes.MODES)
    dims = RECIPES["wordnet-lm"].model_dims
    for mode, p5, p6 in rows:
        assert (int(p5.replace(",", "")), int(p6.replace(",", ""))) == (
            facts("P5").trainable(dims, modes.parse(mode)), facts("P6").trainable(dims, modes.parse(mode))), mode
