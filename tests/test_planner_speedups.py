"""Issue 25's structural speedups give the answers the plain computation gives.

- `csbp plan` searches the other implementation's baseline in a forked process beside its main
  search (`method_vs_implementation.baselines_ahead`): the same `search` call on the same
  inputs, so its answer equals the inline one exactly (one function, one input, the same CPU;
  the workers' results are held to the same standard in test_bounds).
- That child first simulates, under its implementation, the best candidate the main screen
  has scored so far (`shared_checks.SharedChecks.lead`); where it is the recommendation, the
  answer takes it instead of simulating it again: the same call on the same inputs.
- A batch of event-engine re-scorings runs half in a process forked for it when a core is idle
  (`workers.halves`): every item's result, in order, the same call in either process.
- The compute floor takes a drafter's offline-feature reader streams (`floor.reader_floor`):
  the same ops (the builder's `feature_io`) priced by the same function (`cost.seconds`) as the
  step graph's, so the reader sum equals the graph's exactly, and it does not depend on the K/V
  transport or checkpointing (the planner computes one floor per such pair of twins).
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from csbp.simulator.commands.cli import build_parser
from csbp.simulator.commands.plan import answer
from csbp.simulator.cost.graph import StepGraph
from csbp.simulator.engine import durations
from csbp.simulator.engine.program import IO_STREAMS
from csbp.simulator.errors import InputError
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.planner import method_vs_implementation as mvi
from csbp.simulator.planner.floor import compute_floor, floor_bounds, reader_floor
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.workload.objectives import as_executed, default_objective
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

K = 1024
FORK = "fork" in mp.get_all_start_methods()


def _planned(jobs: int):
    argv = ["plan", "--model", "nemotron-diffusion-3b", "--seq-len", "32k", "--nodes", "1", "--axes",
            "dp,cp,bp", "--json", "--jobs", str(jobs)]
    return answer(build_parser(argv).parse_args(argv))


@pytest.mark.floats
@pytest.mark.timeout(300)
@pytest.mark.skipif(not FORK, reason="the baseline search runs ahead only where the OS can fork")
def test_baseline_searched_ahead_equals_the_inline_search(monkeypatch):
    """Exact: the forked child runs the same `search` on the same inputs as the inline path."""
    monkeypatch.setattr(mvi, "core_free", lambda: True)  # whatever the host's load
    inline, ahead = _planned(1), _planned(2)
    assert ahead.by_implementation == inline.by_implementation
    assert ahead.to_json() == inline.to_json()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not FORK, reason="the baseline search runs ahead only where the OS can fork")
def test_baseline_ahead_raises_the_childs_error_and_ends_what_it_started(monkeypatch):
    model, profile = load_model("nemotron-diffusion-3b"), load_profile("h200")
    workload = Workload(seq_len=32 * K)

    def fails(*args, **kwargs):
        raise InputError("nothing feasible: test")

    monkeypatch.setattr(mvi, "search", fails)  # the fork copies the patched module
    monkeypatch.setattr(mvi, "core_free", lambda: True)
    with mvi.baselines_ahead(model, workload, profile, 1, "des", workers=2) as ahead:
        assert set(ahead.running) == {"ideal"}
        with pytest.raises(InputError, match="nothing feasible: test"):
            ahead.baseline("ideal", model, workload, profile, 1, "des")
    # not collected: ended on leaving the block
    with mvi.baselines_ahead(model, workload, profile, 1, "des", workers=2) as ahead:
        child = ahead.running["ideal"][0]
    assert not child.is_alive() and not ahead.running
    # other inputs than it was started for: not taken from the child
    with mvi.baselines_ahead(model, workload, profile, 1, "des", workers=2) as ahead:
        assert ahead.baseline("ideal", model, workload.model_copy(), profile, 1, "des") == (False, None)
    # one worker, or no idle core: nothing runs ahead, the search stays inline
    assert not mvi.baselines_ahead(model, workload, profile, 1, "des", workers=1).running
    monkeypatch.setattr(mvi, "core_free", lambda: False)
    assert not mvi.baselines_ahead(model, workload, profile, 1, "des", workers=2).running


@pytest.mark.floats
@pytest.mark.timeout(300)
@pytest.mark.skipif(not FORK, reason="the baseline search runs ahead only where the OS can fork")
def test_recommendation_presimulated_by_the_child_equals_the_parents(monkeypatch):
    """Exact: the child's simulation of the main screen's best candidate under `ideal` is the one
    `speedup_by_implementation` would make for the recommendation (here the same plan)."""
    import time

    from csbp.simulator.engine.simulate import simulate
    from csbp.simulator.planner.planner import plan_of, search

    monkeypatch.setattr(mvi, "core_free", lambda: True)
    model, profile = load_model("nemotron-diffusion-3b"), load_profile("h200")
    workload = Workload(seq_len=32 * K)
    with mvi.baselines_ahead(model, workload, profile, 1, "des", workers=2) as ahead:
        found = search(model, workload, profile, 1, keep=10, checks=ahead.checks, workers=2)
        lead = ahead.checks.space.candidates[ahead.checks.leader]
        # this job's screen leader is its recommendation (else choose a job where it is)
        assert lead.plan == plan_of(found.recommended)
        got = None
        for _ in range(1200):  # it never waits for the child: ask until its messages are in
            got = ahead.presimulated("ideal", found)
            if got is not None:
                break
            time.sleep(0.05)
        assert got is not None, "the child did not presimulate the recommendation"
        rec = found.recommended
        ideal = profile.model_copy(update={"implementation": "ideal"})
        mine = simulate(model, Workload(**rec.workload), plan_of(rec), ideal, 1, engine="des", with_trace=False)
        assert got.to_json() == mine.to_json()
        assert ahead.baseline("ideal", model, workload, profile, 1, "des")[0]  # still collected


def _square(x: int) -> int:
    return x * x


def _square_not_in(pid: int, x: int) -> int:
    """`_square`, failing in any process but `pid`."""
    import os

    if os.getpid() != pid:
        raise RuntimeError("not here")
    return x * x


def _square_but_in(pid: int, x: int) -> int:
    """`_square`, failing in process `pid`."""
    import os

    if os.getpid() == pid:
        raise ValueError("here")
    return x * x


@pytest.mark.timeout(60)
@pytest.mark.skipif(not FORK, reason="halves forks")
def test_halves_gives_every_result_in_order_and_runs_a_failed_half_here():
    import os
    from functools import partial

    from csbp.simulator.planner.workers import halves

    items = list(range(11))
    assert halves(_square, items) == [x * x for x in items]
    # the forked half fails: its items run in this process, the results are the same
    assert halves(partial(_square_not_in, os.getpid()), items) == [x * x for x in items]
    # this process's half fails: the error is raised here and the helper ended
    with pytest.raises(ValueError, match="here"):
        halves(partial(_square_but_in, os.getpid()), items)


def _graph_readers(model, workload, plan, profile) -> np.ndarray | None:
    """Per rank, the longest reader stream of the plan's own step graph (bounds reason 6)."""
    graph = StepGraph.build(model, workload, plan, Layout.build(as_executed(workload, model), plan),
                            profile.node.gpus_per_node, implementation=profile.implementation)
    d = durations(graph, profile)
    streams: dict[str, np.ndarray] = {}
    for op, took in zip(graph.ops, d):
        if op.stream in IO_STREAMS:
            streams[op.stream] = streams.get(op.stream, np.zeros(graph.ranks)) + took
    return np.max(list(streams.values()), axis=0) if streams else None


