"""Engines turn a StepGraph and a HardwareProfile into a timeline of the step.

Both engines read the same graph and produce the same `Timeline` (start and finish of every op on
every representative rank), so everything derived from it (step time, exposed communication,
time by phase, the trace) is computed once here and the engines can be tested against each other:
- `closed_form`: one pass in program order, communication running beside compute without
  contention; milliseconds per plan, for screening;
- `des`: a simpy discrete-event simulation with a compute and a communication stream per rank,
  where transfers queue behind each other.
With `overlap=False` each rank has a single stream and the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from csbp.simulator.cost.cost import seconds
from csbp.simulator.cost.graph import Comm, StepGraph
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.report.result import TraceEvent

ENGINES = ("des", "closed-form")


@dataclass(frozen=True)
class Timeline:
    start: np.ndarray  # [op, rank] seconds
    finish: np.ndarray

    @property
    def step_time_s(self) -> float:
        return float(self.finish.max()) if self.finish.size else 0.0

    @property
    def critical_rank(self) -> int:
        return int(self.finish.max(axis=0).argmax()) if self.finish.size else 0


def durations(graph: StepGraph, profile: HardwareProfile) -> np.ndarray:
    """[op, rank] seconds (read-only); identical layers share work objects, so each is priced
    once. Kept with the graph for the profile: the planner runs both engines on its best plans."""
    return _per_profile(graph, profile, "durations", lambda: _priced(graph, profile))


def _priced(graph: StepGraph, profile: HardwareProfile) -> np.ndarray:
    works, which = graph.works()
    priced = np.array([seconds(w, profile) for w in works]).reshape(-1, graph.ranks)
    return priced[which]


def _per_profile(graph: StepGraph, profile: HardwareProfile, what: str, make):
    """`make()` once per graph and profile (the same profile object), its array read-only."""
    hit = graph._arrays.get((what, id(profile)))
    if hit is None or hit[0] is not profile:
        made = make()
        if made is not None:
            made.flags.writeable = False
        hit = graph._arrays[(what, id(profile))] = (profile, made)
    return hit[1]


def simulate_graph(graph: StepGraph, profile: HardwareProfile, engine: str = "des",
                   overlap: bool = True, copies: int | None = None) -> tuple[Timeline, np.ndarray]:
    """(timeline, durations) of the step with the named engine.

    `copies`: ranks each representative rank stands for when the plan runs on one host (its
    DP/TP/EP peers); with a profile that measured how ranks share the host, every op is then
    priced at the ranks busy while it runs (`host_crowding`), else at all the host's ranks."""
    d = durations(graph, profile)
    if engine == "des":
        from csbp.simulator.engine.des import run
    elif engine == "closed-form":
        from csbp.simulator.engine.closed_form import run
    else:
        from csbp.simulator.errors import InputError

        raise InputError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    slowdown = stretch(graph, profile)
    from csbp.simulator.engine import host_crowding

    if host_crowding.applies(profile, copies):
        def timeline(priced: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            t = run(graph, priced, overlap, stretch=slowdown)
            return t.start, t.finish

        start, finish, d = host_crowding.crowded(graph, profile, d, copies, overlap, timeline)
        return Timeline(start, finish), d
    return run(graph, d, overlap, stretch=slowdown), d


def stretch(graph: StepGraph, profile: HardwareProfile) -> np.ndarray | None:
    """Per op, how much slower it runs beside a transfer (1 for transfers), or None when the
    profile gives no interference figures (CPU hosts: gloo's threads are priced by core sharing)."""
    memory, compute = profile.overlap_slowdown(True), profile.overlap_slowdown(False)
    if memory == 1.0 and compute == 1.0:
        return None

    def make() -> np.ndarray:
        works, which = graph.works()
        per_work = np.array([1.0 if isinstance(w, Comm) else
                             memory if w.kind in ("elementwise", "optimizer", "storage-read") else compute
                             for w in works])
        return per_work[which]
    return _per_profile(graph, profile, "stretch", make)


@dataclass(frozen=True)
class Summary:
    step_time_s: float
    exposed_comm_s: float
    stretched_compute_s: float
    phases_s: dict[str, float]
    trace: list[TraceEvent]


def summarize(graph: StepGraph, timeline: Timeline, d: np.ndarray, with_trace: bool = True) -> Summary:
    """Step time, exposed communication and time by phase on the critical rank, and the trace.

    The compute stream is serial, so whatever part of the step it is not computing is spent
    waiting for communication (or for a slower peer inside a collective): that is the exposed
    communication. Each idle stretch is charged to the phase of the transfer that ended it.
    """
    r = timeline.critical_rank
    step = timeline.step_time_s
    names, compute, compute_phase, comm, comm_phase = _phase_index(graph)
    begin, end = timeline.start[compute, r], timeline.finish[compute, r]
    nominal = d[compute, r]
    took = end - begin  # as run: longer than nominal where a transfer ran beside it
    comm_end = timeline.finish[comm, r]
    by_end = np.argsort(comm_end, kind="stable")  # transfers in the order they end
    ends, ended_phase = comm_end[by_end], comm_phase[by_end]

    def waited_for(since: np.ndarray, until: np.ndarray, default: np.ndarray) -> np.ndarray:
        """Phase of the last transfer that ended inside each idle stretch (since, until]."""
        j = np.searchsorted(ends, until, side="right") - 1
        last = np.maximum(j, 0)
        hit = (j >= 0) & (ends[last] > since) if ends.size else np.zeros(j.shape, bool)
        return np.where(hit, ended_phase[last] if ends.size else default, default)

    # one stream: program order is time order; before each compute op, the idle stretch since
    # the previous one ended, then the op itself
    before = np.concatenate([[0.0], end[:-1]])
    idle = begin - before
    amounts = np.column_stack([idle, took]).ravel()
    codes = np.column_stack([waited_for(before, begin, compute_phase), compute_phase]).ravel()
    charged = np.column_stack([idle > 0, np.ones(len(took), bool)]).ravel()
    amounts, codes = amounts[charged], codes[charged]
    last = float(end[-1]) if len(end) else 0.0
    if step - last > 0:
        tail = waited_for(np.array([last]), np.array([step]), np.array([names.index("grad-sync")]))
        amounts, codes = np.append(amounts, step - last), np.append(codes, tail)
    phases: dict[str, float] = {}
    for code in dict.fromkeys(codes.tolist()):  # in the order phases were first charged, each
        phases[names[code]] = sum(amounts[codes == code].tolist())  # summed in time order
    trace = _trace(graph, timeline) if with_trace else []
    busy = sum(took.tolist())
    return Summary(step, max(0.0, step - busy), max(0.0, busy - sum(nominal.tolist())), phases, trace)


def _phase_index(graph: StepGraph) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(phase names, compute op indices and their phase codes, the same for transfers), once per graph."""
    if "phases" not in graph._arrays:
        phase_of = [op.phase for op in graph.ops]
        names = list(dict.fromkeys(["grad-sync"] + phase_of))
        code = {name: i for i, name in enumerate(names)}
        # the io stream (a background reader) is neither the compute stream nor a transfer
        from csbp.simulator.engine.program import work_streams

        _, which = graph.works()
        on = np.array(work_streams(graph), dtype=object)[which]  # per op, its stream
        phases = np.array([code[name] for name in phase_of], dtype=np.intp)
        split = [np.flatnonzero(on == stream) for stream in ("compute", "comm")]
        graph._arrays["phases"] = (names, *(a for idx in split for a in (idx, phases[idx])))
    return graph._arrays["phases"]


def _trace(graph: StepGraph, timeline: Timeline) -> list[TraceEvent]:
    events = []
    starts, finishes = timeline.start.tolist(), timeline.finish.tolist()
    for op in graph.ops:
        category = op.work.category if isinstance(op.work, Comm) else "compute"
        name = op.name if op.layer is None else f"L{op.layer}.{op.name}"
        for r, (begin, end) in enumerate(zip(starts[op.index], finishes[op.index])):
            if end - begin > 0:
                events.append(TraceEvent(r, op.stream, name, begin, end - begin, op.phase, category))
    return events
