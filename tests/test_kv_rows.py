"""Per-rank K/V row counts from the shares alone equal the counts of the layout's own exchanges."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from csbp.simulator.layout import kv_rows, mask, pairs
from csbp.simulator.layout.layout import Layout
from csbp.simulator.layout.objective_layout import AnchorLayout
from csbp.simulator.layout.pairs import QueryIntervals
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import AttentionSpec

from test_layout import FULL, layouts, sliding

LINEAR = AttentionSpec(kind="linear", n_heads=4, n_kv_heads=2, head_dim=8)


def from_exchange(lay: Layout, a: AttentionSpec, phase: str) -> list[int]:
    ex = lay.exchange(a, phase)
    return [ex.rows_received(r) for r in range(lay.size)]


@settings(max_examples=80, deadline=None)
@given(layouts(), st.sampled_from([FULL, LINEAR, sliding(1), sliding(3), sliding(8)]),
       st.sampled_from(["full", "none"]))
def test_rows_received_equal_the_exchanges(lay, a, ckpt):
    lay = Layout(lay.seq_len, lay.block, lay.plan, ckpt)
    for phase in kv_rows.PHASES:
        assert kv_rows.pattern(lay, a, phase) == lay.exchange(a, phase).pattern
        assert kv_rows.received(lay, a, phase).tolist() == from_exchange(lay, a, phase)
        ex = lay.exchange(a, phase)
        for step, moves in enumerate(ex.steps):
            for payload in (None, "kv", "dkv"):
                want = [sum(t.n_rows for t in moves.transfers if t.dst == r and payload in (None, t.payload))
                        for r in range(lay.size)]
                assert kv_rows.step_received(lay, a, phase, step, payload).tolist() == want
            if ex.pattern == "ring":
                senders = {t.dst: t.src for t in moves.transfers}
                assert kv_rows.ring_senders(lay) == tuple(senders.get(r, r) for r in range(lay.size))
    ex = lay.exchange(a, "forward")
    per_step = [[sum(t.n_rows for t in s.transfers if t.dst == r) for s in ex.steps] for r in range(lay.size)]
    if ex.pattern == "ring":
        assert kv_rows.held_at_once(lay, a).tolist() == [max(s, default=0) for s in per_step]
    if ex.pattern in ("all-gather", "all-to-all"):
        sent = [ex.rows_sent(r) for r in range(lay.size)]
        groups = {r: len(g) for g in ex.groups for r in g}
        if ex.pattern == "all-gather":  # one buffer for every member
            sent = [s // max(groups[r] - 1, 1) for r, s in enumerate(sent)]
        assert kv_rows.packed_rows(lay, a).tolist() == sent


def test_drafter_rows_equal_the_exchanges():
    for plan in (Plan(cp=4), Plan(cp=2, bp=4), Plan(cp=2, bp=4, transport="ring"), Plan(bp=4)):
        lay = AnchorLayout(64, 4, plan, "full", anchors=6)
        for a in (FULL, sliding(5)):
            for phase in kv_rows.PHASES:
                assert kv_rows.received(lay, a, phase).tolist() == from_exchange(lay, a, phase)


@settings(max_examples=60, deadline=None)
@given(layouts(), st.sampled_from([None, 1, 3, 8]))
def test_pairs_with_each_shard_count_the_mask(lay, window):
    """Prefix-sum pair counts against every shard equal counting each shard on its own."""
    shards = [s.owned_kv for s in lay.shares] + [((0, 2 * lay.seq_len),), ()]
    for r in range(lay.size):
        q = QueryIntervals.of(lay, r, window)
        each = q.pairs_with_each(shards)
        keys = np.arange(2 * lay.seq_len)
        pos = mask.span_positions(lay.shares[r].positions)
        vis = mask.visible(pos[:, None], keys[None, :], lay.seq_len, lay.block, window)
        for j, shard in enumerate(shards):
            inside = np.zeros(keys.size, dtype=bool)
            for s, e in shard:
                inside[s:e] = True
            assert each[j] == q.pairs_with(shard) == int(vis[:, inside].sum())
        assert q.total() == int(vis.sum()) == pairs.totals(lay, window)[r]


def _alltoall_rows_span_by_span(lay: Layout, window: int) -> np.ndarray:
    """The count before issue 25's arrays: each reader's needed spans less its own shard,
    intersected with every member's shard."""
    from csbp.simulator.layout.spans import normalize, subtract
    rows = np.zeros((lay.size, lay.size), dtype=np.int64)
    for g in lay.cp_groups():
        for dst in g:
            need = subtract(lay.needed_kv(dst, window), lay.shares[dst].owned_kv)
            for src in g:
                if src != dst:
                    rows[dst, src] = sum(max(0, min(e, z) - max(s, a)) for s, e in need
                                         for a, z in normalize(lay.shares[src].owned_kv))
    return rows


def test_windowed_alltoall_rows_equal_the_span_by_span_count():
    """`kv_rows._group_rows` (every member of a group at once, issue 25) on layouts as the
    planner meets them: blocks not dividing the tile, windows below, at and above the block,
    schedules, and a drafter's anchor layout; exact integers."""
    from csbp.simulator.workload.workload import Workload
    cases = []
    for cp, bp, schedule in ((2, 4, "dual-end"), (4, 16, "dual-end"), (8, 32, "contiguous"), (2, 8, "contiguous")):
        for seq_len, block in ((16384, 256), (6400, 100)):
            cases.append(Layout.build(Workload(seq_len=seq_len, block_size=block),
                                      Plan(cp=cp, bp=bp, schedule=schedule)))
    cases += [AnchorLayout(256, 8, Plan(cp=2, bp=4), "full", anchors=6),
              AnchorLayout(256, 8, Plan(cp=4, bp=8), "full", anchors=10)]
    for lay in cases:
        for window in (1, 3, 50, 100, 256, 1024, 40000):
            lay.derived.pop(("kv-rows-alltoall", window), None)
            assert (kv_rows._alltoall_rows(lay, window) == _alltoall_rows_span_by_span(lay, window)).all()
