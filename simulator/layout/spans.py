"""Half-open integer ranges [start, stop) and the few set operations the layout needs.

Kept as plain tuples so layouts hash, compare and serialise trivially.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from typing import Iterable

import numpy as np

Span = tuple[int, int]


def normalize(spans: Iterable[Span]) -> tuple[Span, ...]:
    """Sorted, non-empty, with touching or overlapping spans merged. A tuple (what layouts hold
    and pass around: the same few shares, asked again by every count) is normalised once."""
    if type(spans) is tuple:
        try:
            return _normalized(spans)
        except TypeError:  # unhashable parts (lists): normalised as any iterable
            pass
    return _normalize(spans)


@functools.lru_cache(maxsize=1 << 16)
def _normalized(spans: tuple[Span, ...]) -> tuple[Span, ...]:
    return _normalize(spans)


def _normalize(spans: Iterable[Span]) -> tuple[Span, ...]:
    items = iter(sorted(s for s in spans if s[1] > s[0]))
    first = next(items, None)
    if first is None:
        return ()
    out: list[Span] = []
    lo, hi = first
    for start, stop in items:
        if start <= hi:
            if stop > hi:
                hi = stop
        else:
            out.append((lo, hi))
            lo, hi = start, stop
    out.append((lo, hi))
    return tuple(out)


def join_apart(low: tuple[Span, ...], high: tuple[Span, ...]) -> tuple[Span, ...]:
    """`normalize(low + high)` for normalised `low` ending at or before where normalised `high`
    starts (a share's noisy blocks below L, its clean rows from L): the two joined, merged
    where they touch, without sorting a rank's thousands of spans again."""
    if not low or not high:
        return low or high
    if low[-1][1] < high[0][0]:
        return low + high
    if low[-1][1] == high[0][0]:
        return low[:-1] + ((low[-1][0], high[0][1]),) + high[1:]
    return normalize(low + high)  # they overlap after all: the general case


def intersect(a: Iterable[Span], b: Iterable[Span]) -> tuple[Span, ...]:
    """The positions in both. Each span of the shorter list takes the run of the longer one's
    spans it overlaps by bisection, clipped at its ends: a share's hundreds of spans against
    one stream's range cost a slice, not a step per span. Both normalised, the overlaps are
    sorted and apart, so this is the normalised intersection whichever list is walked."""
    a, b = normalize(a), normalize(b)
    if len(a) < len(b):
        a, b = b, a
    out: list[Span] = []
    for lo, hi in b:
        i, j = overlapping(a, lo, hi)
        if i == j:
            continue
        run = list(a[i:j])
        run[0] = (max(run[0][0], lo), run[0][1])
        run[-1] = (run[-1][0], min(run[-1][1], hi))
        out += run
    return tuple(out)


def overlapping(spans: tuple[Span, ...], lo: int, hi: int) -> tuple[int, int]:
    """(i, j): `spans[i:j]` are the spans of a normalised list that overlap [lo, hi), found by
    bisection (the first ending after lo, the first starting at or after hi)."""
    i = bisect.bisect_right(spans, lo, key=_stop)
    return i, bisect.bisect_left(spans, hi, lo=i, key=_start)


_start, _stop = operator.itemgetter(0), operator.itemgetter(1)


def subtract(a: Iterable[Span], b: Iterable[Span]) -> tuple[Span, ...]:
    out: list[Span] = []
    b = normalize(b)
    for start, stop in normalize(a):
        cur = start
        for lo, hi in b:
            if hi <= cur or lo >= stop:
                continue
            if lo > cur:
                out.append((cur, lo))
            cur = max(cur, hi)
        if cur < stop:
            out.append((cur, stop))
    return tuple(out)


def size(spans: Iterable[Span]) -> int:
    """Positions in `spans` (each stop - start, summed without a Python step per span)."""
    return -sum(itertools.starmap(operator.sub, spans))


def shift(spans: Iterable[Span], offset: int) -> tuple[Span, ...]:
    return tuple((a + offset, b + offset) for a, b in spans)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique of an integer array (sorted, each value once) by a sort and a comparison: the
    same array, without np.unique's masked-array check, whose first call imports numpy.ma
    (10-50 ms of a cold `csbp plan`)."""
    values = np.sort(values, axis=None)
    if values.size < 2:
        return values
    return values[np.concatenate(([True], values[1:] != values[:-1]))]


def block_spans_each(lists, block: int) -> list[tuple[Span, ...]]:
    """Each list's blocks as spans of positions, neighbours merged: `normalize` of the blocks'
    spans, for every list at once (a layout deals thousands of blocks over up to a thousand
    ranks: one sort instead of a pass per rank)."""
    which, k = flat_lists(lists)
    if not k.size:
        return [()] * len(lists)
    top = int(k.max()) + 2  # one key per (list, block): lists apart, blocks in order, once
    key = sorted_unique(which * top + k)
    which, k = key // top, key % top
    first = np.flatnonzero(np.concatenate([[True], (which[1:] != which[:-1]) | (k[1:] != k[:-1] + 1)]))
    last = np.append(first[1:], k.size) - 1
    return spans_per_list(len(lists), which[first], k[first] * block, (k[last] + 1) * block)


def flat_lists(lists) -> tuple[np.ndarray, np.ndarray]:
    """(which list, value) of every entry of every list of integers, as two arrays."""
    sizes = [len(x) for x in lists]
    which = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    return which, np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(sizes))


def flat_spans(span_lists) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(which list, start, stop) of every span of every list of spans, as three arrays, read
    without a Python tuple per span (a 1,024-GPU layout's ranks hold thousands)."""
    sizes = [len(x) for x in span_lists]
    flat = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(span_lists)),
                       dtype=np.int64, count=2 * sum(sizes))
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes), flat[0::2], flat[1::2]


def spans_per_list(n: int, which: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> list[tuple[Span, ...]]:
    """Spans [lo, hi) sorted by list (`which`, ascending), back as one tuple of Python ints per
    list: each list's run cut out by a bisection and zipped whole (a layout of 1,024 blocks has
    a few thousand spans; a Python step per span cost 1-2 ms a layout)."""
    cuts = np.searchsorted(which, np.arange(n + 1)).tolist()
    starts, stops = lo.tolist(), hi.tolist()
    return [tuple(zip(starts[a:z], stops[a:z])) for a, z in zip(cuts, cuts[1:])]
