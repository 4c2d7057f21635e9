"""A step graph as a program both engines run in one pass: per op, its kind, inputs, waits.

Both engines walk the ops in program order with one row of times per op (all representative
ranks at once). What they need from an op's work (is it a transfer, which ranks wait for each
other, whom it receives from) is looked up once per distinct work here, as identical layers
share their works, so the pass itself is a few array operations per op.
"""

from __future__ import annotations

from collections.abc import Iterator

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
        stretch: np.ndarray | None = None, repeats: bool = True) -> tuple[np.ndarray, np.ndarray]:
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

    `repeats`: a stamped layer (`StepGraph.repeats`) that enters as an earlier instance of its
    template did, shifted by one time on every rank and stream, is not walked: its times are
    that instance's, shifted (`_Repeats`). Equal to the walk up to rounding: every time is a
    maximum and sum of entry times and durations (the stretch too moves less than its inputs
    do), so a layer's times move by at most what its entry moved, and an entry taken as shifted
    within REPEAT_TOLERANCE of the latest time differs from the walked one by at most that much
    (same bound per layer, not compounding: each is shifted from a walked instance). In a layer
    where no rank waits for another (no transfer with a rank set or a sender: pure BP, DP, TP
    and EP peers are copies), a rank's times are maxima and sums of its own entry and durations
    only, so the shift may differ between ranks: one time per rank, on all its streams.
    """
    n = graph.ranks
    zero = np.zeros(n)
    maximum = np.maximum
    # one row per op, written once: a layer timed as an earlier one shifted is one block write,
    # and the rows need no joining at the end (NaN until written: an op the walk missed shows)
    start, finish = np.full(d.shape, np.nan), np.full(d.shape, np.nan)
    compute_free = comm_free = comm_until = zero
    io_free = {}
    if stretch is not None and (not overlap or not (stretch > 1).any()):
        stretch = None
    # no transfer still running past the compute stream on any rank: nothing to stretch until a
    # transfer is issued (the compute stream only moves later, so the test once true stays true)
    calm = stretch is None
    if stretch is not None:  # per op: its duration all beside a transfer, what a transfer adds
        slow, keep = d * stretch[:, None], 1.0 - 1.0 / stretch
    memo = _Repeats(d, queue_comm and overlap, stretch is not None) if repeats and graph.repeats else None
    walk = steps(graph, overlap, queue_comm, stretch is not None, memo is not None)
    expand: list = []  # a stamped layer walked: its steps, run next
    if memo is not None:
        walk = _walking(walk, expand)
    for i, deps, kind, sync, peer, chain in walk:
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
                    end = compute_free = _stretched(begin, took, slow[i], comm_until, keep[i])
            elif not calm:
                rest = chain[:0]  # op by op: each one's part beside the transfers runs slower ...
                for k, j in enumerate(chain.tolist()):
                    start[j] = begin
                    begin = finish[j] = _stretched(begin, d[j], slow[j], comm_until, keep[j])
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
        elif kind is _ENTER:  # a stamped layer: timed as an earlier instance, shifted, or walked
            shifted = memo.enter(sync, finish, (compute_free, comm_free, comm_until))
            if shifted is None:
                expand.append(instance_steps(graph, sync, overlap, queue_comm, stretch is not None))
                continue
            s, f, by, state = shifted
            np.add(s, by, out=start[sync.first:sync.end])
            np.add(f, by, out=finish[sync.first:sync.end])
            compute_free, comm_free, comm_until = state
            calm = stretch is None
            continue
        elif kind is _LEAVE:
            memo.leave(sync, start, finish, (compute_free, comm_free, comm_until))
            continue
        else:  # the host/storage path: its own stream, waited on by nobody (`Op.stream`)
            begin = maximum(io_free.get(kind, zero), ready)
            end = io_free[kind] = begin + took
        start[i] = begin
        finish[i] = end
    return start, finish


_COMPUTE, _COMM, _ENTER, _LEAVE = "compute", "comm", "enter", "leave"

# How far (relative to the latest entry time) a stamped layer's entry may differ from an earlier
# instance's shifted entry and still be timed as that instance shifted: a thousand times the
# rounding of ~1e4 additions (1e4 x 1.1e-16), far below any step time's meaning
REPEAT_TOLERANCE = 1e-12
# Layers shorter than this are walked: comparing an entry and shifting an earlier instance's
# rows costs about 12 us at 4 ranks (DiffusionGemma 256K), what walking four or five steps does,
# and a layer of 8 ops walks about that many (chains take the rest): both engines 5-20 % faster
# on the study layers of 10-15 ops. The shift grows with the ranks and the walk hardly does
# (numpy rows): up to 64 ranks it still pays (Nemotron-8B 1M, cp=bp=64: 12.3 -> 10.9 ms), at 256
# it costs (10-op layers: 17 -> 19-22 ms), so wider groups shift only layers of 32 ops or more
# (a long ring's layer holds hundreds: cp steps and hops)
REPEAT_MIN_OPS = 8
REPEAT_MIN_OPS_WIDE = 32
REPEAT_WIDE_RANKS = 64
# An entry of at most this many numbers (ranks x 2-4 rows) is compared as Python floats
FEW_NUMBERS = 32


def steps(graph: StepGraph, overlap: bool, queue_comm: bool, stretched: bool = False,
          repeats: bool = False) -> list[tuple]:
    """What `run` walks, per op in program order that is not timed with a chain before it:
    (op, its inputs, its kind: "compute", "comm" or an io stream's name, the rank sets it waits
    with or None, p2p senders or None, the chain it starts (`chained_ops`) or None). Made once
    per graph and engine: the walk then reads no op, work or dict.

    `stretched`: transfers slow the compute beside them (chains end where one is issued).
    `repeats`: each stamped layer is one _ENTER step (its `_Instance` where the rank sets go);
    its own steps, ending with a _LEAVE, are made when the walk first needs them
    (`instance_steps`: most layers are timed as an earlier one shifted and never need them).
    Chains are cut at its edges (the same times: a chain's ops are timed as single steps would
    be, and no transfer is issued inside a chain when it matters)."""
    key = ("steps", overlap, queue_comm, stretched, repeats)
    if key not in graph._arrays:
        instances = _instances(graph, streams(graph), overlap) if repeats else []
        out: list[tuple] = []
        lo = 0
        for inst in instances:
            if inst.first > lo:  # ops between two stamped layers (most follow one another)
                out += _segment(graph, lo, inst.first, overlap, queue_comm, stretched)
            out.append((-1, (), _ENTER, inst, None, None))
            lo = inst.end
        out += _segment(graph, lo, len(graph.ops), overlap, queue_comm, stretched)
        graph._arrays[key] = out
    return graph._arrays[key]


def instance_steps(graph: StepGraph, inst: "_Instance", overlap: bool, queue_comm: bool,
                   stretched: bool) -> list[tuple]:
    """A stamped layer's steps and its _LEAVE, made once per layer and engine: from its ops for
    the first instance of its template walked, shifted from that one's for the others (the
    same works, streams and waits inside the layer, so the same kinds and chains; inputs from
    outside it never continue a chain, which starts afresh at the layer)."""
    if inst.walk is None:
        made = graph._arrays.setdefault(("template-steps", overlap, queue_comm, stretched), {})
        base = made.get(inst.template)
        if base is None:
            walk = _segment(graph, inst.first, inst.end, overlap, queue_comm, stretched)
            made[inst.template] = (inst.first, walk)
        else:
            first, steps = base
            by, ops = inst.first - first, graph.ops
            walk = [(i + by, ops[i + by].deps, kind, sync, peer, None if chain is None else chain + by)
                    for i, _, kind, sync, peer, chain in steps]
        inst.walk = walk + [(-1, (), _LEAVE, inst, None, None)]
    return inst.walk


def _segment(graph: StepGraph, lo: int, hi: int, overlap: bool, queue_comm: bool,
             stretched: bool) -> list[tuple]:
    """`steps` of the ops [lo, hi), chains inside it."""
    per_work, (_, which), stream = program(graph), graph.works(), streams(graph)
    chains = _runs(graph, lo, hi, not queue_comm, stretched) if overlap else {}
    timed = set()  # ops a chain times
    for chain in chains.values():
        timed.update(chain[1:].tolist())
    out = []
    for op, w, on in zip(graph.ops[lo:hi], which[lo:hi].tolist(), stream[lo:hi]):
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
    return out


def _walking(top: list[tuple], expand: list) -> Iterator[tuple]:
    """`top`'s steps, and after any step the steps `run` put in `expand` then (a layer it walks)."""
    for step in top:
        yield step
        if expand:
            yield from expand.pop()


