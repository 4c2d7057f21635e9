"""Attention pairs of a rank's queries against any set of keys, by prefix sums.

Every query of the mask sees at most two runs of keys (`mask.visible_intervals`), so the number
of pairs whose key is below x is a piecewise-linear function of x, G(x), kept as sorted interval
ends with running sums; the pairs with keys in [s, e) are G(e) - G(s). One rank's queries are
then counted against every shard of its group at once (a ring's steps, a collective's local and
remote keys) in a few array operations instead of a pass over the intervals per shard, which is
what made a large ring's split cost ranks^2 passes. Integer arithmetic: the counts are exact.
"""

from __future__ import annotations

import functools

import numpy as np

from csbp.simulator.layout import mask
from csbp.simulator.layout.layout import Layout
from csbp.simulator.layout.spans import Span, flat_spans, intersect, normalize, sorted_unique


class KeySets:
    """Several key sets, each `normalize`d, and all their spans flattened once into arrays (the
    set, start and stop of each: `flat_spans`). A ring's split asks every rank of a group about
    the same members' shards (256 ranks x 256 shards at 1,024 GPUs): made once per group, not
    once per rank."""

    __slots__ = ("n", "sets", "which", "starts", "stops")

    def __init__(self, key_sets) -> None:
        self.n = len(key_sets)
        self.sets = [normalize(keys) for keys in key_sets]
        self.which, self.starts, self.stops = flat_spans(self.sets)

    @classmethod
    def of(cls, key_sets) -> "KeySets":
        return key_sets if isinstance(key_sets, cls) else cls(key_sets)


