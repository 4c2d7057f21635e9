"""Closed-form step time for screening: one pass over the ops in program order, no event queue.

Per rank, compute ops run back to back; a transfer starts when its inputs are ready and, for a
collective, when its last member has arrived; with overlap it runs beside compute (no queueing
behind other transfers) and only the wait of the op that needs its result is exposed. Without
overlap a transfer holds the rank like a compute op. So a rank's time is sum(compute) + exposed
communication, with the slowest member setting each collective, evaluated for all
representative ranks at once.
"""

from __future__ import annotations

from functools import reduce

import numpy as np

from csbp.simulator.engine import Timeline
from csbp.simulator.graph import Comm, StepGraph


def run(graph: StepGraph, d: np.ndarray, overlap: bool = True) -> Timeline:
    # Rows are kept as a list of arrays and stacked once: with a few ranks per op, numpy's per-call
    # cost dominates, so each op does as few calls as it can.
    start: list[np.ndarray] = []
    finish: list[np.ndarray] = []
    clock = idle = np.zeros(graph.ranks)
    last = -1  # the op whose finish is the clock
    peers: dict[int, np.ndarray] = {}  # id(work.peer) -> as an index array
    for op, took in zip(graph.ops, d):
        deps, work = op.deps, op.work
        ready = reduce(np.maximum, [finish[j] for j in deps]) if deps else idle
        if isinstance(work, Comm):
            begin = ready if overlap else np.maximum(clock, ready)
            begin = work.group.slowest(begin)
            if work.peer:  # a send/recv starts once its sender is there too
                if id(work.peer) not in peers:
                    peers[id(work.peer)] = np.array(work.peer)
                begin = np.maximum(begin, begin[peers[id(work.peer)]])
            end = begin + took
            if not overlap:
                clock, last = end, op.index
        else:
            begin = clock if deps == (last,) else np.maximum(clock, ready)  # the stream is free
            end = clock = begin + took
            last = op.index
        start.append(begin)
        finish.append(end)
    shape = d.shape
    return Timeline(np.array(start).reshape(shape), np.array(finish).reshape(shape))
