"""Pair counts under a window by runs (simulator/layout/pairs.py `_WindowRuns`, issue 25) are
exactly the per-position counts: the reference below is QueryIntervals' windowed path as it was
(commit 7caf68f), one interval pair per query position. Integers against integers: exact
equality, on random spans and real layouts (tests/test_kv_rows.py holds both to the dense mask)."""

from __future__ import annotations

import random

import numpy as np

from csbp.simulator.layout import mask
from csbp.simulator.layout.layout import Layout
from csbp.simulator.layout.pairs import QueryIntervals
from csbp.simulator.layout.spans import normalize
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.workload import Workload


class _Reference:
    """QueryIntervals with a window before the runs: every query position's intervals."""

    def __init__(self, queries, seq_len, block, window):
        q = mask.span_positions(queries)
        self.weight = np.ones(q.size, dtype=np.int64)
        self.intervals = mask.visible_intervals(q, seq_len, block, window)

    def total(self):
        return int(sum(((z - a) * self.weight).sum() for a, z in self.intervals))

    def below(self, x):
        a = np.concatenate([lo for lo, _ in self.intervals])
        z = np.concatenate([hi for _, hi in self.intervals])
        w = np.concatenate([self.weight] * len(self.intervals))
        seen = z > a
        x = np.asarray(x, dtype=np.int64)
        ramp = lambda ends, wt: np.array([(wt * np.maximum(v - ends, 0)).sum() for v in x.ravel()],  # noqa: E731
                                         dtype=np.int64).reshape(x.shape)
        return ramp(a[seen], w[seen]) - ramp(z[seen], w[seen])

    def pairs_with(self, keys):
        keys = normalize(keys)
        if not keys or self.weight.size == 0:
            return 0
        starts, stops = np.array(keys, dtype=np.int64).T
        before = np.concatenate([[0], np.cumsum(stops - starts)])

        def keys_below(x):
            k = np.searchsorted(starts, x, side="right")
            last = np.maximum(k - 1, 0)
            return np.where(k > 0, before[last] + np.minimum(x - starts[last], stops[last] - starts[last]), 0)

        return int(sum(((keys_below(z) - keys_below(a)) * self.weight).sum() for a, z in self.intervals))


def _spans(rng, length, k):
    cuts = sorted(rng.sample(range(length + 1), min(2 * k, length + 1)))
    return tuple((a, z) for a, z in zip(cuts[::2], cuts[1::2]) if z > a)


def _check(queries, L, b, w, key_sets):
    new, ref = QueryIntervals(queries, L, b, w), _Reference(queries, L, b, w)
    assert new.total() == ref.total()
    for keys in key_sets:
        assert new.pairs_with(keys) == ref.pairs_with(keys), (queries, L, b, w, keys)
    x = np.array(sorted({v for keys in key_sets for s in normalize(keys) for v in s} | {0, 2 * L}))
    assert new.below(x).tolist() == ref.below(x).tolist()


def test_window_runs_equal_the_per_position_counts_on_random_spans():
    rng = random.Random(25)
    for _ in range(400):
        b = rng.choice([1, 2, 3, 4, 8, 16, 17, 64, 100, 256])
        L = b * rng.randint(1, 20)
        w = rng.choice([1, 2, 3, max(b - 1, 1), b, b + 1, rng.randint(1, 2 * L), 2 * L + 5])
        queries = _spans(rng, 2 * L, rng.randint(1, 10)) or ((0, 1),)
        key_sets = [((0, 2 * L),), ((L, 2 * L),), queries, _spans(rng, 2 * L, rng.randint(1, 8)), ()]
        _check(queries, L, b, w, key_sets)


def test_window_runs_cut_each_stream_at_its_own_block_edges():
    """A sequence that is not whole blocks (no `Workload` makes one) puts the clean stream's
    block edges off the noisy stream's grid: the runs are cut at each stream's own edges."""
    rng = random.Random(27)
    for _ in range(100):
        b = rng.choice([3, 4, 8, 16])
        L = b * rng.randint(1, 10) + rng.randint(1, b - 1)
        w = rng.choice([1, 2, b - 1, b, b + 1, 2 * L + 5])
        queries = _spans(rng, 2 * L, rng.randint(1, 6)) or ((0, 1),)
        _check(queries, L, b, w, [((0, 2 * L),), queries, _spans(rng, 2 * L, 4)])


def test_window_runs_equal_the_per_position_counts_on_real_layouts():
    rng = random.Random(26)
    for cp, bp, schedule in ((4, 1, "dual-end"), (2, 8, "dual-end"), (8, 8, "contiguous"), (1, 16, "dual-end")):
        lay = Layout.build(Workload(seq_len=8192, block_size=256), Plan(cp=cp, bp=bp, schedule=schedule))
        shards = [s.owned_kv for s in lay.shares]
        for r in rng.sample(range(lay.size), min(3, lay.size)):
            for w in (100, 256, 1024, 4096):
                _check(lay.shares[r].positions, lay.seq_len, lay.block, w, shards + [((0, 2 * lay.seq_len),)])


def test_pairs_with_every_rank_at_once_equal_rank_by_rank():
    """`pairs.pairs_with_ranks` (every rank's queries and keys at once, issue 25) counts what
    `QueryIntervals.pairs_with` counts rank by rank, with and without a window, on random
    layouts (DP, CP, BP, CSBP, a drafter's anchors) and key sets (a rank's own rows, its noisy
    blocks, everything, nothing). Exact: integer counts either way."""
    from csbp.simulator.layout.objective_layout import AnchorLayout
    from csbp.simulator.layout.pairs import pairs_with_ranks

    rng = random.Random(25)
    checked = 0
    while checked < 120:
        b = rng.choice([1, 3, 8, 16, 100]); blocks = rng.choice([4, 8, 16, 64]); L = b * blocks
        cp = rng.choice([1, 2, 4]); bp = rng.choice([1, 2, 4]) * cp
        if bp > blocks or L % (2 * cp):
            continue
        plan = Plan(cp=cp, bp=bp, schedule=rng.choice(["dual-end", "contiguous"])) if bp > 1 else \
            Plan(cp=cp) if cp > 1 else Plan()
        if rng.random() < 0.8:
            lay = Layout(L, b, plan)
        else:
            lay = AnchorLayout(L, b, plan, "full", anchors=max(1, blocks // 3), window=rng.choice([None, 3 * b]))
        window = rng.choice([None, 1, b, b + 1, rng.randint(1, 2 * L)])
        keys = [normalize(rng.choice([s.positions + s.owned_kv, s.owned_kv, ((0, 2 * L),), (),
                                      tuple(p for p in s.positions if p[0] < L)])) for s in lay.shares]
        one_by_one = [QueryIntervals.of(lay, r, window).pairs_with(keys[r]) for r in range(lay.size)]
        assert pairs_with_ranks(lay, keys, window).tolist() == one_by_one
        checked += 1
