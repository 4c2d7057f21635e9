"""Objective ar (plain autoregressive training, issue 24): the causal layout, its CP exchanges as
TorchTitan and Megatron-Core run them, and the rules that keep block parallelism out.

The causal mask is BD3-LM's clean-to-clean mask at block 1, so the layout holds the sequence in
the clean stream's coordinates and every count of the mask applies unchanged; these tests hold
the counts to the dense causal mask and the CP variants' waits to the step graph's timeline.
"""

from __future__ import annotations

import numpy as np
import pytest

from csbp.simulator.cost.graph import StepGraph
from csbp.simulator.engine import durations
from csbp.simulator.engine.des import run as des_run
from csbp.simulator.errors import InputError
from csbp.simulator.layout.layout import Layout
from csbp.simulator.layout.objective_layout import CausalLayout
from csbp.simulator.plan import rules
from csbp.simulator.plan.plan import Plan
from csbp.simulator.planner.planner import enumerate_space
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.system.implementation import Implementation
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

TINY = load_model("tiny")


def ar(seq_len: int, **kw) -> Workload:
    return Workload(seq_len=seq_len, objective="ar", **kw)


def fact(value):
    return {"value": value, "source": "test"}


def profile_with(**passes) -> Implementation:
    """An implementation profile whose cp / cp-ring families run the given pass facts."""
    families = {}
    for family, (forward, backward) in passes.items():
        families[family] = {"forward": {k: fact(v) for k, v in forward.items()},
                            "backward": {k: fact(v) for k, v in backward.items()}}
    return Implementation.model_validate({"name": "test", "notes": "test", "families": families})


def causal_pairs(queries: np.ndarray) -> int:
    """Pairs of the dense causal mask (key <= query) for these tokens of the sequence."""
    return int((queries + 1).sum())


# ---- layout ---------------------------------------------------------------------------------


def test_ar_workload_has_no_blocks():
    w = ar(4096, block_size=256)  # whatever was passed: the causal mask is block 1
    assert w.block_size == 1 and w.n_blocks == 4096


