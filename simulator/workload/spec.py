"""What the network is: layer shapes, per-layer attention kind, MoE.

One `ModelSpec` drives both the simulator (FLOPs, bytes, memory) and the runtime (the torch
model), so the two can never disagree on what is being trained. Presets and Hugging Face
`config.json` files both become a `ModelSpec` (see `presets.py`, `hf_config.py`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

AttentionKind = Literal["full", "sliding", "linear"]


class AttentionSpec(BaseModel):
    """One layer's token mixer.

    `full` and `sliding` are softmax attention (GQA); `linear` is Gated-DeltaNet style linear
    attention, where `n_heads` are value heads, `n_kv_heads` key heads and no K/V cache of the
    sequence exists (only a recurrent state), which is why CP/CSBP treat it differently.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: AttentionKind = "full"
    n_heads: PositiveInt
    n_kv_heads: PositiveInt
    head_dim: PositiveInt
    window: PositiveInt | None = None
    k_eq_v: bool = False  # K and V share one projection (DiffusionGemma global layers)
    gated_q: bool = False  # query projection also emits an output gate (Qwen3.5 full attention)
    conv_kernel: int = 0  # short causal convolution of linear attention (0 = none)

    @model_validator(mode="after")
    def _check(self) -> "AttentionSpec":
        if self.kind == "sliding" and self.window is None:
            raise ValueError("a sliding-window layer needs a window")
        if self.kind != "sliding" and self.window is not None:
            raise ValueError(f"a {self.kind} layer takes no window")
        if self.kind != "linear" and self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads} (GQA)"
            )
        return self

    @property
    def kv_width(self) -> int:
        """Elements of K (or of V) per token: what one K/V row holds per tensor."""
        return self.n_kv_heads * self.head_dim

    @property
    def kv_tensors(self) -> int:
        """How many tensors a K/V row carries on the wire (1 when K = V)."""
        return 1 if self.k_eq_v else 2


def _hash_kept(cls):
    """A frozen model's hash by value, found once per object: a layer spec keys the step
    builder's caches and is hashed a hundred thousand times per planner search (pydantic hashes
    every field each time). Kept by identity (the object held, so its id is not reused)."""
    by_value = cls.__hash__
    kept: dict[int, tuple[object, int]] = {}

    def __hash__(self) -> int:
        hit = kept.get(id(self))
        if hit is not None and hit[0] is self:
            return hit[1]
        if len(kept) >= 4096:
            kept.clear()
        h = by_value(self)
        kept[id(self)] = (self, h)
        return h

    cls.__hash__ = __hash__
    return cls


_hash_kept(AttentionSpec)


class MoESpec(BaseModel):
    """Mixture of experts FFN: routed experts plus an optional always-on dense branch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_experts: PositiveInt
    top_k: PositiveInt
    expert_ffn: PositiveInt
    dense_ffn: int = Field(0, ge=0)  # width of a dense/shared branch, 0 = none

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        return self


class ModelSpec(BaseModel):
    """A decoder-only transformer: RMSNorm, RoPE, GQA attention per layer, SwiGLU or MoE FFN."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    hidden: PositiveInt
    ffn: int = Field(ge=0)  # dense SwiGLU width (0 when every layer is MoE without dense branch)
    vocab: PositiveInt
    layers: tuple[AttentionSpec, ...]
    moe: MoESpec | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    conditioning_layers: int = Field(0, ge=0)  # DFlash drafters: target layers fed in as K/V
    source: str = ""  # where the shapes come from, and what is unverified

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if not self.layers:
            raise ValueError("a model needs at least one layer")
        if self.moe is None and self.ffn == 0:
            raise ValueError("a dense model needs ffn > 0")
        return self

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def attention_kinds(self) -> dict[AttentionSpec, int]:
        """Distinct layer kinds and how many layers of each: identical layers cost the same."""
        counts: dict[AttentionSpec, int] = {}
        for layer in self.layers:
            counts[layer] = counts.get(layer, 0) + 1
        return counts

    # ---- parameter counts (used by memory and gradient-traffic models) ----
    def mixer_params(self, a: AttentionSpec) -> int:
        h = self.hidden
        if a.kind == "linear":
            qk = 2 * h * a.n_kv_heads * a.head_dim
            v = h * a.n_heads * a.head_dim
            gate = h * a.n_heads * a.head_dim  # output gate z
            out = a.n_heads * a.head_dim * h
            decay = 2 * h * a.n_heads  # per-head beta and alpha projections
            conv = a.conv_kernel * (2 * a.n_kv_heads + a.n_heads) * a.head_dim
            return qk + v + gate + out + decay + conv
        q_width = a.n_heads * a.head_dim * (2 if a.gated_q else 1)  # the gate doubles the q projection
        kv = h * a.kv_width * a.kv_tensors
        out = a.n_heads * a.head_dim * h
        bias = (q_width + a.kv_width * a.kv_tensors) if self.qkv_bias else 0
        q = h * q_width
        return q + kv + out + bias

    def dense_ffn_params(self) -> int:
        width = self.moe.dense_ffn if self.moe else self.ffn
        return 3 * self.hidden * width

    def expert_params_per_layer(self) -> int:
        """All routed experts of one layer (plus the router)."""
        if not self.moe:
            return 0
        return self.moe.n_experts * 3 * self.hidden * self.moe.expert_ffn + self.hidden * self.moe.n_experts

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    def dense_params(self) -> int:
        """Parameters every rank of an expert-parallel group holds (all but routed experts)."""
        per_layer = sum(self.mixer_params(a) + self.dense_ffn_params() + 2 * self.hidden for a in self.layers)
        cond = self.conditioning_layers * self.hidden * self.hidden
        return per_layer + self.embedding_params() + self.hidden + cond

    def total_params(self) -> int:
        return self.dense_params() + self.n_layers * self.expert_params_per_layer()

    def active_params(self) -> int:
        """Parameters touched per token (routed experts counted top_k times, not n_experts)."""
        if not self.moe:
            return self.total_params()
        active_experts = self.moe.top_k * 3 * self.hidden * self.moe.expert_ffn + self.hidden * self.moe.n_experts
        return self.dense_params() + self.n_layers * active_experts
