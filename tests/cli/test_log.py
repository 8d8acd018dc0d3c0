"""Diagnostics through one logger (dpbench.log): the progress lines a user sees during training
read as before, on stderr; results stay on stdout; warnings carry the prefix of the command's
errors; ``--quiet`` and DPBENCH_LOG_LEVEL set the level."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dpbench import cli, log

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["train", "--problem", "P2", "--optimizer", "dpsgd", "--lr", "0.1", "--batch-size", "60", "--epochs", "1",
         "--seed", "0", "--noise-multiplier", "1", "--accountant", "rdp", "--max-steps", "2", "--test-subset", "20",
         "--progress-every", "1e9"]
LABEL = re.escape("[P2 dpsgd lr=0.1 L=60 eps=None seed=0]")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (the logger's first set-up is per process)."""
    environ = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    environ.pop("DPBENCH_LOG_LEVEL", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**environ, **env})


@pytest.mark.slow  # three short training runs through the command line: about 3 s
def test_a_short_training_run_shows_its_progress_lines_on_stderr_and_quiet_hides_them(tiny_fmnist, tmp_path,
                                                                                     capsys):
    assert cli.main([*TRAIN, "--out", str(tmp_path / "run.parquet")]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    # the run's header and the progress line at the end of its one epoch, word for word as printed before
    header = LABEL + r" N=\d+ q=[0-9.]+ T=\d+ steps=2 sigma=1 \(given\) device=cpu"
    assert any(re.fullmatch(header, x) for x in lines), lines
    assert any(re.fullmatch(LABEL + r" step 2/2 \(100%\) epoch 1 test loss [0-9.]+ acc [0-9.]+ \| [0-9.]+ steps/s "
                            r"\| eta 0s", x) for x in lines), lines
    assert any(x.startswith(f"wrote {tmp_path / 'run.parquet'}: status=") for x in lines), lines
    assert captured.out == ""  # diagnostics never on stdout

    assert cli.main(["--quiet", *TRAIN, "--out", str(tmp_path / "quiet.parquet")]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main([*TRAIN, "--out", str(tmp_path / "again.parquet")]) == 0  # the next command: the level again
    assert "step 2/2 (100%)" in capsys.readouterr().err


def test_one_format_warnings_carry_the_commands_prefix_and_info_reads_as_written():
    proc = _python("from dpbench import log\n"
                   "log.get('dpbench.x').info('[label] step 1/2 (50%)')\n"
                   "log.get('dpbench.x.y').warning('checkpoint c is damaged')\n"
                   "log.get('dpbench').error('no such file')\n"
                   "log.get('dpbench.x').debug('hidden at info')\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == ("[label] step 1/2 (50%)\ndpbench: warning: checkpoint c is damaged\n"
                           "dpbench: error: no such file\n")


def test_the_environment_sets_the_level_and_a_bad_value_is_named_not_ignored_silently():
    code = ("from dpbench import log\n"
            "log.get('dpbench.x').debug('a debug line')\nlog.get('dpbench.x').info('an info line')\n"
            "log.get('dpbench.x').warning('a warning')\n")
    assert _python(code, DPBENCH_LOG_LEVEL="debug").stderr == ("a debug line\nan info line\n"
                                                               "dpbench: warning: a warning\n")
    assert _python(code, DPBENCH_LOG_LEVEL="WARNING").stderr == "dpbench: warning: a warning\n"
    assert _python(code, DPBENCH_LOG_LEVEL="loud").stderr == (
        "dpbench: warning: ignoring DPBENCH_LOG_LEVEL='loud' (expected one of debug, info, warning, error)\n"
        "an info line\ndpbench: warning: a warning\n")


def test_lines_go_to_the_current_stderr_once_and_not_to_the_root_logger(capsys):
    import logging

    root = logging.getLogger()
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    catch = Catch()
    root.addHandler(catch)
    try:
        log.get("dpbench.test_log").info("to whatever stderr is now")
    finally:
        root.removeHandler(catch)
    assert capsys.readouterr().err == "to whatever stderr is now\n"  # capsys replaced sys.stderr after set-up
    assert seen == []  # no second copy through an application's own handlers
    with pytest.raises(ValueError, match="logger 'torch' is not dpbench's"):
        log.get("torch")
