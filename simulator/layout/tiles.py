"""Kernel tiles of one attention call: what a block-sparse kernel really computes.

FlashAttention-class kernels (FA3/FA4 block-sparse, FlexAttention with a BlockMask) cut the
queries x keys rectangle into tiles (128 x 128 here, `graph.ATTENTION_KERNEL_TILE`): a tile no
pair of the mask reaches is skipped, a tile whose every pair is visible is computed plainly, and a
partial tile costs a whole tile plus the mask applied to it (implementation.md 1, 6). So a call's
work is its tiles, not its pairs: small blocks, windows and GQA without packing waste work that
pair counts do not see.

Counting uses the mask's structure (`mask.visible_intervals`): every query sees at most two runs of
keys whose ends never move backwards as the query moves forward. So the keys *some* query of a
query tile sees are the runs from its first query's start to its last query's end, and the keys
*every* query of the tile sees run from its last query's start to its first query's end; a key
tile is touched if the first set reaches it and full if the second covers it. Per query tile this
is a handful of prefix-sum reads, never the n^2 mask.

Closed form (issue 25): a tile's runs need only four of its queries, never the positions in
between. Take the queries of one side (noisy [0, L) or clean [L, 2L)) in buffer order, which
is increasing position order for every caller (spans sorted and disjoint; others take
`_by_position`). All four ends of the two runs `mask.visible_intervals` gives are then
non-decreasing in the position: own (max(s, i-W+1), min(s+b, i+W)) and prefix (L+max(0, i-W+1),
L+max(s, i-W+1)), with s = i - i mod b and W = 2L+1 without a window, as min/max of
non-decreasing functions are. Per tile, `every` = (max a, min z) over its queries = (a(last),
z(first)); `some` = (min a, max z) over the queries whose run is not empty = (a(first non-empty),
z(last non-empty)), or (0, 0) when none is. An own run is never empty (a query sees itself); a
noisy query's prefix is non-empty iff s >= b and i - s <= W - 2; a clean query's prefix is
always (0, 0). So per tile: its first and last query, and its first and last with a non-empty
prefix, found by searchsorted over the side's span lengths and over the non-empty pieces
([b, L) when W - 1 >= b, else [kb, kb + W - 1) per block k >= 1). Key tiles are counted by
`_KeyTiles`' prefix sums, or by arithmetic when the keys are one span (`_OneSpan`). Cost per
call O(query tiles + spans), against O(query positions) reading every query; the result is the
same integers (tests/test_tiles.py holds it to the per-position code on random and real layouts).

Approximations [U]: key tiles are laid on logical positions (0..2L in steps of the tile), as they
are for a call over the whole sequence in logical order; a call over packed shards (received
rows, owner-major clean K/V) has its tile edges elsewhere, which moves a few tiles per shard
between full and partial. Query tiles run over the rank's packed query buffer (`_query_tiles`);
the keys some query of a tile sees are taken as one run from the first to the last seen, so a
tile in a gap between two blocks' runs counts as touched (`_tile_runs`).
"""

from __future__ import annotations

import functools

import numpy as np

from csbp.simulator.layout import mask
from csbp.simulator.layout.spans import Span, flat_spans, normalize


def tile_counts(queries: tuple[Span, ...], keys: tuple[Span, ...], seq_len: int, block: int,
                window: int | None, q_rows: int, k_tile: int) -> tuple[int, int]:
    """(full, partial) tiles of queries `queries` over the keys `keys` of one call, `q_rows`
    query positions per tile (fewer than the tile's rows when GQA heads are packed into it).

    Cached on the exact arguments: ranks of one ownership, and ownerships that share a rank's
    spans, ask for the same call again (a search meets the same call hundreds of times)."""
    return _tile_counts(tuple(queries), tuple(keys), seq_len, block, window, q_rows, k_tile)


