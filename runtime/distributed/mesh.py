"""Where a rank sits on the plan's axes, and the process groups its step talks over.

Global ranks follow `plan.placement` (innermost axis first), exactly as the simulator places them,
so a group here is the group the step graph prices. torch needs every rank to create every group
in the same order, members or not, so `build` walks all of them on every rank; a group that is the
whole world is the default group (None) and a group of one is never made.

The groups, by what they carry:
- tp: the ranks that split one context rank's positions and heads (activations, the loss);
- ep: the ranks whose tokens meet each other's experts (token dispatch and combine);
- exchange: a clean replica's context ranks of one (dp, ep, tp) coordinate (K/V rows);
- dense: everyone holding the same dense weights with other tokens, dp x ctx x ep (gradient sum,
  and the step's loss, summed once per TP coordinate);
- experts: everyone holding the same experts with other tokens, dp x ctx x tp (their gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

import torch.distributed as dist

from csbp.runtime.distributed.comm import Comm
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan

Group = dist.ProcessGroup | None  # None: the default (world) group


def _sizes(plan: Plan) -> dict[str, int]:
    return {"tp": plan.tp, "ctx": plan.ctx, "ep": plan.ep, "dp": plan.dp}


def coordinates(plan: Plan, rank: int) -> dict[str, int]:
    """Index of a global rank on each axis; `plan.placement` lists axes innermost first."""
    where = {}
    for axis in plan.placement.split(","):
        rank, where[axis] = divmod(rank, _sizes(plan)[axis])
    return where


def global_rank(plan: Plan, **where: int) -> int:
    rank, stride = 0, 1
    for axis in plan.placement.split(","):
        rank += where.get(axis, 0) * stride
        stride *= _sizes(plan)[axis]
    return rank


@dataclass(frozen=True)
class Peers:
    """The ranks one collective spans: its process group (None: the default group, when they
    are the whole world), how many they are and this rank's index among them (group rank order,
    which is global rank order). One rank alone has nothing to exchange."""

    group: dist.ProcessGroup | None = None
    size: int = 1
    index: int = 0


@dataclass
class Mesh:
    """One rank's coordinates and peers (see the module docstring)."""

    where: dict[str, int]
    tp: Peers = Peers()
    ep: Peers = Peers()
    dense: Peers = Peers()
    experts: Peers = Peers()
    exchange: dict[tuple[int, ...], dist.ProcessGroup | None] = field(default_factory=dict)
    ctx_ranks: tuple[int, ...] = (0,)  # global rank of each context rank of this rank's replica


def _along(plan: Plan, rank: int, comm: Comm, axes: tuple[str, ...],
           subsets: list[tuple[tuple[int, ...], ...]] | None = None) -> dict[tuple, Peers]:
    """Groups of the ranks that differ only along `axes`, one per coordinate of the other axes
    (and per subset of `axes` coordinates in `subsets`, default all): those holding `rank`,
    keyed by their subset. Every rank makes every group, in the same order."""
    sizes = _sizes(plan)
    others = [a for a in ("dp", "ep", "ctx", "tp") if a not in axes]
    if subsets is None:
        subsets = [tuple(product(*(range(sizes[a]) for a in axes)))]
    mine = {}
    for fixed in product(*(range(sizes[a]) for a in others)):
        outer = dict(zip(others, fixed))
        for subset in subsets:
            ranks = sorted(global_rank(plan, **outer, **dict(zip(axes, inner))) for inner in subset)
            if len(ranks) == 1:
                if rank in ranks:
                    mine[subset] = Peers()
                continue
            group = None if len(ranks) == plan.world else comm.new_group(ranks)
            if rank in ranks:
                mine[subset] = Peers(group, len(ranks), ranks.index(rank))
    return mine


def _only(peers: dict[tuple, Peers]) -> Peers:
    (one,) = peers.values()
    return one


def build(plan: Plan, layout: Layout, rank: int, comm: Comm) -> Mesh:
    """The rank's mesh; collective: every rank calls it, in the same order."""
    where = coordinates(plan, rank)
    exchange = _along(plan, rank, comm, ("ctx",),
                      [tuple((c,) for c in g) for g in layout.cp_groups() if len(g) > 1])
    return Mesh(where,
                tp=_only(_along(plan, rank, comm, ("tp",))),
                ep=_only(_along(plan, rank, comm, ("ep",))),
                dense=_only(_along(plan, rank, comm, ("dp", "ctx", "ep"))),
                experts=_only(_along(plan, rank, comm, ("dp", "ctx", "tp"))),
                exchange={tuple(c for (c,) in subset): peers.group
                          for subset, peers in exchange.items()},
                ctx_ranks=tuple(global_rank(plan, **{**where, "ctx": c}) for c in range(plan.ctx)))
