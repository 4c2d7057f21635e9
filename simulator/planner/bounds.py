"""Lower bounds on a plan's step time that cost a fraction of simulating it: the planner
prunes, without simulating them, candidates whose bound already loses (`planner.py`).

`step_time_lower_bound` is at most the step time either engine computes, for these reasons:

1. Both engines run each rank's compute ops one after another on one stream, in program order
   (the closed form's clock, the event engine's compute stream). Cut that stream into segments,
   the compute ops of each layer in each pass and those of each step edge (embedding, head,
   loss, optimizer): a segment lasts at least its compute plus the waits its own ops force
   (a compute op waiting for a transfer that an earlier op of the segment started, e.g. a TP
   collective between two GEMMs, or K/V still arriving when local attention is done). Those
   waits are found by running the segment's ops alone, its inputs from other segments ready
   at once, no rank waiting for another (syncing with a slower peer only delays), transfers
   never queueing (queueing only delays). Segments do not overlap on the stream, so the step
   lasts at least the sum of the segments, on every rank; the bound is the busiest rank's.
2. Layers of one kind append the same ops wherever they sit (the builder stamps them from the
   first), so each of their segments lasts the same: one layer of each kind, times the number of
   layers of that kind. The bound builds a model with one layer per kind; its embedding, head
   and loss are the step's, and its optimizer updates fewer parameters, so it is only shorter.
3. `keys_at_home=True` (the quick bound, shared by a plan's ring and collective twins) builds
   that graph with every attention call reading all its keys where it runs: one call per layer
   and pass over all the rank's pairs, no K/V transfers. The plan's real calls split the same
   pairs (local and remote keys, or one part per ring step) into calls over fewer keys per
   query, and a profile's attention efficiency that never falls as tiles grow runs each part at
   most as efficiently as the whole, so the parts take at least as long; the whole runs on the
   fastest kernel family the implementation uses in that pass and packs GQA heads into query
   tiles or not, whichever computes fewer tiles (a sub-set of keys never needs fewer tiles than
   it covers, nor a full tile where the whole has a partial one; where the GQA group divides a
   tile's rows, packing: an unpacked tile is `group` packed ones, touched if one of them is and
   full only if all are, so it never costs less than they do); the LSE merges and K/V
   packing it leaves out take time >= 0, and it makes no more kernel calls. On a profile whose
   attention curves fall somewhere, or whose attention is priced as dense (CPU) math, the
   quick bound keeps the real split. Without it the bound has the plan's own calls and K/V
   transfers (tighter, as it sees K/V waits; more ops for a long ring).
4. Floating point: sums are taken in another order than the engines', so the bound is lowered
   by a relative 1e-12, far above the rounding of a few thousand additions.
5. Checkpointing only adds a recompute pass: the forward and backward layers, the edges and
   the optimizer are the same ops either way (a layer's K/V exchange in the backward does not
   depend on it), so the bound without checkpointing is the one with it, less the recompute
   segments; one graph gives both (`tests/test_bounds.py` holds them equal to a graph built
   without checkpointing).
6. A reader on its own stream (`io`, `h2d`: a drafter's offline features) runs its ops one after
   another from the step's start at the earliest, waited on by nobody (`engine.program.run`);
   without overlap they run on the compute stream. Either way the step lasts at least each
   reader stream's sum, on every rank, so the bound is the larger of that and the compute
   stream's segments (which leave the readers out).
7. Ranks wait for each other at a collective whose members start together (a CP group's K/V
   all-gather: its slowest member sets when it starts). Per segment, on every rank: `pre`, the
   compute ops up to the last one the segment's first such collective depends on (in program
   order: the stream runs them all before that one ends); `mid`, those after it that do not wait
   for the collective; `post`, the rest, from the first op that does. With E the time a rank's
   stream ends the segment before (a lower bound, by induction), the collective starts no
   earlier than T = the largest E + pre among its members, the first op waiting for it no
   earlier than max(T, E + pre + mid), so the rank ends the segment no earlier than that plus
   post; a segment without such a collective, no earlier than E plus all its compute. A ring's
   hop is such a transfer too, between two ranks: a rank's hop starts once its sender has
   arrived at it (`engine.program.run`: p2p waits for `peer`), so there T = the larger of its own
   E + pre and its sender's (pure CP's ring: the imbalance of the zigzag reaches every rank one
   hop per layer, as the all-gather's slowest member does at once). That is the closed form's
   own recursion with every transfer taking 0 s, no stretch and fewer waits, below both engines
   (each is monotone in every duration); and by reason 1 the segment also ends no earlier than
   E plus how long its ops alone last from its start (`_alone`: its own transfers' waits), so
   each segment ends at the larger of the two and the next starts from there: cross-rank waits
   and a segment's own transfer waits (EP all-to-alls, K/V arrivals) add up instead of the
   bound being the larger of two sums. Layers of a kind have the same
   segments (reason 2), so the recursion runs along the model's real layer order (forward
   ascending, recompute and backward descending, each pass and stream as the graph has them)
   with each layer's kind's segments from the one-layer-per-kind graph: per layer a few array
   operations, not its ops. The bound per rank is the larger of this and reason 1's sum
   (taken for pure CP's tight bound, where ranks are unbalanced: `busy_per_rank`).
8. A ring's hops chain (`ring_chains`): in a layer's forward (and recompute) a rank sends on
   the K/V it received at the step before (`AttentionOps.attention_forward`: hop s waits for
   hop s-1), and its last step's call waits for the last hop, so the layer's segment lasts at
   least the sum of its hops' durations (no hop starts before the segment does: the first
   waits for the layer's input); in the backward, at least that of its K/V hops and at least
   that of its dK/dV hops and the one home. Reason 1 then gives the step at least the sum over
   those segments, on every rank, each layer's from one layer of its kind (reason 2), in every
   trained stream and view pass. It reads only the hops' prices, not a graph: the rung the
   planner climbs for a ring before its tight bound, whose graph has a call and a hop per ring
   step and layer (hundreds at a context group of 256).
"""

