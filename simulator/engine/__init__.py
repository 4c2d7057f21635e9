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

from csbp.simulator.cost import seconds
from csbp.simulator.graph import Comm, StepGraph
from csbp.simulator.hardware import HardwareProfile
from csbp.simulator.result import TraceEvent

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
    """[op, rank] seconds; identical layers share work objects, so each is priced once."""
    works, which = graph.works()
    priced = np.array([seconds(w, profile) for w in works]).reshape(-1, graph.ranks)
    return priced[which]


def simulate_graph(graph: StepGraph, profile: HardwareProfile, engine: str = "des",
                   overlap: bool = True) -> tuple[Timeline, np.ndarray]:
    """(timeline, durations) of the step with the named engine."""
    d = durations(graph, profile)
    if engine == "des":
        from csbp.simulator.engine.des import run
    elif engine == "closed-form":
        from csbp.simulator.engine.closed_form import run
    else:
        from csbp.simulator.errors import InputError

        raise InputError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    return run(graph, d, overlap), d


@dataclass(frozen=True)
class Summary:
    step_time_s: float
    exposed_comm_s: float
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
    starts, finishes, took = (a[:, r].tolist() for a in (timeline.start, timeline.finish, d))
    compute = [op for op in graph.ops if not isinstance(op.work, Comm)]
    comm = sorted((op for op in graph.ops if isinstance(op.work, Comm)), key=lambda op: finishes[op.index])
    ends = np.array([finishes[op.index] for op in comm])
    phases: dict[str, float] = {}

    def charge(phase: str, seconds: float) -> None:
        phases[phase] = phases.get(phase, 0.0) + seconds

    def waited_for(since: float, until: float, default: str) -> str:
        """Phase of the last transfer that ended inside the idle stretch (since, until]."""
        j = int(np.searchsorted(ends, until, side="right")) - 1
        return comm[j].phase if j >= 0 and ends[j] > since else default

    busy, end = 0.0, 0.0
    for op in compute:  # one stream: program order is time order
        begin = starts[op.index]
        if begin - end > 0:
            charge(waited_for(end, begin, op.phase), begin - end)
        charge(op.phase, took[op.index])
        busy += took[op.index]
        end = finishes[op.index]
    if step - end > 0:
        charge(waited_for(end, step, "grad-sync"), step - end)
    trace = _trace(graph, timeline) if with_trace else []
    return Summary(step, max(0.0, step - busy), phases, trace)


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
