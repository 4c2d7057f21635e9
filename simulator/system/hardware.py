"""What the machine can do: GPU compute and memory, NVLink and InfiniBand, each figure with a source.

A profile is a YAML file in `hardware_profiles/` (or anywhere, by path). Every number in it is
written `{value: ..., source: "..."}` so a plan's cost can always be traced back to a datasheet,
a public measurement, an explicit assumption, or our own calibration run. The loaded
`HardwareProfile` holds plain numbers; the sources sit in `profile.sources` by dotted path.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from csbp.simulator.errors import InputError, one_line
from csbp.simulator.system.profile_files import names_in, read_mapping

PROFILE_DIR = Path(__file__).resolve().parents[2] / "hardware_profiles"


class _Figure:
    """Marks a field whose YAML form is `{value: ..., source: ...}`."""


FIGURE = _Figure()

Positive = Annotated[float, Field(gt=0, strict=True), FIGURE]
Count = Annotated[int, Field(gt=0, strict=True), FIGURE]
Fraction = Annotated[float, Field(gt=0, le=1, strict=True), FIGURE]


def _increasing(curve: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    xs = [x for x, _ in curve]
    if any(a >= b for a, b in zip(xs, xs[1:])):
        raise ValueError(f"curve x values must be strictly increasing, got {xs}")
    return curve


# (x, y) points with x strictly increasing: x > 0 because curves are read in log10(x).
_X = Annotated[float, Field(gt=0, strict=True)]
_Y = Annotated[float, Field(gt=0, le=1, strict=True)]
Curve = Annotated[tuple[tuple[_X, _Y], ...], Field(min_length=1), AfterValidator(_increasing), FIGURE]
OptionalPositive = Annotated[float | None, Field(gt=0, strict=True), FIGURE]
OptionalFraction = Annotated[float | None, Field(gt=0, le=1, strict=True), FIGURE]
OptionalCurve = Annotated[tuple[tuple[_X, _Y], ...] | None, Field(min_length=1),
                          AfterValidator(lambda c: c if c is None else _increasing(c)), FIGURE]

CollectiveOp = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"]
# measured hosts: {group size: {op: ((bytes each member receives, seconds of one call), ...)}}
_Seconds = Annotated[float, Field(gt=0, strict=True)]
CallTable = Annotated[tuple[tuple[_X, _Seconds], ...], Field(min_length=2), AfterValidator(_increasing)]
CallTables = Annotated[dict[Annotated[int, Field(gt=1)], dict[CollectiveOp, CallTable]] | None, FIGURE]


def interpolate(curve: Sequence[Sequence[float]], x: float, log_x: bool = True) -> float:
    """y at x on a piecewise-linear curve (in log10(x) by default), clamped to the end points.

    Efficiencies change by orders of magnitude of size, hence log10; outside the measured range
    we do not extrapolate a trend we have no data for.
    """
    xs = [p[0] for p in curve]
    if x <= xs[0]:
        return curve[0][1]
    if x >= xs[-1]:
        return curve[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    f = math.log10 if log_x else float
    t = (f(x) - f(x0)) / (f(x1) - f(x0))
    return y0 + t * (y1 - y0)


class KernelFamily(BaseModel):
    """One attention kernel family on this GPU (FA3, FA4, Triton FlexAttention, cuDNN, ...).

    Its speed is the GPU's FA3-class curves times a factor per pass: the public comparisons
    (implementation.md section 6) measure families side by side at 2K-16K, where their ratio is
    nearly flat, while the curves' shape over tile length is only known for FA3. Every family
    listed works on 128 x 128 tiles (graph.ATTENTION_KERNEL_TILE).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    forward_factor: Positive  # x the FA3-class forward efficiency
    backward_factor: Positive
    # per head dim other than the curves' 128: [head dim, forward, backward] x the factors above;
    # a head dim not listed runs at 1 (implementation.md 17: FA3 at 256 forward ~0.98 of 128)
    head_dim_factors: Annotated[tuple[tuple[int, float, float], ...] | None, FIGURE] = None

    def factor(self, backward: bool, head_dim: int = 0) -> float:
        own = self.backward_factor if backward else self.forward_factor
        for hd, fwd, bwd in self.head_dim_factors or ():
            if hd == head_dim:
                return own * (bwd if backward else fwd)
        return own


