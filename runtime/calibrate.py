"""`csbp calibrate`: measure this host and write a `kind: measured` hardware profile.

Runs the microbenchmarks (`runtime.microbench`) with the runtime's own threading (one thread per
rank on CPU), then fits the profile's figures from first principles, each with a source that
names the measurement:

- compute: peak = the fastest GEMM; efficiency curves = measured rate / peak (GEMMs by GFLOP,
  attention tiles by length, using the runtime's attention code);
- memory-bound ops: copy bandwidth, and the fraction of it elementwise ops reach;
- core sharing: GEMM rate of 1, 2, 4 processes at once -> the cores ranks effectively share;
- gloo collectives (ring formulas for wire bytes and steps): latency and bus bandwidth per op at
  world size 2, the size-efficiency curve, and the wake-up latency per step once ranks outnumber
  cores (world size 4 on a 2-core host).

The fit never looks at a training step: validation (`csbp validate`) checks it against those.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from csbp.simulator.errors import InputError
from csbp.simulator.hardware import PROFILE_DIR, HardwareProfile, load_profile
from csbp.simulator.report import print_json

KIB, MIB, GIB = 1024, 1024**2, 1024**3
COLLECTIVE_SIZES = (4 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
QUICK_COLLECTIVE_SIZES = (4 * KIB, 1 * MIB, 16 * MIB)
GROUP_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# Attention calls measured: (L, query counts) against all 2L keys, the sizes the validation plans
# make (a rank's share of the 2L positions), each with three query sets (different masks).
DENSE_CALLS = {False: ((512, (256, 512, 768, 1024)), (1024, (256, 512, 1024, 1536, 2048))),
               True: ((512, (256, 1024)),)}
BLOCK = 32
# Tokens per rank of the validation plans (L = 512-1024 over 1-4 ranks, 2L positions each)
ELEMENTWISE_TOKENS = (512, 1024, 2048)
# Host overhead: the validation model's layer structure at widths where arithmetic vanishes.
TINY_SEQ = 32
TINY_SPEC_TEXT = "the validation model's layers at hidden 32, 4 heads of 8, L = 32"


def _tiny_spec():
    from csbp.runtime.validate import VALIDATION_MODEL
    from csbp.simulator.spec import AttentionSpec

    layers = tuple(AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=8) for _ in VALIDATION_MODEL.layers)
    return VALIDATION_MODEL.model_copy(update={"name": "tiny-overhead", "hidden": 32, "ffn": 32,
                                               "vocab": 64, "layers": layers})


@dataclass
class Measurements:
    """Raw results of one calibration run (seconds, bytes, FLOP)."""

    host: str
    cpu: str
    date: str
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
    gemm_load: dict[int, list[float]]  # processes -> FLOP/s each got
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
    probe: tuple[float, float] | None = None  # reference step seconds, start and end of the run
    score_copies: list[tuple[int, int, float]] = field(default_factory=list)  # (q, keys, copies)


# ---- collective model: the formulas the fit inverts --------------------------------------------

def wire_bytes(op: str, n_bytes: int, world: int) -> float:
    """Bytes one rank sends, and receives, for a buffer of `n_bytes` (ring algorithms; send/recv:
    the message): what the step graph counts as a member's received bytes."""
    if op == "send_recv":
        return n_bytes
    share = (world - 1) / world * n_bytes
    return 2 * share if op == "all_reduce" else share


def ring_steps(op: str, world: int) -> int:
    if op == "send_recv":
        return 1
    return 2 * (world - 1) if op == "all_reduce" else world - 1


def per_rank_bytes(op: str, n_bytes: int, world: int) -> float:
    """x of the size-efficiency curve: bytes each rank moves in one call."""
    return n_bytes if op == "send_recv" else n_bytes / world


def collective_seconds(profile: HardwareProfile, op: str, n_bytes: int, world: int,
                       measured: bool = True) -> float:
    """The simulator's price of one call over a buffer of `n_bytes` by `world` ranks of one host:
    the measured table where the profile has one (`measured`), else the alpha-beta model with the
    wake-up delay once ranks outnumber cores."""
    from csbp.simulator.cost import collective_seconds as price
    from csbp.simulator.graph import Comm, Group

    if not measured:
        profile = profile.model_copy(update={"links": profile.links.model_copy(update={
            "nvlink": profile.links.nvlink.model_copy(update={"call_seconds": None})})})
    collective = "p2p" if op == "send_recv" else op.replace("_", "-")
    group = Group(size=world, per_node=world, sync=((0,),))
    return price(Comm(collective, (wire_bytes(op, n_bytes, world),), group, "other"),
                 wire_bytes(op, n_bytes, world), profile.on_one_host(world))


# ---- fitting ------------------------------------------------------------------------------------

def _figure(value: Any, source: str) -> dict:
    return {"value": value, "source": source}


