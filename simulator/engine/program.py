"""A step graph as a program both engines run in one pass: per op, its kind, inputs, waits.

Both engines walk the ops in program order with one row of times per op (all representative
ranks at once); what they need from each op (is it a transfer, which ops it waits for, which
ranks wait for each other, whom it receives from) is looked up once per graph here, so the pass
itself is a few array operations per op.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from csbp.simulator.graph import Comm, Group, StepGraph


class Step(NamedTuple):
    comm: bool
    deps: tuple[int, ...]
    sync: tuple[np.ndarray, ...] | None  # rank sets that wait for each other; None: nobody waits
    peer: np.ndarray | None  # p2p: the rank each one receives from


def program(graph: StepGraph) -> list[Step]:
    """The graph's ops as engine steps (kept with the graph: the DES re-runs a screened graph).
    What a step needs of its work is the same wherever the work is shared: found once per work."""
    if "program" not in graph._arrays:
        works, which = graph.works()
        groups: dict[int, tuple | None] = {}
        per_work = []
        for work in works:
            if not isinstance(work, Comm):
                per_work.append((False, None, None))
                continue
            if id(work.group) not in groups:
                groups[id(work.group)] = _sync(work.group, graph.ranks)
            per_work.append((True, groups[id(work.group)], np.array(work.peer) if work.peer else None))
        graph._arrays["program"] = [Step(c, op.deps, sync, peer) for op, (c, sync, peer)
                                    in zip(graph.ops, map(per_work.__getitem__, which.tolist()))]
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
    rows = iter(d)
    for comm, deps, sync, peer in program(graph):
        took = next(rows)
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
