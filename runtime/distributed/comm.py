"""The one door to torch.distributed: every collective and send/recv of the runtime, counted.

Counts are each rank's logical traffic per category: what it receives from and sends to other
ranks (a rank's own slot of a collective is not traffic). For all-gather, reduce-scatter,
all-to-all and send/recv that is exactly the rows `Layout.exchange` names, which is why counted
attention bytes can equal the simulator's prediction to the byte. All-reduce counts the ring
algorithm's 2(P-1)/P of the buffer each way. Backends may move more on the wire (gloo's
reduce-scatter is an all-reduce underneath); the counts describe the plan, not the backend.
Attention K/V bytes received are also split by phase (forward, recompute, backward), the way the
layout predicts them.

Every call has the process group's timeout (a stuck peer fails it instead of hanging the run),
and a backend failure surfaces as `CollectiveError`: this rank only saw another one fail.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

# the step graph's traffic categories (simulator/cost/graph.py): K/V exchange, gradient sums, tensor-
# parallel activations, expert-parallel tokens, the rest (the step's loss), ZeRO's gathers of
# updated parameters
CATEGORIES = ("attention-kv", "gradients", "tp", "ep", "other", "params")
PHASES = ("forward", "recompute", "backward")

# torch 2.13 renames these (the old names warn); older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _share(nbytes: int, size: int, passes: int = 1) -> int:
    """(P-1)/P of a buffer per ring pass: what each member of a ring all-gather or reduce-scatter
    (one pass) or all-reduce (two) receives, on average over the members. Exact for equal shards;
    otherwise rounded to the byte, as the graph's counts are (a 4-byte loss over 16 ranks moves
    7.5 bytes a member on average: 8, not the 7 a floor would give)."""
    return round(passes * (size - 1) * nbytes / size)


class CollectiveError(RuntimeError):
    """A collective failed in the backend: a peer died, or did not arrive within the timeout."""


@contextmanager
def _calling(op: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as err:  # gloo and NCCL report peer failures and timeouts this way
        lines = [line for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0])  # gloo's "[source.cc:123]" prefix
        raise CollectiveError(f"{op} failed: {text}") from err


class Comm:
    """Collectives and point-to-point transfers of one rank, with byte counters.

    `timeout` is given to the groups made here (torch gives new groups its 30-minute default,
    not the world group's timeout).
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        self._in_backward = False
        self.timeout = timeout
        self.reset()

    def reset(self) -> None:
        self.sent = dict.fromkeys(CATEGORIES, 0)
        self.received = dict.fromkeys(CATEGORIES, 0)
        self.attention_received = dict.fromkeys(PHASES, 0)

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Mark the backward pass: forward-direction exchanges in it are recomputation."""
        self._in_backward = True
        try:
            yield
        finally:
            self._in_backward = False

    def forward_phase(self) -> str:
        return "recompute" if self._in_backward else "forward"

    def new_group(self, ranks: list[int]) -> dist.ProcessGroup:
        with _calling("new_group"):
            return dist.new_group(ranks, timeout=self.timeout)

    def _count(self, category: str, sent: int, received: int, phase: str | None = None) -> None:
        self.sent[category] += sent
        self.received[category] += received
        if category == "attention-kv":
            self.attention_received[phase] += received

    def all_gather(self, shard: torch.Tensor, group: dist.ProcessGroup, category: str,
                   phase: str | None = None, padding: int = 0) -> torch.Tensor:
        """Equal shards of every group member, stacked along dim 0 in group rank order.

        `padding`: elements of the gathered whole that only round it up to equal shards (ZeRO's
        flat buffers); not traffic, so the count is (P-1)/P of the rest, as the graph's.
        """
        size = dist.get_world_size(group)
        out = shard.new_empty((size * shard.shape[0], *shard.shape[1:]))
        with _calling("all_gather"):
            _all_gather(out, shard.contiguous(), group=group)
        volume = _share(size * _nbytes(shard) - padding * shard.element_size(), size)
        self._count(category, volume, volume, phase)
        return out

    def reduce_scatter(self, full: torch.Tensor, group: dist.ProcessGroup, category: str,
                       phase: str | None = None, padding: int = 0) -> torch.Tensor:
        """Sum over members of `full`, each member keeping its own 1/P slice of dim 0
        (`padding` as in `all_gather`)."""
        size = dist.get_world_size(group)
        out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
        with _calling("reduce_scatter"):
            _reduce_scatter(out, full.contiguous(), group=group)
        volume = _share(_nbytes(full) - padding * full.element_size(), size)
        self._count(category, volume, volume, phase)
        return out

    def all_to_all(self, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                   me: int, group: dist.ProcessGroup, category: str,
                   phase: str | None = None) -> torch.Tensor:
        """Rows to each member (`send_splits`, group rank order); rows from each come back."""
        out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
        with _calling("all_to_all"):
            dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        self._count(category, (sum(send_splits) - send_splits[me]) * row_bytes,
                    (sum(recv_splits) - recv_splits[me]) * row_bytes, phase)
        return out

    def send_recv(self, sends: dict[int, torch.Tensor], recv_numel: dict[int, int],
                  like: torch.Tensor, category: str, phase: str | None = None
                  ) -> dict[int, torch.Tensor]:
        """One message to and from each peer (global ranks), posted together so none deadlocks."""
        received = {peer: like.new_empty(n) for peer, n in recv_numel.items()}
        ops = [dist.P2POp(dist.isend, t.contiguous(), peer) for peer, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, buf, peer) for peer, buf in received.items()]
        if ops:
            with _calling("send/recv"):
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
        self._count(category, sum(map(_nbytes, sends.values())),
                    sum(map(_nbytes, received.values())), phase)
        return received

    def all_reduce(self, t: torch.Tensor, category: str,
                   group: dist.ProcessGroup | None = None, op: str = "sum") -> torch.Tensor:
        """In place, SUM or MAX (gloo rejects AVG on older torch; callers normalise by global
        counts)."""
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        if size > 1:
            with _calling("all_reduce"):
                dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                                group=group)
            volume = _share(_nbytes(t), size, passes=2)
            self._count(category, volume, volume)
        return t


def wire_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype activations travel in: autocast's (bf16/fp16) when it is on, as the step graph
    prices them, else the tensor's own. Consumers under autocast cast to it anyway."""
    device = t.device.type
    if torch.is_autocast_enabled(device) and t.is_floating_point():
        return torch.get_autocast_dtype(device)
    return t.dtype
