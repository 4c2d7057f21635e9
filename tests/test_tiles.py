"""Kernel-tile counts in closed form (simulator/layout/tiles.py, issue 25) are exactly the counts
the per-position reduction gives: the reference below is that code as it was (commit 7caf68f),
kept verbatim. Integers against integers: exact equality, on random and real layouts. The dense
mask check (tests/test_implementation.py) holds both to the definition."""

from __future__ import annotations

import random

import numpy as np

from csbp.simulator.layout import mask
from csbp.simulator.layout.layout import Layout
from csbp.simulator.layout.spans import normalize
from csbp.simulator.layout.tiles import _KeyTiles, _by_position, tile_counts, clear_caches
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.workload import Workload


# ---- the reference: tiles.tile_counts before the closed form, verbatim ------------------------

def _tile_counts_reference(queries, keys, seq_len, block, window, q_rows, k_tile):
    if not keys:
        return 0, 0
    counter = _KeyTiles(normalize(keys), 2 * seq_len, k_tile)
    touched = full = 0
    for q, at in _query_tiles(queries, seq_len, q_rows):
        for (some_a, some_z), (every_a, every_z) in _tile_runs(q, at, seq_len, block, window):
            touched += int(counter.touched(some_a, some_z).sum())
            full += int(counter.full(every_a, every_z).sum())
    return full, touched - full


def _query_tiles(queries, seq_len, q_rows):
    for lo, hi in ((0, seq_len), (seq_len, 2 * seq_len)):
        side = tuple((max(a, lo), min(z, hi)) for a, z in queries if min(z, hi) > max(a, lo))
        if side:
            q = mask.span_positions(side)
            yield q, np.arange(0, q.size, q_rows)


def _tile_runs(q, at, seq_len, block, window):
    last = np.append(at[1:], q.size) - 1
    first_q, last_q = q[at], q[last]
    if window is None and (last_q - first_q == last - at).all():
        own_f, pre_f = mask.visible_intervals(first_q, seq_len, block, window)
        own_l, pre_l = mask.visible_intervals(last_q, seq_len, block, window)
        return [((f[0], l[1]), (l[0], f[1])) for f, l in ((own_f, own_l), (pre_f, pre_l))]
    out = []
    big = np.iinfo(np.int64).max
    for a, z in mask.visible_intervals(q, seq_len, block, window):
        empty = z <= a
        some_a = np.minimum.reduceat(np.where(empty, big, a), at)
        some_z = np.maximum.reduceat(np.where(empty, -1, z), at)
        every_a = np.maximum.reduceat(a, at)
        every_z = np.minimum.reduceat(z, at)
        none = some_z < 0
        out.append(((np.where(none, 0, some_a), np.where(none, 0, some_z)), (every_a, every_z)))
    return out


# ---- cases --------------------------------------------------------------------------------------

def _random_spans(rng, length, k):
    cuts = sorted(rng.sample(range(length + 1), min(2 * k, length + 1)))
    out = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
    if rng.random() < 0.3 and out:  # touching spans, as packed buffers of neighbouring blocks give
        a, z = out[-1]
        out.append((z, min(z + rng.randint(1, 5), length)))
    return tuple(s for s in out if s[1] > s[0])


def _random_case(rng):
    """A layout's sequence is whole blocks (`Workload`); spans cross L, touch, are one position
    long; windows below, at and above the block (W = 1 included); any query rows and key tile."""
    block = rng.choice([1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 100, 128, 256])
    seq_len = block * rng.randint(1, 30)
    window = rng.choice([None, None, 1, 2, 3, max(block - 1, 1), block, block + 1,
                         rng.randint(1, 2 * seq_len), 2 * seq_len + 5])
    q_rows = rng.choice([1, 2, 3, 7, 8, 16, 21, 32, 42, 64, 128, rng.randint(1, 300)])
    k_tile = rng.choice([1, 2, 7, 16, 64, 128, rng.randint(1, 200)])
    queries = _random_spans(rng, 2 * seq_len, rng.randint(1, 12)) or ((0, 1),)
    keys = rng.choice([((0, 2 * seq_len),), _random_spans(rng, 2 * seq_len, rng.randint(1, 12)),
                       ((seq_len, 2 * seq_len),), queries])
    return queries, keys, seq_len, block, window, q_rows, k_tile


