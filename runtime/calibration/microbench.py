"""Microbenchmarks of this host: GEMMs, memory-bound ops, core sharing, collectives.

Each function returns raw timings (seconds per call, median over repeats), no fitting: that is
`calibrate`'s job. Multi-process benchmarks run in spawned workers joined with a timeout, so a
stuck collective fails the calibration instead of hanging it.
"""

from __future__ import annotations

import socket
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from csbp.runtime.memory.allocator import keep_freed_memory, resident_high_water

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
GAP_S = 0.03  # compute before each timed collective: a layer's share of a validation step


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1, cold: bool = False) -> float:
    """Median wall time of `fn()` in seconds over `repeats` calls after `warmup` calls;
    `cold`: each call after `evict_caches()`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cold:
            evict_caches()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def op_seconds(fn: Callable[[], object], budget_s: float, lo: int = 3, cold: bool = True) -> float:
    """Median seconds of `fn()`, repeated as often as `budget_s` of its own time allows; `cold`
    (default): as a training step meets it, every call after `evict_caches()`."""
    first = median_time(fn, 1, cold=cold)
    return median_time(fn, repeats_for(first, budget_s, lo, hi=50 if cold else 200), cold=cold)


def private_cache_bytes() -> int:
    """Bytes of a core's own largest cache (L2 on current x86 hosts, from sysfs; 2 MiB if the
    host does not say)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            shared = (index / "shared_cpu_list").read_text().strip()
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        if "," not in shared and "-" not in shared and text.endswith("K"):  # this core's alone
            best = max(best, int(text[:-1]) * 1024)
    return best or 2 * 1024**2


_EVICT: list[torch.Tensor] = []


