"""Issue 23, more of what the reference keeps in memory (implementation.md 11, 13): DeepEP's
communication buffers outside PyTorch's caching allocator (in the fit verdict, not in the
allocated peak), MoE routing indices kept with every layer's checkpoint, and Gated-DeltaNet's
all-to-all buffers. Each mechanism is a profile fact, compared with the same profile less it."""

from pathlib import Path

import numpy as np
import pytest

from csbp.simulator.cost.memory import estimate_memory, step_timeline
from csbp.simulator.cost.memory_timeline import linear_a2a_width
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.layout import kv_rows
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.report.result import GIB
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.system.implementation import IMPLEMENTATION_DIR, load_implementation
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

pytestmark = pytest.mark.floats  # byte sums compared with their formulas (tests/README.md)
GEMMA = load_model("diffusiongemma-26b-a4b")
QWEN = load_model("qwen3.5-27b")
TURBO = load_implementation("turbo-dllm")
H200 = load_profile("h200")
GEMMA_W = Workload(seq_len=65536, objective="diffusiongemma")
# exact sums of integers held in floats: 1e-12 relative covers the summation order only
REL = 1e-12


def variant(tmp_path: Path, name: str, old: str, new: str):
    """turbo-dllm with one fact changed, as a profile of its own (a file, so caches keyed by
    the implementation's name never mix the two)."""
    text = (IMPLEMENTATION_DIR / "turbo-dllm.yaml").read_text()
    assert text.count(old) == 1, old
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace(old, new).replace("name: turbo-dllm", f"name: {name}"))
    return H200.model_copy(update={"implementation": str(path)})


def test_deepep_buffers_are_outside_the_allocated_peak_but_inside_the_fit(tmp_path):
    plan = Plan(ep=2, cp=8)
    lay = Layout.build(GEMMA_W, plan)
    est = estimate_memory(GEMMA, GEMMA_W, plan, lay, H200)
    m = TURBO.moe
    # channels x EP peers x tokens per channel x (a bf16 row of 2816 + metadata), from the profile
    want = m.comm_buffer_channels * 2 * m.comm_buffer_tokens * (2816 * 2 + m.comm_buffer_meta_bytes)
    assert want > 0 and est.outside_gib == pytest.approx(want / GIB, rel=REL)
    none = variant(tmp_path, "turbo-no-deepep", "comm_buffer_channels: {value: 10", "comm_buffer_channels: {value: 0")
    base = estimate_memory(GEMMA, GEMMA_W, plan, lay, none)
    assert base.outside_gib == 0.0
    # max_memory_allocated does not see them: the live-tensor peak is the same
    np.testing.assert_allclose(est.allocated, base.allocated, rtol=REL)
    # the need is allocated x (1 + overhead) + reserved + outside
    need = est.allocated * (1 + est.overhead) + est.reserved_gib + est.outside_gib
    np.testing.assert_allclose(est.totals_gib, need, rtol=REL)
    np.testing.assert_allclose(np.array(est.totals_gib) - base.totals_gib, want / GIB, rtol=1e-9)
    assert est.rank(0)["outside"] == pytest.approx(want / GIB, rel=REL)
    # a GPU between the two needs: fits without the buffers, not with them
    mid = (max(est.totals_gib) + max(base.totals_gib)) / 2
    gpu = H200.gpu.model_copy(update={"memory_gib": mid})
    assert estimate_memory(GEMMA, GEMMA_W, plan, lay, none.model_copy(update={"gpu": gpu})).feasible
    tight = estimate_memory(GEMMA, GEMMA_W, plan, lay, H200.model_copy(update={"gpu": gpu}))
    assert not tight.feasible and tight.reason.startswith("infeasible:")


def test_no_outside_buffers_without_ep_or_moe():
    for model, w, plan in ((GEMMA, GEMMA_W, Plan(cp=8)),
                           (load_model("nemotron-diffusion-8b"), Workload(seq_len=65536), Plan(ep=1, cp=8))):
        est = estimate_memory(model, w, plan, Layout.build(w, plan), H200)
        assert est.outside_gib == 0.0 and "outside" not in est.rank(0)


