"""Validation: the quick suite runs for real (bytes must match exactly; no timing assertion), the
report's arithmetic is right on made-up numbers, and bad input is one line with exit code 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from csbp.runtime import validate as v

ROOT = Path(__file__).resolve().parent.parent


def _csbp(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "csbp.simulator.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


@pytest.mark.timeout(300)
def test_quick_suite_bytes_equal_and_report(tmp_path):
    png = tmp_path / "validation.png"
    r = _csbp("validate", "--quick", "--json", "--plot", str(png), timeout=280)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert {"median_abs_error", "max_abs_error", "noise", "bytes_equal", "ranking_matches",
            "rows"} <= set(report)
    assert report["bytes_equal"] is True
    assert {row["world"] for row in report["rows"]} == {2, 4}
    assert {row["kind"] for row in report["rows"]} == {"cp", "csbp"}
    for row in report["rows"]:
        assert row["attention_bytes_counted"] == row["attention_bytes_layout"] \
            == row["attention_bytes_simulated"] > 0
        assert row["measured_step_s"] > 0 and row["predicted_step_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_full_suite_covers_every_plan_kind_world_and_two_contexts():
    cases = v.suite(quick=False)
    assert len(cases) >= 8
    assert {c.plan.kind for c in cases} == {"dp", "cp", "bp", "csbp"}
    assert {c.plan.world for c in cases} == {2, 4}
    assert len({c.workload.seq_len for c in cases}) == 2
    for c in cases:
        c.plan.check_against(v.VALIDATION_MODEL, c.workload)


def _row(plan, world, measured, predicted, noise, L=256):
    return {"plan": plan, "world": world, "seq_len": L, "measured_step_s": measured,
            "predicted_step_s": predicted, "noise": noise}


def test_ranking_counts_only_pairs_apart_by_more_than_the_noise():
    rows = [_row("dp=2", 2, 1.0, 2.0, 0.02), _row("cp=2", 2, 1.02, 1.0, 0.02),  # within noise
            _row("bp=2", 2, 2.0, 3.0, 0.02), _row("cp=4", 4, 5.0, 1.0, 0.02)]   # other world
    pairs = v.ranking_pairs(rows)
    assert len(pairs) == 3  # only same world and context are compared
    decided = {(p["faster_measured"], p["slower_measured"]): p["agrees"] for p in pairs if p["decided"]}
    assert decided == {("dp=2", "bp=2"): True, ("cp=2", "bp=2"): True}


def test_relative_spread():
    assert v.relative_spread([1.0]) == 0.0
    assert v.relative_spread([0.9, 1.0, 1.1]) == pytest.approx(0.1)


@pytest.mark.parametrize("args, expected", [
    (["--plot", "out.txt"], "must be a .png"),
    (["--profile", "nosuch"], "unknown hardware profile"),
    (["--steps", "0"], "at least 1"),
])
def test_bad_input_is_one_line_exit_2(args, expected):
    r = _csbp("validate", *args)
    assert r.returncode == 2 and expected in r.stderr and r.stderr.count("\n") == 1
    assert r.stdout == ""


def test_host_drift_compares_the_reference_step_with_its_calibration():
    from csbp.runtime.validate import _drift
    from csbp.simulator.hardware import load_profile

    p = load_profile("cpu-measured")
    p = p.model_copy(update={"node": p.node.model_copy(update={"probe_step_s": 0.1})})
    d = _drift(p, 0.11, 0.12)
    assert d["before"] == pytest.approx(0.1) and d["after"] == pytest.approx(0.2)
    assert _drift(p, None, None) is None
