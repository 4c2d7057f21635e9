"""ZeRO-1/2 AdamW gives the replicated optimizer's weights, and moves the step graph's bytes.

Every case trains two steps (gloo, CPU) and returns its weights; they must equal the
single-process reference trained with torch's AdamW (fp32: to rounding), and the replicated run's.
Counted bytes per category equal the step graph's at the same ZeRO stage: reduce-scattered
gradients and all-gathered updated weights ("params"), padding of the flat buffers excluded
(dp=3: the tiny model's weights do not split in three). A bf16 run keeps bf16 weights, fp32
master weights and moments, and stays near the fp32 run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest
import torch

from csbp.runtime.distributed.comm import CATEGORIES, Comm
from csbp.runtime.training.launch import spawn
from csbp.runtime.distributed.mesh import Mesh
from csbp.runtime.models.model import BlockDiffusionLM
from csbp.runtime.distributed.plans import check_supported
from csbp.runtime.distributed.plans.reference import reference_work
from csbp.runtime.distributed.sharded_optimizer import ShardedAdamW
from csbp.runtime.training.train import LEARNING_RATE, Job
from csbp.simulator.errors import InputError
from csbp.simulator.cost.graph import StepGraph
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import parse_plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload
from test_gradient_property import adam_clear, stored_rounding
from test_runtime_plans import SEVEN_BLOCKS, relative_error
from test_runtime_tp_ep import BALANCED, DENSE

pytestmark = pytest.mark.floats  # float results of numeric kernels: re-run under baseline kernels in CI
SPAWN_TIMEOUT_S = 120
STEPS = 2
# Relative, on what the steps changed. Basis: the sharded and the reference runs reduce the same
# fp32 gradients in a different order (a few ulps, ~1e-7 relative); AdamW's first steps move each
# weight by about lr * g / |g|, so a gradient's error passes to the update scaled by how close its
# elements are to zero. Elements near zero (test_gradient_property.adam_clear: an element whose
# exact gradient is zero, a key bias, gets lr * noise / (|noise| + eps), a full-size update of
# arbitrary sign, different on every CPU) are not compared through Adam's update: their gradients
# are compared directly in test_runtime_plans / test_runtime_tp_ep, and here they are checked to
# move no more than AdamW can.
TOLERANCE = 1e-4
TINY = load_model("tiny")
ZERO2 = SEVEN_BLOCKS.model_copy(update={"zero_stage": 2})


@dataclass(frozen=True)
class Case:
    name: str
    model: ModelSpec
    plan: str
    workload: Workload = ZERO2
    balanced: bool = True  # EP bytes exact only under balanced routing

    def job(self) -> Job:
        return Job(self.model, self.workload, parse_plan(self.plan), steps=STEPS, warmup=0,
                   capture_parameters=True)


def _stage(z: int) -> Workload:
    return ZERO2.model_copy(update={"zero_stage": z})


CASES = {
    2: [Case("dp2-zero2", TINY, "dp=2"),
        Case("dp2-replicated", TINY, "dp=2", _stage(0)),
        Case("csbp-cp2-bp2-zero1", TINY, "cp=2,bp=2", _stage(1)),
        Case("cp2-ring-zero2", TINY, "cp=2"),
        Case("tp2-zero2", DENSE, "tp=2"),
        Case("ep2-zero2", BALANCED, "ep=2"),
        Case("dp2-bf16-zero2", TINY, "dp=2", ZERO2.model_copy(update={"dtype": "bf16"}))],
    3: [Case("dp3-zero2-padded", TINY, "dp=3")],
}
ALL = [(world, case) for world, cases in CASES.items() for case in cases]


@cache
def run_world(world: int) -> dict[str, list]:
    cases = CASES[world]
    reports = spawn([c.job() for c in cases], world, "cpu", SPAWN_TIMEOUT_S)
    return {c.name: r for c, r in zip(cases, reports)}


@cache
def reference(model: ModelSpec, workload: Workload, n_sequences: int):
    """Initial and trained weights of one process with torch's AdamW (fp32), and per weight the
    elements whose gradient was clear of zero at every step (where Adam's update is meaningful)."""
    m = BlockDiffusionLM(model, seed=0)
    initial = {n: p.detach().double().numpy().copy() for n, p in m.named_parameters()}
    clear = {n: np.ones(p.shape, bool) for n, p in m.named_parameters()}
    optimizer = torch.optim.AdamW(m.parameters(), lr=LEARNING_RATE)
    work = reference_work(model, workload.model_copy(update={"dtype": "fp32"}), n_sequences)
    for step in range(STEPS):
        work.loss(m, step=step, seed=0).backward()
        for n, p in m.named_parameters():
            g = p.grad.double().numpy() if p.grad is not None else np.zeros(p.shape)
            clear[n] &= adam_clear(g)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return initial, {n: p.detach().double().numpy() for n, p in m.named_parameters()}, clear


def _cut(want: np.ndarray, name: str, report) -> np.ndarray:
    if name in report.gradient_slices:  # a TP rank holds a slice of the whole weight
        dim, start, stop = report.gradient_slices[name]
        return np.take(want, range(start, stop), axis=dim)
    return want


def ids(item):
    return f"world{item[0]}-{item[1].name}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, case", [a for a in ALL if "bf16" not in a[1].name],
                         ids=[ids(a) for a in ALL if "bf16" not in a[1].name])
