"""Block-sparse attention over the BD3-LM mask with FlexAttention, for CUDA ranks.

Explicit masked math materialises an [Nq, Nk] score matrix per head: at 64K+ tokens per rank it
does not fit. FlexAttention computes only the (query block, key block) tiles the mask touches,
given a `BlockMask`; this module builds that BlockMask from the positions a rank's queries and
keys hold (so from the layout's spans) and never from a dense mask:

- the block structure (which tiles are empty, full or partial) comes from interval arithmetic:
  every query sees at most two contiguous runs of key positions (`simulator.mask.
  visible_intervals`), so the pairs a tile holds are two `searchsorted` calls per query over the
  tile's sorted key positions, O(Nq x Nk / block) instead of O(Nq x Nk);
- inside partial tiles, `mask_mod` applies `simulator.mask.visible` itself to the positions, so
  the rule exists once, shared with the simulator and the exact CPU path.

Calls return the natural-log LSE (fp32) next to the output, so partial results over disjoint key
sets merge exactly (`runtime.attention.merge`). On CUDA the compiled kernel is made once
(`torch.compile` caches one graph per shape), and each `Visibility` builds its BlockMask once:
a rank's positions do not change between steps. On CPU flex_attention runs eagerly (the unfused
reference, forward only: torch 2.13 has no CPU backward for it), which is what the tests use; the
runtime's CPU path stays the exact math of `runtime.attention`.
"""

from __future__ import annotations

import math
import warnings
from functools import cache

import numpy as np
import torch

from csbp.simulator.layout.mask import visible, visible_intervals

BLOCK = 128  # FlexAttention's default tile, rows x keys
_PAIRS_PER_CHUNK = 1 << 24  # searchsorted results held at once while counting tile pairs


