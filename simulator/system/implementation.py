"""What an implementation executes for each plan family: data, like a hardware profile.

The method fixes which pairs a rank computes and which K/V rows move; how a framework runs them
does not follow from it (implementation.md): which kernel family runs each attention call, how
the calls are cut (one call over every key, or local keys apart from received ones), whether the
K/V collective is waited on at once or hidden behind local work, which copies sit on the critical
path, whether collectives are padded to the largest shard, and the dtype dK/dV travel in. The
step graph reads these facts; nothing about a particular framework is written in the builder.

A profile is a YAML file in `implementations/` (or anywhere, by path), every fact written
`{value: ..., source: "..."}` as in hardware profiles.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from csbp.simulator.errors import InputError, one_line
from csbp.simulator.system.hardware import FIGURE, _unwrap
from csbp.simulator.system.profile_files import names_in, read_mapping

IMPLEMENTATION_DIR = Path(__file__).resolve().parents[2] / "implementations"
DEFAULT_IMPLEMENTATION = "turbo-dllm"

# How a pass cuts one layer's attention into kernel calls (calls named in brackets):
# whole: one call over every key, after the exchange (attn);
# local-remote: keys the rank holds apart from received ones (local, remote);
# noisy-prefix: the noisy queries over their own block apart from every query over the clean
#   prefix, own shard included (noisy-block, prefix).
# steps: one call per step of the exchange as the frameworks' CP attention runs it (frameworks.md
#   A1, B1): step 0 over the rank's own keys (local), then one call per other member's shard
#   (step), each over only the queries that see that shard (head-tail CP: Q(2C) x K(C) or
#   Q(C) x K(2C), no masked waste), kernel tiles counted; under an all-gather the steps slice the
#   gathered buffer and only step 0 runs beside the gather (TorchTitan's `allgather` rotate).
# A ring transport always calls once per step (local, ring); with `steps` its step calls are
# shaped and tile-counted as above, else priced by pairs.
Split = Literal["whole", "local-remote", "noisy-prefix", "steps"]
CALLS = {"whole": ("attn",), "local-remote": ("local", "remote"), "noisy-prefix": ("noisy-block", "prefix"),
         "steps": ("local", "step")}
FAMILIES = ("dp", "bp", "cp", "csbp", "cp-ring", "csbp-ring")

_Bool = Annotated[bool, Field(strict=True), FIGURE]
_NonNegative = Annotated[float, Field(ge=0), FIGURE]


class Pass(BaseModel):
    """One layer's attention in one phase (forward, recompute or backward) of one plan family.

    Defaults are "nothing extra": an implementation states only what it does beyond the method.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    split: Annotated[Split, FIGURE] = "local-remote"
    # kernel family per call name ("default": any call not named); "best" = the GPU's fastest
    kernels: Annotated[dict[str, str], FIGURE] = Field(default_factory=lambda: {"default": "best"})
    # calls that pack a K/V head's query heads into one query tile (FA3/FA4 pack-GQA); "all", or
    # "auto": every call packed or not, whichever computes fewer tiles
    pack_gqa: Annotated[tuple[str, ...], FIGURE] = ()
    # immediate: the collective is waited on before any attention of the layer runs
    exchange: Annotated[Literal["overlapped", "immediate"], FIGURE] = "overlapped"
    # full passes (read + write) over the call's K/V (backward: dK/dV) rows on the critical path
    copy_passes: _NonNegative = 0.0
    pad_to_largest_shard: _Bool = False  # collective buffers sized by the group's largest shard
    gradient_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None  # dK/dV element; None = the step dtype
    # issue 24, the CP mechanics of AR frameworks (frameworks.md A1, B1):
    # K/V enter the exchange and the kernel at the K/V head count ("kv") or repeated to the query
    # head count first ("query": TorchTitan's repeat_kv before SDPA; the repeat is a copy, the
    # exchange moves n_heads / n_kv_heads times the bytes, and no GQA packing is possible)
    kv_heads: Annotated[Literal["kv", "query"], FIGURE] = "kv"
    # backward: the remote K/V are fetched again by the backward itself with the forward's
    # exchange (torch CP's backward op re-gathers; the forward saved only the local K/V); a ring
    # moves K/V in its backward in any case
    refetch_kv: _Bool = False
    # backward: dK/dV go home as the layout moves them ("layout": reduce-scatter after a gather,
    # cp - 1 hops after a pass-KV ring) or on their own ring posted after every step's backward
    # call ("ring": torch CP's all-to-all dK/dV rotater, cp hops, each waited at the next step,
    # the last one home)
    dkv_exchange: Annotated[Literal["layout", "ring"], FIGURE] = "layout"
    # "kv": ranks exchange K/V between sequence shards (the layout's all-gather or ring);
    # "heads": Ulysses (Megatron cp_comm_type a2a): all-to-alls of Q, K, V from sequence to head
    # shards before attention and of O back, waited on (backward: dO in, dQ, dK, dV back); each
    # rank attends every position over heads / cp (tp*cp must divide the heads, plan/rules.py)
    context_exchange: Annotated[Literal["kv", "heads"], FIGURE] = "kv"

    @model_validator(mode="after")
    def _default_kernel(self) -> "Pass":
        if "default" not in self.kernels:
            raise ValueError("kernels must name a 'default' family")
        return self

    def kernel(self, call: str) -> str:
        return self.kernels.get(call, self.kernels["default"])

    def packs(self, call: str) -> bool | str:
        """Whether the call packs GQA heads into its query tiles; "auto": whichever wastes less."""
        if "auto" in self.pack_gqa:
            return "auto"
        return call in self.pack_gqa or "all" in self.pack_gqa


