"""The single-process reference: every sequence of the step, all 2L positions, local attention.

Each plan must reproduce its loss and every gradient; it needs no process group.
"""

from __future__ import annotations

from csbp.runtime.models.attention import Attention
from csbp.runtime.distributed.plans import Work
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload


def reference_work(spec: ModelSpec, workload: Workload, n_sequences: int) -> Work:
    """The work of a single process training `n_sequences` sequences (dp x ep x micro-batch)."""
    layout = Layout.build(workload, Plan())
    return Work(workload, layout, 0, range(n_sequences), n_sequences * workload.seq_len,
                Attention(spec.layers, layout))
