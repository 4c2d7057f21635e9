"""Half-open integer ranges [start, stop) and the few set operations the layout needs.

Kept as plain tuples so layouts hash, compare and serialise trivially.
"""

from __future__ import annotations

import functools
from typing import Iterable

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


def intersect(a: Iterable[Span], b: Iterable[Span]) -> tuple[Span, ...]:
    a, b = normalize(a), normalize(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


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
    return sum(stop - start for start, stop in spans)


def shift(spans: Iterable[Span], offset: int) -> tuple[Span, ...]:
    return tuple((a + offset, b + offset) for a, b in spans)
