"""A failing rank ends the run everywhere, soon, with one line naming the rank and the step.

Faults are injected with CSBP_FAULT (runtime/training/faults.py) into world-2 gloo runs on CPU: a rank
that raises, is killed, produces a NaN loss, or hangs (its peer's collective times out).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from csbp.runtime.training import faults
from csbp.runtime.training.launch import RunFailed, spawn
from csbp.runtime.training.train import Job
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

ENDS_WITHIN_S = 60
JOB = Job(load_model("tiny"), Workload(seq_len=64, block_size=8, dtype="fp32"), parse_plan("cp=2"),
          steps=3, warmup=0)
SMALL = ["--seq-len", "64", "--block-size", "8", "--steps", "3", "--warmup", "0", "--plan", "cp=2"]


def failed_run(monkeypatch, fault: str, timeout_s: float = ENDS_WITHIN_S) -> str:
    """The one-line message of a run with `fault`; checks it ended in time."""
    monkeypatch.setenv(faults.ENV, fault)
    start = time.monotonic()
    with pytest.raises(RunFailed) as failed:
        spawn([JOB], 2, "cpu", timeout_s)
    assert time.monotonic() - start < ENDS_WITHIN_S
    message = str(failed.value)
    assert "\n" not in message
    return message


@pytest.mark.timeout(90)
def test_a_rank_that_raises_is_named_with_its_step(monkeypatch):
    assert failed_run(monkeypatch, "rank=1,step=1,kind=raise") == \
        "rank 1 failed at step 1: RuntimeError: injected fault (CSBP_FAULT)"


@pytest.mark.timeout(90)
def test_a_killed_rank_is_named_with_its_step(monkeypatch):
    message = failed_run(monkeypatch, "rank=1,step=2,kind=kill")
    assert message.startswith("rank 1 was killed by signal 9") and message.endswith("at step 2")


@pytest.mark.timeout(90)
def test_a_nan_loss_stops_the_run_naming_the_rank_it_came_from(monkeypatch):
    assert failed_run(monkeypatch, "rank=0,step=1,kind=nan").startswith(
        "rank 0 failed at step 1: LossNotFinite: this rank's part of the loss is nan")


@pytest.mark.timeout(90)
def test_a_hung_rank_fails_its_peers_collective_at_the_timeout(monkeypatch):
    message = failed_run(monkeypatch, "rank=1,step=1,kind=hang", timeout_s=10)
    assert message.startswith("rank 0 failed at step 1: CollectiveError:")
    assert "Timed out" in message and message.endswith("(still running: rank 1)")


def run_cli(module: list[str], fault: str) -> subprocess.CompletedProcess:
    env = os.environ | {faults.ENV: fault}
    return subprocess.run([sys.executable, *module, *SMALL], capture_output=True, text=True,
                          env=env, timeout=ENDS_WITHIN_S)


@pytest.mark.timeout(90)
def test_csbp_run_prints_one_line_and_exits_1():
    done = run_cli(["-m", "csbp.simulator.commands.cli", "run"], "rank=0,step=2,kind=raise")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == "csbp: error: rank 0 failed at step 2: RuntimeError: injected fault (CSBP_FAULT)\n"


@pytest.mark.timeout(90)
def test_torchrun_entry_names_the_failing_rank():
    done = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "csbp.runtime.training.torchrun"], "rank=1,step=1,kind=raise")
    assert done.returncode != 0
    assert "runtime.torchrun: error: rank 1 failed at step 1: RuntimeError: injected fault" in done.stderr


@pytest.mark.parametrize("text", ["rank=1", "rank=x,step=1,kind=raise", "rank=1,step=1,kind=explode"])
def test_a_malformed_fault_is_refused(monkeypatch, text):
    monkeypatch.setenv(faults.ENV, text)
    with pytest.raises(ValueError, match="use rank=R,step=S,kind=raise"):
        faults.from_env()
