"""Layouts that objectives derive from the BD3-LM layout: drafter anchors, and the canvas view.

Both keep the 2L coordinates of `layout.py` ([noisy ; clean]) and the Layout's exchange rules, so
K/V movement, pair counting and the step graph work unchanged on them:
- `AnchorLayout` (dflash2): the noisy stream holds only the draft blocks that start at the
  sampled anchors; the clean stream holds the target's features, which are keys only. A draft
  block at anchor block k sees clean blocks < k and itself, which is the BD3-LM mask.
- `CanvasLayout` (diffusiongemma self-conditioning): the same ownership as the main layout, with
  only the noisy (canvas) positions as queries.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from csbp.simulator.layout.layout import Layout, RankShare, assign_blocks, zigzag
from csbp.simulator.layout.spans import intersect, normalize


def anchor_blocks(n_blocks: int, anchors: int) -> tuple[int, ...]:
    """Blocks where `anchors` uniformly sampled anchors sit on average: evenly spaced, distinct."""
    a = min(anchors, n_blocks)
    return tuple((2 * j + 1) * n_blocks // (2 * a) for j in range(a))


@dataclass(frozen=True)
class AnchorLayout(Layout):
    """Draft blocks at the anchors as queries; target features (clean stream) as K/V only.

    DP/single: everything on one rank. CP: the context zigzags over cp ranks and every rank runs
    every draft block (conventional CP replicates the block-local decoder). BP: anchors dealt by
    the block schedule, each rank holding the context prefix its anchors read. CSBP: anchors dealt
    as in BP, context zigzagged over each cp sub-group.
    """

    anchors: int = 2048

    def _build_shares(self) -> tuple[RankShare, ...]:
        L, b, p = self.seq_len, self.block, self.plan
        blocks = anchor_blocks(L // b, self.anchors)

        def drafts(ks) -> tuple:
            return normalize(self._block_span(k) for k in ks)

        if p.kind in ("single", "dp"):
            return (RankShare(0, drafts(blocks), ((L, 2 * L),), blocks, 0),)
        if p.kind == "cp":
            return tuple(RankShare(r, drafts(blocks), zigzag(L, p.cp, r, offset=L), blocks, 0)
                         for r in range(p.cp))
        shares = []
        for r, idx in enumerate(assign_blocks(len(blocks), p.bp, p.schedule)):
            mine = tuple(blocks[i] for i in idx)
            if p.kind == "bp":
                context = ((L, L + max(mine) * b),) if mine and max(mine) else ()
                shares.append(RankShare(r, drafts(mine), context, mine, 0))
            else:
                shares.append(RankShare(r, drafts(mine), zigzag(L, p.cp, r % p.cp, offset=L),
                                        mine, r // p.cp))
        return tuple(shares)


@dataclass(frozen=True)
class CanvasLayout(Layout):
    """The main layout with only its noisy (canvas) positions as queries."""

    def _build_shares(self) -> tuple[RankShare, ...]:
        noisy = ((0, self.seq_len),)
        return tuple(replace(s, positions=intersect(s.positions, noisy)) for s in super()._build_shares())


def canvas_view(layout: Layout) -> CanvasLayout:
    return CanvasLayout(layout.seq_len, layout.block, layout.plan, layout.checkpointing)
