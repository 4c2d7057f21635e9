"""The main search's memory checks shared with the baseline child (`planner.shared_checks`) report
what a search checking every candidate itself reports.

Exact comparisons: both sides run the same `candidate_memory` on the same objects (forked copies),
and the report only reads each candidate's fit and the first misfit's line.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from csbp.simulator.planner import planner
from csbp.simulator.planner.shared_checks import FITS, MISFIT, SharedChecks, for_search, fits_of
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

K = 1024
FORK = "fork" in mp.get_all_start_methods()
needs_fork = pytest.mark.skipif(not FORK, reason="the helper is a forked process")


def _job():
    # 136 candidates on one node, 45 of them too big at 128K: the memory group is reported
    return load_model("nemotron-diffusion-3b"), Workload(seq_len=128 * K), load_profile("h200")


def _report(found: planner.Search) -> dict:
    return {"ranked": [r.to_json() for r in found.ranked[:3]], "baseline": found.baseline.to_json(),
            "feasible": found.feasible, "pruned": found.pruned, "screened": found.screened,
            "infeasible": [g.to_json() for g in found.infeasible]}


def _help_then_exit(checks: SharedChecks, stop_after: int | None) -> None:
    fits = fits_of(checks)
    done = [0]

    def counted(i: int) -> bool:
        if stop_after is not None and done[0] == stop_after:
            os.kill(os.getpid(), signal.SIGKILL)  # dies with a chunk in hand
        done[0] += 1
        return fits(i)
    checks.help(counted)


@needs_fork
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_after", [None, 5], ids=["helper-finishes", "helper-dies-mid-chunk"])
def test_search_with_shared_checks_reports_what_the_plain_search_does(stop_after):
    model, workload, profile = _job()
    plain = planner.search(model, workload, profile, 1, workers=1, keep=3)
    ctx = mp.get_context("fork")
    checks = for_search(ctx, model, workload, profile, 1)
    helper = ctx.Process(target=_help_then_exit, args=(checks, stop_after), daemon=True)
    helper.start()
    checks.helper = helper
    shared = planner.search(model, workload, profile, 1, workers=1, keep=3, checks=checks)
    helper.join(timeout=60)
    assert _report(shared) == _report(plain)
    assert set(checks.state.tolist()) <= {FITS, MISFIT}  # every candidate checked by someone
    memory = [g for g in plain.infeasible if g.reason == "memory"]
    assert memory and int((checks.state == MISFIT).sum()) == len(memory[0].plans)


@pytest.mark.timeout(120)
def test_checks_for_other_inputs_are_left_alone():
    """Made for another job, or given to a search that reads no misfits: not used, and nothing
    is left for a helper to take."""
    model, workload, profile = _job()
    ctx = mp.get_context("fork") if FORK else mp.get_context()
    other = for_search(ctx, model, Workload(seq_len=64 * K), profile, 1)
    found = planner.search(model, workload, profile, 1, workers=1, keep=3, checks=other)
    assert _report(found) == _report(planner.search(model, workload, profile, 1, workers=1, keep=3))
    assert other._take(front=False) is None
    lazy = for_search(ctx, model, workload, profile, 1)
    planner.search(model, workload, profile, 1, workers=1, keep=3, misfits=False, checks=lazy)
    assert lazy._take(front=True) is None and not lazy.state.any()


@pytest.mark.timeout(60)
def test_the_two_sides_take_disjoint_chunks_that_cover_the_list():
    model, workload, profile = _job()
    checks = for_search(mp.get_context(), model, workload, profile, 1)
    n, seen = len(checks.space.candidates), []
    front = True
    while (part := checks._take(front)) is not None:
        seen.extend(part)
        front = not front
    assert sorted(seen) == list(range(n))