from __future__ import annotations

import numpy as np

from csbp.simulator.engine import durations, host_crowding
from csbp.simulator.engine.program import IO_STREAMS, streams
from csbp.simulator.cost.graph import Comm, StepGraph
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.workload.objectives import as_executed
from csbp.simulator.layout import kv_rows
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

ROUNDING_MARGIN = 1e-12


_REDUCED: dict[int, tuple[ModelSpec, ModelSpec, list[int]]] = {}


def one_layer_per_kind(model: ModelSpec) -> tuple[ModelSpec, list[int]]:
    """The model with one layer of each kind, and how many layers each stands for (made once
    per model: a search asks for every candidate)."""
    hit = _REDUCED.get(id(model))
    if hit is None or hit[0] is not model:
        if len(_REDUCED) > 64:
            _REDUCED.clear()
        kinds = model.attention_kinds()
        hit = _REDUCED[id(model)] = (model, model.model_copy(update={"layers": tuple(kinds)}),
                                     list(kinds.values()))
    return hit[1], hit[2]


def keys_at_home_is_cheapest(profile: HardwareProfile) -> bool:
    """Reason 3 holds on this profile: attention efficiency never falls as tiles grow, and
    attention is priced by its tiles (not as dense CPU math)."""
    gpu = profile.gpu
    curves = (gpu.attention_forward_efficiency, gpu.attention_backward_efficiency)
    rising = all(a[1] <= b[1] for curve in curves for a, b in zip(curve, curve[1:]))
    return rising and not gpu.dense_attention


def busy_per_rank(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
                  keys_at_home: bool = False) -> dict[str, np.ndarray]:
    """Per representative rank, a lower bound on how long its compute stream is busy or forced
    to wait (reasons 1-3 of the module docstring), with full checkpointing and without.

    Both come from one graph built with checkpointing: without it a step runs the same
    segments but the recompute pass (reason 5), so its sum leaves those segments out.
    """
    workload = workload.model_copy(update={"checkpointing": "full"})
    reduced, counts = one_layer_per_kind(model)
    graph = StepGraph.build(reduced, workload, plan, Layout.build(as_executed(workload, model), plan),
                            profile.node.gpus_per_node,
                            keys_at_home=keys_at_home and keys_at_home_is_cheapest(profile),
                            implementation=profile.implementation)
    # ranks sharing a host: an op may run with fewer of them busy than all (engine/host_crowding)
    d = durations(graph, host_crowding.fastest(profile))
    sums = segment_sums(graph, counts, d)
    if keys_at_home or plan.cp == 1 or plan.bp > 1:
        # reason 7 only where it moves the bound: without a K/V exchange no collective's members
        # start together, and under BP/CSBP the dealt blocks balance the ranks (DiffusionGemma
        # 256K dp=4,cp=4,bp=4: 36.29 s either way), while pure CP's streams do not (0.68 -> 0.98
        # of the closed form); elsewhere its recursion costs more than it prunes
        return sums
    waits = sync_waits(graph, d, [reduced.layers.index(a) for a in model.layers])
    return {ckpt: np.maximum(busy, waits[ckpt]) for ckpt, busy in sums.items()}


