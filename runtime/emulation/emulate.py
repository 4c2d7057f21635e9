"""One rank of a large plan on one device, timed op by op beside the step graph's prediction.

    csbp run --model nemotron-diffusion-8b --seq-len 256k --block-size 256 \
        --plan cp=8,bp=8 --emulate-rank 3 --layers 2 --json

Why: a cluster is rarely at hand, but what separates CP from CSBP on the compute side (a rank's
positions, its noisy blocks, its attention calls in the layout's order, its kernels, copies and
memory) is one rank's business, and one GPU can run it at the study's shapes. The rank runs the
runtime's own code (`plans.rank_work`, `train.Trainer`), so it executes exactly what that rank
executes in a real run; only the comm layer differs: `LocalComm` answers every collective with
a local buffer of the size the rank would receive (contents synthetic), counting bytes as
`comm.Comm` does. Each op is timed (CUDA events on a GPU, the wall clock on CPU) and set beside
the step graph's price of the same op for that rank (`cost.seconds(work, profile)[ctx rank]`);
the graph's ops are matched by (phase, layer) and grouped by what the runtime can time
(`graph_group`), read from their names and kinds, not from a fixed list. Peak memory is the
allocator's (CUDA) or the process's resident high-water mark (CPU), beside `memory.py`'s
estimate for that rank.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator
from unittest import mock

import torch

from csbp.runtime.distributed.comm import Comm, _share
from csbp.runtime.distributed.mesh import coordinates
from csbp.simulator.errors import InputError

GIB = 1024**3
COLLECTIVE = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
              "all_to_all": "all-to-all", "send_recv": "p2p", "all_reduce": "all-reduce"}
LAYER_OPS = ("qkv", "attention", "out-proj", "mlp", "elementwise")


# ---- collectives answered locally -----------------------------------------------------------
class LocalGroup:
    """A process group that exists only as its members (global ranks, ascending)."""

    def __init__(self, ranks) -> None:
        self.ranks = tuple(sorted(ranks))


@dataclass(frozen=True)
class CommCall:
    """One collective the rank issued: what a real run would have moved for it."""

    op: str  # the Comm method
    category: str
    phase: str | None  # attention K/V: forward, recompute or backward
    received: int  # bytes
    sent: int
    in_backward: bool
    after_backward: bool


class LocalComm(Comm):
    """`Comm` for one rank of a `world`-rank plan with no peers: every collective returns a
    buffer of the size the rank would receive, its own slot holding its own data and the peers'
    slots synthetic; the byte counters move exactly as `Comm`'s do.

    Synthetic contents [U]: this rank's own rows of the same tensor, repeated (what it sends, or
    its own slot): finite, of the right dtype and scale (K/V, hidden states, gradients, ZeRO's
    updated weights), so the step stays numerically sane for as many steps as it runs; a sum
    over peers (reduce-scatter) is this rank's part times the group size, an all-reduce leaves
    this rank's part as the sum.
    """

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank
        self.calls: list[CommCall] = []
        self.listener = None  # step_begin(), backward_end(): the Clock
        self._after_backward = False
        super().__init__(None)

    # the step's milestones, as train.Trainer marks them through its comm
    def reset(self) -> None:
        super().reset()
        self.calls, self._after_backward = [], False
        if getattr(self, "listener", None):
            self.listener.step_begin()

    @contextmanager
    def backward(self) -> Iterator[None]:
        with super().backward():
            yield
        self._after_backward = True
        if self.listener:
            self.listener.backward_end()

    def new_group(self, ranks: list[int]) -> LocalGroup:
        return LocalGroup(ranks)

    def _members(self, group) -> tuple[int, ...]:
        return tuple(range(self.world)) if group is None else group.ranks

    def _record(self, op: str, category: str, phase: str | None, before: tuple) -> None:
        sent, received = before
        self.calls.append(CommCall(op, category, phase, self.received[category] - received,
                                   self.sent[category] - sent, self._in_backward,
                                   self._after_backward))

    def _snapshot(self, category: str) -> tuple[int, int]:
        return self.sent[category], self.received[category]

    def all_gather(self, shard, group, category, phase=None, padding=0):
        members = self._members(group)
        size, rows = len(members), shard.shape[0]
        before = self._snapshot(category)
        out = _repeated((size * rows, *shard.shape[1:]), shard)  # own slot: its own shard
        volume = _share(size * _nbytes(shard) - padding * shard.element_size(), size)
        self._count(category, volume, volume, phase)
        self._record("all_gather", category, phase, before)
        return out

    def reduce_scatter(self, full, group, category, phase=None, padding=0):
        members = self._members(group)
        size, me = len(members), members.index(self.rank)
        before = self._snapshot(category)
        rows = full.shape[0] // size
        out = full[me * rows:(me + 1) * rows] * size
        volume = _share(_nbytes(full) - padding * full.element_size(), size)
        self._count(category, volume, volume, phase)
        self._record("reduce_scatter", category, phase, before)
        return out

    def all_to_all(self, rows, send_splits, recv_splits, me, group, category, phase=None):
        before = self._snapshot(category)
        out = _repeated((sum(recv_splits), *rows.shape[1:]), rows)
        start_in, start_out = sum(send_splits[:me]), sum(recv_splits[:me])
        own = min(send_splits[me], recv_splits[me])
        out[start_out:start_out + own] = rows[start_in:start_in + own]
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        self._count(category, (sum(send_splits) - send_splits[me]) * row_bytes,
                    (sum(recv_splits) - recv_splits[me]) * row_bytes, phase)
        self._record("all_to_all", category, phase, before)
        return out

    def send_recv(self, sends, recv_numel, like, category, phase=None):
        before = self._snapshot(category)
        source = next(iter(sends.values()), like)
        received = {peer: _repeated((n,), source if source.numel() else like)
                    for peer, n in recv_numel.items()}
        self._count(category, sum(map(_nbytes, sends.values())),
                    sum(map(_nbytes, received.values())), phase)
        self._record("send_recv", category, phase, before)
        return received

    def all_reduce(self, t, category, group=None, op="sum"):
        size = len(self._members(group))
        before = self._snapshot(category)
        if size > 1:
            volume = _share(_nbytes(t), size, passes=2)
            self._count(category, volume, volume)
        self._record("all_reduce", category, None, before)
        return t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _repeated(shape: tuple[int, ...], source: torch.Tensor) -> torch.Tensor:
    """A fresh buffer of `shape` holding `source`'s elements over and over (doubling copies:
    one write of the buffer, as a receive does); zeros when `source` is empty."""
    out = torch.empty(shape, dtype=source.dtype, device=source.device)
    flat, src = out.view(-1), source.reshape(-1)
    n = flat.numel()
    if src.numel() == 0:
        return out.zero_()
    filled = min(n, src.numel())
    flat[:filled] = src[:filled]
    while filled < n:
        more = min(filled, n - filled)
        flat[filled:filled + more] = flat[:more]
        filled += more
    return out


# ---- timing ------------------------------------------------------------------------------------
Key = tuple[str, "int | None", str]  # (phase, layer, op name)


class _Span:
    """One timed call: a start stamp and the stamps that may end it (the latest counts)."""

    __slots__ = ("key", "start", "ends")

    def __init__(self, key: Key, start=None) -> None:
        self.key, self.start, self.ends = key, start, []


class _Mark(torch.autograd.Function):
    """Identity whose backward calls `note` when the gradient reaches it (a backward boundary)."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.note()
        return grad, None


