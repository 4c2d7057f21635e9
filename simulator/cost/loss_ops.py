"""The loss of a step: the vocabulary-parallel LM head and cross-entropy over the loss rows,
forward and backward, and self-conditioning's soft embedding. A mixin of the builder.
"""

from __future__ import annotations

import math

import numpy as np

from csbp.simulator.cost.step_ops import LOSS_BYTES, Deps

# Training does dgrad + wgrad: a linear layer's backward is twice its forward.
GEMM_BACKWARD_FLOP_RATIO = 2.0


class LossOps:
    """LM head and cross-entropy (mixed into the builder)."""

    def loss_rows(self) -> np.ndarray:
        """Rows the LM head and loss run on: the noisy tokens, every token of a causal (ar)
        sequence, and every clean row too when the objective adds an autoregressive loss on
        the clean stream (DiffusionGemma); a clean row replicated on several ranks (pure BP,
        CSBP's replicas) runs it on each [U]."""
        rows = self.tokens if self.obj.clean_loss or self.obj.causal else self.noisy  # ar: every token
        # only the rows that carry a label (Fast-dLLM v2's L - 1 valid rows, objectives.py)
        return rows * self.obj.loss_row_share if self.obj.loss_row_share != 1.0 else rows

    def head_calls(self, per_block: int) -> int:
        """GEMM calls of the LM head: `per_block` per vocabulary block of the rank's V/tp, and
        per row block of a frozen head run in row blocks (`implementation.loss.frozen_head_rows`)."""
        blk = self.obj.vocab_block
        calls = per_block * (math.ceil(self.m.vocab / self.tp / blk) if blk else 1)
        rows = self.impl.loss.frozen_head_rows
        if rows and self.obj.frozen_embeddings:
            calls *= max(1, math.ceil(float(np.max(self.loss_rows())) / rows))
        return calls

    def loss_tiles(self, rows: np.ndarray) -> int | None:
        """Row tiles of a tiled loss kernel (`implementation.loss`), None for Liger's chunks or
        a frozen head (its own kernel, objectives.py). Each GEMM call is one tile's rows; the
        ranks' loss rows differ little, the most loaded sets the count."""
        kernel = self.impl.loss
        if kernel.kernel == "chunked-ce" or self.obj.frozen_embeddings:
            return None
        if kernel.kernel == "unchunked":  # one call over every row
            return 1
        return max(1, math.ceil(float(np.max(rows)) / kernel.tile_rows))

    def loss_notes(self) -> list[str]:
        """What the report says about the loss kernel and the TP collectives."""
        k, out = self.impl.loss, []
        if k.kernel == "unchunked" and self.loss_tiles(self.loss_rows()) is not None:
            out.append("loss: unchunked cross-entropy over every loss row's logits at once, buffers of "
                       f"{'+'.join(map(str, k.logits_buffers))} B per logit alive at it")
        elif self.loss_tiles(self.loss_rows()) is not None:
            out.append(f"loss: tiled fused cross-entropy, {k.tile_rows}-row tiles with "
                       f"{k.logits_bytes or self.dt}-byte logits, logits recomputed in backward"
                       if k.recompute_logits else f"loss: tiled fused cross-entropy, {k.tile_rows}-row tiles")
        if self.tp > 1:
            tp = self.impl.tp
            out.append("tensor parallel: collectives " + ("overlapped with the GEMMs" if tp.exchange == "overlapped"
                                                          else "waited on by the next op")
                       + (f" (backward: {'overlapped with the GEMMs' if tp.mode('backward') == 'overlapped' else 'waited on'})"
                          if tp.mode("backward") != tp.exchange else "")
                       + ("" if tp.replay_in_recompute else ", not replayed in recompute"))
        return out

    def loss_forward(self, x: Deps, rows: np.ndarray | None = None) -> Deps:
        """Vocabulary-parallel LM head and cross-entropy over the loss rows (`loss_rows`)."""
        h, V = self.m.hidden, self.m.vocab
        rows = self.loss_rows() if rows is None else rows
        tiles = self.loss_tiles(rows)
        x = self.add("head-in.ag", "forward", None, self.tp_collective("all-gather", rows), x)
        x = self.add("lm-head", "forward", None, self.gemm(2 * rows * h * V / self.tp, tiles or self.head_calls(1)), x)
        # vocabulary-parallel cross-entropy: each row's max logit, then its target logit and sum
        # of exponentials, all-reduced over TP in fp32 (Megatron's algorithm)
        for name, values in (("max", 1), ("sums", 2)):
            x = self.add(f"cross-entropy.{name}.ar", "forward", None, self.comm(
                "all-reduce", rows * values * LOSS_BYTES * 2 * self.ring_share(self.g_tp),
                self.g_tp, "tp"), x)
        # fp32 passes over the logits; an unchunked loss writes and reads each of its buffers once
        k = self.impl.loss
        per = 2 * sum(k.logits_buffers) if k.kernel == "unchunked" and tiles is not None else 4 * 3
        return self.add("cross-entropy", "forward", None, self.memory_bound(rows * V / self.tp * per), x)

    def soft_embedding(self, x: Deps) -> Deps:
        """Self-conditioning's soft embedding: the canvas's probabilities times the embedding
        matrix, each TP rank over its V/tp rows, the partial sums reduce-scattered to the
        sequence shards as the embedding's are (implementation.md section 4, DiffusionGemma (2))."""
        h, V = self.m.hidden, self.m.vocab
        x = self.add("soft-embed", "forward", None, self.gemm(2 * self.noisy * h * V / self.tp), x)
        return self.add("soft-embed.rs", "forward", None, self.tp_collective("reduce-scatter", self.noisy), x)

    def loss_backward(self, x: Deps, rows: np.ndarray | None = None) -> Deps:
        """The LM head's backward: input and weight gradients, or the input gradient of a frozen
        head; plus the forward again where the logits are recomputed in backward.

        A tiled kernel (implementation.md 9) recomputes each tile's logits, writes and reads its
        backward buffers (`backward_tile_bytes`, each written once and read once [U]), accumulates
        the weight gradient in fp32 inside the GEMM and casts it once; under TP the input
        gradient is all-reduced or reduce-scattered as the profile says."""
        h, V, obj, kernel = self.m.hidden, self.m.vocab, self.obj, self.impl.loss
        rows = self.loss_rows() if rows is None else rows
        tiles = self.loss_tiles(rows)
        if tiles is None:
            ratio = (1.0 if obj.frozen_embeddings else GEMM_BACKWARD_FLOP_RATIO) + obj.head_recompute
            calls = self.head_calls((1 if obj.frozen_embeddings else 2) + obj.head_recompute)
        else:
            passes = GEMM_BACKWARD_FLOP_RATIO + kernel.recompute_logits
            ratio, calls = passes, tiles * int(passes)
        x = self.add("lm-head-bwd", "backward", None, self.gemm(ratio * 2 * rows * h * V / self.tp, calls), x)
        if tiles is not None:
            x = self.add("cross-entropy-bwd", "backward", None, self.memory_bound(
                rows * V / self.tp * 2 * sum(kernel.backward_tile_bytes)), x)
            if kernel.grad_weight_bytes:
                x = self.add("lm-head.grad-weight.cast", "backward", None, self.memory_bound(
                    V / self.tp * h * sum(kernel.grad_weight_bytes)), x)
        if kernel.tp_grad_hidden == "all-reduce" and tiles is not None:
            return self.add("head.grad-hidden.ar", "backward", None, self.comm(
                "all-reduce", rows * h * self.dt * 2 * self.ring_share(self.g_tp), self.g_tp, "tp"), x)
        return self.add("head-in.rs-bwd", "backward", None, self.tp_collective("reduce-scatter", rows), x)