def _layout_cases(rng, limit):
    """Calls as the step graph makes them: every rank's positions over all keys, over the clean
    prefix, over its own positions, and its noisy blocks over themselves, on real layouts."""
    out = []
    for cp in (1, 2, 4, 8, 16):
        for bp in (1, 2, 4, 8, 16, 32):
            for schedule in (("dual-end",) if bp == 1 else ("dual-end", "contiguous")):
                for seq_len, block, objective in ((16384, 256, "bd3lm"), (12288, 192, "bd3lm"),
                                                  (16384, 256, "dflash2"), (6400, 100, "bd3lm")):
                    try:
                        lay = Layout.build(Workload(seq_len=seq_len, block_size=block, objective=objective),
                                           Plan(cp=cp, bp=bp, schedule=schedule))
                    except Exception:  # a plan the method's rules refuse
                        continue
                    L2 = 2 * seq_len
                    for r in rng.sample(range(lay.size), min(2, lay.size)):
                        pos = lay.shares[r].positions
                        noisy = tuple((a, min(z, seq_len)) for a, z in pos if a < seq_len)
                        calls = [(pos, ((0, L2),)), (pos, ((seq_len, L2),)), (pos, pos)]
                        if noisy:
                            calls.append((noisy, noisy))
                        for q, k in calls:
                            out.append((q, k, seq_len, block, rng.choice([None, 1024, 100, 256, 4096]),
                                        rng.choice([128, 64, 42, 21, 16, 8]), 128))
    rng.shuffle(out)
    return out[:limit]


def _same(cases):
    for case in cases:
        clear_caches()
        want = _tile_counts_reference(*case)
        assert tile_counts(*case) == tuple(int(x) for x in want), case[2:]


def test_closed_form_equals_the_per_position_counts_on_random_layouts():
    rng = random.Random(25)
    _same([_random_case(rng) for _ in range(800)])


def test_closed_form_equals_the_per_position_counts_on_real_layouts():
    _same(_layout_cases(random.Random(26), 300))


def test_cached_calls_return_the_same_counts():
    rng = random.Random(27)
    cases = [_random_case(rng) for _ in range(50)]
    first = [tile_counts(*c) for c in cases]
    assert [tile_counts(*c) for c in cases] == first  # now from the caches


def test_spans_out_of_order_take_the_per_position_path():
    """Query spans out of buffer order break the ends' monotonicity: counted by position."""
    rng = random.Random(28)
    for _ in range(100):
        q, k, L, b, w, qr, kt = _random_case(rng)
        if len(q) < 2:
            continue
        shuffled = tuple(reversed(q))
        clear_caches()
        want = _tile_counts_reference(shuffled, k, L, b, w, qr, kt)
        assert tile_counts(shuffled, k, L, b, w, qr, kt) == _by_position(shuffled, normalize(k), L, b, w, qr, kt) \
            == tuple(int(x) for x in want)


def test_calls_counted_at_once_equal_the_calls_one_by_one():
    """`tile_counts_each` lays several calls side by side in one pass (issue 25): each call's
    counts are those `tile_counts` gives it alone, keys empty, queries out of order (counted
    by position) and calls of real layouts' ranks included."""
    from csbp.simulator.layout.tiles import tile_counts_each
    rng = random.Random(29)
    for _ in range(200):
        _, _, L, b, w, qr, kt = _random_case(rng)
        calls = []
        for _ in range(rng.randint(1, 7)):
            q = _random_spans(rng, 2 * L, rng.randint(1, 12)) or ((0, 1),)
            k = rng.choice([((0, 2 * L),), _random_spans(rng, 2 * L, rng.randint(1, 12)), ((L, 2 * L),), q, ()])
            calls.append((tuple(reversed(q)) if rng.random() < 0.1 else q, k))
        assert tile_counts_each(calls, L, b, w, qr, kt) == [tile_counts(q, k, L, b, w, qr, kt) for q, k in calls]
        # every call's keys one span (counted by arithmetic per call, `_OneSpanEach`)
        spans = [(0, 2 * L), (L, 2 * L), (0, L)] + [s for s in _random_spans(rng, 2 * L, 3)]
        calls = [(q, (rng.choice(spans),)) for q, _ in calls]
        assert tile_counts_each(calls, L, b, w, qr, kt) == [tile_counts(q, k, L, b, w, qr, kt) for q, k in calls]
    by_params: dict[tuple, list] = {}
    for case in _layout_cases(random.Random(30), 300):
        by_params.setdefault(case[2:], []).append(case[:2])
    for params, calls in by_params.items():
        assert tile_counts_each(calls, *params) == [tile_counts(q, k, *params) for q, k in calls]