def _mark(x, note: Callable[[], None] | None):
    if note is None or not isinstance(x, torch.Tensor) or not x.requires_grad:
        return x
    return _Mark.apply(x, note)


class Clock:
    """Named spans of one step: CUDA events on a GPU (read once the step is over), the wall
    clock on CPU. Forward spans open and close around a call; a backward span opens when the
    gradient of the call's output arrives and closes when its inputs' gradients are made."""

    def __init__(self, device: torch.device, comm: LocalComm) -> None:
        self.cuda, self.comm = device.type == "cuda", comm
        self.spans: list[_Span] = []
        self.at_backward_end: list[_Span] = []
        self.steps: list[dict[Key, float]] = []  # seconds per key, one dict per step
        self.totals: list[float] = []
        self.origin = None

    def stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def phase(self) -> str:
        return self.comm.forward_phase()

    def open(self, key: Key) -> _Span:
        span = _Span(key, self.stamp())
        self.spans.append(span)
        return span

    def close(self, span: _Span) -> None:
        span.ends.append(self.stamp())

    def later(self, key: Key) -> _Span:
        """A backward span, opened and closed by `_Mark` notes."""
        span = _Span(key)
        self.spans.append(span)
        return span

    def start_note(self, span: _Span) -> Callable[[], None]:
        def note() -> None:
            if span.start is None:
                span.start = self.stamp()
        return note

    def end_note(self, span: _Span) -> Callable[[], None]:
        return lambda: span.ends.append(self.stamp())

    # step milestones (LocalComm.listener and the optimizer's hooks)
    def step_begin(self) -> None:
        self.spans, self.at_backward_end = [], []
        self.origin = self.stamp()

    def backward_end(self) -> None:
        for span in self.at_backward_end:
            span.ends.append(self.stamp())

    def step_end(self) -> None:
        end = self.stamp()
        if self.cuda:
            torch.cuda.synchronize()
            at = lambda s: self.origin.elapsed_time(s) / 1e3  # noqa: E731
        else:
            at = lambda s: s - self.origin  # noqa: E731
        done = [(s.key, at(s.start), max(map(at, s.ends))) for s in self.spans
                if s.start is not None and s.ends]  # not: a backward no gradient reached
        # checkpointing recomputes a block inside the backward of its first op: a backward
        # span counts without the recomputed blocks it contains
        recomputed = [(t0, t1) for (phase, _, name), t0, t1 in done
                      if phase == "recompute" and name == "block"]
        seconds: dict[Key, float] = {}
        for key, t0, t1 in done:
            inside = (sum(r1 - r0 for r0, r1 in recomputed if t0 <= r0 and r1 <= t1)
                      if key[0] == "backward" else 0.0)
            seconds[key] = seconds.get(key, 0.0) + t1 - t0 - inside
        self.steps.append(seconds)
        self.totals.append(at(end))


