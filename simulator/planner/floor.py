"""A compute floor: the first, cheapest lower bound on a plan's step time, without a step graph.

The planner caps every fitting candidate by it before any graph is built (`planner.screen_pruned`:
floor, then the quick and the tight graph bound of `bounds.py`, then a simulation, each only for
candidates that still matter). It costs a few array operations per candidate, against a step
graph per bound key for the graph bounds.

Per layer kind, once per (model, profile, frozen router, the plan family's attention kernels):
seconds per token of the layer's GEMMs forward and backward on one rank at tp = 1, and seconds
per attention pair forward and backward, each at the best rate the profile gives that kind of op
there. Per candidate, per representative rank: those terms times the rank's tokens and attention
pairs over tp (counts the step graph reads itself, cached per layout ownership), times the layers
of each kind, plus the LM head, per pass; the recompute pass with full checkpointing adds the
forward layers again, self-conditioning the expected share of a forward over its canvas.

Why it is below both engines (and below `bounds.py`'s graph bounds):
1. Every term is an op of the step graph with at least those FLOPs: a layer's GEMMs
   (projections, dense MLP, router and routed experts) are linear in the rank's tokens over tp
   with `ModelSpec.mixer_params` / `dense_ffn_params` / the experts' parameters (`_Builder.
   mixer_gemms`, `ffn`; K/V projections replicated under TP only add FLOPs); attention is
   pairs x 4 x head_dim x heads / tp forward and 2.5x that backward, and a call's kernel tiles
   cover all of its pairs; the LM head is 2 x rows x hidden x vocab / tp, backward the same
   ratios as `LossOps.loss_backward`. Self-conditioning (`ObjectiveOps.canvas_pass`) scales
   a forward of every layer over its canvas view, that view's LM head and soft embedding
   (2 x noisy rows x hidden x vocab / tp each) by the pass's probability.
2. Each op is priced by `cost.compute_seconds` at an efficiency no higher than the one taken
   here: the top of the GEMM curve or of any GEMM family the GPU lists; for the routed experts
   (`MoEOps.experts_work`) the implementation's expert GEMM as priced there: its grouped family
   at the expert width, the dense curve's top per expert (`expert_rate`); the top of the
   attention curve times the kernel factor, at the layer's head dim (every call of a layer is
   priced at its own), of the fastest family the plan family's calls run on in that pass
   (`attention_kernels`; the fastest the GPU lists where a family is not listed), times
   max(1, masked-tile factor) (partial tiles cost a whole tile over that factor); a per-op
   overhead is >= 0, a rank's share of a shared host's speed at most 1 (or the largest share
   measured), and an implementation's stretch beside transfers >= 1.
3. Everything left out only adds time: norms and element-wise work, collectives and waits, the
   embedding and conditioning, linear attention's core, a drafter's context projections and
   storage read, the optimizer.
   (The storage read and host copy of a drafter's offline features run on their own reader
   streams: the floor is the larger of the compute floor and the longest reader stream,
   `reader_floor`, by `bounds.py` reason 6; issue 25.)
4. By reason 1 of `bounds.py`, a rank's compute stream lasts at least the sum of its compute
   ops; the step at least its busiest rank's; lowered by `bounds.ROUNDING_MARGIN`.
5. With EP, each MoE layer's stream also idles while its dispatch and combine move the rows
   (`ep_waits`): those idle stretches lie between its compute ops, so they add to point 4's sum
   (a compute op beside the dispatch that runs slower there only lengthens the stretch). The
   planner adds them as a rung of its own (`floor_bounds(with_waits=True)`), only for the plans
   it takes up: they need the step builder's transfers.

Mechanisms added to the step graph later (more ops, waits, copies, padding) only raise the step
and so keep the floor valid, as long as no op's FLOPs fall below the formulas of point 1 and no
price rises above the rates of point 2; `tests/test_bounds.py` holds floor <= quick bound on
every fitting candidate of its jobs and floor <= both engines, and fails loudly otherwise.

Attention priced as dense math (CPU profiles: measured seconds, not curves) has no floor (None):
the planner starts at the quick bound there.
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.cost.attention_ops import ATTENTION_BACKWARD_FLOP_RATIO
from csbp.simulator.cost.graph import GEMM_BACKWARD_FLOP_RATIO, StepGraph
from csbp.simulator.cost.linear_ops import resolve_linear_dtype
from csbp.simulator.layout import kv_rows, pairs
from csbp.simulator.layout.layout import Layout
from csbp.simulator.layout.objective_layout import canvas_view
from csbp.simulator.plan.plan import Plan
from csbp.simulator.planner.bounds import ROUNDING_MARGIN
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.system.implementation import load_implementation
from csbp.simulator.workload.objectives import batch_rows, objective_shape
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

GEMM_BACKWARD = GEMM_BACKWARD_FLOP_RATIO  # dgrad + wgrad, as the step graph prices them
ATTENTION_BACKWARD = ATTENTION_BACKWARD_FLOP_RATIO


def top_rates(profile: HardwareProfile, fp8: bool = False, head_dim: int | None = None,
              kernels: tuple[tuple[str, ...], tuple[str, ...]] | None = None) -> tuple[float, float, float] | None:
    """(GEMM, attention forward, attention backward) FLOP/s no op of that kind is priced above
    (reason 2), or None where attention is priced as dense math. `fp8`: the blocks' linears run
    in FP8 (`linear_ops.LinearGemmOps`), so the GEMM rate is the faster of bf16's and FP8's.
    `head_dim`: attention at that head dim only (a layer kind's calls are priced at its own,
    `cost.compute_seconds`), at the fastest kernel family there; None: at any head dim listed.
    `kernels`: the families the plan's attention calls run on, forward (and recompute) and
    backward (`_Builder.attend` takes each call's from the plan family's facts; the quick
    bound the fastest of them): the fastest of those; None, or a family the GPU does not
    list: the fastest the GPU lists."""
    gpu = profile.gpu
    if gpu.dense_attention:
        return None
    peak = gpu.peak_tflops * 1e12
    top = lambda curve: max(y for _, y in curve)  # noqa: E731
    gemm = max([top(gpu.gemm_efficiency)] + [top(k.efficiency) for k in (gpu.gemm_kernels or {}).values()])
    if fp8:  # as a fraction of the bf16 peak, so the scaling below applies to it too
        fp8_peak, fp8_curve = gpu.gemm_rate(fp8=True)
        gemm = max(gemm, fp8_peak / gpu.peak_tflops * top(fp8_curve))

    def kernel(backward: bool) -> float:
        if head_dim is not None:  # the fastest family the calls may run on, at this head dim
            families = kernels[backward] if kernels else ()
            listed = families and all(f in gpu.attention_kernels for f in families)
            return gpu.kernel_factor("|".join(families) if listed else "best", backward, head_dim)
        best = 1.0 if not gpu.attention_kernels else 0.0
        for k in gpu.attention_kernels.values():
            for hd in (0, *(row[0] for row in k.head_dim_factors or ())):  # [[hd, fwd, bwd]]
                best = max(best, k.factor(backward, hd))
        return best

    masked = max(1.0, gpu.masked_attention_efficiency_factor)
    peak *= _share(profile)
    return (peak * gemm,
            peak * top(gpu.attention_forward_efficiency) * kernel(False) * masked,
            peak * top(gpu.attention_backward_efficiency) * kernel(True) * masked)


def _share(profile: HardwareProfile) -> float:
    """Ranks sharing a host run at a share of one rank's speed: measured shares above 1 count."""
    return max([1.0] + [y for curve in (profile.node.rank_speed or {}).values() for _, y in curve])


