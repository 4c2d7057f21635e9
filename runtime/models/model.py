"""The block-diffusion transformer (Llama/Qwen style) built from a `ModelSpec`.

RMSNorm, RoPE, GQA attention (full or sliding-window), SwiGLU or top-k MoE. The model runs on any
*set* of positions of the 2L sequence [x_t ; x_0], because a plan gives each rank only the
positions it computes: RoPE uses the original position i % L (a noisy token and its clean twin
share it), and attention is a callable the plan supplies (`runtime.attention.Attention`), so K/V
exchange lives with the plan and this file stays parallelism-free: tensor and expert parallelism
cut it from outside (`runtime.tensor_parallel`, `runtime.expert_parallel`). Objective ar trains the
same network as a plain causal LM: its layout puts token t at position L + t, where the mask at
block 1 is causal and RoPE sees t (`runtime.objective`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from csbp.simulator.errors import InputError
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec

# attend(layer index, q [B, N, Hq, D], k [B, N, Hkv, D], v [B, N, Hkv, D]) -> [B, N, Hq, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

ROPE_THETA = 10_000.0
INIT_STD = 0.02


def check_supported(spec: ModelSpec) -> None:
    """The spec features the runtime cannot execute yet, as one-line input errors."""
    if any(a.kind == "linear" for a in spec.layers):
        raise InputError(f"{spec.name}: linear (Gated-DeltaNet) layers are not supported by the "
                         "runtime yet")
    if any(a.k_eq_v for a in spec.layers):
        raise InputError(f"{spec.name}: K = V layers (k_eq_v) are not supported by the runtime yet")
    if spec.conditioning_layers:
        raise InputError(f"{spec.name}: conditioning layers (DFlash drafters) are not supported "
                         "by the runtime yet")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(original_positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, D/2] of the rotary embedding at each token's original position."""
    freqs = ROPE_THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = original_positions.to(torch.float64)[:, None] * freqs.to(original_positions.device)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of each head (x [B, N, H, D]); tables cast to x so K/V keep their dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, spec: AttentionSpec, hidden: int, bias: bool, index: int):
        super().__init__()
        self.spec, self.index = spec, index
        q_width = spec.n_heads * spec.head_dim
        self.wq = nn.Linear(hidden, q_width * (2 if spec.gated_q else 1), bias=bias)
        self.wk = nn.Linear(hidden, spec.kv_width, bias=bias)
        self.wv = nn.Linear(hidden, spec.kv_width, bias=bias)
        self.wo = nn.Linear(q_width, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
                ) -> torch.Tensor:
        b, n, _ = x.shape
        a = self.spec
        q = self.wq(x).view(b, n, a.n_heads, -1)
        if a.gated_q:  # each head also emits a sigmoid gate on its output (Qwen3.5)
            q, gate = q.chunk(2, dim=-1)
        k = self.wk(x).view(b, n, a.n_kv_heads, a.head_dim)
        v = self.wv(x).view(b, n, a.n_kv_heads, a.head_dim)
        y = attend(self.index, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        if a.gated_q:
            y = y * torch.sigmoid(gate)
        return self.wo(y.reshape(b, n, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, width, bias=False)  # gate
        self.w3 = nn.Linear(hidden, width, bias=False)  # up
        self.w2 = nn.Linear(width, hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def run_experts(experts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert on its run of `rows` (rows grouped by expert, `counts[i]` for the i-th)."""
    parts = rows.split(counts)
    return torch.cat([expert(part) if len(part) else part for expert, part in zip(experts, parts)])


class Experts(nn.ModuleList):
    """The routed SwiGLU experts. Called on rows grouped by expert, so expert parallelism can
    replace this module alone (`runtime.expert_parallel`) and leave routing where it is."""

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return run_experts(self, rows, counts)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts (weights renormalised over the k) plus an optional dense branch."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, expert_ffn: int, dense_ffn: int):
        super().__init__()
        self.top_k, self.n_experts = top_k, n_experts
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.experts = Experts(SwiGLU(hidden, expert_ffn) for _ in range(n_experts))
        self.dense = SwiGLU(hidden, dense_ffn) if dense_ffn else None

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The experts' part of the output: every token through its top-k experts, weighted."""
        flat = x.reshape(-1, x.shape[-1])  # [T, h]
        weights, chosen = torch.softmax(self.router(flat).float(), -1).topk(self.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        pairs = chosen.flatten().argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts).tolist()
        token = pairs // self.top_k
        y = self.experts(flat[token], counts) * weights.flatten()[pairs, None]
        return torch.zeros_like(flat).index_add(0, token, y.to(flat.dtype)).view_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        return out if self.dense is None else out + self.dense(x)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden)
        self.attn = SelfAttention(spec.layers[index], spec.hidden, spec.qkv_bias, index)
        self.ffn_norm = RMSNorm(spec.hidden)
        m = spec.moe
        self.ffn = (MoE(spec.hidden, m.n_experts, m.top_k, m.expert_ffn, m.dense_ffn) if m
                    else SwiGLU(spec.hidden, spec.ffn))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
                ) -> torch.Tensor:
        """cos, sin: the rotary tables of this block's head dimension."""
        x = x + self.attn(self.attn_norm(x), cos, sin, attend)
        return x + self.ffn(self.ffn_norm(x))


class BlockDiffusionLM(nn.Module):
    """Embeddings, blocks, final norm and LM head; the same weights on every rank for a seed.

    `checkpointing` recomputes each whole block in backward (torch.utils.checkpoint, without
    stopping early), so the block's K/V exchange and TP/EP collectives really run again, as the
    step graph's recompute phase predicts.
    """

    def __init__(self, spec: ModelSpec, seed: int = 0, checkpointing: bool = False):
        super().__init__()
        check_supported(spec)
        self.spec, self.checkpointing = spec, checkpointing
        self.mask_id = spec.vocab - 1  # the last vocabulary entry is the [MASK] token
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.blocks = nn.ModuleList(Block(spec, i) for i in range(spec.n_layers))
        self.norm = RMSNorm(spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        generator = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.data.copy_(torch.randn(module.weight.shape, generator=generator) * INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, seq_len: int,
                attend: Attend) -> torch.Tensor:
        """tokens [B, N] at `positions` (in [0, 2L)) -> final hidden states [B, N, hidden]."""
        tables = {d: rope_tables(positions % seq_len, d) for d in {a.head_dim for a in self.spec.layers}}
        x = self.embed(tokens)
        for block, layer in zip(self.blocks, self.spec.layers):
            args = (x, *tables[layer.head_dim], attend)
            if self.checkpointing and torch.is_grad_enabled():
                with set_checkpoint_early_stop(False):  # rerun the whole block, collectives too
                    x = checkpoint(block, *args, use_reentrant=False)
            else:
                x = block(*args)
        return self.norm(x)
