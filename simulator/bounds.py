"""Lower bounds on a plan's step time that cost a fraction of simulating it: the planner
prunes, without simulating them, candidates whose bound already loses (`planner.py`).

`step_time_lower_bound` is at most the step time either engine computes, for these reasons:

1. Both engines run each rank's compute ops one after another on one stream, in program order
   (the closed form's clock, the event engine's compute stream). Cut that stream into segments,
   the compute ops of each layer in each pass and those of each step edge (embedding, head,
   loss, optimizer): a segment lasts at least its compute plus the waits its own ops force
   (a compute op waiting for a transfer that an earlier op of the segment started, e.g. a TP
   collective between two GEMMs, or K/V still arriving when local attention is done). Those
   waits are found by running the segment's ops alone, its inputs from other segments ready
   at once, no rank waiting for another (syncing with a slower peer only delays), transfers
   never queueing (queueing only delays). Segments do not overlap on the stream, so the step
   lasts at least the sum of the segments, on every rank; the bound is the busiest rank's.
2. Layers of one kind append the same ops wherever they sit (the builder stamps them from the
   first), so each of their segments lasts the same: one layer of each kind, times the number of
   layers of that kind. The bound builds a model with one layer per kind; its embedding, head
   and loss are the step's, and its optimizer updates fewer parameters, so it is only shorter.
3. `keys_at_home=True` (the quick bound, shared by a plan's ring and collective twins) builds
   that graph with every attention call reading all its keys where it runs: one call per layer
   and pass over all the rank's pairs, no K/V transfers. The plan's real calls split the same
   pairs (local and remote keys, or one part per ring step) into calls over fewer keys per
   query, and a profile's attention efficiency that never falls as tiles grow runs each part at
   most as efficiently as the whole, so the parts take at least as long; the LSE merges and K/V
   packing it leaves out take time >= 0, and it makes no more kernel calls. On a profile whose
   attention curves fall somewhere, or whose attention is priced as dense (CPU) math, the
   quick bound keeps the real split. Without it the bound has the plan's own calls and K/V
   transfers (tighter, as it sees K/V waits; more ops for a long ring).
4. Floating point: sums are taken in another order than the engines', so the bound is lowered
   by a relative 1e-12, far above the rounding of a few thousand additions.
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.engine import durations
from csbp.simulator.graph import Comm, StepGraph
from csbp.simulator.hardware import HardwareProfile
from csbp.simulator.layout import Layout
from csbp.simulator.plan import Plan
from csbp.simulator.spec import ModelSpec
from csbp.simulator.workload import Workload

ROUNDING_MARGIN = 1e-12


def one_layer_per_kind(model: ModelSpec) -> tuple[ModelSpec, list[int]]:
    """The model with one layer of each kind, and how many layers each stands for."""
    kinds = model.attention_kinds()
    return model.model_copy(update={"layers": tuple(kinds)}), list(kinds.values())


def keys_at_home_is_cheapest(profile: HardwareProfile) -> bool:
    """Reason 3 holds on this profile: attention efficiency never falls as tiles grow, and
    attention is priced by its tiles (not as dense CPU math)."""
    gpu = profile.gpu
    curves = (gpu.attention_forward_efficiency, gpu.attention_backward_efficiency)
    rising = all(a[1] <= b[1] for curve in curves for a, b in zip(curve, curve[1:]))
    return rising and not gpu.dense_attention


def busy_per_rank(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
                  keys_at_home: bool = False) -> np.ndarray:
    """Per representative rank, a lower bound on how long its compute stream is busy or forced
    to wait (reasons 1-3 of the module docstring)."""
    layout = Layout.build(workload, plan)
    reduced, counts = one_layer_per_kind(model)
    graph = StepGraph.build(reduced, workload, plan, layout, profile.node.gpus_per_node,
                            keys_at_home=keys_at_home and keys_at_home_is_cheapest(profile))
    d = durations(graph, profile)
    n = graph.ranks
    never = np.full(n, -np.inf)  # ready before the segment: no wait to count
    total = np.zeros(n)
    segment, finish, clock, computes, weight = None, {}, np.zeros(n), False, 1.0
    for op, took in zip(graph.ops, d):
        if (op.layer, op.phase) != segment:
            if computes:
                total += weight * clock
            segment, finish, clock, computes = (op.layer, op.phase), {}, np.zeros(n), False
            weight = 1.0 if op.layer is None else float(counts[op.layer])
        ready = never
        for j in op.deps:
            if j in finish:
                ready = np.maximum(ready, finish[j])
        if isinstance(op.work, Comm):
            finish[op.index] = ready + took
        else:
            clock = np.maximum(clock, ready) + took
            finish[op.index] = clock
            computes = True
    if computes:
        total += weight * clock
    return total


def step_time_lower_bound(model: ModelSpec, workload: Workload, plan: Plan,
                          profile: HardwareProfile, keys_at_home: bool = False) -> float:
    """Seconds no engine's step can undercut (see the module docstring for why)."""
    busy = busy_per_rank(model, workload, plan, profile, keys_at_home)
    return float(busy.max()) * (1 - ROUNDING_MARGIN) if busy.size else 0.0


def quick_bound_key(plan: Plan, workload: Workload, profile: HardwareProfile) -> tuple:
    """Candidates with equal keys have equal quick bounds (`keys_at_home=True`): the transport
    only matters where the real split is kept (reason 3)."""
    if keys_at_home_is_cheapest(profile):
        plan = plan.model_copy(update={"transport": "collective"})
    return plan, workload
