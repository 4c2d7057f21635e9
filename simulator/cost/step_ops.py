"""The vocabulary of a step graph: ops, the work they carry, and who takes part in a collective.

A compute op carries FLOPs, HBM bytes, a kind and, for attention, what its kernel computes (tile
length, kernel family, full and partial tiles); a transfer carries the bytes each representative
rank receives, its collective, its group and a traffic category. One value per representative
rank, so one op stands for the whole context group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Union

import numpy as np

LOSS_BYTES = 4  # the step's loss, fp32
COUNT_BYTES = 8  # a row count of the EP dispatch, int64

ComputeKind = Literal["gemm", "attention-fwd", "attention-bwd", "elementwise", "optimizer", "storage-read",
                      "linear-fwd", "linear-bwd", "host-sync", "h2d"]
# work on the host/storage path (a drafter's offline features, implementation.md 14): a background
# reader thread (storage -> pinned host) and a side CUDA stream (host -> GPU), each its own stream
# (`Op.stream`), pipelined one batch ahead and never waited on by compute or transfers
IO_STREAMS = {"storage-read": "io", "h2d": "h2d"}

Collective = Literal["all-gather", "reduce-scatter", "all-reduce", "all-to-all", "p2p"]

Category = Literal["attention-kv", "gradients", "tp", "ep", "params", "other"]

Phase = Literal["data", "forward", "recompute", "backward", "grad-sync", "optimizer", "param-sync"]

PerRank = tuple[float, ...]


def _hash_once(cls):
    """A frozen value whose hash is found once: works carry a value per representative rank
    (hundreds at 1,024 GPUs) and are looked up by value many times (the pricing cache, the
    per-ownership caches of the builder). Not pickled with it: a string's hash differs between
    interpreters."""
    by_fields = cls.__hash__

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = by_fields(self)
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    cls.__hash__, cls.__getstate__ = __hash__, __getstate__
    return cls


@_hash_once
@dataclass(frozen=True)
class Group:
    """Who takes part in one collective.

    `size` counts every member of the job (copies included) and sets the algorithm's steps;
    `per_node` is the fewest members that share a node in any instance of the group (equal to
    `size` when the group sits inside one node), so a spanning group is priced on its slowest
    level; `sync` lists the representative ranks that wait for each other.
    """

    size: int
    per_node: int
    sync: tuple[tuple[int, ...], ...]

    @property
    def spans_nodes(self) -> bool:
        return self.per_node < self.size

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.per_node)

    def slowest(self, values: np.ndarray) -> np.ndarray:
        """Per representative rank, the latest of `values` among the ranks it waits for."""
        if len(self.sync) == len(values):
            return values
        if len(self.sync) == 1:
            return np.full_like(values, values.max())
        out = values.copy()
        for members in self.sync:
            idx = list(members)
            out[idx] = values[idx].max()
        return out

@_hash_once
@dataclass(frozen=True)
class Compute:
    kind: ComputeKind
    flops: PerRank
    bytes: PerRank  # HBM traffic (what prices memory-bound ops)
    kernels: int = 1  # GEMM calls the FLOPs are split into: efficiency depends on one call's size
    tile_len: PerRank = ()  # attention: mean keys per query the kernel sweeps
    masked: bool = False  # attention: mask edges cut kernel tiles
    dense_flops: PerRank = ()  # attention: FLOPs of the whole queries x keys rectangle of the call
    kernel: str = "best"  # attention: the kernel family that runs the call (implementation profile)
    full_tile_flops: PerRank = ()  # attention: FLOPs of the kernel tiles every pair of which is visible
    partial_tile_flops: PerRank = ()  # ... and of the tiles the mask cuts (each costs the mask too)
    readers: int = 1  # storage-read: ranks of one node reading at once (they share its storage)
    shape_x: float = 0.0  # gemm of a kernel family (`kernel`): the x its curve is read at (expert width)
    head_dim: int = 0  # attention: the head dim (kernel families' head-dim factors); 0: the curves'
    # gemm: the share of its FLOPs run in FP8 at the GPU's FP8 peak and curve (a block linear's
    # forward, or the dgrad and wgrad halves of its backward: linear_ops.LinearGemmOps)
    fp8_share: float = 0.0

@_hash_once
@dataclass(frozen=True)
class Comm:
    collective: Collective
    bytes: PerRank  # received per rank
    group: Group
    category: Category
    peer: tuple[int, ...] = ()  # p2p: the rank each one receives from; both ends must be there
    kernel: str = "nccl"  # all-to-all: the kernel family that moves it (a link's alltoall_kernels)

Work = Union[Compute, Comm]

class Op(NamedTuple):
    """One op of the step (a tuple: a step holds thousands, stamped layer by layer)."""

    index: int
    name: str
    phase: Phase
    layer: int | None
    work: Work
    deps: tuple[int, ...]

    @property
    def stream(self) -> str:
        if isinstance(self.work, Comm):
            return "comm"
        return IO_STREAMS.get(self.work.kind, "compute")

Deps = tuple[int, ...]