class _Instance:
    """One stamped layer as the walk meets it: its ops [first, end), its template, the ops
    before it that its ops wait for, whether it runs compute ops and transfers (else it leaves
    that stream as it found it), whether its ranks time it each on its own (no transfer in it
    waits for another representative rank: no rank set, no sender), and its steps once made
    (`instance_steps`)."""

    __slots__ = ("first", "end", "template", "inputs", "computes", "transfers", "local", "walk")

    def __init__(self, first: int, end: int, template: int, inputs: tuple[int, ...], computes: bool,
                 transfers: bool, local: bool = False) -> None:
        self.first, self.end, self.template, self.inputs = first, end, template, inputs
        self.computes, self.transfers, self.local, self.walk = computes, transfers, local, None


def _instances(graph: StepGraph, stream: list[str], overlap: bool) -> list[_Instance]:
    """The graph's stamped layers that `run` may time as an earlier one shifted: those whose
    ops run the same works as the first instance of their template (a pass that rewrote one
    instance's works is left to the walk), of REPEAT_MIN_OPS ops or more (REPEAT_MIN_OPS_WIDE over
    more than REPEAT_WIDE_RANKS ranks), with inputs, whose
    every op waits for something (so that nothing in it starts before its inputs are there:
    `_Repeats.entry`) and that run nothing on an io stream (whose state the entry does not hold)."""
    _, which = graph.works()
    per_work = program(graph)
    first_of: dict[int, tuple[bytes, bool, bool, bool] | None] = {}
    out = []
    least = REPEAT_MIN_OPS if graph.ranks <= REPEAT_WIDE_RANKS else REPEAT_MIN_OPS_WIDE
    for first, end, template, inputs in graph.repeats:
        if end - first < least:
            continue
        if template not in first_of:  # its ops' streams and waits, read on its first instance
            on = stream[first:end]
            ok = all(graph.ops[i].deps for i in range(first, end)) and not any(x in IO_STREAMS for x in on)
            local = all(sync is None and peer is None for _, sync, peer in
                        (per_work[w] for w in set(which[first:end].tolist())))
            first_of[template] = (which[first:end].tobytes(), "compute" in on or (not overlap and bool(on)),
                                  "comm" in on, local) if ok else None
        known = first_of[template]
        if known is None:
            continue
        works, computes, transfers, local = known  # its works' indices, compared as bytes
        if inputs and which[first:end].tobytes() == works:
            out.append(_Instance(first, end, template, inputs, computes, transfers, local))
    return out


