"""The optimizer and gradient path, the loss kernel and TP waits as implementation profiles say
(issue 23, implementation.md sections 8-10 and 14)."""

import math

import numpy as np
import pytest

from csbp.simulator.cost import loss_ops
from csbp.simulator.cost.graph import Comm, StepGraph
from csbp.simulator.cost.memory import step_timeline
from csbp.simulator.cost.memory_timeline import weight_state
from csbp.simulator.engine import simulate_graph
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.system.implementation import load_implementation
from csbp.simulator.workload.objectives import as_executed
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

M8 = load_model("nemotron-diffusion-8b")
TURBO, IDEAL = load_implementation("turbo-dllm"), load_implementation("ideal")
K16 = 16 * 1024


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200")


def variant(base, **sections):
    """`base` with some of its optimizer / loss / tp facts replaced (a test profile)."""
    update = {k: getattr(base, k).model_copy(update=v) for k, v in sections.items()}
    return base.model_copy(update=update)


def graph(model, w, plan, impl):
    return StepGraph.build(model, w, plan, Layout.build(as_executed(w, model), plan), 8, implementation=impl)


def timeline(model, w, plan, impl, profile):
    prof = profile.model_copy(update={"implementation": impl})
    return step_timeline(model, w, plan, Layout.build(as_executed(w, model), plan), prof)


def test_two_ipg_buckets_of_the_largest_parameter_live_through_the_backward(h200):
    """Section 8: two bf16 buffers of the embedding's size (V x h / tp), allocated before the
    backward, alive through it, gone at the optimizer."""
    w, plan = Workload(seq_len=K16), Plan(dp=2, cp=4, tp=2)
    opt = TURBO.optimizer.path("bd3lm")
    state = weight_state(M8, 2, 2, plan, False, False, opt)
    assert state.bucket == 2 * M8.vocab * M8.hidden / 2 * 2
    layer_buckets = variant(TURBO, optimizer={"buckets": "layer"})
    a, b = timeline(M8, w, plan, TURBO, h200), timeline(M8, w, plan, layer_buckets, h200)
    other = weight_state(M8, 2, 2, plan, False, False, layer_buckets.optimizer.path("bd3lm")).bucket
    diff = a.totals() - b.totals()  # byte counts, exact
    for k, m in enumerate(a.moments):
        if m.phase in ("backward", "recompute") or m.op == "head-bwd":
            assert np.all(diff[k] == state.bucket - other), m
        if m.phase == "optimizer":
            assert np.all(diff[k] == 0)
    backward = [m for m in a.moments if m.phase == "backward"]
    assert {backward[0].layer, backward[-1].layer} >= {M8.n_layers - 1, 0}  # first and last layer


def test_buckets_are_reduced_when_one_fills():
    """Gradients reach the collective in buckets of the largest parameter: fewer, larger calls
    than per-layer buckets, every trained parameter reduced exactly once."""
    w, plan = Workload(seq_len=K16), Plan(dp=2, cp=4)
    g_big, g_layer = graph(M8, w, plan, TURBO), graph(M8, w, plan, variant(TURBO, optimizer={"buckets": "layer"}))
    grads = lambda g: [op.work for op in g.ops if op.name.startswith("grads.dense")]  # noqa: E731
    big, per_layer = grads(g_big), grads(g_layer)
    bucket = M8.vocab * M8.hidden * 2  # bf16 bytes
    assert len(big) < len(per_layer)
    share = 7 / 8  # reduce-scatter over dp x ctx = 8 ranks
    assert max(max(c.bytes) for c in big) >= bucket * share  # a full bucket at least
    # byte counts, summed in another order
    assert sum(c.bytes[0] for c in big) == pytest.approx(sum(c.bytes[0] for c in per_layer), rel=1e-12)


