"""Objectives as the reference executes them (implementation.md section 4): Fast-dLLM v2's rows,
DiffusionGemma's role passes, the drafter's anchors, storage read and frozen head."""

import numpy as np
import pytest

from csbp.simulator.cost.cost import seconds as cost_seconds
from csbp.simulator.cost.graph import Comm, Compute, StepGraph, delta_rule_flops_per_token
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.system.implementation import DEFAULT_IMPLEMENTATION, load_implementation
from csbp.simulator.layout.layout import Layout
from csbp.simulator.cost.memory import estimate_memory, weight_state
from csbp.simulator.layout.objective_layout import AnchorLayout, anchor_blocks, canvas_view, locality_anchor_blocks
from csbp.simulator.workload.objectives import as_executed, objective_shape
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.layout.spans import intersect, normalize, size
from csbp.simulator.workload.workload import Workload

TINY = load_model("tiny")
# flops, bytes and times as numpy sums against their formulas: tests/README.md
pytestmark = pytest.mark.floats
DRAFTER = load_model("dflash2-qwen3.8-27b")
GEMMA = load_model("diffusiongemma-26b-a4b")


def graph(model, plan, **workload):
    w = Workload(**{"seq_len": 1024, "block_size": 64, **workload})
    return StepGraph.build(model, w, plan, Layout.build(w, plan), 8)


def test_shapes_per_objective():
    w = Workload(seq_len=1024, block_size=64)
    bd3 = objective_shape(w, TINY)
    assert (bd3.passes, bd3.rows_per_example, bd3.canvas_passes, bd3.stored_features) == (1, 1, 0.0, 0)
    fast = objective_shape(w.model_copy(update={"objective": "fast-dllm-v2"}), TINY)
    assert (fast.passes, fast.rows_per_example) == (1, 2)  # two rows in one pass, not two passes
    dg = objective_shape(w.model_copy(update={"objective": "diffusiongemma"}), GEMMA)
    assert dg.canvas_passes == 0.5 and dg.frozen_router and not dg.frozen_embeddings
    assert dg.clean_loss and dg.soft_embedding and dg.canvas_sync_axis == "ep"
    df = objective_shape(w.model_copy(update={"objective": "dflash2"}), DRAFTER)
    assert df.context_as_kv and df.frozen_embeddings and df.vocab_block == 32768 and df.head_recompute
    assert df.stored_bytes_per_token(DRAFTER) == 5 * 5120 * 2  # ~51 KB per context token


def test_fast_dllm_v2_runs_two_rows_in_one_pass():
    plan = Plan(cp=2, bp=2)
    one, two = graph(TINY, plan), graph(TINY, plan, objective="fast-dllm-v2")
    # the clean stream runs in both rows but is useful once (implementation.md 13): useful FLOPs
    # lie between one row's and two rows' (strict inequalities, no tolerance needed)
    assert one.model_flops < two.model_flops < 2 * one.model_flops
    # one forward/backward: the same ops, each call carrying both rows
    assert [op.name for op in two.ops] == [op.name for op in one.ops]
    share = (1024 - 1) / (2 * 1024)  # the LM head runs on the L - 1 valid rows (section 13)
    for a, b in zip(one.ops, two.ops):
        if isinstance(a.work, Compute) and a.work.kind == "gemm":  # one call of twice the size
            assert b.work.kernels == a.work.kernels
            head = a.name.startswith("lm-head")
            assert b.work.flops == pytest.approx(tuple(2 * (share if head else 1) * f for f in a.work.flops))
        if isinstance(a.work, Comm) and a.work.category == "attention-kv":  # one latency, 2x bytes
            assert b.work.collective == a.work.collective
            assert b.work.bytes == pytest.approx(tuple(2 * x for x in a.work.bytes))
        if isinstance(a.work, Comm) and a.work.category == "gradients":  # reduced once
            assert b.work.bytes == a.work.bytes
    gathers = [op for op in two.ops if op.name == "kv.gather"]
    assert len(gathers) == len({(op.layer, op.phase) for op in gathers})  # one per layer and phase
    assert two.views == 2  # rows per example: the attention traffic the report counts


