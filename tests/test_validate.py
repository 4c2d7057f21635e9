"""Validation: the quick suite runs for real (bytes must match exactly; no timing assertion), the
report's arithmetic is right on made-up numbers, and bad input is one line with exit code 2."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from csbp.runtime.validation import validate as v
from csbp.runtime.validation import validation_report as report
from csbp.runtime.validation.validation_runs import SuiteRuns, run_places

ROOT = Path(__file__).resolve().parent.parent


def _csbp(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "csbp.simulator.commands.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


@pytest.mark.timeout(300)
def test_quick_suite_bytes_equal_and_report(tmp_path):
    png = tmp_path / "validation.png"
    r = _csbp("validate", "--quick", "--json", "--plot", str(png), timeout=280)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)  # exactly one JSON object on stdout
    assert {"median_abs_error", "max_abs_error", "noise", "bytes_equal", "ranking_matches",
            "rows", "profile_warnings", "median_abs_normalised_error", "host_drift", "probes"} <= set(report)
    assert isinstance(report["profile_warnings"], list)
    assert len(report["probes"]) == 3  # before the first round and after each world size's
    assert all(row["normalised_error"] is not None for row in report["rows"])
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
    assert {c.workload.checkpointing for c in cases} == {"full", "none"}
    assert len(cases) == len({c.label for c in cases})
    for c in cases:
        c.plan.check_against(v.VALIDATION_MODEL, c.workload)


def _row(plan, world, measured, predicted, noise, L=256):
    return {"plan": plan, "world": world, "seq_len": L, "measured_step_s": measured,
            "predicted_step_s": predicted, "noise": noise}


def test_ranking_counts_only_pairs_apart_by_more_than_the_noise():
    rows = [_row("dp=2", 2, 1.0, 2.0, 0.02), _row("cp=2", 2, 1.02, 1.0, 0.02),  # within noise
            _row("bp=2", 2, 2.0, 3.0, 0.02), _row("cp=4", 4, 5.0, 1.0, 0.02)]   # other world
    pairs = report.ranking_pairs(rows)
    assert len(pairs) == 3  # only same world and context are compared
    decided = {(p["faster_measured"], p["slower_measured"]): p["agrees"] for p in pairs if p["decided"]}
    assert decided == {("dp=2", "bp=2"): True, ("cp=2", "bp=2"): True}


def test_relative_spread():
    assert report.relative_spread([1.0]) == 0.0
    assert report.relative_spread([0.9, 1.0, 1.1]) == pytest.approx(0.1)


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
    probes = [{"probe_step_s": t} for t in (0.11, 0.09, 0.12)]
    d = report.drift(0.1, probes)
    assert d["before"] == pytest.approx(0.1) and d["after"] == pytest.approx(0.2)
    assert d["min"] == pytest.approx(-0.1) and d["max"] == pytest.approx(0.2)
    assert report.drift(None, probes) is None and report.drift(0.1, []) is None


def test_run_places_are_the_middles_of_runs_in_their_round():
    assert run_places([1.0, 3.0]) == [pytest.approx(0.125), pytest.approx(0.625)]
    assert run_places([0.0, 0.0]) == [0.25, 0.75]


GIB = 1024**3


def _summary(step_s: float, bytes_: int = 1000) -> dict:
    return {"step_time_s": step_s, "step_times_s": [step_s], "attention_bytes_counted": bytes_,
            "attention_bytes_predicted": bytes_, "attention_bytes_match": True, "peak_memory_gib": 1.0,
            "loss": 5.0, "warmup": 2, "steps": 3}


def _prediction(step_s: float, bytes_: int = 1000):
    return SimpleNamespace(step_time_s=step_s, attention_traffic_gib_per_gpu=bytes_ / GIB,
                           peak_memory_gib=0.9, peak_allocated_gib=0.8,
                           peak_memory_at={"rank": 0, "phase": "backward", "op": "attn.local",
                                           "layer": 1}, peak_breakdown_gib={"scores": 0.5})


def test_normalised_error_takes_the_host_drift_out():
    cases = v.suite(quick=True)[:2]
    # the host ran 20 % slow in the first repeat and 10 % fast in the second; the model is exact
    runs = SuiteRuns(runs=[[_summary(1.2), _summary(0.9)], [_summary(2.4), _summary(1.8)]],
                     probe_at_run=[[0.12, 0.09], [0.12, 0.09]],
                     probes=[{"probe_step_s": 0.12}, {"probe_step_s": 0.09}])
    r = report.compare(cases, runs, [_prediction(1.0), _prediction(2.0)], probe_at_calibration=0.1)
    for row in r["rows"]:
        assert row["normalised_error"] == pytest.approx(0.0)
        assert row["normalised_noise"] == pytest.approx(0.0)
        assert row["error"] == pytest.approx(1 / 1.05 - 1) and row["noise"] == pytest.approx(0.15 / 1.05)
    assert r["median_abs_normalised_error"] == pytest.approx(0.0)
    assert r["max_abs_error"] == pytest.approx(1 - 1 / 1.05)
    assert r["host_drift"]["before"] == pytest.approx(0.2) and r["bytes_equal"] is True
    # memory: the allocated peak on both sides (not the reserve-inclusive peak_memory_gib)
    assert all(row["memory_error"] == pytest.approx(-0.2) for row in r["rows"])
    assert r["median_abs_memory_error"] == pytest.approx(0.2) == r["max_abs_memory_error"]
    assert r["rows"][0]["predicted_peak_memory_at"]["op"] == "attn.local"
    none = report.compare(cases, SuiteRuns(runs.runs, [[None, None]] * 2, []), [_prediction(1.0)] * 2, None)
    assert none["median_abs_normalised_error"] is None and none["host_drift"] is None


def test_validate_warns_about_a_profile_from_another_host(tmp_path, monkeypatch, capsys):
    """The command end to end on made-up runs: the warning line first, then the JSON with it."""
    from csbp.simulator.commands.cli import main

    raw = yaml.safe_load((ROOT / "hardware_profiles" / "cpu-measured.yaml").read_text())
    raw |= {"host": "elsewhere", "cpu_model": "Other CPU", "cpus": 64, "torch": "0.0.1", "date": "2020-01-01"}
    profile = tmp_path / "elsewhere.yaml"
    profile.write_text(yaml.safe_dump(raw, sort_keys=False))

    def fake_suite(cases, repeats, steps, warmup, timeout_s, progress, probing):
        assert probing  # the profile has a reference probe: the suite times it between rounds
        return SuiteRuns([[_summary(1.0)] for _ in cases], [[0.15] for _ in cases],
                         [{"after": "start", "probe_step_s": 0.15, "elapsed_s": 0.0}])

    monkeypatch.setattr(v, "measure_suite", fake_suite)
    monkeypatch.setattr(v, "predict", lambda case, p: _prediction(1.1))
    png = tmp_path / "v.png"
    assert main(["validate", "--quick", "--json", "--profile", str(profile), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    warnings = [line for line in err.splitlines() if line.startswith("csbp: warning:")]
    assert len(warnings) == len(got["profile_warnings"]) == 3  # another host, torch, 2020
    assert "another host" in warnings[0] and "csbp calibrate" in warnings[0]
    assert got["median_abs_error"] == pytest.approx(0.1) and got["rows"][0]["normalised_error"] is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _rows_by_world() -> list[dict]:
    """World-2 plans predicted 20 % fast, world-4 plans 30 % slow: the issue-26 split."""
    rows = []
    for world, error in ((2, -0.2), (4, 0.3)):
        for kind in ("dp", "cp", "bp", "csbp"):
            rows.append({"plan": f"{kind}={world}", "kind": kind, "world": world, "error": error,
                         "normalised_error": error / 2})
    return rows


def test_errors_are_grouped_by_world_size_and_plan_family():
    groups = {g["label"]: g for g in report.error_groups(_rows_by_world())}
    assert set(groups) == {"world 2", "world 4", "dp plans", "cp plans", "bp plans", "csbp plans"}
    assert groups["world 2"]["plans"] == 4 and groups["world 2"]["mean_error"] == pytest.approx(-0.2)
    assert groups["world 4"]["mean_normalised_error"] == pytest.approx(0.15)
    # every family mixes both worlds: its signed mean hides the split, its mean |error| does not
    assert groups["cp plans"]["mean_error"] == pytest.approx(0.05)
    assert groups["cp plans"]["mean_abs_error"] == pytest.approx(0.25)
    worst = report.worst_group(report.error_groups(_rows_by_world()), "mean_error")
    assert worst["label"] == "world 4"
    rows = _rows_by_world()
    rows[0]["normalised_error"] = None  # a row without a probe: no normalised mean for its groups
    groups = {g["label"]: g for g in report.error_groups(rows)}
    assert groups["world 2"]["mean_normalised_error"] is None
    assert groups["world 4"]["mean_normalised_error"] is not None


def test_report_names_the_worst_group(tmp_path, monkeypatch, capsys):
    """The text report: a table of group means and the worst group on the summary lines; the
    JSON carries the groups."""
    from csbp.simulator.commands.cli import main

    def fake_suite(cases, repeats, steps, warmup, timeout_s, progress, probing):
        return SuiteRuns([[_summary(1.0)] for _ in cases], [[0.15] for _ in cases],
                         [{"after": "start", "probe_step_s": 0.15, "elapsed_s": 0.0}])

    monkeypatch.setattr(v, "measure_suite", fake_suite)
    monkeypatch.setattr(v, "predict", lambda case, p: _prediction(0.9 if case.plan.world == 2 else 1.4))
    png = tmp_path / "v.png"
    assert main(["validate", "--quick", "--plot", str(png)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # however rich wraps the line
    assert "worst group world 4: mean +40.0%" in out
    assert main(["validate", "--quick", "--json", "--plot", str(png)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["worst_group"]["label"] == "world 4"
    assert {(g["by"], g["group"]) for g in got["groups"]} == {
        ("world", 2), ("world", 4), ("kind", "cp"), ("kind", "csbp")}
