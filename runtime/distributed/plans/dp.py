"""The DP axis: which sequences a replica trains on, and the gradient sum.

Every rank's loss is already divided by the step's global token count, so summing each gradient
over the ranks that hold the same weights with other tokens gives exactly the single-process
gradient. No averaging anywhere. Who those ranks are depends on the weight:
- replicated (dense) weights: dp x ctx x ep (context ranks hold different tokens, or replicated
  clean work whose gradient paths are disjoint; EP ranks hold other sequences);
- routed experts: dp x ctx x tp (they are whole on every TP rank, which routes its own tokens);
- weights applied to a TP rank's sequence shard only (norms, the router; `sequence_parallel`):
  also over tp, once per step (Megatron's layer-norm gradient all-reduce).
Gradients travel in the workload's dtype, as the step graph prices them. This is the replicated
optimizer's all-reduce (ZeRO-0); ZeRO-1/2 reduce-scatter over the same groups instead
(`runtime.sharded_optimizer`).
"""

from __future__ import annotations

import torch

from csbp.runtime.distributed.comm import Comm
from csbp.runtime.distributed.expert_parallel import ExpertParallelExperts
from csbp.runtime.distributed.mesh import Mesh, Peers
from csbp.runtime.models.model import Experts


def sequences(replica: int, micro_batch: int) -> range:
    return range(replica * micro_batch, (replica + 1) * micro_batch)


def sum_gradients(params: list[torch.nn.Parameter], peers: Peers, comm: Comm,
                  dtype: torch.dtype) -> None:
    """Sum the gradients of `params` over `peers` in one flat buffer (absent ones count as zero)."""
    if not params or peers.size == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    summed = comm.all_reduce(flat.to(dtype), "gradients", peers.group).to(flat.dtype)
    for p, g in zip(params, summed.split([p.numel() for p in params])):
        p.grad = g.view_as(p)


def routed_parameters(model: torch.nn.Module) -> set[int]:
    """ids of the routed experts' weights (summed over the experts' peers, not the dense ones)."""
    return {id(p) for m in model.modules() if isinstance(m, (Experts, ExpertParallelExperts))
            for p in m.parameters()}


def all_reduce_gradients(model: torch.nn.Module, comm: Comm, mesh: Mesh,
                         dtype: torch.dtype = torch.float32) -> None:
    """Sum every trained weight's gradient over the ranks that share it (module docstring)."""
    routed = routed_parameters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    dense = [p for p in params if id(p) not in routed]
    experts = [p for p in params if id(p) in routed]
    if mesh.dense == mesh.experts:  # no TP or EP: one buffer, one call
        sum_gradients(dense + experts, mesh.dense, comm, dtype)
    else:
        sum_gradients(dense, mesh.dense, comm, dtype)
        sum_gradients(experts, mesh.experts, comm, dtype)
    sum_gradients([p for p in dense if getattr(p, "sequence_parallel", False)], mesh.tp, comm, dtype)
