"""Behaviour unchanged, proven: the golden runs (tests/golden/runs.py) recomputed now equal the
ones recorded before the package was restructured, bit for bit, on the CPU: every registered
optimizer on P2 (real Fashion-MNIST) and P4 (generated quotations), three steps at seed 0 (metrics,
sigma, target and achieved epsilon, canary exposures), and one audit per mechanism family
(scores and bounds)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
import runs as golden  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.realdata]


def differences(want, got, path=""):
    """Paths at which two JSON trees differ (values compared exactly)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}/{k}: missing" for k in want.keys() - got.keys()]
        out += [f"{path}/{k}: new" for k in got.keys() - want.keys()]
        for k in sorted(want.keys() & got.keys()):
            out += differences(want[k], got[k], f"{path}/{k}")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in differences(w, g, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: recorded {want!r}, now {got!r}"]


def test_differences_finds_one_changed_bit():
    a = {"P2/dpsgd": {"privacy": {"noise_multiplier": 0.6181640625}, "metrics": {"loss": [2.31, 2.32]}}}
    b = json.loads(json.dumps(a))
    assert differences(a, b) == []
    b["P2/dpsgd"]["metrics"]["loss"][1] = 2.3200000000000003  # one ulp
    assert differences(a, b) == ["/P2/dpsgd/metrics/loss[1]: recorded 2.32, now 2.3200000000000003"]


def test_the_golden_runs_are_bit_identical(fmnist_dir):
    recorded = json.loads(golden.GOLDEN.read_text())
    now = json.loads(json.dumps(golden.compute(str(fmnist_dir))))  # the same JSON round trip as recorded
    found = differences(recorded, now)
    assert not found, f"{len(found)} differences, first: " + "; ".join(found[:10])
