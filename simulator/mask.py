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

from simulator.spans import Span


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


def visible_counts(positions: np.ndarray, seq_len: int, block: int,
                   window: int | None = None) -> np.ndarray:
    """Number of keys each query position sees (closed form of `visible`, O(n) not O(n^2))."""
    p = np.asarray(positions, dtype=np.int64)
    noisy = p < seq_len
    i = p % seq_len
    start = (i // block) * block  # first token of the query's block
    w = np.int64(window) if window is not None else np.int64(2 * seq_len + 1)
    lo = np.maximum(0, i - w + 1)  # earliest position the window admits
    hi = i + w - 1  # latest
    # noisy: own noisy block within the window, plus clean tokens before the block
    own = np.minimum(start + block - 1, hi) - np.maximum(start, lo) + 1
    clean_before = np.maximum(0, start - lo)
    # clean: clean tokens of earlier blocks and of its own block, within the window
    clean_upto = np.minimum(start + block - 1, hi) - lo + 1
    return np.where(noisy, own + clean_before, clean_upto)


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