class Visibility:
    """Which keys the queries of one attention call see: their positions in the 2L sequence
    (queries in the rank's order, keys in the K/V tensor's order), the layer's window.

    Built once per route (layer kind) and kept: the dense mask (CPU path) and the BlockMask
    (CUDA path) are made on first use per device and cached.
    """

    def __init__(self, queries: torch.Tensor, keys: torch.Tensor, seq_len: int, block: int,
                 window: int | None, tile: int = BLOCK):
        self.queries, self.keys = queries.long().cpu(), keys.long().cpu()
        self.seq_len, self.block, self.window, self.tile = seq_len, block, window, tile
        self._dense: dict[torch.device, torch.Tensor] = {}
        self._block_masks: dict[torch.device, object] = {}

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.queries), len(self.keys)

    def dense(self, device: torch.device) -> torch.Tensor:
        """The boolean [Nq, Nk] mask: the CPU path's (small shapes only)."""
        device = torch.device(device)
        if device not in self._dense:
            self._dense[device] = visible(self.queries[:, None], self.keys[None, :], self.seq_len,
                                          self.block, self.window).to(device)
        return self._dense[device]

    def mask_mod(self, device: torch.device):
        """FlexAttention's mask_mod: `visible` on the positions the indices stand for; indices
        past the lengths (tile padding) see nothing."""
        n_q, n_k = self.shape
        pad = lambda t: torch.cat([t, t.new_zeros(_round_up(len(t), self.tile) - len(t) + 1)])  # noqa: E731
        q_pos, k_pos = pad(self.queries).to(device), pad(self.keys).to(device)
        seq_len, block, window = self.seq_len, self.block, self.window

        def mask_mod(b, h, q_idx, kv_idx):
            seen = visible(q_pos[q_idx], k_pos[kv_idx], seq_len, block, window)
            return seen & (q_idx < n_q) & (kv_idx < n_k)

        return mask_mod

    def tile_pairs(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Visible (query, key) pairs of every tile: [ceil(Nq/tile), ceil(Nk/tile)], int64."""
        return tile_pairs(self.queries, self.keys, self.seq_len, self.block, self.window,
                          self.tile, torch.device(device))

    def block_mask(self, device: torch.device):
        """The FlexAttention BlockMask of this call (made once per device)."""
        device = torch.device(device)
        if device not in self._block_masks:
            self._block_masks[device] = self._make_block_mask(device)
        return self._block_masks[device]

    def _make_block_mask(self, device: torch.device):
        from torch.nn.attention.flex_attention import BlockMask

        n_q, n_k, t = *self.shape, self.tile
        pairs = self.tile_pairs(device)
        rows = _tile_sizes(n_q, t, device)[:, None] * _tile_sizes(n_k, t, device)[None, :]
        whole = (_tile_sizes(n_q, t, device) == t)[:, None] & (_tile_sizes(n_k, t, device) == t)[None, :]
        full = (pairs == rows) & whole  # a ragged edge tile is partial: mask_mod bounds it
        partial = (pairs > 0) & ~full

        def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            count = blocks.sum(-1, dtype=torch.int32)
            index = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
            return count[None, None], index[None, None]

        return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=t,
                                        mask_mod=self.mask_mod(device), seq_lengths=(n_q, n_k))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _tile_sizes(n: int, tile: int, device) -> torch.Tensor:
    sizes = torch.full((max(1, math.ceil(n / tile)),), tile, dtype=torch.long, device=device)
    sizes[-1] = n - tile * (len(sizes) - 1)
    return sizes


def tile_pairs(queries: torch.Tensor, keys: torch.Tensor, seq_len: int, block: int,
               window: int | None, tile: int = BLOCK, device: torch.device | None = None
               ) -> torch.Tensor:
    """Visible pairs per (query tile, key tile), from the queries' visible intervals.

    A query sees the key positions in at most two runs [lo, hi) (`visible_intervals`); a key tile
    holds `tile` positions, sorted here, so the query's pairs with it are two differences of
    `searchsorted`. Padding keys sit past 2L, inside no run; padding queries have empty runs.
    """
    device = device or torch.device("cpu")
    n_q, n_k = len(queries), len(keys)
    n_qt, n_kt = max(1, math.ceil(n_q / tile)), max(1, math.ceil(n_k / tile))
    sentinel = 4 * seq_len + 1
    k = torch.full((n_kt * tile,), sentinel, dtype=torch.long)
    k[:n_k] = keys.long().cpu()
    k = k.view(n_kt, tile).sort(-1).values.to(device)
    runs = visible_intervals(np.asarray(queries.cpu()), seq_len, block, window)
    bounds = torch.zeros((4, n_qt * tile), dtype=torch.long)  # padding queries: empty runs
    bounds[:, :n_q] = torch.from_numpy(np.stack([runs[0][0], runs[0][1], runs[1][0],
                                                 runs[1][1]]).astype(np.int64))
    bounds = bounds.to(device)
    pairs = torch.empty((n_qt, n_kt), dtype=torch.long, device=device)
    step = max(1, _PAIRS_PER_CHUNK // (n_kt * tile)) * tile  # queries per chunk, whole tiles
    for start in range(0, n_qt * tile, step):
        lo0, hi0, lo1, hi1 = (b[start:start + step].expand(n_kt, -1).contiguous()
                              for b in bounds)
        seen = (torch.searchsorted(k, hi0) - torch.searchsorted(k, lo0)
                + torch.searchsorted(k, hi1) - torch.searchsorted(k, lo1))  # [n_kt, chunk]
        pairs[start // tile:(start + seen.shape[1]) // tile] = seen.view(n_kt, -1, tile).sum(-1).T
    return pairs


RECOMPILE_LIMIT = 64  # graphs per process: a rank's call shapes x (forward, backward), not 8


@cache
def _compiled():
    """flex_attention compiled once for the process (torch.compile caches a graph per shape).

    A rank calls it at a few shapes (local and received keys per layer kind, ring tiles), with
    and without gradients; past dynamo's default of 8 graphs it would fall back to the eager,
    score-materialising path without a word, so the limit is raised.
    """
    from torch.nn.attention.flex_attention import flex_attention
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across releases
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped queries q [B, Hkv, G, Nq, D] over k, v [B, Hkv, Nk, D] -> (out, lse fp32).

    A query with no visible key gives out 0 and lse -inf, as the exact path does. Compiled on
    CUDA; eager (the unfused reference, forward only) elsewhere.
    """
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    b, h_kv, g, n, d = q.shape
    if k.shape[2] == 0:  # no keys at all (a rank that receives nothing): nothing seen
        return q.new_zeros(q.shape), q.new_full((b, h_kv, g, n), float("-inf"), dtype=torch.float32)
    call = _compiled() if q.is_cuda else flex_attention
    with warnings.catch_warnings():  # eager CPU: "called without torch.compile" (intended)
        warnings.simplefilter("ignore", UserWarning)
        out, aux = call(q.flatten(1, 2), k, v, block_mask=vis.block_mask(q.device), scale=scale,
                        enable_gqa=g > 1, return_aux=AuxRequest(lse=True))
    return out.view(b, h_kv, g, n, d), aux.lse.view(b, h_kv, g, n)
