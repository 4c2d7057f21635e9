"""`csbp map`: each cell is what `csbp plan` answers there; the files, the reading, bad input."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from csbp.simulator.planner import planner
from csbp.simulator.commands.cli import main
from csbp.simulator.grids.map_reading import read_map
from csbp.simulator.planner.planner import label_of
from csbp.simulator.report.result import Result
from test_planner import fake_result


def _result(d: dict) -> Result:
    return Result(**{k: v for k, v in d.items() if k in Result.__dataclass_fields__})


def _map(capsys, tmp_path, *flags) -> dict:
    argv = ["map", "--model", "tiny", "--seq-lens", "2k", "--gpus", "8,16", "--out-dir", str(tmp_path),
            "--json", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def _plan(capsys, cell: dict, *flags) -> dict:
    argv = ["plan", "--model", cell["model"], "--seq-len", str(cell["seq_len"]), "--nodes",
            str(cell["gpus"] // 8), "--top", "1000", "--jobs", "1", "--json", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.floats
@pytest.mark.parametrize("flags", [
    ("--engine", "closed-form", "--axes", "cp,bp", "--jobs", "2"),  # BP wins over a CP baseline
    ("--engine", "closed-form", "--jobs", "1"),  # DP wins, BP loses
    ("--engine", "des", "--axes", "cp,bp", "--jobs", "1"),
    ("--engine", "closed-form", "--model", "nemotron-diffusion-8b", "--seq-lens", "64k", "--gpus", "8"),
])
def test_map_cells_equal_plan_runs(capsys, tmp_path, flags):
    """The real engines on small cells: the map says what a single `csbp plan` says."""
    cells = _map(capsys, tmp_path, *flags)["cells"]
    cell_flags = ("--jobs", "--model", "--seq-lens", "--gpus")
    plan_flags = [f for i, f in enumerate(flags) if f not in cell_flags and flags[i - 1] not in cell_flags]
    assert len(cells) == (1 if "--gpus" in flags else 2)
    for cell in cells:
        plan = _plan(capsys, cell, *plan_flags)
        rec, base = _result(plan["recommended"]), _result(plan["baseline"])
        assert cell["plan"] == label_of(rec) and cell["tokens_per_s"] == rec.tokens_per_s
        assert cell["best_no_bp_plan"] == label_of(base)
        assert cell["best_no_bp_tokens_per_s"] == base.tokens_per_s
        assert cell["speedup"] == plan["speedup"]
        engine = plan["search"]["engine"]
        bp = next((_result(c) for c in plan["candidates"] if c["plan"]["bp"] > 1 and c["engine"] == engine),
                  None)
        if bp is None:  # e.g. more ranks than the context has blocks
            assert cell["best_bp_plan"] is None and cell["bp_speedup"] is None
            continue
        assert cell["best_bp_plan"] == label_of(bp)
        # the map divides the same two tokens/s (its cells run the planner, one code path); 1e-12
        # allows the quotient another association or a JSON round trip, nothing more
        assert cell["bp_speedup"] == pytest.approx(bp.tokens_per_s / base.tokens_per_s, rel=1e-12)
        if rec.plan["bp"] > 1:
            assert cell["bp_speedup"] == pytest.approx(plan["speedup"], rel=1e-12)


def nothing_long(model, workload, plan, profile, nodes, engine="des", overlap=True, with_trace=True):
    """The planner tests' stand-in engine, with nothing fitting from 8K on and only BP at 4K."""
    r = fake_result(model, workload, plan, profile, nodes, engine, overlap, with_trace)
    if workload.seq_len >= 8192 or (workload.seq_len == 4096 and plan.bp == 1):
        r.feasible, r.reason, r.tokens_per_s = False, "out of memory: 99 GiB > 40 GiB usable", None
    return r


