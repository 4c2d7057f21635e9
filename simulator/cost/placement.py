"""Placement: which ranks of a parallel group share a node, from the plan's axis order.

Global ranks follow `plan.placement`, innermost axis first; a group is priced on its slowest
level, so what matters is the fewest members that share a node in any instance of the group.
"""

from __future__ import annotations

import functools

import numpy as np

from csbp.simulator.plan.plan import Plan

def group_on_nodes(plan: Plan, gpus_per_node: int, axes: tuple[str, ...],
                   ctx_block: int | None = None) -> tuple[int, int]:
    """(size, fewest members on one node over all instances) of the groups spanning `axes`.

    Global ranks follow `plan.placement`, innermost axis first. `ctx_block` splits the context
    axis into consecutive sub-groups of that size (the cp groups of CSBP).
    """
    return _placed_group((plan.tp, plan.ctx, plan.ep, plan.dp), plan.placement, gpus_per_node,
                         axes, ctx_block)

@functools.lru_cache(maxsize=1024)
def _placed_group(degrees: tuple[int, ...], placement: str, gpus_per_node: int,
                  axes: tuple[str, ...], ctx_block: int | None) -> tuple[int, int]:
    """`group_on_nodes` from the degrees alone: plans differing in transport or schedule share it."""
    dims = dict(zip(("tp", "ctx", "ep", "dp"), degrees))
    order = placement.split(",")
    coords = np.indices([dims[a] for a in order]).reshape(len(order), -1)
    strides = np.cumprod([1] + [dims[a] for a in order[:-1]])
    node = (strides[:, None] * coords).sum(axis=0) // gpus_per_node
    key = np.zeros(coords.shape[1], dtype=np.int64)
    for i, a in enumerate(order):
        if a not in axes:
            key = key * dims[a] + coords[i]
    n = int(np.prod([dims[a] for a in axes]))
    if ctx_block is not None and "ctx" in axes:
        ci = order.index("ctx")
        key = key * dims["ctx"] + coords[ci] // ctx_block
        n = n // dims["ctx"] * ctx_block
    _, counts = np.unique(key * (int(node.max()) + 1) + node, return_counts=True)
    return n, int(counts.min())
