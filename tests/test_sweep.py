"""`csbp sweep`: the table (one row per point and family), the files, bad input."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from csbp.simulator.commands.cli import main
from test_planner import fake_engine  # noqa: F401  (fixture)


def test_sweep_writes_table_and_plots(fake_engine, tmp_path, capsys):
    argv = ["sweep", "--models", "tiny", "--seq-lens", "2k,4k", "--gpus", "8,16",
            "--engine", "closed-form", "--out-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    names = {p.rsplit("/", 1)[-1] for p in out["files"]}
    assert {"sweep.csv", "tokens_per_s.png", "speedup.png", "peak_memory.png", "crossover.png"} <= names
    df = pd.read_csv(tmp_path / "sweep.csv")
    assert len(df) == 2 * 2 * 4  # points x families
    assert set(df.family) == {"dp", "cp", "bp", "csbp"}
    winners = df[df.winner]
    assert len(winners) == 4 and set(winners.family) == {"csbp"}
    assert (winners.speedup_over_baseline > 1).all()
    assert len(out["rows"]) == len(df)


def test_sweep_table_output(fake_engine, tmp_path, capsys):
    argv = ["sweep", "--models", "tiny", "--seq-lens", "4k", "--gpus", "8", "--engine", "closed-form",
            "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Recommended plan per point" in out and "sweep.csv" in out


@pytest.mark.parametrize("argv, message", [
    (["--models", "tiny,nope"], "unknown model"),
    (["--gpus", "12"], "impossible cluster"),
    (["--seq-lens", "1000"], "not a multiple of block-size"),
    (["--seq-lens", "lots"], "not a token count"),
])
def test_sweep_bad_input(fake_engine, tmp_path, capsys, argv, message):
    assert main(["sweep", "--out-dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