def expert_rate(profile: HardwareProfile, kernel: str, width: float) -> float:
    """FLOP/s no routed-expert GEMM is priced above (`MoEOps.experts_work`, `cost.compute_seconds`):
    one call per expert on the dense curve (its top), or the implementation's grouped family at
    the expert width (`best`: the faster of that and the dense top); a family the GPU does not
    list, the fastest it lists (pricing refuses it anyway)."""
    gpu = profile.gpu
    dense = max(y for _, y in gpu.gemm_efficiency)
    if kernel == "per-expert" or not gpu.gemm_kernels:
        eff = dense
    elif kernel in gpu.gemm_kernels:
        eff = gpu.grouped_gemm_efficiency(kernel, width)
    else:
        eff = max(dense, gpu.grouped_gemm_efficiency("best", width))
    return gpu.peak_tflops * 1e12 * eff * _share(profile)


def attention_kernels(profile: HardwareProfile, kind: str, transport: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The kernel families a plan family's attention calls may run on: (forward and recompute,
    backward), every call of each pass (`implementation.Pass.kernels`)."""
    family = load_implementation(profile.implementation).family(kind, transport)
    passes = ((family.phase("forward"), family.phase("recompute")), (family.phase("backward"),))
    return tuple(tuple(sorted({k for p in group for k in p.kernels.values()})) for group in passes)


_TERMS: dict[tuple, tuple] = {}


def kind_terms(model: ModelSpec, profile: HardwareProfile, frozen_router: bool,
               fp8: bool = False, kernels: tuple[tuple[str, ...], tuple[str, ...]] | None = None) -> list[tuple] | None:
    """Per layer kind: (layers of the kind, its window or None, whether it has softmax
    attention, GEMM seconds per token forward, backward, attention seconds per pair forward,
    backward), at tp = 1 and one row; `kernels` as `top_rates`'. Once per (model, profile,
    frozen router, kernels): every candidate of a plan family reads the same terms."""
    key = (id(model), id(profile), frozen_router, fp8, kernels)
    hit = _TERMS.get(key)
    if hit is not None and hit[0] is model and hit[1] is profile:
        return hit[2]
    terms = None
    if top_rates(profile, fp8) is not None:
        terms = []
        for a, count in model.attention_kinds().items():
            gemm_rate, fwd_rate, bwd_rate = top_rates(profile, fp8, a.head_dim, kernels)
            router = model.hidden * model.moe.n_experts if model.moe else 0
            params = model.mixer_params(a) + model.dense_ffn_params() + router
            experts = model.moe.top_k * 3 * model.hidden * model.moe.expert_ffn if model.moe else 0
            fwd = 2 * params / gemm_rate
            bwd = 2 * (GEMM_BACKWARD * (params - router) + (1.0 if frozen_router else GEMM_BACKWARD) * router) / gemm_rate
            if experts:  # the routed experts, on the implementation's expert GEMM (`expert_rate`)
                rate = expert_rate(profile, load_implementation(profile.implementation).moe.expert_gemm,
                                   model.moe.expert_ffn)
                fwd += 2 * experts / rate
                bwd += 2 * GEMM_BACKWARD * experts / rate
            softmax = a.kind != "linear"
            per_pair = 4 * a.head_dim * a.n_heads if softmax else 0
            terms.append((count, a.window if a.kind == "sliding" else None, softmax,
                          fwd, bwd, per_pair / fwd_rate,
                          ATTENTION_BACKWARD * per_pair / bwd_rate))
    if len(_TERMS) > 64:
        _TERMS.clear()
    _TERMS[key] = (model, profile, terms)
    return terms


def compute_floor(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
                  layout: Layout) -> dict[str, np.ndarray] | None:
    """Per representative rank, seconds of compute no step of this plan avoids, with
    checkpointing "full" and "none" (`workload.checkpointing` does not matter); None where the
    profile prices attention as dense math. `layout`: the plan's, as the step graph gets it."""
    obj = objective_shape(workload, model, plan)
    fp8 = resolve_linear_dtype(workload, profile.implementation) == "fp8"  # the blocks' linears
    terms = kind_terms(model, profile, obj.frozen_router, fp8, attention_kernels(profile, layout.kind, plan.transport))
    if terms is None:
        return None
    mb = float(batch_rows(workload, model).micro_batch)  # the batch as the builder sees it
    per_stream = bool(obj.canvas_passes) and obj.streams != ("main",) and \
        load_implementation(profile.implementation).stream_ownership == "per-stream"
    # what does not depend on the EP degree (only the self-conditioning probability does,
    # `objectives.objective_shape`), once per layout ownership: DiffusionGemma's candidates that
    # differ in ep (and dp) share it
    key = ("floor", mb, plan.tp, obj.clean_loss, bool(obj.canvas_passes), per_stream, bool(obj.soft_embedding))
    hit = layout.derived.get(key)
    if hit is None or hit[0] is not terms or hit[1] is not model:
        hit = layout.derived[key] = (terms, model, _floor_terms(model, profile, terms, layout, mb, plan.tp, obj,
                                                                per_stream))
    fwd, bwd, head, canvas = hit[2]
    head_backward = (1.0 if obj.frozen_embeddings else GEMM_BACKWARD) + obj.head_recompute
    none = obj.passes * (fwd + bwd + head * (1 + head_backward))
    if obj.canvas_passes:  # self-conditioning (`ObjectiveOps.canvas_pass`): its expected forward
        none = none + obj.canvas_passes * canvas
    return {"none": none, "full": none + obj.passes * fwd}