def segment_sums(graph: StepGraph, counts: list[int], d: np.ndarray) -> dict[str, np.ndarray]:
    """Per rank, the sum over the compute stream's segments of how long each lasts at least
    (reason 1), layers weighted by the layers of their kind (`counts`, reason 2); "none" leaves
    the recompute segments out."""
    n = graph.ranks
    total = {"full": np.zeros(n), "none": np.zeros(n)}
    durations, readers = segment_durations(graph, d)
    for (layer, phase), clock in durations:
        weight = 1.0 if layer is None else float(counts[layer])
        total["full"] += weight * clock
        if phase != "recompute":
            total["none"] += weight * clock
    for busy in readers.values():  # reason 6: the step outlasts each reader stream too
        for ckpt in total:
            total[ckpt] = np.maximum(total[ckpt], busy)
    return total


def segment_durations(graph: StepGraph, d: np.ndarray) -> tuple[list[tuple], dict[str, np.ndarray]]:
    """([((layer, phase), how long the segment lasts at least on each rank)] for the compute
    stream's segments in program order (`_alone`), and per reader stream the sum of its ops
    (reason 6)."""
    out: list[tuple] = []
    readers: dict[str, np.ndarray] = {}
    segment, members = None, []
    for op, stream in zip(graph.ops, streams(graph)):
        if stream in IO_STREAMS:  # a background reader beside the step: its own bound (reason 6)
            readers[stream] = readers.get(stream, 0.0) + d[op.index]
            continue
        if (op.layer, op.phase) != segment:
            lasts = _alone(members, d, graph.ranks)
            if lasts is not None:
                out.append((segment, lasts))
            segment, members = (op.layer, op.phase), []
        members.append(op)
    lasts = _alone(members, d, graph.ranks)
    if lasts is not None:
        out.append((segment, lasts))
    return out, readers


def _alone(ops: list, d: np.ndarray, n: int) -> np.ndarray | None:
    """How long a segment's compute stream lasts at least on each rank (reason 1): its ops
    alone, in program order, inputs from other segments ready at its start, transfers as soon
    as their inputs are; None if it runs no compute op."""
    # an op none of whose inputs is in the segment is ready at once (None: no wait to count,
    # as -inf would be), and so is a transfer that waits for none, which is left out
    finish: dict[int, np.ndarray] = {}
    clock, computes = np.zeros(n), False
    for op in ops:
        ready = None
        for j in op.deps:
            f = finish.get(j)
            if f is not None:
                ready = f if ready is None else np.maximum(ready, f)
        if isinstance(op.work, Comm):
            if ready is not None:
                finish[op.index] = ready + d[op.index]
        else:
            clock = (clock if ready is None else np.maximum(clock, ready)) + d[op.index]
            finish[op.index] = clock
            computes = True
    return clock if computes else None


def _segments(graph: StepGraph, d: np.ndarray) -> list[tuple]:
    """The compute stream's segments in program order (reason 1's): (layer, phase, run key, what
    a rank's stream does in it: ("sum", seconds) or ("sync", pre, mid, post, the collective's
    `program.Sync` or None, a hop's senders or None), by reason 7; how long it lasts at least
    from its start, by reason 1: `_alone`)."""
    from csbp.simulator.engine.program import program

    per_work, (_, which), on = program(graph), graph.works(), streams(graph)
    n = graph.ranks
    out, ops = [], graph.ops
    start = 0
    while start < len(ops):
        key = (ops[start].layer, ops[start].phase)
        end = start
        while end < len(ops) and (ops[end].layer, ops[end].phase) == key:
            end += 1
        inside = range(start, end)
        compute = [i for i in inside if not per_work[which[i]][0] and on[i] not in IO_STREAMS]
        if compute:
            head = ops[compute[0]].name.split(".", 1)[0]
            stream = head if head in ("encoder", "decoder", "selfcond") else ""
            run = (stream, "forward" if key[1] == "forward" else "backward")
            alone = _alone([ops[i] for i in inside if on[i] not in IO_STREAMS], d, n)
            out.append((key[0], key[1], run, _segment(ops, compute, start, end, per_work, which, d, n), alone))
        start = end
    return out


