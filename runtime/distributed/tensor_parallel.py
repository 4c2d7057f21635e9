"""Tensor parallelism with sequence parallelism (Megatron-style), through the counting comm layer.

Why by hand and not `torch.distributed.tensor.parallel`: DTensor's collectives bypass
`runtime/distributed/comm.py`, so their bytes could not be counted and held equal to the step graph's. The cut
is TorchTitan's TP plan for Llama, applied with module hooks so the model file stays as it is:

- Between blocks a TP rank holds 1/tp of its context rank's positions (sequence parallel): norms
  and residual adds run on that shard. The norm weights (and a MoE router, which routes the shard's
  own tokens) see only the shard's tokens, so their gradients are partial sums: they are marked
  `sequence_parallel` and summed over the TP group after backward (`plans.dp`).
- Attention and the dense MLP all-gather the shard to all positions, run on 1/tp of the heads and
  of the FFN width (column-parallel Q/K/V and gate/up, row-parallel output and down) and
  reduce-scatter their partial outputs back to shards. Backward mirrors each collective; the
  gathered input is kept for the weight gradient rather than gathered again (as DTensor does).
- The embedding is vocabulary-parallel: each rank looks up the tokens of its 1/tp of the vocabulary
  and the partial embeddings reduce-scatter to shards.
- The LM head gathers only the noisy rows (the only ones with a loss), computes the logits of its
  vocabulary slice and Megatron's vocabulary-parallel cross-entropy: an all-reduce of each row's
  max logit, then one of its target logit and sum of exponentials (fp32); backward needs neither.
- MoE experts stay whole on every TP rank and see the shard's own tokens (expert parallelism, if
  any, moves them: `runtime.expert_parallel`); a dense branch is split like the MLP.

Shard order: a context rank's noisy positions are cut into tp equal runs, and so are its clean
ones; TP rank t holds noisy run t then clean run t. So every shard starts with its noisy rows, and
gathering them gives the context rank's noisy rows in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from csbp.runtime.distributed.comm import Comm, wire_dtype
from csbp.runtime.models.model import MoE, BlockDiffusionLM
from csbp.runtime.distributed.mesh import Peers

TP = "tp"


@dataclass(frozen=True)
class TensorParallel:
    """This rank's TP group and the comm layer that counts what crosses it."""

    comm: Comm
    peers: Peers

    @property
    def size(self) -> int:
        return self.peers.size

    @property
    def rank(self) -> int:
        return self.peers.index

    def _gather(self, x: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
        """[B, n, ...] shards of every TP rank -> [B, tp * n, ...] (sequence dim 1)."""
        rows = x.transpose(0, 1).to(wire)
        return self.comm.all_gather(rows, self.peers.group, TP).transpose(0, 1).to(x.dtype)

    def _scatter(self, x: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
        """[B, N, ...] partial sums on every TP rank -> this rank's summed [B, N / tp, ...]."""
        rows = x.transpose(0, 1).to(wire)
        return self.comm.reduce_scatter(rows, self.peers.group, TP).transpose(0, 1).to(x.dtype)


class _GatherShards(torch.autograd.Function):
    """All-gather of sequence shards; backward reduce-scatters the gradient's partial sums."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel):
        ctx.tp, ctx.wire = tp, wire_dtype(x)
        return tp._gather(x, ctx.wire)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp._scatter(grad, ctx.wire), None


class _ScatterSums(torch.autograd.Function):
    """Reduce-scatter of partial sums to sequence shards; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallel):
        ctx.tp, ctx.wire = tp, wire_dtype(x)
        return tp._scatter(x, ctx.wire)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp._gather(grad, ctx.wire), None


def gather_shards(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _GatherShards.apply(x, tp)


def scatter_sums(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _ScatterSums.apply(x, tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of rows whose logits are split over the vocabulary (Megatron's algorithm).

    The softmax needs two all-reduces over TP (each row's max logit; its target logit and sum
    of exponentials); its gradient, softmax minus the one-hot target, is local to each slice.
    """

    @staticmethod
    def forward(ctx, logits, targets, start: int, tp: TensorParallel):
        top = logits.max(-1).values
        tp.comm.all_reduce(top, TP, tp.peers.group, op="max")
        e = torch.exp(logits - top[:, None])
        local = targets - start
        mine = (local >= 0) & (local < logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        target = torch.where(mine, logits.gather(1, local[:, None]).squeeze(1), 0.0)
        sums = torch.stack([target, e.sum(-1)])
        tp.comm.all_reduce(sums, TP, tp.peers.group)
        target, total = sums
        ctx.save_for_backward(e / total[:, None], local, mine)
        return total.log() + top - target

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(len(g), device=g.device), local] -= mine.to(g.dtype)
        return g * grad[:, None], None, None, None


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/tp) of the embedding; output reduce-scattered to the shard."""

    def __init__(self, weight: nn.Parameter, start: int, tp: TensorParallel):
        super().__init__()
        self.weight, self.start, self.tp = weight, start, tp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, N] of every position of the context rank -> [B, N / tp, h]."""
        local = tokens - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return scatter_sums(x * mine[..., None], self.tp)


class VocabParallelHead(nn.Module):
    """Rows [start, start + V/tp) of the LM head; owns the loss, which needs the other slices."""

    def __init__(self, weight: nn.Parameter, start: int, tp: TensorParallel):
        super().__init__()
        self.weight, self.start, self.tp = weight, start, tp

    def weighted_cross_entropy(self, hidden: torch.Tensor, targets: torch.Tensor,
                               weights: torch.Tensor) -> torch.Tensor:
        """hidden [B, n / tp, h]: this shard's loss rows (noisy; objective ar: all); targets,
        weights [B, n]: every loss row of the context rank. Every row is scored (weight 0 rows too), so the collectives'
        sizes do not depend on which tokens happen to be masked."""
        rows = gather_shards(hidden, self.tp)
        logits = F.linear(rows, self.weight).float().flatten(0, 1)
        ce = _VocabParallelCrossEntropy.apply(logits, targets.flatten(), self.start, self.tp)
        return (ce * weights.flatten()).sum()


def sequence_order(positions: torch.Tensor, seq_len: int, tp: int) -> torch.Tensor:
    """A context rank's positions in shard order (see the module docstring)."""
    noisy, clean = positions[positions < seq_len], positions[positions >= seq_len]
    runs = zip(noisy.tensor_split(tp), clean.tensor_split(tp))
    return torch.cat([torch.cat(pair) for pair in runs])


def _gather_input(tp: TensorParallel, module, args):
    return (gather_shards(args[0], tp), *args[1:])


def _scatter_output(tp: TensorParallel, module, args, out):
    return scatter_sums(out, tp)


def _sequence_parallel(module: nn.Module, tp: TensorParallel) -> None:
    """Run `module` on all positions: gather its input shards, reduce-scatter its output."""
    module.register_forward_pre_hook(partial(_gather_input, tp))
    module.register_forward_hook(partial(_scatter_output, tp))


class _Slicer:
    """Keeps this rank's 1/tp of weights, remembering (dim, start, stop) of each in the whole."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self.slices: dict[str, tuple[int, int, int]] = {}

    def take(self, module: nn.Module, prefix: str, name: str, dim: int) -> nn.Parameter:
        full = getattr(module, name)
        n = full.shape[dim] // self.tp.size
        start = self.tp.rank * n
        shard = nn.Parameter(full.detach().narrow(dim, start, n).clone(),
                             requires_grad=full.requires_grad)
        setattr(module, name, shard)
        self.slices[f"{prefix}.{name}"] = (dim, start, start + n)
        return shard

    def column(self, linear: nn.Linear, prefix: str) -> None:
        """Output features split: each rank computes its 1/tp of the outputs."""
        linear.out_features = self.take(linear, prefix, "weight", 0).shape[0]
        if linear.bias is not None:
            self.take(linear, prefix, "bias", 0)

    def row(self, linear: nn.Linear, prefix: str) -> None:
        """Input features split: each rank's output is a partial sum."""
        linear.in_features = self.take(linear, prefix, "weight", 1).shape[1]

    def mlp(self, mlp: nn.Module, prefix: str) -> None:
        self.column(mlp.w1, f"{prefix}.w1")
        self.column(mlp.w3, f"{prefix}.w3")
        self.row(mlp.w2, f"{prefix}.w2")
        _sequence_parallel(mlp, self.tp)


def parallelize(model: BlockDiffusionLM, tp: TensorParallel) -> dict[str, tuple[int, int, int]]:
    """Cut `model` (whole, identical on every rank) to this TP rank's part and insert the
    collectives; returns (dim, start, stop) in the whole weight of each weight it cut."""
    cut = _Slicer(tp)
    for i, block in enumerate(model.blocks):
        attn, p = block.attn, f"blocks.{i}.attn"
        for name in ("wq", "wk", "wv"):
            cut.column(getattr(attn, name), f"{p}.{name}")
        cut.row(attn.wo, f"{p}.wo")
        attn.spec = attn.spec.model_copy(update={"n_heads": attn.spec.n_heads // tp.size,
                                                 "n_kv_heads": attn.spec.n_kv_heads // tp.size})
        _sequence_parallel(attn, tp)
        if isinstance(block.ffn, MoE):
            block.ffn.router.weight.sequence_parallel = True
            if block.ffn.dense is not None:
                cut.mlp(block.ffn.dense, f"blocks.{i}.ffn.dense")
        else:
            cut.mlp(block.ffn, f"blocks.{i}.ffn")
        block.attn_norm.weight.sequence_parallel = True
        block.ffn_norm.weight.sequence_parallel = True
    model.norm.weight.sequence_parallel = True
    tied = model.lm_head.weight is model.embed.weight
    embed = cut.take(model.embed, "embed", "weight", 0)
    start = cut.slices["embed.weight"][1]
    head = embed if tied else cut.take(model.lm_head, "lm_head", "weight", 0)
    model.embed = VocabParallelEmbedding(embed, start, tp)
    model.lm_head = VocabParallelHead(head, start, tp)
    return cut.slices