def _floor_terms(model: ModelSpec, profile: HardwareProfile, terms: list[tuple], layout: Layout, mb: float,
                 tp: int, obj, per_stream: bool) -> tuple:
    """Per rank, (forward layers, backward layers, the LM head's forward, one self-conditioning
    forward) seconds of `compute_floor`, at `terms`' rates."""
    gemm = top_rates(profile)[0]
    fwd, bwd = layer_terms(terms, layout, mb, tp)
    rows = kv_rows.held(layout, "positions" if obj.clean_loss else "noisy") * mb
    head = 2 * rows * model.hidden * model.vocab / tp / gemm
    canvas = None
    if obj.canvas_passes:  # over its canvas view: a forward of every layer, its LM head and soft embedding
        view = canvas_view(layout, per_stream)
        noisy = kv_rows.held(view, "noisy") * mb
        heads = 2 * noisy * model.hidden * model.vocab / tp / gemm * (1 + bool(obj.soft_embedding))
        canvas = layer_terms(terms, view, mb, tp)[0] + heads
    return fwd, bwd, head, canvas


def ep_waits(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
             layout: Layout) -> dict[str, np.ndarray] | None:
    """Per representative rank, seconds the compute stream idles at least for the EP
    all-to-alls of every MoE layer, in each pass of each trained stream, with checkpointing
    "full" and "none"; None without EP (reason 5). `MoEOps.moe_ffn` appends in program order
    the route copy, the dense branch where it runs beside the dispatch, the dispatch, the
    experts waiting for it, the combine, the copy back waiting for it and the dense branch of
    `dense_overlaps: combine`: the stream idles at least max(0, dispatch - dense) before the
    experts (the dense branch is the only compute op between), and the combine before the copy
    back (nothing between). Without a copy back the combine is first waited on by the next
    layer, outside this layer's segment (`bounds.py` reason 1), so it is left out, as the graph
    bounds leave it out: the floor stays below them. The transfers are the builder's own works,
    priced as the bounds price them."""
    if model.moe is None or plan.ep <= 1:
        return None
    from csbp.simulator.cost.cost import seconds
    from csbp.simulator.engine import host_crowding

    builder = StepGraph.builder(model, workload, plan, layout, profile.node.gpus_per_node,
                                implementation=profile.implementation)
    priced = host_crowding.fastest(profile)
    early = builder.impl.moe.dense_overlaps == "dispatch"

    def took(work) -> np.ndarray | float:
        return seconds(work, priced) if work is not None else 0.0

    per_pass = {False: np.zeros(layout.size), True: np.zeros(layout.size)}  # forward, backward
    for s in builder.stream_builders():
        for backward in (False, True):
            dispatch = took(s.ep_exchange(backward, not backward))
            if early:  # the dense branch beside it, moe_ffn's own work
                dispatch = np.maximum(dispatch - took(s.dense_branch(backward)), 0.0)
            # the combine is waited on inside the layer only by the copy back
            combine = took(s.ep_exchange(backward, False)) if s.route_copies() is not None else 0.0
            per_pass[backward] = per_pass[backward] + dispatch + combine
    layers = len(model.layers) * builder.obj.passes
    none = layers * (per_pass[False] + per_pass[True])
    return {"none": none, "full": none + layers * per_pass[False]}  # the recompute runs the forward's


