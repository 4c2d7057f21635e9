"""Every plan reproduces the single-process loss and gradients, and moves the predicted bytes.

All cases of one world size run in one spawned process group (gloo, CPU, fp32), joined with a
timeout; the reference runs in this process. Odd block counts (L=56, b=8: 7 blocks) make the
dual-end schedule deal an unpaired middle block.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest
import torch

from csbp.runtime.training.launch import spawn
from csbp.runtime.models.model import BlockDiffusionLM
from csbp.runtime.distributed.plans.reference import reference_work
from csbp.runtime.training.train import Job
from csbp.simulator.layout.layout import Layout, attention_bytes_received
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec, MoESpec
from csbp.simulator.workload.workload import Workload

# Relative, on the loss and on each weight's gradient (as a whole: norm of the difference over the
# norm). Basis: both sides compute in fp32 (unit roundoff 6e-8) but reduce in different orders
# (sharded matmuls, LSE merges of partial attention, gradients summed over ranks); errors of
# reductions over the tiny models' few hundred terms grow like sqrt(n) x 6e-8 ~ 1e-6, so 1e-5
# leaves a tenfold margin while a wrong mask, block or shard moves gradients by percents.
TOLERANCE = 1e-5
# A gradient that is zero in exact arithmetic (an expert no token chose is exactly zero; top-1
# routing leaves the router a gradient of cancelling terms) comes out as the rounding of the terms
# that cancel, whose size is set by the model's largest gradients, not by its own norm: gradients
# below this share of the largest one are judged against that floor (absolute terms).
ROUNDING_FLOOR = 1e-4
SPAWN_TIMEOUT_S = 150

TINY = load_model("tiny")
SLIDING = ModelSpec(name="tiny-sliding", hidden=64, ffn=128, vocab=256, layers=(
    AttentionSpec(kind="sliding", n_heads=4, n_kv_heads=2, head_dim=16, window=12),
    AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=16)))
MOE = ModelSpec(name="tiny-moe", hidden=64, ffn=0, vocab=256, qkv_bias=True,
                layers=(AttentionSpec(n_heads=4, n_kv_heads=1, head_dim=16, gated_q=True),) * 2,
                moe=MoESpec(n_experts=4, top_k=2, expert_ffn=32, dense_ffn=32))
SEVEN_BLOCKS = Workload(seq_len=56, block_size=8, dtype="fp32")
NO_RECOMPUTE = SEVEN_BLOCKS.model_copy(update={"checkpointing": "none"})
TWO_PER_REPLICA = SEVEN_BLOCKS.model_copy(update={"micro_batch": 2})


@dataclass(frozen=True)
class Case:
    name: str
    model: ModelSpec
    workload: Workload
    plan: str
    transport: str = "collective"
    schedule: str = "dual-end"

    def job(self) -> Job:
        plan = parse_plan(self.plan, transport=self.transport, schedule=self.schedule)
        return Job(self.model, self.workload, plan, capture_gradients=True)


CASES = {
    1: [Case("single", TINY, SEVEN_BLOCKS, "dp=1")],
    2: [Case("dp2-microbatch2", TINY, TWO_PER_REPLICA, "dp=2"),
        Case("cp2", TINY, SEVEN_BLOCKS, "cp=2"),
        Case("cp2-no-recompute", TINY, NO_RECOMPUTE, "cp=2"),
        Case("cp2-ring", TINY, SEVEN_BLOCKS, "cp=2", "ring"),
        Case("bp2", TINY, SEVEN_BLOCKS, "bp=2"),
        Case("csbp-cp2-bp2", TINY, SEVEN_BLOCKS, "cp=2,bp=2"),
        Case("csbp-cp2-bp2-ring", TINY, NO_RECOMPUTE, "cp=2,bp=2", "ring"),
        Case("csbp-cp2-bp2-sliding", SLIDING, SEVEN_BLOCKS, "cp=2,bp=2"),
        Case("cp2-sliding-ring", SLIDING, SEVEN_BLOCKS, "cp=2", "ring"),
        Case("csbp-cp2-bp2-moe", MOE, SEVEN_BLOCKS, "cp=2,bp=2")],
    4: [Case("cp4", TINY, SEVEN_BLOCKS, "cp=4"),
        Case("cp4-ring", TINY, SEVEN_BLOCKS, "cp=4", "ring"),
        Case("bp4-contiguous", TINY, SEVEN_BLOCKS, "bp=4", schedule="contiguous"),
        Case("csbp-cp2-bp4", TINY, SEVEN_BLOCKS, "cp=2,bp=4"),
        Case("csbp-cp2-bp4-ring", TINY, SEVEN_BLOCKS, "cp=2,bp=4", "ring"),
        Case("csbp-cp4-bp4-sliding", SLIDING, SEVEN_BLOCKS, "cp=4,bp=4"),
        Case("csbp-cp2-bp4-sliding", SLIDING, NO_RECOMPUTE, "cp=2,bp=4"),
        Case("dp2-cp2", TINY, SEVEN_BLOCKS, "dp=2,cp=2"),
        Case("dp2-csbp-cp2-bp2", TINY, TWO_PER_REPLICA, "dp=2,cp=2,bp=2")],
}
ALL = [(world, case) for world, cases in CASES.items() for case in cases]


@cache
def run_world(world: int) -> dict[str, list]:
    """Reports of every case of one world size, by case name (one process group for all)."""
    cases = CASES[world]
    reports = spawn([c.job() for c in cases], world, "cpu", SPAWN_TIMEOUT_S)
    return {c.name: r for c, r in zip(cases, reports)}


@cache
def reference(model: ModelSpec, workload: Workload, n_sequences: int):
    m = BlockDiffusionLM(model, seed=0, checkpointing=workload.checkpointing == "full")
    loss = reference_work(model, workload, n_sequences).loss(m, step=0, seed=0)
    loss.backward()
    return loss.item(), {n: (p.grad if p.grad is not None else torch.zeros_like(p)).double().numpy()
                         for n, p in m.named_parameters()}  # an expert no token chose: zero


def relative_error(got: np.ndarray, want: np.ndarray, floor: float = 0.0) -> float:
    """|got - want| / |want|; gradients smaller than `floor` (zero up to rounding, like the
    router's under top-1 routing) are judged against `floor` instead."""
    scale = max(float(np.linalg.norm(want)), floor)
    return float(np.linalg.norm(got - want) / (scale if scale > 0 else 1.0))


def gradient_floor(grads: dict[str, np.ndarray]) -> float:
    """The norm below which a weight's gradient is zero up to rounding (ROUNDING_FLOOR)."""
    return ROUNDING_FLOOR * max(float(np.linalg.norm(g)) for g in grads.values())


def ids(item):
    return f"world{item[0]}-{item[1].name}"


@pytest.mark.floats
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, case", ALL, ids=[ids(a) for a in ALL])
def test_loss_and_every_gradient_match_the_single_process_reference(world, case):
    reports = run_world(world)[case.name]
    plan = case.job().plan
    ref_loss, ref_grads = reference(case.model, case.workload, plan.dp * case.workload.micro_batch)
    for r in reports:
        assert abs(r.losses[0] - ref_loss) <= TOLERANCE * abs(ref_loss)
        assert r.gradients.keys() == ref_grads.keys()
        floor = gradient_floor(ref_grads)
        errors = {n: relative_error(r.gradients[n], ref_grads[n], floor) for n in ref_grads}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"rank {r.rank}: {worst} off by {errors[worst]:.2e}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, case", ALL, ids=[ids(a) for a in ALL])
def test_counted_attention_bytes_equal_the_layout_prediction(world, case):
    reports = run_world(world)[case.name]
    plan = case.job().plan
    layout = Layout.build(case.workload, plan)
    predicted = attention_bytes_received(layout, case.model.layers, case.workload.dtype_bytes)
    for r in reports:
        assert r.bytes_received["attention-kv"] == predicted[r.ctx_rank] * case.workload.micro_batch
        assert r.attention_received_by_phase == r.attention_predicted_by_phase
    if plan.kind in ("cp", "csbp"):
        assert all(r.bytes_received["attention-kv"] > 0 for r in reports)
    if case.workload.checkpointing == "none":
        assert all(r.attention_received_by_phase["recompute"] == 0 for r in reports)