class Family(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    forward: Pass = Field(default_factory=Pass)
    recompute: Pass | None = None  # None: as the forward
    backward: Pass = Field(default_factory=Pass)

    def phase(self, phase: str) -> Pass:
        if phase == "recompute":
            return self.recompute or self.forward
        return self.backward if phase == "backward" else self.forward


ShardGroup = Literal["dp-ctx-ep", "dp-ctx", "dp-ctx-tp", "none"]
Buckets = Literal["layer", "largest-parameter", "step"]
Reduce = Literal["reduce-scatter", "all-reduce"]
_Bytes = Annotated[int, Field(ge=0, le=8, strict=True), FIGURE]


class OptimizerPath(BaseModel):
    """How gradients reach the optimizer and what it keeps (one objective's, resolved).

    Defaults are what the step graph priced before profiles said it (= csbp's runtime,
    runtime/distributed/sharded_optimizer.py): state sharded over the ranks holding the same
    shard (dense dp x ctx x ep, experts dp x ctx x tp), per-layer reduce-scatter buckets.
    The workload's ZeRO stage still says what is sharded (1: state, 2: + gradients, 3: + params);
    `shard_group: none` replicates everything whatever the stage.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_group: Annotated[ShardGroup, FIGURE] = "dp-ctx-ep"  # dense parameters
    expert_shard_group: Annotated[ShardGroup, FIGURE] = "dp-ctx-tp"
    reduce: Annotated[Reduce, FIGURE] = "reduce-scatter"  # the gradient collective (sharded state)
    reduce_with_ep: Annotated[Reduce | None, FIGURE] = None  # when ep > 1; None: as `reduce`
    # dense gradients summed over the EP group by one more all-reduce (a dense shard group
    # without ep: the EP peers hold the same dense weights)
    ep_dense_all_reduce: _Bool = False
    # layer: one bucket per layer, reduced after its backward; largest-parameter: buckets the
    # size of the largest trainable parameter (the embedding), reduced when one fills; step:
    # every gradient in one call after the backward (Megatron's overlap_grad_reduce off)
    buckets: Annotated[Buckets, FIGURE] = "layer"
    bucket_buffers: Annotated[int, Field(ge=1, strict=True), FIGURE] = 2
    bucket_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None  # None: the step dtype
    # an all-reduced bucket is first flattened into one more buffer (a fallback's copy)
    flatten_all_reduce: _Bool = False
    clip_temporary_bytes: _Bytes = 0  # per element of the gradient tensor the norm reads (0: none)
    state_bytes: Annotated[int, Field(ge=1, le=8, strict=True), FIGURE] = 4  # each Adam moment
    master: _Bool = True  # an fp32 master copy of weights trained in a lower precision
    # the framework's sharding whatever the workload's ZeRO stage (FSDP2: 3, parameters gathered
    # a layer at a time; Megatron's distributed optimizer: 1); None: the workload's stage
    zero_stage: Annotated[int | None, Field(ge=0, le=3), FIGURE] = None
    # element of the parameter shards a rank stores under ZeRO-3 (FSDP2 keeps them in fp32 and
    # casts on the gather: they are the master); None: the step dtype
    param_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None
    # element of the gradients a rank keeps, sharded or whole (Megatron's fp32 main_grad, FSDP2's
    # fp32 reduce dtype); None: the step dtype
    grad_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None
    # the gradient buffer is allocated before the step and alive throughout (Megatron's
    # contiguous grad buffer, reduced in place); false: gradients appear as the backward makes them
    persistent_grads: _Bool = False
    # ZeRO-3: the layers whose parameters are freed after their forward and gathered again in
    # backward: all, or all but the last (FSDP2 keeps the last block's for its backward)
    reshard_after_forward: Annotated[Literal["all", "all-but-last"], FIGURE] = "all"
    # ZeRO-3: the root (embedding, final norm, LM head): `not-gathered` prices its shards as if
    # each rank held them (the default [U]); `gathered-once`: one all-gather before the forward,
    # unsharded until its backward is done (FSDP2's root module, not resharded after forward)
    root: Annotated[Literal["not-gathered", "gathered-once"], FIGURE] = "not-gathered"

    def dense_group(self, plan) -> int:
        return _group_size(self.shard_group, plan)

    def expert_group(self, plan) -> int:
        return _group_size(self.expert_shard_group, plan)

    def collective(self, plan) -> Reduce:
        return self.reduce_with_ep or self.reduce if plan.ep > 1 else self.reduce

    def stage(self, workload_stage: int) -> int:
        """The ZeRO stage that runs: the framework's, else the workload's."""
        return workload_stage if self.zero_stage is None else self.zero_stage


def _group_size(group: ShardGroup, plan) -> int:
    axes = {"dp-ctx-ep": (plan.dp, plan.ctx, plan.ep), "dp-ctx": (plan.dp, plan.ctx),
            "dp-ctx-tp": (plan.dp, plan.ctx, plan.tp), "none": (1,)}[group]
    return int(math.prod(axes))


class OptimizerOverride(BaseModel):
    """An objective's own optimizer path (e.g. a replicated drafter): the fields it changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_group: Annotated[ShardGroup | None, FIGURE] = None
    expert_shard_group: Annotated[ShardGroup | None, FIGURE] = None
    reduce: Annotated[Reduce | None, FIGURE] = None
    reduce_with_ep: Annotated[Reduce | None, FIGURE] = None
    ep_dense_all_reduce: Annotated[bool | None, FIGURE] = None
    buckets: Annotated[Buckets | None, FIGURE] = None
    bucket_buffers: Annotated[int | None, Field(ge=1), FIGURE] = None
    bucket_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None
    flatten_all_reduce: Annotated[bool | None, FIGURE] = None
    clip_temporary_bytes: Annotated[int | None, Field(ge=0, le=8), FIGURE] = None
    state_bytes: Annotated[int | None, Field(ge=1, le=8), FIGURE] = None
    master: Annotated[bool | None, FIGURE] = None
    zero_stage: Annotated[int | None, Field(ge=0, le=3), FIGURE] = None
    param_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None
    grad_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None
    persistent_grads: Annotated[bool | None, FIGURE] = None
    reshard_after_forward: Annotated[Literal["all", "all-but-last"] | None, FIGURE] = None
    root: Annotated[Literal["not-gathered", "gathered-once"] | None, FIGURE] = None


class Optimizer(OptimizerPath):
    """The optimizer path, and per objective (`ObjectiveShape.name`) what differs."""

    objectives: dict[str, OptimizerOverride] = Field(default_factory=dict)

    def path(self, objective: str) -> OptimizerPath:
        """The resolved path of one objective (cached: the planner asks per candidate)."""
        key = (id(self), objective)
        hit = _PATHS.get(key)
        if hit is None or hit[0] is not self:
            base = self.model_dump(exclude={"objectives"})
            over = self.objectives.get(objective)
            if over is not None:
                base |= over.model_dump(exclude_none=True)
            hit = _PATHS[key] = (self, OptimizerPath(**base))
        return hit[1]


_PATHS: dict[tuple, tuple[Optimizer, OptimizerPath]] = {}


class LossKernel(BaseModel):
    """The LM head + cross-entropy kernel (defaults: Liger's chunked rule, logits in the step
    dtype, the weight gradient computed with the chunk, nothing recomputed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # chunked-ce: Liger-Kernel's chunks (memory.loss_chunk_tokens), gradients made in the
    # forward; tiled-ce: fixed row tiles, logits recomputed in backward; unchunked: the head
    # over every loss row at once, then cross-entropy over the whole [rows, V/tp] logits
    # (`logits_buffers` alive at it, `backward_tile_bytes` at its backward)
    kernel: Annotated[Literal["chunked-ce", "tiled-ce", "unchunked"], FIGURE] = "chunked-ce"
    # unchunked: bytes per [row, V/tp] element of each buffer alive at the forward's
    # cross-entropy (TorchTitan: the bf16 logits and their fp32 copy, ...)
    logits_buffers: Annotated[tuple[int, ...], FIGURE] = ()
    tile_rows: Annotated[int | None, Field(ge=1), FIGURE] = None  # tiled-ce: rows per tile
    logits_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None  # None: the step dtype
    # tiled-ce backward: bytes per element of each buffer it allocates (one entry per buffer)
    backward_tile_bytes: Annotated[tuple[int, ...], FIGURE] = ()  # per tile [tile, V/tp]: logits, their gradients
    grad_weight_bytes: Annotated[tuple[int, ...], FIGURE] = ()  # the whole [V/tp, hidden]
    grad_hidden_bytes: Annotated[tuple[int, ...], FIGURE] = ()  # every loss row [rows, hidden]
    recompute_logits: _Bool = False  # the backward runs the head's forward GEMM again
    # the head's input gradient summed over TP: reduce-scatter (sequence parallel) or all-reduce
    tp_grad_hidden: Annotated[Reduce, FIGURE] = "reduce-scatter"
    # a frozen head (a drafter's, objectives.py) run over blocks of this many rows, each with a
    # [rows, vocab block] workspace of frozen_head_bytes elements; None: one block of every row,
    # logits and their gradient in the step dtype
    frozen_head_rows: Annotated[int | None, Field(ge=1), FIGURE] = None
    frozen_head_bytes: Annotated[int, Field(ge=1, le=4), FIGURE] = 4

    @model_validator(mode="after")
    def _tiles(self) -> "LossKernel":
        if self.kernel == "tiled-ce" and self.tile_rows is None:
            raise ValueError("a tiled-ce loss needs tile_rows")
        if self.kernel == "unchunked" and not self.logits_buffers:
            raise ValueError("an unchunked loss needs logits_buffers (bytes of each [row, vocab] buffer)")
        return self


class TensorParallelRun(BaseModel):
    """How a layer's TP (sequence-parallel) collectives run (default: waited, replayed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # waited: the next op waits for the collective; overlapped: GEMM/collective overlap
    # (userbuffers-style), the layer's end waits for both
    exchange: Annotated[Literal["waited", "overlapped"], FIGURE] = "waited"
    # the backward's collectives when they run otherwise (Transformer Engine overlaps the norm
    # output's all-gather with dgrad and the reduce-scatter with wgrad); None: as `exchange`
    backward_exchange: Annotated[Literal["waited", "overlapped"] | None, FIGURE] = None
    replay_in_recompute: _Bool = True  # a recomputed layer runs its collectives again

    def mode(self, phase: str) -> str:
        """How the phase's TP collectives run: waited or overlapped."""
        return self.backward_exchange or self.exchange if phase == "backward" else self.exchange


class MoE(BaseModel):
    """How a MoE layer's experts and its expert-parallel exchange run (implementation.md 11).
    Defaults: one GEMM per local expert on the dense curve, NCCL all-to-alls in the step dtype,
    the dense branch beside the combine, no host syncs or copies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # per-expert: one GEMM call per local expert (dense curve); a GPU GEMM family (grouped-mm):
    # one call over jagged groups at the family's curve; best: the faster of all
    expert_gemm: Annotated[str, FIGURE] = "per-expert"
    # nccl, a link's all-to-all family (deepep-normal), or best
    a2a_kernel: Annotated[str, FIGURE] = "nccl"
    dispatch_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None  # None: the step dtype
    weight_bytes: Annotated[int, Field(ge=0, le=8), FIGURE] = 0  # routing weight per routed row, sent with the dispatch
    # the a2a the dense branch runs beside: dispatch (experts wait for it, the combine is waited
    # on after the experts) or combine (dense after the experts, beside the combine)
    dense_overlaps: Annotated[Literal["combine", "dispatch"], FIGURE] = "combine"
    host_syncs_per_layer: Annotated[int, Field(ge=0), FIGURE] = 0  # per layer and forward pass
    # full read + write passes over the route-expanded rows (rows x top-k x hidden) per pass
    route_copy_passes: _NonNegative = 0.0
    # communication buffers the EP exchange allocates outside the framework's caching allocator
    # (DeepEP's own NVLink buffer), allocated once and alive the whole run: they count against
    # the GPU's memory but not in max_memory_allocated. Size: channels x EP peers x tokens per
    # channel x (one routed row at max(dispatch element, 2 B) + `comm_buffer_meta_bytes`);
    # 0 channels: none (NCCL all-to-alls use the caching allocator)
    comm_buffer_channels: Annotated[int, Field(ge=0), FIGURE] = 0
    comm_buffer_tokens: Annotated[int, Field(ge=0), FIGURE] = 0  # tokens per channel and peer
    comm_buffer_meta_bytes: Annotated[int, Field(ge=0), FIGURE] = 0  # per token: indices, weights, scales
    # bytes per token and layer of routing metadata saved with each layer's checkpoint for the
    # backward (top-k indices replayed in recompute: top_k x this); 0: none kept
    saved_route_index_bytes: Annotated[int, Field(ge=0, le=8), FIGURE] = 0


class LinearAttention(BaseModel):
    """How linear-attention (Gated-DeltaNet) layers run (implementation.md 13). Defaults: one
    delta-rule call outside CP/CSBP priced on the attention curves, its all-to-alls hidden."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # attention-curve: the attention curves at the chunk tile; a GPU linear family; best
    kernel: Annotated[str, FIGURE] = "attention-curve"
    # the clean stream once, then every noisy block from its clean-prefix state, on every plan
    two_passes: _Bool = False
    state_bytes: Annotated[int, Field(ge=1, le=4), FIGURE] = 4  # boundary state element
    # waited: the sequence<->head all-to-alls block the compute stream (synchronous calls)
    exchange: Annotated[Literal["overlapped", "waited"], FIGURE] = "overlapped"
    # pure CP: the noisy rows go head-parallel too (their own all-to-alls), no state exchange
    cp_moves_noisy: _Bool = False
    # the sequence -> head all-to-all moves the output gate z and the per-head beta and a with
    # q, k, v (false: q, k, v only)
    a2a_gate_inputs: _Bool = False


class FP8Linears(BaseModel):
    """What a framework runs around the transformer blocks' linears when they run FP8 (torchao
    Float8, Transformer Engine; frameworks.md A2, B3); the FP8 GEMM's own speed is the hardware
    profile's, the linear dtype the workload's or the profile's `linear_dtype`. Defaults:
    nothing cast or cached.

    Cast traffic is HBM bytes per element of the tensor cast, summing every pass a framework makes
    over it (amax reduction, scale-and-cast, transposed copy); priced as memory-bound ops."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the GEMMs of each block linear that run FP8 when the linear dtype is fp8 (the rest bf16)
    gemms: Annotated[tuple[Literal["forward", "dgrad", "wgrad"], ...], FIGURE] = ("forward", "dgrad", "wgrad")
    # per element of each linear's input in forward (and recompute), of each linear's output
    # gradient in backward, and of each input passed over again in backward (recast from a saved
    # high-precision input, or the saved FP8 copy laid out anew for wgrad)
    activation_cast_bytes: _NonNegative = 0.0
    gradient_cast_bytes: _NonNegative = 0.0
    backward_input_cast_bytes: _NonNegative = 0.0
    # per weight element: each forward pass (recompute included) casts the weights again, or
    # (`weight_cache_bytes` > 0) once per step into cached copies alive the whole step
    weight_cast_bytes: _NonNegative = 0.0
    backward_weight_cast_bytes: _NonNegative = 0.0  # per weight element in backward (recast or re-laid out)
    weight_cache_bytes: _Bytes = 0  # cached FP8 weight copies per parameter (TE: FP8 + its transpose)
    # FP8 copies of a linear's input alive beside its GEMM, bytes per input element
    activation_copy_bytes: _NonNegative = 0.0
    # one all-reduce of every linear's weight amax over the shard group after the optimizer step
    # (torchao's precompute_float8_dynamic_scale_for_fsdp)
    amax_all_reduce: _Bool = False
    # element of the norm output's sequence-parallel all-gather into the linears when they run
    # FP8 (Transformer Engine casts before the gather: 1); None: the step dtype
    tp_gather_bytes: Annotated[int | None, Field(ge=1, le=4), FIGURE] = None


class HeadDimCopy(BaseModel):
    """K/V repeated before attention at one head dim: a kernel that packs at most `max_group`
    query heads per K/V head repeats each K/V head ceil(group / max_group) times."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    head_dim: Annotated[int, Field(gt=0)]
    max_group: Annotated[int, Field(gt=0)]
    # backward packs [noisy; clean] K/V repeated into a new buffer plus a gradient buffer as large
    backward_grad_buffer: bool = True
    kernels: tuple[str, ...] = ()  # kernel families that repeat; empty: every family
    # pure CP (the cp family's all-gather of every key): the backward of a layer of these kinds
    # at this head dim also all-gathers every rank's rows of these query-width tensors over the
    # CP group (the attention output before the call, dQ after it), waited on as the family's
    # exchange; empty: none
    cp_gathers: tuple[Literal["output", "dq"], ...] = ()
    cp_gather_kinds: tuple[Literal["full", "sliding"], ...] = ("full",)


class Implementation(BaseModel):
    """Per plan family (dp, bp, cp, csbp and the ring transports) what runs; a family not
    listed runs as `ideal` does (best kernel, collectives hidden where the graph allows)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    notes: str
    families: dict[str, Family] = Field(default_factory=dict)
    # beyond the strict shape rules (plan_rules.py): TP over a multiple of a layer's K/V heads,
    # each K/V head copied on tp / kv ranks; false (the default): TP must divide the K/V heads
    tp_replicates_kv_heads: _Bool = False
    optimizer: Optimizer = Field(default_factory=Optimizer)  # the gradient path and the optimizer
    loss: LossKernel = Field(default_factory=LossKernel)
    tp: TensorParallelRun = Field(default_factory=TensorParallelRun)
    moe: MoE = Field(default_factory=MoE)  # experts and the EP exchange
    linear_attention: LinearAttention = Field(default_factory=LinearAttention)
    head_dim_copies: Annotated[tuple[HeadDimCopy, ...], FIGURE] = ()  # K/V repeats per head dim
    # the transformer blocks' linear GEMMs when the workload names no dtype (None: bf16); all
    # three GEMMs of each block linear run in it, the LM head stays bf16 (linear_ops.LinearGemmOps)
    linear_dtype: Annotated[Literal["bf16", "fp8"] | None, FIGURE] = None
    fp8: FP8Linears = Field(default_factory=FP8Linears)  # casts and copies around FP8 linears
    # the plan families this framework can run (a plan of another is refused in one line,
    # plan/rules.py); empty: every family
    plan_families: Annotated[tuple[str, ...], FIGURE] = ()
    # a two-stream objective (DiffusionGemma, implementation.md 12) under CP/CSBP: how the
    # decoder gets the encoder's remote clean K/V. `regather`: its own layers gather them again
    # (forward and recompute) and send their gradients home in backward, each rank keeping only
    # the encoder K/V rows it owns. Keeping every layer's gathered clean K/V alive for the
    # decoder instead is not modelled (no other value is accepted).
    encoder_kv: Annotated[Literal["regather"], FIGURE] = "regather"
    # a two-stream objective under pure CP: which positions each stream runs on a rank.
    # `shared-2l`: both streams keep the 2L two-chunk zigzag (implementation.md 1: noisy chunk r,
    # clean chunk 2cp-1-r), balanced only when the streams run in one pass, so each stream alone
    # is unbalanced and every layer's K/V collective waits for its slowest rank. `per-stream`:
    # each stream's own L positions zigzagged over the CP group (rank r: chunks r and 2cp-1-r of
    # that stream's 2cp), each stream balanced on its own. CSBP, BP and DP are the same either way
    # (CSBP's clean shard is already the clean stream's own zigzag, its noisy blocks whole).
    stream_ownership: Annotated[Literal["shared-2l", "per-stream"], FIGURE] = "shared-2l"
    # the K/V transport a plan of this framework runs when the user names none (`--transport`):
    # Megatron's cp_comm_type defaults to p2p, a ring; None: collective (an all-gather)
    transport: Annotated[Literal["collective", "ring"] | None, FIGURE] = None
    sources: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _unwrap_facts(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "sources" in data:
            raise ValueError("sources is filled from the {value, source} facts; do not write it")
        sources: dict[str, str] = {}
        # top-level facts (tp_replicates_kv_heads); families are unwrapped pass by pass below
        out = data | _unwrap(cls, {k: v for k, v in data.items() if k != "families"}, "", sources)
        families = data.get("families")
        if isinstance(families, dict):
            out["families"] = {
                name: {ph: _unwrap(Pass, p, f"families.{name}.{ph}.", sources) if isinstance(p, dict) else p
                       for ph, p in fam.items()} if isinstance(fam, dict) else fam
                for name, fam in families.items()}
        return {**out, "sources": sources}

    @model_validator(mode="after")
    def _known_families(self) -> "Implementation":
        unknown = sorted(set(self.families) - set(FAMILIES))
        if unknown:
            raise ValueError(f"unknown plan families {unknown}: use {', '.join(FAMILIES)}")
        unknown = sorted(set(self.plan_families) - set(FAMILIES))
        if unknown:
            raise ValueError(f"plan_families {unknown}: use {', '.join(FAMILIES)}")
        for name, fam in self.families.items():
            for p in (fam.forward, fam.recompute, fam.backward):
                if p is not None and p.split == "noisy-prefix" and name != "csbp":
                    raise ValueError(f"{name}: the noisy-prefix split needs whole noisy blocks and the "
                                     "whole clean sequence on each rank after the exchange (csbp only)")
                if p is not None and p.context_exchange == "heads" and name not in ("cp", "cp-ring"):
                    raise ValueError(f"{name}: Ulysses (context_exchange: heads) shards heads over a "
                                     "cp group of the whole sequence (cp, cp-ring only)")
        return self

    @staticmethod
    def family_name(kind: str, transport: str) -> str:
        """The plan family of a layout kind (single, dp, bp, cp, csbp) and transport."""
        name = {"single": "dp"}.get(kind, kind)
        return name + "-ring" if name in ("cp", "csbp") and transport == "ring" else name

    def family(self, kind: str, transport: str) -> Family:
        """What runs for a plan of this layout kind (single, dp, bp, cp, csbp) and transport."""
        return self.families.get(self.family_name(kind, transport)) or Family()

    def refusal(self, kind: str, transport: str) -> str | None:
        """One line when this framework cannot run the plan family at all; None when it can."""
        name = self.family_name(kind, transport)
        if not self.plan_families or name in self.plan_families:
            return None
        return (f"implementation {self.name!r} cannot run {name} plans (it runs "
                f"{', '.join(self.plan_families)})")


    def kernels(self) -> set[str]:
        """Every kernel family this implementation names (a profile must list them)."""
        return {k for fam in self.families.values() for p in (fam.forward, fam.recompute, fam.backward)
                if p is not None for k in p.kernels.values()} - {"best"}


def list_implementations() -> list[str]:
    return names_in(IMPLEMENTATION_DIR)


_LOADED: dict[str, Implementation] = {}


def load_implementation(name_or_path: str | Implementation) -> Implementation:
    """A shipped implementation by name (`turbo-dllm`, `ideal`) or any YAML file by path."""
    if isinstance(name_or_path, Implementation):
        return name_or_path
    if name_or_path in _LOADED:
        return _LOADED[name_or_path]
    path, raw = read_mapping(name_or_path, IMPLEMENTATION_DIR, "implementation")
    try:
        impl = Implementation.model_validate(raw)
    except ValidationError as err:
        raise InputError(f"{path}: {one_line(err)}") from None
    _LOADED[name_or_path] = impl
    return impl


def check_kernels(impl: Implementation, gpu) -> None:
    """One line if the implementation names a kernel family the GPU does not list."""
    if not gpu.attention_kernels:
        return
    missing = sorted(impl.kernels() - set(gpu.attention_kernels))
    if missing:
        raise InputError(f"implementation {impl.name!r} runs {', '.join(missing)}, which the GPU "
                         f"{gpu.name!r} does not list (it has {', '.join(gpu.attention_kernels)})")
    for what, name, listed, own in (
            ("GEMM", impl.moe.expert_gemm, gpu.gemm_kernels, ("per-expert", "best")),
            ("linear-attention", impl.linear_attention.kernel, gpu.linear_attention_kernels,
             ("attention-curve", "best"))):
        if listed and name not in own and name not in listed:
            raise InputError(f"implementation {impl.name!r} runs the {what} kernel {name!r}, which the "
                             f"GPU {gpu.name!r} does not list (it has {', '.join(listed)})")