def test_fast_dllm_v2_throughput_counts_examples_not_rows():
    w = Workload(seq_len=1024, block_size=64, objective="fast-dllm-v2")
    plan = Plan(dp=4, cp=2, bp=2)
    r = simulate(TINY, w, plan, load_profile("h200"), nodes=1)
    assert r.tokens_per_s * r.step_time_s == pytest.approx(1024 * plan.sequences)  # L per example


def test_diffusiongemma_adds_the_clean_stream_ar_loss():
    plan = Plan(cp=2, bp=2)  # one clean shard per rank: every clean row once
    bd3 = graph(TINY, plan)
    off = graph(TINY, plan, objective="diffusiongemma", self_conditioning=0.0)
    head = 2 * 1024 * TINY.hidden * TINY.vocab  # the LM head over the L clean rows
    # a dense model without self-conditioning: BD3-LM plus the AR head, forward and backward
    # (and the forward again where the loss kernel recomputes its logits, implementation.md 9)
    recompute = load_implementation(DEFAULT_IMPLEMENTATION).loss.recompute_logits
    assert off.flops().sum() - bd3.flops().sum() == pytest.approx((3 + recompute) * head)
    assert off.model_flops - bd3.model_flops == pytest.approx(3 * head)
    # one LM head per trained stream (implementation.md 12): the encoder's over the clean rows,
    # the decoder's over the noisy ones, 2L in all
    heads = {op.name: sum(op.work.flops) for op in off.ops if op.name.endswith("lm-head")}
    assert heads["encoder.lm-head"] == pytest.approx(head) and heads["decoder.lm-head"] == pytest.approx(head)


def test_self_conditioning_adds_its_expected_canvas_forward_and_soft_embedding():
    plan = Plan(cp=2, bp=2)
    off = graph(TINY, plan, objective="diffusiongemma", self_conditioning=0.0)
    half = graph(TINY, plan, objective="diffusiongemma", self_conditioning=0.5)
    full = graph(TINY, plan, objective="diffusiongemma", self_conditioning=1.0)
    extra_half = half.flops().sum() - off.flops().sum()
    assert extra_half > 0
    assert full.flops().sum() - off.flops().sum() == pytest.approx(2 * extra_half)
    selfcond = [op for op in half.ops if op.name.startswith("selfcond.")]
    assert selfcond and all(op.phase == "forward" for op in selfcond)
    # the canvas pass moves clean K/V again, as the main forward does
    assert any(op.stream == "comm" and op.work.category == "attention-kv" for op in selfcond)
    # its logits feed a soft embedding: probabilities x embedding over the L canvas rows
    soft = [op for op in selfcond if op.name == "selfcond.soft-embed"]
    assert len(soft) == 1 and sum(soft[0].work.flops) == pytest.approx(0.5 * 2 * 1024 * TINY.hidden * TINY.vocab)
    assert half.model_flops > off.model_flops


def test_self_conditioning_runs_when_any_example_of_the_ep_group_draws_it():
    moe = load_model("tiny-moe")
    w = Workload(seq_len=1024, block_size=64, objective="diffusiongemma", self_conditioning=0.5)
    assert objective_shape(w, moe, Plan(ep=2, cp=2, bp=2)).canvas_passes == pytest.approx(1 - 0.5 ** 2)
    assert objective_shape(w, moe, Plan(ep=4)).canvas_passes == pytest.approx(1 - 0.5 ** 4)
    ep1, ep2 = (graph(moe, Plan(ep=e, cp=2, bp=2), objective="diffusiongemma") for e in (1, 2))

    def head(g):
        return sum(op.work.flops[0] for op in g.ops if op.name == "selfcond.lm-head")

    assert head(ep2) == pytest.approx(head(ep1) * 0.75 / 0.5)
    # the draw is one MAX all-reduce over the EP group, before the pass
    draws = [op for op in ep2.ops if op.name == "selfcond.draw.ep-max"]
    assert len(draws) == 1 and draws[0].work.collective == "all-reduce" and draws[0].work.group.size == 2
    assert not any(op.name == "selfcond.draw.ep-max" for op in ep1.ops)


