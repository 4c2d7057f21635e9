"""Layouts that objectives derive from the BD3-LM layout: drafter anchors, and the canvas view.

Both keep the 2L coordinates of `layout.py` ([noisy ; clean]) and the Layout's exchange rules, so
K/V movement, pair counting and the step graph work unchanged on them:
- `AnchorLayout` (dflash2): the noisy stream holds only the draft blocks that start at the
  sampled anchors; the clean stream holds the target's features, which are keys only. A draft
  block at anchor block k sees clean blocks < k and itself, which is the BD3-LM mask.
- `CanvasLayout` (diffusiongemma self-conditioning and its trained decoder stream): the same
  ownership as the main layout, with only the noisy (canvas) positions as queries.
- `EncoderLayout` (diffusiongemma's encoder stream): the main layout's clean rows only, as
  queries and owned K/V (`stream_views` gives both streams' views). Under pure CP both views
  either keep the 2L zigzag's ownership or shard each stream on its own (the implementation
  profile's `stream_ownership`).
- `CausalLayout` (ar): one causal sequence held in the clean stream's coordinates at block 1.

CausalLayout API (what the simulator prices and a runtime executes for objective ar):
- `Layout.build(workload, plan)` returns it for `workload.objective == "ar"` (the workload's block
  is 1: `Workload._causal_block`). `seq_len` = L, `block` = 1.
- Token t of the sequence sits at position L + t ([L, 2L), the clean stream); no position is
  below L (no noisy stream). `token_spans(rank)` gives a rank's tokens in [0, L).
- `mask.visible(q, k, L, 1)` on those positions is the causal mask k <= q (the clean-to-clean
  rule at block 1), so `pairs`, `QueryIntervals`, `kv_rows` and `tiles` count it unchanged:
  L(L+1)/2 pairs in all.
- single/dp: one rank holds [L, 2L). cp: head-tail load balancing as TorchTitan and
  Megatron-Core shard it (frameworks.md A1, B1): 2cp chunks of C = L / 2cp, rank r holds chunks r
  and 2cp-1-r (`layout.zigzag`), queries and owned K/V alike, so every rank has 2C tokens and
  the same 2cp C^2 + C causal pairs, L(L+1)/2 / cp (tests/test_ar_objective.py).
- `exchange(layer, phase)` is the Layout's: an all-gather of every member's K/V (transport
  collective; backward: dK/dV reduce-scattered home) or a pass-KV ring of cp - 1 steps (transport
  ring; backward: K/V again and dK/dV, cp - 1 hops each). What a framework adds on top (the
  torch backward re-gathering K/V, dK/dV on their own ring, K/V repeated to the query heads,
  Ulysses all-to-alls) is the implementation profile's (`system/implementation.py`), priced by
  the step graph, not a change of ownership.
- BP and CSBP have no blocks to deal out: `plan/rules.py` refuses them for ar; building such a
  layout raises InputError.
"""

from __future__ import annotations

import itertools

import functools

from dataclasses import dataclass, replace

import numpy as np

from csbp.simulator.errors import InputError
from csbp.simulator.layout.layout import Layout, RankShare, assign_blocks, zigzag
from csbp.simulator.layout.spans import (Span, block_spans_each, flat_lists, intersect, normalize, shift,
                                         spans_per_list, subtract)