def test_simulate_reports_outside_allocator_apart_from_peak_allocated():
    r = simulate(GEMMA, GEMMA_W, Plan(ep=2, cp=8), H200, nodes=2, with_trace=False)
    js = r.to_json()
    assert js["outside_allocator_gib"] > 0
    # peak_memory_gib holds it, peak_allocated_gib (max_memory_allocated) does not
    assert js["peak_memory_gib"] >= js["peak_allocated_gib"] + js["outside_allocator_gib"]
    # the table shows it under the peak; a plan without such buffers has neither row nor key
    from rich.console import Console
    from csbp.simulator.report.report import result_table

    console = Console(width=120, record=True)
    console.print(result_table(r))
    assert "outside the allocator" in console.export_text()
    dense = simulate(load_model("nemotron-diffusion-8b"), Workload(seq_len=65536), Plan(cp=8), H200, nodes=1,
                     with_trace=False)
    assert "outside_allocator_gib" not in dense.to_json() and dense.outside_allocator_gib is None


def test_routing_indices_kept_from_each_layers_forward_to_its_backward(tmp_path):
    plan = Plan(ep=2, cp=8)
    lay = Layout.build(GEMMA_W, plan)
    tl = step_timeline(GEMMA, GEMMA_W, plan, lay, H200)
    tokens = kv_rows.held(lay, "positions").astype(float)  # both streams' rows (micro-batch 1)
    clean = tokens - kv_rows.held(lay, "noisy")
    per_layer = tokens * 8 * TURBO.moe.saved_route_index_bytes  # top-8 int64 indices, no TP
    n = GEMMA.n_layers
    # the decoder's last layer in backward: every layer's indices (n - 1 below it and its own)
    last = [k for k, m in enumerate(tl.moments) if m.phase == "backward" and m.layer == n - 1
            and not m.op.startswith("encoder.")]
    assert last
    for k in last:
        got = np.array([tl.breakdown(k, r).get("routing", 0.0) for r in range(lay.size)])
        np.testing.assert_allclose(got, n * per_layer, rtol=REL)
    # the encoder's backward starts with every encoder layer's indices of its clean rows
    enc = [k for k, m in enumerate(tl.moments) if m.op.startswith("encoder.")]
    got = np.array([tl.breakdown(enc[0], r).get("routing", 0.0) for r in range(lay.size)])
    np.testing.assert_allclose(got, n * clean * 8 * TURBO.moe.saved_route_index_bytes, rtol=REL)
    # the optimizer comes after every backward: none left
    opt = [k for k, m in enumerate(tl.moments) if m.phase == "optimizer"]
    assert all("routing" not in tl.breakdown(opt[0], r) for r in range(lay.size))
    # a profile that keeps none: the peak is lower by at most what the indices add
    none = variant(tmp_path, "turbo-no-routing", "saved_route_index_bytes: {value: 8",
                   "saved_route_index_bytes: {value: 0")
    a = estimate_memory(GEMMA, GEMMA_W, plan, lay, H200).allocated
    b = estimate_memory(GEMMA, GEMMA_W, plan, lay, none).allocated
    assert np.all(a > b)
    assert np.all(a - b <= (n * per_layer + n * clean * 8 * 8) / GIB * (1 + 1e-9))


def test_dense_models_keep_no_routing_indices():
    w, plan = Workload(seq_len=65536), Plan(cp=8)
    tl = step_timeline(load_model("nemotron-diffusion-8b"), w, plan, Layout.build(w, plan), H200)
    assert all("routing" not in g for groups in tl.groups for g in groups)


@pytest.mark.parametrize("plan", [Plan(cp=8), Plan(cp=8, bp=8)])
def test_gated_deltanet_all_to_all_buffers_at_the_layer(plan, tmp_path):
    w = Workload(seq_len=65536, objective="fast-dllm-v2")
    lay = Layout.build(w, plan)
    gdn = QWEN.layers[0]
    assert gdn.kind == "linear"
    # q, k at 16 key heads, v and z at 48 value heads, beta and a one per value head (section 13)
    assert linear_a2a_width(gdn, TURBO) == 2 * 16 * 128 + 2 * 48 * 128 + 2 * 48
    assert linear_a2a_width(gdn) == 2 * 16 * 128 + 48 * 128
    tl = step_timeline(QWEN, w, plan, lay, H200)
    rows = kv_rows.held(lay, "positions").astype(float) * 2  # Fast-dLLM v2: two batch rows
    noisy = kv_rows.held(lay, "noisy").astype(float) * 2
    clean = rows - noisy
    # pure CP (the profile moves the noisy rows too): the larger pass; CSBP: the clean rows
    moved = np.maximum(clean, noisy) if plan.bp == 1 else clean
    want = 2 * moved * linear_a2a_width(gdn, TURBO) * 2  # send + receive, bf16
    for phase in ("recompute", "backward"):
        k = next(k for k, m in enumerate(tl.moments) if m.phase == phase and m.op == "attn"
                 and QWEN.layers[m.layer].kind == "linear")
        got = np.array([tl.breakdown(k, r).get("comm", 0.0) for r in range(lay.size)])
        np.testing.assert_allclose(got, want, rtol=REL)
    # the profile without z, beta, a in the exchange holds the q, k, v widths only
    qkv = variant(tmp_path, "turbo-qkv-a2a", "a2a_gate_inputs: {value: true", "a2a_gate_inputs: {value: false")
    tl2 = step_timeline(QWEN, w, plan, lay, qkv)
    k = next(k for k, m in enumerate(tl2.moments) if m.phase == "backward" and m.op == "attn"
             and QWEN.layers[m.layer].kind == "linear")
    got = np.array([tl2.breakdown(k, r).get("comm", 0.0) for r in range(lay.size)])
    np.testing.assert_allclose(got, 2 * moved * linear_a2a_width(gdn) * 2, rtol=REL)