@pytest.mark.floats
@pytest.mark.parametrize("plan", [Plan(dp=8), Plan(dp=2, cp=4), Plan(cp=2, bp=4), Plan(dp=2, cp=2, bp=2, transport="ring")],
                         ids=lambda p: p.label())
def test_reader_floor_is_the_graphs_reader_stream(plan):
    """Exact: the same reader ops priced by the same function, summed from zero in program order."""
    model, profile = load_model("dflash2-qwen3.8-27b"), load_profile("h200")
    workload = Workload(seq_len=64 * K, objective=default_objective(model), checkpointing="none")
    layout = Layout.build(as_executed(workload, model), plan)
    mine = reader_floor(model, workload, plan, profile, layout)
    assert mine is not None and mine.tolist() == _graph_readers(model, workload, plan, profile).tolist()
    # the planner's floor key drops transport and checkpointing: the readers do not change with them
    for twin in ({"checkpointing": "full"},):
        other = workload.model_copy(update=twin)
        assert reader_floor(model, other, plan, profile, Layout.build(as_executed(other, model), plan)).tolist() == mine.tolist()
    if plan.cp > 1:
        ring = plan.model_copy(update={"transport": "collective" if plan.transport == "ring" else "ring"})
        assert reader_floor(model, workload, ring, profile, Layout.build(as_executed(workload, model), ring)).tolist() == mine.tolist()
    # offline features on this job are read slower than the step computes: the floor is the read
    compute = compute_floor(model, workload, plan, profile, layout)["none"].max()
    assert floor_bounds(model, workload, plan, profile, layout)["none"] >= min(compute, mine.max()) * (1 - 1e-12)


def test_no_reader_floor_without_offline_features():
    model, profile = load_model("dflash2-qwen3.8-27b"), load_profile("h200")
    workload = Workload(seq_len=64 * K, objective=default_objective(model), features="synthetic")
    plan = Plan(dp=8)
    assert reader_floor(model, workload, plan, profile, Layout.build(as_executed(workload, model), plan)) is None
    dense = load_model("nemotron-diffusion-8b")
    w = Workload(seq_len=64 * K)
    assert reader_floor(dense, w, plan, profile, Layout.build(w, plan)) is None
