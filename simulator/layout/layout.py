"""The plan layout: the one source of truth shared by the simulator and the runtime.

For one context group (the max(cp, bp) ranks that share a sequence) it says
- which positions of the 2L sequence each rank computes (queries, projections, MLP),
- whose K/V each rank owns (and receives gradients for),
- which noisy blocks each rank owns (BP/CSBP),
- per attention layer kind, which K/V rows move from whom to whom in forward, recompute and
  backward, step by step (`RingStep`; a collective is one step with every transfer),
- how many attention pairs each rank computes, counted from the mask.

Objective ar (plain autoregressive) holds one causal L-token sequence in the clean stream's
coordinates at block 1 (`objective_layout.CausalLayout`, whose docstring gives its API).

Plans (see plan.py): DP/single hold all 2L positions; CP zigzags the 2L sequence over cp ranks
and all-gathers every K/V row (noisy ones too); pure BP gives each rank whole noisy blocks and
the clean prefix they need, replicated; CSBP gives each rank whole noisy blocks and a zigzag
shard of the clean sequence, and moves only clean K/V (bp / cp replicas of the clean sequence
when bp > cp, each all-gathering inside its own cp ranks).

Pure Python + numpy: no torch, no hardware.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, field, fields
from typing import Literal

from csbp.simulator.layout import mask
from csbp.simulator.plan.plan import Plan
from csbp.simulator.layout.spans import Span, block_spans_each, intersect, join_apart, normalize, size, subtract
from csbp.simulator.workload.spec import AttentionSpec
from csbp.simulator.workload.objectives import replicates_clean_under_bp
from csbp.simulator.workload.workload import Workload

Payload = Literal["kv", "dkv"]
Phase = Literal["forward", "recompute", "backward"]
Pattern = Literal["none", "all-gather", "all-to-all", "ring"]


@dataclass(frozen=True)
class KVTransfer:
    """Rows of K/V (or of their gradients) that one rank sends to another."""

    src: int
    dst: int
    rows: tuple[Span, ...]  # positions of the 2L sequence
    payload: Payload = "kv"

    @property
    def n_rows(self) -> int:
        return size(self.rows)


@dataclass(frozen=True)
class RingStep:
    """Transfers that happen together. A collective is a single step; a ring has P-1."""

    transfers: tuple[KVTransfer, ...]


@dataclass(frozen=True)
class Exchange:
    """How one attention layer kind moves K/V in one phase."""

    pattern: Pattern
    steps: tuple[RingStep, ...] = ()
    groups: tuple[tuple[int, ...], ...] = ()  # disjoint rank sets that exchange among themselves

    def rows_received(self, rank: int, payload: Payload | None = None) -> int:
        return sum(t.n_rows for s in self.steps for t in s.transfers
                   if t.dst == rank and (payload is None or t.payload == payload))

    def rows_sent(self, rank: int, payload: Payload | None = None) -> int:
        return sum(t.n_rows for s in self.steps for t in s.transfers
                   if t.src == rank and (payload is None or t.payload == payload))


NO_EXCHANGE = Exchange("none")


@dataclass(frozen=True)
class RankShare:
    """What one rank of the context group holds."""

    rank: int
    positions: tuple[Span, ...]  # queries it computes, in [0, 2L)
    owned_kv: tuple[Span, ...]  # K/V rows it owns: gradients for them end up here
    noisy_blocks: tuple[int, ...]  # whole noisy blocks (BP, CSBP); empty for CP/DP
    cp_group: int  # which clean replica (CSBP) or 0

    @property
    def n_positions(self) -> int:
        return size(self.positions)


def zigzag(length: int, parts: int, rank: int, offset: int = 0) -> tuple[Span, ...]:
    """Head-tail split of `length` into 2*parts chunks; rank r owns chunks r and 2*parts-1-r."""
    chunk = length // (2 * parts)
    if chunk <= 0:
        return ()
    last_idx = 2 * parts - 1 - rank  # > rank: the two chunks in order, touching at the middle
    if last_idx == rank + 1:  # normalised: one span
        return ((offset + rank * chunk, offset + (last_idx + 1) * chunk),)
    return ((offset + rank * chunk, offset + (rank + 1) * chunk),
            (offset + last_idx * chunk, offset + (last_idx + 1) * chunk))


def assign_blocks(n_blocks: int, n_ranks: int, schedule: str) -> tuple[tuple[int, ...], ...]:
    """Noisy blocks per rank.

    dual-end: blocks b and B-1-b travel together (their attention cost sums to a constant), pairs
    are dealt round-robin, an odd middle block goes to the lightest rank; with fewer pairs than
    ranks, greedy heaviest-first (LPT). contiguous: rank r gets the r-th run of blocks.
    Block i costs i+1 units (its noisy block plus i clean blocks of keys).
    """
    owned: list[list[int]] = [[] for _ in range(n_ranks)]
    if schedule == "contiguous":
        for r in range(n_ranks):
            owned[r] = list(range(r * n_blocks // n_ranks, (r + 1) * n_blocks // n_ranks))
        return tuple(tuple(o) for o in owned)
    load = [0] * n_ranks
    n_pairs = n_blocks // 2
    if n_pairs >= n_ranks:
        for p in range(n_pairs):
            r = p % n_ranks
            owned[r] += [p, n_blocks - 1 - p]
            load[r] += n_blocks + 1
        rest = [n_pairs] if n_blocks % 2 else []
    else:
        rest = list(range(n_blocks - 1, -1, -1))  # heaviest first
    # the lightest rank (fewest blocks, then lowest rank, on ties) takes the next: a heap of
    # (load, blocks, rank), so a thousand ranks cost a thousand pops, not a scan each
    lightest = [(load[i], len(owned[i]), i) for i in range(n_ranks)]
    heapq.heapify(lightest)
    for blk in rest:
        _, _, r = heapq.heappop(lightest)
        owned[r].append(blk)
        load[r] += blk + 1
        heapq.heappush(lightest, (load[r], len(owned[r]), r))
    return tuple(tuple(sorted(o)) for o in owned)


_OWN_FIELDS: dict[type, tuple[str, ...]] = {}  # per layout class: `ownership_key`'s fields


@dataclass(frozen=True)
class Layout:
    """Ownership and K/V movement of one context group for (workload, plan)."""

    seq_len: int
    block: int
    plan: Plan
    checkpointing: str = "full"
    shares: tuple[RankShare, ...] = field(init=False)
    # what follows from the shares (with the plan's transport and the checkpointing, where they
    # matter), shared by every layout that owns the same positions
    derived: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shares, derived = _ownership(self)
        object.__setattr__(self, "shares", shares)
        object.__setattr__(self, "derived", derived)

    @classmethod
    def build(cls, workload: Workload, plan: Plan) -> "Layout":
        """The layout of (workload, plan); a DFlash drafter's draft blocks sit at its anchors.

        Cached: a layout is immutable, and the planner needs each one for its memory check and
        again for the simulation.
        """
        return _build(workload, plan)

    def ownership_key(self) -> tuple:
        """What `shares` depends on: the layout's own fields (sequence, block, anchors, ...) and
        the plan's kind, cp, bp and schedule, not its dp, tp, ep, transport or checkpointing."""
        names = _OWN_FIELDS.get(type(self))
        if names is None:  # dataclasses.fields costs ~20 us: a search asks once per candidate
            names = _OWN_FIELDS[type(self)] = tuple(f.name for f in fields(self)
                                                    if f.init and f.name not in ("plan", "checkpointing"))
        own = tuple(getattr(self, name) for name in names)
        p = self.plan
        return (type(self), own, p.kind, p.cp, p.bp, p.schedule)

    # ---- ownership -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.plan.ctx

    @property
    def kind(self) -> str:
        return self.plan.kind

    def _build_shares(self) -> tuple[RankShare, ...]:
        L, p = self.seq_len, self.plan
        kind = p.kind
        if kind in ("single", "dp"):
            everything = ((0, 2 * L),)
            return (RankShare(0, everything, everything, (), 0),)
        if kind == "cp":
            return tuple(RankShare(r, zigzag(2 * L, p.cp, r), zigzag(2 * L, p.cp, r), (), 0)
                         for r in range(p.cp))
        blocks = assign_blocks(L // self.block, p.bp, p.schedule)
        shares = []
        for r, noisy in enumerate(block_spans_each(blocks, self.block)):
            if kind == "bp":  # the clean prefix its blocks read, replicated on every rank
                clean = ((L, L + max(blocks[r]) * self.block),)
                shares.append(RankShare(r, join_apart(noisy, normalize(clean)), clean, blocks[r], 0))
            else:  # csbp: clean zigzag shard of its cp sub-group, noisy K/V stay home
                clean = zigzag(L, p.cp, r % p.cp, offset=L)
                shares.append(RankShare(r, join_apart(noisy, clean), clean, blocks[r], r // p.cp))
        return tuple(shares)

    def cp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Rank sets that exchange K/V with each other."""
        if self.kind == "cp":
            return (tuple(range(self.plan.cp)),)
        if self.kind == "csbp":
            cp = self.plan.cp
            return tuple(tuple(range(g * cp, (g + 1) * cp)) for g in range(self.plan.bp // cp))
        return tuple((r,) for r in range(self.size))

    # ---- work ------------------------------------------------------------------------------
    def pairs(self, rank: int, window: int | None = None) -> int:
        """Attention pairs rank computes per head per layer (queries x visible keys)."""
        return mask.pairs(self.shares[rank].positions, self.seq_len, self.block, window)

    def computed_pairs(self, rank: int, window: int | None = None) -> set[tuple[int, int]]:
        """The explicit (query, key) pairs of a rank: for small test layouts only."""
        out = set()
        for q in mask.span_positions(self.shares[rank].positions):
            keys = mask.span_positions(((0, 2 * self.seq_len),))
            vis = mask.visible(q, keys, self.seq_len, self.block, window)
            out.update((int(q), int(k)) for k in keys[vis])
        return out

    def needed_kv(self, rank: int, window: int | None = None) -> tuple[Span, ...]:
        """K/V rows the rank's queries read (only clean rows can come from elsewhere in CSBP)."""
        L, b, W = self.seq_len, self.block, window
        need: list[Span] = []
        for q0, q1 in self.shares[rank].positions:
            for blk_start in range(q0 - q0 % b, q1, b):  # one block of queries at a time
                a, z = max(q0, blk_start), min(q1, blk_start + b)
                i0, first, last = blk_start % L, a % L, (z - 1) % L  # original positions
                lo = 0 if W is None else max(0, first - W + 1)
                hi = i0 + b if W is None else min(i0 + b, last + W)
                if a < L:  # noisy queries: own noisy block + earlier clean blocks
                    need += [(max(blk_start, a - (first - lo)), min(blk_start + b, z - 1 + (hi - last))),
                             (L + lo, L + i0)]
                else:  # clean queries: clean blocks up to their own
                    need.append((L + lo, L + hi))
        return normalize(need)

    # ---- K/V movement ----------------------------------------------------------------------
    def exchange(self, layer: AttentionSpec, phase: Phase) -> Exchange:
        """K/V movement of one attention layer in one phase (cached per layer kind and ownership)."""
        key = ("exchange", self.plan.transport, self.checkpointing, layer.kind, layer.window, phase)
        if key not in self.derived:
            self.derived[key] = self._exchange(layer, phase)
        return self.derived[key]

    def _exchange(self, layer: AttentionSpec, phase: Phase) -> Exchange:
        if self.kind not in ("cp", "csbp") or layer.kind == "linear":
            return NO_EXCHANGE
        if phase == "recompute" and self.checkpointing != "full":
            return NO_EXCHANGE
        groups = self.cp_groups()
        window = layer.window if layer.kind == "sliding" else None
        if window is not None and self.kind == "csbp":
            fwd = self._visible_rows_alltoall(groups, window)
            if phase == "backward":
                return Exchange("all-to-all", (_reversed(fwd),), groups)
            return Exchange("all-to-all", (fwd,), groups)
        if self.plan.transport == "ring":
            return Exchange("ring", self._ring_steps(groups, backward=phase == "backward"), groups)
        gather = RingStep(tuple(
            KVTransfer(src, dst, self.shares[src].owned_kv)
            for g in groups for src in g for dst in g if src != dst))
        if phase == "backward":  # reduce-scatter of dK/dV back to the owners
            return Exchange("all-gather", (_reversed(gather),), groups)
        return Exchange("all-gather", (gather,), groups)

    def _visible_rows_alltoall(self, groups, window: int) -> RingStep:
        transfers = []
        for g in groups:
            for dst in g:
                need = subtract(self.needed_kv(dst, window), self.shares[dst].owned_kv)
                for src in g:
                    if src != dst:
                        rows = intersect(need, self.shares[src].owned_kv)
                        if rows:
                            transfers.append(KVTransfer(src, dst, rows))
        return RingStep(tuple(transfers))

    def _ring_steps(self, groups, backward: bool) -> tuple[RingStep, ...]:
        """Ring over each group: at step s rank g[i] receives the K/V of g[i-s] from g[i-1].

        Backward also passes dK/dV accumulators: after step s the partial sums for the shard of
        g[i-s] move on to g[i+1], and the last hop delivers them to their owner (P-1 hops).
        """
        n = len(groups[0])
        steps = []
        for s in range(1, n):
            transfers = []
            for g in groups:
                for i, dst in enumerate(g):
                    owner, prev = g[(i - s) % n], g[(i - 1) % n]
                    transfers.append(KVTransfer(prev, dst, self.shares[owner].owned_kv, "kv"))
                    if backward and s >= 2:  # partial dK/dV of that shard travel with it
                        transfers.append(KVTransfer(prev, dst, self.shares[owner].owned_kv, "dkv"))
            steps.append(RingStep(tuple(transfers)))
        if backward:
            final = tuple(KVTransfer(g[(i - 1) % n], g[i], self.shares[g[i]].owned_kv, "dkv")
                          for g in groups for i in range(n))
            steps.append(RingStep(final))
        return tuple(steps)

    # ---- bytes -----------------------------------------------------------------------------
    def rows_received(self, rank: int, layer: AttentionSpec) -> int:
        """K/V and dK/dV rows a rank receives for one layer over forward, recompute, backward."""
        return sum(self.exchange(layer, ph).rows_received(rank)
                   for ph in ("forward", "recompute", "backward"))


@functools.lru_cache(maxsize=512)
def _build(workload: Workload, plan: Plan) -> Layout:
    if workload.objective == "ar":
        from csbp.simulator.layout.objective_layout import CausalLayout

        return CausalLayout(workload.seq_len, workload.block_size, plan, workload.checkpointing)
    if workload.objective == "dflash2":
        from csbp.simulator.layout.objective_layout import AnchorLayout

        return AnchorLayout(workload.seq_len, workload.block_size, plan, workload.checkpointing,
                            anchors=workload.max_anchors, window=workload.drafter_window)
    if plan.kind == "bp" and replicates_clean_under_bp(workload.objective):  # implementation.md 12
        from csbp.simulator.layout.objective_layout import WholeCleanLayout

        return WholeCleanLayout(workload.seq_len, workload.block_size, plan, workload.checkpointing)
    return Layout(workload.seq_len, workload.block_size, plan, workload.checkpointing)


_OWNERSHIP: dict[tuple, tuple[tuple[RankShare, ...], dict]] = {}
_OWNERSHIP_LIMIT = 512  # a search meets a few dozen; a long sweep starts over when it is full


def _ownership(layout: Layout) -> tuple[tuple[RankShare, ...], dict]:
    """(shares, derived) of the layout, built once per ownership key: plans that differ only in
    dp, tp, ep, transport or checkpointing own the same positions (most of a planner search)."""
    key = layout.ownership_key()
    if key not in _OWNERSHIP:
        if len(_OWNERSHIP) >= _OWNERSHIP_LIMIT:
            _OWNERSHIP.clear()
        _OWNERSHIP[key] = (layout._build_shares(), {})
    return _OWNERSHIP[key]


def clear_caches() -> None:
    """Forget every cached layout and ownership (a benchmark measuring a cold search)."""
    _build.cache_clear()
    _OWNERSHIP.clear()
    from csbp.simulator.layout import tiles  # its per-call caches (issue 25)

    tiles.clear_caches()
    from csbp.simulator.layout import spans  # its normalised spans

    spans._normalized.cache_clear()
    from csbp.simulator.layout import objective_layout  # its views

    objective_layout._view.cache_clear()


def kv_row_bytes(layer: AttentionSpec, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of one K/V row on the wire: heads are split over TP (GQA heads replicate if few)."""
    heads = max(1, layer.n_kv_heads // tp)
    return layer.kv_tensors * heads * layer.head_dim * dtype_bytes


def attention_bytes_received(layout: Layout, layers: tuple[AttentionSpec, ...], dtype_bytes: int,
                             tp: int = 1) -> list[int]:
    """Per rank of the context group: attention K/V + dK/dV bytes received in one step."""
    return [sum(layout.rows_received(r, layer) * kv_row_bytes(layer, dtype_bytes, tp)
                for layer in layers) for r in range(layout.size)]


def _reversed(step: RingStep) -> RingStep:
    """The same rows flowing back to their owners as gradients (reduce-scatter / reverse a2a)."""
    return RingStep(tuple(KVTransfer(t.dst, t.src, t.rows, "dkv") for t in step.transfers))
