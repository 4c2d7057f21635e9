"""One measured step split by phase from its GPU kernels, beside the step graph's split.

For one step after warm-up (the last measured one), `torch.profiler` records every CUDA kernel
with the CPU ranges that launched it. A kernel is charged to
- `recompute` when a range `csbp.recompute` encloses its launch (opened around each block's
  forward while the autograd engine runs: activation checkpointing's re-run, `mark_recompute`);
- `backward` when the autograd engine launched it (`autograd::engine::evaluate_function: ...`);
- `optimizer` inside torch's `Optimizer.step#...` range, or launched after the last backward
  kernel (ZeRO's sharded step, zeroing gradients);
- `forward` otherwise (launched before backward: the blocks, embedding and loss);
- communication when its name is an NCCL kernel; only the part of communication time when no
  compute kernel runs counts as exposed (as the simulator's `exposed_comm_s`).
Compute phases are summed kernel times; they are what the step graph's compute ops of that phase
predict (summed on the representative rank whose compute is largest). CUDA only: on CPU there
are no kernel times, and the split is skipped with a note.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PHASES = ("forward", "recompute", "backward", "optimizer")
RECOMPUTE = "csbp.recompute"
BACKWARD_SCOPE = "autograd::engine::evaluate_function"
OPTIMIZER_SCOPE = "Optimizer.step"
COMM_MARKERS = ("nccl",)


@dataclass(frozen=True)
class KernelEvent:
    """One GPU kernel: name, device start and duration (µs), the names of the CPU ranges that
    launched it (outermost first) and the CPU time of the launch (µs)."""

    name: str
    start_us: float
    duration_us: float
    scopes: tuple[str, ...]
    launched_us: float


def is_comm(name: str) -> bool:
    return any(m in name.lower() for m in COMM_MARKERS)


def _scoped(e: KernelEvent, prefix: str) -> bool:
    return any(s.startswith(prefix) for s in e.scopes)


def phase_of(e: KernelEvent, backward_ends_us: float | None) -> str:
    """The phase a compute kernel belongs to (see the module docstring)."""
    if _scoped(e, RECOMPUTE):
        return "recompute"
    if _scoped(e, BACKWARD_SCOPE):
        return "backward"
    if _scoped(e, OPTIMIZER_SCOPE) or (backward_ends_us is not None and e.launched_us > backward_ends_us):
        return "optimizer"
    return "forward"


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def exposed_us(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Time some communication kernel runs and no compute kernel does."""
    busy = _union(compute)
    out = 0.0
    for begin, end in _union(comm):
        covered = sum(max(0.0, min(end, b) - max(begin, a)) for a, b in busy)
        out += (end - begin) - covered
    return out


def split(events: list[KernelEvent]) -> dict[str, float]:
    """Seconds per compute phase (summed kernel times), communication kernel time, the exposed
    part of it, and the profiled step's span on the GPU (first kernel start to last end)."""
    compute = [e for e in events if not is_comm(e.name)]
    comm = [e for e in events if is_comm(e.name)]
    backward = [e.launched_us for e in compute if _scoped(e, BACKWARD_SCOPE) or _scoped(e, RECOMPUTE)]
    ends = max(backward) if backward else None
    out = dict.fromkeys(PHASES, 0.0)
    for e in compute:
        out[phase_of(e, ends)] += e.duration_us / 1e6
    spans = lambda es: [(e.start_us, e.start_us + e.duration_us) for e in es]  # noqa: E731
    out["communication"] = _length(_union(spans(comm))) / 1e6
    out["exposed_communication"] = exposed_us(spans(comm), spans(compute)) / 1e6
    out["gpu_span"] = ((max(e.start_us + e.duration_us for e in events) - min(e.start_us for e in events))
                       / 1e6 if events else 0.0)
    return out


def predicted_split(trace, exposed_comm_s: float | None) -> dict[str, float]:
    """The step graph's compute seconds per phase on the representative rank whose compute is
    largest (the simulator's trace), and its exposed communication."""
    by_rank: dict[int, dict[str, float]] = {}
    for ev in trace:
        if ev.stream == "compute" and ev.phase in PHASES:
            phases = by_rank.setdefault(ev.rank, dict.fromkeys(PHASES, 0.0))
            phases[ev.phase] += ev.duration_s
    out = max(by_rank.values(), key=lambda p: sum(p.values()), default=dict.fromkeys(PHASES, 0.0))
    return {**out, "exposed_communication": exposed_comm_s or 0.0}


def compare(measured: dict[str, float], predicted: dict[str, float]) -> dict[str, dict]:
    """Per phase: measured, predicted and the error (predicted / measured - 1)."""
    return {k: {"measured_s": measured.get(k, 0.0), "predicted_s": predicted.get(k, 0.0),
                "error": predicted[k] / measured[k] - 1 if measured.get(k) and k in predicted else None}
            for k in (*PHASES, "exposed_communication")}


# ---- CUDA: the profiler and the recompute marks ------------------------------------------------

def mark_recompute(model) -> list:
    """Hooks on each block that open a `csbp.recompute` profiler range around its forward while
    the autograd engine runs (checkpointing's re-run); returns the handles to remove."""
    import torch

    open_ranges: list = []

    def in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def before(module, args):
        if in_backward():
            scope = torch.profiler.record_function(RECOMPUTE)
            scope.__enter__()
            open_ranges.append(scope)

    def after(module, args, output):
        if in_backward() and open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    blocks = getattr(model, "blocks", [])
    return [h for b in blocks for h in (b.register_forward_pre_hook(before), b.register_forward_hook(after))]


def kernel_events(prof) -> list[KernelEvent]:
    """The profiled kernels with the CPU ranges that launched them (torch.profiler's events:
    a kernel's linked correlation id is the id of the CPU op that launched it)."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    cpu = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    out = []
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        launcher = cpu.get(e.linked_correlation_id)
        scopes, node = [], launcher
        while node is not None:
            scopes.append(node.name)
            node = node.cpu_parent
        out.append(KernelEvent(e.name, e.time_range.start, e.time_range.end - e.time_range.start,
                               tuple(reversed(scopes)),
                               launcher.time_range.start if launcher else e.time_range.start))
    return out
