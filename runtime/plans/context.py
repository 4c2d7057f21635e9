"""The context axis: a rank's positions of the 2L sequence and how its K/V move, from the layout.

Process groups are made here for the layout's exchange groups (the CP group; each clean replica's
cp ranks in CSBP), once per DP replica, by every rank in the same order as torch requires.
"""

from __future__ import annotations

from csbp.runtime.attention import Attention
from csbp.runtime.comm import Comm
from csbp.runtime.plans import dp
from csbp.simulator.layout import Layout
from csbp.simulator.plan import Plan
from csbp.simulator.spec import ModelSpec


def attention(spec: ModelSpec, layout: Layout, plan: Plan, where: dict[str, int],
              comm: Comm) -> Attention:
    global_ranks = tuple(dp.global_rank(plan, dp=where["dp"], ctx=c) for c in range(plan.ctx))
    groups = {}
    for replica in range(plan.dp):
        for group in layout.cp_groups():
            if len(group) > 1:
                made = comm.new_group(sorted(dp.global_rank(plan, dp=replica, ctx=c) for c in group))
                if replica == where["dp"]:
                    groups[group] = made
    return Attention(spec.layers, layout, where["ctx"], comm, global_ranks, groups)
