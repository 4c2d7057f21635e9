"""Objectives: views, self-conditioning, the drafter's anchor layout, frozen parameters."""

import numpy as np
import pytest

from csbp.simulator.graph import StepGraph
from csbp.simulator.hardware import load_profile
from csbp.simulator.layout import Layout
from csbp.simulator.memory import estimate_memory, weight_state
from csbp.simulator.objective_layout import AnchorLayout, anchor_blocks, canvas_view
from csbp.simulator.objectives import objective_shape
from csbp.simulator.plan import Plan
from csbp.simulator.presets import load_model
from csbp.simulator.spans import intersect, normalize, size
from csbp.simulator.workload import Workload

TINY = load_model("tiny")
DRAFTER = load_model("dflash2-qwen3.8-27b")
GEMMA = load_model("diffusiongemma-26b-a4b")


def graph(model, plan, **workload):
    w = Workload(**{"seq_len": 1024, "block_size": 64, **workload})
    return StepGraph.build(model, w, plan, Layout.build(w, plan), 8)


def test_shapes_per_objective():
    w = Workload(seq_len=1024, block_size=64)
    assert objective_shape(w, TINY).views == 1
    assert objective_shape(w.model_copy(update={"objective": "fast-dllm-v2"}), TINY).views == 2
    dg = objective_shape(w.model_copy(update={"objective": "diffusiongemma"}), GEMMA)
    assert dg.canvas_passes == 0.5 and dg.frozen_router and not dg.frozen_embeddings
    df = objective_shape(w.model_copy(update={"objective": "dflash2"}), DRAFTER)
    assert df.context_as_kv and df.frozen_embeddings and df.vocab_block == 32768


def test_fast_dllm_v2_runs_two_full_views():
    plan = Plan(cp=2, bp=2)
    one, two = graph(TINY, plan), graph(TINY, plan, objective="fast-dllm-v2")
    assert two.model_flops == pytest.approx(2 * one.model_flops)
    assert two.flops().sum() == pytest.approx(2 * one.flops().sum())  # the optimizer moves bytes only


def test_self_conditioning_adds_its_expected_canvas_forward():
    plan = Plan(cp=2, bp=2)
    off = graph(TINY, plan, objective="diffusiongemma", self_conditioning=0.0)
    half = graph(TINY, plan, objective="diffusiongemma", self_conditioning=0.5)
    full = graph(TINY, plan, objective="diffusiongemma", self_conditioning=1.0)
    # a dense model has no router: without self-conditioning the step is BD3-LM's
    assert off.flops().sum() == pytest.approx(graph(TINY, plan).flops().sum())
    extra_half = half.flops().sum() - off.flops().sum()
    assert extra_half > 0
    assert full.flops().sum() - off.flops().sum() == pytest.approx(2 * extra_half)
    selfcond = [op for op in half.ops if op.name.startswith("selfcond.")]
    assert selfcond and all(op.phase == "forward" for op in selfcond)
    # the canvas pass moves clean K/V again, as the main forward does
    assert any(op.stream == "comm" and op.work.category == "attention-kv" for op in selfcond)
    assert half.model_flops > off.model_flops


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
    anchors = anchor_blocks(L // b, 64)
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
        peaks.append(estimate_memory(DRAFTER, w, plan, Layout.build(w, plan), h100).peak_gib)
    # the context's features, fc output and per-layer K/V: (5 + 1) x hidden + 5 x 2 x 1024 per token
    per_token = (6 * 5120 + 5 * 2048) * 2 / 1024**3
    assert peaks[1] - peaks[0] == pytest.approx((262144 - 65536) * per_token, rel=0.01)