class _Repeats:
    """Per template, the last few walked instances: their entry, their ops' times, their exit.

    The entry holds what the instance's times depend on, per rank: the latest of its inputs
    (every op of it that waits outside waits for all of them: `_LayerTemplate.record`), when
    its compute stream is free, and (events) its transfer stream, and (interference) until when
    transfers run beside it. As nothing in the instance starts before its inputs are there, a
    compute stream free earlier than that is taken as free then, and until-when no earlier than
    that compute time (every compute op begins later, where an earlier until-when stretches
    nothing): the same maxima, and instances that differ only in how long the compute stream
    sat idle before them match. The transfer stream is compared as it is (a transfer outside
    the instance may start as early as it allows)."""

    KEPT = 3  # a template's instances enter after different kinds of layer (5:1 patterns)
    # A template none of whose first this-many instances entered as an earlier one shifted is
    # walked from then on without comparing or keeping its instances: where ranks drift apart
    # layer by layer (the closed form's wide rings, whose ranks wait only for their ring
    # neighbour), no instance ever matches, and keeping each walked one's rows costs 10-25 %
    # of the walk (Nemotron-8B 1M, cp = 64: 69 -> 55 ms). Where instances match, the first
    # match came by the fifth instance in every study graph of a 12 x 8 map.
    GIVE_UP = 8

    def __init__(self, d: np.ndarray, queued: bool, stretched: bool) -> None:
        self.d, self.queued, self.stretched = d, queued, stretched
        self.walked: dict[int, list] = {}
        self.pending: dict[int, np.ndarray] = {}
        self.prices: dict[int, bytes] = {}
        self.hits = 0
        self.drifted = 0  # of the hits, shifted by a time per rank (`enter`)
        self.misses: dict[int, int] = {}  # per template, instances walked before any match
        self.matched: set[int] = set()  # templates with a match

    def entry(self, inst: _Instance, finish: np.ndarray, state: tuple) -> np.ndarray:
        """The entry's rows end to end (one array: a layer of a dozen ops is worth shifting only
        if comparing its entry costs a few array operations)."""
        compute_free, comm_free, comm_until = state
        inputs = inst.inputs
        ready = finish[inputs[0]]
        for j in inputs[1:]:
            ready = np.maximum(ready, finish[j])
        free = np.maximum(compute_free, ready)
        if self.queued:
            if self.stretched:
                return np.concatenate((ready, free, comm_free, np.maximum(comm_until, free)))
            return np.concatenate((ready, free, comm_free))
        if self.stretched:
            return np.concatenate((ready, free, np.maximum(comm_until, free)))
        return np.concatenate((ready, free))

    def _priced(self, inst: _Instance) -> bytes:
        """Its ops' durations as bytes: instances of a template run the same works, so these
        differ only where ops were re-priced one by one (host crowding)."""
        key = self.prices.get(inst.first)
        if key is None:
            key = self.prices[inst.first] = self.d[inst.first:inst.end].tobytes()
        return key

    def enter(self, inst: _Instance, finish: np.ndarray, state: tuple):
        """(an earlier instance's start rows and finish rows, the shift its own are those plus
        (one time, or one per rank), the streams' state after it), or None: walk it (its entry is
        kept for `leave`). A few ranks' entry is compared on Python floats, where numpy's
        reductions cost more than the arithmetic (the same IEEE differences, maxima and minima
        either way)."""
        template = inst.template
        if template not in self.matched and self.misses.get(template, 0) >= self.GIVE_UP:
            return None  # walked, and not kept (`leave` finds no entry)
        entry = self.entry(inst, finish, state)
        few = entry.size <= FEW_NUMBERS
        latest = None
        for e, walked, s, f, after in self.walked.get(inst.template, ()):
            moved = entry - e
            if few:
                listed = moved.tolist()
                by, least = max(listed), min(listed)  # one time for every rank and stream
            else:
                by, least = float(moved.max()), float(moved.min())
            if latest is None:
                latest = max(entry.tolist()) if few else float(entry.max())
            per_rank = least < by - REPEAT_TOLERANCE * latest
            if per_rank:
                if not inst.local:
                    continue
                # ranks that wait for no other rank in it: each rank's times move by what its
                # own entry moved (its streams, its inputs), as ranks drift apart layer by layer
                moved = moved.reshape(-1, len(s[0]))
                by = moved.max(axis=0)
                if (moved.min(axis=0) < by - REPEAT_TOLERANCE * latest).any():
                    continue
            if self._priced(walked) != self._priced(inst):
                continue  # re-priced op by op (host crowding): not the same layer
            self.hits += 1
            self.drifted += per_rank
            self.matched.add(template)
            compute_free, comm_free, comm_until = state
            if inst.computes:
                compute_free = after[0] + by
            if inst.transfers and self.queued:
                comm_free = after[1] + by
            if self.stretched:  # until-when only ever grows; an earlier one matters nowhere
                comm_until = np.maximum(comm_until, after[2] + by)
            return s, f, by, (compute_free, comm_free, comm_until)
        self.pending[inst.first] = entry
        if template not in self.matched:
            self.misses[template] = self.misses.get(template, 0) + 1
        return None

    def leave(self, inst: _Instance, start: np.ndarray, finish: np.ndarray, state: tuple) -> None:
        entry = self.pending.pop(inst.first, None)
        if entry is None:
            return
        a, b = inst.first, inst.end
        kept = self.walked.setdefault(inst.template, [])
        # its rows as they are: `run` writes each op's row once
        kept.insert(0, (entry, inst, start[a:b], finish[a:b], state))
        del kept[self.KEPT:]


