"""A lower bound on a plan's step time that costs a fraction of simulating it: the planner
prunes, without simulating them, candidates whose bound already loses (`planner.py`).

`step_time_lower_bound` is at most the step time either engine computes, for these reasons:

1. Both engines run each rank's compute ops one after another on one stream (the closed form's
   clock, the event engine's compute stream, and with overlap off the single stream), so a step
   lasts at least as long as the busiest rank's compute: max over ranks of the sum of its compute
   op durations. Communication, waiting for peers and idling only add to it.
2. Layers of one kind append the same ops wherever they sit (the builder stamps them from the
   first), so the compute of all layers is one layer of each kind times the number of layers of
   that kind. The bound builds a model with one layer per kind; its embedding, head and loss are
   the step's, and its optimizer updates fewer parameters, so it is only shorter.
3. That graph is built with every attention call reading all its keys where it runs
   (`StepGraph.build(keys_at_home=True)`): one call per layer and pass over all the rank's pairs.
   The plan's real calls split the same pairs (local and remote keys, or one part per ring step)
   into calls over fewer keys per query, and a profile's attention efficiency that never falls
   as tiles grow runs each part at most as efficiently as the whole, so the parts take at least
   as long; the LSE merges and K/V packing it leaves out take time >= 0, and it makes no more
   kernel calls. For a profile whose attention curves fall somewhere, or whose attention is
   priced as dense (CPU) math, the bound keeps the plan's real split instead.
4. Floating point: sums are taken in another order than the engines', so the bound is lowered
   by a relative 1e-12, far above the rounding of a few thousand additions.

The graph depends on the plan's ownership, degrees and checkpointing, not on the K/V transport,
so ring and collective twins share one bound.
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


def compute_per_rank(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
                     layout: Layout | None = None) -> np.ndarray:
    """Per representative rank, a lower bound on the seconds its compute stream is busy."""
    layout = layout or Layout.build(workload, plan)
    reduced, counts = one_layer_per_kind(model)
    graph = StepGraph.build(reduced, workload, plan, layout, profile.node.gpus_per_node,
                            keys_at_home=keys_at_home_is_cheapest(profile))
    d = durations(graph, profile)
    weight = np.array([0.0 if isinstance(op.work, Comm) else
                       (1.0 if op.layer is None else float(counts[op.layer])) for op in graph.ops])
    return weight @ d if len(weight) else np.zeros(graph.ranks)


def step_time_lower_bound(model: ModelSpec, workload: Workload, plan: Plan,
                          profile: HardwareProfile, layout: Layout | None = None) -> float:
    """Seconds no engine's step can undercut (see the module docstring for why)."""
    busy = compute_per_rank(model, workload, plan, profile, layout)
    return float(busy.max()) * (1 - ROUNDING_MARGIN) if busy.size else 0.0


def bound_key(plan: Plan, workload: Workload, profile: HardwareProfile) -> tuple:
    """Candidates with equal keys have equal bounds: the transport only changes the bound when
    the plan's real split is used (reason 3 does not hold)."""
    if keys_at_home_is_cheapest(profile):
        plan = plan.model_copy(update={"transport": "collective"})
    return plan, workload