def test_sharded_steps_give_the_single_process_weights(world, case):
    plan = parse_plan(case.plan)
    initial, trained, clear = reference(case.model, case.workload,
                                        plan.sequences * case.workload.micro_batch)
    for r in run_world(world)[case.name]:
        assert set(r.parameters) <= set(trained)
        for name, got in r.parameters.items():
            start, want = _cut(initial[name], name, r), _cut(trained[name], name, r)
            big = _cut(clear[name], name, r)
            error = relative_error((got - start)[big], (want - start)[big])
            allowed = TOLERANCE + STEPS * stored_rounding(want[big], (want - start)[big])
            assert error <= allowed, f"rank {r.rank}: {name} off by {error:.2e}"
            # the rest: AdamW moves a weight by at most lr per step (|m_hat / sqrt(v_hat)| <= 1
            # up to its betas' bias correction, < 1.01 over two steps) plus the weight decay
            bound = LEARNING_RATE * STEPS * (1.01 + 0.01 * np.abs(start[~big]).max(initial=0.0))
            assert np.abs((got - start)[~big]).max(initial=0.0) <= bound, (r.rank, name)


@pytest.mark.timeout(300)
def test_zero2_equals_the_replicated_optimizer():
    sharded, replicated = run_world(2)["dp2-zero2"], run_world(2)["dp2-replicated"]
    for a, b in zip(sharded, replicated):
        assert a.losses == pytest.approx(b.losses, rel=1e-6)
        for name in b.parameters:
            np.testing.assert_allclose(a.parameters[name], b.parameters[name], rtol=0,
                                       atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, case", ALL, ids=[ids(a) for a in ALL])
def test_counted_bytes_equal_the_step_graph_at_the_zero_stage(world, case):
    job = case.job()
    w = job.workload
    graph = StepGraph.build(case.model, w, job.plan, Layout.build(w, job.plan), job.plan.world,
                            implementation="csbp-runtime")
    received = graph.received_bytes()
    reports = run_world(world)[case.name]
    for r in reports:
        for c in CATEGORIES:
            if c == "ep" and not case.balanced:
                continue
            want = round(float(received[c][r.ctx_rank])) if c in received else 0
            assert r.bytes_received[c] == r.bytes_predicted[c] == want, (r.rank, c)
    sharded = w.zero_stage > 0 and job.plan.world // job.plan.tp > 1
    assert all((r.bytes_received["params"] > 0) == sharded for r in reports)


@pytest.mark.timeout(300)
def test_bf16_weights_stay_near_the_fp32_run():
    bf16, fp32 = run_world(2)["dp2-bf16-zero2"], run_world(2)["dp2-zero2"]
    for a, b in zip(bf16, fp32):
        assert a.losses == pytest.approx(b.losses, rel=2e-2)
        for name in b.parameters:  # bf16 keeps ~3 significant digits of each weight
            assert relative_error(a.parameters[name], b.parameters[name]) <= 1e-2, name


@pytest.mark.timeout(60)
def test_one_process_keeps_bf16_weights_with_fp32_master_and_moments():
    model = BlockDiffusionLM(TINY, seed=0).to(torch.bfloat16)
    opt = ShardedAdamW(model, Mesh({}), Comm(), torch.bfloat16, lr=LEARNING_RATE)
    work = reference_work(TINY, SEVEN_BLOCKS, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = work.loss(model, step=0, seed=0)
    opt.prepare_gradients()
    loss.backward()
    flat = opt.shards[0].flat  # autograd accumulated in place: the gradients are the buffer
    assert all(p.grad.data_ptr() >= flat.data_ptr() for p in model.parameters())
    assert sum(float(p.grad.float().abs().sum()) for p in model.parameters()) == pytest.approx(
        float(flat.float().abs().sum()))
    opt.reduce_gradients()
    assert all(p.grad is None for p in model.parameters())  # the full gradients are freed
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    n = sum(p.numel() for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(s.master.dtype == torch.float32 for s in opt.shards)
    assert opt.state_bytes() == 12 * n  # fp32 master + m + v, one shard holding everything
    assert any(not torch.equal(before[k], p) for k, p in model.named_parameters())


def test_zero3_is_refused_in_one_line():
    w = SEVEN_BLOCKS.model_copy(update={"zero_stage": 3})
    with pytest.raises(InputError) as err:
        check_supported(TINY, w, parse_plan("dp=2"))
    assert "ZeRO-3" in str(err.value) and "\n" not in str(err.value)
