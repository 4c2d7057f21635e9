"""Closed-form step time for screening: one pass over the ops in program order, no event queue.

Per rank, compute ops run back to back; a transfer starts when its inputs are ready and, for a
collective, when its last member has arrived; with overlap it runs beside compute (no queueing
behind other transfers) and only the wait of the op that needs its result is exposed. Without
overlap a transfer holds the rank like a compute op. So a rank's time is sum(compute) + exposed
communication, with the slowest member setting each collective, evaluated for all
representative ranks at once.
"""

from __future__ import annotations

import numpy as np

from simulator.engine import Timeline
from simulator.graph import Comm, StepGraph


def slowest_member(values: np.ndarray, sync: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Each rank gets the latest value among the ranks it waits for."""
    if len(sync) == len(values):
        return values
    if len(sync) == 1:
        return np.full_like(values, values.max())
    out = values.copy()
    for members in sync:
        idx = list(members)
        out[idx] = values[idx].max()
    return out


def run(graph: StepGraph, d: np.ndarray, overlap: bool = True) -> Timeline:
    start, finish = np.zeros_like(d), np.zeros_like(d)
    clock = np.zeros(graph.ranks)
    for op in graph.ops:
        i = op.index
        ready = finish[list(op.deps)].max(axis=0) if op.deps else np.zeros(graph.ranks)
        if isinstance(op.work, Comm):
            begin = ready if overlap else np.maximum(clock, ready)
            begin = slowest_member(begin, op.work.group.sync)
            if op.work.peer:  # a send/recv starts once its sender is there too
                begin = np.maximum(begin, begin[list(op.work.peer)])
            finish[i] = begin + d[i]
            if not overlap:
                clock = finish[i]
        else:
            begin = np.maximum(clock, ready)
            finish[i] = clock = begin + d[i]
        start[i] = begin
    return Timeline(start, finish)