# ---- pure CP at head dim 256: the output rows and dQ all-gathered (implementation.md 13) ------


def qwen_graph(plan: Plan, implementation, seq_len: int = 65536):
    from csbp.simulator.cost.graph import StepGraph

    w = Workload(seq_len=seq_len, objective="fast-dllm-v2")
    lay = Layout.build(w, plan)
    return StepGraph.build(QWEN, w, plan, lay, 8, implementation=implementation), lay


def test_pure_cp_gathers_output_rows_and_dq_at_head_dim_256_full_attention_layers():
    graph, lay = qwen_graph(Plan(cp=8), "turbo-dllm")
    full = [i for i, a in enumerate(QWEN.layers) if a.kind == "full"]
    assert QWEN.layers[full[0]].head_dim == 256 and len(full) == 16
    ops = {(op.name, op.layer): op for op in graph.ops if op.name in ("attn.output-gather", "attn.dq-gather")}
    # one of each per full-attention layer, in backward only, none at the Gated-DeltaNet layers
    assert sorted(ops) == sorted((n, i) for i in full for n in ("attn.output-gather", "attn.dq-gather"))
    assert {op.phase for op in ops.values()} == {"backward"}
    # every other member's query rows (padded to the largest shard) x 24 heads x 256, bf16, x 2 rows
    pos = kv_rows.held(lay, "positions").astype(float)
    want = 7 * pos.max() * 2 * 24 * 256 * 2
    for op in ops.values():
        assert op.work.collective == "all-gather"
        np.testing.assert_allclose(op.work.bytes, want, rtol=REL)
    # the dQ gather follows the call, the call follows the output gather
    li = full[0]
    names = [op.name for op in graph.ops if op.layer == li and op.phase == "backward"]
    assert names.index("attn.output-gather") < names.index("attn") < names.index("attn.dq-gather")


@pytest.mark.parametrize("plan, impl", [(Plan(cp=8, bp=8), "turbo-dllm"), (Plan(cp=8), "ideal")])
def test_no_query_gathers_outside_pure_cp_or_without_the_fact(plan, impl):
    graph, _ = qwen_graph(plan, impl)
    assert not [op for op in graph.ops if op.name.endswith(("output-gather", "dq-gather"))]


def test_pure_cp_query_gathers_slow_the_step_and_hold_a_gathered_buffer(tmp_path):
    w = Workload(seq_len=65536, objective="fast-dllm-v2")
    plan = Plan(cp=8)
    off = variant(tmp_path, "turbo-no-gathers", "cp_gathers: [output, dq]", "cp_gathers: []")
    with_, without = (simulate(QWEN, w, plan, p, nodes=1, with_trace=False) for p in (H200, off))
    assert with_.step_time_s > without.step_time_s
    assert with_.flops_per_gpu == pytest.approx(without.flops_per_gpu, rel=REL)  # bytes, not FLOPs
    lay = Layout.build(w, plan)
    tl = step_timeline(QWEN, w, plan, lay, H200)
    tl0 = step_timeline(QWEN, w, plan, lay, off)
    k = next(k for k, m in enumerate(tl.moments) if m.phase == "backward" and m.op in ("attn", "attn.local")
             and QWEN.layers[m.layer].kind == "full")
    rows = 8 * kv_rows.held(lay, "positions").astype(float).max() * 2  # all 2L rows, two batch rows
    extra = tl.breakdown(k, 0).get("comm", 0.0) - tl0.breakdown(k, 0).get("comm", 0.0)
    assert extra == pytest.approx(rows * 24 * 256 * 2, rel=1e-9)
