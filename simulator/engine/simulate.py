"""simulate(): one (model, workload, plan, cluster) -> Result, the whole flow in one call.

workload -> layout -> step graph -> memory check -> engine -> Result. Bad input raises
InputError; a plan that does not fit is a normal Result(feasible=False) that still reports the
memory it needs and the step time the closed form estimates.
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.engine import ENGINES, simulate_graph, summarize
from csbp.simulator.errors import InputError
from csbp.simulator.cost.graph import StepGraph
from csbp.simulator.cost.recent_graphs import RecentGraphs
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.layout import kv_rows
from csbp.simulator.workload.objectives import as_executed, counted_tokens_per_example
from csbp.simulator.layout.layout import Layout, kv_row_bytes
from csbp.simulator.cost.memory import estimate_memory
from csbp.simulator.plan.plan import Plan
from csbp.simulator.report.model_flops import per_gpu
from csbp.simulator.report.result import GIB, Result
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

ASSUMPTIONS = (
    "representative ranks: one context group is simulated; its DP/EP/TP peers are copies, and a "
    "group that spans nodes in any instance is priced on the slower link",
    "attention efficiency read at the mean keys per query of each attention call",
)


def loss_note(implementation: str) -> str:
    """How the implementation's loss kernel runs (its profile's `loss` facts), in one line: the
    note must follow the profile, not one framework's kernel."""
    from csbp.simulator.system.implementation import load_implementation

    impl = load_implementation(implementation)
    loss = impl.loss
    where = f"{impl.name}: loss over the objective's loss rows as "
    if loss.kernel == "chunked-ce":
        return where + "a fused LM head + cross-entropy chunked as Liger-Kernel does (gradients made with each chunk)"
    if loss.kernel == "tiled-ce":
        dtype = f"{8 * loss.logits_bytes}-bit" if loss.logits_bytes else "step-dtype"
        return (where + f"a fused LM head + cross-entropy in tiles of {loss.tile_rows} rows with "
                f"{dtype} logits" + (", the logits recomputed in backward" if loss.recompute_logits else ""))
    return (where + "the LM head over every loss row, then cross-entropy over the whole [rows, V/tp] "
            f"logits ({sum(loss.logits_buffers)} B per logit alive at it)")


# the planner re-runs its best screened plans with the event engine, and each at its other
# placement; a long ring's graph holds 100k ops: bound the memory too
_GRAPHS = RecentGraphs(kept=32, ops_kept=400_000)


def _step_graph(model: ModelSpec, workload: Workload, plan: Plan, layout: Layout, gpus_per_node: int,
                one_bucket: bool, implementation: str) -> StepGraph:
    """The step graph, kept for the last few plans (`RecentGraphs`)."""
    return _GRAPHS.get(model, workload, plan, gpus_per_node, (one_bucket, implementation),
                       lambda: StepGraph.build(model, workload, plan, layout, gpus_per_node,
                                               one_bucket=one_bucket, implementation=implementation))


def simulate(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
             nodes: int, engine: str = "des", overlap: bool = True, with_trace: bool = True) -> Result:
    """One step of `plan` on `nodes` nodes of `profile`; `with_trace=False` skips the timeline
    events (screening many plans)."""
    if engine not in ENGINES:
        raise InputError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    if nodes < 1:
        raise InputError(f"nodes must be >= 1, got {nodes}")
    gpus = nodes * profile.node.gpus_per_node
    plan.check_against(model, workload, world=gpus, implementation=profile.implementation)
    layout = Layout.build(as_executed(workload, model), plan)  # a windowed drafter trims its context
    graph = _step_graph(model, workload, plan, layout, profile.node.gpus_per_node, not overlap,
                        profile.implementation)
    memory = estimate_memory(model, workload, plan, layout, profile)
    notes = list(ASSUMPTIONS) + [loss_note(profile.implementation)] + list(graph.notes)
    used = engine if memory.feasible else "closed-form"
    if not memory.feasible:
        notes.append("the plan does not fit: step time from the closed form, no tokens/s")
    if not overlap:
        notes.append("overlap off: every transfer waits for compute and blocks it")
    # one host's ranks (a CPU host): each op priced at the ranks busy while it runs
    copies = gpus // graph.ranks if nodes == 1 and gpus % graph.ranks == 0 else None
    timeline, durations = simulate_graph(graph, profile, used, overlap, copies=copies)
    summary = summarize(graph, timeline, durations, with_trace)
    step = summary.step_time_s
    kv = np.zeros(layout.size)  # identical layers move identical rows: count each kind once
    for kind, count in model.attention_kinds().items():
        rows = sum(kv_rows.received(layout, kind, phase) for phase in kv_rows.PHASES)
        kv += count * (rows * kv_row_bytes(kind, workload.dtype_bytes, plan.tp))
    passes = workload.micro_batch * graph.views
    received = graph.received_bytes()
    executed = graph.flops()
    useful = graph.model_flops * plan.sequences
    peak = profile.gpu.peak_tflops * 1e12
    counted = counted_tokens_per_example(workload)  # the objective's own count (section 15)
    examples_per_s = workload.micro_batch * plan.sequences / step if memory.feasible and step > 0 else None
    tokens_per_s = workload.seq_len * workload.micro_batch * plan.sequences / step \
        if memory.feasible and step > 0 else None
    per_gpu_tokens, model_tflops = per_gpu(model, workload, plan, gpus, step, tokens_per_s)
    return Result(
        feasible=memory.feasible,
        reason=memory.reason,
        model=model.name,
        hardware=profile.name,
        nodes=nodes,
        gpus=gpus,
        plan={**plan.axes(), "transport": plan.transport, "schedule": plan.schedule,
              "placement": plan.placement, "kind": plan.kind, "label": plan.label()},
        workload=workload.model_dump(),
        engine=used,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=per_gpu_tokens,
        model_tflops_per_gpu=model_tflops,
        objective_tokens_name=counted[0] if counted else None,
        objective_tokens_per_s=counted[1] * examples_per_s if counted and examples_per_s else None,
        peak_memory_gib=memory.peak_gib,
        memory_gib=memory.rank(memory.peak_rank),
        memory_per_rank_gib=memory.totals_gib,
        peak_allocated_gib=memory.max_allocated_gib,
        outside_allocator_gib=memory.outside_gib or None,
        peak_memory_at=memory.peak_at,
        peak_breakdown_gib=memory.breakdown,
        attention_traffic_gib_per_gpu=float(kv.max()) * passes / GIB,
        comm_gib_per_gpu={k: float(v.max()) / GIB for k, v in received.items()},
        exposed_comm_s=summary.exposed_comm_s,
        stretched_compute_s=summary.stretched_compute_s,
        implementation=profile.implementation,
        phases_s=summary.phases_s,
        flops_per_gpu=float(executed.max()),
        mfu=useful / (gpus * peak * step) if step > 0 else None,
        notes=notes,
        trace=summary.trace,
    )
