"""Peak memory per rank, as the planner and `csbp simulate` read it: `MemoryEstimate`.

The peak is the maximum over the step of the live tensor bytes (`memory_timeline` walks the step
in program order), on each rank of the layout, plus what the allocator adds on top of live
tensors (`gpu.allocator_overhead` of the profile) and the reserved memory. A plan fits when that
total is within the GPU's memory; when it does not, the reason names the rank, the phase and op
of the peak and what is alive there. Sizes follow the layout (the tokens each rank holds, the
K/V rows it receives), so CP, BP and CSBP differ exactly where their layouts do; pure BP holds
its replicated clean prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from csbp.simulator.layout import kv_rows
from csbp.simulator.cost import loss_ops, memory_timeline
from csbp.simulator.cost.linear_ops import resolve_linear_dtype
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.system.implementation import load_implementation
from csbp.simulator.layout.layout import Layout, kv_row_bytes
from csbp.simulator.layout.objective_layout import stream_views, untrimmed
from csbp.simulator.workload.objectives import objective_shape
from csbp.simulator.plan.plan import Plan
from csbp.simulator.report.result import GIB
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload.workload import Workload

# fp32 master weights + Adam m and v (mixed-precision AdamW): 4 + 4 + 4 bytes per parameter.
OPTIMIZER_BYTES_PER_PARAM = memory_timeline.MASTER_BYTES_PER_PARAM + memory_timeline.ADAM_BYTES_PER_PARAM
LABELS = memory_timeline.LABELS


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

@dataclass(frozen=True)
class MemoryEstimate:
    """Every rank's peak from the step's live-tensor timeline (`memory_timeline`).

    `allocated`: the live-tensor peak per rank (GiB), what `torch.cuda.max_memory_allocated`
    (or the CPU runtime's tracker) measures. A rank needs that plus what the allocator adds over
    live bytes (the profile's `gpu.allocator_overhead`) plus the reserved memory (context,
    communicator buffers). `parts` breaks each rank's need down by category at the moment of
    its peak; it is built only when asked (a search reads the totals of thousands of plans).
    `outside_gib`: buffers allocated outside the caching allocator (DeepEP's, implementation.md
    11), alive the whole run: not in `allocated`, but in every rank's need.
    """

    allocated: np.ndarray  # GiB per rank: the live-tensor peak
    capacity_gib: float
    reserved_gib: float
    overhead: float  # allocator bytes per live byte at the peak
    timeline: memory_timeline.Timeline = field(repr=False)
    where: np.ndarray = field(repr=False)  # per rank: index of its peak moment
    outside_gib: float = 0.0  # per rank, outside the caching allocator (same on every rank)

    @cached_property
    def moments(self) -> tuple:
        """Per rank: the memory_timeline.Moment of its peak."""
        return tuple(self.timeline.moments[m] for m in self.where.tolist())

    @cached_property
    def parts(self) -> dict[str, np.ndarray]:
        """GiB per rank by category at each rank's peak, allocator and reserved included."""
        n = len(self.allocated)
        parts: dict[str, np.ndarray] = {}
        for m in set(self.where.tolist()):
            ranks = self.where == m
            for k, v in memory_timeline._merge(*self.timeline.groups[m]).items():
                if k not in parts:
                    parts[k] = np.zeros(n)
                parts[k][ranks] = (v[ranks] if isinstance(v, np.ndarray) else v) / GIB
        parts = {k: v for k, v in parts.items() if v.any()}
        parts["allocator"] = self.allocated * self.overhead
        if self.outside_gib:
            parts["outside"] = np.full(n, float(self.outside_gib))
        parts["reserved"] = np.full(n, float(self.reserved_gib))
        return parts

    @cached_property
    def per_rank(self) -> tuple[dict[str, float], ...]:
        """GiB by component, one dict per rank."""
        return tuple(self.rank(r) for r in range(len(self.totals_gib)))

    def rank(self, r: int) -> dict[str, float]:
        """GiB by category at rank r's peak, allocator and reserved included."""
        out = {k: v / GIB for k, v in self.timeline.breakdown(int(self.where[r]), r).items()}
        out["allocator"] = float(self.allocated[r] * self.overhead)
        if self.outside_gib:
            out["outside"] = float(self.outside_gib)
        return out | {"reserved": float(self.reserved_gib)}

    @cached_property
    def totals_gib(self) -> list[float]:
        """Each rank's need: allocated x (1 + allocator overhead) + reserved + outside."""
        total = self.allocated * (1 + self.overhead) + float(self.reserved_gib)
        if self.outside_gib:
            total = total + float(self.outside_gib)
        return total.tolist()

    @property
    def peak_rank(self) -> int:
        return int(np.argmax(self.totals_gib))

    @property
    def peak_gib(self) -> float:
        return max(self.totals_gib)

    @property
    def allocated_gib(self) -> float:
        """The live-tensor peak of the peak rank (what an allocated-bytes counter measures)."""
        return float(self.allocated[self.peak_rank])

    @property
    def max_allocated_gib(self) -> float:
        """The largest live-tensor peak over ranks (runtimes report the max over ranks)."""
        return float(np.max(self.allocated))

    @property
    def peak_at(self) -> dict:
        """Where the peak rank peaks: rank, phase, op and layer (None outside the layers)."""
        r = self.peak_rank
        m = self.moments[r]
        return {"rank": r, "phase": m.phase, "op": m.op, "layer": m.layer}

    @property
    def breakdown(self) -> dict[str, float]:
        """GiB by category at the peak rank's peak, largest first (reserved last)."""
        parts = self.rank(self.peak_rank)
        reserved = parts.pop("reserved", 0.0)
        out = dict(sorted(((k, v) for k, v in parts.items() if v > 0), key=lambda kv: -kv[1]))
        return out | {"reserved": reserved}

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
        shown = ", ".join(f"{LABELS.get(k, k)} {v:.1f}"
                          for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v >= 0.05)
        usable = self.capacity_gib - self.reserved_gib
        where = f" at {self.moments[r].describe()}"
        return (f"infeasible: needs {need:.1f} GiB on rank {r}{where} ({shown}) > {usable:.1f} GiB "
                f"usable ({self.capacity_gib:.1f} GiB HBM - {self.reserved_gib:.1f} reserved)")


def weight_state(model: ModelSpec, workload: Workload, plan: Plan) -> dict[str, float]:
    """Bytes of parameters, gradients (after the backward) and optimizer state (with the fp32
    master copy under mixed precision) per rank, sharded by ZeRO stage
    (`memory_timeline.weight_state`). Frozen parameters (a drafter's embedding and LM head,
    shared with the target) are held in the compute dtype and have neither gradients nor
    optimizer state."""
    obj = objective_shape(workload, model)
    w = memory_timeline.weight_state(model, workload.zero_stage, workload.dtype_bytes, plan,
                                     obj.frozen_embeddings)
    return {"params": w.params, "grads": w.grads, "optimizer": w.optimizer + w.master}


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


# GPU copies of a batch's target features (implementation.md section 14): synthetic features are
# allocated once; the offline reader keeps one batch ahead on the GPU, so two copies are alive
FEATURE_COPIES = {"synthetic": 1, "offline": 2}


def context_bytes(model: ModelSpec, kinds: dict[AttentionSpec, int], tokens: float, dtype_bytes: int,
                  tp: int, keep_kv: bool, feature_rows=None, feature_copies: int = 1) -> float:
    """A drafter's target-feature tokens on one rank: the captured features of every conditioning
    layer (`feature_copies` buffers of the rank's whole shard, `feature_rows`: a windowed drafter
    trims after the copy, section 14), their fc projection and the K/V each draft layer makes of
    the rows it keeps (`tokens`; all layers kept for the backward without checkpointing, one
    layer at a time with it)."""
    kv = {a: a.kv_width * a.kv_tensors / tp for a in kinds if a.kind != "linear"}
    per_layer = sum(n * kv[a] for a, n in kinds.items() if a in kv) if keep_kv else max(kv.values(), default=0)
    shard = tokens if feature_rows is None else feature_rows
    features = feature_copies * shard * model.conditioning_layers * model.hidden * dtype_bytes
    return features + tokens * (model.hidden + per_layer) * dtype_bytes


def loss_bytes(model: ModelSpec, loss_tokens: int, vocab_block: int | None, dtype_bytes: int, tp: int) -> float:
    """Logit buffers of the loss: Liger-style token chunks over the whole (TP-split) vocabulary,
    or, vocabulary-blocked, one block of logits for every token and its gradient."""
    vocab = math.ceil(model.vocab / tp)
    if vocab_block:
        return 2 * loss_tokens * min(vocab_block, vocab) * dtype_bytes
    return loss_chunk_tokens(loss_tokens, vocab, model.hidden) * vocab * dtype_bytes


_ESTIMATES: dict[tuple, tuple[ModelSpec, HardwareProfile, MemoryEstimate]] = {}


def estimate_memory(model: ModelSpec, workload: Workload, plan: Plan, layout: Layout,
                    profile: HardwareProfile) -> MemoryEstimate:
    """Every rank's peak from one walk of the step (`memory_timeline.walk_activations`). Kept for the
    last plans asked: a search asks again for the same plan at each placement of its group,
    which changes links, not bytes."""
    key = (id(model), id(profile), workload, plan.dp, plan.tp, plan.ep, plan.cp, plan.bp,
           plan.transport, plan.schedule)
    hit = _ESTIMATES.get(key)
    if hit is not None and hit[0] is model and hit[1] is profile:
        return hit[2]
    tl = step_timeline(model, workload, plan, layout, profile)
    peaks, where = tl.peaks()
    outside = outside_allocator_bytes(model, plan, load_implementation(profile.implementation),
                                      workload.dtype_bytes)
    est = MemoryEstimate(peaks / GIB, profile.gpu.memory_gib, profile.gpu.reserved_gib,
                         profile.gpu.allocator_overhead or 0.0, tl, where, outside / GIB)
    if len(_ESTIMATES) > 2048:
        _ESTIMATES.clear()
    _ESTIMATES[key] = (model, profile, est)
    return est


def outside_allocator_bytes(model: ModelSpec, plan: Plan, impl, dt: int) -> float:
    """Per rank: the EP exchange's own communication buffers (DeepEP's NVLink buffer,
    implementation.md 11), allocated outside the caching allocator once and alive the whole
    run: channels x EP peers x tokens per channel x (a routed row + its metadata), the sizing
    rule of DeepEP's buffer-size hint (profile facts, [U]). 0 without EP or such buffers."""
    m = impl.moe
    if model.moe is None or plan.ep <= 1 or not m.comm_buffer_channels:
        return 0.0
    row = model.hidden * max(m.dispatch_bytes or dt, 2)
    return float(m.comm_buffer_channels * plan.ep * m.comm_buffer_tokens * (row + m.comm_buffer_meta_bytes))


def step_timeline(model: ModelSpec, workload: Workload, plan: Plan, layout: Layout,
                  profile: HardwareProfile) -> memory_timeline.Timeline:
    """The step's live bytes moment by moment on every rank, sized from the layout: the
    activations' walk (`step_bytes`, shared by plans that differ only in dp and ep) under this
    plan's weight state."""
    impl = load_implementation(profile.implementation)
    obj = objective_shape(workload, model)
    opt = impl.optimizer.path(obj.name)
    zero = opt.stage(workload.zero_stage)  # the framework's sharding (FSDP2: 3), else the workload's
    fp8 = resolve_linear_dtype(workload, impl) == "fp8"
    weights = memory_timeline.weight_state(model, zero, workload.dtype_bytes, plan, obj.frozen_embeddings,
                                           obj.frozen_router, opt, impl.fp8.weight_cache_bytes if fp8 else 0)
    return step_bytes(model, workload, plan, layout, profile, weights.replicas > 1).timeline(weights)


_STEP_BYTES: dict[tuple, tuple[ModelSpec, HardwareProfile, memory_timeline.StepBytes]] = {}


def step_bytes(model: ModelSpec, workload: Workload, plan: Plan, layout: Layout,
               profile: HardwareProfile, synced: bool) -> memory_timeline.StepBytes:
    """The activations' side of `step_timeline`: what it reads of the plan is the layout's
    ownership and transport, TP and the plan family, so it is walked once for all the plans of
    a search that differ only in dp and ep (`synced`: their gradients are summed at all)."""
    key = (id(model), id(profile), workload, layout.ownership_key(), layout.plan.transport,
           layout.checkpointing, plan.tp, plan.kind, plan.transport, synced)
    hit = _STEP_BYTES.get(key)
    if hit is not None and hit[0] is model and hit[1] is profile:
        return hit[2]
    walked = _walk_activations(model, workload, plan, layout, profile, synced)
    if len(_STEP_BYTES) > 1024:
        _STEP_BYTES.clear()
    _STEP_BYTES[key] = (model, profile, walked)
    return walked


def _walk_activations(model: ModelSpec, workload: Workload, plan: Plan, layout: Layout,
                      profile: HardwareProfile, synced: bool) -> memory_timeline.StepBytes:
    dt, tp, mb = workload.dtype_bytes, plan.tp, workload.micro_batch
    obj = objective_shape(workload, model)
    rows = getattr(obj, "rows_per_example", 1)  # examples packed as rows of one batch
    batch = mb * rows
    tokens = kv_rows.held(layout, "positions") * batch
    noisy = kv_rows.held(layout, "noisy") * batch
    impl = load_implementation(profile.implementation)
    family = impl.family(layout.kind, plan.transport)
    linear_dtype = resolve_linear_dtype(workload, impl)
    sizes = memory_timeline.Sizes(tokens=tokens, noisy=noisy, hidden=tokens * model.hidden * dt / tp,
                                  dt=dt, tp=tp, batch=batch, family=family, impl=impl,
                                  block=workload.block_size, linear_dtype=linear_dtype,
                                  routing=route_index_bytes(model, impl, tokens, tp))
    eager = bool(profile.gpu.dense_attention)
    zero = impl.optimizer.path(obj.name).stage(workload.zero_stage)
    full_ckpt = workload.checkpointing == "full"
    kinds = _model_sizes(model)["kinds"]
    if eager:
        # ar: every token carries the loss (the masked fraction is of noisy tokens only)
        loss = memory_timeline.masked_loss_bytes(model, tokens / memory_timeline.MASKED_FRACTION
                                                 if obj.causal else noisy, dt, tp)
    else:
        loss_tokens = tokens if obj.causal else noisy  # ar: every token is a loss row
        per = {n: loss_bytes(model, n, obj.vocab_block, dt, tp) for n in set(loss_tokens.tolist())}
        loss = np.array([per[n] for n in loss_tokens.tolist()], dtype=float)
    loss_backward = None
    if not eager and obj.frozen_embeddings and impl.loss.frozen_head_rows:
        # a frozen head over row blocks: one fp32 workspace wherever the rank has loss rows
        loss = (noisy > 0) * loss_ops.frozen_head_workspace(model, impl.loss, obj.vocab_block, tp)
    if not eager and impl.loss.kernel in ("tiled-ce", "unchunked") and not obj.frozen_embeddings:
        # the reference's tiled kernel (implementation.md 9): one tile's fp32 logits in forward,
        # its backward buffers with the whole weight and input gradients; unchunked (TorchTitan,
        # frameworks.md A3): every loss row's logits and their fp32 copy at once
        rows = (tokens if obj.clean_loss or obj.causal else noisy) * obj.loss_row_share  # as loss_ops.loss_rows
        loss, loss_backward = loss_ops.loss_buffers(model, impl.loss, rows.astype(float), dt, tp)
    context = 0.0
    if obj.context_as_kv:
        held = kv_rows.held(layout, "context") * batch
        shard = kv_rows.held(untrimmed(layout), "context") * batch
        context = context_bytes(model, kinds, held, dt, tp, keep_kv=not full_ckpt,
                                feature_rows=shard, feature_copies=FEATURE_COPIES.get(obj.features, 1))
    retained = None
    if obj.retain_encoder_kv:
        # the streams' views as the profile shards them (`stream_ownership`); the encoder's view
        # holds the clean rows it owns (the same counts as the layout's under `shared-2l`)
        views = stream_views(layout, impl.stream_ownership) if obj.streams == ("encoder", "decoder") else ()
        retained = encoder_retained(model, views[0] if views else layout, batch, dt, tp, impl)
        if views:  # each stream's layers hold its own rows' buffers
            retained = replace(retained, streams=tuple(
                (view, stream_sizes(sizes, view, model, impl)) for view in views))
    return memory_timeline.walk_activations(model, layout, sizes, eager, full_ckpt, loss, context,
                                            zero, retained, loss_backward, synced)


def route_index_bytes(model: ModelSpec, impl, rows, tp: int):
    """One MoE layer's routing metadata kept with its checkpoint for the backward (the top-k
    indices the recompute replays, implementation.md 11), per rank: rows x top-k x the profile's
    bytes, split over TP as the sequence-parallel hidden state is [U]; 0 without MoE."""
    if model.moe is None or not impl.moe.saved_route_index_bytes:
        return 0.0
    return rows * (model.moe.top_k * impl.moe.saved_route_index_bytes / tp)


def stream_sizes(sizes: memory_timeline.Sizes, view: Layout, model: ModelSpec, impl) -> memory_timeline.Sizes:
    """The sizes of one trained stream's rows (`objective_layout.stream_views`)."""
    tokens = kv_rows.held(view, "positions") * sizes.batch
    return replace(sizes, tokens=tokens, noisy=kv_rows.held(view, "noisy") * sizes.batch,
                   hidden=tokens * model.hidden * sizes.dt / sizes.tp,
                   routing=route_index_bytes(model, impl, tokens, sizes.tp))


def encoder_retained(model: ModelSpec, layout: Layout, batch: int, dt: int,
                     tp: int, impl=None) -> memory_timeline.RetainedEncoder:
    """What DiffusionGemma's encoder keeps for its decoder (implementation.md section 12), per
    rank: each layer's K/V of the clean rows the rank owns (the whole clean stream under pure BP,
    `WholeCleanLayout`) and one encoder checkpoint of its clean query rows. Only the owned rows:
    the decoder gathers remote clean K/V again inside its own layers (the profile's
    `encoder_kv: regather`, the step graph's decoder stream, [U])."""
    owned = kv_rows.held(layout, "context").astype(float) * batch  # clean K/V rows it owns
    clean = (kv_rows.held(layout, "positions") - kv_rows.held(layout, "noisy")).astype(float) * batch
    kv = {a: owned * kv_row_bytes(a, dt, tp) for a in _model_sizes(model)["kinds"] if a.kind != "linear"}
    routing = route_index_bytes(model, impl, clean, tp) if impl is not None else 0.0
    return memory_timeline.RetainedEncoder(kv, clean * model.hidden * dt / tp, routing)