def _time_module(module: torch.nn.Module, clock: Clock, layer: int | None, name: str) -> None:
    """Forward (and recompute) spans around each call; a backward span from the gradient of
    its output to the gradient of its first input (or to the end of backward when that input
    takes no gradient, as token ids do)."""
    calls: list[tuple[_Span, _Span | None]] = []

    def pre(mod, args):
        phase = clock.phase()
        span = clock.open((phase, layer, name))
        back = None
        if phase == "forward" and torch.is_grad_enabled():
            back = clock.later(("backward", layer, name))
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.requires_grad:
                args = (_mark(first, clock.end_note(back)), *args[1:])
            else:
                clock.at_backward_end.append(back)
        calls.append((span, back))
        return args

    def post(mod, args, out):
        span, back = calls.pop()
        clock.close(span)
        return _mark(out, clock.start_note(back)) if back is not None else out

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


class _TimedAttention:
    """The rank's `Attention`, each call a span (exchange, kernels, merges: the layout's calls)."""

    def __init__(self, inner, clock: Clock) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "clock", clock)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, layer: int, q, k, v):
        clock = self.clock
        phase = clock.phase()
        span = clock.open((phase, layer, "attention"))
        back = None
        if phase == "forward" and torch.is_grad_enabled():
            back = clock.later(("backward", layer, "attention"))
            q, k, v = (_mark(t, clock.end_note(back)) for t in (q, k, v))
        out = self.inner(layer, q, k, v)
        clock.close(span)
        return _mark(out, clock.start_note(back)) if back is not None else out


