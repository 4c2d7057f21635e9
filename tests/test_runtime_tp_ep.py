"""Tensor and expert parallelism reproduce the single-process loss and gradients, and move the
step graph's bytes.

All cases of one world size run in one spawned gloo group (CPU, fp32), joined with a timeout; the
reference runs in this process. A TP rank's gradients are slices of the whole weights (checked
against the reference's slice); an EP rank holds only its experts. EP bytes follow the routing,
and the graph predicts them for balanced routing: the `balanced` cases route every token to
every expert (top_k = n_experts), so each rank sends each peer exactly its share and the
prediction must hold to the byte; otherwise only the TP, K/V, gradient and loss bytes must.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest

from csbp.runtime.distributed.comm import CATEGORIES
from csbp.runtime.training.launch import spawn
from csbp.runtime.training.train import Job
from csbp.simulator.cost.graph import StepGraph
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec, MoESpec
from test_runtime_plans import (NO_RECOMPUTE, SEVEN_BLOCKS, TOLERANCE, gradient_floor, reference,
                                relative_error)

SPAWN_TIMEOUT_S = 100

TINY_MOE = load_model("tiny-moe")
# gated queries, Q/K/V biases, tied embeddings, a sliding-window layer (all-to-all K/V in CSBP)
DENSE = ModelSpec(name="tp-dense", hidden=64, ffn=128, vocab=256, qkv_bias=True,
                  tie_embeddings=True, layers=(
                      AttentionSpec(kind="sliding", n_heads=4, n_kv_heads=2, head_dim=16, window=12,
                                    gated_q=True),
                      AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=16)))
NO_DENSE_BRANCH = TINY_MOE.model_copy(update={"name": "moe-no-dense", "moe": MoESpec(
    n_experts=4, top_k=2, expert_ffn=32, dense_ffn=0)})
BALANCED = TINY_MOE.model_copy(update={"name": "moe-balanced", "moe": MoESpec(
    n_experts=4, top_k=4, expert_ffn=16, dense_ffn=32)})


@dataclass(frozen=True)
class Case:
    name: str
    model: ModelSpec
    plan: str
    transport: str = "collective"
    workload: object = SEVEN_BLOCKS

    def job(self) -> Job:
        return Job(self.model, self.workload, parse_plan(self.plan, transport=self.transport),
                   capture_gradients=True)

    @property
    def balanced(self) -> bool:
        moe = self.model.moe
        return moe is None or moe.top_k == moe.n_experts


CASES = {
    2: [Case("tp2", DENSE, "tp=2"),
        Case("tp2-moe-no-dense-branch", NO_DENSE_BRANCH, "tp=2", workload=NO_RECOMPUTE),
        Case("ep2", TINY_MOE, "ep=2"),
        Case("ep2-balanced", BALANCED, "ep=2")],
    4: [Case("tp2-cp2-bp2", DENSE, "tp=2,cp=2,bp=2"),
        Case("tp2-cp2-ring", TINY_MOE, "tp=2,cp=2", "ring", NO_RECOMPUTE),
        Case("ep2-cp2-bp2", TINY_MOE, "ep=2,cp=2,bp=2"),
        Case("ep2-cp2-bp2-balanced", BALANCED, "ep=2,cp=2,bp=2")],
    8: [Case("tp2-ep2-cp2-bp2-balanced", BALANCED, "tp=2,ep=2,cp=2,bp=2")],
}
ALL = [(world, case) for world, cases in CASES.items() for case in cases]


@cache
def run_world(world: int) -> dict[str, list]:
    cases = CASES[world]
    reports = spawn([c.job() for c in cases], world, "cpu", SPAWN_TIMEOUT_S)
    return {c.name: r for c, r in zip(cases, reports)}


def ids(item):
    return f"world{item[0]}-{item[1].name}"


@pytest.mark.floats
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, case", ALL, ids=[ids(a) for a in ALL])
def test_loss_and_every_gradient_slice_match_the_reference(world, case):
    plan = case.job().plan
    ref_loss, ref_grads = reference(case.model, case.workload,
                                    plan.sequences * case.workload.micro_batch)
    held = {}
    floor = gradient_floor(ref_grads)  # the whole weights' largest gradient sets the rounding
    for r in run_world(world)[case.name]:
        assert abs(r.losses[0] - ref_loss) <= TOLERANCE * abs(ref_loss)
        for name, grad in r.gradients.items():
            want = ref_grads[name]
            if name in r.gradient_slices:
                dim, start, stop = r.gradient_slices[name]
                want = np.take(want, range(start, stop), axis=dim)
                held.setdefault(name, set()).add((start, stop))
            else:
                held.setdefault(name, set())
            error = relative_error(grad, want, floor)
            assert error <= TOLERANCE, f"rank {r.rank}: {name} off by {error:.2e}"
    assert held.keys() == ref_grads.keys()  # every weight lives on some rank
    for name, slices in held.items():  # and its slices cover it
        if slices:
            dim = r.gradient_slices[name][0]
            assert sorted(slices)[0][0] == 0 and sorted(slices)[-1][1] == ref_grads[name].shape[dim]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, case", ALL, ids=[ids(a) for a in ALL])
def test_counted_bytes_equal_the_step_graph_per_category(world, case):
    job = case.job()
    w = job.workload.model_copy(update={"zero_stage": 0})  # the runtime's replicated AdamW
    graph = StepGraph.build(case.model, w, job.plan, Layout.build(w, job.plan), job.plan.world,
                            implementation="csbp-runtime")  # what the runtime executes
    received = graph.received_bytes()
    exact = [c for c in CATEGORIES if c != "ep" or case.balanced]
    reports = run_world(world)[case.name]
    for r in reports:
        for c in exact:
            want = round(float(received[c][r.ctx_rank])) if c in received else 0
            assert r.bytes_received[c] == r.bytes_predicted[c] == want, (r.rank, c)
    if job.plan.tp > 1:
        assert all(r.bytes_received["tp"] > 0 for r in reports)
    if job.plan.ep > 1:  # whatever the routing: every row sent is received, and some travel
        sent, received = (sum(r.bytes_sent["ep"] for r in reports),
                          sum(r.bytes_received["ep"] for r in reports))
        assert sent == received > 0
