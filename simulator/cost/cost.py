"""Seconds of one op on one hardware profile: the only place where speed enters the simulator.

Compute is priced from FLOPs over the profile's peak times a measured efficiency (GEMM by the
size of one call, attention by tile length), memory-bound work from bytes over HBM bandwidth,
communication with an alpha-beta model per collective algorithm and link level. Each formula
lives in one function with its source.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from csbp.simulator.cost.graph import ALSO_CLEARED, Comm, Compute, Group, Work
from csbp.simulator.system.hardware import CollectiveOp, HardwareProfile, Link, interpolate

US = 1e-6
GB = 1e9


def compute_seconds(work: Compute, profile: HardwareProfile) -> np.ndarray:
    """Per rank: FLOPs / (peak x efficiency), or bytes / (HBM x efficiency) for memory-bound ops.

    On a host whose ranks share fewer cores than there are ranks, each gets its share of the
    speed (every rank of the host taken as busy: `host_share` for another count); a profile
    with a per-op overhead (dispatch, launch) adds it per kernel call.
    """
    alone = host_share(work, profile)
    return alone.at(profile.node, profile.node.gpus_per_node) if isinstance(alone, HostShare) else alone


def host_share(work: Compute, profile: HardwareProfile) -> "HostShare | np.ndarray":
    """The op's time alone split for pricing at any number of busy ranks (`HostShare`), or its
    seconds where ranks' sharing of the host does not enter (storage, H2D, a host sync's idle)."""
    gpu = profile.gpu
    flops, nbytes = np.asarray(work.flops), np.asarray(work.bytes)
    if work.kind == "storage-read":  # the node's storage, shared by its ranks reading at once
        rate = profile.node.storage_share_gbs(work.readers)  # None: the profile gives no figure
        return nbytes / (rate * GB) if rate else np.zeros(len(nbytes))
    if work.kind == "h2d":  # pinned host memory to this GPU over its own PCIe link
        rate = profile.node.h2d_gbs
        return nbytes / (rate * GB) if rate else np.zeros(len(nbytes))
    if work.kind in ("elementwise", "optimizer"):
        own = gpu.optimizer_efficiency if work.kind == "optimizer" else None
        busy = nbytes / (gpu.hbm_gbs * GB * (own or gpu.hbm_efficiency))
    elif work.kind == "host-sync":  # the stream idles, nothing is computed
        return np.full(len(flops), (gpu.host_sync_us or 0.0) * US * work.kernels)
    elif work.kind == "gemm":
        eff = along(gpu.gemm_efficiency, flops / work.kernels / 1e9)
        family = gpu.grouped_gemm_efficiency(work.kernel, work.shape_x) if work.shape_x else None
        if family is not None:  # a GEMM family (grouped experts); `best`: or the dense curve
            eff = np.maximum(eff, family) if work.kernel == "best" else np.full_like(eff, family)
        busy = flops / (gpu.peak_tflops * 1e12 * eff)
        if work.fp8_share:  # FP8 linears: that share at the FP8 peak and curve, read at the same size
            fp8_peak, fp8_curve = gpu.gemm_rate(fp8=True)
            fp8_busy = flops / (fp8_peak * 1e12 * along(fp8_curve, flops / work.kernels / 1e9))
            busy = busy * (1 - work.fp8_share) + fp8_busy * work.fp8_share
    elif work.kind in ("linear-fwd", "linear-bwd") and \
            (lin := gpu.linear_efficiency(work.kernel, work.kind == "linear-bwd")) is not None:
        busy = flops / (gpu.peak_tflops * 1e12 * lin)
    else:
        backward = work.kind in ("attention-bwd", "linear-bwd")  # linear: on the attention curves
        dense = [profile.dense_attention_seconds(f, d, work.kernels, backward)
                 for f, d in zip(flops, work.dense_flops)] if gpu.dense_attention else []
        if gpu.dense_attention and work.dense_flops:  # explicit math scores the whole rectangle
            flops = np.asarray(work.dense_flops)
        curve = gpu.attention_backward_efficiency if backward else gpu.attention_forward_efficiency
        family = "best" if work.kind.startswith("linear") else work.kernel  # linear: as before families
        kernel = gpu.kernel_factor(family, backward, work.head_dim)
        if work.full_tile_flops and not gpu.dense_attention:
            # block-sparse kernel: every tile it touches costs a whole tile, a partial one the
            # mask too (the masked-tile factor), at the family's speed over the call's tiles
            executed = np.asarray(work.full_tile_flops) + np.asarray(work.partial_tile_flops) / \
                gpu.masked_attention_efficiency_factor
            eff = along(curve, np.asarray(work.tile_len, dtype=float), kernel)
            busy = executed / (gpu.peak_tflops * 1e12 * eff)
        else:
            factor = (gpu.masked_attention_efficiency_factor if work.masked else 1.0) * kernel
            eff = along(curve, np.asarray(work.tile_len, dtype=float), factor)
            busy = flops / (gpu.peak_tflops * 1e12 * eff)
        if dense and all(s is not None for s in dense):  # measured per visible / masked score
            busy = np.array(dense)
    overhead = np.full(len(flops), (gpu.op_overhead_us or 0.0) * US * work.kernels)
    return HostShare(busy, overhead, HOST_OP_CLASS.get(work.kind, "gemm"), (flops > 0) | (nbytes > 0),
                     call_size(work) if profile.node.rank_speed_by_size else None)


def call_size(work: Compute) -> np.ndarray | None:
    """Per rank, one call's size in the unit its class's sized sharing curves are read at
    (`hardware.SIZE_UNITS`): attention's score-matrix elements, from the FLOPs of its whole
    queries x keys rectangle (4 x head_dim per element forward, 2.5 times that backward:
    `attention_ops.attention_work`). None for classes without sized curves."""
    if work.kind not in ("attention-fwd", "attention-bwd") or not work.dense_flops or not work.head_dim:
        return None
    from csbp.simulator.cost.attention_ops import ATTENTION_BACKWARD_FLOP_RATIO

    per_element = 4.0 * work.head_dim * (ATTENTION_BACKWARD_FLOP_RATIO if work.kind == "attention-bwd" else 1.0)
    return np.asarray(work.dense_flops, dtype=float) / (per_element * max(work.kernels, 1))


class HostShare:
    """A compute op's seconds alone on its rank, split by what slows it when ranks share a
    host's cores: its arithmetic (its op class's measured curve) and its per-call host overhead
    (CPU time too: the host curve). `at` prices it with a number of ranks busy at once: the
    host's rank count for a static price, or per rank the ranks busy while it runs
    (`engine/host_crowding.py`). On a GPU every share is 1 and `at` is busy + overhead."""

    __slots__ = ("busy", "overhead", "op_class", "works", "size")

    def __init__(self, busy: np.ndarray, overhead: np.ndarray, op_class: str, works: np.ndarray,
                 size: np.ndarray | None = None) -> None:
        self.busy, self.overhead, self.op_class, self.works = busy, overhead, op_class, works
        self.size = size  # per rank, one call's size where the class has sized curves

    def at(self, node, ranks: float | np.ndarray) -> np.ndarray:
        """Seconds per rank with `ranks` ranks busy: one count for all, or one per rank."""
        if np.ndim(ranks) == 0 and self.size is None:
            op_share, host_share = self._shares(node, ranks, None)
        else:
            counts = np.broadcast_to(np.asarray(ranks, dtype=float), np.shape(self.busy)).tolist()
            sizes = [None] * len(counts) if self.size is None else np.ravel(self.size).tolist()
            read: dict[tuple, tuple[float, float]] = {}  # each distinct (count, size) read once
            pairs = [read[key] if key in read else read.setdefault(key, self._shares(node, *key))
                     for key in zip(counts, sizes)]
            op_share, host_share = (np.array(column) for column in zip(*pairs))
        if node.rank_speed is None:
            # host overhead is CPU time too: ranks sharing cores slow it down like arithmetic
            shared = (self.busy + self.overhead) / op_share
        else:  # measured per op class: each slows as much as its own measurement says
            shared = self.busy / op_share + self.overhead / host_share
        return np.where(self.works, shared, 0.0)

    def _shares(self, node, ranks: float, size: float | None) -> tuple[float, float]:
        if node.rank_speed is None:
            share = node.core_share(ranks)
            return share, share
        return node.rank_share(self.op_class, ranks, size), node.rank_share("host", ranks)


# which measured sharing curve (`Node.rank_speed`) prices each kind of compute on a shared host:
# arithmetic-bound, memory-bound, the runtime's attention, or host time (Python, dispatch)
HOST_OP_CLASS = {"gemm": "gemm", "linear-fwd": "gemm", "linear-bwd": "gemm",
                 "attention-fwd": "attention", "attention-bwd": "attention",
                 "elementwise": "memory", "optimizer": "memory", "host-sync": "host"}


def along(curve, x: np.ndarray, factor: float = 1.0) -> np.ndarray:
    """`hardware.interpolate(curve, x) * factor` for every x (1 where x is 0: no work).

    One code path with the scalar read on purpose: numpy's vectorised log10 rounds differently
    from libm's on CPUs with AVX-512 loops, and the bounds, both engines and the memory model
    must read the same efficiency for the same size on every host. The arrays are per
    representative rank (a few to a few dozen values), so the scalar loop costs microseconds;
    at 1,024 GPUs a work holds up to 256 ranks' sizes, of which a few are distinct, so each
    distinct one is read once (the same call on the same value: the same number).
    """
    values = np.ravel(x).tolist()
    read: dict[float, float] = {}  # each distinct size read once: ranks repeat a handful of sizes
    for v in values:
        if v not in read:
            read[v] = interpolate(curve, v) * factor if v else 1.0
    return np.array([read[v] for v in values], dtype=float).reshape(np.shape(x))


def ring_seconds(op: CollectiveOp, recv_bytes: float, group: Group, profile: HardwareProfile) -> float:
    """Ring all-gather / reduce-scatter (one pass) or all-reduce (two passes), for one member.

    NCCL's ring model (src/graph/tuning.cc; hardware.md 3.4): time = base latency + intra-node
    steps x intra step latency + inter-node steps x network step latency + bytes / bus bandwidth,
    with n-1 steps per pass of which nodes-1 cross the network. A ring spanning nodes runs one
    channel per NIC of the node's members, so its bus bandwidth is the members-per-node NICs,
    capped by NVLink (hardware.md 3.3: 8 NICs x 46-48 GB/s ~ NVLink's ~370 GB/s).
    `recv_bytes` is what the member receives: (n-1)/n of the buffer per pass; a profile may give
    each collective its own bus bandwidth (`Link.bus_gbs`) and hosts a per-call wake-up delay.
    """
    nvl = profile.links.nvlink
    n, passes = group.size, 2 if op == "all_reduce" else 1
    steps = passes * (n - 1)
    inter = passes * (group.nodes - 1)
    shard = recv_bytes / steps  # one member's slice of the buffer: what the size curves are read at
    bandwidth = nvl.bus_gbs(op) * nvl.bandwidth_fraction(shard)
    latency = nvl.call_latency_us + steps * nvl.step_latency_us
    if group.spans_nodes:  # the ring crosses both levels: the slower one sets the pace
        ib = profile.link("infiniband")
        latency = ib.call_latency_us + (steps - inter) * nvl.step_latency_us + inter * ib.step_latency_us
        bandwidth = min(bandwidth, ib.bus_gbs(op) * group.per_node * ib.bandwidth_fraction(shard))
    latency += profile.node.call_wakeup_us(group.size)
    return latency * US + recv_bytes / (bandwidth * GB)


def alltoall_seconds(recv_bytes: float, group: Group, profile: HardwareProfile, kernel: str = "nccl") -> float:
    """All-to-all: every peer's slice moves at once; NVLink for peers on the node, one NIC for the rest.

    All-to-all cannot aggregate NICs, so off-node slices move at single-NIC speed per GPU
    (sjeaugey, nccl-tests #267; hardware.md 3.3). The slower level sets the time. A kernel
    family other than NCCL's (DeepEP) moves at its factor of NCCL's bandwidth on each link.
    """
    nvl = profile.links.nvlink
    n, k = group.size, group.per_node
    per_peer = recv_bytes / (n - 1)
    on_node = per_peer * (k - 1)
    off_node = per_peer * (n - k)
    seconds = on_node / (nvl.bus_gbs("all_to_all") * nvl.alltoall_factor(kernel) * GB
                         * nvl.bandwidth_fraction(per_peer)) if on_node else 0.0
    latency = nvl.call_latency_us
    if off_node:
        ib = profile.link("infiniband")
        latency = ib.call_latency_us
        seconds = max(seconds, off_node / (ib.bus_gbs("all_to_all") * ib.alltoall_factor(kernel) * GB
                                           * ib.bandwidth_fraction(per_peer)))
    return (latency + profile.node.call_wakeup_us(n)) * US + seconds


def p2p_seconds(recv_bytes: float, link: Link) -> float:
    """One send/recv pair: NCCL gives a peer few channels, so its own (lower) bandwidth applies.

    hardware.md 3.2: sendrecv ~80-180 GB/s on NVLink against ~370 for ring collectives.
    """
    return link.p2p_latency_us * US + recv_bytes / (link.bus_gbs("send_recv") * GB * link.bandwidth_fraction(recv_bytes))


def collective_seconds(work: Comm, recv_bytes: float, profile: HardwareProfile) -> float:
    """Seconds for one member that receives `recv_bytes` in this collective.

    A measured host's own table of calls (`Link.call_seconds`, by group size) takes precedence
    over the alpha-beta formulas inside one node.
    """
    if recv_bytes <= 0:
        return 0.0
    group = work.group
    if not group.spans_nodes:
        op = "send_recv" if work.collective == "p2p" else work.collective.replace("-", "_")
        measured = profile.links.nvlink.measured_seconds(op, group.size, recv_bytes)
        if measured is not None:  # measured with `group.size` ranks on the host
            return measured + profile.node.crowd_wakeup_us(profile.node.gpus_per_node, group.size) * US
    if work.collective in ("all-gather", "reduce-scatter", "all-reduce"):  # all-reduce = RS + AG
        return ring_seconds(work.collective.replace("-", "_"), recv_bytes, group, profile)
    if work.collective == "all-to-all":
        return alltoall_seconds(recv_bytes, group, profile, work.kernel)
    return p2p_seconds(recv_bytes, profile.link("infiniband" if group.spans_nodes else "nvlink"))


def comm_seconds(work: Comm, profile: HardwareProfile) -> np.ndarray:
    """Per rank; a collective ends together for its members: the slowest member sets the time."""
    priced = {b: collective_seconds(work, b, profile) for b in set(work.bytes)}  # ranks often match
    if len(priced) == 1:  # every member the same: nobody waits for a slower one
        return np.full(len(work.bytes), priced[work.bytes[0]])
    return work.group.slowest(np.array([priced[b] for b in work.bytes]))


# A planner search prices the same work in many candidates (a layer's GEMMs do not change with
# checkpointing or the K/V transport): priced works are kept, keyed by value and profile.
_PRICED: dict[tuple[int, Work], tuple[HardwareProfile, np.ndarray]] = {}
_PRICED_LIMIT = 50_000  # works of a 1,024-GPU search; a key holds a row per rank
ALSO_CLEARED.append(_PRICED.clear)


def seconds(work: Work, profile: HardwareProfile) -> np.ndarray:
    """Seconds of one op on each representative rank (read-only: the array is shared)."""
    key = (id(profile), work)
    hit = _PRICED.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    if len(_PRICED) >= _PRICED_LIMIT:
        _PRICED.clear()
    out = _seconds(work, profile)
    out.flags.writeable = False
    _PRICED[key] = (profile, out)
    return out


def _seconds(work: Work, profile: HardwareProfile) -> np.ndarray:
    if isinstance(work, Comm):
        return comm_seconds(work, profile)
    if len(work.flops) > 1 and all(len(set(v)) <= 1 for v in
                                   (work.flops, work.bytes, work.tile_len, work.dense_flops,
                                    work.full_tile_flops, work.partial_tile_flops)):
        # every rank does the same work (most GEMMs, norms): price one, the same arithmetic
        first = replace(work, flops=work.flops[:1], bytes=work.bytes[:1], tile_len=work.tile_len[:1],
                        dense_flops=work.dense_flops[:1], full_tile_flops=work.full_tile_flops[:1],
                        partial_tile_flops=work.partial_tile_flops[:1])
        return np.full(len(work.flops), compute_seconds(first, profile)[0])
    return compute_seconds(work, profile)