@pytest.mark.floats
def test_a_waited_tp_collective_adds_its_time_an_overlapped_one_its_exposed_part(h200):
    """Section 10: waited, the GEMM after the all-gather waits for it (the layer adds the
    collective's full time); overlapped, the GEMM does not and the layer's end waits for both, so
    the step saves at most the collectives' time."""
    w, plan = Workload(seq_len=K16), Plan(tp=2, cp=4)
    waited = graph(M8, w, plan, TURBO)
    over = graph(M8, w, plan, variant(TURBO, tp={"exchange": "overlapped"}))
    for g, waits in ((waited, True), (over, False)):
        ag = next(op for op in g.ops if op.name == "attn-in.ag" and op.layer == 3 and op.phase == "forward")
        norm = g.ops[ag.index + 1]
        assert norm.name == "norm-rope" and (ag.index in norm.deps) is waits
        # the next layer starts after layer 3's end: its overlapped collectives included
        nxt = next(op for op in g.ops if op.layer == 4 and op.phase == "forward")
        assert (ag.index in nxt.deps) is not waits
    for engine in ("des", "closed-form"):
        (tl_w, d_w), (tl_o, _) = simulate_graph(waited, h200, engine), simulate_graph(over, h200, engine)
        tp_seconds = sum(d_w[op.index].max() for op in waited.ops
                         if isinstance(op.work, Comm) and op.work.category == "tp" and op.phase != "grad-sync")
        # 1e-9: event times summed in other orders
        assert tl_o.step_time_s <= tl_w.step_time_s * (1 + 1e-9)
        # overlapping saves something, and at most what the TP collectives cost
        assert 0 < tl_w.step_time_s - tl_o.step_time_s <= tp_seconds * (1 + 1e-9)


def test_recompute_replays_tp_collectives_unless_the_profile_says_not():
    w, plan = Workload(seq_len=K16), Plan(tp=2, cp=4)
    count = lambda g: sum(op.phase == "recompute" and op.name == "attn-in.ag" for op in g.ops)  # noqa: E731
    assert count(graph(M8, w, plan, TURBO)) == M8.n_layers
    assert count(graph(M8, w, plan, variant(TURBO, tp={"replay_in_recompute": False}))) == 0


def test_tiled_loss_buffers_and_head_backward(h200):
    """Section 9: one tile's fp32 logits in forward; in backward the tile's fp32 logits and
    fp32 + bf16 grad-logits, the whole fp32 grad-weight with its bf16 copy and fp32 + bf16
    grad-hidden; the backward recomputes the logits (3 head GEMM passes, one call per tile)."""
    w, plan = Workload(seq_len=K16), Plan(dp=2, cp=4, tp=2)
    V, h, tile = M8.vocab // 2, M8.hidden, TURBO.loss.tile_rows
    rows = np.array([2048.0, 1000.0])
    fwd, bwd = loss_ops.loss_buffers(M8, TURBO.loss, rows, 2, 2)
    assert list(fwd) == [tile * V * 4, 1000 * V * 4]
    assert bwd[0] == tile * V * (4 + 4 + 2) + V * h * (4 + 2) + 2048 * h * (4 + 2)
    tl = timeline(M8, w, plan, TURBO, h200)
    at = [k for k, m in enumerate(tl.moments) if m.op == "head-bwd"]
    assert len(at) == 1 and tl.breakdown(at[0], 0)["loss"] > V * h * 6
    assert not any(m.op == "head-bwd" for m in timeline(M8, w, plan, IDEAL, h200).moments)
    for impl, passes in ((TURBO, 3), (IDEAL, 2)):
        g = graph(M8, w, plan, impl)
        head = next(op for op in g.ops if op.name == "lm-head").work
        back = next(op for op in g.ops if op.name == "lm-head-bwd").work
        assert back.flops == pytest.approx(tuple(passes * f for f in head.flops), rel=1e-12)
    g = graph(M8, w, plan, TURBO)
    head = next(op for op in g.ops if op.name == "lm-head").work
    assert head.kernels == math.ceil(K16 / 4 / tile)  # each rank's L/cp noisy rows (gathered over TP), per tile
    names = {op.name for op in g.ops}
    assert "head.grad-hidden.ar" in names and "head-in.rs-bwd" not in names  # vocab-parallel head
    assert "head-in.rs-bwd" in {op.name for op in graph(M8, w, plan, IDEAL).ops}


