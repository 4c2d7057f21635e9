"""A step graph as a program both engines run in one pass: per op, its kind, inputs, waits.

Both engines walk the ops in program order with one row of times per op (all representative
ranks at once). What they need from an op's work (is it a transfer, which ranks wait for each
other, whom it receives from) is looked up once per distinct work here, as identical layers
share their works, so the pass itself is a few array operations per op.
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.cost.graph import Comm, Group, StepGraph
from csbp.simulator.cost.step_ops import IO_STREAMS as IO_STREAM_OF  # compute kind -> stream


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


class Sync:
    """Rank sets that wait for each other, laid out for one reduction: their ranks one set after
    another (`order`), where each set starts in it (`starts`) and its size (`sizes`)."""

    __slots__ = ("order", "starts", "sizes", "whole")

    def __init__(self, sets: tuple[tuple[int, ...], ...], ranks: int) -> None:
        self.whole = len(sets) == 1  # one set: every member waits for the slowest of all
        self.order = np.array([r for members in sets for r in members], dtype=np.intp)
        self.sizes = np.array([len(members) for members in sets], dtype=np.intp)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.intp)

    def __len__(self) -> int:
        return len(self.sizes)


def _sync(group: Group, ranks: int) -> Sync | None:
    if len(group.sync) == ranks:  # every representative rank on its own: nobody to wait for
        return None
    return Sync(group.sync, ranks)


def slowest(values: np.ndarray, sync: Sync) -> np.ndarray:
    """Per rank, the latest of `values` among the ranks it waits for (`Group.slowest`): every set's
    maximum in one reduction (a maximum is exact, so it is the same number however it is taken);
    ranks in no set keep their own value. `values` [..., ranks]: each row on its own (the bounds
    run two checkpointing settings at once)."""
    if sync.whole:
        return np.repeat(values.max(axis=-1, keepdims=True), values.shape[-1], axis=-1)
    out = values.copy()
    out[..., sync.order] = np.repeat(np.maximum.reduceat(values[..., sync.order], sync.starts, axis=-1),
                                     sync.sizes, axis=-1)
    return out


def run(graph: StepGraph, d: np.ndarray, overlap: bool, queue_comm: bool,
        stretch: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(start, finish) [op, rank] of the step.

    `stretch` (per op; 1 for transfers): how much longer a compute op runs while a transfer runs
    beside it on its rank (`HardwareProfile.overlap_slowdown`); its part inside the overlap runs
    that much slower, the rest at full speed. A rank's transfers are taken as running from the
    op's start until the last transfer issued before it in program order ends (one issued later
    but running earlier is not seen) [U]. None: no interference (the reference queue's timeline).

    Compute runs in program order on one stream per rank; a transfer starts once its inputs are
    done, its group's last member has arrived and (p2p) its sender is there. `queue_comm`: the
    transfers of a rank also run one after another on their own stream (the event engine);
    otherwise each runs as soon as it can (the closed form). Without overlap a rank has one
    stream for both. Maxima and one addition per op: the same floating-point operations, in the
    same order, as an event queue processing the same streams. The walk reads the graph's
    `steps` (made once per graph and engine), not its ops.
    """
    n = graph.ranks
    zero = np.zeros(n)
    maximum = np.maximum
    start: list = [None] * len(graph.ops)
    finish: list = [None] * len(graph.ops)
    compute_free = comm_free = comm_until = zero
    io_free = {}
    if stretch is not None and (not overlap or not (stretch > 1).any()):
        stretch = None
    # no transfer still running past the compute stream on any rank: nothing to stretch until a
    # transfer is issued (the compute stream only moves later, so the test once true stays true)
    calm = stretch is None
    for i, deps, kind, sync, peer, chain in steps(graph, overlap, queue_comm):
        took = d[i]
        if deps:
            ready = finish[deps[0]]
            for j in deps[1:]:
                ready = maximum(ready, finish[j])
        else:
            ready = zero
        if kind is _COMPUTE:
            begin = compute_free if ready is compute_free else maximum(compute_free, ready)
            if not calm and not (comm_until > begin).any():
                calm = True
            if chain is None:
                if calm:
                    end = compute_free = begin + took
                else:
                    end = compute_free = _stretched(begin, took, comm_until, stretch[i])
            elif not calm:
                rest = chain[:0]  # op by op: each one's part beside the transfers runs slower ...
                for k, j in enumerate(chain.tolist()):
                    start[j] = begin
                    begin = finish[j] = _stretched(begin, d[j], comm_until, stretch[j])
                    if not (comm_until > begin).any():  # ... until they have ended on every rank
                        rest, calm = chain[k + 1:], True
                        break
                if rest.size:  # then back to back: `_stretched` with no window is begin + took
                    compute_free = _back_to_back(rest, begin, d, start, finish)
                else:
                    compute_free = begin
                continue
            else:  # it and the compute ops that each wait only for the one before, back to back
                compute_free = _back_to_back(chain, begin, d, start, finish)
                continue
        elif kind is _COMM:
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
            if stretch is not None:
                comm_until, calm = maximum(comm_until, end), False
        else:  # the host/storage path: its own stream, waited on by nobody (`Op.stream`)
            begin = maximum(io_free.get(kind, zero), ready)
            end = io_free[kind] = begin + took
        start[i] = begin
        finish[i] = end
    shape = d.shape
    return np.array(start).reshape(shape), np.array(finish).reshape(shape)