def test_dflash2_offline_features_are_read_and_copied_beside_the_step():
    """Offline features (implementation.md 14): a background reader and a side-stream copy one
    batch ahead, on their own streams, waited on by nothing; synthetic features: no I/O."""
    w = dict(seq_len=8192, block_size=8, objective="dflash2", max_anchors=256, checkpointing="none")
    g = graph(DRAFTER, Plan(cp=8), **w)
    read = next(op for op in g.ops if op.name == "data.storage-read")
    copy = next(op for op in g.ops if op.name == "data.h2d")
    assert read.phase == copy.phase == "data" and not read.deps and not copy.deps
    assert (read.stream, copy.stream) == ("io", "h2d")
    assert read.work.kind == "storage-read" and read.work.readers == 8  # every GPU of the node reads
    # each context rank reads and copies its whole shard (the trim comes after the copy)
    assert read.work.bytes == pytest.approx((8192 / 8 * 5 * 5120 * 2,) * 8)
    assert copy.work.bytes == read.work.bytes
    h100 = load_profile("h100")
    share = h100.node.storage_gbs / 8 * 1e9
    assert cost_seconds(read.work, h100) == pytest.approx(np.array(read.work.bytes) / share)
    assert cost_seconds(copy.work, h100) == pytest.approx(np.array(copy.work.bytes) / (h100.node.h2d_gbs * 1e9))
    assert not any(read.index in op.deps or copy.index in op.deps for op in g.ops)
    # a profile without a storage figure leaves the read unpriced
    bare = h100.model_copy(update={"node": h100.node.model_copy(update={"storage_gbs": None})})
    assert not cost_seconds(read.work, bare).any()
    synthetic = graph(DRAFTER, Plan(cp=8), features="synthetic", **w)
    assert not any(op.stream in ("io", "h2d") for op in synthetic.ops)
    assert not any(op.stream in ("io", "h2d") for op in graph(TINY, Plan(cp=2)).ops)


def test_dflash2_offline_step_is_the_longer_of_the_step_and_its_reader():
    kw = dict(seq_len=65536, block_size=8, objective="dflash2", max_anchors=512, checkpointing="none")
    plan, h100 = Plan(cp=8, bp=8), load_profile("h100")
    offline, synthetic = (simulate(DRAFTER, Workload(**kw, features=f), plan, h100, nodes=1)
                          for f in ("offline", "synthetic"))
    shard = 65536 / 8 * 5 * 5120 * 2
    read, copy = shard / (h100.node.storage_gbs / 8 * 1e9), shard / (h100.node.h2d_gbs * 1e9)
    # the io streams change no other op's time: the same sums in the same order, so only the
    # last bits of the division differ (rel 1e-9)
    assert offline.step_time_s == pytest.approx(max(synthetic.step_time_s, read, copy), rel=1e-9)


