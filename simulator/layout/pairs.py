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
from csbp.simulator.layout.spans import Span, normalize


class QueryIntervals:
    """The key intervals a rank's queries see, so attention work can be split by where keys live.

    Without a window all queries of one block see the same intervals, so they are kept once with
    a weight (the block's positions among the queries).
    """

    def __init__(self, queries: tuple[Span, ...], seq_len: int, block: int,
                 window: int | None = None) -> None:
        if window is None:  # one representative query per (stream, block)
            q, self.weight = _touched_blocks(queries, block)
            q = q * block
        else:
            q = mask.span_positions(queries)
            self.weight = np.ones(q.size, dtype=np.int64)
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
        if not keys or self.weight.size == 0:
            return 0
        starts, stops = np.array(keys, dtype=np.int64).T
        before = np.concatenate([[0], np.cumsum(stops - starts)])

        def keys_below(x: np.ndarray) -> np.ndarray:
            k = np.searchsorted(starts, x, side="right")  # spans starting at or before x
            last = np.maximum(k - 1, 0)
            return np.where(k > 0, before[last] + np.minimum(x - starts[last], stops[last] - starts[last]), 0)

        return int(sum(((keys_below(z) - keys_below(a)) * self.weight).sum() for a, z in self.intervals))

    def pairs_with_each(self, key_sets: list[tuple[Span, ...]]) -> np.ndarray:
        """Pairs with each of several key sets (each a tuple of disjoint spans), in one pass."""
        spans = [(i, s, e) for i, keys in enumerate(key_sets) for s, e in normalize(keys)]
        out = np.zeros(len(key_sets), dtype=np.int64)
        if spans:
            which, s, e = np.array(spans, dtype=np.int64).T
            np.add.at(out, which, self.below(e) - self.below(s))
        return out


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
    if window is not None:  # each query's count depends on its position only: sum a prefix
        below = _window_prefix(layout.seq_len, layout.block, window)
        return np.array([sum(int(below[e] - below[s]) for s, e in share.positions)
                         for share in layout.shares], dtype=np.int64)
    L, b = layout.seq_len, layout.block
    spans = [(r, s, e) for r, share in enumerate(layout.shares) for s, e in share.positions]
    out = np.zeros(layout.size, dtype=np.int64)
    if not spans:
        return out
    rank, lo, hi = np.array(spans, dtype=np.int64).T
    first, last = lo // b, (hi - 1) // b
    pieces = last - first + 1
    which = np.repeat(np.arange(len(spans)), pieces)
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
    if not spans:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    ids = [np.arange(s // block, (e - 1) // block + 1, dtype=np.int64) for s, e in spans]
    lo, hi = (np.repeat(ends, [len(i) for i in ids]) for ends in zip(*spans))
    ids = np.concatenate(ids)
    counts = np.minimum(hi, (ids + 1) * block) - np.maximum(lo, ids * block)
    first = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))  # spans may share a block
    return ids[first], np.add.reduceat(counts, first)


def pairs_with_keys(layout: Layout, rank: int, keys: tuple[Span, ...], window: int | None = None) -> int:
    """Pairs of the rank's queries whose key lies in `keys`."""
    return QueryIntervals.of(layout, rank, window).pairs_with(keys)
