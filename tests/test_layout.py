"""Invariants of the layout (the single source of truth the runtime executes)."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from csbp.simulator.layout import mask
from csbp.simulator.errors import InputError
from csbp.simulator.layout.layout import Layout, assign_blocks, attention_bytes_received
from csbp.simulator.plan.plan import Plan, parse_plan
from csbp.simulator.layout.spans import normalize, size
from csbp.simulator.workload.spec import AttentionSpec
from csbp.simulator.workload.workload import Workload

FULL = AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=8)


def sliding(w: int) -> AttentionSpec:
    return AttentionSpec(kind="sliding", n_heads=4, n_kv_heads=2, head_dim=8, window=w)


@st.composite
def layouts(draw, kinds=("cp", "bp", "csbp", "dp")):
    block = draw(st.sampled_from([1, 2, 3, 4, 8]))
    kind = draw(st.sampled_from(kinds))
    cp = draw(st.integers(2, 4)) if kind in ("cp", "csbp") else 1
    bp = cp * draw(st.integers(1, 3)) if kind == "csbp" else (draw(st.integers(2, 5)) if kind == "bp" else 1)
    n_blocks = draw(st.integers(max(bp, 1), 14))
    L = n_blocks * block
    assume(L % (2 * cp) == 0 if kind == "csbp" else L % cp == 0)
    plan = Plan(cp=cp, bp=bp, dp=2 if kind == "dp" else 1,
                transport=draw(st.sampled_from(["collective", "ring"])),
                schedule=draw(st.sampled_from(["dual-end", "contiguous"])))
    return Layout.build(Workload(seq_len=L, block_size=block), plan)


def mask_pairs(L: int, b: int, window=None) -> set:
    pos = np.arange(2 * L)
    vis = mask.visible(pos[:, None], pos[None, :], L, b, window)
    return {(int(q), int(k)) for q, k in zip(*np.nonzero(vis))}


@settings(max_examples=60, deadline=None)
@given(layouts(), st.sampled_from([None, 1, 3, 8]))
def test_every_mask_pair_computed_exactly_once(lay, window):
    """Noisy queries are computed once overall; clean ones once per clean replica."""
    L, b = lay.seq_len, lay.block
    expected = mask_pairs(L, b, window)
    counts = Counter()
    for r in range(lay.size):
        counts.update(lay.computed_pairs(r, window))
    noisy = {p for p in expected if p[0] < L}
    assert {p for p in counts if p[0] < L} == noisy
    assert all(counts[p] == 1 for p in noisy)
    if lay.kind in ("cp", "csbp", "dp"):
        clean = expected - noisy
        assert {p for p in counts if p[0] >= L} == clean
        assert all(counts[p] == lay.plan.replicas for p in clean)
    # the closed-form pair count equals the explicit one
    for r in range(lay.size):
        assert lay.pairs(r, window) == len(lay.computed_pairs(r, window))


@settings(max_examples=60, deadline=None)
@given(layouts(kinds=("cp", "csbp")))
def test_each_clean_kv_row_has_one_owner_per_group(lay):
    L = lay.seq_len
    for group in lay.cp_groups():
        owners = Counter()
        for r in group:
            for a, z in lay.shares[r].owned_kv:
                owners.update(p for p in range(a, z) if p >= L)
        assert set(owners) == set(range(L, 2 * L))
        assert set(owners.values()) == {1}


@settings(max_examples=60, deadline=None)
@given(layouts(kinds=("bp", "csbp")))
def test_noisy_blocks_partition_all_blocks(lay):
    owned = [b for s in lay.shares for b in s.noisy_blocks]
    assert sorted(owned) == list(range(lay.seq_len // lay.block))
    assert all(s.noisy_blocks for s in lay.shares)


@settings(max_examples=80, deadline=None)
@given(layouts(), st.sampled_from([None, 2, 5]))
def test_every_needed_kv_row_is_local_or_received(lay, window):
    layer = FULL if window is None else sliding(window)
    fwd = lay.exchange(layer, "forward")
    for r in range(lay.size):
        got = [row for st_ in fwd.steps for t in st_.transfers if t.dst == r and t.payload == "kv"
               for row in t.rows]
        available = normalize(list(lay.shares[r].positions) + got)
        need = lay.needed_kv(r, window)
        assert size(normalize(list(need) + list(available))) == size(available)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from([1, 2, 4]),
       st.sampled_from(["collective", "ring"]), st.sampled_from(["full", "none"]))
def test_csbp_moves_exactly_half_of_cp(cp_half, blocks_per, block, transport, ckpt):
    cp = 2 * cp_half if cp_half > 1 else 2
    L = 2 * cp * blocks_per * block
    w = Workload(seq_len=L, block_size=block, checkpointing=ckpt)
    cp_bytes = attention_bytes_received(Layout.build(w, Plan(cp=cp, transport=transport)), (FULL,), 2)
    csbp_bytes = attention_bytes_received(Layout.build(w, Plan(cp=cp, bp=cp, transport=transport)), (FULL,), 2)
    assert max(cp_bytes) == 2 * max(csbp_bytes) > 0


def test_backward_returns_gradients_to_owners():
    lay = Layout.build(Workload(seq_len=64, block_size=4), Plan(cp=4, bp=4))
    fwd, bwd = lay.exchange(FULL, "forward"), lay.exchange(FULL, "backward")
    for r in range(4):
        assert bwd.rows_received(r, "dkv") == fwd.rows_sent(r, "kv") == 3 * 16


def test_ring_backward_carries_kv_and_dkv_for_p_minus_one_hops():
    lay = Layout.build(Workload(seq_len=64, block_size=4), Plan(cp=4, transport="ring"))
    bwd = lay.exchange(FULL, "backward")
    for r in range(4):
        assert bwd.rows_received(r, "kv") == bwd.rows_received(r, "dkv") == 3 * 32


def test_recompute_exchange_only_with_checkpointing():
    plan = Plan(cp=2, bp=2)
    assert Layout.build(Workload(seq_len=32, block_size=4), plan).exchange(FULL, "recompute").steps
    lay = Layout.build(Workload(seq_len=32, block_size=4, checkpointing="none"), plan)
    assert lay.exchange(FULL, "recompute").pattern == "none"


def test_sliding_window_csbp_ships_only_visible_rows():
    w = Workload(seq_len=1024, block_size=16)
    lay = Layout.build(w, Plan(cp=4, bp=4))
    full = max(lay.rows_received(r, FULL) for r in range(4))
    narrow = max(lay.rows_received(r, sliding(16)) for r in range(4))
    assert 0 < narrow < full / 2
    # CP ships whole shards whatever the window
    cp = Layout.build(w, Plan(cp=4))
    assert cp.rows_received(0, sliding(16)) == cp.rows_received(0, FULL)


def test_total_pairs_formula():
    for L, b in [(16, 4), (24, 8), (9, 3)]:
        assert len(mask_pairs(L, b)) == mask.total_pairs(L, b)


@pytest.mark.parametrize("n_blocks,n_ranks", [(1024, 8), (33, 4), (7, 4), (5, 5), (16, 16)])
def test_dual_end_balances_load(n_blocks, n_ranks):
    owned = assign_blocks(n_blocks, n_ranks, "dual-end")
    loads = [sum(b + 1 for b in o) for o in owned]
    heaviest_block = n_blocks
    assert max(loads) - min(loads) <= heaviest_block
    contiguous = [sum(b + 1 for b in o) for o in assign_blocks(n_blocks, n_ranks, "contiguous")]
    assert max(loads) <= max(contiguous)


@pytest.mark.parametrize("text,rule", [
    ("cp=4,bp=2", "bp >= cp"),
    ("cp=4,bp=6", "bp % cp == 0"),
    ("cp=x", "not an integer"),
    ("zz=2", "bad plan term"),
    ("cp=0", ">= 1"),
])
def test_plan_rules_named(text, rule):
    with pytest.raises(InputError, match=rule.replace("%", "%").replace("*", r"\*")):
        parse_plan(text)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=8))
def test_normalize_is_the_same_for_a_tuple_a_list_and_a_generator(spans):
    """A tuple of spans is normalised once and kept (`spans._normalized`): whatever container
    holds the spans, and however often it is asked, the answer is the same (integers: exact)."""
    expected = normalize(list(spans))
    assert normalize(tuple(spans)) == expected
    assert normalize(tuple(spans)) == expected  # the kept answer
    assert normalize(s for s in spans) == expected
    assert normalize(tuple(list(s) for s in spans)) == expected  # unhashable parts: not kept
    assert all(a < b for a, b in expected) and all(b < c for (_, b), (c, _) in zip(expected, expected[1:]))
