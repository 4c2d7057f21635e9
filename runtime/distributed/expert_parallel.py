"""Expert parallelism: each rank of an EP group keeps n_experts / ep of the routed experts, and
tokens travel to them.

Routing stays where the model does it (every rank routes its own tokens with the replicated
router), so only the experts module is replaced: `MoE.routed` hands it rows grouped by expert and
gets their outputs back in the same order. One call:

1. counts: how many rows go to each expert, sent to the experts' owners (all-to-all of int64), so
   every rank knows what it will receive from each peer;
2. dispatch: the rows go to their experts' owners (all_to_all_single with variable splits);
3. the local experts run on what arrived, regrouped by expert;
4. combine: the outputs go back the way they came.

Backward reverses 4 and 2 (the splits are known by then). Everything is counted as `ep`. The bytes
follow the routing; the step graph predicts them for balanced routing (top_k x tokens x (ep-1)/ep
rows each way), which they equal whenever every rank sends each peer its share of the pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from csbp.runtime.distributed.comm import Comm, wire_dtype
from csbp.runtime.models.model import BlockDiffusionLM, Experts, MoE, run_experts
from csbp.runtime.distributed.mesh import Peers

EP = "ep"


@dataclass(frozen=True)
class ExpertGroup:
    """This rank's EP group and the comm layer that counts what crosses it."""

    comm: Comm
    peers: Peers

    def all_to_all(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return self.comm.all_to_all(rows, send, recv, self.peers.index, self.peers.group, EP)


class _AllToAll(torch.autograd.Function):
    """Rows to their owners (`send` per peer), theirs back (`recv`); backward the reverse."""

    @staticmethod
    def forward(ctx, rows, send: list[int], recv: list[int], group: ExpertGroup):
        ctx.args, ctx.wire = (send, recv, group), wire_dtype(rows)
        return group.all_to_all(rows.to(ctx.wire), send, recv).to(rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group = ctx.args
        return group.all_to_all(grad.to(ctx.wire), recv, send).to(grad.dtype), None, None, None


class ExpertParallelExperts(nn.ModuleDict):
    """This rank's experts, keyed by their index in the whole model (parameter names unchanged)."""

    def __init__(self, experts: Experts, n_experts: int, group: ExpertGroup):
        per = n_experts // group.peers.size
        first = group.peers.index * per
        super().__init__({str(e): experts[e] for e in range(first, first + per)})
        self.group, self.per = group, per

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows grouped by expert (`counts[e]` for expert e of the whole model) -> their outputs."""
        ep = self.group.peers.size
        wanted = torch.tensor(counts, dtype=torch.int64, device=rows.device)
        offered = self.group.all_to_all(wanted, [self.per] * ep, [self.per] * ep).view(ep, self.per)
        send = wanted.view(ep, self.per).sum(1).tolist()
        recv = offered.sum(1).tolist()
        arrived = _AllToAll.apply(rows, send, recv, self.group)  # by source, then local expert
        order = _by_expert(offered.cpu()).to(rows.device)
        y = run_experts(self.values(), arrived[order], offered.sum(0).tolist())
        return _AllToAll.apply(y[order.argsort()], recv, send, self.group)


def _by_expert(counts: torch.Tensor) -> torch.Tensor:
    """Permutation taking rows laid out [source][expert] (counts [sources, experts]) to
    [expert][source]."""
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view_as(counts)
    return torch.cat([torch.arange(s, s + n) for e in range(counts.shape[1])
                      for s, n in zip(starts[:, e].tolist(), counts[:, e].tolist())]
                     or [torch.zeros(0, dtype=torch.long)])


def parallelize(model: BlockDiffusionLM, group: ExpertGroup) -> None:
    """Keep this rank's experts of every MoE layer and send tokens to the others' (in place)."""
    for block in model.blocks:
        if isinstance(block.ffn, MoE):
            block.ffn.experts = ExpertParallelExperts(block.ffn.experts, block.ffn.n_experts, group)
