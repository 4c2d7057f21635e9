"""How ranks share this host, measured: the speed each rank gets while R ranks are busy at once,
per op class, and what a collective call costs more when more ranks crowd the host.

Why not cores / R: on the issue-26 host (2 cores) the summed GEMM rate was 124 GFLOP/s for one
process, 271 for two and 202 for four at once, and a training step took 143.8 ms alone, 160.6 ms
with two and 463.3 ms with four: two ranks on two cores do not each get a whole core (the step
is slower, its GEMMs are not), and four take 3.2 times as long as one, not twice as long as two.
Ops of different kinds share differently (arithmetic against the cores, memory-bound ops
against the caches and memory bus, host overhead against the interpreter's cores), so each
class is measured as the runtime runs it: R spawned processes (one thread each, as ranks) start
it together behind a gloo barrier and call it over and over for a fixed window; a call counts
when it starts and ends inside the window, and every rank keeps calling until the window
closes, so all R stay busy for all of it.

The wake-ups: a small group's collective call in a loop of compute (as `microbench._collectives`
times calls), with 2 and with 4 ranks on the host, every pair of ranks a group: what the call
adds with more ranks waiting for a core.

All of it runs in one set of processes (as many as the most ranks measured): ranks not among
the R busy ones wait in a gloo barrier, which sleeps, so one start-up (torch import, gloo) serves
every R instead of one per R.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from csbp.runtime.calibration import microbench as mb
from csbp.runtime.memory.allocator import keep_freed_memory, resident_high_water

OP_CLASSES = ("gemm", "memory", "attention", "host")
# The shapes: one rank's share of the validation model's steps (2L = 1024-2048 positions over 2-4
# ranks: 256-1024 tokens), each class as the calibration fitted its alone figures on it.
GEMM_SHAPE = (1024, 256, 768)  # tokens x hidden x ffn: an nn.Linear forward + backward
GEMM_FLOP = 3 * 2.0 * GEMM_SHAPE[0] * GEMM_SHAPE[1] * GEMM_SHAPE[2]  # forward + 2 backward GEMMs
ELEMENTWISE_TOKENS = 1024
ATTENTION_CALL = (512, 256)  # L, queries against all 2L keys, BD3-LM mask (spread queries)
# ... and a call whose score matrix is 8 times larger (1024 queries x 2048 keys x 4 heads, fp32:
# 32 MiB, past any core's caches; the suite's largest call is 2048 x 2048): how ranks share the
# host depends on how much memory a call streams through (measured on the 2-core host: dp=2 at
# L = 1024 ran its 2048 x 2048 attention 28-37 % slower than the small call's curve said).
# Its own class in the measurement, `sized_classes` names what it measures at which size.
ATTENTION_LARGE_CALL = (1024, 1024)
SIZED = {"attention": ("attention", "attention-large")}  # class -> its measured classes, small to large
LARGE_WINDOW = 2.0  # x the window: a large call takes ~0.35 s alone, ~1.4 s with four ranks busy
WAKEUP_BYTES = 4096  # latency-bound: what is measured is the wake-up, not the wire


@dataclass(frozen=True)
class SharingJob:
    kind: str  # "sharing"
    world: int  # processes started: the most ranks measured at once
    port: int
    seconds: float = 1.0  # the window per op class and rank count
    rounds: int = 3  # passes over R = 1..world, in alternating order; the median per R is kept
    repeats: int = 5  # wake-ups: interleaved loops with and without the call
    calls: int = 8  # wake-ups: calls per loop
    pair_worlds: tuple[int, ...] = (2, 4)  # ranks on the host for the pairs' calls


@dataclass
class Sharing:
    """What one run measured: ranks busy -> op class -> each busy rank's calls per second;
    ranks on the host -> seconds a pair's call adds; the workers' resident set after importing
    torch."""

    rates: dict[int, dict[str, list[float]]]
    pair_calls: dict[int, float]
    baseline_rss_bytes: int


def class_steps() -> dict[str, tuple[Callable[[], object], bool]]:
    """Per op class (and attention again at a larger call, `SIZED`): (one call, run it cold:
    after `evict_caches`, as the calibration's alone figures were)."""
    from csbp.runtime.calibration.calibration_measurements import TINY_SEQ, tiny_spec
    from csbp.runtime.training.train import Job, Trainer
    from csbp.runtime.validation.validation_suite import BLOCK, VALIDATION_MODEL
    from csbp.simulator.plan.plan import Plan
    from csbp.simulator.workload.workload import Workload

    m, k, n = GEMM_SHAPE
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k, requires_grad=True)

    def linear() -> None:
        lin(x).sum().backward()

    L, queries = ATTENTION_CALL
    _, attention, _ = mb.bd3lm_call(VALIDATION_MODEL, L, BLOCK, queries, "spread")
    L, queries = ATTENTION_LARGE_CALL
    _, attention_large, _ = mb.bd3lm_call(VALIDATION_MODEL, L, BLOCK, queries, "spread")
    tiny = Workload(seq_len=TINY_SEQ, block_size=TINY_SEQ, dtype="fp32", zero_stage=0)
    trainer = Trainer(Job(tiny_spec(), tiny, Plan()), 0, torch.device("cpu"))
    return {"gemm": (linear, True),
            "memory": (mb.layer_elementwise_step(VALIDATION_MODEL, ELEMENTWISE_TOKENS), True),
            "attention": (attention, True),
            "attention-large": (attention_large, True),
            "host": (lambda: trainer.step(0), False)}


