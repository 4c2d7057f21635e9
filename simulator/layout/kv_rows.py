"""K/V rows each rank of a context group receives in a layout's exchanges, from the shares alone.

`Layout.exchange` lists every transfer, which is what the runtime executes and the step graph
times: an all-gather over n ranks holds n(n-1) of them, a ring n per step. Memory, the traffic
figure and the planner's screen need only per-rank totals, and at a few hundred ranks listing the
transfers costs more than the rest of the screen; the totals follow from who owns which rows
(each rank's shard, its cp group, the rows its queries read), counted here with arrays and kept
with the layout's ownership. `tests/test_kv_rows.py` holds them equal to the exchanges' counts.
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.layout.layout import Layout, Payload, Phase
from csbp.simulator.layout.spans import Span, normalize, overlapping, size, subtract
from csbp.simulator.workload.spec import AttentionSpec

PHASES: tuple[Phase, ...] = ("forward", "recompute", "backward")


def pattern(layout: Layout, a: AttentionSpec, phase: Phase) -> str:
    """The exchange's pattern, decided as `Layout.exchange` decides it (without its transfers)."""
    if layout.kind not in ("cp", "csbp") or a.kind == "linear":
        return "none"
    if phase == "recompute" and layout.checkpointing != "full":
        return "none"
    if a.kind == "sliding" and layout.kind == "csbp":
        return "all-to-all"
    return "ring" if layout.plan.transport == "ring" else "all-gather"


def received(layout: Layout, a: AttentionSpec, phase: Phase) -> np.ndarray:
    """Rows (K/V, and dK/dV in the backward) each rank receives in one layer's exchange."""
    kind = pattern(layout, a, phase)
    key = ("kv-rows", kind, a.window if kind == "all-to-all" else None, phase == "backward")
    if key not in layout.derived:
        layout.derived[key] = _received(layout, a, kind, phase == "backward")
    return layout.derived[key]


def held_at_once(layout: Layout, a: AttentionSpec) -> np.ndarray:
    """Remote K/V rows a rank holds at once in one layer's forward: everything it receives, or
    for a ring the largest step (the runtime keeps two buffers in flight; memory counts them)."""
    if pattern(layout, a, "forward") != "ring":
        return received(layout, a, "forward")
    key = ("kv-rows-ring-step",)
    if key not in layout.derived:
        own = owned_rows(layout)
        step = np.zeros(layout.size, dtype=np.int64)
        for g in map(np.array, layout.cp_groups()):
            if len(g) < 2:
                continue
            mine = own[g]
            first, second = np.sort(mine)[::-1][:2]  # the largest other shard: the largest, or
            alone = (mine == first) & ((mine == first).sum() == 1)  # the second if it is mine
            step[g] = np.where(alone, second, first)
        layout.derived[key] = step
    return layout.derived[key]


def step_received(layout: Layout, a: AttentionSpec, phase: Phase, step: int,
                  payload: Payload | None = None) -> np.ndarray:
    """Rows each rank receives in one step of the exchange (`payload`: only K/V or only dK/dV).

    A collective is one step (K/V forward, their gradients home in the backward); a ring's step
    s brings every rank the shard of the member s places back, the backward's steps also carry
    that shard's partial dK/dV from the second step on, and its last step takes each shard's
    gradients home.
    """
    kind = pattern(layout, a, phase)
    backward = phase == "backward"
    carries = "dkv" if backward else "kv"
    if kind != "ring":
        rows = received(layout, a, phase)
        return rows if payload in (None, carries) else np.zeros_like(rows)
    key = ("kv-rows-ring", backward, step, payload)
    if key not in layout.derived:
        own, out = owned_rows(layout), np.zeros(layout.size, dtype=np.int64)
        for gradients, carried in ((False, payload in (None, "kv")),
                                   (True, backward and payload in (None, "dkv"))):
            sources = ring_sources(layout, gradients)
            if carried and step < len(sources):
                src = sources[step]
                out = out + np.where(src >= 0, own[np.maximum(src, 0)], 0)
        layout.derived[key] = out
    return layout.derived[key]


