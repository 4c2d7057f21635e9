"""The last few step graphs built, kept by what they were built from.

Engines and bounds only read a graph, so a plan asked again (the event engine re-scoring a
screened plan) reuses it, and a plan that differs from a kept one only in where its groups sit
(the planner re-scores each pick at its other placement) is that graph placed again
(`StepGraph.placed_as`: the same ops, transfers on regrouped links), not built.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from csbp.simulator.cost.graph import ALSO_CLEARED, StepGraph
from csbp.simulator.plan.plan import Plan


class RecentGraphs:
    """`kept` graphs at most, `ops_kept` ops in all (a long ring's graph holds 100k ops); the
    least recently asked go first. Keys: (model, workload, plan, gpus per node, options), the
    model by identity (a search holds one model object)."""

    def __init__(self, kept: int, ops_kept: int) -> None:
        self.kept, self.ops_kept = kept, ops_kept
        self._graphs: OrderedDict[tuple, tuple[object, StepGraph]] = OrderedDict()
        ALSO_CLEARED.append(self._graphs.clear)

    def get(self, model, workload, plan: Plan, gpus_per_node: int, options: tuple,
            build: Callable[[], StepGraph]) -> StepGraph:
        key = (id(model), workload, plan, gpus_per_node, options)
        hit = self._graphs.get(key)
        if hit is not None and hit[0] is model:
            self._graphs.move_to_end(key)
            return hit[1]
        graph = self._placed_again(model, key) or build()
        self._graphs[key] = (model, graph)
        while len(self._graphs) > 1 and (len(self._graphs) > self.kept or
                                         sum(len(g.ops) for _, g in self._graphs.values()) > self.ops_kept):
            self._graphs.popitem(last=False)
        return graph

    def _placed_again(self, model, key: tuple) -> StepGraph | None:
        """A kept graph of the same step at another placement, placed as this key's plan."""
        _, workload, plan, gpus_per_node, options = key
        for (_, w, other, g, o), (kept_model, graph) in reversed(self._graphs.items()):
            if kept_model is model and (w, g, o) == (workload, gpus_per_node, options) \
                    and other.placement != plan.placement \
                    and other == plan.model_copy(update={"placement": other.placement}):
                return graph.placed_as(plan, gpus_per_node)
        return None