def test_map_files_reading_and_infeasible_cells(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(planner, "simulate", nothing_long)
    out = _map(capsys, tmp_path, "--seq-lens", "2k,4k,8k", "--engine", "closed-form", "--jobs", "1")
    names = {f.rsplit("/", 1)[-1] for f in out["files"]}
    assert names >= {"map-tiny-h200.csv", "map-tiny-h200.png", "map-tiny-h200.md"}
    df = pd.read_csv(tmp_path / "map-tiny-h200.csv")
    assert len(df) == 6 and list(df.seq_len.unique()) == [2048, 4096, 8192]
    long = df[df.seq_len == 8192]
    assert not long.feasible.any() and long.reason.str.startswith("memory").all()
    only_bp = df[df.seq_len == 4096]
    assert only_bp.feasible.all() and only_bp.best_no_bp_plan.isna().all() and only_bp.bp_speedup.isna().all()
    assert (df[df.seq_len == 2048].bp_speedup > 1).all()
    reading = out["reading"]
    assert reading == (tmp_path / "map-tiny-h200.md").read_text().split("\n\n")[2]
    assert "only BP plans fit at 4K on 8-16 GPUs" in reading
    assert "Nothing fits at 8K on 8-16 GPUs (memory)" in reading
    assert "CSBP wins up to 4K, nothing fits from 8K" in reading


def test_reading_names_the_crossovers():
    def cell(L, g, fam, speedup, feasible=True):
        return {"model": "m", "hardware": "h", "seq_len": L, "context": f"{L // 1024}K", "gpus": g,
                "feasible": feasible, "family": fam if feasible else None,
                "family_label": (fam.upper() if feasible else None), "bp_speedup": speedup,
                "best_bp_plan": "bp-plan", "best_bp_tokens_per_s": 1.0 if feasible else None,
                "best_no_bp_tokens_per_s": 1.0 if feasible else None,
                "reason": None if feasible else "memory (12)"}
    df = pd.DataFrame([cell(65536, 8, "dp", 0.9), cell(131072, 8, "csbp", 1.2), cell(262144, 8, "csbp", 1.3),
                       cell(65536, 16, "dp", 0.95), cell(131072, 16, "dp", 1.001),
                       cell(262144, 16, "csbp", 1.002, ), cell(524288, 8, None, None, False),
                       cell(524288, 16, "csbp", 1.4)])
    text = read_map(df)
    assert "at 8 GPUs DP gives way to CSBP between 64K and 128K, then CSBP wins up to 256K, nothing fits from 512K" in text
    assert "at 16 GPUs DP gives way to CSBP between 128K and 256K" in text
    assert "most at 512K on 16 GPUs (1.40x, bp-plan)" in text
    assert "ties the best no-BP plan within 0.5 % at 128K-256K on 16 GPUs (the planner still recommends BP in 1 of them" in text
    assert "it loses at 64K on 8-16 GPUs" in text
    assert "Nothing fits at 512K on 8 GPUs (memory)" in text


def test_reading_finds_a_border_in_context_per_gpu():
    rows = [{"model": "m", "hardware": "h", "seq_len": L * 1024, "context": f"{L}K", "gpus": g,
             "feasible": True, "family": "csbp", "family_label": "CSBP", "best_bp_plan": "p",
             "best_bp_tokens_per_s": 1.0, "best_no_bp_tokens_per_s": 1.0, "reason": None,
             "bp_speedup": 1.03 if L // g <= 8 else 1.0}
            for L in (64, 128, 256) for g in (8, 16, 32)]
    assert ("BP gains where a GPU holds at most 8K tokens of context and not from 16K on"
            in read_map(pd.DataFrame(rows)))


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope"], "unknown model"),
    (["--gpus", "12"], "impossible cluster"),
    (["--seq-lens", "1000"], "not a multiple of block-size"),
    (["--seq-lens", "lots"], "not a token count"),
    (["--seq-lens", ","], "comma-separated list"),
    (["--hardware", "tpu"], "unknown hardware profile"),
    (["--axes", "dp,pp"], "--axes"),
    (["--jobs", "0"], "--jobs 0"),
    (["--what-if", "nvlink=2"], "scale them with a factor"),
    (["--engine", "fast"], "invalid choice"),
])
def test_map_bad_input(capsys, tmp_path, argv, message):
    assert main(["map", "--out-dir", str(tmp_path / "m"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "m").exists()  # refused before any work or file
