"""`csbp run` and the torchrun entry end to end, as a user calls them (subprocesses with timeouts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from csbp.simulator.planner import planfile
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.workload import Workload

SMALL = ["--seq-len", "64", "--block-size", "8", "--steps", "1", "--warmup", "0"]
KEYS = {"step_time_s", "loss", "peak_memory_gib", "attention_bytes_counted",
        "attention_bytes_predicted", "bytes_per_rank", "plan"}


def csbp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "csbp.simulator.commands.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(150)
def test_run_with_degrees_prints_one_json_object_with_matching_bytes():
    done = csbp("run", *SMALL, "--plan", "cp=2,bp=2", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert KEYS <= result.keys() and result["world"] == 2 and result["plan"]["kind"] == "csbp"
    assert result["attention_bytes_counted"] == result["attention_bytes_predicted"] > 0
    assert len(result["bytes_per_rank"]) == 2


@pytest.mark.timeout(150)
def test_run_from_a_plan_file_writes_the_result(tmp_path):
    path = tmp_path / "plan.json"
    planfile.dump(planfile.PlanFile(model="tiny", workload=Workload(seq_len=64, block_size=8),
                                    plan=Plan(cp=2, transport="ring")), path)
    done = csbp("run", "--plan", str(path), "--steps", "1", "--warmup", "0",
                "--out", str(tmp_path / "result.json"))
    assert done.returncode == 0, done.stderr
    assert "match" in done.stdout and "MISMATCH" not in done.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["workload"]["dtype"] == "bf16"  # the file's workload wins over run's defaults
    assert result["attention_bytes_counted"] == result["attention_bytes_predicted"] > 0


@pytest.mark.timeout(150)
def test_a_recommended_expert_parallel_plan_runs_from_its_plan_file(tmp_path):
    """The README's flow: plan tiny-moe for this host, then run the file (`--axes ep` keeps the
    recommendation expert-parallel whatever the host profile says)."""
    path = tmp_path / "plan.json"
    done = csbp("plan", "--model", "tiny-moe", "--hardware", "cpu-measured", "--nodes", "1",
                "--seq-len", "256", "--block-size", "16", "--dtype", "fp32", "--axes", "ep",
                "--jobs", "1", "--out", str(path))
    assert done.returncode == 0, done.stderr
    assert planfile.load(path).plan.ep > 1
    done = csbp("run", "--plan", str(path), "--steps", "1", "--warmup", "0", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    pairs, match = result["bytes_by_category"], result["bytes_by_category_match"]
    assert {"tp", "ep", "attention-kv", "gradients"} <= pairs.keys()
    assert all(match[c] for c in ("tp", "attention-kv", "gradients", "other"))
    assert pairs["ep"]["counted"] > 0 and pairs["ep"]["predicted"] > 0  # routing-dependent
    assert len(result["bytes_by_category_per_rank"]) == result["world"]


@pytest.mark.timeout(150)
def test_torchrun_entry_runs_a_plan():
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "csbp.runtime.training.torchrun", *SMALL, "--plan", "bp=2", "--json"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["plan"]["kind"] == "bp" and result["attention_bytes_counted"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, message", [
    (["--model", "qwen3.5-27b", "--plan", "cp=2"], "not supported by the runtime yet"),
    (["--seq-len", "60", "--block-size", "4", "--plan", "cp=8"], "divisible by cp"),
    (["--plan", "tp=4"], "does not divide the 2 K/V heads"),
    (["--plan", "missing-plan.json"], "cannot read plan file"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    done = csbp("run", *args, timeout=50)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