class GemmFamily(BaseModel):
    """A GEMM kernel family beside the dense `gemm_efficiency` curve: grouped GEMM over jagged
    expert groups (`F.grouped_mm`), read at the expert width (implementation.md 11, 17)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    efficiency: Curve  # [expert intermediate width, fraction of peak_tflops]


class LinearFamily(BaseModel):
    """A linear-attention kernel family (the chunked delta rule): fraction of peak on the FLOPs
    of `linear_ops.delta_rule_flops_per_token` (implementation.md 13, 17)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    forward_efficiency: Fraction
    backward_efficiency: Fraction


class GPU(BaseModel):
    """One accelerator: capacity, peaks, and how much of the peaks real kernels reach."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    memory_gib: Positive  # HBM capacity
    reserved_gib: Annotated[float, Field(ge=0, strict=True), FIGURE]  # context, NCCL, fragmentation
    # memory the allocator holds beyond live tensors (fragmentation, cached blocks), as a
    # fraction of the live-tensor peak: reserved / allocated at the peak; None = 0
    allocator_overhead: Annotated[float | None, Field(ge=0, le=1, strict=True), FIGURE] = None
    peak_tflops: Positive  # dense bf16 tensor peak
    # FP8 linears (frameworks.md A2, B3): the dense FP8 tensor peak and the fraction of it one
    # FP8 GEMM reaches by GFLOP per call, both or neither; None: this GPU prices no FP8 GEMM
    # (`linear_dtype fp8` is refused on it, `gemm_rate`)
    fp8_peak_tflops: OptionalPositive = None
    fp8_gemm_efficiency: OptionalCurve = None
    hbm_gbs: Positive
    hbm_efficiency: Fraction  # fraction of hbm_gbs memory-bound kernels reach
    gemm_efficiency: Curve  # [GFLOP per op, fraction of peak]
    attention_forward_efficiency: Curve  # [tile length in tokens, fraction of peak]
    attention_backward_efficiency: Curve
    masked_attention_efficiency_factor: Fraction  # multiplier for partially masked tiles
    op_overhead_us: OptionalPositive = None  # fixed cost per op (launch, dispatch); None = ignore
    # attention kernel families by name (implementation profiles say which runs each call);
    # empty: every call runs at the curves above (CPU hosts: the runtime's own attention)
    attention_kernels: dict[str, KernelFamily] = Field(default_factory=dict)
    # GEMM and linear-attention kernel families by name (implementation profiles' `moe` and
    # `linear_attention` sections say which runs); empty: the dense curves price them
    gemm_kernels: dict[str, GemmFamily] = Field(default_factory=dict)
    linear_attention_kernels: dict[str, LinearFamily] = Field(default_factory=dict)
    # the compute stream idle around one host synchronisation (`nonzero`, `.item()`): the
    # queue drains, then the next kernels are launched again; None = not priced
    host_sync_us: OptionalPositive = None
    # communication kernels beside compute (implementation.md section 7): the share of SMs an
    # NCCL kernel keeps, and HBM bytes it moves per byte on the link; None = no interference
    comm_sm_share: OptionalFraction = None
    comm_hbm_traffic_ratio: OptionalPositive = None
    optimizer_efficiency: OptionalFraction = None  # the optimizer's own; None = hbm_efficiency
    # True: attention computes every score of the queries x keys a rank holds, masked or not
    # (explicit math on CPU), so its work is that rectangle, not the mask's pairs
    dense_attention: Annotated[bool, Field(strict=True), FIGURE] = False
    # Dense attention: peak memory of one layer's attention in score matrices (queries x keys x
    # heads x dtype), for the memory model; None = not counted
    dense_score_copies: OptionalPositive = None
    # Dense attention (CPU): fraction of peak the runtime's explicit attention reaches on the
    # scores it computes, by GFLOP of the call's whole queries x keys rectangle (4 x q x k x
    # head_dim x heads forward, 2.5x that backward): visible scores, and masked ones (their exp
    # takes the slow path for -inf). None = price dense attention with the tile curves.
    dense_visible_forward_efficiency: OptionalCurve = None
    dense_visible_backward_efficiency: OptionalCurve = None
    dense_masked_forward_efficiency: OptionalCurve = None
    dense_masked_backward_efficiency: OptionalCurve = None

    @model_validator(mode="after")
    def _fits(self) -> "GPU":
        if self.reserved_gib >= self.memory_gib:
            raise ValueError(f"reserved_gib={self.reserved_gib} leaves no memory of {self.memory_gib} GiB")
        return self

    @model_validator(mode="after")
    def _dense_curves_together(self) -> "GPU":
        curves = [getattr(self, f) for f in DENSE_CURVES]
        if any(c is None for c in curves) and any(c is not None for c in curves):
            raise ValueError(f"give all of {', '.join(DENSE_CURVES)} or none")
        return self

    @model_validator(mode="after")
    def _fp8_together(self) -> "GPU":
        if (self.fp8_peak_tflops is None) != (self.fp8_gemm_efficiency is None):
            raise ValueError("give both of fp8_peak_tflops, fp8_gemm_efficiency or neither")
        return self

    def gemm_rate(self, fp8: bool = False) -> tuple[float, tuple[tuple[float, float], ...]]:
        """(peak TFLOP/s, efficiency curve by GFLOP per call) of a dense GEMM in bf16 or FP8;
        a GPU without FP8 figures refuses FP8 in one line rather than pricing it as bf16."""
        if not fp8:
            return self.peak_tflops, self.gemm_efficiency
        if self.fp8_peak_tflops is None or self.fp8_gemm_efficiency is None:
            raise InputError(f"linear dtype fp8: the GPU {self.name!r} has no FP8 GEMM figures "
                             "(gpu.fp8_peak_tflops, gpu.fp8_gemm_efficiency); use --linear-dtype bf16")
        return self.fp8_peak_tflops, self.fp8_gemm_efficiency

    @property
    def usable_gib(self) -> float:
        """Memory left for weights, optimizer state and activations."""
        return self.memory_gib - self.reserved_gib

    def kernel_factor(self, family: str, backward: bool, head_dim: int = 0) -> float:
        """Speed of a kernel family relative to the curves (at `head_dim`, 0: the curves' own);
        `best` is the fastest this GPU lists, `a|b` the faster of a and b, and a GPU listing none
        (a CPU host) runs everything at its curves."""
        if not self.attention_kernels:
            return 1.0
        if "|" in family:  # any of these (a lower bound's call stands for calls of each)
            return max(self.kernel_factor(f, backward, head_dim) for f in family.split("|"))
        if family == "best":
            return max(k.factor(backward, head_dim) for k in self.attention_kernels.values())
        k = self.attention_kernels.get(family)
        if k is None:
            raise InputError(f"the GPU {self.name!r} lists no attention kernel {family!r}: it has "
                             f"{', '.join(self.attention_kernels)}")
        return k.factor(backward, head_dim)

    def grouped_gemm_efficiency(self, family: str, width: float) -> float | None:
        """Fraction of peak of a GEMM family at expert width `width`; `best`: the fastest listed;
        None where the GPU lists none (the dense curve prices it)."""
        if not self.gemm_kernels:
            return None
        if family == "best":
            return max(interpolate(k.efficiency, width) for k in self.gemm_kernels.values())
        k = self.gemm_kernels.get(family)
        if k is None:
            raise InputError(f"the GPU {self.name!r} lists no GEMM kernel {family!r}: it has "
                             f"{', '.join(self.gemm_kernels)}")
        return interpolate(k.efficiency, width)

    def linear_efficiency(self, family: str, backward: bool) -> float | None:
        """Fraction of peak of a linear-attention family; `best`: the fastest listed; None where
        the GPU lists none (or `attention-curve`: the attention curves price it)."""
        if not self.linear_attention_kernels or family == "attention-curve":
            return None
        pick = (lambda k: k.backward_efficiency if backward else k.forward_efficiency)
        if family == "best":
            return max(pick(k) for k in self.linear_attention_kernels.values())
        k = self.linear_attention_kernels.get(family)
        if k is None:
            raise InputError(f"the GPU {self.name!r} lists no linear-attention kernel {family!r}: "
                             f"it has {', '.join(self.linear_attention_kernels)}")
        return pick(k)


DENSE_CURVES = ("dense_visible_forward_efficiency", "dense_visible_backward_efficiency",
                "dense_masked_forward_efficiency", "dense_masked_backward_efficiency")


# CPU hosts: how fast each rank runs while R ranks are busy at once, per op class, as a fraction of
# one rank alone: [[R, fraction], ...] with R strictly increasing (measured, never cores / R)
HostOpClass = Literal["gemm", "memory", "attention", "host"]
_Ranks = Annotated[int, Field(gt=0, strict=True)]
_Speed = Annotated[float, Field(gt=0, strict=True)]
RankCurve = Annotated[tuple[tuple[_Ranks, _Speed], ...], Field(min_length=1), AfterValidator(_increasing)]
RankSpeed = Annotated[dict[HostOpClass, RankCurve] | None, FIGURE]
RankWakeups = Annotated[dict[_Ranks, Annotated[float, Field(ge=0, strict=True)]] | None, FIGURE]
# ... and the same curves measured at more than one call size for a class whose sharing depends
# on how much memory its call touches: {class: {size: curve}}, size in the class's own unit
# (`SIZE_UNITS`); at least two sizes
RankSpeedBySize = Annotated[dict[HostOpClass, Annotated[dict[Annotated[float, Field(gt=0)], RankCurve],
                                                        Field(min_length=2)]] | None, FIGURE]
# what a call's size counts, per class that may have sized curves (the cost model reads the same)
SIZE_UNITS = {"attention": "score-matrix elements per call (queries x keys x heads x batch)"}


def _curve_share(curve, ranks: float) -> float:
    """A measured rank curve read at `ranks` (`Node.rank_share`)."""
    last_ranks, last_speed = curve[-1]
    if ranks > last_ranks:
        return last_speed * last_ranks / ranks
    return interpolate(curve, ranks, log_x=False)


MAX_GPUS_PER_NODE = 128  # an NVL72 rack as one node fits; the planner enumerates GPU counts


class Node(BaseModel):
    """One host. `cores` and `wakeup_latency_us` describe CPU hosts whose ranks share cores."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus_per_node: Annotated[int, Field(gt=0, le=MAX_GPUS_PER_NODE, strict=True), FIGURE]
    cores: OptionalPositive = None  # ranks that run at full speed at once; None = one device each
    wakeup_latency_us: OptionalPositive = None  # added per collective call when ranks > cores
    # seconds of a reference step when the profile was measured (csbp validate re-times it)
    probe_step_s: OptionalPositive = None
    # when ranks outnumber cores, the fraction of its cores / ranks share a rank really gets
    # (each switch between ranks on a core leaves the next one a cache full of the other's data)
    sharing_efficiency: OptionalFraction = None
    # GB/s the node's local storage reads at, summed over the node: per node because the drives
    # (or the file-system client) are a node resource that its GPUs' readers share; a step whose
    # data is read inside it (a drafter's offline target features, implementation.md section 5)
    # waits for its share. None = not given: such reads are not priced.
    storage_gbs: OptionalPositive = None
    # GB/s of one GPU's host-to-device copies from pinned host memory (its PCIe link); a drafter's
    # offline features cross it (implementation.md section 14). None = not given: not priced.
    h2d_gbs: OptionalPositive = None
    # CPU hosts, measured (`csbp calibrate`): the speed each rank gets while R ranks are busy at
    # once, per op class (gemm, memory, attention, host overhead), as a fraction of one rank
    # alone; when given it replaces cores / R x sharing_efficiency for the classes it lists
    rank_speed: RankSpeed = None
    # CPU hosts, measured: microseconds a collective call of a group adds when R ranks share the
    # host, by R (a call priced from a table measured with fewer ranks on the host adds the
    # difference: woken ranks wait behind the others for a core)
    rank_wakeup_us: RankWakeups = None
    # CPU hosts, measured: a class's curves at two or more call sizes (attention: a call whose
    # score matrix outgrows the caches shares the memory bus with the other ranks' calls, so it
    # slows more than a small one); a call is read between them in log size (`rank_share`)
    rank_speed_by_size: RankSpeedBySize = None

    def storage_share_gbs(self, readers: int) -> float | None:
        """GB/s one of `readers` ranks of this node reading at once gets (None: not given)."""
        return None if self.storage_gbs is None else self.storage_gbs / max(readers, 1)

    def core_share(self, ranks: int) -> float:
        """Fraction of its full compute speed each of `ranks` busy ranks on this host gets (1 on
        GPUs). Measured gloo bandwidth does not shrink this way (see runtime/calibration/collective_fit.py)."""
        if self.cores is None or ranks <= self.cores:
            return 1.0
        return self.cores / ranks * (self.sharing_efficiency or 1.0)

    def call_wakeup_us(self, ranks: int) -> float:
        """Extra latency of one collective call when ranks outnumber cores: woken ranks wait
        for a core (measured on gloo; point-to-point transfers do not show it)."""
        if self.cores is None or self.wakeup_latency_us is None or ranks <= self.cores:
            return 0.0
        return self.wakeup_latency_us

    def rank_share(self, op_class: HostOpClass, ranks: float, size: float | None = None) -> float:
        """Fraction of its alone speed a rank gets on ops of `op_class` while `ranks` ranks are
        busy on this host: the measured curve where the profile has one for the class (read
        linearly between measured rank counts; beyond the last, the summed speed stays at its
        last measured value and is split among more ranks [U]), else `core_share`. With curves
        at several call sizes for the class and the call's `size` (`SIZE_UNITS`), the share at
        each measured size, read between them in log size and held at the ends (no trend
        extrapolated past what was measured)."""
        sized = (self.rank_speed_by_size or {}).get(op_class)
        if sized and size is not None and size > 0:
            return interpolate([(s, _curve_share(sized[s], ranks)) for s in sorted(sized)], size)
        curve = (self.rank_speed or {}).get(op_class)
        if curve is None:
            return self.core_share(ranks)
        return _curve_share(curve, ranks)

    def crowd_wakeup_us(self, ranks: int, measured_with: int) -> float:
        """Extra latency of one collective call when `ranks` ranks share the host and its price
        was measured with `measured_with` ranks there (0 without the measured figures)."""
        if not self.rank_wakeup_us:
            return 0.0
        table = sorted(self.rank_wakeup_us.items())
        at = lambda r: interpolate(table, r, log_x=False)  # noqa: E731
        return max(0.0, at(ranks) - at(measured_with))


class Link(BaseModel):
    """One fabric as NCCL sees it from one GPU: asymptotic bandwidths plus alpha terms (GB/s, µs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    collective_gbs: Positive  # ring bus bandwidth per GPU for all-gather / reduce-scatter / all-reduce
    p2p_gbs: Positive  # send/recv per GPU pair: lower than collective_gbs (fewer NCCL channels)
    alltoall_gbs: Positive  # per GPU
    call_latency_us: Positive  # base cost of one collective call
    step_latency_us: Positive  # added per ring step
    p2p_latency_us: Positive  # one send/recv
    size_efficiency: Curve  # [bytes per rank, fraction of the asymptotic bandwidth]
    all_reduce_gbs: OptionalPositive = None  # bus bandwidth if it differs from collective_gbs
    reduce_scatter_gbs: OptionalPositive = None  # (gloo emulates it: see hardware_profiles/README)
    call_seconds: CallTables = None  # measured calls, used instead of alpha-beta where they exist
    # all-to-all kernels beside NCCL's (DeepEP normal, implementation.md 11, 17), by name
    alltoall_kernels: dict[str, "AllToAllFamily"] = Field(default_factory=dict)

    def alltoall_factor(self, kernel: str) -> float:
        """all-to-all bandwidth of a kernel family x NCCL's; `nccl` or a family not listed: 1;
        `best`: the fastest of NCCL and every family listed."""
        if kernel == "best":
            return max([1.0, *(k.bandwidth_factor for k in self.alltoall_kernels.values())])
        k = self.alltoall_kernels.get(kernel)
        return k.bandwidth_factor if k is not None else 1.0

    def measured_seconds(self, op: CollectiveOp, group_size: int, received: float) -> float | None:
        """Seconds of one call from the measured table of this op and group size, or None.

        Read in log-log between measured sizes; below the smallest, its time (latency-bound);
        above the largest, extended at the marginal bandwidth of the last two sizes.
        """
        table = (self.call_seconds or {}).get(group_size, {}).get(op)
        if table is None:
            return None
        (b0, t0), (b1, t1) = table[-2], table[-1]
        if received >= b1:
            return t1 + (received - b1) * max(t1 - t0, 0.0) / (b1 - b0)
        log_t = interpolate([(b, math.log(t)) for b, t in table], max(received, table[0][0]))
        return math.exp(log_t)

    def bus_gbs(self, op: CollectiveOp) -> float:
        """Asymptotic bus bandwidth of one collective (ring formulas for the bytes on the wire)."""
        own = {"all_reduce": self.all_reduce_gbs, "reduce_scatter": self.reduce_scatter_gbs,
               "all_to_all": self.alltoall_gbs, "send_recv": self.p2p_gbs}.get(op)
        return own if own is not None else self.collective_gbs

    def bandwidth_fraction(self, bytes_per_rank: float) -> float:
        """Fraction of the asymptotic bandwidth reached when each rank moves `bytes_per_rank`."""
        return interpolate(self.size_efficiency, bytes_per_rank)


class AllToAllFamily(BaseModel):
    """An all-to-all kernel family on one fabric: its bandwidth as a factor of NCCL's all-to-all
    (`Link.alltoall_gbs`) on the same link."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth_factor: Positive


Link.model_rebuild()


class Links(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    nvlink: Link  # inside a node (NVSwitch; on a CPU host: gloo over TCP loopback)
    infiniband: Link | None = None  # across nodes, per GPU (one NIC per GPU); None = one host


class HardwareProfile(BaseModel):
    """A cluster's hardware: one GPU type, a node shape and two fabrics."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: Literal["datasheet", "measured"]
    host: str | None = None
    date: str | None = None
    # where a measured profile came from (`csbp calibrate` writes them, `csbp validate` compares)
    cpu_model: str | None = None
    cpus: Annotated[int, Field(gt=0, strict=True)] | None = None
    torch: str | None = None
    notes: str
    gpu: GPU
    node: Node
    links: Links
    sources: dict[str, str] = Field(default_factory=dict)  # dotted field path -> source, filled on load
    # the software the cluster runs (an implementation profile's name or path, `implementation.py`):
    # not hardware, but chosen with it (`--implementation`) and carried wherever the profile goes
    implementation: str = "turbo-dllm"

    @model_validator(mode="before")
    @classmethod
    def _unwrap_figures(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "sources" in data:
            raise ValueError("sources is filled from the {value, source} figures; do not write it")
        sources: dict[str, str] = {}
        return {**_unwrap(cls, data, "", sources), "sources": sources}

    def gemm_efficiency(self, gflop: float) -> float:
        """Fraction of peak a GEMM of `gflop` GFLOP reaches (small GEMMs cannot fill the GPU)."""
        return interpolate(self.gpu.gemm_efficiency, gflop)

    def attention_efficiency(self, tile_len: float, backward: bool, masked: bool = False) -> float:
        """Fraction of peak a FlashAttention call on `tile_len`-token tiles reaches.

        Ring and block attention cut attention into tiles of length S/P, so their speed depends on
        the tile, not on the whole sequence; `masked` tiles (causal diagonal) also waste work.
        """
        gpu = self.gpu
        curve = gpu.attention_backward_efficiency if backward else gpu.attention_forward_efficiency
        factor = gpu.masked_attention_efficiency_factor if masked else 1.0
        return interpolate(curve, tile_len) * factor

    def dense_attention_seconds(self, flops: float, dense_flops: float, calls: int,
                                backward: bool) -> float | None:
        """Seconds of explicit (dense) attention on one core, or None without dense curves.

        The call scores its whole queries x keys rectangle (`dense_flops`); the visible share
        (`flops`, the mask's pairs) and the masked rest are priced at their own measured
        efficiencies, read at the size of one call (the score matrix outgrows the caches).
        """
        gpu = self.gpu
        if gpu.dense_visible_forward_efficiency is None or dense_flops <= 0:
            return None
        x = dense_flops / max(calls, 1) / 1e9
        visible = min(flops, dense_flops)
        if backward:
            vis, masked = gpu.dense_visible_backward_efficiency, gpu.dense_masked_backward_efficiency
        else:
            vis, masked = gpu.dense_visible_forward_efficiency, gpu.dense_masked_forward_efficiency
        peak = gpu.peak_tflops * 1e12
        return visible / (peak * interpolate(vis, x)) + (dense_flops - visible) / (peak * interpolate(masked, x))

    def overlap_slowdown(self, memory_bound: bool) -> float:
        """How much longer a kernel takes while an NCCL kernel runs beside it (1: no figures).

        Mechanism (implementation.md 7): compute-bound kernels lose the SMs NCCL's channels hold;
        memory-bound kernels lose the HBM bandwidth NCCL's traffic takes, `comm_hbm_traffic_ratio`
        bytes per link byte at NVLink's ring bandwidth (the busiest case) [U]."""
        gpu = self.gpu
        if memory_bound:
            if self.gpu.comm_hbm_traffic_ratio is None:
                return 1.0
            share = min(0.9, gpu.comm_hbm_traffic_ratio * self.links.nvlink.collective_gbs
                        / (gpu.hbm_gbs * gpu.hbm_efficiency))
            return 1.0 / (1.0 - share)
        return 1.0 / (1.0 - gpu.comm_sm_share) if gpu.comm_sm_share is not None else 1.0

    def on_one_host(self, ranks: int) -> "HardwareProfile":
        """The same hardware with all `ranks` on one node (a CPU host running that many ranks)."""
        return self.model_copy(update={"node": self.node.model_copy(update={"gpus_per_node": ranks})})

    def link(self, name: str) -> Link:
        """`nvlink` or `infiniband`."""
        if name not in Links.model_fields:
            raise InputError(f"unknown link {name!r}: use one of {', '.join(Links.model_fields)}")
        link = getattr(self.links, name)
        if link is None:
            raise InputError(f"profile {self.name!r} describes one host: it has no {name} link")
        return link


def _unwrap(cls: type[BaseModel], data: dict, prefix: str, sources: dict[str, str]) -> dict:
    """Replace each `{value, source}` figure of `data` by its value, recording the source.

    Walks the model's fields, so any figure added to a model gets the same treatment. Missing or
    mistyped sections are left for pydantic to report.
    """
    out = dict(data)
    for key, field in cls.model_fields.items():
        if key not in data:
            continue
        path, value = prefix + key, data[key]
        if FIGURE in field.metadata:
            if not isinstance(value, dict) or set(value) != {"value", "source"}:
                raise ValueError(f"{path}: write as {{value: <number>, source: <where it came from>}}")
            if not isinstance(value["source"], str) or not value["source"].strip():
                raise ValueError(f"{path}: source must be a non-empty string")
            out[key], sources[path] = value["value"], value["source"].strip()
        elif (section := _named_sections(field.annotation)) and isinstance(value, dict):
            out[key] = {name: _unwrap(section, v, f"{path}.{name}.", sources) if isinstance(v, dict) else v
                        for name, v in value.items()}
        elif (section := _section_model(field.annotation)) and isinstance(value, dict):
            out[key] = _unwrap(section, value, path + ".", sources)
    return out


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a nested section (`Link`, or `Link | None` for an optional one)."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _named_sections(annotation: Any) -> type[BaseModel] | None:
    """The model of a `dict[str, Model]` field (sections keyed by name, e.g. kernel families)."""
    args = get_args(annotation)
    if getattr(annotation, "__origin__", None) is dict and len(args) == 2 and args[0] is str:
        return _section_model(args[1])
    return None


def list_profiles() -> list[str]:
    """Names of the profiles shipped in `hardware_profiles/`."""
    return names_in(PROFILE_DIR)


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (`h100`, `h200`, ...) or any profile YAML by path."""
    path, raw = read_mapping(name_or_path, PROFILE_DIR, "hardware profile")
    try:
        return HardwareProfile.model_validate(raw)
    except ValidationError as err:
        raise InputError(f"{path}: {one_line(err)}") from None
