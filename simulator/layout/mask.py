"""The BD3-LM attention mask over the 2L sequence [noisy x_t ; clean x_0], and pair counts.

Positions 0..L-1 are noisy tokens, L..2L-1 clean tokens; token i of either stream sits at
original position i % L. A noisy block sees itself (bidirectionally) and the clean blocks
before it; a clean block sees the clean blocks up to itself; clean never sees noisy. A sliding
window W further limits any pair to |i - j| < W in original positions.

`visible` uses only operators, so the same function masks numpy arrays in the simulator and
torch tensors in the runtime: the mask exists once.
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.layout.spans import Span


def visible(q, k, seq_len: int, block: int, window: int | None = None):
    """Boolean mask of (query position q, key position k), both in [0, 2L); broadcasts."""
    q_noisy, k_noisy = q < seq_len, k < seq_len
    qi, ki = q % seq_len, k % seq_len
    qb, kb = qi // block, ki // block
    mask = (q_noisy & k_noisy & (qb == kb)) | (q_noisy & ~k_noisy & (kb < qb)) | (
        ~q_noisy & ~k_noisy & (kb <= qb))
    if window is not None:
        mask = mask & (abs(qi - ki) < window)
    return mask


def visible_intervals(positions, seq_len: int, block: int, window: int | None = None):
    """The key intervals [start, stop) each query position sees: ((own_lo, own_hi), (prefix_lo, prefix_hi)).

    Every query of the mask sees at most two contiguous runs of keys: a noisy query its own noisy
    block and the clean tokens before that block, a clean query the clean tokens up to the end of
    its block (its second run is empty); the window cuts both. Counting keys, and splitting the
    work by where keys live (graph.py), then needs only interval arithmetic, never the n^2 mask.
    """
    p = np.asarray(positions, dtype=np.int64)
    noisy = p < seq_len
    i = p % seq_len
    start = (i // block) * block  # first token of the query's block
    w = np.int64(window) if window is not None else np.int64(2 * seq_len + 1)
    lo = np.maximum(0, i - w + 1)  # earliest original position the window admits
    last = np.minimum(start + block - 1, i + w - 1)  # last visible key of the query's own block
    own = (np.where(noisy, np.maximum(start, lo), seq_len + lo),
           np.where(noisy, last + 1, seq_len + last + 1))
    prefix = (np.where(noisy, seq_len + lo, 0), np.where(noisy, seq_len + np.maximum(start, lo), 0))
    return own, prefix


def visible_counts(positions: np.ndarray, seq_len: int, block: int,
                   window: int | None = None) -> np.ndarray:
    """Number of keys each query position sees (closed form of `visible`, O(n) not O(n^2))."""
    (a0, z0), (a1, z1) = visible_intervals(positions, seq_len, block, window)
    return (z0 - a0) + (z1 - a1)


def span_positions(spans: tuple[Span, ...]) -> np.ndarray:
    if not spans:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans])


def pairs(spans: tuple[Span, ...], seq_len: int, block: int, window: int | None = None) -> int:
    """Attention (query, key) pairs of the queries in `spans`: the mask's exact work."""
    return int(visible_counts(span_positions(spans), seq_len, block, window).sum())


def total_pairs(seq_len: int, block: int) -> int:
    """Full-attention pairs of the whole BD3-LM mask: L^2 + L*b (workloads.md)."""
    return seq_len * seq_len + seq_len * block
