"""Peak memory per rank: weights, gradients, optimizer state, activations, K/V buffers, logits.

Counted at the start of the backward pass, where everything is alive at once: all weight-side
state, every saved activation, the gathered K/V and dK/dV of one layer, one loss chunk. Sizes
follow the layout (the tokens each rank holds, the K/V rows it receives), so CP, BP and CSBP
differ exactly where their layouts do; pure BP holds its replicated clean prefix.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from csbp.simulator import kv_rows
from csbp.simulator.hardware import HardwareProfile
from csbp.simulator.layout import Layout, kv_row_bytes
from csbp.simulator.objectives import objective_shape
from csbp.simulator.plan import Plan
from csbp.simulator.result import GIB
from csbp.simulator.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload import Workload

# fp32 master weights + Adam m and v (mixed-precision AdamW): 4 + 4 + 4 bytes per parameter.
OPTIMIZER_BYTES_PER_PARAM = 12


def loss_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk of the fused linear-cross-entropy loss.

    Liger-Kernel's rule (ops/fused_linear_cross_entropy.py): chunk_size =
    next_power_of_2(ceil(BT / ceil(V / H))), so a chunk's logits are about as large as the
    hidden states of all tokens. The kernel writes the logits' gradient over the logits in place
    (one buffer in the activation dtype).
    """
    if tokens <= 0:
        return 0
    chunk = math.ceil(tokens / math.ceil(vocab / hidden))
    return min(tokens, 1 << (chunk - 1).bit_length())

