"""The step graph of the validation model trained by one process: what calibration compares the
runtime's eager ops with (their bytes, their kernel count), so a fitted efficiency is the one the
simulator will divide by when it prices a plan."""

from __future__ import annotations

from csbp.runtime.validation.validation_suite import BLOCK


def one_process_graph(spec, seq_len: int, block: int):
    """The step graph of `spec` trained by one process (fp32, full checkpointing)."""
    from csbp.simulator.cost.graph import StepGraph
    from csbp.simulator.layout.layout import Layout
    from csbp.simulator.plan.plan import Plan
    from csbp.simulator.workload.workload import Workload

    w = Workload(seq_len=seq_len, block_size=block, dtype="fp32", zero_stage=0)
    return StepGraph.build(spec, w, Plan(), Layout.build(w, Plan()), 1, implementation="csbp-runtime")


def graph_ops(spec, seq_len: int, names: tuple[str, ...], layer: int | None) -> tuple[float, int]:
    """(bytes, kernels) the step graph gives the ops called `names` of `layer` in a one-process
    step (every phase: forward, recompute, backward)."""
    ops = [op for op in one_process_graph(spec, seq_len, BLOCK).ops
           if op.name in names and op.layer == layer]
    return sum(op.work.bytes[0] for op in ops), sum(op.work.kernels for op in ops)


def step_kernels(spec, seq_len: int) -> int:
    """Kernels of one step of `spec` in the step graph (one process, full checkpointing)."""
    from csbp.simulator.cost.graph import Compute

    return sum(op.work.kernels for op in one_process_graph(spec, seq_len, seq_len).ops
               if isinstance(op.work, Compute))