def frozen_head_workspace(model, kernel, vocab_block: int | None, tp: int) -> float:
    """A frozen head's workspace (implementation.md 14): one [row block, vocabulary block]
    buffer of `frozen_head_bytes` elements, whatever the rows; 0 without row blocks."""
    if not kernel.frozen_head_rows:
        return 0.0
    V = math.ceil(model.vocab / tp)
    return float(kernel.frozen_head_rows * min(vocab_block or V, V) * kernel.frozen_head_bytes)


def loss_buffers(model, kernel, rows: np.ndarray, dt: int, tp: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes a tiled loss kernel holds per rank (implementation.md 9): in the forward one tile's
    logits; in the backward the tile's buffers, the whole [V/tp, h] weight gradient (fp32 and
    its copy) and every loss row's input gradient (fp32 then bf16). `rows`: loss rows per rank.
    An unchunked loss (frameworks.md A3) is one tile of every row, its forward holding each of
    `logits_buffers` (bf16 logits, their fp32 copy, ...) at once."""
    V = math.ceil(model.vocab / tp)
    if kernel.kernel == "unchunked":
        tile, per = rows, sum(kernel.logits_buffers)
    else:
        tile, per = np.minimum(rows, kernel.tile_rows), kernel.logits_bytes or dt
    forward = tile * V * per
    backward = (tile * V * sum(kernel.backward_tile_bytes) + V * model.hidden * sum(kernel.grad_weight_bytes)
                + rows * model.hidden * sum(kernel.grad_hidden_bytes))
    return forward.astype(float), backward.astype(float)
