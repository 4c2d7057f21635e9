"""A step graph as a program both engines run in one pass: per op, its kind, inputs, waits.

Both engines walk the ops in program order with one row of times per op (all representative
ranks at once). What they need from an op's work (is it a transfer, which ranks wait for each
other, whom it receives from) is looked up once per distinct work here, as identical layers
share their works, so the pass itself is a few array operations per op.
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.graph import Comm, Group, StepGraph


def program(graph: StepGraph) -> list[tuple[bool, tuple | None, np.ndarray | None]]:
    """Per distinct work of the graph: (is it a transfer, rank sets that wait for each other or
    None, p2p senders or None). Ops sharing a work share these; kept with the graph."""
    if "program" not in graph._arrays:
        works, _ = graph.works()
        groups: dict[int, tuple | None] = {}
        per_work = []
        for work in works:
            if not isinstance(work, Comm):
                per_work.append((False, None, None))
                continue
            if id(work.group) not in groups:
                groups[id(work.group)] = _sync(work.group, graph.ranks)
            per_work.append((True, groups[id(work.group)], np.array(work.peer) if work.peer else None))
        graph._arrays["program"] = per_work
    return graph._arrays["program"]


def _sync(group: Group, ranks: int) -> tuple[np.ndarray, ...] | None:
    if len(group.sync) == ranks:  # every representative rank on its own: nobody to wait for
        return None
    return tuple(np.array(members) for members in group.sync)


def slowest(values: np.ndarray, sync: tuple[np.ndarray, ...]) -> np.ndarray:
    """Per rank, the latest of `values` among the ranks it waits for (`Group.slowest`)."""
    if len(sync) == 1:
        return np.full_like(values, values.max())
    out = values.copy()
    for idx in sync:
        out[idx] = values[idx].max()
    return out


def run(graph: StepGraph, d: np.ndarray, overlap: bool, queue_comm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(start, finish) [op, rank] of the step.

    Compute runs in program order on one stream per rank; a transfer starts once its inputs are
    done, its group's last member has arrived and (p2p) its sender is there. `queue_comm`: the
    transfers of a rank also run one after another on their own stream (the event engine);
    otherwise each runs as soon as it can (the closed form). Without overlap a rank has one
    stream for both. Maxima and one addition per op: the same floating-point operations, in the
    same order, as an event queue processing the same streams.
    """
    n = graph.ranks
    zero = np.zeros(n)
    maximum = np.maximum
    start: list[np.ndarray] = []
    finish: list[np.ndarray] = []
    compute_free = comm_free = zero
    per_work = program(graph)
    _, which = graph.works()
    for op, w, took in zip(graph.ops, which.tolist(), d):
        deps = op.deps
        comm, sync, peer = per_work[w]
        if deps:
            ready = finish[deps[0]]
            for j in deps[1:]:
                ready = maximum(ready, finish[j])
        else:
            ready = zero
        if comm:
            if not overlap:
                begin = maximum(compute_free, ready)
            elif queue_comm:
                begin = maximum(comm_free, ready)
            else:
                begin = ready
            if sync is not None:
                begin = slowest(begin, sync)
            if peer is not None:
                begin = maximum(begin, begin[peer])
            end = begin + took
            if not overlap:
                compute_free = end
            elif queue_comm:
                comm_free = end
        else:
            begin = compute_free if ready is compute_free else maximum(compute_free, ready)
            end = compute_free = begin + took
        start.append(begin)
        finish.append(end)
    shape = d.shape
    return np.array(start).reshape(shape), np.array(finish).reshape(shape)