class QueryIntervals:
    """The key intervals a rank's queries see, so attention work can be split by where keys live.

    Without a window all queries of one block see the same intervals, so they are kept once with
    a weight (the block's positions among the queries). With one, the queries are cut into runs
    of consecutive positions on which every end of both intervals is constant or rises by one
    per position (`_WindowRuns`), so counts cost per run, not per position.
    """

    def __init__(self, queries: tuple[Span, ...], seq_len: int, block: int,
                 window: int | None = None) -> None:
        self._runs = None
        if window is None:  # one representative query per (stream, block)
            q, self.weight = _touched_blocks(queries, block)
            q = q * block
        else:
            self._runs = _WindowRuns(queries, seq_len, block, window)
            self._total = self._runs.total()
            return
        self.intervals = mask.visible_intervals(q, seq_len, block, window)
        self._total = int(sum(((z - a) * self.weight).sum() for a, z in self.intervals))
        self._sums: tuple[_RunningSums, _RunningSums] | None = None  # made on the first count

    @classmethod
    def of(cls, layout: Layout, rank: int, window: int | None = None) -> "QueryIntervals":
        return cls(layout.shares[rank].positions, layout.seq_len, layout.block, window)

    def total(self) -> int:
        """Every pair of the rank's queries (the mask's count, at one query per block)."""
        return self._total

    def below(self, x: np.ndarray) -> np.ndarray:
        """G(x): pairs whose key position is < x, for each x.

        A query interval [a, z) holds min(max(x - a, 0), z - a) keys below x, which is
        (x - a)+ - (x - z)+: a sum over the interval starts below x minus one over the stops.
        """
        if self._runs is not None:
            return self._runs.below(np.asarray(x, dtype=np.int64))
        if self._sums is None:
            a = np.concatenate([lo for lo, _ in self.intervals])
            z = np.concatenate([hi for _, hi in self.intervals])
            w = np.concatenate([self.weight] * len(self.intervals))
            seen = z > a
            self._sums = _RunningSums(a[seen], w[seen]), _RunningSums(z[seen], w[seen])
        starts, stops = self._sums
        x = np.asarray(x, dtype=np.int64)
        return starts.ramp(x) - stops.ramp(x)

    def pairs_with(self, keys: tuple[Span, ...]) -> int:
        """Pairs whose key lies in `keys`: each query interval [a, z) holds K(z) - K(a) of them,
        K(x) the keys below x (one key set: no need to sort the queries' intervals)."""
        keys = normalize(keys)
        if self._runs is not None:
            return self._runs.pairs_with(keys) if keys else 0
        if not keys or self.weight.size == 0:
            return 0
        one = np.zeros(self.weight.size, dtype=np.int64)  # every query of the one rank
        return int(_block_pairs(_RankKeys([keys]), one, self.intervals, self.weight).sum())

    def queries_seeing_each(self, key_sets: "list[tuple[Span, ...]] | KeySets") -> np.ndarray:
        """Queries with at least one visible key in each key set: the query rows a call over
        that set runs when it skips the queries that see none of its keys (the frameworks' CP
        step calls, Q(C) x K(2C) rather than Q(2C) x K(2C)). Exact without a window (every query
        of a block sees the same runs); with one, every query is counted [U].

        A run [a, z) meets a set of sorted disjoint spans iff the last span starting below z
        ends above a: one searchsorted per run over every set's spans at once (sets offset
        apart so that their spans never interleave)."""
        key_sets = KeySets.of(key_sets)
        out = np.zeros(key_sets.n, dtype=np.int64)
        if self._runs is not None:
            out[:] = int(self._runs.n.sum())
            return out
        if not key_sets.which.size or self.weight.size == 0:
            return out
        ranges = self._monotone_runs()
        if ranges is not None:  # each span meets one contiguous range of each kind's runs
            total = np.concatenate([[0], np.cumsum(self.weight)])
            hits: list[list[tuple[int, int]]] = [[] for _ in range(key_sets.n)]
            for first, a, z in ranges:
                lo = np.searchsorted(z, key_sets.starts, side="right")  # z > s from here
                hi = np.searchsorted(a, key_sets.stops, side="left")  # a < e up to here
                for j, i0, i1 in zip(key_sets.which.tolist(), lo.tolist(), hi.tolist()):
                    if i1 > i0:
                        hits[j].append((first + i0, first + i1))
            for j, found in enumerate(hits):
                for i0, i1 in normalize(found):
                    out[j] += int(total[i1] - total[i0])
            return out
        which, starts, stops = key_sets.which, key_sets.starts, key_sets.stops
        shift = int(max(int(stops.max()), max(int(hi.max(initial=0)) for _, hi in self.intervals)) + 1)
        starts, stops = starts + which * shift, stops + which * shift  # set j lives in [j*shift, ...)
        sets = np.arange(key_sets.n, dtype=np.int64)[:, None] * shift
        seen = np.zeros((key_sets.n, self.weight.size), dtype=bool)
        for lo, hi in self.intervals:
            a, z = lo[None, :] + sets, hi[None, :] + sets
            k = np.searchsorted(starts, z, side="left") - 1  # last span starting below z
            hit = (k >= 0) & (stops[np.maximum(k, 0)] > a) & (which[np.maximum(k, 0)] == sets // shift)
            seen |= hit & (hi > lo)[None, :]
        return seen.astype(np.int64) @ self.weight

    def _monotone_runs(self):
        """Per kind of run (own, prefix): (first representative, starts, stops) of its non-empty
        runs when they are consecutive representatives whose starts and stops never fall (the
        mask without a window: tiles.py's docstring), else None. Then the runs meeting a span
        [s, e) are those from the first with stop > s to the last with start < e."""
        if not hasattr(self, "_monotone"):
            out = []
            for lo, hi in self.intervals:
                idx = np.flatnonzero(hi > lo)
                if not idx.size:
                    continue
                a, z = lo[idx], hi[idx]
                if (np.diff(idx) != 1).any() or (np.diff(a) < 0).any() or (np.diff(z) < 0).any():
                    out = None
                    break
                out.append((int(idx[0]), a, z))
            self._monotone = out
        return self._monotone

    def keys_seen_each(self, key_sets: "list[tuple[Span, ...]] | KeySets") -> np.ndarray:
        """Keys of each key set that at least one query sees: the key rows such a call reads
        (Q(2C) x K(C) when only a shard's first chunk is visible). Exact without a window;
        with one, every key of the set is counted [U]. The union of the queries' runs is kept
        as sorted disjoint segments with the length covered below each start."""
        key_sets = KeySets.of(key_sets)
        if self._runs is not None:
            return np.array([sum(e - s for s, e in keys) for keys in key_sets.sets], dtype=np.int64)
        if self.weight.size == 0:
            return np.zeros(key_sets.n, dtype=np.int64)
        if not hasattr(self, "_seen"):
            a = np.concatenate([lo for lo, _ in self.intervals])
            z = np.concatenate([hi for _, hi in self.intervals])
            keep = z > a
            a, z = a[keep], z[keep]
            order = np.argsort(a, kind="stable")
            a, z = a[order], z[order]
            reach = np.maximum.accumulate(z)
            new = np.concatenate([[True], a[1:] > reach[:-1]])  # a gap before this run
            first = np.flatnonzero(new)
            seg_a = a[first]
            seg_z = np.maximum.reduceat(z, first) if first.size else z[:0]
            self._seen = (seg_a, seg_z, np.concatenate([[0], np.cumsum(seg_z - seg_a)]))
        seg_a, seg_z, before = self._seen

        def covered(x: np.ndarray) -> np.ndarray:  # union length below x
            k = np.searchsorted(seg_a, x, side="right") - 1
            inside = np.where(k >= 0, np.minimum(x, seg_z[np.maximum(k, 0)]) - seg_a[np.maximum(k, 0)], 0)
            return np.where(k >= 0, before[np.maximum(k, 0)] + np.maximum(inside, 0), 0)

        out = np.zeros(key_sets.n, dtype=np.int64)
        if key_sets.which.size:
            np.add.at(out, key_sets.which, covered(key_sets.stops) - covered(key_sets.starts))
        return out

    def pairs_with_each(self, key_sets: "list[tuple[Span, ...]] | KeySets") -> np.ndarray:
        """Pairs with each of several key sets (each a tuple of disjoint spans, or `KeySets`
        made once for many ranks), in one pass."""
        key_sets = KeySets.of(key_sets)
        out = np.zeros(key_sets.n, dtype=np.int64)
        if key_sets.which.size:
            np.add.at(out, key_sets.which, self.below(key_sets.stops) - self.below(key_sets.starts))
        return out


class _WindowRuns:
    """A rank's queries under a window as runs of consecutive positions [q, q + n) on which each
    end e of both visible intervals (`mask.visible_intervals`) is e0 + slope * k, slope 0 or 1.

    Why the runs are exact: inside one block of one stream, every end is a max / min of a
    constant and i - W + 1 or i + W (i the query's position in its stream), so it never falls and
    rises by 0 or 1 per position; its slope changes only where one of those terms overtakes the
    other, at offsets W - 1 and b - W of a block or at i = W - 1. Cutting the spans there and at
    block and stream edges leaves runs whose ends rise by 0 at every step or by 1 at every step,
    which the first and last query show (an end risen by n - 1 over n queries rose by 1 each
    time; by 0, never); a run where they show anything else is read query by query. Sums over a
    run are then arithmetic series: O(runs) per count, against O(positions) over every query.
    Integer arithmetic throughout: the counts are exact."""

    def __init__(self, queries: tuple[Span, ...], seq_len: int, block: int, window: int) -> None:
        q0, n, _ = _run_starts(queries, seq_len, block, window)
        self.n, self.ends, _ = _affine_runs(q0, n, seq_len, block, window)

    def total(self) -> int:
        n, tri = self.n, self.n * (self.n - 1) // 2
        return int(sum((n * (z0 - a0) + (sz - sa) * tri).sum() for (a0, sa), (z0, sz) in self.ends))

    def _ramp(self, x: np.ndarray, e0: np.ndarray, slope: np.ndarray) -> np.ndarray:
        """sum over each run's ends e of (x - e)+, summed over runs, for each x."""
        d = x[None, :] - e0[:, None]
        n = self.n[:, None]
        m = np.clip(d, 0, n)
        rising = m * d - m * (m - 1) // 2
        flat = n * np.maximum(d, 0)
        return np.where(slope[:, None] == 1, rising, flat).sum(axis=0)

    def below(self, x: np.ndarray) -> np.ndarray:
        """G(x): pairs whose key position is < x (`QueryIntervals.below`)."""
        shape = np.shape(x)
        x = np.ravel(x)
        out = np.zeros(x.size, dtype=np.int64)
        if self.n.size:
            for (a0, sa), (z0, sz) in self.ends:
                out += self._ramp(x, a0, sa) - self._ramp(x, z0, sz)
        return out.reshape(shape)

    def pairs_with(self, keys: tuple[Span, ...]) -> int:
        """Pairs whose key lies in `keys` (sorted, disjoint): over each run, the keys below its
        stops minus those below its starts, as sums of K (keys below) or of its prefix sums R."""
        if not self.n.size:
            return 0
        one = np.zeros(self.n.size, dtype=np.int64)  # every run of the one rank
        return int(_run_pairs(_RankKeys([keys]), one, self.n, self.ends).sum())


def _run_starts(queries: tuple[Span, ...], L: int, b: int, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first query, length) of each run: every span's part in each stream (noisy [0, L), clean
    [L, 2L)) cut at its stream's block edges plus offsets 0, W - 1 and b - W, at the part's start
    and at W - 1 into the stream; parts in span order, noisy before clean, runs in position order
    within a part, and the query span each run is in. All parts at once: a rank holding hundreds of
    dealt blocks holds as many spans (and `pairs_with_ranks` passes every rank's spans)."""
    spans = np.array(queries, dtype=np.int64).reshape(-1, 2)
    base = np.tile(np.array([0, L], dtype=np.int64), len(spans))  # per part: its stream's start
    lo = np.maximum(np.repeat(spans[:, 0], 2), base)
    hi = np.minimum(np.repeat(spans[:, 1], 2), base + L)
    keep = hi > lo
    base, lo, hi = base[keep], lo[keep], hi[keep]
    if not lo.size:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    offsets = np.array(sorted({o for o in (0, w - 1, b - w) if 0 <= o < b}), dtype=np.int64)
    first_block = (lo - base) // b
    count = (hi - 1 - base) // b - first_block + 1  # blocks each part touches
    part = np.repeat(np.arange(lo.size), count)
    k = np.arange(part.size) - np.repeat(np.cumsum(count) - count, count) + first_block[part]
    edges = base[part] + k * b
    cut = np.concatenate([(edges[:, None] + offsets[None, :]).ravel(), lo, base + w - 1])
    owner = np.concatenate([np.repeat(part, offsets.size), np.arange(lo.size), np.arange(lo.size)])
    inside = (cut >= lo[owner]) & (cut < hi[owner])
    span = 2 * L + 1  # one sort key per (part, cut): parts apart, cuts in order, duplicates once
    key = sorted_unique(owner[inside] * span + cut[inside])
    owner, cut = key // span, key % span
    later = np.append(cut[1:], 0)
    same = np.append(owner[1:] == owner[:-1], False)
    return cut, np.where(same, later, hi[owner]) - cut, (np.flatnonzero(keep) // 2)[owner]


def _affine_runs(q0: np.ndarray, n: np.ndarray, L: int, b: int, w: int, tag: np.ndarray | None = None):
    """(run lengths, per interval (own, prefix) its ((start e0, slope), (stop e0, slope)), `tag`
    per run) of runs starting at `q0` (`_WindowRuns`); a run whose ends do not rise by 0 or 1
    per query is read query by query, its queries keeping its tag."""
    if not q0.size:
        return np.zeros(0, dtype=np.int64), [], tag
    first = mask.visible_intervals(q0, L, b, w)
    last = mask.visible_intervals(q0 + n - 1, L, b, w)
    rises = [hi - lo for f, l in zip(first, last) for lo, hi in zip(f, l)]
    affine = np.logical_and.reduce([(r == 0) | (r == n - 1) for r in rises])
    if not affine.all():  # defensive: read such runs query by query (no case found needs it)
        odd = np.flatnonzero(~affine)
        single = np.concatenate([np.arange(q0[i], q0[i] + n[i]) for i in odd])
        if tag is not None:
            tag = np.concatenate([tag[affine], np.repeat(tag[odd], n[odd])])
        q0 = np.concatenate([q0[affine], single])
        n = np.concatenate([n[affine], np.ones(single.size, dtype=np.int64)])
        first = mask.visible_intervals(q0, L, b, w)
        last = mask.visible_intervals(q0 + n - 1, L, b, w)
    ends = [((f[0], _slope(f[0], l[0], n)), (f[1], _slope(f[1], l[1], n))) for f, l in zip(first, last)]
    return n, ends, tag


def pairs_with_ranks(layout: Layout, keys: list[tuple[Span, ...]], window: int | None = None) -> np.ndarray:
    """[rank] pairs of each rank's queries whose key lies in keys[rank]:
    `QueryIntervals.pairs_with` of every rank at once (an attention split counts a layout's
    ranks one by one otherwise: ~100 ms for 256 windowed ranks). The queries of all ranks as one
    set of representative queries (a block's, or a window's runs) tagged by rank, every rank's
    keys in one `_RankKeys`; the same integer sums per rank."""
    n_ranks, L, b = layout.size, layout.seq_len, layout.block
    out = np.zeros(n_ranks, dtype=np.int64)
    spans = [share.positions for share in layout.shares]
    counter = _RankKeys([normalize(k) for k in keys], 4 * L)
    if window is None:  # one representative query per (rank, block), weighted by its positions
        rank, q, weight = _touched_blocks_ranks(spans, b)
        if not q.size:
            return out
        np.add.at(out, rank, _block_pairs(counter, rank, mask.visible_intervals(q * b, L, b, None), weight))
        return out
    owner = np.repeat(np.arange(n_ranks), [len(p) for p in spans])
    q0, n, which = _run_starts(tuple(p for ps in spans for p in ps), L, b, window)
    n, ends, rank = _affine_runs(q0, n, L, b, window, owner[which] if which.size else which)
    if n.size:
        np.add.at(out, rank, _run_pairs(counter, rank, n, ends))
    return out


def _block_pairs(counter: "_RankKeys", rank: np.ndarray, intervals, weight: np.ndarray) -> np.ndarray:
    """Per representative query (one per block, `weight` positions each): its pairs with its
    rank's keys, K(z) - K(a) over each interval [a, z) it sees."""
    return sum((counter.below(hi, rank) - counter.below(lo, rank)) * weight for lo, hi in intervals)


def _run_pairs(counter: "_RankKeys", rank: np.ndarray, n: np.ndarray, ends) -> np.ndarray:
    """Per window run (`_WindowRuns`): its pairs with its rank's keys, the keys below its
    intervals' stops minus those below their starts, as sums of K (keys below) or of its
    prefix sums R over the run's queries."""
    total = np.zeros(n.size, dtype=np.int64)
    for interval in ends:
        for sign, (e0, slope) in zip((-1, 1), interval):
            flat = n * counter.below(e0, rank)
            rising = counter.summed(e0 + n, rank) - counter.summed(e0, rank)
            total += sign * np.where(slope == 1, rising, flat)
    return total


class _RankKeys:
    """Every rank's own keys (sorted disjoint spans) at once: K_r(x), the keys of rank r below
    x, and R_r(x) = sum of K_r(y) over y < x. The spans of all ranks in one array, rank after
    rank, searched by (rank, position) (`top`: past every position; 0 with one rank), counted
    with running sums from the rank's first span (no sum crosses ranks, so none outgrows one
    rank's). A span [s, e) of size l adds to R, for x >= e, l(l+1)/2 + (x-1-e) l = x l +
    (l(l+1)/2 - (1+e) l)."""

    def __init__(self, keys: list[tuple[Span, ...]], top: int = 0) -> None:
        sizes = [len(k) for k in keys]
        self.first = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # rank r: [first[r], first[r + 1])
        rank = np.repeat(np.arange(len(keys), dtype=np.int64), sizes)
        self.s, self.e = np.array([span for k in keys for span in k], dtype=np.int64).reshape(-1, 2).T
        self.top = top
        self.ks, self.ke = rank * top + self.s, rank * top + self.e
        size = self.e - self.s
        self.size = np.concatenate([[0], np.cumsum(size)])
        self.const = np.concatenate([[0], np.cumsum(size * (size + 1) // 2 - (1 + self.e) * size)])

    def below(self, x: np.ndarray, rank: np.ndarray) -> np.ndarray:
        if not self.s.size:
            return np.zeros(np.shape(x), dtype=np.int64)
        k = np.searchsorted(self.ks, rank * self.top + x, side="right")  # spans starting at or before x
        mine = k > self.first[rank]  # one of them is the rank's own
        last = np.maximum(k - 1, 0)
        inside = np.where(mine, np.minimum(x - self.s[last], self.e[last] - self.s[last]), 0)
        return np.where(mine, self.size[last] - self.size[self.first[rank]], 0) + inside

    def summed(self, x: np.ndarray, rank: np.ndarray) -> np.ndarray:
        if not self.s.size:
            return np.zeros(np.shape(x), dtype=np.int64)
        done = np.searchsorted(self.ke, rank * self.top + x, side="right")  # the rank's spans with e <= x end here
        base = self.first[rank]
        out = x * (self.size[done] - self.size[base]) + self.const[done] - self.const[base]
        j = np.minimum(done, self.s.size - 1)
        t = np.where((done < self.first[rank + 1]) & (x > self.s[j]), x - self.s[j], 0)  # the span x is inside
        return out + t * (t - 1) // 2


def _touched_blocks_ranks(spans: list[tuple[Span, ...]], block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_touched_blocks` of every rank's spans at once: (rank, block, positions in it) per
    (rank, block) the rank's spans touch, rank after rank, blocks in order."""
    flat = [span for ps in spans for span in ps]
    if not flat:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    owner = np.repeat(np.arange(len(spans), dtype=np.int64), [len(p) for p in spans])
    lo, hi = np.array(flat, dtype=np.int64).T
    k0, k1 = lo // block, (hi - 1) // block
    count = k1 - k0 + 1
    span = np.repeat(np.arange(lo.size), count)
    ids = k0[span] + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    positions = np.minimum(hi[span], (ids + 1) * block) - np.maximum(lo[span], ids * block)
    rank = owner[span]
    first = np.flatnonzero(np.concatenate([[True], (ids[1:] != ids[:-1]) | (rank[1:] != rank[:-1])]))
    return rank[first], ids[first], np.add.reduceat(positions, first)


def _slope(first: np.ndarray, last: np.ndarray, n: np.ndarray) -> np.ndarray:
    return ((last - first == n - 1) & (n > 1)).astype(np.int64)


class _RunningSums:
    """Sorted interval ends with the running sums of their weights and of weight x end."""

    def __init__(self, ends: np.ndarray, weights: np.ndarray) -> None:
        order = np.argsort(ends, kind="stable")
        self.ends, w = ends[order], weights[order]
        self.weight = np.concatenate([[0], np.cumsum(w)])
        self.moment = np.concatenate([[0], np.cumsum(w * self.ends)])

    def ramp(self, x: np.ndarray) -> np.ndarray:
        """sum of w * (x - end) over the ends below x."""
        k = np.searchsorted(self.ends, x, side="left")
        return self.weight[k] * x - self.moment[k]


def totals(layout: Layout, window: int | None = None) -> np.ndarray:
    """Every pair of each rank's queries, all ranks at once (`QueryIntervals.total` per rank).

    Without a window every query of a block sees as many keys as the block's first one, so a
    rank's pairs are its positions in each block times that block's count: one pass over every
    rank's spans cut at block edges.
    """
    L, b = layout.seq_len, layout.block
    rank, lo, hi = flat_spans([share.positions for share in layout.shares])
    out = np.zeros(layout.size, dtype=np.int64)
    if not rank.size:
        return out
    if window is not None:  # each query's count depends on its position only: sum a prefix
        below = _window_prefix(L, b, window)
        np.add.at(out, rank, below[hi] - below[lo])  # integers: the same sums in any order
        return out
    first, last = lo // b, (hi - 1) // b
    pieces = last - first + 1
    which = np.repeat(np.arange(rank.size), pieces)
    ids = first[which] + np.arange(which.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    held = np.minimum(hi[which], (ids + 1) * b) - np.maximum(lo[which], ids * b)
    np.add.at(out, rank[which], held * _block_counts(L, b)[ids])
    return out


@functools.lru_cache(maxsize=8)
def _block_counts(seq_len: int, block: int) -> np.ndarray:
    """Keys seen by each query of each block of the 2L sequence (the same for all of a block)."""
    return mask.visible_counts(np.arange(0, 2 * seq_len, block, dtype=np.int64), seq_len, block)


@functools.lru_cache(maxsize=2)  # 2L + 1 counts each: 64 MB at the longest context
def _window_prefix(seq_len: int, block: int, window: int) -> np.ndarray:
    """Keys seen by the queries at positions < p, for every p of the 2L sequence."""
    counts = mask.visible_counts(np.arange(2 * seq_len, dtype=np.int64), seq_len, block, window)
    return np.concatenate([[0], np.cumsum(counts)])


def _touched_blocks(spans: tuple[Span, ...], block: int) -> tuple[np.ndarray, np.ndarray]:
    """(blocks the spans touch, positions of the spans in each), sorted: the spans' positions
    grouped by block without listing every position (spans are sorted and disjoint)."""
    _, blocks, positions = _touched_blocks_ranks([spans], block)
    return blocks, positions


def pairs_with_keys(layout: Layout, rank: int, keys: tuple[Span, ...], window: int | None = None) -> int:
    """Pairs of the rank's queries whose key lies in `keys`."""
    return QueryIntervals.of(layout, rank, window).pairs_with(keys)