@functools.lru_cache(maxsize=8192)
def _tile_counts(queries: tuple[Span, ...], keys: tuple[Span, ...], seq_len: int, block: int,
                 window: int | None, q_rows: int, k_tile: int) -> tuple[int, int]:
    if not keys:
        return 0, 0
    keys = normalize(keys)
    if not keys:
        return 0, 0
    counter = _OneSpan(keys[0], k_tile) if len(keys) == 1 else _key_tiles(keys, 2 * seq_len, k_tile)
    q = np.array(queries, dtype=np.int64).reshape(-1, 2)
    sides = []
    for noisy, (lo, hi) in ((True, (0, seq_len)), (False, (seq_len, 2 * seq_len))):
        starts, stops = np.maximum(q[:, 0], lo), np.minimum(q[:, 1], hi)
        keep = stops > starts
        starts, stops = starts[keep], stops[keep]
        if starts.size and (starts[1:] < stops[:-1]).any():  # out of order or overlapping
            return _by_position(queries, keys, seq_len, block, window, q_rows, k_tile)
        if starts.size:
            sides.append((starts, stops, noisy))
    touched = full = 0
    for starts, stops, noisy in sides:
        t, f = _side(starts, stops, noisy, counter, seq_len, block, window, q_rows)
        touched += t
        full += f
    return full, touched - full


# Query tiles above which a call is counted alone rather than beside others: laying calls side
# by side saves a few dozen array operations per call (~0.2 ms) and costs more per tile (key
# tiles by search, not by `_OneSpan`'s arithmetic). Measured (cProfile, tile counting per
# csbp.plan): at 1,024 DiffusionGemma 128 GPUs 1.80 -> 0.82 s, Qwen3.5 16 GPUs 0.19 -> 0.22 s
# (4,096: 0.32 s); both paths give the same counts, so this only moves time.
_ALONE = 1024