def _round(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def efficiency_curve(points: list[tuple[float, float]], per_decade: int = 3) -> list[list[float]]:
    """Median y per log-spaced bin of x: a curve for `interpolate` (x increasing, 0 < y <= 1)."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for x, y in points:
        bins.setdefault(math.floor(math.log10(x) * per_decade), []).append((x, y))
    curve = []
    for key in sorted(bins):
        xs, ys = zip(*bins[key])
        curve.append([_round(statistics.median(xs)), _round(min(1.0, max(1e-4, statistics.median(ys))))])
    return curve


def _fit_links(m: Measurements) -> tuple[dict, float, dict]:
    """Link figures from world size 2, the wake-up latency from world size 4."""
    from csbp.runtime.microbench import GAP_S

    two = m.collectives[2]
    sizes = sorted({s for _, s in two})
    small, large = sizes[0], sizes[-1]
    where = ("gloo over TCP loopback, world size 2, one thread per rank, the wall time each call "
             f"adds to a loop of {GAP_S * 1e3:.0f} ms of compute per call")
    # alpha-beta per op: latency from the smallest size, asymptote = the best bandwidth any
    # size reaches once latency is off (the size curve then says how far each size falls short)
    gbs, lat = {}, {}
    for op in (*GROUP_OPS, "send_recv"):
        latency = two[(op, small)]
        for _ in range(3):  # the smallest call's own wire time, refined with the bandwidth
            bandwidth = max(wire_bytes(op, s, 2) / (two[(op, s)] - latency) for s in sizes
                            if s != small and two[(op, s)] > latency)
            latency = max(1e-7, two[(op, small)] - wire_bytes(op, small, 2) / bandwidth)
        gbs[op], lat[op] = bandwidth / 1e9, latency
    # ring latency = call + steps x step: all-gather (1 step at n = 2) and all-reduce (2 steps)
    step = max(1e-7, (lat["all_reduce"] - lat["all_gather"])
               / (ring_steps("all_reduce", 2) - ring_steps("all_gather", 2)))
    call = max(1e-7, lat["all_gather"] - ring_steps("all_gather", 2) * step)
    p2p_latency = lat["send_recv"]
    # size efficiency: what fraction of its asymptote each op reaches per bytes-per-rank
    points = []
    for op in GROUP_OPS:
        latency = call + ring_steps(op, 2) * step
        for s in sizes:
            spent = max(1e-9, two[(op, s)] - latency)
            points.append((per_rank_bytes(op, s, 2), wire_bytes(op, s, 2) / (gbs[op] * 1e9) / spent))
    curve = efficiency_curve(points, per_decade=1)

    def t(op: str, s: int) -> str:
        return f"{two[(op, s)] * 1e6:.0f} us"

    link = {
        "call_seconds": _call_tables(m, GAP_S),
        "collective_gbs": _figure(_round(gbs["all_gather"]), f"measured ({where}): the runtime's Comm.all_gather "
                                  f"(all_gather_single) of {large // MIB} MiB in {t('all_gather', large)}, ring wire bytes "
                                  "(n-1)/n x buffer, latency subtracted"),
        "p2p_gbs": _figure(_round(gbs["send_recv"]), f"measured ({where}): batch_isend_irecv of "
                           f"{large // MIB} MiB to the ring neighbour in {t('send_recv', large)}"),
        "alltoall_gbs": _figure(_round(gbs["all_to_all"]), f"measured ({where}): all_to_all_single of "
                                f"{large // MIB} MiB in {t('all_to_all', large)}, wire bytes (n-1)/n x buffer"),
        "call_latency_us": _figure(_round(call * 1e6), f"measured ({where}): all_gather latency "
                                   f"({t('all_gather', small)} at {small // KIB} KiB less its wire time) "
                                   "minus one step"),
        "step_latency_us": _figure(_round(step * 1e6), f"measured ({where}): all_reduce latency "
                                   f"(2 steps; {t('all_reduce', small)} at {small // KIB} KiB) minus "
                                   "all_gather latency (1 step)"),
        "p2p_latency_us": _figure(_round(p2p_latency * 1e6), f"measured ({where}): send/recv "
                                  f"latency (alpha; {t('send_recv', small)} at {small // KIB} KiB)"),
        "size_efficiency": _figure(curve, f"measured ({where}): latency from the smallest size and "
                                   "the best bandwidth per op, then per bytes-per-rank bin, median over "
                                   "all_gather / reduce_scatter / all_reduce / all_to_all of (wire bytes / "
                                   "asymptotic bandwidth) / (time - latency), at "
                                   + ", ".join(f"{s // KIB} KiB" for s in sizes)),
        "all_reduce_gbs": _figure(_round(gbs["all_reduce"]), f"measured ({where}): all_reduce of "
                                  f"{large // MIB} MiB in {t('all_reduce', large)}, wire bytes 2(n-1)/n x buffer "
                                  "(includes the CPU reduction)"),
        "reduce_scatter_gbs": _figure(_round(gbs["reduce_scatter"]), f"measured ({where}): Comm.reduce_scatter "
                                      f"(reduce_scatter_single) of {large // MIB} MiB in {t('reduce_scatter', large)} against "
                                      f"{t('all_reduce', large)} for all_reduce: gloo has no native ring "
                                      "reduce-scatter (torch PR #118911 emulates it), so it is priced "
                                      "from its own measurement, with ring wire bytes (n-1)/n x buffer"),
    }
    # wake-up latency: world size 4 on fewer cores, small messages, minus the world-2 model
    wakeups, detail = [], []
    if 4 in m.collectives:
        four = m.collectives[4]
        small4 = min(s for _, s in four)
        for op in GROUP_OPS:
            base = call + ring_steps(op, 4) * step
            wakeups.append(four[(op, small4)] - base)
            detail.append(f"{op} {four[(op, small4)] * 1e6:.0f} us")
    wakeup = statistics.median(wakeups) if wakeups else None
    wake_fig = None
    if wakeup and wakeup > 0:
        wake_fig = _figure(_round(wakeup * 1e6), "measured (gloo, world size 4 on this host's cores, "
                           f"the wall time each call adds to a loop of {GAP_S * 1e3:.0f} ms of compute per call, "
                           f"{small4 // KIB} KiB): median over ops of time - world-2 latency model, per call; "
                           f"{', '.join(detail)}; send/recv shows no such delay")
    return link, wakeup or 0.0, {"wakeup_latency_us": wake_fig}


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators). A larger
    call never takes less time, so a dip is noise; pooling averages it with its neighbours
    instead of letting one slow small call set the floor for every size above it."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (a, n), (b, k) = blocks[-2], blocks.pop()
            blocks[-1] = [(a * n + b * k) / (n + k), n + k]
    return [mean for mean, count in blocks for _ in range(count)]


def _call_tables(m: Measurements, gap_s: float) -> dict:
    """Every measured call as the cost model reads it: by group size and op, seconds against the
    bytes each member receives, made non-decreasing."""
    tables: dict[int, dict[str, list]] = {}
    for world, measured in sorted(m.collectives.items()):
        for op in sorted({op for op, _ in measured}):
            sizes = sorted(s for o, s in measured if o == op)
            seconds = non_decreasing([measured[(op, s)] for s in sizes])
            tables.setdefault(world, {})[op] = [[_round(wire_bytes(op, s, world)), _round(t)]
                                                for s, t in zip(sizes, seconds)]
    sizes = sorted({s for table in m.collectives.values() for _, s in table})
    return _figure(tables, (
        f"measured: the runtime's Comm calls (gloo over TCP loopback, one thread per rank) at world "
        f"sizes {', '.join(map(str, sorted(m.collectives)))}, buffers "
        f"{', '.join(f'{s // KIB} KiB' for s in sizes)}: the wall time each call adds to a loop "
        f"of {gap_s * 1e3:.0f} ms of compute per call (as a training step calls them: wake-up, "
        "waiting for a core and for the slowest rank included), median of 3 x 8 calls; x = "
        "bytes each member receives; made non-decreasing over sizes (pool adjacent violators)"))


def _score_copies(m: Measurements) -> dict:
    if not m.score_copies:
        return {}
    return {"dense_score_copies": _figure(_round(statistics.median(c for *_, c in m.score_copies)), (
        "measured: peak resident growth of the runtime's attention_with_lse (forward, recompute, "
        "backward, keep-freed-memory allocator) over its queries x keys x heads fp32 score matrix, "
        "median of " + ", ".join(f"{q}x{k}: {c:.1f}" for q, k, c in m.score_copies)))}


def _probe(m: Measurements) -> dict:
    if m.probe is None:
        return {}
    start, end = m.probe
    return {"probe_step_s": _figure(_round((start + end) / 2), (
        "measured: the validation model's one-process training step at L = 256, median of 8, "
        f"{start * 1e3:.1f} ms as the calibration began and {end * 1e3:.1f} ms as it ended; "
        "csbp validate re-times it to report the host's drift since"))}


def _sharing(m: Measurements, cpus: int) -> dict:
    """How much of its cores / ranks share a rank gets with twice as many ranks as cores."""
    if cpus not in m.step_load or 2 * cpus not in m.step_load:
        return {}
    alone, shared = m.step_load[cpus], m.step_load[2 * cpus]
    return {"sharing_efficiency": _figure(_round(min(1.0, 2 * alone / shared)), (
        f"measured: the validation model's one-process training step (L = 256) in {cpus} "
        f"processes at once took {alone * 1e3:.1f} ms, in {2 * cpus} at once {shared * 1e3:.1f} ms "
        f"(ideal: twice as long): 2 x {alone * 1e3:.1f} / {shared * 1e3:.1f}"))}


def _op_overhead(m: Measurements) -> dict:
    """Host time per step-graph kernel: a whole runtime step at negligible arithmetic (eager
    PyTorch issues dozens of dispatched, autograd-recorded ops per kernel of the graph)."""
    if m.tiny_step is None:
        return _figure(_round(m.op_overhead_s * 1e6), "measured: median time of an 8-element add "
                       "(dispatch + allocation, no arithmetic to speak of)")
    seconds, kernels = m.tiny_step
    return _figure(_round(seconds / kernels * 1e6), (
        f"measured: one whole training step of the runtime (one process, {TINY_SPEC_TEXT}, full "
        f"checkpointing, AdamW) in {seconds * 1e3:.2f} ms, over the {kernels} kernels its step "
        f"graph counts: host time (Python, dispatch, autograd, allocation) per kernel; an "
        f"8-element add alone takes {m.op_overhead_s * 1e6:.2f} us"))


def one_process_graph(spec, seq_len: int, block: int):
    """The step graph of `spec` trained by one process (fp32, full checkpointing)."""
    from csbp.simulator.graph import StepGraph
    from csbp.simulator.layout import Layout
    from csbp.simulator.plan import Plan
    from csbp.simulator.workload import Workload

    w = Workload(seq_len=seq_len, block_size=block, dtype="fp32", zero_stage=0)
    return StepGraph.build(spec, w, Plan(), Layout.build(w, Plan()), 1)


def _graph_ops(spec, seq_len: int, names: tuple[str, ...], layer: int | None) -> tuple[float, int]:
    """(bytes, kernels) the step graph gives the ops called `names` of `layer` in a one-process
    step (every phase: forward, recompute, backward)."""
    ops = [op for op in one_process_graph(spec, seq_len, BLOCK).ops
           if op.name in names and op.layer == layer]
    return sum(op.work.bytes[0] for op in ops), sum(op.work.kernels for op in ops)


def _memory_bound(m: Measurements, copy_gbs: float) -> dict:
    """Fractions of the copy bandwidth the runtime's memory-bound ops reach, against the bytes
    the step graph counts for them (host time per kernel taken off first).

    The graph counts fused kernels (one pass per RMSNorm, one per RoPE); eager PyTorch makes a
    pass per op (pow, mean, rsqrt, two multiplies for one RMSNorm) and AdamW's foreach update a
    pass per term, so the measured fraction is well below a single copy's.
    """
    from csbp.runtime.validate import VALIDATION_MODEL

    spec, overhead = VALIDATION_MODEL, _op_overhead(m)["value"] * 1e-6
    names = ("norm-rope", "norm-swiglu", "norm-rope-bwd", "norm-swiglu-bwd")
    fractions = []
    for tokens, seconds in m.layer_elementwise:
        nbytes, kernels = _graph_ops(spec, tokens // 2, names, 0)
        fractions.append(nbytes / (copy_gbs * 1e9 * max(seconds - kernels * overhead, 1e-9)))
    out = {"hbm_efficiency": _figure(_round(min(1.0, statistics.median(fractions))), (
        "measured: one layer's memory-bound ops as the runtime trains them (2 RMSNorms, RoPE on q "
        "and k, 2 residual adds, silu(gate) * up; forward, recompute, backward) at "
        + ", ".join(f"{n} tokens {s * 1e3:.1f} ms ({f:.2f})" for (n, s), f in zip(m.layer_elementwise, fractions))
        + f": the step graph's bytes for them / time / copy bandwidth {copy_gbs:.2f} GB/s, median; "
        "eager ops each make their own pass, the graph counts fused ones"))}
    if m.optimizer:
        params, seconds = m.optimizer
        nbytes, kernels = _graph_ops(spec, min(n for n, _ in m.layer_elementwise) // 2, ("adamw",), None)
        fraction = nbytes / (copy_gbs * 1e9 * max(seconds - kernels * overhead, 1e-9))
        out["optimizer_efficiency"] = _figure(_round(min(1.0, fraction)), (
            f"measured: torch.optim.AdamW step (foreach, fp32) over the validation model's "
            f"{params:,} parameters in {seconds * 1e3:.2f} ms: the step graph's bytes for it / time "
            f"/ copy bandwidth {copy_gbs:.2f} GB/s"))
    return out


def _dense_curves(m: Measurements, peak: float) -> dict:
    """Visible and masked score efficiencies of the runtime's explicit attention, by call GFLOP.

    Calls of one size (queries x keys) differ only in their mask: time = visible dense FLOP /
    (peak x e_visible) + masked dense FLOP / (peak x e_masked), solved by least squares over
    the query sets of each size.
    """
    if not m.dense_attention:
        return {}
    import numpy as np

    from csbp.runtime.validate import VALIDATION_MODEL

    a = VALIDATION_MODEL.layers[0]
    sizes = sorted({(q, k) for q, k, *_ in m.dense_attention}, key=lambda s: s[0] * s[1])
    curves: dict[tuple[str, str], list] = {}
    for backward, direction in ((False, "forward"), (True, "backward")):
        for q, k in sizes:
            rows = [r for r in m.dense_attention if (r[0], r[1]) == (q, k)]
            dense = 4.0 * q * k * a.head_dim * a.n_heads * (2.5 if backward else 1.0)
            A = np.array([[frac * dense, (1 - frac) * dense] for *_, frac in rows])
            t = np.array([r[4] if backward else r[3] for r in rows])
            (cv, cm), *_ = np.linalg.lstsq(A, t, rcond=None)
            if cv <= 0 or cm <= 0:  # masks too alike to separate: one price for both
                cv = cm = float(t.sum() / A.sum())
            curves.setdefault(("visible", direction), []).append((dense / 1e9, 1 / (cv * peak)))
            curves.setdefault(("masked", direction), []).append((dense / 1e9, 1 / (cm * peak)))
    shapes = ", ".join(f"{q}x{k}" for q, k in sizes)
    out = {}
    for (kind, direction), pts in curves.items():
        by_x: dict[float, list[float]] = {}
        for x, y in pts:  # shapes of one size (512 x 2048, 1024 x 1024): one point
            by_x.setdefault(_round(x), []).append(y)
        out[f"dense_{kind}_{direction}_efficiency"] = _figure(
            [[x, _round(min(1.0, max(1e-4, statistics.mean(ys))))] for x, ys in sorted(by_x.items())], (
                f"measured: the runtime's attention_with_lse {direction} "
                f"({'autograd, as a training step runs it' if direction == 'backward' else 'recording autograd'}) "
                f"on BD3-LM-masked calls of queries x keys {shapes} (L = keys / 2, block {BLOCK}), three "
                "query sets per size (spread, early blocks, late blocks: different visible shares); per "
                "size, least squares of time = visible / (peak x e_visible) + masked / (peak x "
                "e_masked) over dense FLOP (4 x q x k x head_dim x heads"
                f"{', x 2.5 backward' if direction == 'backward' else ''}); {kind} scores"
                f"{' (-inf: exp leaves its vectorised fast path)' if kind == 'masked' else ''}"))
    return out


def dense_attention_check(profile: HardwareProfile, m: Measurements) -> list[dict]:
    """Every measured attention call vs the visible/masked pricing (the mechanism's check)."""
    from csbp.runtime.validate import VALIDATION_MODEL

    a = VALIDATION_MODEL.layers[0]
    rows = []
    for queries, keys, where, tf, tb, frac in m.dense_attention:
        dense = 4.0 * queries * keys * a.head_dim * a.n_heads
        for backward, measured in ((False, tf), (True, tb)):
            x = dense * (2.5 if backward else 1.0)
            predicted = profile.dense_attention_seconds(frac * x, x, 1, backward)
            if predicted is None:
                continue
            rows.append({"queries": queries, "keys": keys, "queries_from": where, "visible": frac,
                         "backward": backward, "measured_s": measured, "predicted_s": predicted,
                         "error": predicted / measured - 1})
    return rows


def fit_profile(m: Measurements, name: str) -> dict:
    """The profile (YAML form, every figure with its source) that these measurements imply."""
    rates = [(2 * mm * k * n / 1e9, 2 * mm * k * n / s) for mm, k, n, s in m.gemm]
    peak = max(r for _, r in rates)
    best = max(m.gemm, key=lambda g: 2 * g[0] * g[1] * g[2] / g[3])
    rank = f"fp32, {m.threads} thread{'s' if m.threads > 1 else ''} per rank"
    if m.linear:  # training with full recompute: each projection forward twice, backward once
        mix = [(2 * mm * k * n / 1e9, 4 * (2 * mm * k * n) / (2 * tf + tb) / peak)
               for mm, k, n, tf, tb in m.linear]
        gemm_source = (f"measured: {len(mix)} nn.Linear layers at the model's projection shapes "
                       "(tokens x hidden x width) as the runtime trains them under full "
                       "checkpointing (forward twice, autograd backward once: 4 x 2mkn FLOP over "
                       "2 forward + 1 backward time) / peak, by GFLOP of one GEMM, median per "
                       "third of a decade; backward GEMMs (transposed operands, .grad "
                       "accumulation) reach ~0.7 of the forward rate")
    else:
        mix = [(g, r / peak) for g, r in rates]
        gemm_source = (f"measured: rate / peak of {len(rates)} fp32 GEMMs at the model's "
                       "projection shapes (tokens x hidden x width), median per third of a "
                       "decade of GFLOP")
    fwd = [(tile, flop / s / peak) for tile, _, bwd, flop, s in m.attention if not bwd]
    bwd = [(tile, flop / s / peak) for tile, _, b, flop, s in m.attention if b]
    head_dims = sorted({hd for _, hd, *_ in m.attention})
    copy_gbs = m.copy[0] / m.copy[1] / 1e9
    full_s, masked_s = m.masked_attention
    load_rates = {p: sum(r) for p, r in m.gemm_load.items()}
    single = load_rates[1]
    effective = max(load_rates.values()) / single
    cpus = len(os.sched_getaffinity(0))
    link, _, node_extra = _fit_links(m)
    tiles = ", ".join(str(t) for t in sorted({t for t, *_ in m.attention}))
    profile = {
        "name": name,
        "kind": "measured",
        "host": m.host,
        "date": m.date,
        "notes": (f"{m.cpu}; one rank = one process with {rank}; ranks share {cpus} cores "
                  f"({effective:.2f} cores' worth measured) and talk through gloo over TCP loopback. Measured by csbp calibrate "
                  f"under load {m.load} (load average 1/5/15 min, before -> after); other work on "
                  "the host makes every figure noisier. " + " ".join(m.notes)).strip(),
        "gpu": {
            "name": f"{m.cpu} ({rank})",
            "memory_gib": _figure(_round(m.memory_bytes / GIB), "MemTotal in /proc/meminfo (shared by "
                                  "all ranks of the host)"),
            "reserved_gib": _figure(_round(m.baseline_rss_bytes / GIB), "measured: peak resident set "
                                    "(VmHWM) of a worker process after importing torch, before any "
                                    "model: a rank's high-water RSS includes it"),
            "peak_tflops": _figure(_round(peak / 1e12), f"measured: fastest fp32 GEMM of the sweep, "
                                   f"{best[0]}x{best[1]}x{best[2]} in {best[3] * 1e3:.2f} ms, one process alone"),
            "hbm_gbs": _figure(_round(copy_gbs), f"measured: copy_ of {m.copy[0] // 2 // MIB} MiB fp32 "
                               f"(read + write counted) in {m.copy[1] * 1e3:.2f} ms"),
            **_memory_bound(m, copy_gbs),
            "gemm_efficiency": _figure(efficiency_curve(mix), gemm_source),
            "attention_forward_efficiency": _figure(
                efficiency_curve(fwd), f"measured: the runtime's CPU attention (explicit masked "
                f"math) forward, FLOP 4 x q x k x head_dim x heads per tile / time / peak, tiles "
                f"{tiles}, head dim {head_dims}"),
            "attention_backward_efficiency": _figure(
                efficiency_curve(bwd), "measured: same tiles, backward (dQ, dK, dV: 2.5 x the "
                "forward FLOP) / time / peak"),
            "masked_attention_efficiency_factor": _figure(
                _round(min(1.0, full_s / masked_s)), f"measured: full tile {full_s * 1e3:.2f} ms vs the "
                f"same tile under the BD3-LM mask {masked_s * 1e3:.2f} ms (explicit math computes "
                "every score either way, so the mask adds work, never removes it)"),
            "dense_attention": _figure(True, "runtime/attention.py on CPU: attention_with_lse "
                                       "computes the whole queries x keys score matrix and masks it"),
            "op_overhead_us": _op_overhead(m),
            **_dense_curves(m, peak),
            **_score_copies(m),
        },
        "node": {
            "gpus_per_node": _figure(4, "ranks per host csbp validate runs (world sizes 2 and 4); "
                                     "they share node.cores"),
            "cores": _figure(float(cpus), f"CPUs this process may run on (sched_getaffinity); "
                             "check, summed GEMM rate of " + ", ".join(
                                 f"{p} process{'es' if p > 1 else ''} at once {load_rates[p] / 1e9:.0f} GFLOP/s"
                                 for p in sorted(load_rates))
                             + f": {effective:.2f} cores' worth under load {m.load}"),
            **{k: v for k, v in node_extra.items() if v is not None},
            **_sharing(m, cpus),
            **_probe(m),
        },
        "links": {"nvlink": link},
    }
    HardwareProfile.model_validate(profile)  # a fit that breaks the schema is a bug, not input
    return profile


# ---- measuring ----------------------------------------------------------------------------------

def gemm_shapes(hidden: int, widths: tuple[int, ...], tokens: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(m, k, n) of a layer's projections at each token count: x @ W and its transpose."""
    shapes = set()
    for m in tokens:
        for w in widths:
            shapes |= {(m, hidden, w), (m, w, hidden)}
    return sorted(shapes)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total() -> int:
    from csbp.runtime.allocator import proc_bytes

    return proc_bytes("/proc/meminfo", "MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def measure(quick: bool, step: Callable[[str], None]) -> Measurements:
    """Run every microbenchmark; `step(label)` is called before each one (progress)."""
    import torch

    from csbp.runtime import microbench as mb
    from csbp.runtime.allocator import keep_freed_memory
    from csbp.runtime.validate import VALIDATION_MODEL

    threads = 1
    torch.set_num_threads(threads)
    keep_freed_memory()  # the ranks' allocator regime (runtime/allocator.py)
    probe_start = mb.probe_step_seconds()
    load_before = _loadavg()
    spec = VALIDATION_MODEL
    a = spec.layers[0]
    widths = (a.n_heads * a.head_dim, a.kv_width, spec.ffn, spec.vocab)
    tokens = (256, 1024, 4096) if quick else (128, 256, 512, 1024, 2048, 4096, 8192)
    budget = 0.05 if quick else 0.25
    step("GEMMs")
    gemm = [(m, k, n, mb.gemm_seconds(m, k, n, torch.float32, budget))
            for m, k, n in gemm_shapes(spec.hidden, widths, tokens)]
    linear = [(m, hidden, width, *mb.linear_seconds(m, hidden, width, budget))
              for m in tokens if m <= 4096 for hidden, width in
              sorted({(spec.hidden, w) for w in widths} | {(w, spec.hidden) for w in widths})]
    step("attention tiles")
    tiles = (128, 512, 2048) if quick else (128, 256, 512, 1024, 2048, 4096)
    attention = mb.attention_points(spec, tiles[:-1] if not quick else tiles, budget)
    masked = mb.masked_tile_seconds(spec, 1024, 64, budget)
    dense = [(q, 2 * L, where, *mb.bd3lm_call_seconds(spec, L, BLOCK, q, where, budget))
             for L, queries in DENSE_CALLS[quick] for q in queries for where in mb.BD3LM_QUERY_SETS]
    step("memory-bound ops")
    copy_bytes = 64 * MIB
    copy = (2 * copy_bytes, mb.copy_seconds(copy_bytes, budget))
    elementwise = [(n, mb.layer_elementwise_seconds(spec, n, budget)) for n in ELEMENTWISE_TOKENS]
    overhead = mb.op_overhead_seconds()
    score_copies = [(q, k, mb.attention_peak_scores(spec, q, k, k // 2, BLOCK))
                    for q, k in ((512, 1024), (1024, 1024), (1024, 2048))]
    tiny = mb.tiny_step_seconds(_tiny_spec(), TINY_SEQ, TINY_SEQ, steps=10 if quick else 30)
    optimizer = mb.optimizer_seconds(spec)
    step("core sharing")
    seconds = 0.3 if quick else 1.0
    gemm_load, rss = {}, 0
    for procs in (1, 2, 4):
        results = mb.gemm_rate_under_load(procs, threads, seconds=seconds)
        gemm_load[procs] = [r["flops_per_s"] for r in results]
        rss = max(rss, *(r["baseline_rss_bytes"] for r in results))
    cpus = len(os.sched_getaffinity(0))
    step_load = {procs: mb.step_seconds_under_load(procs, seconds=1.0 if quick else 4.0)
                 for procs in (cpus, 2 * cpus)}
    collectives = {}
    for world in (2, 4):
        step(f"collectives, world size {world}")
        sizes = QUICK_COLLECTIVE_SIZES if quick else COLLECTIVE_SIZES
        collectives[world] = mb.collective_seconds(world, sizes, threads=threads,
                                                   repeats=1 if quick else 3, calls=4 if quick else 8)
    return Measurements(
        host=mb.host_name(), cpu=_cpu_name(), date=dt.date.today().isoformat(),
        load=f"{load_before} -> {_loadavg()}", threads=threads, memory_bytes=_mem_total(),
        baseline_rss_bytes=rss, gemm=gemm, attention=attention, masked_attention=masked,
        copy=copy, layer_elementwise=elementwise, op_overhead_s=overhead, gemm_load=gemm_load,
        collectives=collectives, linear=linear, dense_attention=dense,
        tiny_step=(tiny, step_kernels(_tiny_spec(), TINY_SEQ)), optimizer=optimizer,
        step_load=step_load, score_copies=score_copies, probe=(probe_start, mb.probe_step_seconds()),
        notes=["Quick calibration: fewer sizes and repeats."] if quick else [])


def step_kernels(spec, seq_len: int) -> int:
    """Kernels of one step of `spec` in the step graph (one process, full checkpointing)."""
    from csbp.simulator.graph import Compute

    return sum(op.work.kernels for op in one_process_graph(spec, seq_len, seq_len).ops
               if isinstance(op.work, Compute))


def residuals(profile: HardwareProfile, m: Measurements) -> list[dict]:
    """Every measured call against its price from the table and from the alpha-beta fit (what
    group sizes without a table get): the check of the fit's mechanisms."""
    rows = []
    for world, table in sorted(m.collectives.items()):
        for (op, n_bytes), seconds in sorted(table.items()):
            predicted = collective_seconds(profile, op, n_bytes, world)
            alpha_beta = collective_seconds(profile, op, n_bytes, world, measured=False)
            rows.append({"world": world, "op": op, "bytes": n_bytes, "measured_s": seconds,
                         "predicted_s": predicted, "error": predicted / seconds - 1,
                         "alpha_beta_s": alpha_beta, "alpha_beta_error": alpha_beta / seconds - 1})
    return rows


# ---- CLI ----------------------------------------------------------------------------------------

def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this host into a hardware profile",
                       description="Run GEMM, attention, memory, core-sharing and gloo collective "
                                   "microbenchmarks on this host and write a measured profile.")
    p.add_argument("--out", default=None, help="profile path (default: hardware_profiles/NAME.yaml)")
    p.add_argument("--name", default="cpu-measured", help="profile name (default: cpu-measured)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about a minute; the full run takes about 4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    if not args.name.replace("-", "").replace("_", "").isalnum():
        raise InputError(f"bad profile name {args.name!r}: use letters, digits, '-' and '_'")
    out = Path(args.out) if args.out else PROFILE_DIR / f"{args.name}.yaml"
    if out.suffix not in (".yaml", ".yml"):
        raise InputError(f"{out}: the profile path must end in .yaml")
    if not out.parent.is_dir():
        raise InputError(f"{out.parent}: no such directory")
    console = Console(stderr=True)
    labels = ["GEMMs", "attention tiles", "memory-bound ops", "core sharing",
              "collectives, world size 2", "collectives, world size 4"]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("calibrating", total=len(labels))

        def step(label: str) -> None:
            progress.update(task, description=label, completed=labels.index(label))

        m = measure(args.quick, step)
    raw = fit_profile(m, args.name)
    out.write_text(_header(m) + yaml.safe_dump(raw, sort_keys=False, width=100,
                                                default_flow_style=None))
    profile = load_profile(str(out))
    rows = residuals(profile, m)
    errors = sorted(abs(r["alpha_beta_error"]) for r in rows)
    check = dense_attention_check(profile, m)
    summary = {"profile": str(out), "name": args.name, "host": m.host, "date": m.date, "load": m.load,
               "attention_fit_median_abs_error": statistics.median(abs(r["error"]) for r in check)
               if check else None,
               "attention_fit_max_abs_error": max(abs(r["error"]) for r in check) if check else None,
               "attention_fit": check,
               "peak_tflops": profile.gpu.peak_tflops, "cores": profile.node.cores,
               # the table reproduces its own points; the alpha-beta fit is what the check is of
               "collective_fit_median_abs_error": statistics.median(errors),
               "collective_fit_max_abs_error": errors[-1], "collective_fit": rows}
    if args.json:
        print_json(summary)
    else:
        _print_summary(console, profile, summary)
    return 0


def _header(m: Measurements) -> str:
    return (f"# csbp hardware profile measured by `csbp calibrate` on {m.host}, {m.date}.\n"
            "# Every figure's source names the measurement it came from; rerun the command to refresh.\n"
            "# Field meanings and units: hardware_profiles/README.md.\n\n")


def _print_summary(console, profile: HardwareProfile, summary: dict) -> None:
    from rich.table import Table

    out = console.__class__()  # stdout
    out.print(f"wrote {summary['profile']} (host {summary['host']}, load {summary['load']})")
    out.print(f"peak {profile.gpu.peak_tflops * 1e3:.1f} GFLOP/s per rank, copy "
              f"{profile.gpu.hbm_gbs:.1f} GB/s, {profile.node.cores:.2f} cores shared by the ranks")
    table = Table(title="gloo collectives: measured calls (the profile's table) vs the alpha-beta fit")
    for col in ("world", "op", "bytes", "measured", "table", "alpha-beta", "error"):
        table.add_column(col, justify="right")
    for r in summary["collective_fit"]:
        table.add_row(str(r["world"]), r["op"], f"{r['bytes'] // KIB} KiB", f"{r['measured_s'] * 1e3:.2f} ms",
                      f"{r['predicted_s'] * 1e3:.2f} ms", f"{r['alpha_beta_s'] * 1e3:.2f} ms",
                      f"{r['alpha_beta_error']:+.0%}")
    out.print(table)
    out.print(f"alpha-beta fit (group sizes without a table): median |error| "
              f"{summary['collective_fit_median_abs_error']:.0%}, max "
              f"{summary['collective_fit_max_abs_error']:.0%}")