def ring_sources(layout: Layout, gradients: bool) -> np.ndarray:
    """[step, rank]: whose shard each rank receives at each step of its group's ring (-1: none),
    once per ownership: step s brings the shard of the member s + 1 places back while s < m - 1
    (K/V, the forward's and the backward's); their partial dK/dV (`gradients`) ride from the
    second step on, and step m - 1 takes each shard's gradients home (its own). A layout's cp
    groups are equal in size. `step_received` counts a step's rows from it, the planner's ring
    chains price each hop by it (`bounds.hop_chain`)."""
    key = ("ring-sources", gradients)
    if key not in layout.derived:
        groups = np.array(layout.cp_groups())  # [group, member]
        m = groups.shape[1]
        step = np.arange(m)[:, None]
        src = groups[:, (np.arange(m)[None, :] - step - 1) % m]  # [group, step, member]
        carries = step < m - 1
        if gradients:
            home = step == m - 1
            src = np.where(home, groups[:, None, :], src)
            carries = (carries & (step >= 1)) | home
        out = np.full((m, layout.size), -1)
        out[:, groups.ravel()] = np.where(carries, src, -1).transpose(1, 0, 2).reshape(m, -1)
        layout.derived[key] = out
    return layout.derived[key]


def ring_senders(layout: Layout) -> tuple[int, ...]:
    """The rank each one receives from in a ring: the previous member of its group (once per
    ownership: every ring step of every layer asks)."""
    key = ("ring-senders",)
    if key not in layout.derived:
        prev = list(range(layout.size))
        for g in layout.cp_groups():
            for i, r in enumerate(g):
                prev[r] = g[i - 1]
        layout.derived[key] = tuple(prev)
    return layout.derived[key]


def packed_rows(layout: Layout, a: AttentionSpec) -> np.ndarray:
    """Rows each rank copies into one send buffer in the forward exchange: its shard once for
    an all-gather (every member receives the same buffer), every row it sends for an all-to-all."""
    kind = pattern(layout, a, "forward")
    key = ("packed-rows", kind, a.window if kind == "all-to-all" else None)  # once per ownership
    if key not in layout.derived:
        layout.derived[key] = _packed_rows(layout, a, kind)
    return layout.derived[key]


def _packed_rows(layout: Layout, a: AttentionSpec, kind: str) -> np.ndarray:
    if kind == "all-to-all":
        return _alltoall_rows(layout, a.window).sum(axis=0)
    if kind == "all-gather":
        own, out = owned_rows(layout), np.zeros(layout.size, dtype=np.int64)
        for g in map(np.array, layout.cp_groups()):
            out[g] = own[g] if len(g) > 1 else 0
        return out
    return np.zeros(layout.size, dtype=np.int64)


def held(layout: Layout, what: str) -> np.ndarray:
    """Positions ("positions"), noisy positions ("noisy") or clean K/V rows it owns ("context")
    of each rank: counts the graph and the memory model both read, once per ownership."""
    key = ("held", what)
    if key not in layout.derived:
        L = layout.seq_len
        count = {"positions": lambda s: s.n_positions,
                 "noisy": lambda s: _inside(s.positions, 0, L),
                 "context": lambda s: _inside(s.owned_kv, L, 2 * L)}[what]
        layout.derived[key] = np.array([count(s) for s in layout.shares], dtype=np.int64)
    return layout.derived[key]


def _inside(spans: tuple[Span, ...], lo: int, hi: int) -> int:
    """Positions of `spans` (sorted, disjoint, as a layout keeps them) inside [lo, hi): the run
    of spans that overlap it found by bisection, its two ends clipped."""
    i, j = overlapping(spans, lo, hi)
    if i == j or hi <= lo:
        return 0
    first, last = spans[i], spans[j - 1]
    return size(spans[i:j]) - max(0, lo - first[0]) - max(0, last[1] - hi)