def evict_caches() -> None:
    """Overwrite four times a core's private cache, so the next op finds none of its data there.

    In a training step every op follows other ops that filled the cache with their own data; a
    microbenchmark repeating one op back to back finds its inputs and outputs still cached.
    Measured on this host: explicit attention on 512 x 512 and 512 x 1024 score tiles (4-8 MiB
    against a 2 MiB L2) takes 6-14 % longer cold, which a validation run sees in every step.
    """
    if not _EVICT:
        _EVICT.append(torch.empty(4 * private_cache_bytes() // 4))
    _EVICT[0].fill_(1.0)


def repeats_for(seconds_per_call: float, budget_s: float, lo: int = 3, hi: int = 200) -> int:
    """How many repeats fit a time budget, at least `lo` (for a median) and at most `hi`."""
    return max(lo, min(hi, int(budget_s / max(seconds_per_call, 1e-7))))


def gemm_seconds(m: int, k: int, n: int, dtype: torch.dtype, budget_s: float = 0.3,
                 device: str = "cpu") -> float:
    """Seconds for one (m x k) @ (k x n) product."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    return op_seconds(lambda: a @ b, budget_s, cold=False)  # the peak: data in cache


def copy_seconds(n_bytes: int, budget_s: float = 0.3) -> float:
    """Seconds to copy `n_bytes` between two preallocated fp32 tensors (read + write)."""
    src = torch.randn(n_bytes // 4)
    dst = torch.empty_like(src)
    return op_seconds(lambda: dst.copy_(src), budget_s, cold=False)  # 128 MiB: no cache holds it


def layer_elementwise_seconds(spec, tokens: int, budget_s: float = 0.3) -> float:
    """Seconds of one layer's memory-bound ops as the runtime trains them under full
    checkpointing (forward without grad, forward again recording autograd, backward): two
    RMSNorms, RoPE on q and k, two residual adds and SwiGLU's silu(gate) * up, eager, each op
    its own pass over memory (the step graph prices them as fused)."""
    return op_seconds(layer_elementwise_step(spec, tokens), budget_s, lo=5)


def layer_elementwise_step(spec, tokens: int) -> Callable[[], None]:
    """One call of a layer's memory-bound ops as `layer_elementwise_seconds` times them."""
    from csbp.runtime.models.model import RMSNorm, apply_rope, rope_tables

    a, h = spec.layers[0], spec.hidden

    def act(*shape: int) -> torch.Tensor:
        return torch.randn(1, tokens, *shape, requires_grad=True)

    x, attn_out, mlp_out = act(h), act(h), act(h)
    q, k = act(a.n_heads, a.head_dim), act(a.n_kv_heads, a.head_dim)
    gate, up = act(spec.ffn), act(spec.ffn)
    norms = RMSNorm(h), RMSNorm(h)
    cos, sin = rope_tables(torch.arange(tokens), a.head_dim)

    def forward() -> list[torch.Tensor]:
        mid = x + attn_out
        return [norms[0](x), apply_rope(q, cos, sin), apply_rope(k, cos, sin), norms[1](mid),
                torch.nn.functional.silu(gate) * up, mid + mlp_out]

    def train() -> None:
        with torch.no_grad():
            forward()
        outs = forward()
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return train


def attention_flop(queries: int, keys: int, head_dim: int, heads: int) -> float:
    """Forward FLOP of one dense tile: QK^T and PV, 2 FLOP per multiply-add."""
    return 4.0 * queries * keys * head_dim * heads


def _tile(spec, tile: int):
    """Grouped q [1, Hkv, G, tile, D] and k, v [1, Hkv, tile, D] of the model's first layer."""
    a = spec.layers[0]
    g = a.n_heads // a.n_kv_heads
    q = torch.randn(1, a.n_kv_heads, g, tile, a.head_dim, requires_grad=True)
    k = torch.randn(1, a.n_kv_heads, tile, a.head_dim, requires_grad=True)
    v = torch.randn(1, a.n_kv_heads, tile, a.head_dim, requires_grad=True)
    return q, k, v, a.head_dim ** -0.5


def attention_tile_seconds(spec, tile: int, allowed: torch.Tensor, budget_s: float,
                           grad_forward: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of the runtime's attention on one tile x tile block.

    Forward is `attention_with_lse` as the runtime calls it (`grad_forward`: recording autograd,
    as a training step does); backward is autograd through it, timed as forward + backward minus
    forward.
    """
    from csbp.runtime.models.attention import attention_with_lse

    q, k, v, scale = _tile(spec, tile)
    fwd = lambda: attention_with_lse(q, k, v, allowed, scale)  # noqa: E731

    def both() -> None:
        out, _ = attention_with_lse(q, k, v, allowed, scale)
        out.sum().backward()

    with torch.set_grad_enabled(grad_forward):
        t_fwd = op_seconds(fwd, budget_s / 3)
    t_both = op_seconds(both, budget_s)
    return t_fwd, max(t_both - t_fwd, 1e-9)


def attention_points(spec, tiles: Sequence[int], budget_s: float) -> list[tuple]:
    """(tile, head_dim, backward, FLOP, seconds) for full (unmasked) square tiles."""
    a = spec.layers[0]
    out = []
    for tile in tiles:
        allowed = torch.ones(tile, tile, dtype=torch.bool)
        fwd, bwd = attention_tile_seconds(spec, tile, allowed, budget_s)
        flop = attention_flop(tile, tile, a.head_dim, a.n_heads)
        out += [(tile, a.head_dim, False, flop, fwd), (tile, a.head_dim, True, 2.5 * flop, bwd)]
    return out


def masked_tile_seconds(spec, tile: int, block: int, budget_s: float) -> tuple[float, float]:
    """(full, BD3-LM-masked) forward + backward seconds of one tile of the whole 2L sequence."""
    from csbp.simulator.layout.mask import visible

    pos = torch.arange(tile)
    masked = visible(pos[:, None], pos[None, :], tile // 2, block)
    full = torch.ones(tile, tile, dtype=torch.bool)
    return tuple(sum(attention_tile_seconds(spec, tile, m, budget_s)) for m in (full, masked))


def linear_seconds(m: int, k: int, n: int, budget_s: float = 0.3) -> tuple[float, float]:
    """(forward, backward) seconds of one `nn.Linear(k, n)` on m tokens, as the runtime trains it.

    Backward is autograd's input and weight gradients (two GEMMs, transposed operands, the
    weight gradient accumulated into .grad), timed as forward + backward minus forward.
    """
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k, requires_grad=True)
    fwd = lambda: lin(x)  # noqa: E731

    def both() -> None:
        lin(x).sum().backward()

    t_fwd = op_seconds(fwd, budget_s / 3)
    t_both = op_seconds(both, budget_s)
    return t_fwd, max(t_both - t_fwd, 1e-9)


def dense_attention_points(spec, tiles: Sequence[int], budget_s: float) -> list[tuple]:
    """(tile, visible, backward, dense FLOP, seconds) of the runtime's attention on square tiles
    whose scores are all visible and all masked: the two prices of a dense score."""
    a = spec.layers[0]
    out = []
    for tile in tiles:
        flop = attention_flop(tile, tile, a.head_dim, a.n_heads)
        for visible in (True, False):
            allowed = torch.full((tile, tile), visible, dtype=torch.bool)
            fwd, bwd = attention_tile_seconds(spec, tile, allowed, budget_s, grad_forward=True)
            out += [(tile, visible, False, flop, fwd), (tile, visible, True, 2.5 * flop, bwd)]
    return out


BD3LM_QUERY_SETS = ("spread", "early", "late")


def bd3lm_call_seconds(spec, seq_len: int, block: int, queries: int, where: str,
                       budget_s: float) -> tuple[float, float, float]:
    """(forward s, backward s, visible fraction) of one call of the runtime's attention as a rank
    makes it: `queries` positions of the 2L sequence against all 2L keys under the BD3-LM mask.

    `where` picks the queries: spread over the whole sequence, or the first or last half of the
    blocks of both halves, so calls of one size differ in how many of their scores are visible. Forward records
    autograd (as a training step does); backward is autograd through it, timed as forward +
    backward minus forward.
    """
    fwd, both, visible_share = bd3lm_call(spec, seq_len, block, queries, where)
    t_fwd = op_seconds(fwd, budget_s / 2, lo=5)
    t_both = op_seconds(both, budget_s, lo=5)
    return t_fwd, max(t_both - t_fwd, 1e-9), visible_share


def bd3lm_call(spec, seq_len: int, block: int, queries: int, where: str):
    """(forward, forward + backward, visible fraction) of one call of `bd3lm_call_seconds`."""
    from csbp.runtime.models.attention import attention_with_lse
    from csbp.simulator.layout.mask import visible

    a = spec.layers[0]
    g = a.n_heads // a.n_kv_heads
    keys = torch.arange(2 * seq_len)
    half = torch.linspace(0, seq_len // 2 - 1, queries // 2).round().long()
    pos = {"spread": torch.linspace(0, 2 * seq_len - 1, queries).round().long(),
           "early": torch.cat([half, half + seq_len]),  # first blocks: few visible keys
           "late": torch.cat([half + seq_len // 2, half + seq_len + seq_len // 2])}[where]
    allowed = visible(pos[:, None], keys[None, :], seq_len, block)
    q = torch.randn(1, a.n_kv_heads, g, queries, a.head_dim, requires_grad=True)
    k = torch.randn(1, a.n_kv_heads, 2 * seq_len, a.head_dim, requires_grad=True)
    v = torch.randn(1, a.n_kv_heads, 2 * seq_len, a.head_dim, requires_grad=True)
    scale = a.head_dim ** -0.5
    fwd = lambda: attention_with_lse(q, k, v, allowed, scale)  # noqa: E731

    def both() -> None:
        out, _ = attention_with_lse(q, k, v, allowed, scale)
        out.sum().backward()

    return fwd, both, float(allowed.float().mean())


def attention_peak_scores(spec, queries: int, keys: int, seq_len: int, block: int) -> float:
    """Peak resident growth of the runtime's attention on one call (forward, recompute forward,
    backward, three times), in score matrices of the call (queries x keys x heads, fp32)."""
    from csbp.runtime.memory.allocator import start_peak
    from csbp.runtime.models.attention import attention_with_lse
    from csbp.simulator.layout.mask import visible

    a = spec.layers[0]
    g = a.n_heads // a.n_kv_heads
    q = torch.randn(1, a.n_kv_heads, g, queries, a.head_dim, requires_grad=True)
    k = torch.randn(1, a.n_kv_heads, keys, a.head_dim, requires_grad=True)
    v = torch.randn(1, a.n_kv_heads, keys, a.head_dim, requires_grad=True)
    pos = torch.linspace(0, 2 * seq_len - 1, queries).round().long()
    allowed = visible(pos[:, None], torch.arange(keys)[None, :], seq_len, block)
    start_peak()
    base = resident_high_water()
    for _ in range(3):
        with torch.no_grad():
            attention_with_lse(q, k, v, allowed, a.head_dim ** -0.5)
        out, _ = attention_with_lse(q, k, v, allowed, a.head_dim ** -0.5)
        out.sum().backward()
    return (resident_high_water() - base) / (queries * keys * a.n_heads * 4)


PROBE_SEQ_LEN = 256


def probe_step_seconds(steps: int = 8) -> float:
    """Median seconds of the validation model's one-process training step at L = 256: the
    reference `csbp calibrate` records and `csbp validate` re-times to see how far the host's
    speed has moved in between (a shared VM's does, by several percent within minutes); it
    interleaves it between the suite's rounds to take that drift out of the errors."""
    from csbp.runtime.validation.validation_suite import BLOCK, VALIDATION_MODEL

    torch.set_num_threads(1)  # a rank's regime, wherever it runs
    keep_freed_memory()
    return tiny_step_seconds(VALIDATION_MODEL, PROBE_SEQ_LEN, BLOCK, steps)


def tiny_step_seconds(spec, seq_len: int, block: int, steps: int = 20) -> float:
    """Median seconds of one whole training step of the runtime (one process, all positions) at a
    context so short that arithmetic is negligible: the host overhead (Python, dispatch,
    autograd, allocation) of the step's ops."""
    from csbp.runtime.training.train import Job, Trainer
    from csbp.simulator.plan.plan import Plan
    from csbp.simulator.workload.workload import Workload

    job = Job(spec, Workload(seq_len=seq_len, block_size=min(block, seq_len), dtype="fp32", zero_stage=0), Plan())
    trainer = Trainer(job, 0, torch.device("cpu"))
    return median_time(lambda: trainer.step(0), steps, warmup=3)


def optimizer_seconds(spec, repeats: int = 10) -> tuple[int, float]:
    """(parameters, seconds) of one replicated AdamW step over the runtime's model, as it trains."""
    from csbp.runtime.models.model import BlockDiffusionLM
    from csbp.runtime.training.train import LEARNING_RATE

    model = BlockDiffusionLM(spec)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    return sum(p.numel() for p in model.parameters()), median_time(opt.step, repeats, warmup=2, cold=True)


def op_overhead_seconds(repeats: int = 2000) -> float:
    """Seconds of framework overhead per tiny op (dispatch, allocation): an 8-element add."""
    x = torch.ones(8)
    return median_time(lambda: x + x, repeats)


# ---- multi-process benchmarks ----------------------------------------------------------------

@dataclass(frozen=True)
class _Job:
    kind: str  # "collectives" | "step-load" (ranks sharing the host: rank_sharing.py)
    world: int
    port: int
    threads: int
    sizes: tuple[int, ...] = ()
    ops: tuple[str, ...] = ()
    repeats: int = 3
    calls: int = 8
    gap_s: float = 0.0
    gemm: int = 512
    seconds: float = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(job: _Job, timeout_s: float, target: Callable | None = None) -> list[dict]:
    """Start `job.world` spawned workers (`target(rank, job, queue)`, default `_worker`), return
    each rank's result; kill them all on timeout."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=target or _worker, args=(rank, job, queue), daemon=True)
             for rank in range(job.world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    results: dict[int, dict] = {}
    try:
        while len(results) < job.world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{job.kind} benchmark at world size {job.world} did not finish "
                                   f"in {timeout_s:.0f} s")
            if not queue.empty():
                rank, payload = queue.get()
                if isinstance(payload, str):
                    raise RuntimeError(f"{job.kind} benchmark, rank {rank}: {payload}")
                results[rank] = payload
            elif any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"{job.kind} benchmark: a worker exited with code "
                                   f"{next(p.exitcode for p in procs if p.exitcode not in (None, 0))}")
            else:
                time.sleep(0.01)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(job.world)]


def _worker(rank: int, job: _Job, queue) -> None:
    torch.set_num_threads(job.threads)
    keep_freed_memory()
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated collective names
    try:
        if job.kind == "step-load":
            payload = _step_load(job)
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port}",
                                    rank=rank, world_size=job.world)
            try:
                payload = _collectives(rank, job)
            finally:
                dist.destroy_process_group()
        queue.put((rank, payload))
    except Exception as err:  # reported to the parent, which fails the calibration
        queue.put((rank, f"{type(err).__name__}: {err}"))


def _step_load(job: _Job) -> float:
    """Median seconds of the validation model's one-process training step at L = `job.gemm`,
    stepping for `job.seconds` while the other processes of the job do the same."""
    from csbp.runtime.training.train import Job, Trainer
    from csbp.runtime.validation.validation_suite import BLOCK, VALIDATION_MODEL
    from csbp.simulator.plan.plan import Plan
    from csbp.simulator.workload.workload import Workload

    w = Workload(seq_len=job.gemm, block_size=BLOCK, dtype="fp32", zero_stage=0)
    trainer = Trainer(Job(VALIDATION_MODEL, w, Plan()), 0, torch.device("cpu"))
    trainer.step(0)
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < job.seconds or len(times) < 3:
        begin = time.perf_counter()
        trainer.step(1)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def _collective_call(op: str, n_bytes: int, rank: int, world: int) -> Callable[[], object]:
    """One call of the runtime's comm layer over a buffer of `n_bytes` (the whole, fp32)."""
    from csbp.runtime.distributed.comm import Comm

    comm, group = Comm(), dist.group.WORLD
    n = max(world, n_bytes // 4 // world * world)
    full, chunk = torch.ones(n), torch.ones(n // world)
    if op == "all_gather":
        return lambda: comm.all_gather(chunk, group, "other")
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(full, group, "other")
    if op == "all_reduce":
        return lambda: comm.all_reduce(full, "other", group)
    if op == "all_to_all":
        splits = [n // world] * world
        return lambda: comm.all_to_all(full, splits, splits, rank, group, "other")
    if op == "send_recv":  # every rank sends `n_bytes` to its right neighbour (one ring hop)
        right, left = (rank + 1) % world, (rank - 1) % world
        msg = torch.ones(n_bytes // 4)
        return lambda: comm.send_recv({right: msg}, {left: msg.numel()}, msg, "other")
    raise ValueError(f"unknown collective {op!r}")


def _collectives(rank: int, job: _Job) -> dict:
    """Per (op, size): the wall time one call adds to a loop of compute, on this rank.

    The runtime calls its collectives between layers of compute, so that is how they are timed:
    loops of `job.calls` x (`job.gap_s` of GEMMs, the same work on every rank, then the call)
    against the same loops without the call, interleaved `job.repeats` times; the call's cost is
    the median difference per call. It includes what a call costs there and nowhere else: gloo's
    threads waking after the compute (512 KiB at world size 2: 0.6 ms back to back, 1.5-2 ms
    after 50 ms of compute), ranks waiting for a core to finish it when they outnumber the
    cores, and every rank waiting for the slowest one's compute, whose time varies a little
    from call to call.
    """
    a = torch.randn(job.gemm, job.gemm)
    per_gemm = median_time(lambda: a @ a, 20, warmup=3)  # all ranks at once: shared cores
    probe = torch.tensor([per_gemm])
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)  # the same GEMM count on every rank
    gemms = max(1, round(job.gap_s / float(probe)))

    def loop(call: Callable[[], object] | None) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(job.calls):
            for _ in range(gemms):
                a @ a
            if call is not None:
                call()
        dist.barrier()
        return time.perf_counter() - start

    out = {}
    for n_bytes in job.sizes:
        for op in job.ops:
            call = _collective_call(op, n_bytes, rank, job.world)
            call()  # warm-up: allocation, connection set-up
            pairs = [(loop(call), loop(None)) for _ in range(job.repeats)]
            out[(op, n_bytes)] = statistics.median(w - wo for w, wo in pairs) / job.calls
    return out


def collective_seconds(world: int, sizes: Sequence[int], ops: Sequence[str] = COLLECTIVES,
                       threads: int = 1, repeats: int = 3, calls: int = 8, gap_s: float = GAP_S,
                       timeout_s: float = 300.0) -> dict[tuple[str, int], float]:
    """Seconds one call of each collective of the runtime's comm layer (gloo) and size adds to
    a loop of `gap_s` compute per call (see `_collectives`), as rank 0 measured it (the loops
    end in a barrier, so every rank sees the same time)."""
    job = _Job("collectives", world, _free_port(), threads, tuple(sizes), tuple(ops),
               repeats=repeats, calls=calls, gap_s=gap_s)
    first = _run_workers(job, timeout_s)[0]
    return {key: max(seconds, 1e-6) for key, seconds in first.items()}


def step_seconds_under_load(procs: int, seq_len: int = 256, seconds: float = 4.0,
                            timeout_s: float = 120.0) -> float:
    """Median over `procs` processes training the validation model at once (one process each,
    no communication) of their median step time: how ranks fare when they share cores."""
    job = _Job("step-load", procs, 0, 1, gemm=seq_len, seconds=seconds)
    return statistics.median(_run_workers(job, timeout_s))