def _weights(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The leaf modules of `module` that multiply by a weight matrix (its GEMMs)."""
    return [m for m in module.modules() if not list(m.children())
            and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2]


def instrument(trainer, clock: Clock) -> None:
    """Time the trainer's step: per block its projections, attention and MLP (the rest of the
    block is its elementwise work), the embedding, the LM head and the optimizer."""
    model = trainer.model
    for li, block in enumerate(model.blocks):
        _time_module(block, clock, li, "block")
        attn = block.attn
        for name, modules in (("qkv", [getattr(attn, n, None) for n in ("wq", "wk", "wv")]),
                              ("out-proj", [getattr(attn, "wo", None)]),
                              ("mlp", _weights(block.ffn))):
            for module in modules:
                if module is not None:
                    _time_module(module, clock, li, name)
    _time_module(model.embed, clock, None, "embed")
    _time_module(model.lm_head, clock, None, "lm-head")
    trainer.work.attention = _TimedAttention(trainer.work.attention, clock)
    step = trainer.optimizer.step  # ZeRO's sharded AdamW is no torch Optimizer: wrap the call

    def timed_step(*args, **kwargs):
        span = clock.open(("optimizer", None, "optimizer"))
        out = step(*args, **kwargs)
        clock.close(span)
        clock.step_end()
        return out

    trainer.optimizer.step = timed_step


def measured_ops(seconds: dict[Key, float], total: float) -> dict[Key, float]:
    """The emulated ops of one step: block spans become their elementwise remainder, and
    whatever no span covers (loss, batch, gradient sums, synthetic receives) is `other`."""
    out = {k: v for k, v in seconds.items() if k[2] != "block"}
    covered = 0.0
    for (phase, layer, name), s in seconds.items():
        if name == "block":
            inner = sum(seconds.get((phase, layer, n), 0.0) for n in LAYER_OPS[:-1])
            out[(phase, layer, "elementwise")] = max(0.0, s - inner)
            covered += s
        elif layer is None:
            covered += s
    out[("step", None, "other")] = max(0.0, total - covered)
    return out


# ---- prediction -----------------------------------------------------------------------------------
def graph_group(op) -> Key | None:
    """The emulated op a step-graph op belongs to, from its phase, layer, name and kind; None
    for communication (reported apart). New op names fall into the nearest group by kind."""
    from csbp.simulator.cost.graph import Comm as GraphComm

    work, name = op.work, op.name
    if isinstance(work, GraphComm):
        return None
    if op.phase == "optimizer":
        return ("optimizer", None, "optimizer")
    if op.layer is None:
        for edge in ("embed", "lm-head"):
            if name.startswith(edge):
                return (op.phase, None, edge)
        return ("step", None, "other")
    if name.startswith(("attn", "kv.", "dkv.")) or work.kind.startswith("attention"):
        group = "attention"
    elif name.startswith(("qkv", "context-kv")):
        group = "qkv"
    elif name.startswith("out-proj"):
        group = "out-proj"
    elif work.kind == "gemm":
        group = "mlp"
    else:
        group = "elementwise"
    return (op.phase, op.layer, group)


def runtime_workload(job):
    """The workload as the runtime executes it (its ZeRO stage: `train.zero_stage`)."""
    from csbp.runtime.training.train import zero_stage

    return job.workload.model_copy(update={"zero_stage": zero_stage(job)})


@dataclass
class Prediction:
    ops: dict[Key, float]
    graph_ops: dict[Key, list[str]]
    collectives: dict[tuple[str, str, str], dict]  # (category, collective, phase) -> figures
    memory_gib: dict[str, float]  # by category at the rank's peak, allocator and reserved included
    allocated_gib: float  # live tensors at the peak: what an allocated-bytes counter measures
    peak_at: dict  # the phase, op and layer of the rank's peak


def predict(job, ctx: int, profile) -> Prediction:
    """The step graph's ops for context rank `ctx`, priced on `profile` and grouped."""
    from csbp.simulator.cost.cost import seconds
    from csbp.simulator.cost.graph import Comm as GraphComm, StepGraph
    from csbp.simulator.layout.layout import Layout
    from csbp.simulator.cost.memory import estimate_memory

    w = runtime_workload(job)
    layout = Layout.build(w, job.plan)
    graph = StepGraph.build(job.model, w, job.plan, layout, profile.node.gpus_per_node,
                            implementation="csbp-runtime")  # what this runtime executes
    ops: dict[Key, float] = {}
    names: dict[Key, list[str]] = {}
    collectives: dict[tuple[str, str, str], dict] = {}
    for op in graph.ops:
        price = float(seconds(op.work, profile)[ctx])
        if isinstance(op.work, GraphComm):
            key = (op.work.category, op.work.collective, _comm_phase(op.work.category, op.phase))
            entry = collectives.setdefault(key, {"calls": 0, "bytes": 0.0, "seconds": 0.0})
            entry["calls"] += 1
            entry["bytes"] += op.work.bytes[ctx]
            entry["seconds"] += price
            continue
        key = graph_group(op)
        ops[key] = ops.get(key, 0.0) + price
        if op.name not in names.setdefault(key, []):
            names[key].append(op.name)
    memory = estimate_memory(job.model, w, job.plan, layout, profile)
    parts = memory.rank(ctx)
    allocated = getattr(memory, "allocated", None)  # older estimates: categories less reserved
    allocated = (float(allocated[ctx]) if allocated is not None else
                 sum(v for k, v in parts.items() if k not in ("reserved", "allocator")))
    moments = getattr(memory, "moments", None)
    peak_at = ({k: getattr(moments[ctx], k, None) for k in ("phase", "op", "layer")}
               if moments is not None else {})
    return Prediction(ops, names, collectives, parts, allocated, peak_at)


