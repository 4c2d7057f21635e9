"""Seconds of one op on one hardware profile: the only place where speed enters the simulator.

Compute is priced from FLOPs over the profile's peak times a measured efficiency (GEMM by the
size of one call, attention by tile length), memory-bound work from bytes over HBM bandwidth,
communication with an alpha-beta model per collective algorithm and link level. Each formula
lives in one function with its source.
"""

from __future__ import annotations

import numpy as np

from simulator.graph import Comm, Compute, Group, Work
from simulator.hardware import HardwareProfile, Link

US = 1e-6
GB = 1e9


def compute_seconds(work: Compute, profile: HardwareProfile) -> np.ndarray:
    """Per rank: FLOPs / (peak x efficiency), or bytes / (HBM x efficiency) for memory-bound ops."""
    gpu = profile.gpu
    flops, nbytes = np.asarray(work.flops), np.asarray(work.bytes)
    if work.kind in ("elementwise", "optimizer"):
        return nbytes / (gpu.hbm_gbs * GB * gpu.hbm_efficiency)
    peak = gpu.peak_tflops * 1e12
    if work.kind == "gemm":
        eff = np.array([profile.gemm_efficiency(f / work.kernels / 1e9) if f else 1.0 for f in flops])
    else:
        backward = work.kind == "attention-bwd"
        eff = np.array([profile.attention_efficiency(t, backward, work.masked) if t else 1.0
                        for t in work.tile_len])
    return flops / (peak * eff)


def ring_seconds(recv_bytes: float, steps_per_member: int, group: Group, profile: HardwareProfile) -> float:
    """Ring all-gather / reduce-scatter (1 pass) or all-reduce (2 passes) of one member.

    NCCL's ring model (src/graph/tuning.cc; hardware.md 3.4): time = base latency + intra-node
    steps x intra step latency + inter-node steps x network step latency + bytes / bus bandwidth,
    with n-1 steps per pass of which nodes-1 cross the network. A ring spanning nodes runs one
    channel per NIC of the node's members, so its bus bandwidth is the members-per-node NICs,
    capped by NVLink (hardware.md 3.3: 8 NICs x 46-48 GB/s ~ NVLink's ~370 GB/s).
    `recv_bytes` is what the member receives: (n-1)/n of the buffer per pass.
    """
    nvl, ib = profile.links.nvlink, profile.links.infiniband
    n, passes = group.size, steps_per_member
    steps = passes * (n - 1)
    inter = passes * (group.nodes - 1)
    if group.spans_nodes:
        latency = ib.call_latency_us + (steps - inter) * nvl.step_latency_us + inter * ib.step_latency_us
        bandwidth = min(nvl.collective_gbs, ib.collective_gbs * group.per_node)
        link = ib
    else:
        latency = nvl.call_latency_us + steps * nvl.step_latency_us
        bandwidth = nvl.collective_gbs
        link = nvl
    shard = recv_bytes / steps  # one member's slice of the buffer: what the size curves are read at
    return latency * US + recv_bytes / (bandwidth * GB * link.bandwidth_fraction(shard))


def alltoall_seconds(recv_bytes: float, group: Group, profile: HardwareProfile) -> float:
    """All-to-all: every peer's slice moves at once; NVLink for peers on the node, one NIC for the rest.

    All-to-all cannot aggregate NICs, so off-node slices move at single-NIC speed per GPU
    (sjeaugey, nccl-tests #267; hardware.md 3.3). The slower level sets the time.
    """
    nvl, ib = profile.links.nvlink, profile.links.infiniband
    n, k = group.size, group.per_node
    per_peer = recv_bytes / (n - 1)
    on_node = per_peer * (k - 1)
    off_node = per_peer * (n - k)
    t_nvl = on_node / (nvl.alltoall_gbs * GB * nvl.bandwidth_fraction(per_peer)) if on_node else 0.0
    t_ib = off_node / (ib.alltoall_gbs * GB * ib.bandwidth_fraction(per_peer)) if off_node else 0.0
    latency = (ib if off_node else nvl).call_latency_us
    return latency * US + max(t_nvl, t_ib)


def p2p_seconds(recv_bytes: float, link: Link) -> float:
    """One send/recv pair: NCCL gives a peer few channels, so its own (lower) bandwidth applies.

    hardware.md 3.2: sendrecv ~80-180 GB/s on NVLink against ~370 for ring collectives.
    """
    return link.p2p_latency_us * US + recv_bytes / (link.p2p_gbs * GB * link.bandwidth_fraction(recv_bytes))


def collective_seconds(work: Comm, recv_bytes: float, profile: HardwareProfile) -> float:
    """Seconds for one member that receives `recv_bytes` in this collective."""
    if recv_bytes <= 0:
        return 0.0
    group = work.group
    if work.collective in ("all-gather", "reduce-scatter"):
        return ring_seconds(recv_bytes, 1, group, profile)
    if work.collective == "all-reduce":  # reduce-scatter then all-gather
        return ring_seconds(recv_bytes, 2, group, profile)
    if work.collective == "all-to-all":
        return alltoall_seconds(recv_bytes, group, profile)
    link = profile.links.infiniband if group.spans_nodes else profile.links.nvlink
    return p2p_seconds(recv_bytes, link)


def comm_seconds(work: Comm, profile: HardwareProfile) -> np.ndarray:
    """Per rank; a collective ends together for its members: the slowest member sets the time."""
    own = np.array([collective_seconds(work, b, profile) for b in work.bytes])
    out = np.empty_like(own)
    for members in work.group.sync:
        idx = list(members)
        out[idx] = own[idx].max()
    return out


def seconds(work: Work, profile: HardwareProfile) -> np.ndarray:
    """Seconds of one op on each representative rank."""
    if isinstance(work, Comm):
        return comm_seconds(work, profile)
    return compute_seconds(work, profile)
