"""Chrome / Perfetto trace of a simulated step: one process per rank, one thread per stream.

Open the file in ui.perfetto.dev or chrome://tracing. Times are in microseconds, as the format
wants; each event carries its phase and traffic category so the UI can filter them.
"""

from __future__ import annotations

import json
from pathlib import Path

from csbp.simulator.errors import InputError
from csbp.simulator.report.result import Result

STREAMS = ("compute", "comm")


def trace_events(result: Result) -> list[dict]:
    """The traceEvents list: metadata naming ranks and streams, then one complete event per op."""
    ranks = sorted({e.rank for e in result.trace})
    streams = list(STREAMS) + sorted({e.stream for e in result.trace} - set(STREAMS))
    meta = []
    for r in ranks:
        meta.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"context rank {r}"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}})
        for tid, stream in enumerate(streams):
            meta.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": stream}})
    tids = {s: i for i, s in enumerate(streams)}
    events = [{"ph": "X", "name": e.name, "cat": e.category or e.stream, "pid": e.rank,
               "tid": tids[e.stream], "ts": e.start_s * 1e6, "dur": e.duration_s * 1e6,
               "args": {"phase": e.phase, "category": e.category}} for e in result.trace]
    return meta + events


def write_trace(result: Result, path: str | Path) -> None:
    """Write the step of `result` as a Chrome/Perfetto JSON trace."""
    doc = {"traceEvents": trace_events(result), "displayTimeUnit": "ms",
           "otherData": {"model": result.model, "hardware": result.hardware, "engine": result.engine,
                         "plan": result.plan, "step_time_s": result.step_time_s}}
    try:
        Path(path).write_text(json.dumps(doc))
    except OSError as err:
        raise InputError(f"cannot write trace {path}: {err.strerror}") from None