def owned_rows(layout: Layout) -> np.ndarray:
    key = ("owned-rows",)
    if key not in layout.derived:
        layout.derived[key] = np.array([size(s.owned_kv) for s in layout.shares], dtype=np.int64)
    return layout.derived[key]


def _received(layout: Layout, a: AttentionSpec, kind: str, backward: bool) -> np.ndarray:
    n = layout.size
    if kind == "none":
        return np.zeros(n, dtype=np.int64)
    if kind == "all-to-all":
        sent = _alltoall_rows(layout, a.window)  # [dst, src]
        return sent.sum(axis=0) if backward else sent.sum(axis=1)  # backward: gradients go home
    own, out = owned_rows(layout), np.zeros(n, dtype=np.int64)
    for g in map(np.array, layout.cp_groups()):
        total, mine = own[g].sum(), own[g]
        if kind == "all-gather":  # every other member's shard; backward: own shard from each
            out[g] = (len(g) - 1) * mine if backward else total - mine
        elif len(g) == 1:  # a ring of one: only the last hop, home to itself
            out[g] = mine if backward else 0
        else:  # ring: the other shards pass by; backward also their partial dK/dV (all but the
            # previous member's shard), the last hop bringing each rank its own
            out[g] = (total - mine) + (total - np.roll(mine, 1) if backward else 0)
    return out


def _alltoall_rows(layout: Layout, window: int) -> np.ndarray:
    """[dst, src] rows of src's shard that dst's queries read (a windowed CSBP exchange)."""
    key = ("kv-rows-alltoall", window)
    if key in layout.derived:
        return layout.derived[key]
    n = layout.size
    rows = np.zeros((n, n), dtype=np.int64)
    disjoint = []  # groups whose members' shards do not overlap: counted all at once
    for g in layout.cp_groups():
        owned = [normalize(layout.shares[r].owned_kv) for r in g]
        starts = np.array([s for spans in owned for s, _ in spans], dtype=np.int64)
        stops = np.array([e for spans in owned for _, e in spans], dtype=np.int64)
        src = np.repeat(np.array(g), [len(spans) for spans in owned])
        order = np.argsort(starts, kind="stable")
        if (starts.size and (stops[order][:-1] <= starts[order][1:]).all()  # shards disjoint
                and type(layout).needed_kv is Layout.needed_kv):  # the rule `_group_rows` follows
            disjoint.append((g, starts, stops, src))
            continue
        for dst, mine in zip(g, owned):
            need = subtract(layout.needed_kv(dst, window), mine)
            if not need or not starts.size:
                continue
            s, e = np.array(need, dtype=np.int64).T
            overlap = np.minimum(e[:, None], stops) - np.maximum(s[:, None], starts)
            np.add.at(rows[dst], src, np.maximum(overlap, 0).sum(axis=0))
            rows[dst, dst] = 0
    if disjoint:
        _group_rows(layout, disjoint, window, rows)
    layout.derived[key] = rows
    return rows