def test_all_reduce_fallback_and_dense_ep_all_reduce_under_ep():
    """Section 8: with EP > 1 the reduce-scatter is forced off (the bucket is all-reduced) and
    dense gradients get one more all-reduce over EP; the ideal profile reduce-scatters over
    every rank holding the same dense weights."""
    moe = load_model("tiny-moe")
    w, plan = Workload(seq_len=4096, block_size=64), Plan(dp=2, cp=2, ep=2)
    turbo, ideal = graph(moe, w, plan, TURBO), graph(moe, w, plan, IDEAL)
    names = lambda g: {op.name for op in g.ops if op.phase == "grad-sync"}  # noqa: E731
    assert {"grads.dense.all-reduce", "grads.dense.ep-all-reduce", "grads.experts.all-reduce"} <= names(turbo)
    assert {"grads.dense.reduce-scatter", "grads.experts.reduce-scatter"} <= names(ideal)
    assert not any("all-reduce" in n and n.startswith("grads.") for n in names(ideal))
    # bytes: an all-reduce counts 2 (P - 1) / P of its bucket, P = dp x ctx = 4 under turbo
    ar = next(op.work for op in turbo.ops if op.name == "grads.dense.all-reduce")
    assert ar.group.size == 4
    # dense optimizer state: sharded over dp x ctx (turbo) vs dp x ctx x ep (ideal): twice as much
    t = weight_state(moe, 2, 2, plan, False, False, TURBO.optimizer.path("bd3lm"))
    i = weight_state(moe, 2, 2, plan, False, False, IDEAL.optimizer.path("bd3lm"))
    assert t.optimizer > i.optimizer and t.master > i.master


def test_drafter_optimizer_is_replicated_bf16_adamw():
    """Section 14: no ZeRO, bf16 parameters and bf16 AdamW state (m, v: 4 B per parameter), no
    master; gradients all-reduced, no updated-parameter all-gather."""
    model = load_model("dflash2-qwen3.8-27b")
    w = Workload(seq_len=K16, block_size=8, objective="dflash2", max_anchors=64, checkpointing="none")
    plan = Plan(dp=8)
    opt = TURBO.optimizer.path("dflash2")
    assert opt.shard_group == "none" and not opt.master and opt.state_bytes == 2
    s = weight_state(model, 2, 2, plan, True, False, opt)
    assert s.master == 0 and s.optimizer == 4 * s.trainable and s.bucket == 0
    g = graph(model, w, plan, TURBO)
    names = {op.name for op in g.ops}
    assert not any(n.startswith("updated-params") for n in names)
    assert any(n.startswith("grads.dense.all-reduce") for n in names)
    adamw = next(op for op in g.ops if op.name == "adamw").work
    assert adamw.bytes[0] == pytest.approx(14 * s.trainable, rel=1e-9)  # 2 + 2*2*2 + 2*2


@pytest.mark.floats
@pytest.mark.parametrize("model,plan,seq", [
    ("nemotron-diffusion-8b", Plan(dp=2, cp=8, bp=8), 64 * 1024),
    ("nemotron-diffusion-8b", Plan(tp=2, cp=8), 64 * 1024),
    ("tiny-moe", Plan(dp=2, ep=2, cp=2, bp=2), 4096),
])
def test_ideal_optimizer_loss_and_tp_never_slower_than_turbo(model, plan, seq, h200):
    """The ideal profile's optimizer, loss and TP sections are the faster choice of each."""
    m = load_model(model)
    w = Workload(seq_len=seq, block_size=64 if seq < K16 else 256)
    best = variant(TURBO, optimizer=IDEAL.optimizer.model_dump(), loss=IDEAL.loss.model_dump(),
                   tp=IDEAL.tp.model_dump())
    step = {k: simulate_graph(graph(m, w, plan, impl), h200)[0].step_time_s
            for k, impl in (("turbo", TURBO), ("best", best))}
    # 1e-9: two graphs whose shared ops sum in other orders
    assert step["best"] <= step["turbo"] * (1 + 1e-9)


def test_frozen_head_runs_in_row_blocks_with_one_fp32_workspace(h200):
    """Section 14: the drafter's frozen head over 4096-row blocks with an fp32 workspace (width:
    the recipe's vocabulary block [U]): the loss moment holds one workspace, whatever the rows;
    each pass calls one GEMM per row block and vocabulary block."""
    model = load_model("dflash2-qwen3.8-27b")
    w = Workload(seq_len=K16, block_size=8, objective="dflash2", max_anchors=1024, checkpointing="none",
                 vocab_block=32768)
    plan = Plan(dp=8)
    tl = timeline(model, w, plan, TURBO, h200)
    at = next(k for k, m in enumerate(tl.moments) if m.op == "cross-entropy")
    assert tl.breakdown(at, 0)["loss"] == 4096 * 32768 * 4
    g = graph(model, w, plan, TURBO)
    head = next(op for op in g.ops if op.name == "lm-head").work
    rows = 1024 * 8  # anchors x block: the draft rows
    assert head.kernels == math.ceil(rows / 4096) * math.ceil(model.vocab / 32768)