def _segment(ops, compute: list[int], start: int, end: int, per_work, which, d: np.ndarray, n: int) -> tuple:
    """("sync", pre, mid, post, sync, senders) for the segment's first transfer whose members
    wait for each other (a collective's that start together, or a hop's sender), that waits for
    some of its compute and that some of its compute waits for; ("sum", all its compute) where
    there is none (reason 7)."""
    is_compute = set(compute)
    for c in range(start, end):
        comm, sync, peer = per_work[which[c]]
        if not comm or (sync is None and peer is None):
            continue
        before, stack = set(), list(ops[c].deps)  # its ancestors inside the segment
        while stack:
            j = stack.pop()
            if j >= start and j not in before:
                before.add(j)
                stack.extend(ops[j].deps)
        last = max((j for j in before if j in is_compute), default=None)
        after = {c}  # what waits for it inside the segment, in program order
        first = None
        for j in range(c + 1, end):
            if any(k in after for k in ops[j].deps):
                after.add(j)
                if j in is_compute:
                    first = j
                    break
        if last is None or first is None:
            continue
        parts = [np.zeros(n), np.zeros(n), np.zeros(n)]
        for j in compute:
            parts[0 if j <= last else 1 if j < first else 2] += d[j]
        return ("sync", *parts, sync, peer)
    return ("sum", d[compute].sum(axis=0))


def sync_waits(graph: StepGraph, d: np.ndarray, kinds: list[int]) -> dict[str, np.ndarray]:
    """Per rank, when its compute stream ends at the earliest by reason 7, with full
    checkpointing and without (rows 0 and 1 of one recursion); `graph` has one layer per kind,
    `kinds` gives the kind (its layer in `graph`) of each layer of the model, in order. Zeros
    where no segment waits at such a collective (reason 1's sum is then the larger)."""
    from csbp.simulator.engine.program import slowest

    segments = _segments(graph, d)
    n = graph.ranks
    if not any(part[0] == "sync" for *_, part, _ in segments):
        return {"full": np.zeros(n), "none": np.zeros(n)}
    end = np.zeros((2, n))  # [full, none]
    skip = np.array([[1.0], [0.0]])  # a recompute segment counts in "full" only

    def step(end: np.ndarray, part: tuple, phase: str, lasts: np.ndarray) -> np.ndarray:
        if part[0] == "sum":
            added = end + np.maximum(part[1], lasts)
        else:
            _, pre, mid, post, sync, peer = part
            arrived = end + pre
            starts = arrived if sync is None else slowest(arrived, sync)
            if peer is not None:  # a hop: also once its sender has arrived
                starts = np.maximum(starts, starts[..., peer])
            added = np.maximum(np.maximum(starts, arrived + mid) + post, end + lasts)
        return end + skip * (added - end) if phase == "recompute" else added

    i = 0
    while i < len(segments):
        layer, phase, run, part, lasts = segments[i]
        if layer is None:
            end = step(end, part, phase, lasts)
            i += 1
            continue
        # a pass over the layers: its segments by (kind, phase), one layer's phases in order
        j, found, pattern = i, {}, []
        while j < len(segments) and segments[j][0] is not None and segments[j][2] == run:
            found[segments[j][0], segments[j][1]] = segments[j][3:]
            if segments[j][0] == segments[i][0] and segments[j][1] not in pattern:
                pattern.append(segments[j][1])
            j += 1
        order = range(len(kinds)) if run[1] == "forward" else range(len(kinds) - 1, -1, -1)
        for li in order:
            for ph in pattern:
                got = found.get((kinds[li], ph))
                if got is not None:
                    end = step(end, got[0], ph, got[1])
        i = j
    return {"full": end[0], "none": end[1]}