def test_dflash2_frozen_head_recomputes_its_logits_in_backward_by_vocabulary_block():
    w = dict(seq_len=8192, block_size=8, objective="dflash2", max_anchors=256, checkpointing="none")
    g = graph(DRAFTER, Plan(cp=8), **w)
    fwd = next(op.work for op in g.ops if op.name == "lm-head")
    bwd = next(op.work for op in g.ops if op.name == "lm-head-bwd")
    blocks = -(-DRAFTER.vocab // 32768)
    assert fwd.kernels == blocks and bwd.kernels == 2 * blocks  # recomputed logits + input gradient
    assert bwd.flops == pytest.approx(tuple(2 * f for f in fwd.flops))


def test_canvas_view_keeps_only_noisy_queries():
    w = Workload(seq_len=1024, block_size=64)
    lay = Layout.build(w, Plan(cp=2, bp=4))
    canvas = canvas_view(lay)
    for main, view in zip(lay.shares, canvas.shares):
        assert view.positions == intersect(main.positions, ((0, 1024),))
        assert view.owned_kv == main.owned_kv


def test_anchor_blocks_are_evenly_spaced_and_distinct():
    blocks = anchor_blocks(8192, 2048)
    assert len(blocks) == len(set(blocks)) == 2048
    assert set(np.diff(blocks)) == {4}
    assert anchor_blocks(16, 2048) == tuple(range(16))  # never more anchors than blocks


@pytest.mark.parametrize("plan", [Plan(dp=1), Plan(cp=4), Plan(bp=4), Plan(cp=2, bp=4), Plan(cp=4, bp=4)])
def test_anchor_layout_covers_every_anchor_and_the_context(plan):
    L, b = 4096, 8
    w = Workload(seq_len=L, block_size=b, objective="dflash2", max_anchors=64)
    lay = Layout.build(w, plan)
    assert isinstance(lay, AnchorLayout)
    anchors = locality_anchor_blocks(L // b, 64)
    assert set(np.diff(anchors)) == {1}  # locality: adjacent anchors one block apart
    owned = [blk for s in lay.shares for blk in s.noisy_blocks]
    if plan.kind == "cp":  # conventional CP: every rank runs every draft block
        assert all(s.noisy_blocks == anchors for s in lay.shares)
    else:
        assert sorted(owned) == sorted(anchors)
    for s in lay.shares:  # queries are draft tokens only
        assert size(s.positions) == len(s.noisy_blocks) * b
        assert not intersect(s.positions, ((L, 2 * L),))
    if plan.kind in ("cp", "csbp"):  # each cp group's context shards partition the context
        for g in lay.cp_groups():
            assert normalize(sp for r in g for sp in lay.shares[r].owned_kv) == ((L, 2 * L),)
    # a draft block sees the context before its anchor and itself
    s = lay.shares[0]
    blk = s.noisy_blocks[0]
    assert lay.pairs(0) == sum(b * (k * b + b) for k in s.noisy_blocks)
    assert blk in anchors


def test_cp_replicates_the_draft_decoder_csbp_divides_it():
    w = dict(seq_len=8192, block_size=8, objective="dflash2", max_anchors=256, checkpointing="none")
    cp, csbp = graph(DRAFTER, Plan(cp=8), **w), graph(DRAFTER, Plan(cp=8, bp=8), **w)
    dp = graph(DRAFTER, Plan(dp=8), **w)

    def flops(g, name):
        return max(sum(op.work.flops[r] for op in g.ops if op.name == name) for r in range(g.ranks))

    assert flops(cp, "mlp") == pytest.approx(flops(dp, "mlp"))  # replicated
    assert flops(csbp, "mlp") == pytest.approx(flops(dp, "mlp") / 8)
    assert flops(cp, "context-kv") == pytest.approx(flops(dp, "context-kv") / 8)  # context is sharded
    assert flops(cp, "lm-head") == pytest.approx(flops(dp, "lm-head"))
    assert cp.model_flops == pytest.approx(csbp.model_flops) == pytest.approx(dp.model_flops)


def test_drafter_memory_freezes_the_head_and_grows_with_context():
    plan = Plan(dp=8)
    base = Workload(seq_len=65536, block_size=8)
    bd3, drafter = (weight_state(DRAFTER, base.model_copy(update={"objective": o}), plan)
                    for o in ("bd3lm", "dflash2"))
    frozen = DRAFTER.embedding_params()
    assert bd3["params"] == pytest.approx(drafter["params"])  # frozen weights are still held
    assert bd3["optimizer"] - drafter["optimizer"] == pytest.approx(frozen * 12 / 8)
    h100 = load_profile("h100")
    peaks = []
    for L in (65536, 262144):
        w = Workload(seq_len=L, block_size=8, objective="dflash2", checkpointing="none")
        # the live-tensor peak: the allocator overhead and the reserve scale or shift the need
        peaks.append(estimate_memory(DRAFTER, w, plan, Layout.build(as_executed(w, DRAFTER), plan),
                                     h100).allocated_gib)
    # windowed: fc output and K/V are trimmed, flat in L; only the features grow, two offline
    # copies of 5 x hidden bf16 per token (implementation.md 14)
    per_token = 2 * 5 * 5120 * 2 / 1024**3
    # 1 %: a modelling margin for what grows slower than the context (exact today), not rounding
    assert peaks[1] - peaks[0] == pytest.approx((262144 - 65536) * per_token, rel=0.01)


@pytest.mark.parametrize("plan", [Plan(cp=4, bp=4), Plan(cp=2, bp=4), Plan(cp=4), Plan(bp=4), Plan(dp=4)])
def test_gated_deltanet_routes_boundary_states_to_the_noisy_blocks_owners(plan):
    """Fast-dLLM v2 on a hybrid model: clean rows head-sharded through the delta rule, each noisy
    block restarting from its clean-prefix state at its owner (implementation.md section 4)."""
    qwen = load_model("qwen3.5-27b")
    a = next(k for k in qwen.attention_kinds() if k.kind == "linear")
    L, b = 4096, 256
    w = Workload(seq_len=L, block_size=b, objective="fast-dllm-v2")
    lay = Layout.build(w, plan)
    # the method's routing, under the profile schema's defaults (one delta-rule call per row outside
    # CP/CSBP, states moved as they are computed); turbo-dllm's two Triton passes, waits and state
    # traffic are tests/test_moe_linear_pricing.py's
    g = StepGraph.build(qwen, w, plan, lay, 8, implementation="csbp-runtime")
    layer = [i for i, k in enumerate(qwen.layers) if k.kind == "linear"][0]
    ops = {(op.name, op.phase): op for op in g.ops if op.layer == layer}
    positions = np.array([s.n_positions for s in lay.shares], dtype=float)
    noisy = np.array([size(intersect(s.positions, ((0, L),))) for s in lay.shares], dtype=float)
    per_token = a.n_heads * delta_rule_flops_per_token(a.head_dim, a.head_dim)
    # the delta rule's work is the same however it is split: every row once, two rows per example
    rule = [op.work.flops for (name, ph), op in ops.items() if name.startswith("delta-rule") and ph == "forward"]
    assert np.sum(rule, axis=0) == pytest.approx(2 * positions * per_token)
    if plan.kind not in ("cp", "csbp"):
        assert not any(name.startswith("lin.") for name, _ in ops)
        return
    n = plan.cp
    width_in = (2 * a.n_kv_heads + a.n_heads) * a.head_dim
    a2a = ops[("lin.a2a-in", "forward")].work
    assert a2a.bytes == pytest.approx(tuple(2 * (positions - noisy) * width_in * 2 * (n - 1) / n))  # clean only
    state = a.n_heads * a.head_dim ** 2 * 4 + (a.conv_kernel - 1) * width_in * 2
    fwd, bwd = ops[("lin.states", "forward")].work, ops[("lin.states-bwd", "backward")].work
    if plan.kind == "cp":  # noisy rows are zigzag shards: every boundary, gathered
        blocks = np.full(n, L // b - 1)
        assert (fwd.collective, bwd.collective) == ("all-gather", "reduce-scatter")
    else:
        blocks = np.array([len(s.noisy_blocks) - (0 in s.noisy_blocks) for s in lay.shares])
        assert fwd.collective == bwd.collective == "all-to-all"
    assert fwd.bytes == pytest.approx(tuple(2 * blocks * state * (n - 1) / n)) == bwd.bytes
    # the noisy blocks wait for their states; the clean backward for the state gradients (through
    # the states' write and read, `lin.states-io`, where the implementation prices it)
    before = _ancestors(g)
    assert ops[("lin.states", "forward")].index in before[ops[("delta-rule.noisy", "forward")].index]
    assert ops[("lin.states-bwd", "backward")].index in before[ops[("delta-rule-bwd.clean", "backward")].index]


def _ancestors(g) -> list[set[int]]:
    """Every op's transitive dependencies (ops come in dependency order)."""
    out: list[set[int]] = []
    for op in g.ops:
        out.append(set(op.deps).union(*(out[d] for d in op.deps)))
    return out