def _group_rows(layout: Layout, groups: list[tuple], window: int, rows: np.ndarray) -> None:
    """`_alltoall_rows` of the cp groups whose members' shards are disjoint, every member of
    every such group at once, into `rows`: the K/V spans each member's queries read
    (`Layout.needed_kv`'s per-block intervals, as arrays, a clean span's blocks as the one span
    they merge into, merged as `normalize` merges them), then for each merged span the owned
    spans of its group it overlaps (found by bisection: a group's owned spans are disjoint, so
    sorted by start and by stop alike) and its rows inside each. Only overlapping (needed span,
    owned span) pairs are visited, not every reader against every owned span of its group: a
    windowed reader needs the neighbourhood of its own blocks. A member's own
    rows are not sent (its diagonal is 0); since the shards are disjoint, its own shard never
    overlaps another member's, so nothing else changes by not subtracting it first. `groups`:
    (members, owned span starts, stops, owners) each. Same integers as the span-by-span count
    (tests/test_kv_rows.py)."""
    L, b, W = layout.seq_len, layout.block, window
    far = 4 * L  # past every position: rank r's spans at r * far never touch rank r + 1's
    q = [(r, a, z) for g, *_ in groups for r in g for a, z in layout.shares[r].positions]
    if not q:
        return
    who, q0, q1 = np.array(q, dtype=np.int64).T
    # clean queries (at or above L): each block's keys [first - W + 1, its end or last + W) touch
    # the next block's (W >= 1, so a whole block's reach ends where the next one starts), so a
    # span's blocks read one merged span, from its first query's window to its last block's end:
    # counted per span, not per block (a clean shard holds hundreds of blocks)
    c0, c1 = np.maximum(q0, L), q1
    clean = c1 > c0
    cw, c0, c1 = who[clean], c0[clean] - L, c1[clean] - L  # original positions
    last_block = (c1 - 1) // b * b
    clean_s = L + np.maximum(0, c0 - W + 1)
    clean_e = L + np.minimum(last_block + b, c1 - 1 + W)
    # noisy queries, block by block: own noisy block (up to the window) + earlier clean blocks
    q1 = np.minimum(q1, L)
    keep = q1 > q0
    who, q0, q1 = who[keep], q0[keep], q1[keep]
    k0, k1 = q0 // b, (q1 - 1) // b
    count = np.maximum(k1 - k0 + 1, 0)
    span = np.repeat(np.arange(q0.size), count)
    blk_start = (k0[span] + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)) * b
    a, z = np.maximum(q0[span], blk_start), np.minimum(q1[span], blk_start + b)
    i0, first, last = blk_start, a, z - 1  # below L: original positions
    lo = np.maximum(0, first - W + 1)
    hi = np.minimum(i0 + b, last + W)
    s1 = np.maximum(blk_start, a - (first - lo))
    e1 = np.minimum(blk_start + b, z - 1 + (hi - last))
    s2, e2 = L + lo, L + i0
    off = np.concatenate([who[span], who[span], cw]) * far
    ns = np.concatenate([s1, s2, clean_s]) + off
    ne = np.concatenate([e1, e2, clean_e]) + off
    keep = ne > ns
    ns, ne = ns[keep], ne[keep]
    o = np.lexsort((ne, ns))
    ns, ne = ns[o], ne[o]
    reach = np.maximum.accumulate(ne)
    new = np.concatenate([[True], ns[1:] > reach[:-1]])  # merged as `normalize` merges
    first_i = np.flatnonzero(new)
    seg_a, seg_z = ns[first_i], np.maximum.reduceat(ne, first_i)
    reader = seg_a // far
    # the groups' owned spans, each group apart (group k at k * far), in order of position
    members = np.concatenate([np.asarray(g, dtype=np.int64) for g, *_ in groups])
    group_of = np.zeros(layout.size, dtype=np.int64)
    group_of[members] = np.repeat(np.arange(len(groups)), [len(g) for g, *_ in groups])
    per_group = np.array([len(src) for *_, src in groups], dtype=np.int64)  # owned spans
    group_off = np.repeat(np.arange(len(groups), dtype=np.int64), per_group) * far
    lo = np.concatenate([st for _, st, _, _ in groups]) + group_off
    hi = np.concatenate([sp for _, _, sp, _ in groups]) + group_off
    owner = np.concatenate([src for *_, src in groups])
    order = np.argsort(lo, kind="stable")
    lo, hi, owner = lo[order], hi[order], owner[order]
    # each needed span moved to its reader's group: the owned spans it overlaps run from the
    # first that ends after its start to the last that starts before its end
    shift = (group_of[reader] - reader) * far
    a, z = seg_a + shift, seg_z + shift
    i0 = np.searchsorted(hi, a, side="right")
    count = np.maximum(np.searchsorted(lo, z, side="left") - i0, 0)
    span = np.repeat(np.arange(a.size), count)
    k = i0[span] + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    overlap = np.minimum(z[span], hi[k]) - np.maximum(a[span], lo[k])
    np.add.at(rows, (reader[span], owner[k]), overlap)
    rows[members, members] = 0