def calls_per_second(fn: Callable[[], object], cold: bool, until: float) -> float:
    """Calls per second of `fn` counting only calls that start and end before `until`
    (perf_counter); the rank keeps calling until then, so it stays busy for the whole window.
    A window shorter than one call (a very busy host) falls back on that one call's time."""
    spent, calls, first = 0.0, 0, None
    while True:
        if cold:
            mb.evict_caches()
        begin = time.perf_counter()
        if begin >= until and first is not None:
            break
        fn()
        end = time.perf_counter()
        first = first or end - begin
        if end <= until:
            spent, calls = spent + end - begin, calls + 1
    return calls / spent if calls else 1.0 / first


def _start(rank: int, job: SharingJob) -> None:
    torch.set_num_threads(1)  # a rank's regime
    keep_freed_memory()
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port}", rank=rank,
                            world_size=job.world)


def round_orders(world: int, rounds: int) -> list[list[int]]:
    """The order of R = 1..world in each round: forward, backward, forward, ... (ABBA).

    Why: the curve is a ratio to R = 1, and a host's speed drifts over the minute this takes (the
    2026-12-01 calibration's probe step: 204.7 ms as it began, 152.8 ms as it ended). Measured once
    in one order, R = 1 always came first, in the slow start, and every R > 1 looked faster
    relative to it than it was (two ranks at once 11 % faster per rank than one, at attention);
    alternating the order puts every R at the start and at the end alike, and the median per R
    over the rounds leaves a linear drift out of the ratios.
    """
    forward = list(range(1, world + 1))
    return [forward if i % 2 == 0 else forward[::-1] for i in range(max(1, rounds))]


def _speeds(rank: int, job: SharingJob) -> dict[int, dict[str, float]]:
    """This rank's calls per second of each class with R = 1..world ranks busy (median over
    `job.rounds` rounds in alternating order); a rank not among the R waits in the barrier
    (gloo's barrier sleeps: measured 3 ms of CPU over a 3 s wait)."""
    steps = class_steps()
    for fn, _ in steps.values():
        fn()  # warm-up: allocation, autograd graph
    seen: dict[int, dict[str, list[float]]] = {}
    for order in round_orders(job.world, job.rounds):
        for busy in order:
            for name, (fn, cold) in steps.items():
                dist.barrier()  # the busy ranks start the class together
                if rank < busy:
                    window = job.seconds * (LARGE_WINDOW if name.endswith("-large") else 1.0)
                    rate = calls_per_second(fn, cold, time.perf_counter() + window)
                    seen.setdefault(busy, {}).setdefault(name, []).append(rate)
    dist.barrier()
    return {busy: {name: statistics.median(rates) for name, rates in by.items()} for busy, by in seen.items()}