@pytest.mark.parametrize("seq_len,cp", [(64, 2), (96, 3), (256, 4), (4096, 8), (8192, 16)])
def test_head_tail_cp_gives_every_rank_equal_causal_pairs(seq_len, cp):
    """Head-tail: 2cp chunks of C, rank r holds r and 2cp-1-r, so each rank's pairs are
    2cp C^2 + C (the chunks' offsets sum to 2cp - 1): equal, and L(L+1)/2 in all."""
    lay = Layout.build(ar(seq_len), Plan(cp=cp))
    assert isinstance(lay, CausalLayout)
    counts = [lay.pairs(r) for r in range(cp)]
    C = seq_len // (2 * cp)
    assert counts == [2 * cp * C * C + C] * cp
    assert sum(counts) == seq_len * (seq_len + 1) // 2
    for r in range(cp):  # chunks r and 2cp-1-r of the tokens
        chunks = {(a // C, (b - a) // C) for a, b in
                  ((s, e) for s, e in lay.token_spans(r))}
        assert sum(n for _, n in chunks) == 2
        assert min(chunks)[0] == r and max(k + n - 1 for k, n in chunks) == 2 * cp - 1 - r


@pytest.mark.parametrize("seq_len,cp", [(16, 1), (32, 2), (48, 3), (64, 4)])
def test_pairs_equal_the_dense_causal_mask(seq_len, cp):
    """Every (query, key) pair the layout's ranks compute, listed from the mask, is the dense
    causal mask's: each rank's set equals tril over its tokens, and the ranks' sets partition it."""
    lay = Layout.build(ar(seq_len), Plan(cp=cp) if cp > 1 else Plan())
    L = seq_len
    every = set()
    for r in range(lay.size):
        got = lay.computed_pairs(r)
        tokens = np.concatenate([np.arange(a, b) for a, b in lay.token_spans(r)])
        want = {(L + int(q), L + k) for q in tokens for k in range(int(q) + 1)}
        assert got == want
        assert lay.pairs(r) == len(want) == causal_pairs(tokens)
        assert not every & got
        every |= got
    assert len(every) == L * (L + 1) // 2


@pytest.mark.parametrize("workload,plan", [
    (ar(64), Plan(cp=4)), (ar(64), Plan(cp=2, transport="ring")),
    (Workload(seq_len=64, block_size=8), Plan(cp=4)), (Workload(seq_len=64, block_size=8), Plan(cp=2, bp=4)),
    (Workload(seq_len=96, block_size=4), Plan(bp=3))])
def test_step_call_shapes_equal_the_mask(workload, plan):
    """The queries and keys a shaped step call runs (`QueryIntervals.queries_seeing_each`,
    `keys_seen_each`: the rows of the mask's rectangle that meet it), on both of their paths
    (contiguous monotone runs, and the per-run fallback), equal the dense mask's."""
    from csbp.simulator.layout import mask
    from csbp.simulator.layout.pairs import QueryIntervals

    lay = Layout.build(workload, plan)
    L, b = lay.seq_len, lay.block
    for r in range(lay.size):
        sets = [s.owned_kv for s in lay.shares] + [((0, 2 * L),), ((L, L + 5), (L + 20, L + 33)), ((3, 9),)]
        q = mask.span_positions(lay.shares[r].positions)
        want = []
        for keys in sets:
            vis = mask.visible(q[:, None], mask.span_positions(keys)[None, :], L, b)
            want.append((int(vis.any(axis=1).sum()), int(vis.any(axis=0).sum())))
        fast = QueryIntervals.of(lay, r)
        slow = QueryIntervals.of(lay, r)
        slow._monotone = None  # the per-run path
        for qi in (fast, slow):
            got = list(zip(qi.queries_seeing_each(sets).tolist(), qi.keys_seen_each(sets).tolist()))
            assert got == want
        assert fast._monotone is not None  # without a window the runs are monotone


def test_ar_layout_moves_each_rank_its_peers_kv():
    """The Layout's exchanges apply: an all-gather brings every rank the other shards, a ring
    cp - 1 steps of one shard each; backward reduce-scatters / rings dK/dV home."""
    w = ar(256)
    layer = TINY.layers[0]
    gather = Layout.build(w, Plan(cp=4))
    ring = Layout.build(w, Plan(cp=4, transport="ring"))
    for r in range(4):
        assert gather.exchange(layer, "forward").rows_received(r) == 3 * 64
        assert gather.exchange(layer, "backward").rows_received(r, "dkv") == 3 * 64
        assert len(ring.exchange(layer, "forward").steps) == 3
        assert ring.exchange(layer, "forward").rows_received(r) == 3 * 64


# ---- rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("plan", ["bp=2", "cp=2,bp=2", "dp=2,bp=4"])
def test_bp_and_csbp_are_refused_in_one_line(plan):
    from csbp.simulator.plan.plan import parse_plan

    p = parse_plan(plan)
    with pytest.raises(InputError) as err:
        p.check_against(TINY, ar(1024), world=p.world)
    assert str(err.value) == rules.AR_NO_BLOCKS
    assert "\n" not in str(err.value)
    assert rules.violation(TINY, ar(1024), p) == rules.AR_NO_BLOCKS


def test_planner_space_for_ar_has_no_bp_axis():
    space = enumerate_space(TINY, ar(4096), 8)
    kinds = {c.plan.kind for c in space.candidates}
    assert kinds and kinds <= {"dp", "cp"}  # tiny is dense: tp, cp, dp only
    assert all(c.plan.bp == 1 for c in space.candidates)
    rejected = [label for group in space.rejected.values() for label in group.plans]
    assert rejected and not any("bp=" in label for label in rejected)  # bp never enumerated
    assert rules.AR_NO_BLOCKS not in {g.example for g in space.rejected.values()}


def test_ulysses_needs_heads_divisible_by_tp_cp():
    impl = profile_with(cp=({"context_exchange": "heads"}, {"context_exchange": "heads"}))
    ok = rules.violation(TINY, ar(1024), Plan(cp=2), impl)  # 4 heads, 2 K/V heads
    assert ok is None
    bad = rules.violation(TINY, ar(1024), Plan(cp=4), impl)
    assert bad is not None and "Ulysses" in bad and "2 K/V heads" in bad


# ---- the CP variants on the step graph ---------------------------------------------------------


def timeline(model, workload, plan, impl, profile="h200"):
    prof = load_profile(profile)
    lay = Layout.build(workload, plan)
    graph = StepGraph.build(model, workload, plan, lay, prof.node.gpus_per_node, implementation=impl)
    d = durations(graph, prof)
    return graph, d, des_run(graph, d, True, None)


def op_index(graph, name, layer=0, phase="forward"):
    found = [op.index for op in graph.ops if op.name == name and op.layer == layer and op.phase == phase]
    assert len(found) == 1, (name, found)
    return found[0]


ALLGATHER = profile_with(cp=({"split": "steps", "exchange": "overlapped"},
                             {"split": "steps", "exchange": "overlapped", "refetch_kv": True,
                              "dkv_exchange": "ring", "gradient_bytes": 4}))


def test_allgather_steps_wait_after_the_first_step():
    """TorchTitan's allgather rotate (frameworks.md A1): one gather, step 0 (the rank's own keys)
    beside it, every later step after it. So step 1 starts at max(step 0's end, the gather's
    end): the exposed part is the gather minus step 0's attention. Tolerance: the same float
    additions in another order (1e-9 relative)."""
    model = load_model("llama3.1-8b")
    w = ar(32768)
    graph, d, tl = timeline(model, w, Plan(cp=4), ALLGATHER)
    gather, local = op_index(graph, "kv.gather"), op_index(graph, "attn.local")
    step1 = op_index(graph, "attn.step1")
    assert gather not in graph.ops[local].deps  # step 0 does not wait
    assert gather in graph.ops[step1].deps
    names = [op.name for op in graph.ops if op.layer == 0 and op.phase == "forward" and op.name.startswith("attn.")]
    assert names == ["attn.local", "attn.step1", "attn.merge", "attn.step2", "attn.merge", "attn.step3", "attn.merge"]
    start, finish = tl.start, tl.finish
    for r in range(4):
        # both start when the rank's K/V are packed: the gather beside step 0
        assert start[gather, r] == pytest.approx(start[local, r], rel=1e-9)
        exposed = start[step1, r] - finish[local, r]
        assert exposed == pytest.approx(max(0.0, d[gather, r] - d[local, r]), rel=1e-9, abs=1e-15)
    # every step does the same useful work (head-tail), C x 2C pairs per head
    C = 32768 // 8
    heads = model.layers[0].n_heads
    per_pair = 4 * model.layers[0].head_dim * heads
    for s in (1, 2, 3):
        work = graph.ops[op_index(graph, f"attn.step{s}")].work
        assert work.flops == pytest.approx((2 * C * C * per_pair,) * 4, rel=1e-12)
        assert work.dense_flops == pytest.approx(work.flops, rel=1e-12)  # no masked waste
    # backward: K/V gathered again, dK/dV on their own ring of cp hops in fp32
    bwd = [op for op in graph.ops if op.layer == 0 and op.phase == "backward"]
    assert [op.name for op in bwd].count("kv.gather-bwd") == 1
    hops = [op for op in bwd if op.name.startswith("dkv.hop")]
    assert len(hops) == 4
    kv = model.layers[0]
    shard = 2 * C * kv.kv_tensors * kv.n_kv_heads * kv.head_dim * 4  # fp32 rows of one shard
    assert all(op.work.bytes == pytest.approx((shard,) * 4) for op in hops)


def test_ring_step_exposes_only_the_part_of_a_hop_longer_than_its_attention():
    """Pass-KV ring (Megatron p2p, TorchTitan alltoall): hop s is posted with step s-1's
    attention and waited on by step s, so step s starts max(0, hop - attention) after step s-1's
    end. Checked with a fast link (nothing exposed) and a slow one (the hop's excess exposed)."""
    from csbp.simulator.grids.what_if import apply

    ring = profile_with(**{"cp-ring": ({"split": "steps"}, {"split": "steps"})})
    model = load_model("llama3.1-8b")
    w, plan = ar(65536), Plan(cp=4, transport="ring")
    for what_if, exposed_any in ((None, False), ("nvlink=0.001x", True)):
        prof = apply(load_profile("h200"), what_if).profile if what_if else load_profile("h200")
        lay = Layout.build(w, plan)
        graph = StepGraph.build(model, w, plan, lay, prof.node.gpus_per_node, implementation=ring)
        d = durations(graph, prof)
        tl = des_run(graph, d, True, None)
        exposed = 0.0
        for s in (2, 3):
            hop, step = op_index(graph, f"kv.ring{s}"), op_index(graph, f"attn.ring{s}")
            before = op_index(graph, f"attn.ring{s - 1}")
            assert hop in graph.ops[step].deps  # the step waits for its hop ...
            merged = [i for i in graph.ops[step].deps if i != hop]  # ... and step s-1's merge
            prev_end = tl.finish[merged, :].max(axis=0)
            for r in range(4):
                # the hop runs beside step s-1's attention (posted when that step could start)
                assert tl.start[hop, r] <= tl.start[before, r] + 1e-12
                want = max(0.0, tl.finish[hop, r] - prev_end[r])  # the hop's excess, if any
                assert tl.start[step, r] - prev_end[r] == pytest.approx(want, rel=1e-9, abs=1e-15)
                exposed += want
        assert (exposed > 0) == exposed_any


def test_ulysses_all_to_alls_are_waited_and_attention_is_split_by_heads():
    impl = profile_with(cp=({"context_exchange": "heads"}, {"context_exchange": "heads"}))
    model = load_model("llama3.1-8b")
    w = ar(32768)
    graph, d, tl = timeline(model, w, Plan(cp=4), impl)
    a2a, attn, out = (op_index(graph, n) for n in ("qkv.a2a", "attn.heads", "o.a2a"))
    assert a2a in graph.ops[attn].deps and attn in graph.ops[out].deps
    for r in range(4):
        assert tl.start[attn, r] >= tl.finish[a2a, r] - 1e-15
    # one call over the whole causal sequence on heads / cp: a quarter of the pairs each
    per_pair = 4 * model.layers[0].head_dim * model.layers[0].n_heads
    total = 32768 * 32769 // 2
    assert graph.ops[attn].work.flops == pytest.approx((total * per_pair / 4,) * 4, rel=1e-12)
    # memory holds the head shards and the all-to-all buffers, not a gathered sequence of K/V
    from csbp.simulator.cost.memory import estimate_memory

    prof = load_profile("h200").model_copy(update={"implementation": impl})
    ops = {m.op for m in estimate_memory(model, w, Plan(cp=4), Layout.build(w, Plan(cp=4)), prof).timeline.moments}
    assert "qkv.a2a" in ops and "kv.gather" not in ops


def test_repeat_kv_moves_kv_at_the_query_heads():
    """TorchTitan's repeat_kv before CP: the gather moves n_heads / n_kv_heads times the bytes."""
    model = load_model("llama3.1-8b")
    w, plan = ar(32768), Plan(cp=4)
    a = model.layers[0]
    plain = timeline(model, w, plan, profile_with(cp=({"split": "steps"}, {"split": "steps"})))[0]
    query = timeline(model, w, plan, profile_with(cp=({"split": "steps", "kv_heads": "query"},
                                                      {"split": "steps", "kv_heads": "query"})))[0]
    g0 = plain.ops[op_index(plain, "kv.gather")].work.bytes
    g1 = query.ops[op_index(query, "kv.gather")].work.bytes
    assert np.allclose(np.array(g1) / np.array(g0), a.n_heads / a.n_kv_heads, rtol=1e-12)
    assert "kv.repeat_kv" in {op.name for op in query.ops}


# ---- FLOPs ----------------------------------------------------------------------------------


def test_ar_step_flops_are_about_half_of_bd3lms():
    """At the same L, AR runs L tokens through every GEMM (BD3-LM 2L) and L(L+1)/2 attention
    pairs per head (BD3-LM L^2 + Lb), with the same LM head over L loss rows. So without the
    head, AR / BD3-LM = (1 + 1/L) / (2 (1 + b/L)) for the attention and 1/2 for the GEMMs:
    within b/L of 1/2."""
    model = load_model("llama3.1-8b")
    L, b = 32768, 256
    lay_ar = Layout.build(ar(L), Plan())
    bd = Workload(seq_len=L, block_size=b)
    lay_bd = Layout.build(bd, Plan())
    g_ar = StepGraph.build(model, ar(L), Plan(), lay_ar, 8, implementation="ideal")
    g_bd = StepGraph.build(model, bd, Plan(), lay_bd, 8, implementation="ideal")
    head = 3 * 2 * L * model.hidden * model.vocab  # forward + backward of the head over L rows
    ratio = (g_ar.model_flops - head) / (g_bd.model_flops - head)
    assert abs(ratio - 0.5) <= 0.5 * b / L
    assert g_ar.model_flops < 0.6 * g_bd.model_flops
    # the step graph executes the same math (dp, no recompute counted, a loss that does not
    # recompute its logits: ideal's chunked rule): the formulas agree to float rounding of sums
    # over layers (1e-9 relative)
    assert g_ar.flops(include_recompute=False).sum() == pytest.approx(g_ar.model_flops, rel=1e-9)


# ---- commands ---------------------------------------------------------------------------------


def test_ar_refuses_an_explicit_block_size_in_one_line():
    import argparse

    from csbp.simulator.commands.cli_args import add_workload_args, inputs_from_args

    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    ok = inputs_from_args(parser.parse_args(["--model", "tiny", "--seq-len", "4k", "--objective", "ar"]))
    assert ok.workload.block_size == 1 and ok.workload.objective == "ar"
    with pytest.raises(InputError, match="objective ar has no blocks"):
        inputs_from_args(parser.parse_args(["--model", "tiny", "--seq-len", "4k", "--objective", "ar",
                                            "--block-size", "256"]))


def test_map_compares_objectives_cell_by_cell():
    """`csbp map --objectives ar,bd3lm`: each cell planned once per objective, side by side. AR
    does about half of BD3-LM's work per context token (test above), so its best plan's tokens/s
    is higher at every cell."""
    from csbp.simulator.grids.decision_map import objective_table
    from csbp.simulator.grids.grid import cells, search_cells

    profile = load_profile("h200")
    grid = cells(["tiny"], ["4k", "8k"], ["8"], profile, objectives=["ar", "bd3lm"])
    assert [(c.objective, c.seq_len) for c in grid] == [("ar", 4096), ("ar", 8192), ("bd3lm", 4096), ("bd3lm", 8192)]
    df = objective_table(search_cells(grid, profile, engine="closed-form", jobs=1), profile.name)
    assert list(df.objective) == ["ar", "ar", "bd3lm", "bd3lm"] and df.feasible.all()
    assert (df[df.objective == "ar"].vs_first == 1.0).all()
    assert (df[df.objective == "bd3lm"].vs_first < 1.0).all()
    assert not df[df.objective == "ar"].plan.str.contains("bp=").any()


def test_plan_for_ar_compares_no_implementations_over_a_bp_baseline():
    """Objective ar has no BP plans: the speedup over the best plan without BP says nothing, so
    csbp plan runs no other profile's baseline search and reports an empty comparison."""
    from csbp.simulator.planner.method_vs_implementation import bp_applies, reading, speedup_by_implementation
    from csbp.simulator.workload.workload import Workload

    assert not bp_applies(Workload(seq_len=4096, block_size=1, objective="ar"))
    assert bp_applies(Workload(seq_len=4096))
    assert "does not apply" in reading({})
    import csbp

    planned = csbp.plan(model="tiny", objective="ar", seq_len="4k", hardware="h200", nodes=1)
    assert planned.by_implementation == {}
    assert speedup_by_implementation(planned.found) == {}
