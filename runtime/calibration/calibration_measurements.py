"""What `csbp calibrate` measures on this host, and the record of one run of it.

The microbenchmarks (`runtime.microbench`) run with the runtime's own threading (one thread per
rank on CPU) at the shapes the validation suite's ranks make, so every figure fitted from them
describes the ops a training step of those plans meets; `Measurements` keeps the raw timings,
which the fits (`profile_fit`, `collective_fit`, `attention_fit`) turn into a profile.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from csbp.runtime.calibration.fit_figures import KIB, MIB
from csbp.runtime.calibration.host_identity import HostIdentity, loadavg, this_host
from csbp.runtime.validation.validation_suite import BLOCK, PLANS, VALIDATION_MODEL

COLLECTIVE_SIZES = (4 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
QUICK_COLLECTIVE_SIZES = (4 * KIB, 1 * MIB, 16 * MIB)
# Attention calls measured: (L, query counts) against all 2L keys, the sizes the validation plans
# make (a rank's share of the 2L positions), each with three query sets (different masks).
DENSE_CALLS = {False: ((512, (256, 512, 768, 1024)), (1024, (256, 512, 1024, 1536, 2048))),
               True: ((512, (256, 1024)),)}
# Tokens per rank of the validation plans (L = 512-1024 over 1-4 ranks, 2L positions each)
ELEMENTWISE_TOKENS = (512, 1024, 2048)
# Host overhead: the validation model's layer structure at widths where arithmetic vanishes.
TINY_SEQ = 32
TINY_SPEC_TEXT = "the validation model's layers at hidden 32, 4 heads of 8, L = 32"
# The stages `measure` runs, in order, the reference probe timed before each and at the end
# (`reference_speed` reads each stage against the two probes around it).
STAGES = ("GEMMs", "attention tiles", "memory-bound ops", "core sharing",
          "collectives, world size 2", "collectives, world size 4")


def tiny_spec():
    """The validation model's layer structure at widths where arithmetic vanishes."""
    from csbp.simulator.workload.spec import AttentionSpec

    layers = tuple(AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=8) for _ in VALIDATION_MODEL.layers)
    return VALIDATION_MODEL.model_copy(update={"name": "tiny-overhead", "hidden": 32, "ffn": 32,
                                               "vocab": 64, "layers": layers})


@dataclass
class Measurements:
    """Raw results of one calibration run (seconds, bytes, FLOP)."""

    identity: HostIdentity  # host, CPU, cores, torch and day: what the figures are true of
    load: str  # /proc/loadavg before and after: other work on the host adds noise
    threads: int
    memory_bytes: int
    baseline_rss_bytes: int
    gemm: list[tuple[int, int, int, float]]  # (m, k, n, seconds)
    attention: list[tuple[int, int, bool, float, float]]  # (tile, head_dim, backward, flop, s)
    masked_attention: tuple[float, float]  # (seconds full tile, seconds BD3-LM-masked tile)
    copy: tuple[int, float]  # (bytes read + written, seconds)
    layer_elementwise: list[tuple[int, float]]  # (tokens, seconds of a layer's memory-bound ops)
    op_overhead_s: float
    gemm_load: dict[int, list[float]]  # processes -> FLOP/s each got (nn.Linear fwd + bwd)
    collectives: dict[int, dict[tuple[str, int], float]]  # world -> (op, bytes) -> seconds
    notes: list[str] = field(default_factory=list)
    # nn.Linear as the runtime trains it: (m, k, n, forward s, backward s)
    linear: list[tuple[int, int, int, float, float]] = field(default_factory=list)
    # the runtime's attention on BD3-LM-masked calls:
    # (queries, keys, query set, forward s, backward s, visible fraction)
    dense_attention: list[tuple[int, int, str, float, float, float]] = field(default_factory=list)
    # a whole runtime step at negligible arithmetic: (seconds, step-graph kernels it runs)
    tiny_step: tuple[float, int] | None = None
    optimizer: tuple[int, float] | None = None  # (parameters, seconds of one AdamW step)
    step_load: dict[int, float] = field(default_factory=dict)  # processes -> step seconds each
    probe: tuple[float, ...] | None = None  # reference step seconds, before each stage and at the end
    score_copies: list[tuple[int, int, float]] = field(default_factory=list)  # (q, keys, copies)
    # ranks busy at once -> op class -> calls per second each rank got (`rank_sharing`)
    rank_rates: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    # ranks on the host -> seconds a pair's small all-reduce adds to a loop of compute
    pair_calls: dict[int, float] = field(default_factory=dict)
    rank_window_s: float = 0.0  # seconds each op class ran at once in `rank_rates`