def layer_terms(terms: list[tuple], layout: Layout, mb: float, tp: int) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, (forward, backward) seconds of every layer's GEMMs and softmax attention over
    the layout's positions and pairs, at the rates of `kind_terms`."""
    tokens = kv_rows.held(layout, "positions") * mb / tp
    fwd = np.zeros(layout.size)
    bwd = np.zeros(layout.size)
    for count, window, softmax, g_f, g_b, a_f, a_b in terms:
        fwd += count * tokens * g_f
        bwd += count * tokens * g_b
        if softmax:
            key = ("pairs", window)  # the step graph's own entry (attention_ops), once per ownership
            if key not in layout.derived:
                layout.derived[key] = pairs.totals(layout, window)
            p = layout.derived[key] * mb / tp
            fwd += count * p * a_f
            bwd += count * p * a_b
    return fwd, bwd


def reader_floor(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
                 layout: Layout) -> np.ndarray | None:
    """Per representative rank, the longest reader stream (a drafter's offline features: the
    storage read, the host-to-GPU copy), or None where the step has none.

    `bounds.py` reason 6: each reader stream runs its ops one after another from the step's
    start, so the step lasts at least each stream's sum, whatever the compute does. The ops are
    the step graph's own (the builder's `feature_io` on an empty op list, the same call the
    graph makes) priced by `cost.seconds` (what `engine.durations` prices them with), so the
    sum is the one the graph bound takes, without building a graph: an I/O-bound candidate
    (every drafter plan on the offline default) is capped at once instead of at the quick bound.
    """
    obj = objective_shape(workload, model, plan)
    if getattr(obj, "features", None) != "offline" or not obj.stored_bytes_per_token(model):
        return None
    from csbp.simulator.cost.cost import seconds
    from csbp.simulator.engine.program import IO_STREAMS

    builder = StepGraph.builder(model, workload, plan, layout, profile.node.gpus_per_node,  # its reader ops
                                implementation=profile.implementation)
    builder.feature_io(())
    streams: dict[str, np.ndarray] = {}
    for op in builder.ops:
        if op.stream in IO_STREAMS:  # summed in program order, from zero, as bounds.segment_sums
            streams[op.stream] = streams.get(op.stream, np.zeros(layout.size)) + seconds(op.work, profile)
    return np.max(list(streams.values()), axis=0) if streams else None


def floor_bounds(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
                 layout: Layout, with_waits: bool = False) -> dict[str, float] | None:
    """Seconds no engine's step of this plan can undercut, by checkpointing; None: no floor.
    The compute floor, or a reader stream where that is longer (`reader_floor`). `with_waits`:
    with the EP waits added (reason 5; the planner's second rung, as it builds a step builder
    per plan: where the plan has no EP, the floor itself)."""
    busy = compute_floor(model, workload, plan, profile, layout)
    if busy is None:
        return None
    waits = ep_waits(model, workload, plan, profile, layout) if with_waits else None
    if waits is not None:
        busy = {ckpt: b + waits[ckpt] for ckpt, b in busy.items()}
    readers = reader_floor(model, workload, plan, profile, layout)
    if readers is not None:
        busy = {ckpt: np.maximum(b, readers) for ckpt, b in busy.items()}
    return {ckpt: float(b.max()) * (1 - ROUNDING_MARGIN) if b.size else 0.0 for ckpt, b in busy.items()}