def _pair_calls(rank: int, job: SharingJob) -> dict[int, float]:
    """Per ranks on the host: the seconds a pair's small all-reduce adds to a loop of compute
    (rank 0's view; the loops end in a barrier, so every rank sees the same time)."""
    pairs = [dist.new_group([r, r + 1]) for r in range(0, job.world - 1, 2)]  # every rank makes every group
    group = pairs[rank // 2] if rank // 2 < len(pairs) else None
    buf = torch.ones(WAKEUP_BYTES // 4)
    a = torch.randn(512, 512)
    out = {}
    for on_host in job.pair_worlds:
        here = rank < on_host
        per_gemm = mb.median_time(lambda: a @ a, 20, warmup=3) if here else 0.0  # shared cores
        probe = torch.tensor([per_gemm])
        dist.all_reduce(probe, op=dist.ReduceOp.MAX)
        gemms = max(1, round(mb.GAP_S / float(probe)))

        def loop(call: bool) -> float:
            dist.barrier()
            start = time.perf_counter()
            if here:
                for _ in range(job.calls):
                    for _ in range(gemms):
                        a @ a
                    if call and group is not None:
                        dist.all_reduce(buf, group=group)
            dist.barrier()
            return time.perf_counter() - start

        loop(True)  # warm-up: connections
        timed = [(loop(True), loop(False)) for _ in range(job.repeats)]
        out[on_host] = statistics.median(w - wo for w, wo in timed) / job.calls
    return out


def _worker(rank: int, job: SharingJob, queue) -> None:
    try:
        rss = resident_high_water()  # after importing torch, before any model
        _start(rank, job)
        try:
            payload = {"rates": _speeds(rank, job), "pair_calls": _pair_calls(rank, job),
                       "baseline_rss_bytes": rss}
        finally:
            dist.destroy_process_group()
        queue.put((rank, payload))
    except Exception as err:  # reported to the parent, which fails the calibration
        queue.put((rank, f"{type(err).__name__}: {err}"))


def measure_sharing(most: int, seconds: float = 1.0, repeats: int = 5,
                    timeout_s: float = 300.0, rounds: int = 3) -> Sharing:
    """Every op class with 1..`most` ranks busy at once (`rounds` passes in alternating order),
    and a pair's call with each even number of ranks up to `most` on the host, in one set of
    `most` spawned processes."""
    job = SharingJob("sharing", most, mb._free_port(), seconds=seconds, rounds=rounds, repeats=repeats,
                     pair_worlds=tuple(w for w in range(2, most + 1, 2)))
    results = mb._run_workers(job, timeout_s, target=_worker)
    measured = OP_CLASSES + tuple(c for classes in SIZED.values() for c in classes if c not in OP_CLASSES)
    rates = {busy: {c: [results[r]["rates"][busy][c] for r in range(busy)] for c in measured}
             for busy in range(1, most + 1)}
    return Sharing(rates, results[0]["pair_calls"], max(r["baseline_rss_bytes"] for r in results))


def call_elements(call: tuple[int, int]) -> float:
    """Score-matrix elements of one measured attention call (queries x 2L keys x heads): the
    size unit its sharing curve is kept at (`hardware.SIZE_UNITS`)."""
    from csbp.runtime.validation.validation_suite import VALIDATION_MODEL

    L, queries = call
    return float(queries * 2 * L * VALIDATION_MODEL.layers[0].n_heads)