IO_STREAMS = ("io", "h2d")


def work_streams(graph: StepGraph) -> list[str]:
    """Per distinct work, the stream its ops run on (`Op.stream`), read once per graph."""
    if "work-streams" not in graph._arrays:
        works, _ = graph.works()
        graph._arrays["work-streams"] = ["comm" if isinstance(w, Comm) else IO_STREAM_OF.get(w.kind, "compute")
                                         for w in works]
    return graph._arrays["work-streams"]


def streams(graph: StepGraph) -> list[str]:
    """Per op, the stream it runs on (`Op.stream`), read once per graph for every pass below."""
    if "streams" not in graph._arrays:  # per distinct work, then per op
        of_work, (_, which) = work_streams(graph), graph.works()
        graph._arrays["streams"] = [of_work[w] for w in which.tolist()]
    return graph._arrays["streams"]


def _back_to_back(chain: np.ndarray, begin: np.ndarray, d: np.ndarray, start: np.ndarray,
                  finish: np.ndarray) -> np.ndarray:
    """Times of ops that run one after another from `begin`, op after op (one addition each);
    returns when the last one ends."""
    for j in chain.tolist():
        start[j] = begin
        begin = finish[j] = begin + d[j]
    return begin


def _stretched(begin: np.ndarray, took: np.ndarray, slow: np.ndarray, until: np.ndarray,
               keep: float) -> np.ndarray:
    """End of a compute op of `took` seconds from `begin` whose part before `until` runs
    `factor` times slower (a transfer beside it), the rest at full speed: `slow` = took x
    factor if all of it runs beside one, else took plus (1 - 1/factor) (`keep`) of the window
    (the window's work done at 1/factor speed, the rest after it). Where `until` <= `begin`
    on every rank the window is 0 and this is exactly begin + took (x + 0.0 is x, and slow >=
    took): `run` then times the rest of a chain back to back."""
    return begin + np.minimum(slow, took + np.maximum(until - begin, 0.0) * keep)


