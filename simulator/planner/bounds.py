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
   most as efficiently as the whole, so the parts take at least as long; the whole runs on the
   fastest kernel family the implementation uses in that pass and packs GQA heads into query
   tiles or not, whichever computes fewer tiles (a sub-set of keys never needs fewer tiles than
   it covers, nor a full tile where the whole has a partial one); the LSE merges and K/V
   packing it leaves out take time >= 0, and it makes no more kernel calls. On a profile whose
   attention curves fall somewhere, or whose attention is priced as dense (CPU) math, the
   quick bound keeps the real split. Without it the bound has the plan's own calls and K/V
   transfers (tighter, as it sees K/V waits; more ops for a long ring).
4. Floating point: sums are taken in another order than the engines', so the bound is lowered
   by a relative 1e-12, far above the rounding of a few thousand additions.
5. Checkpointing only adds a recompute pass: the forward and backward layers, the edges and
   the optimizer are the same ops either way (a layer's K/V exchange in the backward does not
   depend on it), so the bound without checkpointing is the one with it, less the recompute
   segments; one graph gives both (`tests/test_bounds.py` holds them equal to a graph built
   without checkpointing).
6. A reader on its own stream (`io`, `h2d`: a drafter's offline features) runs its ops one after
   another from the step's start at the earliest, waited on by nobody (`engine.program.run`);
   without overlap they run on the compute stream. Either way the step lasts at least each
   reader stream's sum, on every rank, so the bound is the larger of that and the compute
   stream's segments (which leave the readers out).
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.engine import durations, host_crowding
from csbp.simulator.cost.graph import Comm, StepGraph
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.workload.objectives import as_executed
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

ROUNDING_MARGIN = 1e-12


_REDUCED: dict[int, tuple[ModelSpec, ModelSpec, list[int]]] = {}


def one_layer_per_kind(model: ModelSpec) -> tuple[ModelSpec, list[int]]:
    """The model with one layer of each kind, and how many layers each stands for (made once
    per model: a search asks for every candidate)."""
    hit = _REDUCED.get(id(model))
    if hit is None or hit[0] is not model:
        if len(_REDUCED) > 64:
            _REDUCED.clear()
        kinds = model.attention_kinds()
        hit = _REDUCED[id(model)] = (model, model.model_copy(update={"layers": tuple(kinds)}),
                                     list(kinds.values()))
    return hit[1], hit[2]


def keys_at_home_is_cheapest(profile: HardwareProfile) -> bool:
    """Reason 3 holds on this profile: attention efficiency never falls as tiles grow, and
    attention is priced by its tiles (not as dense CPU math)."""
    gpu = profile.gpu
    curves = (gpu.attention_forward_efficiency, gpu.attention_backward_efficiency)
    rising = all(a[1] <= b[1] for curve in curves for a, b in zip(curve, curve[1:]))
    return rising and not gpu.dense_attention


def busy_per_rank(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
                  keys_at_home: bool = False) -> dict[str, np.ndarray]:
    """Per representative rank, a lower bound on how long its compute stream is busy or forced
    to wait (reasons 1-3 of the module docstring), with full checkpointing and without.

    Both come from one graph built with checkpointing: without it a step runs the same
    segments but the recompute pass (reason 5), so its sum leaves those segments out.
    """
    workload = workload.model_copy(update={"checkpointing": "full"})
    reduced, counts = one_layer_per_kind(model)
    graph = StepGraph.build(reduced, workload, plan, Layout.build(as_executed(workload, model), plan),
                            profile.node.gpus_per_node,
                            keys_at_home=keys_at_home and keys_at_home_is_cheapest(profile),
                            implementation=profile.implementation)
    # ranks sharing a host: an op may run with fewer of them busy than all (engine/host_crowding)
    return segment_sums(graph, counts, durations(graph, host_crowding.fastest(profile)))


def segment_sums(graph: StepGraph, counts: list[int], d: np.ndarray) -> dict[str, np.ndarray]:
    """Per rank, the sum over the compute stream's segments of how long each lasts at least
    (reason 1), layers weighted by the layers of their kind (`counts`, reason 2); "none" leaves
    the recompute segments out."""
    n = graph.ranks
    never = np.full(n, -np.inf)  # ready before the segment: no wait to count
    total = {"full": np.zeros(n), "none": np.zeros(n)}

    def close(segment, clock):
        weight = 1.0 if segment[0] is None else float(counts[segment[0]])
        total["full"] += weight * clock
        if segment[1] != "recompute":
            total["none"] += weight * clock

    segment, finish, clock, computes = None, {}, np.zeros(n), False
    readers: dict[str, np.ndarray] = {}  # per reader stream, the sum of its ops (reason 6)
    for op, took in zip(graph.ops, d):
        if op.stream in ("io", "h2d"):  # a background reader beside the step: its own bound (reason 6)
            readers[op.stream] = readers.get(op.stream, np.zeros(n)) + took
            continue
        if (op.layer, op.phase) != segment:
            if computes:
                close(segment, clock)
            segment, finish, clock, computes = (op.layer, op.phase), {}, np.zeros(n), False
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
        close(segment, clock)
    for busy in readers.values():  # reason 6: the step outlasts each reader stream too
        for ckpt in total:
            total[ckpt] = np.maximum(total[ckpt], busy)
    return total


def lower_bounds(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
                 keys_at_home: bool = False) -> dict[str, float]:
    """Seconds no engine's step can undercut, with checkpointing "full" and "none" (see the
    module docstring for why); `workload.checkpointing` does not matter."""
    return {ckpt: float(busy.max()) * (1 - ROUNDING_MARGIN) if busy.size else 0.0
            for ckpt, busy in busy_per_rank(model, workload, plan, profile, keys_at_home).items()}


def step_time_lower_bound(model: ModelSpec, workload: Workload, plan: Plan,
                          profile: HardwareProfile, keys_at_home: bool = False) -> float:
    """Seconds no engine's step of this plan and workload can undercut."""
    return lower_bounds(model, workload, plan, profile, keys_at_home)[workload.checkpointing]


def bound_key(plan: Plan, workload: Workload, profile: HardwareProfile, keys_at_home: bool) -> tuple:
    """Candidates with equal keys share `lower_bounds`: checkpointing never changes them, the
    transport not where keys are at home (reason 3)."""
    if keys_at_home and keys_at_home_is_cheapest(profile):
        plan = plan.model_copy(update={"transport": "collective"})
    return plan, workload.model_copy(update={"checkpointing": "full"}), keys_at_home
