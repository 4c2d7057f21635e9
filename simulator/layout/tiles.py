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

Approximations [U]: key tiles are laid on logical positions (0..2L in steps of the tile), as they
are for a call over the whole sequence in logical order; a call over packed shards (received
rows, owner-major clean K/V) has its tile edges elsewhere, which moves a few tiles per shard
between full and partial. Query tiles run over the rank's packed query buffer (`_query_tiles`).
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.layout import mask
from csbp.simulator.layout.spans import Span, normalize


def tile_counts(queries: tuple[Span, ...], keys: tuple[Span, ...], seq_len: int, block: int,
                window: int | None, q_rows: int, k_tile: int) -> tuple[int, int]:
    """(full, partial) tiles of queries `queries` over the keys `keys` of one call, `q_rows`
    query positions per tile (fewer than the tile's rows when GQA heads are packed into it)."""
    if not keys:
        return 0, 0
    counter = _KeyTiles(normalize(keys), 2 * seq_len, k_tile)
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


class _KeyTiles:
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
        inner = np.where(t1 > t0 + 1, self.any[np.maximum(t1, t0 + 1)] - self.any[t0 + 1], 0)
        return np.where(ok, np.where(one, head, head.astype(int) + tail + inner), 0)

    def full(self, a: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Tiles lying wholly inside [a, z) whose keys all belong to the call."""
        t = self.tile
        lo, hi = -(-a // t), z // t
        return np.where(hi > lo, self.all[np.clip(hi, 0, None)] - self.all[np.clip(lo, 0, len(self.all) - 1)], 0)
