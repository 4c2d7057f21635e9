"""BD3-LM: the 2L input [x_t ; x_0], one noise level per block, 1/t-weighted masked cross-entropy.

Every rank draws the whole step's data and noise from one seeded generator per sequence and then
slices its own positions, so every plan trains on bit-identical inputs. The loss is divided by a
global count (every noisy token of the step: L per sequence), so the ranks' losses sum to the
single-process loss exactly and gradients need nothing but an all-reduce SUM.

The data is synthetic: each sequence is an arithmetic progression of token ids with a random
start and stride, which the context predicts, so the loss falls when training works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MIN_NOISE = 1e-3  # t ~ U[MIN_NOISE, 1]: keeps the 1/t weight finite


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [B, 2L]: x_t (masked tokens = mask id) then x_0
    noise: torch.Tensor  # [B, n_blocks]: the noise level t of each block

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.tokens.to(device), self.noise.to(device))


def _sequence_seed(seed: int, step: int, sequence: int) -> int:
    return ((seed * 1_000_003 + step) * 1_000_003 + sequence) % 2**63


def make_batch(sequences: list[int] | range, step: int, seed: int, seq_len: int, block: int,
               vocab: int) -> Batch:
    """The sequences (global ids) of one step; the mask id is vocab - 1, never a data token."""
    tokens, noise = [], []
    for sequence in sequences:
        g = torch.Generator().manual_seed(_sequence_seed(seed, step, sequence))
        start, stride = torch.randint(0, vocab - 1, (2,), generator=g).tolist()
        x0 = (start + stride * torch.arange(seq_len)) % (vocab - 1)
        t = MIN_NOISE + (1 - MIN_NOISE) * torch.rand(seq_len // block, generator=g)
        masked = torch.rand(seq_len, generator=g) < t.repeat_interleave(block)
        tokens.append(torch.cat([torch.where(masked, vocab - 1, x0), x0]))
        noise.append(t)
    return Batch(torch.stack(tokens), torch.stack(noise))


def bd3lm_loss(logits_of, hidden: torch.Tensor, batch: Batch, positions: torch.Tensor,
               seq_len: int, block: int, mask_id: int, total_tokens: int) -> torch.Tensor:
    """Sum of CE / t over this rank's masked noisy tokens, over the step's global token count.

    hidden [B, N, h] at `positions`; `logits_of` is the LM head, applied to masked tokens only.
    """
    noisy = positions < seq_len
    pos = positions[noisy]
    x_t, x_0 = batch.tokens[:, pos], batch.tokens[:, seq_len + pos]
    hit = x_t == mask_id
    logits = logits_of(hidden[:, noisy][hit]).float()
    ce = F.cross_entropy(logits, x_0[hit], reduction="none")
    return (ce / batch.noise[:, pos // block][hit]).sum() / total_tokens