def _comm_phase(category: str, phase: str | None) -> str:
    """Attention K/V traffic is compared per phase; the rest over the whole step."""
    return phase if category == "attention-kv" and phase else "step"


# ---- the emulation -----------------------------------------------------------------------------
@dataclass
class Emulation:
    """What one emulated rank measured, beside the prediction (`to_json` is the CLI's JSON)."""

    job: object
    rank: int
    ctx_rank: int
    device: str
    device_name: str
    hardware: str
    measured: dict[Key, float]  # median seconds per op over the measured steps
    step_time_s: float
    prediction: Prediction
    collectives: dict[tuple[str, str, str], dict]  # emulated calls and bytes
    peak_memory_bytes: int
    memory_measure: str
    positions: int
    noisy_blocks: int
    notes: list[str] = field(default_factory=list)

    def ops(self) -> list[dict]:
        pred = self.prediction
        keys = sorted(set(self.measured) | set(pred.ops), key=_order)
        return [{"name": k[2], "phase": k[0], "layer": k[1],
                 "measured_s": self.measured.get(k), "predicted_s": pred.ops.get(k),
                 "graph_ops": pred.graph_ops.get(k, [])} for k in keys]

    def by_phase(self) -> list[dict]:
        """The ops summed over layers, per phase and name."""
        rows: dict[tuple[str, str], dict] = {}
        for op in self.ops():
            row = rows.setdefault((op["phase"], op["name"]), {"phase": op["phase"], "name": op["name"],
                                                              "measured_s": None, "predicted_s": None})
            for k in ("measured_s", "predicted_s"):
                if op[k] is not None:
                    row[k] = (row[k] or 0.0) + op[k]
        return list(rows.values())

    def collective_rows(self) -> list[dict]:
        pred = self.prediction.collectives
        out = []
        for key in sorted(set(self.collectives) | set(pred)):
            mine, theirs = self.collectives.get(key, {}), pred.get(key, {})
            out.append({"category": key[0], "collective": key[1], "phase": key[2],
                        "calls": mine.get("calls", 0), "emulated_bytes": mine.get("bytes", 0),
                        "predicted_bytes": round(theirs.get("bytes", 0.0)),
                        "predicted_s": theirs.get("seconds", 0.0)})
        return out

    def to_json(self) -> dict:
        job, mem = self.job, self.prediction.memory_gib
        collectives = self.collective_rows()
        return {
            "rank": self.rank,
            "ctx_rank": self.ctx_rank,
            "world": job.plan.world,
            "model": job.model.name,
            "layers": job.model.n_layers,
            "plan": job.plan.model_dump() | {"kind": job.plan.kind, "label": job.plan.label()},
            "workload": job.workload.model_dump(),
            "device": self.device,
            "device_name": self.device_name,
            "hardware": self.hardware,
            "steps": job.steps,
            "warmup": job.warmup,
            "positions": self.positions,
            "noisy_blocks": self.noisy_blocks,
            "step_time_s": self.step_time_s,
            "measured_ops_s": sum(v for v in self.measured.values()),
            "predicted_compute_s": sum(self.prediction.ops.values()),
            "ops": self.ops(),
            "by_phase": self.by_phase(),
            "collectives": collectives,
            "collective_bytes_match": all(c["emulated_bytes"] == c["predicted_bytes"]
                                          for c in collectives),
            "measured_peak_memory_gib": self.peak_memory_bytes / GIB,
            "memory_measure": self.memory_measure,
            "predicted_peak_memory_gib": self.prediction.allocated_gib,
            "predicted_peak_at": self.prediction.peak_at,
            "predicted_reserved_gib": mem.get("reserved", 0.0),
            "predicted_memory_gib": mem,
            "notes": self.notes,
        }


