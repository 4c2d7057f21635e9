"""The context axis: a rank's positions of the 2L sequence and how its K/V move, from the layout.

K/V rows move inside the layout's exchange groups (the CP group; each clean replica's cp ranks in
CSBP), among the ranks of one (dp, ep, tp) coordinate: a TP rank exchanges the K/V heads it holds
with the context ranks holding the same heads. Under TP the positions come in shard order.
"""

from __future__ import annotations

from csbp.runtime.models.attention import Attention, positions_of
from csbp.runtime.distributed.comm import Comm
from csbp.runtime.distributed.mesh import Mesh
from csbp.runtime.distributed.tensor_parallel import sequence_order
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import ModelSpec


def attention(spec: ModelSpec, layout: Layout, plan: Plan, mesh: Mesh, comm: Comm) -> Attention:
    ctx = mesh.where["ctx"]
    positions = sequence_order(positions_of(layout.shares[ctx].positions), layout.seq_len, plan.tp)
    return Attention(spec.layers, layout, ctx, comm, mesh.ctx_ranks, mesh.exchange, positions)