LABELS = {"activations": "activations", "params": "params", "grads": "grads",
          "optimizer": "optimizer", "kv_buffers": "K/V buffers", "logits": "logits"}


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict[str, np.ndarray]  # GiB per rank by component, reserved included
    capacity_gib: float
    reserved_gib: float

    @cached_property
    def per_rank(self) -> tuple[dict[str, float], ...]:
        """GiB by component, one dict per rank."""
        return tuple(self.rank(r) for r in range(len(self.totals_gib)))

    def rank(self, r: int) -> dict[str, float]:
        return {k: float(v[r]) for k, v in self.parts.items()}

    @cached_property
    def totals_gib(self) -> list[float]:
        total = 0  # each rank's components added in order, as summing its dict would
        for part in self.parts.values():
            total = total + part
        return np.asarray(total, dtype=float).tolist()

    @property
    def peak_rank(self) -> int:
        return int(np.argmax(self.totals_gib))

    @property
    def peak_gib(self) -> float:
        return max(self.totals_gib)

    @property
    def feasible(self) -> bool:
        return self.peak_gib <= self.capacity_gib

    @property
    def reason(self) -> str | None:
        if self.feasible:
            return None
        r = self.peak_rank
        parts = {k: v for k, v in self.rank(r).items() if k != "reserved"}
        need = sum(parts.values())
        shown = ", ".join(f"{LABELS[k]} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v >= 0.05)
        usable = self.capacity_gib - self.reserved_gib
        return (f"infeasible: needs {need:.1f} GiB per GPU on rank {r} ({shown}) > {usable:.1f} GiB "
                f"usable ({self.capacity_gib:.1f} GiB HBM - {self.reserved_gib:.1f} reserved)")


def saved_bytes_per_token(model: ModelSpec, a: AttentionSpec, dtype_bytes: int, tp: int) -> float:
    """Activations one layer keeps per token for its backward (no recompute), under TP/SP.

    Megatron-style accounting (Korthikanti et al., arXiv 2205.05198) with FlashAttention (no
    score matrix): the two norm inputs and the two GEMM inputs (4h), q, k, v and the attention
    output (softmax) or q, k, v, gate and output (linear attention), the FFN's gate, up and
    activation (or per routed copy: its input and those three), all sharded over TP/SP; plus the
    fp32 log-sum-exp per head.
    """
    h = model.hidden
    if a.kind == "linear":
        mixer = 2 * a.n_kv_heads * a.head_dim + 3 * a.n_heads * a.head_dim
    else:
        q = a.n_heads * a.head_dim
        mixer = 2 * q + a.kv_width * a.kv_tensors
    if model.moe:
        moe = model.moe
        ffn = moe.top_k * (h + 3 * moe.expert_ffn) + 3 * moe.dense_ffn
    else:
        ffn = 3 * model.ffn
    lse = 4 * a.n_heads if a.kind != "linear" else 0
    return ((4 * h + mixer + ffn) * dtype_bytes + lse) / tp


def kv_buffer_rows(layout: Layout, a: AttentionSpec, rank: int) -> int:
    """Rows of remote K/V a rank holds at once for one layer (a ring keeps two steps in flight)."""
    held = kv_rows.held_at_once(layout, a)[rank]
    return int(2 * held if kv_rows.pattern(layout, a, "forward") == "ring" else held)


def weight_state(model: ModelSpec, workload: Workload, plan: Plan) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state per rank, sharded by ZeRO stage.

    Frozen parameters (a drafter's embedding and LM head, shared with the target) are held in the
    compute dtype and have neither gradients nor optimizer state.
    """
    sizes = _model_sizes(model)
    frozen = sizes["embedding"] / plan.tp if objective_shape(workload, model).frozen_embeddings else 0.0
    dense = sizes["dense"] / plan.tp - frozen
    expert = model.n_layers * sizes["expert_layer"] / plan.ep
    n_dense = plan.dp * plan.ctx * plan.ep  # ranks holding the same dense shard
    n_expert = plan.dp * plan.ctx * plan.tp
    z, dt = workload.zero_stage, workload.dtype_bytes
    sharded = dense / n_dense + expert / n_expert
    full = dense + expert
    largest_layer = sizes["largest_layer"] / plan.tp + sizes["expert_layer"] / plan.ep
    params = (full if z < 3 else sharded + 2 * largest_layer) * dt + frozen * dt  # ZeRO-3: gathered + prefetched layer
    grads = full * dt if z < 2 else (sharded + 2 * largest_layer) * dt  # ZeRO-2/3: reduce buckets
    optimizer = (full if z < 1 else sharded) * OPTIMIZER_BYTES_PER_PARAM
    return {"params": params, "grads": grads, "optimizer": optimizer}


_SIZES: dict[int, tuple[ModelSpec, dict[str, int]]] = {}


def _model_sizes(model: ModelSpec) -> dict:
    """Parameter counts and layer kinds of the model, found once (a search asks per candidate)."""
    hit = _SIZES.get(id(model))
    if hit is None or hit[0] is not model:
        if len(_SIZES) > 64:
            _SIZES.clear()
        hit = _SIZES[id(model)] = (model, {
            "embedding": model.embedding_params(), "dense": model.dense_params(),
            "expert_layer": model.expert_params_per_layer(),
            "largest_layer": max(model.mixer_params(a) + model.dense_ffn_params() for a in model.layers),
            "kinds": model.attention_kinds()})
    return hit[1]


def context_bytes(model: ModelSpec, kinds: dict[AttentionSpec, int], tokens: float, dtype_bytes: int,
                  tp: int, keep_kv: bool) -> float:
    """A drafter's target-feature tokens on one rank: the captured features of every conditioning
    layer, their fc projection, and the K/V each draft layer makes of them (all layers kept for
    the backward without checkpointing, one layer at a time with it)."""
    kv = {a: a.kv_width * a.kv_tensors / tp for a in kinds if a.kind != "linear"}
    per_layer = sum(n * kv[a] for a, n in kinds.items() if a in kv) if keep_kv else max(kv.values(), default=0)
    return tokens * (model.conditioning_layers * model.hidden + model.hidden + per_layer) * dtype_bytes


def loss_bytes(model: ModelSpec, loss_tokens: int, vocab_block: int | None, dtype_bytes: int, tp: int) -> float:
    """Logit buffers of the loss: Liger-style token chunks over the whole (TP-split) vocabulary,
    or, vocabulary-blocked, one block of logits for every token and its gradient."""
    vocab = math.ceil(model.vocab / tp)
    if vocab_block:
        return 2 * loss_tokens * min(vocab_block, vocab) * dtype_bytes
    return loss_chunk_tokens(loss_tokens, vocab, model.hidden) * vocab * dtype_bytes


def dense_score_bytes(layout: Layout, a: AttentionSpec, rank: int, micro_batch: int,
                      dtype_bytes: int, tp: int, copies: float) -> float:
    """Peak bytes of one layer's explicit attention on `rank` (the CPU runtime materialises the
    queries x keys scores per head): `copies` score matrices (measured: autograd's saved
    scores, the temporaries of forward and backward, the allocator's fragmentation) of its
    queries against its own positions and the K/V rows it holds at once (all received rows;
    one shard per step of a ring)."""
    return float(_dense_score_bytes(layout, a, micro_batch, dtype_bytes, tp, copies)[rank])


def _dense_score_bytes(layout: Layout, a: AttentionSpec, micro_batch: int, dtype_bytes: int,
                       tp: int, copies: float) -> np.ndarray:
    positions = kv_rows.held(layout, "positions")
    keys = positions + kv_rows.held_at_once(layout, a)
    return copies * micro_batch * positions * keys * a.n_heads / tp * dtype_bytes


def estimate_memory(model: ModelSpec, workload: Workload, plan: Plan, layout: Layout,
                    profile: HardwareProfile) -> MemoryEstimate:
    """Every rank at once: the same arithmetic per rank as a loop over ranks, on arrays."""
    dt, tp, mb = workload.dtype_bytes, plan.tp, workload.micro_batch
    weights = weight_state(model, workload, plan)
    full_ckpt = workload.checkpointing == "full"
    kinds = _model_sizes(model)["kinds"]  # identical layers hold identical buffers
    obj = objective_shape(workload, model)
    tokens = kv_rows.held(layout, "positions") * mb
    noisy = kv_rows.held(layout, "noisy") * mb
    saved = {a: tokens * saved_bytes_per_token(model, a, dt, tp) for a in kinds}
    kv = {a: kv_buffer_rows_all(layout, a) * mb * kv_row_bytes(a, dt, tp) for a in kinds}
    hidden = tokens * model.hidden * dt / tp  # one hidden-state tensor, SP-sharded
    if full_ckpt:
        # every layer's input, plus one layer recomputed with its gathered K/V, the matching
        # dK/dV buffer and the gradients flowing in and out of it
        activations = model.n_layers * hidden + functools.reduce(np.maximum, saved.values()) + 2 * hidden
        kv_buffers = 2 * functools.reduce(np.maximum, kv.values())
    else:
        # every layer keeps its tensors and its gathered K/V; one dK/dV buffer at a time
        activations = sum(n * saved[a] for a, n in kinds.items()) + 2 * hidden
        kv_buffers = sum(n * kv[a] for a, n in kinds.items()) + functools.reduce(np.maximum, kv.values())
    if obj.context_as_kv:
        context = kv_rows.held(layout, "context") * mb
        activations = activations + context_bytes(model, kinds, context, dt, tp, keep_kv=not full_ckpt)
    logits = {n: loss_bytes(model, n, obj.vocab_block, dt, tp) for n in set(noisy.tolist())}
    parts = {**weights, "activations": activations, "kv_buffers": kv_buffers,
             "logits": np.array([logits[n] for n in noisy.tolist()])}
    copies = profile.gpu.dense_score_copies
    if profile.gpu.dense_attention and copies:
        parts["attention_scores"] = functools.reduce(np.maximum, (
            _dense_score_bytes(layout, a, mb, dt, tp, copies) for a in kinds))
    n = layout.size
    gib = {k: v / GIB if isinstance(v, np.ndarray) else np.full(n, v / GIB) for k, v in parts.items()}
    gib["reserved"] = np.full(n, float(profile.gpu.reserved_gib))
    return MemoryEstimate(gib, profile.gpu.memory_gib, profile.gpu.reserved_gib)


def kv_buffer_rows_all(layout: Layout, a: AttentionSpec) -> np.ndarray:
    """`kv_buffer_rows` of every rank."""
    held = kv_rows.held_at_once(layout, a)
    return 2 * held if kv_rows.pattern(layout, a, "forward") == "ring" else held
