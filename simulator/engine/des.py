"""Discrete-event simulation of one step: a compute and a communication stream per rank.

Each stream runs its ops in program order (like a CUDA stream); an op starts when its inputs are
done and its stream is free; a collective starts when its last member has arrived and ends for
all members together. Transfers on one rank queue behind each other, which the closed form
ignores. With overlap=False a rank has one stream for both.

Every wait points backwards in program order (an input, the stream's previous op) or to the same
op on another rank (a collective's members, a p2p sender), so the order in which an event queue
processes simultaneous events never changes a time: `run` computes the event queue's timeline in
one pass over the program (`program.run` with queueing transfers), the same maxima and additions
without an event per op. `run_events` is that event queue (simpy), kept as the reference the
tests hold `run` equal to, bit for bit.
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.engine import Timeline, program
from csbp.simulator.cost.graph import Comm, StepGraph


def run(graph: StepGraph, d: np.ndarray, overlap: bool = True, stretch: np.ndarray | None = None) -> Timeline:
    return Timeline(*program.run(graph, d, overlap, queue_comm=True, stretch=stretch))


def run_events(graph: StepGraph, d: np.ndarray, overlap: bool = True) -> Timeline:
    """The same timeline from simpy processes, one per stream and rank (the reference)."""
    import simpy  # only the reference needs an event queue

    env = simpy.Environment()
    start = np.zeros_like(d)
    finish = np.full_like(d, np.nan)
    waiting: dict[tuple[int, int], simpy.Event] = {}  # (op, rank) -> event someone waits on;
    # (-1 - op, rank) -> that rank's arrival at a send/recv
    arrived: set[tuple[int, int]] = set()
    barriers: dict[tuple[int, int], list] = {}  # (op, first member) -> [arrived, event]
    member_set = {}
    for op in graph.ops:
        if isinstance(op.work, Comm) and len(op.work.group.sync) < graph.ranks:
            member_set[op.index] = {r: g for g in op.work.group.sync for r in g}

    def done(i: int, r: int) -> simpy.Event:
        if (i, r) not in waiting:
            waiting[(i, r)] = env.event()
        return waiting[(i, r)]

    def stream(r: int, ops: list[int]):
        for i in ops:
            op = graph.ops[i]
            for dep in op.deps:
                if np.isnan(finish[dep, r]):
                    yield done(dep, r)
            members = member_set.get(i, {}).get(r)
            if members is not None and len(members) > 1:
                slot = barriers.setdefault((i, members[0]), [0, env.event()])
                slot[0] += 1
                if slot[0] == len(members):
                    slot[1].succeed()
                else:
                    yield slot[1]
            peer = op.work.peer[r] if isinstance(op.work, Comm) and op.work.peer else r
            if peer != r:  # a send/recv starts once its sender is there too
                arrived.add((i, r))
                event = waiting.pop((-1 - i, r), None)
                if event is not None:
                    event.succeed()
                if (i, peer) not in arrived:
                    yield done(-1 - i, peer)
            start[i, r] = env.now
            if d[i, r] > 0:
                yield env.timeout(d[i, r])
            finish[i, r] = env.now
            event = waiting.pop((i, r), None)
            if event is not None:
                event.succeed()

    for r in range(graph.ranks):
        if overlap:
            env.process(stream(r, [op.index for op in graph.ops if op.stream == "compute"]))
            env.process(stream(r, [op.index for op in graph.ops if op.stream == "comm"]))
            for name in program.IO_STREAMS:
                env.process(stream(r, [op.index for op in graph.ops if op.stream == name]))
        else:
            env.process(stream(r, [op.index for op in graph.ops]))
    env.run()
    if np.isnan(finish).any():
        raise RuntimeError("the step graph deadlocked: an op waits for one issued after it")
    return Timeline(start, finish)
