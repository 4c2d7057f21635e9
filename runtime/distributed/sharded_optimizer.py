"""ZeRO-1/2 AdamW: sharded gradients and optimizer state, fp32 master weights.

An 8B-14B model with replicated fp32 AdamW state (12 bytes/parameter) does not fit one GPU.
Here the trained weights of each data-parallel group are one flat buffer, cut into equal shards
(the last padded); per step:

1. the sequence-parallel weights' partial gradients are all-reduced over TP (as `plans.dp`);
2. the gradients are reduce-scattered over the group (in the workload's dtype, as the step graph
   prices them) and the full gradients freed: each rank keeps its shard (ZeRO-2);
3. each rank updates its shard of fp32 master weights and fp32 Adam moments (torch's AdamW on the
   flat shard: the same arithmetic as the replicated optimizer, element by element);
4. the updated shards, cast to the parameters' dtype (bf16 under `--dtype bf16`), are
   all-gathered back into every rank's parameters.

This matches the simulator's memory model (`simulator.memory.weight_state`: parameters in the
compute dtype, fp32 master + m + v = 12 bytes per parameter sharded over the group) and its step
graph (`grads.*.reduce-scatter`, `updated-params.*` all-gather in category "params"). It is ours,
not `torch.distributed.fsdp.fully_shard`, because every byte goes through `runtime.comm`, which
counts it per category next to the graph's prediction.

The groups are `plans.dp`'s: dense weights over dp x ctx x ep, routed experts over dp x ctx x tp.

[U] ZeRO-1 runs as ZeRO-2 (the same numerics and traffic; gradients freed after the scatter, so
less memory than the simulator's ZeRO-1 figure). [U] One bucket per group after the backward
pass, not per-layer buckets overlapped with it: the full gradients (accumulated in place in the
flat buffer, held once) are alive until the scatter, where the simulator counts the shard plus
two layer buckets. Per-layer buckets need collectives issued from backward hooks in one order on
every rank of a group, which a weight without a gradient on some rank (an expert no token chose)
would break; with blocking collectives that interleave with the K/V exchanges of the backward
pass, a different order deadlocks. [U] A weight no token reached (an expert) has gradient
zero here and is still decayed, as replicated AdamW after an all-reduce does; a single process
skips it.
"""

from __future__ import annotations

import torch

from csbp.runtime.distributed.comm import Comm
from csbp.runtime.distributed.mesh import Mesh, Peers
from csbp.runtime.distributed.plans.dp import routed_parameters


class _Shard:
    """One group's flat buffer: which weights, this rank's slice of it, and the fp32 master."""

    def __init__(self, params: list[torch.nn.Parameter], peers: Peers):
        self.params, self.peers = params, peers
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        self.size = -(-self.numel // peers.size)  # elements per shard
        self.padding = self.size * peers.size - self.numel
        start = peers.index * self.size
        master = torch.zeros(self.size, dtype=torch.float32, device=params[0].device)
        for p, off in zip(params, self.offsets):  # only this shard's slices: no full fp32 copy
            lo, hi = max(off, start), min(off + p.numel(), start + self.size)
            if lo < hi:
                master[lo - start:hi - start] = p.detach().reshape(-1)[lo - off:hi - off]
        self.master = torch.nn.Parameter(master)
        self.flat: torch.Tensor | None = None

    def prepare(self) -> None:
        """Every weight's .grad a zeroed view into one flat buffer: autograd accumulates into
        it in place (as DDP's gradient_as_bucket_view), so the full gradients exist once."""
        p0 = self.params[0]
        self.flat = torch.zeros(self.numel + self.padding, dtype=p0.dtype, device=p0.device)
        for p, off in zip(self.params, self.offsets):
            p.grad = self.flat[off:off + p.numel()].view_as(p)

    def reduce_scatter(self, comm: Comm, wire: torch.dtype) -> None:
        """This rank's shard of the summed gradients (absent ones count as zero) into the
        master's .grad, in fp32; the full gradients are freed."""
        flat, self.flat = self.flat, None
        if flat is None:  # not prepared: gather the gradients now
            flat = torch.zeros(self.numel + self.padding, dtype=wire, device=self.params[0].device)
            for p, off in zip(self.params, self.offsets):
                if p.grad is not None:
                    flat[off:off + p.numel()] = p.grad.reshape(-1)
        for p in self.params:
            p.grad = None
        flat = flat.to(wire)
        if self.peers.size > 1:
            flat = comm.reduce_scatter(flat, self.peers.group, "gradients",
                                       padding=self.padding)
        self.master.grad = flat.float()

    def all_gather(self, comm: Comm) -> None:
        """Every rank's updated shard into the parameters (in their dtype)."""
        dtype = self.params[0].dtype
        shard = self.master.detach().to(dtype)
        whole = (comm.all_gather(shard, self.peers.group, "params", padding=self.padding)
                 if self.peers.size > 1 else shard)
        with torch.no_grad():
            for p, part in zip(self.params, whole[:self.numel].split([p.numel() for p in self.params])):
                p.copy_(part.view_as(p))


class ShardedAdamW:
    """AdamW over shards of the trained weights (module docstring); `reduce_gradients` after the
    backward pass, `step` to update and re-gather, `zero_grad` as torch's."""

    def __init__(self, model: torch.nn.Module, mesh: Mesh, comm: Comm, wire: torch.dtype,
                 lr: float, **adamw):
        self.model, self.mesh, self.comm, self.wire = model, mesh, comm, wire
        routed = routed_parameters(model)
        params = [p for p in model.parameters() if p.requires_grad]
        dense = [p for p in params if id(p) not in routed]
        experts = [p for p in params if id(p) in routed]
        if mesh.dense == mesh.experts:  # no TP or EP: one buffer
            groups = [(dense + experts, mesh.dense)]
        else:
            groups = [(dense, mesh.dense), (experts, mesh.experts)]
        self.shards = [_Shard(ps, peers) for ps, peers in groups if ps]
        self.sequence_parallel = [p for p in dense if getattr(p, "sequence_parallel", False)]
        self.inner = torch.optim.AdamW([s.master for s in self.shards], lr=lr, **adamw)

    def prepare_gradients(self) -> None:
        """Before the backward pass: gradients accumulate in the flat buffers (`_Shard.prepare`)."""
        for shard in self.shards:
            shard.prepare()

    def reduce_gradients(self) -> None:
        """Summed gradients, each rank keeping its shards (collective over the groups)."""
        sp = self.sequence_parallel
        if sp and self.mesh.tp.size > 1:  # norms' partial sums over TP first, in place (views)
            for p in sp:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in sp]).to(self.wire)
            summed = self.comm.all_reduce(flat, "gradients", self.mesh.tp.group)
            for p, g in zip(sp, summed.split([p.numel() for p in sp])):
                p.grad.copy_(g.view_as(p))
        for shard in self.shards:
            shard.reduce_scatter(self.comm, self.wire)

    def step(self) -> None:
        self.inner.step()
        for shard in self.shards:
            shard.all_gather(self.comm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        self.model.zero_grad(set_to_none=set_to_none)

    def state_bytes(self) -> int:
        """fp32 master + moments this rank holds (the simulator's 12 bytes per sharded weight)."""
        held = sum(s.master.numel() for s in self.shards)
        moments = sum(t.numel() * t.element_size() for st in self.inner.state.values()
                      for t in st.values() if torch.is_tensor(t) and t.dim() > 0)
        return held * 4 + moments