def gemm_shapes(hidden: int, widths: tuple[int, ...], tokens: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(m, k, n) of a layer's projections at each token count: x @ W and its transpose."""
    shapes = set()
    for m in tokens:
        for w in widths:
            shapes |= {(m, hidden, w), (m, w, hidden)}
    return sorted(shapes)


def mem_total() -> int:
    from csbp.runtime.memory.allocator import proc_bytes

    return proc_bytes("/proc/meminfo", "MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure(quick: bool, step: Callable[[str], None]) -> Measurements:
    """Run every microbenchmark; `step(label)` is called before each one (progress)."""
    import torch

    from csbp.runtime.calibration import microbench as mb
    from csbp.runtime.calibration.rank_sharing import GEMM_FLOP, measure_sharing
    from csbp.runtime.memory.allocator import keep_freed_memory
    from csbp.runtime.calibration.one_process_graph import step_kernels

    threads = 1
    torch.set_num_threads(threads)
    keep_freed_memory()  # the ranks' allocator regime (runtime/memory/allocator.py)
    identity = this_host()
    # the reference probe before every stage and at the end, its median recorded: on a shared
    # VM one probe at the start and one at the end read 204.7 and 152.8 ms in one calibration
    probes: list[float] = []
    announce = step

    def step(label: str) -> None:  # noqa: F811 - every stage starts with a probe
        probes.append(mb.probe_step_seconds())
        announce(label)

    load_before = loadavg()
    spec = VALIDATION_MODEL
    a = spec.layers[0]
    widths = (a.n_heads * a.head_dim, a.kv_width, spec.ffn, spec.vocab)
    tokens = (256, 1024, 4096) if quick else (128, 256, 512, 1024, 2048, 4096, 8192)
    budget = 0.05 if quick else 0.25
    step(STAGES[0])  # GEMMs
    gemm = [(m, k, n, mb.gemm_seconds(m, k, n, torch.float32, budget))
            for m, k, n in gemm_shapes(spec.hidden, widths, tokens)]
    linear = [(m, hidden, width, *mb.linear_seconds(m, hidden, width, budget))
              for m in tokens if m <= 4096 for hidden, width in
              sorted({(spec.hidden, w) for w in widths} | {(w, spec.hidden) for w in widths})]
    step(STAGES[1])  # attention tiles
    tiles = (128, 512, 2048) if quick else (128, 256, 512, 1024, 2048, 4096)
    attention = mb.attention_points(spec, tiles[:-1] if not quick else tiles, budget)
    masked = mb.masked_tile_seconds(spec, 1024, 64, budget)
    dense = [(q, 2 * L, where, *mb.bd3lm_call_seconds(spec, L, BLOCK, q, where, budget))
             for L, queries in DENSE_CALLS[quick] for q in queries for where in mb.BD3LM_QUERY_SETS]
    step(STAGES[2])  # memory-bound ops
    copy_bytes = 64 * MIB
    copy = (2 * copy_bytes, mb.copy_seconds(copy_bytes, budget))
    elementwise = [(n, mb.layer_elementwise_seconds(spec, n, budget)) for n in ELEMENTWISE_TOKENS]
    overhead = mb.op_overhead_seconds()
    score_copies = [(q, k, mb.attention_peak_scores(spec, q, k, k // 2, BLOCK))
                    for q, k in ((512, 1024), (1024, 1024), (1024, 2048))]
    tiny = mb.tiny_step_seconds(tiny_spec(), TINY_SEQ, TINY_SEQ, steps=10 if quick else 30)
    optimizer = mb.optimizer_seconds(spec)
    step(STAGES[3])  # core sharing
    # 2 s per class and rank count (3 rounds): with 1 s windows two calibrations an hour apart
    # read the two-rank memory-bound speed as 0.91 and 0.76, a spread the size of the biases
    # the curves are there to remove
    window = 0.4 if quick else 2.0
    # 1..the largest world csbp validate runs
    sharing = measure_sharing(max(PLANS), seconds=window, repeats=3 if quick else 5, rounds=1 if quick else 3)
    gemm_load = {busy: [rate * GEMM_FLOP for rate in rates["gemm"]] for busy, rates in sharing.rates.items()}
    cpus = identity.cpus
    step_load = {procs: mb.step_seconds_under_load(procs, seconds=1.0 if quick else 4.0)
                 for procs in (cpus, 2 * cpus)}
    collectives = {}
    for world in (2, 4):
        step(STAGES[4 if world == 2 else 5])  # collectives at this world size
        sizes = QUICK_COLLECTIVE_SIZES if quick else COLLECTIVE_SIZES
        collectives[world] = mb.collective_seconds(world, sizes, threads=threads,
                                                   repeats=1 if quick else 3, calls=4 if quick else 8)
    return Measurements(
        identity=identity, load=f"{load_before} -> {loadavg()}", threads=threads,
        memory_bytes=mem_total(),
        baseline_rss_bytes=sharing.baseline_rss_bytes, gemm=gemm, attention=attention, masked_attention=masked,
        copy=copy, layer_elementwise=elementwise, op_overhead_s=overhead, gemm_load=gemm_load,
        collectives=collectives, linear=linear, dense_attention=dense,
        tiny_step=(tiny, step_kernels(tiny_spec(), TINY_SEQ)), optimizer=optimizer,
        step_load=step_load, score_copies=score_copies, probe=(*probes, mb.probe_step_seconds()),
        rank_rates=sharing.rates, pair_calls=sharing.pair_calls, rank_window_s=window,
        notes=["Quick calibration: fewer sizes and repeats."] if quick else [])