def tile_counts_each(calls: list[tuple[tuple[Span, ...], tuple[Span, ...]]], seq_len: int, block: int,
                     window: int | None, q_rows: int, k_tile: int) -> list[tuple[int, int]]:
    """`tile_counts` of several calls (queries, keys) at once, in one pass of array operations:
    each call's positions and keys are laid side by side at their own offset (a multiple of the
    key tile past 2L, so no tile straddles two calls), which leaves every interval's count the
    same. A step graph counts one call per rank of its group (issue 25: per-call array overhead
    was most of the cost). The same integers as `tile_counts` call by call (tests/test_tiles.py)."""
    n = len(calls)
    out: list[tuple[int, int] | None] = [(0, 0)] * n
    keys_of = [normalize(keys) if keys else () for _, keys in calls]
    has_keys = np.array([bool(k) for k in keys_of], dtype=bool)
    # every call's query spans at once, cut into the two sides (noisy [0, L), clean [L, 2L))
    call, qa, qz = flat_spans([q for q, _ in calls])
    sides, size, unordered = [], np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)
    for noisy, (lo, hi) in ((True, (0, seq_len)), (False, (seq_len, 2 * seq_len))):
        starts, stops = np.maximum(qa, lo), np.minimum(qz, hi)
        keep = stops > starts
        c, starts, stops = call[keep], starts[keep], stops[keep]
        # out of order or overlapping inside one call: counted call by call
        unordered[c[1:][(c[1:] == c[:-1]) & (starts[1:] < stops[:-1])]] = True
        np.add.at(size, c, stops - starts)
        sides.append((noisy, c, starts, stops))
    # out of order, or large enough that array work, not call overhead, is its cost: alone
    # (where one-span keys are counted by arithmetic, `_OneSpan`)
    alone = has_keys & (unordered | (size > _ALONE * q_rows))
    for j in np.flatnonzero(alone).tolist():
        out[j] = _tile_counts(tuple(calls[j][0]), tuple(calls[j][1]), seq_len, block, window, q_rows, k_tile)
    counted = has_keys & ~alone & (size > 0)
    if not counted.any():
        return out
    step = -(-2 * seq_len // k_tile) * k_tile  # each call's own stretch of key positions
    used = np.flatnonzero(counted)
    k_call, ka, kz = flat_spans([keys_of[j] for j in used.tolist()])
    shift = used[k_call] * step
    if ka.size == used.size:  # one key span per call (a call over every key, or the clean prefix)
        counter = _OneSpanEach(np.zeros(n, np.int64), np.zeros(n, np.int64), k_tile)
        counter.k0[used], counter.k1[used] = ka + shift, kz + shift
    else:
        counter = _SpanTiles(ka + shift, kz + shift, k_tile)
    touched = np.zeros(n, dtype=np.int64)
    full = np.zeros(n, dtype=np.int64)
    for noisy, c, starts, stops in sides:
        mine = counted[c]
        if mine.any():
            _sides_at_once(c[mine], starts[mine], stops[mine], noisy, counter, step, seq_len, block, window,
                           q_rows, touched, full)
    for j, f, t in zip(used.tolist(), full[used].tolist(), touched[used].tolist()):
        out[j] = (f, t - f)
    return out


def _sides_at_once(span_of: np.ndarray, starts: np.ndarray, stops: np.ndarray, noisy: bool,
                   counter: "_SpanTiles", step: int, seq_len: int, block: int, window: int | None,
                   q_rows: int, touched: np.ndarray, full: np.ndarray) -> None:
    """`_side` for one side of several calls at once (`span_of`: each span's call, ascending),
    adding each call's (touched, full) into `touched[j]`, `full[j]`. Buffer indices run on
    across calls (a tile never spans two: each call's tiles start at its own first query), and
    positions searched against the prefix pieces carry the call's offset, so no search crosses
    into another call's pieces."""
    new = np.concatenate(([True], span_of[1:] != span_of[:-1]))
    which = span_of[new]  # the calls, in order
    span_call = np.cumsum(new) - 1  # each span's call among them
    lens = stops - starts
    cum = np.concatenate(([0], np.cumsum(lens)))  # buffer index of each span's start
    n = np.bincount(span_call, weights=lens, minlength=which.size).astype(np.int64)
    base = np.concatenate(([0], np.cumsum(n)[:-1]))
    m = -(-n // q_rows)  # query tiles per call
    tile_call = np.repeat(np.arange(which.size), m)
    first_i = base[tile_call] + (np.arange(int(m.sum()), dtype=np.int64)
                                 - np.repeat(np.cumsum(m) - m, m)) * q_rows
    last_i = np.minimum(first_i + q_rows, (base + n)[tile_call]) - 1
    both = _positions(starts, cum, np.concatenate([first_i, last_i]))
    t = first_i.size
    first, last = both[:t], both[t:]
    ok = None
    if noisy:
        u, v, piece_span = _nonempty_prefix(starts, stops, seq_len, block, window, with_spans=True)
        if u.size:
            far = 2 * seq_len  # past every position: pieces and tiles of call c at c * far
            off_p, off_t = span_call[piece_span] * far, tile_call * far
            uo, vo, fo, lo = u + off_p, v + off_p, first + off_t, last + off_t
            j = np.searchsorted(vo, fo, side="right")  # first piece ending after `first`
            fne = np.maximum(uo[np.minimum(j, u.size - 1)], fo)
            ok = (j < u.size) & (fne <= lo)
            k = np.searchsorted(uo, lo, side="right") - 1  # last piece starting at or before `last`
            lne = np.minimum(vo[np.maximum(k, 0)] - 1, lo)
            both = np.concatenate([both, np.where(ok, fne - off_t, first), np.where(ok, lne - off_t, last)])
    (own_a, own_z), (pre_a, pre_z) = mask.visible_intervals(both, seq_len, block, window)
    shift = which[tile_call] * step  # each call's keys sit at its own offset
    some_a, some_z = own_a[:t] + shift, own_z[t:2 * t] + shift
    labels = tile_call
    if ok is not None:
        some_a = np.concatenate([some_a, np.where(ok, pre_a[2 * t:3 * t], 0) + shift])
        some_z = np.concatenate([some_z, np.where(ok, pre_z[3 * t:], 0) + shift])
        labels = np.concatenate([tile_call, tile_call])
    every_a = np.concatenate([own_a[t:2 * t], pre_a[t:2 * t]]) + np.concatenate([shift, shift])
    every_z = np.concatenate([own_z[:t], pre_z[:t]]) + np.concatenate([shift, shift])
    every = np.concatenate([tile_call, tile_call])
    np.add.at(touched, which, np.bincount(labels, weights=counter.at(which[labels]).touched(some_a, some_z),
                                          minlength=which.size).astype(np.int64))
    np.add.at(full, which, np.bincount(every, weights=counter.at(which[every]).full(every_a, every_z),
                                       minlength=which.size).astype(np.int64))


def _positions(starts: np.ndarray, cum: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Query positions of buffer indices: rows of the spans laid end to end, `cum` the buffer
    index of each span's start."""
    k = np.searchsorted(cum, index, side="right") - 1
    return starts[k] + (index - cum[k])


class _KeyCounts:
    """What `_KeyTiles` and `_SpanTiles` share: keys of the call below a position from its
    spans (`starts`, `stops`, `before`), and tiles touched or wholly the call's within an
    interval from how many tiles below an index hold any (`any_below`) or all (`all_below`)
    of their keys: the two differ only in how they keep those tile counts."""

    tile: int
    starts: np.ndarray
    stops: np.ndarray
    before: np.ndarray

    def any_below(self, k: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def all_below(self, k: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def below(self, x: np.ndarray) -> np.ndarray:
        """Keys of the call at positions < x."""
        i = np.searchsorted(self.starts, x, side="right")  # spans starting below x
        inside = np.where(i > 0, np.minimum(x, self.stops[np.maximum(i - 1, 0)]) - self.starts[np.maximum(i - 1, 0)], 0)
        return self.before[np.maximum(i - 1, 0)] * (i > 0) + np.maximum(inside, 0)

    def touched(self, a: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Tiles holding at least one key of the call in [a, z), per interval."""
        t = self.tile
        ok = z > a
        a, z = np.where(ok, a, 0), np.where(ok, z, 1)
        t0, t1 = a // t, (z - 1) // t
        one = t0 == t1
        head = (self.below(np.minimum(z, (t0 + 1) * t)) - self.below(a)) > 0
        tail = (self.below(z) - self.below(np.maximum(a, t1 * t))) > 0
        inner = np.where(t1 > t0 + 1, self.any_below(np.maximum(t1, t0 + 1)) - self.any_below(t0 + 1), 0)
        return np.where(ok, np.where(one, head, head.astype(int) + tail + inner), 0)

    def full(self, a: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Tiles lying wholly inside [a, z) whose keys all belong to the call."""
        t = self.tile
        lo, hi = -(-a // t), z // t
        return np.where(hi > lo, self.all_below(np.clip(hi, 0, None)) - self.all_below(lo), 0)


class _SpanTiles(_KeyCounts):
    """`_KeyTiles`' counts from the key spans alone, without an array over every tile: the
    tiles holding any key are the spans' tile ranges [s // t, ceil(e / t)) merged (neighbouring
    spans may share a tile), those holding only keys of the call the ranges [ceil(s / t), e // t)
    (disjoint: spans are normalised, so a gap lies between any two). Counting those below a
    tile index is one search. The partial last tile of 2L is never inside an interval that
    ends at or before 2L, so `full` never reads it. O(spans) to build, for any number of calls
    laid side by side (`tile_counts_each`)."""

    def __init__(self, starts: np.ndarray, stops: np.ndarray, tile: int) -> None:
        self.tile, self.starts, self.stops = tile, starts, stops
        self.before = np.concatenate([[0], np.cumsum(stops - starts)])
        t0, t1 = starts // tile, -(-stops // tile)
        new = np.concatenate([[True], t0[1:] >= t1[:-1]])  # no tile shared with the span before
        first = np.flatnonzero(new)
        self.any = _Runs(t0[first], np.maximum.reduceat(t1, first) if first.size else t1)
        f0, f1 = -(-starts // tile), stops // tile
        keep = f1 > f0
        self.all = _Runs(f0[keep], f1[keep])

    def at(self, calls: np.ndarray) -> "_SpanTiles":
        """The counter for intervals of these calls (`_OneSpanEach.at`): every call's keys here."""
        return self

    def any_below(self, k: np.ndarray) -> np.ndarray:
        return self.any.below(k)

    def all_below(self, k: np.ndarray) -> np.ndarray:
        return self.all.below(np.clip(k, 0, None))


class _Runs:
    """Sorted disjoint integer ranges [a, z): how many of their integers lie below x."""

    def __init__(self, a: np.ndarray, z: np.ndarray) -> None:
        self.a, self.z = a, z
        self.before = np.concatenate([[0], np.cumsum(z - a)])

    def below(self, x: np.ndarray) -> np.ndarray:
        if not self.a.size:
            return np.zeros(np.shape(x), dtype=np.int64)
        k = np.searchsorted(self.a, x, side="right") - 1
        kk = np.maximum(k, 0)
        inside = np.minimum(x, self.z[kk]) - self.a[kk]
        return np.where(k >= 0, self.before[kk] + np.maximum(inside, 0), 0)


@functools.lru_cache(maxsize=256)
def _key_tiles(keys: tuple[Span, ...], length: int, tile: int) -> "_KeyTiles":
    """The key-tile prefix sums of one key set, shared by every call over the same keys."""
    return _KeyTiles(keys, length, tile)


def clear_caches() -> None:
    _tile_counts.cache_clear()
    _key_tiles.cache_clear()


class _OneSpan:
    """`_KeyTiles.touched` / `.full` for keys that are one span [k0, k1), by arithmetic: a tile
    holds a key of [a, z) iff it meets [max(a, k0), min(z, k1)), and is full iff it lies inside
    it (a partial last tile never does, as z <= 2L)."""

    def __init__(self, span: Span, tile: int) -> None:
        self.k0, self.k1, self.tile = span[0], span[1], tile

    def touched(self, a: np.ndarray, z: np.ndarray) -> np.ndarray:
        a, z, t = np.maximum(a, self.k0), np.minimum(z, self.k1), self.tile
        return np.where(z > a, -(-z // t) - a // t, 0)

    def full(self, a: np.ndarray, z: np.ndarray) -> np.ndarray:
        a, z, t = np.maximum(a, self.k0), np.minimum(z, self.k1), self.tile
        return np.maximum(z // t - -(-a // t), 0)


class _OneSpanEach:
    """`_SpanTiles` for calls laid side by side whose keys are one span each (`k0[j]`, `k1[j]`
    for call j, at its offset): `_OneSpan`'s arithmetic per interval with its call's span, in
    place of a search over every call's spans."""

    def __init__(self, k0: np.ndarray, k1: np.ndarray, tile: int) -> None:
        self.k0, self.k1, self.tile = k0, k1, tile

    def at(self, calls: np.ndarray) -> _OneSpan:
        """The counter of intervals that belong to `calls` (one call per interval)."""
        return _OneSpan((self.k0[calls], self.k1[calls]), self.tile)


def _side(starts: np.ndarray, stops: np.ndarray, noisy: bool, counter, seq_len: int,
          block: int, window: int | None, q_rows: int) -> tuple[int, int]:
    """(touched, full) key tiles summed over the query tiles of one side's sorted spans, from
    four queries per tile (the module docstring): its first and last, and its first and last
    whose clean prefix is not empty."""
    cum = np.concatenate(([0], np.cumsum(stops - starts)))  # buffer index of each span's start
    n = int(cum[-1])
    first_i = np.arange(0, n, q_rows, dtype=np.int64)
    last_i = np.minimum(first_i + q_rows, n) - 1
    both = _positions(starts, cum, np.concatenate([first_i, last_i]))
    m = first_i.size
    first, last = both[:m], both[m:]
    ok = None
    if noisy:
        u, v = _nonempty_prefix(starts, stops, seq_len, block, window)
        if u.size:
            j = np.searchsorted(v, first, side="right")  # first piece ending after `first`
            fne = np.maximum(u[np.minimum(j, u.size - 1)], first)
            ok = (j < u.size) & (fne <= last)
            k = np.searchsorted(u, last, side="right") - 1  # last piece starting at or before `last`
            lne = np.minimum(v[np.maximum(k, 0)] - 1, last)
            both = np.concatenate([both, np.where(ok, fne, first), np.where(ok, lne, last)])
    (own_a, own_z), (pre_a, pre_z) = mask.visible_intervals(both, seq_len, block, window)
    # an own run is never empty: some = (a(first), z(last)), every = (a(last), z(first))
    some_a, some_z = own_a[:m], own_z[m:2 * m]
    if ok is not None:
        some_a = np.concatenate([some_a, np.where(ok, pre_a[2 * m:3 * m], 0)])
        some_z = np.concatenate([some_z, np.where(ok, pre_z[3 * m:], 0)])
    every_a = np.concatenate([own_a[m:2 * m], pre_a[m:2 * m]])
    every_z = np.concatenate([own_z[:m], pre_z[:m]])
    # a clean query's prefix run is (0, 0): never non-empty, and its `every` is empty too
    return int(counter.touched(some_a, some_z).sum()), int(counter.full(every_a, every_z).sum())


def _nonempty_prefix(starts: np.ndarray, stops: np.ndarray, seq_len: int, block: int,
                     window: int | None, with_spans: bool = False) -> tuple[np.ndarray, ...]:
    """Sorted disjoint pieces [u, v) of the noisy query positions whose clean prefix run is not
    empty: block start s >= b and offset i - s <= W - 2 (W = 2L + 1 without a window).
    `with_spans`: also the index of the span each piece lies in."""
    w = window if window is not None else 2 * seq_len + 1
    width = min(block, w - 1)  # non-empty offsets of a block: [0, width)
    none = np.zeros(0, np.int64)
    if width <= 0:
        return (none, none, none) if with_spans else (none, none)
    if width >= block:  # every query of blocks >= 1: one piece [b, L)
        u, v = np.maximum(starts, block), np.minimum(stops, seq_len)
        keep = v > u
        return (u[keep], v[keep], np.flatnonzero(keep)) if with_spans else (u[keep], v[keep])
    k0 = np.maximum(starts // block, 1)
    k1 = (stops - 1) // block
    count = np.maximum(k1 - k0 + 1, 0)
    total = int(count.sum())
    if not total:
        return (none, none, none) if with_spans else (none, none)
    span = np.repeat(np.arange(starts.size), count)
    k = k0[span] + np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    u = np.maximum(starts[span], k * block)
    v = np.minimum(np.minimum(stops[span], k * block + width), seq_len)
    keep = v > u
    return (u[keep], v[keep], span[keep]) if with_spans else (u[keep], v[keep])


def _by_position(queries: tuple[Span, ...], keys: tuple[Span, ...], seq_len: int, block: int,
                 window: int | None, q_rows: int, k_tile: int) -> tuple[int, int]:
    """The same counts by reading every query position: for query spans out of order or
    overlapping, where the ends are not monotone in buffer order (no caller passes them)."""
    counter = _KeyTiles(keys, 2 * seq_len, k_tile)
    touched = full = 0
    for q, at in _query_tiles(queries, seq_len, q_rows):
        for (some_a, some_z), (every_a, every_z) in _tile_runs(q, at, seq_len, block, window):
            touched += int(counter.touched(some_a, some_z).sum())
            full += int(counter.full(every_a, every_z).sum())
    return full, touched - full


def _query_tiles(queries: tuple[Span, ...], seq_len: int, q_rows: int):
    """Per side (noisy, clean): the side's query positions in buffer order and the index of each
    tile's first one. The kernel runs over the rank's packed query buffer, so a tile takes the
    next `q_rows` positions whatever span they come from (many short spans, such as a drafter's
    anchor blocks, share tiles instead of each padding its own); the two sides are cut apart, as
    their queries see different kinds of keys."""
    for lo, hi in ((0, seq_len), (seq_len, 2 * seq_len)):
        side = tuple((max(a, lo), min(z, hi)) for a, z in queries if min(z, hi) > max(a, lo))
        if side:
            q = mask.span_positions(side)
            yield q, np.arange(0, q.size, q_rows)


def _tile_runs(q: np.ndarray, at: np.ndarray, seq_len: int, block: int, window: int | None):
    """Per run of keys (own block, clean prefix): the keys some query of each tile sees and the
    keys every query sees, as [start, stop) per tile.

    Where every tile's queries are consecutive positions and there is no window, a run is never
    empty except the whole prefix of a block-0 or clean query, which sits at an end, so the
    tile's first and last query decide. Otherwise (a window can empty a noisy query's prefix in
    the middle of a tile; a tile can hold queries of distant blocks) every query is read and
    reduced per tile, and the keys some query sees are taken as one run from the first to the
    last seen: a tile in a gap between two blocks' runs counts as touched (full tiles stay exact;
    a drafter's tile of 8 anchor blocks 128 positions apart counts about 8 key tiles too many
    against hundreds in its prefix) [U].
    """
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


def tiles_aligned(queries: tuple[Span, ...], keys: tuple[Span, ...], seq_len: int, block: int,
                  window: int | None, q_rows: int, k_tile: int) -> bool:
    """True when no tile of the call can be partial, so its tiles are its pairs over a tile's
    area: no window, blocks and the sequence in whole tiles of both kinds, query spans cut into
    whole query tiles and key spans into whole key tiles (the studies' block 256 with shards of
    whole blocks). Then every run a query sees starts and ends on a tile edge and every query of
    a tile sees the same runs."""
    if window is not None or block % k_tile or block % q_rows or seq_len % k_tile or seq_len % q_rows:
        return False
    return all(a % q_rows == 0 and z % q_rows == 0 for a, z in queries) and \
        all(a % k_tile == 0 and z % k_tile == 0 for a, z in keys)


class _KeyTiles(_KeyCounts):
    """Prefix sums over the key tiles of one call: how many of its keys lie below a position,
    and how many tiles below a tile index hold any / all of their keys."""

    def __init__(self, keys: tuple[Span, ...], length: int, tile: int) -> None:
        self.tile = tile
        self.starts = np.array([a for a, _ in keys], dtype=np.int64)
        self.stops = np.array([z for _, z in keys], dtype=np.int64)
        self.before = np.concatenate([[0], np.cumsum(self.stops - self.starts)])
        n_tiles = -(-length // tile)
        edges = np.arange(n_tiles + 1, dtype=np.int64) * tile
        per_tile = np.diff(self.below(edges))
        self.any = np.concatenate([[0], np.cumsum(per_tile > 0)])
        self.all = np.concatenate([[0], np.cumsum(per_tile == np.minimum(tile, length - edges[:-1]))])

    def any_below(self, k: np.ndarray) -> np.ndarray:
        return self.any[k]

    def all_below(self, k: np.ndarray) -> np.ndarray:
        return self.all[np.clip(k, 0, len(self.all) - 1)]
