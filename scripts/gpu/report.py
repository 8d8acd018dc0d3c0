"""Markdown summaries for scripts/gpu/run.sh.

  python scripts/gpu/report.py pytest JUNIT.xml          test counts, failures, measured TF32 excess
  python scripts/gpu/report.py workflow RESULTS_DIR      runs of the workflow and its figures
  python scripts/gpu/report.py smoke-config IN OUT       the part2 config shrunk for a CPU smoke run
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def pytest_summary(junit: str) -> str:
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = ["### `pytest -m cuda`", "",
             f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
             f"of {counts['tests']} ({float(suite.get('time', 0)):.0f} s).", ""]
    bad = [c for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    for case in bad:
        node = case.find("failure") if case.find("failure") is not None else case.find("error")
        lines.append(f"* FAILED {case.get('classname')}::{case.get('name')}: {(node.get('message') or '')[:300]}")
    props = [(p.get("name"), float(p.get("value"))) for p in suite.iter("property") if "tf32" in p.get("name", "")]
    if props:
        lines += ["", "Clipped norms (normalised clipping, every example clipped): max true norm - 1", "",
                  "| problem, device, TF32 | max excess over 1 |", "| --- | ---: |"]
        lines += [f"| {name.replace('_max_excess', '').replace('_', ' ')} | {value:.2e} |" for name, value in props]
    return "\n".join(lines) + "\n"


def workflow_summary(results: str) -> str:
    import pandas as pd

    root = Path(results)
    runs = pd.read_parquet(root / "aggregate" / "runs.parquet")
    columns = [c for c in ("problem", "optimizer", "batch_size", "epochs", "target_epsilon", "epsilon", "steps",
                           "status", "best_test_accuracy", "best_test_loss", "steps_per_second", "device")
               if c in runs.columns]
    lines = ["### The workflow on the GPU (scripts/gpu/workflow.yaml)", "",
             "| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    for _, r in runs[columns].iterrows():
        lines.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r) + " |")
    figures = sorted(p.name for p in (root / "figures").glob("*.png"))
    lines += ["", f"Figures: {', '.join(figures) or 'none'}."]
    return "\n".join(lines) + "\n"


def smoke_config(src: str, dst: str) -> None:
    import yaml

    config = yaml.safe_load(Path(src).read_text())
    config["train"] = {"train_subset": 1024, "test_subset": 500}
    for block in config["grid"]:
        block["batch_sizes"] = [256]
    Path(dst).write_text(yaml.safe_dump(config))


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    if what == "smoke-config":
        smoke_config(*args)
    else:
        print({"pytest": pytest_summary, "workflow": workflow_summary}[what](*args), end="")
