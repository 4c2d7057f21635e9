"""Same inputs, same output: simulator JSON byte for byte across processes (different hash
seeds, so no set or dict order leaks into it), and runtime losses for the same seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from csbp.runtime.training.launch import spawn
from csbp.runtime.training.train import Job
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

# the same computation twice must print the same floats: one code path, exact
pytestmark = pytest.mark.floats
SIMULATE = ["simulate", "--model", "tiny", "--seq-len", "4096", "--block-size", "64", "--nodes", "1",
            "--plan", "dp=2,cp=2,bp=4", "--transport", "ring", "--json"]
PLAN = ["plan", "--model", "tiny", "--seq-len", "4096", "--nodes", "1", "--jobs", "2", "--json"]


def stdout_under_hash_seeds(argv: list[str]) -> list[str]:
    outs = []
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-m", "csbp.simulator.commands.cli", *argv], capture_output=True,
                              text=True, timeout=120, env=os.environ | {"PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr
        outs.append(done.stdout)
    return outs


@pytest.mark.timeout(150)
def test_simulate_json_is_byte_identical():
    first, second = stdout_under_hash_seeds(SIMULATE)
    assert first == second and json.loads(first)["feasible"]


@pytest.mark.timeout(150)
def test_plan_json_is_byte_identical():
    first, second = stdout_under_hash_seeds(PLAN)
    assert first == second and json.loads(first)["recommended"]["feasible"]


@pytest.mark.timeout(150)
def test_runtime_losses_depend_on_the_seed_alone():
    job = Job(load_model("tiny"), Workload(seq_len=64, block_size=8, dtype="fp32"),
              parse_plan("cp=2,bp=2"), steps=3, warmup=0)
    reports = spawn([job, job, replace(job, seed=1)], 2, "cpu", 120)
    first, again, other = ([r.losses for r in job_reports] for job_reports in reports)
    assert first == again and first[0] == first[1]  # run to run, and rank to rank
    assert other[0] != first[0]