def chained_ops(graph: StepGraph, transfers: bool, at_transfers: bool = False) -> dict[int, np.ndarray]:
    """Runs of ops in which each waits only for the one before, keyed by their first op (a
    compute op). With overlap the compute stream runs such compute ops back to back, so their
    times are one running sum (np.cumsum adds in the same order as op after op), whatever other
    transfers run between them. `transfers`: a transfer that nobody syncs with and that queues
    behind nothing (the closed form's TP collectives) joins the run too, the compute op after it
    starting when it ends. A run ends with a compute op and holds every compute op between its
    first and last.

    `at_transfers`: a run also ends where a transfer that does not join it is issued: where
    transfers slow the compute beside them, the compute op after it runs beside it, which a run
    timed from its first op would not see (`run`'s stretch reads the transfers issued before an
    op)."""
    return _runs(graph, 0, len(graph.ops), transfers, at_transfers)


def _joining(graph: StepGraph, transfers: bool) -> tuple[list[bool], list[bool]]:
    """Per work: a transfer? one that may join a run (nobody syncs with it, no sender)? Read
    once per graph (`_runs` is asked per layer)."""
    key = ("joining", transfers)
    if key not in graph._arrays:
        per_work = program(graph)
        graph._arrays[key] = ([c for c, _, _ in per_work],
                              [transfers and c and sync is None and peer is None for c, sync, peer in per_work])
    return graph._arrays[key]


def _runs(graph: StepGraph, lo: int, hi: int, transfers: bool, at_transfers: bool) -> dict[int, np.ndarray]:
    """`chained_ops` among the ops [lo, hi) (a run starts afresh at lo)."""
    (_, which), stream = graph.works(), streams(graph)
    comm, joins = _joining(graph, transfers)
    runs: dict[int, np.ndarray] = {}
    run: list[int] = []
    transfers_at_end = 0  # a run ends with a compute op: transfers it took last are dropped

    def close() -> None:
        kept = len(run) - transfers_at_end
        if kept > 1:
            runs[run[0]] = np.array(run[:kept])

    for op, w, on in zip(graph.ops[lo:hi], which[lo:hi].tolist(), stream[lo:hi]):
        deps = op.deps
        follows = run and len(deps) == 1 and deps[0] == run[-1]
        if comm[w]:
            if follows and joins[w]:
                run.append(op.index)
                transfers_at_end += 1
            elif at_transfers and run:  # the compute after it may run beside it: not timed from before
                close()
                run, transfers_at_end = [], 0
            continue
        if on in IO_STREAMS:
            continue
        if follows:
            run.append(op.index)
        else:
            close()
            run = [op.index]
        transfers_at_end = 0
    close()
    return runs
