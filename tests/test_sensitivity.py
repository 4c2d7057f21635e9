"""`csbp plan --sensitivity`: a borderline recommendation is flagged, a safe one is not."""

from __future__ import annotations

import json

import pytest

from csbp.simulator.planner import planner
from csbp.simulator.grids import sensitivity
from csbp.simulator.commands.cli import main
from csbp.simulator.report.result import Result


def borderline(model, workload, plan, profile, nodes, engine="closed-form", overlap=True, with_trace=True):
    """A stand-in engine with a known answer: CSBP runs at 1150 tokens/s whatever the hardware,
    CP at 1000 x (NVLink send/recv bandwidth / 180 GB/s), everything else slower. At the profile's
    own figures CSBP wins by 15 %; 20 % more NVLink bandwidth makes CP win, 10 % does not."""
    speed = {"csbp": 1150.0, "cp": 1000.0 * profile.links.nvlink.p2p_gbs / 180.0}.get(plan.kind, 400.0)
    speed /= plan.tp  # one winner per family: TP only costs here
    return Result(feasible=True, reason=None, model=model.name, hardware=profile.name, nodes=nodes,
                  gpus=nodes * profile.node.gpus_per_node,
                  plan=plan.model_dump() | {"kind": plan.kind, "label": plan.label()},
                  workload=workload.model_dump(), engine=engine, step_time_s=workload.seq_len / speed,
                  tokens_per_s=speed, peak_memory_gib=10.0, attention_traffic_gib_per_gpu=1.0,
                  exposed_comm_s=0.0)


@pytest.fixture
def borderline_engine(monkeypatch):
    monkeypatch.setattr(planner, "simulate", borderline)
    monkeypatch.setattr(sensitivity, "simulate", borderline)


ARGV = ["plan", "--model", "tiny", "--seq-len", "4096", "--nodes", "1", "--engine", "closed-form",
        "--jobs", "1", "--axes", "dp,cp,bp", "--sensitivity"]


def test_a_flip_inside_the_range_is_reported(borderline_engine, capsys):
    assert main([*ARGV, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sens = out["sensitivity"]
    assert sens["nominal"]["family"] == "csbp" and sens["nominal"]["speedup"] == pytest.approx(1.15)
    assert sens["flips"] == ["NVLink bandwidth"]
    nvlink = next(i for i in sens["inputs"] if i["input"] == "nvlink")
    by = {o["factor"]: o for o in nvlink["outcomes"]}
    assert by[1.2]["flipped"] and by[1.2]["family"] == "cp" and by[1.2]["family_flipped"]
    assert not by[1.1]["flipped"] and by[1.1]["speedup"] == pytest.approx(1150 / 1100)
    assert by[0.8]["speedup"] == pytest.approx(1150 / 800)  # the speedup moves, the winner stays
    attention = next(i for i in sens["inputs"] if i["input"] == "attention")
    assert not attention["flips"]
    ib = next(i for i in sens["inputs"] if i["input"] == "ib")
    assert ib["skipped"] and not ib["outcomes"]  # one node: nothing crosses InfiniBand
    interference = next(i for i in sens["inputs"] if i["input"] == "interference")
    assert interference["outcomes"] and not sens["not_modelled"]  # varied like the others


def test_the_text_names_the_flip(borderline_engine, capsys):
    assert main(ARGV) == 0
    out = capsys.readouterr().out
    assert "Sensitivity" in out and "flip: NVLink bandwidth +20 %" in out and "family CSBP -> CP" in out
    assert "compute-communication interference" in out


def test_no_flip_on_a_clear_winner(monkeypatch, capsys):
    from test_planner import fake_result  # CSBP wins by a wide margin, hardware-blind

    monkeypatch.setattr(planner, "simulate", fake_result)
    monkeypatch.setattr(sensitivity, "simulate", fake_result)
    assert main([*ARGV, "--json"]) == 0
    sens = json.loads(capsys.readouterr().out)["sensitivity"]
    assert sens["flips"] == [] and all(not i["flips"] for i in sens["inputs"])
    reserve = next(i for i in sens["inputs"] if i["input"] == "reserve")
    assert [o["factor"] for o in reserve["outcomes"]] == [0.8, 1.2]  # re-screened at the ends


def test_without_the_flag_there_is_no_sensitivity(borderline_engine, capsys):
    assert main([a for a in ARGV if a != "--sensitivity"] + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sensitivity"] is None