def _order(key: Key) -> tuple:
    phases = ("forward", "recompute", "backward", "optimizer", "step")
    phase, layer, name = key
    rank = phases.index(phase) if phase in phases else len(phases)
    names = ("embed",) + LAYER_OPS + ("lm-head", "optimizer", "other")
    return (rank, -1 if layer is None else layer, names.index(name) if name in names else len(names),
            name)


def check_rank(job, rank: int) -> None:
    """Inputs the emulation cannot take, as one-line errors."""
    world = job.plan.world
    if not 0 <= rank < world:
        raise InputError(f"--emulate-rank {rank}: the plan {job.plan.label()} has ranks 0-{world - 1}")
    if job.plan.ep > 1:
        raise InputError("--emulate-rank with expert parallelism (ep > 1) is not supported: the "
                         "rows a rank receives follow the other ranks' routing")
    if job.capture_gradients:
        raise InputError("--emulate-rank times training steps; it does not capture gradients")


def cut_layers(model, layers: int | None):
    """The model with only its first `layers` layers (the rest of the spec unchanged)."""
    if layers is None:
        return model
    if not 1 <= layers <= model.n_layers:
        raise InputError(f"--layers {layers}: {model.name} has {model.n_layers} layers "
                         f"(use 1-{model.n_layers})")
    if layers == model.n_layers:
        return model
    return model.model_copy(update={"name": f"{model.name}-{layers}-layers",
                                    "layers": model.layers[:layers]})


@contextmanager
def _trainer_comm(comm: LocalComm):
    """Build the Trainer with `comm` in place of the process-group comm it makes itself."""
    from csbp.runtime.training import train

    with mock.patch.object(train, "Comm", lambda timeout=None: comm):
        yield


def emulate(job, rank: int, device: torch.device, profile) -> Emulation:
    """Run rank `rank` of `job` alone on `device`; time its ops; predict them on `profile`."""
    from csbp.runtime.memory import memory_tracker
    from csbp.runtime.training.train import Trainer

    check_rank(job, rank)
    ctx = coordinates(job.plan, rank)["ctx"]
    prediction = predict(job, ctx, profile)  # bad input surfaces before any weight is made
    comm = LocalComm(job.plan.world, rank)
    with _trainer_comm(comm):
        trainer = Trainer(job, rank, device)
    clock = Clock(device, comm)
    comm.listener = clock
    instrument(trainer, clock)
    report = trainer.run()
    measured_steps = [measured_ops(s, t) for s, t in zip(clock.steps, clock.totals)][job.warmup:]
    keys = {k for s in measured_steps for k in s}
    measured = {k: statistics.median(s.get(k, 0.0) for s in measured_steps) for k in keys}
    share = trainer.work.layout.shares[ctx]
    cuda = device.type == "cuda"
    return Emulation(
        job=job, rank=rank, ctx_rank=ctx, device=device.type,
        device_name=torch.cuda.get_device_name(device) if cuda else "cpu",
        hardware=profile.name, measured=measured,
        step_time_s=statistics.median(report.step_times_s), prediction=prediction,
        collectives=_emulated_collectives(comm.calls), peak_memory_bytes=report.peak_memory_bytes,
        memory_measure=("torch.cuda.max_memory_allocated after warm-up" if cuda else
                        "live tensor bytes at their peak (runtime.memory_tracker, first "
                        f"{memory_tracker.STEPS} steps)"),
        positions=share.n_positions, noisy_blocks=len(share.noisy_blocks),
        notes=_notes(job, cuda))