def anchor_blocks(n_blocks: int, anchors: int) -> tuple[int, ...]:
    """Blocks where `anchors` uniformly sampled anchors sit on average: evenly spaced, distinct."""
    a = min(anchors, n_blocks)
    return tuple((2 * j + 1) * n_blocks // (2 * a) for j in range(a))


def locality_anchor_blocks(n_blocks: int, anchors: int) -> tuple[int, ...]:
    """Anchors sampled with "locality" (implementation.md section 14, `_sample_locality_anchors`):
    adjacent anchors one block apart, i.e. one contiguous run of blocks; placed at the centre of
    the context, where a uniformly drawn run sits on average [U: run position]."""
    a = min(anchors, n_blocks)
    start = (n_blocks - a) // 2
    return tuple(range(start, start + a))


def window_union(blocks, seq_len: int, block: int, window: int | None) -> tuple:
    """Clean rows (2L coordinates) the draft blocks at `blocks` read through a window: the union
    of their windows, the context a windowed drafter trims to (implementation.md section 14,
    `compact_dflash_target_context`); None: no window, nothing trimmed."""
    return None if window is None else window_unions([blocks], seq_len, block, window)[0]


def window_unions(lists, seq_len: int, block: int, window: int) -> list[tuple]:
    """`window_union` of each list of blocks, all lists at once (a search deals thousands of
    anchors over up to a thousand ranks): windows of sorted blocks start and end in order, so one
    merges into the one before it in its list where it starts at or before that one's end."""
    which, k = flat_lists(lists)
    order = np.lexsort((k, which))
    which, k = which[order], k[order]
    which, k = which[k != 0], k[k != 0]
    if not k.size:
        return [()] * len(lists)
    lo, hi = seq_len + np.maximum(0, k * block - window + 1), seq_len + k * block
    first = np.flatnonzero(np.concatenate([[True], (which[1:] != which[:-1]) | (lo[1:] > hi[:-1])]))
    last = np.append(first[1:], k.size) - 1
    return spans_per_list(len(lists), which[first], lo[first], hi[last])


@dataclass(frozen=True)
class AnchorLayout(Layout):
    """Draft blocks at the anchors as queries; target features (clean stream) as K/V only.

    DP/single: everything on one rank. CP: the context zigzags over cp ranks and every rank runs
    every draft block (conventional CP replicates the block-local decoder). BP: anchors dealt by
    the block schedule, each rank holding the context prefix its anchors read. CSBP: anchors dealt
    as in BP, context zigzagged over each cp sub-group.
    """

    anchors: int = 2048
    # every draft layer's attention window (None: not all windowed): the context each rank keeps
    # is trimmed to the union of its anchors' windows (section 14), flat in the context length
    window: int | None = None

    def _build_shares(self) -> tuple[RankShare, ...]:
        L, b, p, W = self.seq_len, self.block, self.plan, self.window
        blocks = locality_anchor_blocks(L // b, self.anchors)
        every = window_union(blocks, L, b, W)

        def trimmed(context, union) -> tuple:
            return context if W is None else intersect(context, union)

        if p.kind in ("single", "dp"):
            return (RankShare(0, block_spans_each([blocks], b)[0], trimmed(((L, 2 * L),), every), blocks, 0),)
        if p.kind == "cp":
            mine = block_spans_each([blocks], b)[0]
            return tuple(RankShare(r, mine, trimmed(zigzag(L, p.cp, r, offset=L), every), blocks, 0)
                         for r in range(p.cp))
        dealt = [tuple(map(blocks.__getitem__, ix)) for ix in assign_blocks(len(blocks), p.bp, p.schedule)]
        spans = block_spans_each(dealt, b)
        if p.kind == "bp":  # each rank's context: the prefix its anchors read, trimmed to their windows
            unions = window_unions(dealt, L, b, W) if W is not None else [None] * len(dealt)
            return tuple(RankShare(r, spans[r], trimmed(((L, L + max(mine) * b),) if mine and max(mine) else (),
                                                        unions[r]), mine, 0)
                         for r, mine in enumerate(dealt))
        # CSBP: each cp sub-group trims its zigzag shard to its anchors' windows [U]
        groups = [tuple(itertools.chain.from_iterable(dealt[g:g + p.cp])) for g in range(0, len(dealt), p.cp)]
        unions = window_unions(groups, L, b, W) if W is not None else [None] * len(groups)
        shares = [RankShare(r, spans[r], trimmed(zigzag(L, p.cp, r % p.cp, offset=L), unions[r // p.cp]),
                            mine, r // p.cp) for r, mine in enumerate(dealt)]
        return tuple(shares)


def untrimmed(layout: Layout) -> Layout:
    """The layout before a windowed drafter's trim: each rank's feature shard as it is read and
    copied to the GPU (the trim happens after the copy, implementation.md section 14)."""
    return replace(layout, window=None) if getattr(layout, "window", None) else layout


@dataclass(frozen=True)
class WholeCleanLayout(Layout):
    """DiffusionGemma under pure BP (`kv_backend: replicated`): every rank runs the whole clean
    stream (implementation.md section 12, `clean_positions = arange(seq_len)`) beside its own
    noisy blocks, so clean compute and clean K/V are not divided by BP."""

    def _build_shares(self) -> tuple[RankShare, ...]:
        return _whole_clean(self, super()._build_shares())


def _whole_clean(layout: Layout, shares: tuple[RankShare, ...]) -> tuple[RankShare, ...]:
    """Pure BP's shares with the whole clean stream on every rank (others unchanged)."""
    if layout.plan.kind != "bp":
        return shares
    clean = ((layout.seq_len, 2 * layout.seq_len),)
    return tuple(replace(s, positions=normalize(subtract(s.positions, clean) + clean), owned_kv=clean)
                 for s in shares)


def _per_stream(layout: Layout, shares: tuple[RankShare, ...]) -> tuple[RankShare, ...]:
    """Pure CP's shares with each stream sharded on its own (`stream_ownership: per-stream`):
    rank r holds chunks r and 2cp-1-r of the noisy stream's 2cp chunks and the same of the clean
    stream's, as queries and owned K/V, so each stream alone is balanced (the 2L zigzag balances
    only the two together). Chunk bounds at k L // 2cp: no row is dropped where 2cp does not
    divide L. Other plan kinds unchanged: CSBP's clean shard is already the clean stream's own
    zigzag and its noisy blocks are whole; DP and BP hold whole streams or blocks."""
    if layout.plan.kind != "cp":
        return shares
    L, n = layout.seq_len, 2 * layout.plan.cp

    def chunks(r: int, offset: int) -> list[Span]:
        return [(offset + k * L // n, offset + (k + 1) * L // n) for k in (r, n - 1 - r)]

    return tuple(replace(s, positions=normalize(chunks(s.rank, 0) + chunks(s.rank, L)),
                         owned_kv=normalize(chunks(s.rank, 0) + chunks(s.rank, L))) for s in shares)


@dataclass(frozen=True)
class CanvasLayout(Layout):
    """The main layout with only its noisy (canvas) positions as queries; `per_stream`: under
    pure CP each stream zigzagged on its own (`_per_stream`) before the canvas is taken."""

    per_stream: bool = False

    def _build_shares(self) -> tuple[RankShare, ...]:
        noisy = ((0, self.seq_len),)
        shares = _main_shares(self)
        if self.per_stream:
            shares = _per_stream(self, shares)
        return tuple(replace(s, positions=intersect(s.positions, noisy)) for s in shares)


def _main_shares(view: Layout) -> tuple[RankShare, ...]:
    """`Layout._build_shares` of a view's fields: the main layout's shares, made once per
    ownership (`layout._ownership`) for the layout and all its views, not again per view."""
    return Layout(view.seq_len, view.block, view.plan, view.checkpointing).shares


def canvas_view(layout: Layout, per_stream: bool = False) -> CanvasLayout:
    return _view(CanvasLayout, layout.seq_len, layout.block, layout.plan, layout.checkpointing,
                 per_stream=per_stream)


@functools.lru_cache(maxsize=1024)
def _view(cls: type, *fields, **flags) -> Layout:
    """A view, made once per (class, fields): views are immutable, and every graph, bound and
    memory estimate of a candidate asks for the same ones."""
    return cls(*fields, **flags)


@dataclass(frozen=True)
class EncoderLayout(Layout):
    """DiffusionGemma's encoder stream (implementation.md section 12): the main layout's clean
    rows only, as queries and as owned K/V (the encoder makes no noisy K/V); `whole_clean`: the
    main layout is `WholeCleanLayout` (pure BP, every rank the whole clean stream); `per_stream`:
    under pure CP the clean stream zigzagged on its own (`_per_stream`)."""

    whole_clean: bool = False
    per_stream: bool = False

    def _build_shares(self) -> tuple[RankShare, ...]:
        shares = _main_shares(self)
        if self.whole_clean:
            shares = _whole_clean(self, shares)
        if self.per_stream:
            shares = _per_stream(self, shares)
        clean = ((self.seq_len, 2 * self.seq_len),)
        return tuple(replace(s, positions=intersect(s.positions, clean), owned_kv=intersect(s.owned_kv, clean))
                     for s in shares)


def stream_views(layout: Layout, ownership: str = "shared-2l") -> tuple[EncoderLayout, CanvasLayout]:
    """(encoder, decoder) views of a two-stream objective's layout: the encoder over the clean
    rows, the decoder over the noisy canvas (`CanvasLayout`: noisy queries, the same owned K/V,
    so its exchange fetches the clean K/V the encoder made). `ownership`: the implementation
    profile's `stream_ownership`; `per-stream` shards each stream on its own under pure CP
    (both views the same clean rows, so the decoder still reads the K/V the encoder made)."""
    per_stream = ownership == "per-stream"
    enc = _view(EncoderLayout, layout.seq_len, layout.block, layout.plan, layout.checkpointing,
                whole_clean=isinstance(layout, WholeCleanLayout), per_stream=per_stream)
    return enc, canvas_view(layout, per_stream)


@dataclass(frozen=True)
class CausalLayout(Layout):
    """Objective ar: a causal L-token sequence in the clean coordinates [L, 2L) at block 1 (the
    module docstring gives the API). DP holds everything; CP deals head-tail chunks."""

    def _build_shares(self) -> tuple[RankShare, ...]:
        L, p = self.seq_len, self.plan
        if p.kind in ("single", "dp"):
            everything = ((L, 2 * L),)
            return (RankShare(0, everything, everything, (), 0),)
        if p.kind == "cp":
            return tuple(RankShare(r, zigzag(L, p.cp, r, offset=L), zigzag(L, p.cp, r, offset=L), (), 0)
                         for r in range(p.cp))
        raise InputError(f"objective ar has no blocks to deal out: {p.kind} needs block diffusion's "
                         "noisy blocks")

    def token_spans(self, rank: int) -> tuple[Span, ...]:
        """The sequence tokens [0, L) rank holds (its positions less the clean stream's offset)."""
        return shift(self.shares[rank].positions, -self.seq_len)