_COMPUTE, _COMM = "compute", "comm"


def steps(graph: StepGraph, overlap: bool, queue_comm: bool) -> list[tuple]:
    """What `run` walks, per op in program order that is not timed with a chain before it:
    (op, its inputs, its kind: "compute", "comm" or an io stream's name, the rank sets it waits
    with or None, p2p senders or None, the chain it starts (`chained_ops`) or None). Made once
    per graph and engine: the walk then reads no op, work or dict."""
    key = ("steps", overlap, queue_comm)
    if key not in graph._arrays:
        per_work, (_, which), stream = program(graph), graph.works(), streams(graph)
        chains = chained_ops(graph, transfers=not queue_comm) if overlap else {}
        timed = set()  # ops a chain times
        for chain in chains.values():
            timed.update(chain[1:].tolist())
        out = []
        for op, w, on in zip(graph.ops, which.tolist(), stream):
            i = op.index
            if i in timed:
                continue
            comm, sync, peer = per_work[w]
            if overlap and on in IO_STREAMS:
                out.append((i, op.deps, on, None, None, None))
            elif comm:
                out.append((i, op.deps, _COMM, sync, peer, None))
            else:
                out.append((i, op.deps, _COMPUTE, None, None, chains.get(i)))
        graph._arrays[key] = out
    return graph._arrays[key]


IO_STREAMS = ("io", "h2d")


def streams(graph: StepGraph) -> list[str]:
    """Per op, the stream it runs on (`Op.stream`), read once per graph for every pass below."""
    if "streams" not in graph._arrays:  # per distinct work, then per op
        works, which = graph.works()
        of_work = ["comm" if isinstance(w, Comm) else IO_STREAM_OF.get(w.kind, "compute") for w in works]
        graph._arrays["streams"] = [of_work[w] for w in which.tolist()]
    return graph._arrays["streams"]


def _back_to_back(chain: np.ndarray, begin: np.ndarray, d: np.ndarray, start: list, finish: list) -> np.ndarray:
    """Times of ops that run one after another from `begin`, op after op (one addition each);
    returns when the last one ends."""
    for j in chain.tolist():
        start[j] = begin
        begin = finish[j] = begin + d[j]
    return begin


def _stretched(begin: np.ndarray, took: np.ndarray, until: np.ndarray, factor: float) -> np.ndarray:
    """End of a compute op of `took` seconds from `begin` whose part before `until` runs
    `factor` times slower (a transfer beside it), the rest at full speed. Where `until` <=
    `begin` on every rank the window is 0 and this is exactly begin + took (x + 0.0 and
    x - 0.0 are x): `run` then times the rest of a chain back to back."""
    if factor <= 1:
        return begin + took
    window = np.maximum(until - begin, 0.0)
    slow = took * factor
    return np.where(slow <= window, begin + slow, begin + window + (took - window / factor))


def chained_ops(graph: StepGraph, transfers: bool) -> dict[int, np.ndarray]:
    """Runs of ops in which each waits only for the one before, keyed by their first op (a
    compute op). With overlap the compute stream runs such compute ops back to back, so their
    times are one running sum (np.cumsum adds in the same order as op after op), whatever other
    transfers run between them. `transfers`: a transfer that nobody syncs with and that queues
    behind nothing (the closed form's TP collectives) joins the run too, the compute op after it
    starting when it ends. A run ends with a compute op and holds every compute op between its
    first and last."""
    key = ("chains", transfers)
    if key not in graph._arrays:
        per_work, (_, which), stream = program(graph), graph.works(), streams(graph)
        runs: dict[int, list[int]] = {}
        run: list[int] = []
        for op, w, on in zip(graph.ops, which.tolist(), stream):
            comm, sync, peer = per_work[w]
            follows = bool(run) and op.deps == (run[-1],)
            if comm:
                if follows and transfers and sync is None and peer is None:
                    run.append(op.index)
                continue
            if on in IO_STREAMS:
                continue
            if not follows:
                _close(run, runs, graph)
                run = []
            run.append(op.index)
        _close(run, runs, graph)
        graph._arrays[key] = runs
    return graph._arrays[key]


def _close(run: list[int], runs: dict, graph: StepGraph) -> None:
    while run and isinstance(graph.ops[run[-1]].work, Comm):  # a run ends with a compute op
        run.pop()
    if len(run) > 1:
        runs[run[0]] = np.array(run)
