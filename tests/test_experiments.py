"""Experiments: study registry, the runner's rows, the report, one small study end to end."""

import csv

import pytest

from csbp import experiments
from csbp.experiments import c_drafters, load
from csbp.experiments.cli import run as cli_run
from csbp.experiments.f_profile import exposed_attention_s
from csbp.experiments.report import table
from csbp.experiments.runner import H100_1x8, Runner
from csbp.simulator.commands.cli import main
from csbp.simulator.errors import InputError
from csbp.simulator.workload.presets import load_model
from csbp.simulator.report.result import Result, TraceEvent
from csbp.simulator.workload.workload import Workload


def test_every_study_is_listed_and_loads(capsys):
    assert main(["experiments", "list"]) == 0
    out = capsys.readouterr().out
    for name in experiments.STUDIES:
        assert name in out
        study = load(name)
        assert study.ASSUMPTIONS and study.UNVERIFIED and callable(study.run)
    assert load("c") is c_drafters
    with pytest.raises(InputError):
        load("z")


def test_a_row_that_nothing_fits_says_why():
    model = load_model("nemotron-diffusion-14b")
    row = Runner(workers=1).row(model, Workload(seq_len=1024 * 1024, checkpointing="none"), H100_1x8,
                                checkpointing=("none",))
    assert row["best_plan"] == "none fits" and "memory" in row["note"]


def test_drafter_study_end_to_end(tmp_path, monkeypatch):
    """One context of study c: the planner picks both plans, CSV, summary and plot are written."""
    monkeypatch.setattr(c_drafters, "CONTEXTS", ("64k",))
    args = type("Args", (), {"action": "run", "name": "c", "out": str(tmp_path), "jobs": 1})()
    assert cli_run(args) == 0
    rows = list(csv.DictReader((tmp_path / "c-drafters.csv").open()))
    assert len(rows) == 2
    for row in rows:
        assert row["best_plan"] and row["baseline_plan"]
        assert float(row["best_tokens_s"]) >= float(row["baseline_tokens_s"])
        # conventional CP replicates the draft decoder and loss: it cannot beat CSBP
        assert float(row["csbp_tokens_s"]) > float(row["cp_tokens_s"])
    summary = (tmp_path / "summary.md").read_text()
    assert "Unverified inputs" in summary and "Muse-Glimmer" in summary
    assert (tmp_path / "c_drafter_crossover.png").stat().st_size > 1000


def test_exposed_attention_counts_idle_time_released_by_attention_transfers():
    def ev(stream, name, start, dur, cat="compute"):
        return TraceEvent(0, stream, name, start, dur, "forward", cat)

    trace = [ev("compute", "a", 0.0, 1.0), ev("comm", "kv", 0.0, 1.5, "attention-kv"),
             ev("compute", "b", 1.5, 1.0), ev("comm", "grads", 2.5, 1.0, "gradients"),
             ev("compute", "c", 3.5, 1.0)]
    r = Result(True, None, "m", "h", 1, 1, {}, {}, "des", trace=trace)
    assert exposed_attention_s(r) == pytest.approx(0.5)  # the 1.0 s wait for gradients is not attention


def test_table_formats_numbers_and_missing_values():
    out = experiments.StudyOutput([{"a": 1234.5, "b": None, "c": 1.234}], [("a", "A"), ("b", "B"), ("c", "C")])
    assert table(out)[-1] == "| 1,234 | — | 1.23 |"
