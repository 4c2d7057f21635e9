"""The DP axis: where ranks sit, which sequences a replica trains on, and the gradient sum.

Every rank's loss is already divided by the step's global token count, so summing gradients
over all ranks (dp x ctx: context ranks hold different tokens or replicated clean work whose
gradient paths are disjoint) gives exactly the single-process gradient. No averaging anywhere.
"""

from __future__ import annotations

import torch

from csbp.runtime.comm import Comm
from csbp.simulator.errors import InputError
from csbp.simulator.plan import Plan


def check_supported(plan: Plan) -> None:
    for axis in ("tp", "ep"):
        if getattr(plan, axis) > 1:
            raise InputError(f"{axis}={getattr(plan, axis)}: tensor and expert parallelism are "
                             "not supported by the runtime yet")


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


def sequences(dp_rank: int, micro_batch: int) -> range:
    return range(dp_rank * micro_batch, (dp_rank + 1) * micro_batch)


def all_reduce_gradients(model: torch.nn.Module, comm: Comm) -> None:
    """Sum every gradient over all ranks in one flat buffer (absent gradients count as zero)."""
    params = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    comm.all_reduce(flat, "gradients")
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)
