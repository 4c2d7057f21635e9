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
ELEMENTWISE_TOKENS = 1024
ATTENTION_CALL = (512, 256)  # L, queries against all 2L keys, BD3-LM mask (spread queries)
WAKEUP_BYTES = 4096  # latency-bound: what is measured is the wake-up, not the wire


@dataclass(frozen=True)
class SharingJob:
    kind: str  # "rank-speed" | "wakeup"
    world: int
    port: int
    seconds: float = 1.0  # rank-speed: the window per class
    repeats: int = 5  # wakeup: interleaved loops with and without the call
    calls: int = 8  # wakeup: calls per loop


def class_steps() -> dict[str, tuple[Callable[[], object], bool, float]]:
    """Per op class: (one call, run it cold (after `evict_caches`, as the calibration's alone
    figures were), FLOP of one call (0: not arithmetic))."""
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
    tiny = Workload(seq_len=TINY_SEQ, block_size=TINY_SEQ, dtype="fp32", zero_stage=0)
    trainer = Trainer(Job(tiny_spec(), tiny, Plan()), 0, torch.device("cpu"))
    return {"gemm": (linear, True, 3 * 2.0 * m * k * n),
            "memory": (mb.layer_elementwise_step(VALIDATION_MODEL, ELEMENTWISE_TOKENS), True, 0.0),
            "attention": (attention, True, 0.0),
            "host": (lambda: trainer.step(0), False, 0.0)}


def calls_per_second(fn: Callable[[], object], cold: bool, until: float) -> float:
    """Calls per second of `fn` counting only calls that start and end before `until`
    (perf_counter); the rank keeps calling until then, so it stays busy for the whole window."""
    spent, calls = 0.0, 0
    while True:
        if cold:
            mb.evict_caches()
        begin = time.perf_counter()
        if begin >= until:
            break
        fn()
        end = time.perf_counter()
        if end <= until:
            spent, calls = spent + end - begin, calls + 1
    if calls == 0:
        raise RuntimeError(f"no call finished inside the {until:.1f} s window: lengthen it")
    return calls / spent


def _start(rank: int, job: SharingJob) -> None:
    torch.set_num_threads(1)  # a rank's regime
    keep_freed_memory()
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port}", rank=rank,
                            world_size=job.world)


def _speed_worker(rank: int, job: SharingJob, queue) -> None:
    try:
        rss = resident_high_water()  # after importing torch, before any model
        _start(rank, job)
        try:
            steps = class_steps()
            for fn, _, _ in steps.values():
                fn()  # warm-up: allocation, autograd graph
            rates, flop = {}, {}
            for name, (fn, cold, f) in steps.items():
                dist.barrier()  # every rank starts the class together
                rates[name] = calls_per_second(fn, cold, time.perf_counter() + job.seconds)
                flop[name] = f
            dist.barrier()
        finally:
            dist.destroy_process_group()
        queue.put((rank, {"calls_per_s": rates, "flop_per_call": flop, "baseline_rss_bytes": rss}))
    except Exception as err:  # reported to the parent, which fails the calibration
        queue.put((rank, f"{type(err).__name__}: {err}"))


def rank_speeds(procs: int, seconds: float = 1.0, timeout_s: float = 180.0) -> list[dict]:
    """Per process of `procs` running each op class at once: {calls_per_s: {class: rate},
    flop_per_call, baseline_rss_bytes}."""
    job = SharingJob("rank-speed", procs, mb._free_port(), seconds=seconds)
    return mb._run_workers(job, timeout_s, target=_speed_worker)


def _wakeup_worker(rank: int, job: SharingJob, queue) -> None:
    try:
        _start(rank, job)
        try:
            pairs = [dist.new_group([r, r + 1]) for r in range(0, job.world - 1, 2)]  # every rank makes every group
            group = pairs[rank // 2] if rank // 2 < len(pairs) else None
            buf = torch.ones(WAKEUP_BYTES // 4)
            a = torch.randn(512, 512)
            probe = torch.tensor([mb.median_time(lambda: a @ a, 20, warmup=3)])  # at once: shared cores
            dist.all_reduce(probe, op=dist.ReduceOp.MAX)
            gemms = max(1, round(mb.GAP_S / float(probe)))

            def loop(call: bool) -> float:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(job.calls):
                    for _ in range(gemms):
                        a @ a
                    if call and group is not None:
                        dist.all_reduce(buf, group=group)
                dist.barrier()
                return time.perf_counter() - start

            loop(True)  # warm-up: connections
            pairs_timed = [(loop(True), loop(False)) for _ in range(job.repeats)]
        finally:
            dist.destroy_process_group()
        queue.put((rank, statistics.median(w - wo for w, wo in pairs_timed) / job.calls))
    except Exception as err:
        queue.put((rank, f"{type(err).__name__}: {err}"))


def pair_call_seconds(world: int, repeats: int = 5, calls: int = 8, timeout_s: float = 180.0) -> float:
    """Seconds a 4 KiB all-reduce over a pair of ranks adds to a loop of `microbench.GAP_S` of
    compute per call, with `world` ranks on the host (every pair a group), as rank 0 saw it."""
    job = SharingJob("wakeup", world, mb._free_port(), repeats=repeats, calls=calls)
    return mb._run_workers(job, timeout_s, target=_wakeup_worker)[0]