def _emulated_collectives(calls: list[CommCall]) -> dict[tuple[str, str, str], dict]:
    """The last step's collectives, grouped as the prediction's are."""
    out: dict[tuple[str, str, str], dict] = {}
    for c in calls:
        if c.received == 0 and c.sent == 0:
            continue  # a group of one: nothing moves, and the graph has no op for it
        entry = out.setdefault((c.category, COLLECTIVE[c.op], _comm_phase(c.category, c.phase)),
                               {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += c.received
    return out


def _notes(job, cuda: bool) -> list[str]:
    from csbp.runtime.training.train import optimizer_note

    notes = ["collectives are local buffers of the received size (contents: the rank's own rows "
             "repeated): their bytes are the real rank's, their time is not measured (the copy "
             "into the buffer lands in the op that called it)",
             "measured ops: spans around the runtime's modules and attention calls; a block's "
             "elementwise op is its span minus its GEMMs and attention; `other` is the step "
             "minus every span (loss, batch, gradient sums, synthetic receives)",
             "predicted ops: the step graph's compute ops for this context rank, priced one by "
             "one (no overlap), grouped by phase, layer and kind",
             optimizer_note(job),
             "predicted_peak_memory_gib: the memory model's live tensors at the rank's peak, "
             "without allocator overhead and reserved memory, as the measured allocated peak"]
    if not cuda:
        notes.append("CPU: wall clock per op; the memory tracker slows the steps it tracks "
                     "(warm up past them for timings)")
    return notes


def job_for_rank(job, layers: int | None):
    """The job with `--layers` applied."""
    return replace(job, model=cut_layers(job.model, layers))


def print_emulation(result: dict) -> None:
    """The human-readable report: per phase and op, measured against predicted."""
    w = result["workload"]
    print(f"{result['model']}  L={w['seq_len']} b={w['block_size']} {w['dtype']}  plan "
          f"{result['plan']['label']} ({result['plan']['kind']})  rank {result['rank']} of "
          f"{result['world']} (context rank {result['ctx_rank']}: {result['positions']:,} "
          f"positions, {result['noisy_blocks']} noisy blocks) on {result['device_name']}")
    print(f"  step time    {result['step_time_s']:.4f} s measured, "
          f"{result['predicted_compute_s']:.4f} s predicted compute ({result['hardware']})")
    print(f"  {'phase':<10} {'op':<12} {'measured s':>12} {'predicted s':>12}")
    for row in result["by_phase"]:
        m, p = row["measured_s"], row["predicted_s"]
        print(f"  {row['phase']:<10} {row['name']:<12} {_num(m):>12} {_num(p):>12}")
    for c in result["collectives"]:
        print(f"  {c['category']:<12} {c['collective']:<14} {c['phase']:<9} "
              f"{c['emulated_bytes']:,} B emulated, {c['predicted_bytes']:,} B predicted")
    print(f"  peak memory  {result['measured_peak_memory_gib']:.3f} GiB measured "
          f"({result['memory_measure']}), {result['predicted_peak_memory_gib']:.3f} GiB predicted")
    for note in result["notes"]:
        print(f"  note: {note}")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.5f}"
