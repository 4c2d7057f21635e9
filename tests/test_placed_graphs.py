"""A step graph placed again (`StepGraph.placed_as`, issue 25's graph reuse) is the graph a build
under the other placement makes: the same ops, waits, layers and notes, each transfer on the
group that build gives it; where a group cannot be told apart it declines (None)."""

from __future__ import annotations

import pytest

from csbp.simulator.cost.graph import StepGraph
from csbp.simulator.engine import simulate_graph
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.workload.objectives import as_executed
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

STRIPED = "tp,ep,dp,ctx"
CASES = [("nemotron-diffusion-8b", Plan(dp=4, cp=8)),
         ("nemotron-diffusion-8b", Plan(dp=2, cp=16, transport="ring")),
         ("nemotron-diffusion-8b", Plan(dp=2, cp=4, bp=16)),
         ("diffusiongemma-26b-a4b", Plan(dp=2, ep=2, cp=8, bp=8)),
         ("diffusiongemma-26b-a4b", Plan(ep=4, cp=8, transport="ring")),
         ("dflash2-qwen3.8-27b", Plan(dp=4, cp=8, bp=8, transport="ring")),
         ("qwen3.5-27b", Plan(dp=2, tp=2, cp=8))]


def _build(model, workload, plan, keys_at_home):
    w = as_executed(workload, model)
    return StepGraph.build(model, workload, plan, Layout.build(w, plan), 8, keys_at_home=keys_at_home,
                           implementation="turbo-dllm")


def _templates(repeats):
    """Repeats with template numbers by first appearance (numbers are unique per process)."""
    ids: dict = {}
    return [(a, b, ids.setdefault(t, len(ids)), inputs) for a, b, t, inputs in repeats]


@pytest.mark.parametrize("name,plan", CASES, ids=[f"{n}-{p.label()}-{p.transport}" for n, p in CASES])
@pytest.mark.parametrize("keys_at_home", [False, True])
def test_placed_again_is_built_again(name, plan, keys_at_home):
    model = load_model(name)
    workload = Workload(seq_len=64 * 1024)
    striped = plan.model_copy(update={"placement": STRIPED})
    graph = _build(model, workload, plan, keys_at_home)
    built = _build(model, workload, striped, keys_at_home)
    placed = graph.placed_as(striped, 8)
    if placed is None:  # only where one group object was made by two recipes
        assert any(len(made) > 1 for _, made in graph.placed)
        return
    assert placed == built  # ranks, ops (names, phases, layers, works, waits), FLOPs, views, notes
    assert _templates(placed.repeats) == _templates(built.repeats)
    assert dict(placed.placed) == dict(built.placed)
    assert any(a.work != b.work for a, b in zip(graph.ops, built.ops)) or graph == built
    back = placed.placed_as(plan, 8)  # and back, unless groups merged there (e.g. TP and EP of 2)
    assert back == graph if back is not None else any(len(made) > 1 for _, made in placed.placed)


def test_placed_again_times_as_built_again():
    """The engines read only the ops: a placed graph (sharing the steps the engines made for the
    first) times every op as the built one, both engines. Exact: one code path on equal inputs
    (equal ops, so equal prices, steps and chains), the same operations in the same order."""
    h200 = load_profile("h200")
    model, plan = load_model("nemotron-diffusion-8b"), Plan(dp=4, cp=4, bp=4, transport="ring")
    workload = Workload(seq_len=64 * 1024)
    striped = plan.model_copy(update={"placement": STRIPED})
    graph = _build(model, workload, plan, False)
    for engine in ("des", "closed-form"):
        simulate_graph(graph, h200, engine)  # the steps the placed graph then shares
    placed, built = graph.placed_as(striped, 8), _build(model, workload, striped, False)
    assert placed is not None
    for engine in ("des", "closed-form"):
        (a, _), (b, _) = simulate_graph(placed, h200, engine), simulate_graph(built, h200, engine)
        assert (a.start == b.start).all() and (a.finish == b.finish).all()
