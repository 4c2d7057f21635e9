"""A drafter's anchor layout counted with arrays (issue 25: thousands of anchors per rank made
its shares the largest cost of a DFlash2 search): the same spans as the span-by-span rules."""

from __future__ import annotations

import random

from csbp.simulator.layout.objective_layout import AnchorLayout, locality_anchor_blocks, window_union
from csbp.simulator.layout.spans import normalize
from csbp.simulator.plan.plan import Plan


def _window_union_reference(blocks, seq_len, block, window):
    """The one-pass merge before issue 25, verbatim."""
    if window is None:
        return None
    out: list[list[int]] = []
    for k in sorted(blocks):
        if not k:
            continue
        lo, hi = seq_len + max(0, k * block - window + 1), seq_len + k * block
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((a, b) for a, b in out)


def test_window_union_equals_the_one_pass_merge():
    rng = random.Random(25)
    for _ in range(2000):
        seq_len, block = rng.choice([64, 256, 1024, 262144]), rng.choice([1, 2, 4, 8, 16, 32])
        n = seq_len // block
        blocks = [rng.randrange(n) for _ in range(rng.randint(0, 40))]  # duplicates, block 0
        if rng.random() < 0.3:
            blocks = list(range(rng.randrange(n), n))[:rng.randint(0, 50)]
        window = rng.choice([None, 1, 2, block, block + 1, rng.randint(1, 3 * seq_len)])
        got = window_union(tuple(blocks), seq_len, block, window)
        assert got == _window_union_reference(blocks, seq_len, block, window)
        assert got is None or all(type(x) is int for span in got for x in span)  # hashable, JSON


def test_anchor_shares_hold_their_blocks_spans():
    """Each rank's draft positions are its anchor blocks' spans, neighbours merged (`normalize`),
    and its trimmed context lies inside the anchors' window union."""
    for plan in (Plan(cp=4), Plan(cp=2, bp=4), Plan(bp=8), Plan(cp=2, bp=8, schedule="contiguous"),
                 Plan(cp=4, bp=16)):
        for seq_len, anchors, window in ((1024, 6, None), (1024, 40, 17), (262144, 2048, 4096)):
            lay = AnchorLayout(seq_len, 16, plan, "full", anchors=anchors, window=window)
            for share in lay.shares:
                assert share.positions == normalize((k * 16, (k + 1) * 16) for k in share.noisy_blocks)
                if window is not None:
                    union = window_union(locality_anchor_blocks(seq_len // 16, anchors), seq_len, 16, window)
                    assert normalize(share.owned_kv + union) == normalize(union)