def ring_chains(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile) -> dict[str, float]:
    """Seconds no engine's step of a ring plan can undercut by reason 8, with checkpointing
    "full" and "none"; 0 where no layer's attention runs on a ring. The hops are priced as the
    step graph's own works (`AttentionOps.kv_work`) are priced by the bounds, all of a chain at
    once (`hop_chain`)."""
    workload = workload.model_copy(update={"checkpointing": "full"})
    layout = Layout.build(as_executed(workload, model), plan)
    builder = StepGraph.builder(model, workload, plan, layout, profile.node.gpus_per_node,
                                implementation=profile.implementation)
    priced = host_crowding.fastest(profile)

    def chain(s, a, phase: str, hops: int, payload: str | None) -> np.ndarray:
        return hop_chain(s, a, phase, hops, payload, priced)

    out = {"full": np.zeros(layout.size), "none": np.zeros(layout.size)}
    for s in builder.stream_builders():
        for a, count in model.attention_kinds().items():
            if s.pattern(a, "forward") != "ring" or s.ulysses("ring"):
                continue
            n = s.ring_steps()
            forward = count * chain(s, a, "forward", n - 1, None)
            out["none"] = out["none"] + forward
            out["full"] = out["full"] + forward
            if s.pattern(a, "recompute") == "ring":
                out["full"] = out["full"] + count * chain(s, a, "recompute", n - 1, None)
            if s.pattern(a, "backward") == "ring" and s.cut("ring", "backward") != "steps":
                backward = count * np.maximum(chain(s, a, "backward", n - 1, "kv"),
                                              chain(s, a, "backward", n, "dkv"))
                out["none"] = out["none"] + backward
                out["full"] = out["full"] + backward
    passes = builder.obj.passes
    return {ckpt: float(v.max()) * passes * (1 - ROUNDING_MARGIN) for ckpt, v in out.items()}


def hop_chain(s, a, phase: str, hops: int, payload: str | None, priced: HardwareProfile) -> np.ndarray:
    """Per rank, the seconds of the layer kind's first `hops` ring hops in `phase` added in hop
    order: what `kv_work`'s works of those steps cost one after another, without making them (a
    hop prices each rank's bytes alone: its group syncs nobody else). Each rank's shard is priced
    once (`ring_shards`), each hop gathers the price of the shard it brings; kept per layout
    ownership by what it reads (the shards' bytes and group, the hops, the profile), as
    candidates that differ in dp or ep, or a plan's streams, ask for the same chain."""
    from csbp.simulator.cost.cost import seconds

    shards = s.ring_shards(a, phase, payload)
    if shards is None or hops == 0:  # no hop moves a row
        return np.zeros(s.n)
    assert len(shards.group.sync) == s.n  # each rank's hop waits for no other rank's
    gradients = payload == "dkv"

    def add_up() -> np.ndarray:
        src = kv_rows.ring_sources(s.lay, gradients)[:hops]  # [hop, rank]: whose shard it brings
        each = np.where(src >= 0, seconds(shards, priced)[src], 0.0)
        total = np.cumsum(each, axis=0)[-1].copy()  # in hop order, as the graph's hops add up
        total.flags.writeable = False  # shared by every candidate that asks
        return total

    key = ("ring-chain", shards, hops, gradients, id(priced))
    hit = s.lay.derived.get(key)
    if hit is None or hit[0] is not priced:
        hit = s.lay.derived[key] = (priced, add_up())
    return hit[1]


def lower_bounds(model: ModelSpec, workload: Workload, plan: Plan, profile: HardwareProfile,
                 keys_at_home: bool = False) -> dict[str, float]:
    """Seconds no engine's step can undercut, with checkpointing "full" and "none" (see the
    module docstring for why); `workload.checkpointing` does not matter."""
    return {ckpt: float(busy.max()) * (1 - ROUNDING_MARGIN) if busy.size else 0.0
            for ckpt, busy in busy_per_rank(model, workload, plan, profile, keys_at_home).items()}


def step_time_lower_bound(model: ModelSpec, workload: Workload, plan: Plan,
                          profile: HardwareProfile, keys_at_home: bool = False) -> float:
    """Seconds no engine's step of this plan and workload can undercut."""
    return lower_bounds(model, workload, plan, profile, keys_at_home)[workload.checkpointing]


def bound_key(plan: Plan, workload: Workload, profile: HardwareProfile, keys_at_home: bool) -> tuple:
    """Candidates with equal keys share `lower_bounds`: checkpointing never changes them, the
    transport not where keys are at home (reason 3)."""
    if keys_at_home and keys_at_home_is_cheapest(profile):
        plan = plan.model_copy(update={"transport": "collective"})
    return plan, workload.model_copy(update={"checkpointing": "full"}), keys_at_home
