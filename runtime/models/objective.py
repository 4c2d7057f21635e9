"""The objectives the runtime trains: BD3-LM and plain autoregressive (ar).

BD3-LM: the 2L input [x_t ; x_0], one noise level per block, 1/t-weighted masked cross-entropy.
ar: one causal sequence of L tokens, next-token cross-entropy on every token. The sequence is
drawn L + 1 tokens long (as TorchTitan's and Megatron's data loaders cut seq_len + 1), so the
last input token has a label too: L loss rows, as the simulator counts them. The layout holds the
sequence in the clean stream's coordinates (token t at position L + t, `CausalLayout`), so the
model, its RoPE (position % L = t) and the causal mask (`mask.visible` at block 1) need nothing
new.

Every rank draws the whole step's data and noise from one seeded generator per sequence and then
slices its own positions, so every plan trains on bit-identical inputs. The loss is divided by a
global count (every noisy token of the step: L per sequence), so the ranks' losses sum to the
single-process loss exactly and gradients need nothing but an all-reduce SUM (ar: every token of
the step, L per sequence, is a loss row).

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


def make_causal_batch(sequences: list[int] | range, step: int, seed: int, seq_len: int,
                      vocab: int) -> torch.Tensor:
    """Objective ar: [B, L + 1] tokens of the sequences (global ids) of one step, the same
    progressions BD3-LM's clean stream draws (one more token), no mask id."""
    rows = []
    for sequence in sequences:
        g = torch.Generator().manual_seed(_sequence_seed(seed, step, sequence))
        start, stride = torch.randint(0, vocab - 1, (2,), generator=g).tolist()
        rows.append((start + stride * torch.arange(seq_len + 1)) % (vocab - 1))
    return torch.stack(rows)


def next_token_targets(tokens: torch.Tensor, positions: torch.Tensor, seq_len: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Objective ar at a rank's `positions` (in [L, 2L): token t at L + t): the input tokens,
    their next-token targets and unit loss weights, each [B, n] in the positions' order."""
    index = positions - seq_len
    inputs, targets = tokens[:, index], tokens[:, index + 1]
    return inputs, targets, torch.ones(targets.shape, device=tokens.device)


def bd3lm_targets(batch: Batch, noisy: torch.Tensor, seq_len: int, block: int, mask_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and loss weights [B, n] of the noisy positions `noisy` (all < seq_len): the clean
    token, weighted 1/t where the token is masked and 0 where it is not."""
    x_t, x_0 = batch.tokens[:, noisy], batch.tokens[:, seq_len + noisy]
    weights = (x_t == mask_id) / batch.noise[:, noisy // block]
    return x_0, weights


def weighted_cross_entropy(head, hidden: torch.Tensor, targets: torch.Tensor,
                           weights: torch.Tensor) -> torch.Tensor:
    """Sum over rows of weight x CE(head(hidden), target), rows of weight 0 skipped.

    A head that owns its loss (a vocabulary-parallel one, `runtime.tensor_parallel`) computes it.
    """
    if hasattr(head, "weighted_cross_entropy"):
        return head.weighted_cross_entropy(hidden, targets, weights)
    hit = weights > 0
    logits = head(hidden[hit]).float()
    return (F.cross_entropy(logits, targets[hit], reduction="none") * weights[hit]).sum()
