"""Attention over the BD3-LM mask that stays exact when K/V are spread over ranks.

`attention_with_lse` is plain masked math (the CPU reference: exact in fp32/fp64, any mask,
-inf-safe) and returns the log-sum-exp, so partial results over disjoint K/V pieces merge exactly
(`merge`). `Attention` runs one rank's queries against the keys the layout says they see, moving
K/V rows exactly as `Layout.exchange` names them:

- none: every key is local (single process, DP, pure BP);
- all-gather: the owners' rows are gathered forward and dK/dV reduce-scattered back to them
  (CP; CSBP full layers, inside each clean replica's cp group);
- all-to-all: only the clean rows a rank's queries see (CSBP sliding-window layers), reversed in
  backward;
- ring: K/V hop P-1 times with an LSE merge; backward recomputes each tile with the *global* LSE
  (the softmax Jacobian needs only the global normaliser) and passes dK/dV along with K/V, the
  last hop delivering them to their owner.

Queries are grouped by K/V head, q [B, Hkv, G, Nq, D]; k, v [B, Hkv, Nk, D]. Which keys a call's
queries see is a `Visibility` (their positions and the window) over `simulator.mask.visible` (the
mask exists once, shared with the simulator). The kernel follows the device (`attend`): on CUDA
block-sparse FlexAttention (`runtime.flex_attention`: no score matrix, LSE returned, a BlockMask
built from the positions), elsewhere the exact math below over the dense boolean mask.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from csbp.runtime.models.flex_attention import Visibility, flex_attention_with_lse
from csbp.simulator.layout.layout import Layout, RingStep
from csbp.simulator.layout.mask import span_positions
from csbp.simulator.layout.spans import Span, size
from csbp.simulator.workload.spec import AttentionSpec

KV = "attention-kv"


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of grouped queries over the keys `allowed` -> (out, lse).

    A row with no visible key (common in ring tiles) gives out 0, lse -inf and finite gradients.
    """
    s = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, G, Nq, Nk]
    s = s.masked_fill(~allowed, float("-inf"))
    shift = s.detach().amax(-1, keepdim=True)  # softmax is shift-invariant: no gradient needed
    shift = shift.masked_fill(shift == float("-inf"), 0.0)
    e = torch.exp(s - shift)
    total = e.sum(-1, keepdim=True)
    out = (e @ v.unsqueeze(2)) / torch.where(total > 0, total, 1.0)
    return out, (shift + total.log()).squeeze(-1)


def merge(out: torch.Tensor, lse: torch.Tensor, out_t: torch.Tensor, lse_t: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets (logaddexp form: no NaN when both are -inf)."""
    new = torch.logaddexp(lse, lse_t)
    base = new.masked_fill(new == float("-inf"), 0.0)
    w, w_t = torch.exp(lse - base), torch.exp(lse_t - base)
    return out * w.unsqueeze(-1) + out_t * w_t.unsqueeze(-1), new


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                       scale: float, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one K/V tile from the *global* out and lse of the queries."""
    s = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale
    p = torch.where(allowed, torch.exp(s - lse.unsqueeze(-1)), 0.0)
    dv = (p.transpose(-1, -2) @ grad_out).sum(2)  # sum over the query heads sharing a K/V head
    dp = grad_out @ v.unsqueeze(2).transpose(-1, -2)
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True)) * scale
    return ds @ k.unsqueeze(2), (ds.transpose(-1, -2) @ q).sum(2), dv


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one call: block-sparse FlexAttention on CUDA, the exact math elsewhere."""
    if q.is_cuda:
        return flex_attention_with_lse(q, k, v, vis, scale)
    return attention_with_lse(q, k, v, vis.dense(q.device), scale)


def tile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility,
                  scale: float, out: torch.Tensor, lse: torch.Tensor, grad_out: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one K/V tile from the *global* out and lse: the exact formula on CPU; on
    CUDA the tile's attention recomputed and differentiated (FlexAttention's backward).

    The global output is sum_t w_t out_t with w_t = exp(lse_t - lse), so the tile's output gets
    w_t grad_out and its LSE w_t grad_out . (out_t - out); no score matrix is materialised.
    """
    if not q.is_cuda:
        return attention_backward(q, k, v, vis.dense(q.device), scale, out, lse, grad_out)
    if k.shape[2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out_t, lse_t = flex_attention_with_lse(*inputs, vis, scale)
    w = torch.exp(lse_t.detach() - lse.float().masked_fill(lse == float("-inf"), 0.0))
    g = grad_out.float()
    grad_lse = w * (g * (out_t.detach().float() - out.float())).sum(-1)
    grads = torch.autograd.grad((out_t, lse_t), inputs,
                                ((w.unsqueeze(-1) * g).to(out_t.dtype), grad_lse))
    return tuple(grads)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility,
                    scale: float) -> torch.Tensor:
    """Attention when no LSE is needed (every key is local)."""
    return attend(q, k, v, vis, scale)[0]


def positions_of(spans: tuple[Span, ...]) -> torch.Tensor:
    return torch.from_numpy(span_positions(spans))


def _pack(k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """K and V rows `index` as one [rows, B * Hkv * 2D] buffer: one message per exchange."""
    kv = torch.cat([k, v], dim=-1).index_select(2, index)  # [B, Hkv, n, 2D]
    return kv.permute(2, 0, 1, 3).reshape(len(index), -1)


def _unpack(rows: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, h_kv, _, d = like.shape
    kv = rows.view(rows.shape[0], b, h_kv, 2 * d).permute(1, 2, 0, 3)
    return kv[..., :d], kv[..., d:]


class Attention:
    """One rank's attention for every layer of a model: `attend(layer, q, k, v)`.

    `global_ranks[c]` is the global rank of context rank c (of this rank's replica);
    `groups` maps each exchange group of the layout (context ranks) to its process group;
    `positions` orders the rank's positions as its tensors do (default: ascending).
    """

    def __init__(self, layers: tuple[AttentionSpec, ...], layout: Layout, ctx_rank: int = 0,
                 comm=None, global_ranks: tuple[int, ...] = (0,), groups: dict | None = None,
                 positions: torch.Tensor | None = None):
        self.layers, self.layout, self.me = layers, layout, ctx_rank
        self.comm, self.global_ranks, self.groups = comm, global_ranks, groups or {}
        self.positions = (positions_of(layout.shares[ctx_rank].positions) if positions is None
                          else positions)
        self._lookup = torch.full((2 * layout.seq_len,), -1, dtype=torch.long)
        self._lookup[self.positions] = torch.arange(len(self.positions))
        self._routes: dict[tuple, object] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> torch.Tensor:
        """q [B, N, Hq, D], k and v [B, N, Hkv, D] at this rank's positions -> [B, N, Hq, D]."""
        b, n, h_q, d = q.shape
        h_kv = k.shape[2]
        grouped = q.view(b, n, h_kv, h_q // h_kv, d).permute(0, 2, 3, 1, 4)
        route = self._route(self.layers[layer], q.device)
        out = route.attend(grouped, k.transpose(1, 2), v.transpose(1, 2), 1 / math.sqrt(d))
        return out.to(q.dtype).permute(0, 3, 1, 2, 4).reshape(b, n, h_q, d)

    # ---- routes: built once per layer kind from the layout ------------------------------------
    def _route(self, spec: AttentionSpec, device: torch.device):
        key = (spec.kind, spec.window)
        if key not in self._routes:
            self._routes[key] = self._build(spec, device)
        return self._routes[key]

    def _mask(self, keys: torch.Tensor, window: int | None) -> Visibility:
        lay = self.layout
        return Visibility(self.positions, keys, lay.seq_len, lay.block, window)

    def _index(self, rows: tuple[Span, ...], device: torch.device) -> torch.Tensor:
        return self._lookup[positions_of(rows)].to(device)

    def _build(self, spec: AttentionSpec, device: torch.device):
        forward = self.layout.exchange(spec, "forward")
        window = spec.window
        if forward.pattern == "none":
            return _Local(self._mask(self.positions, window))
        group = next(g for g in forward.groups if self.me in g)
        members = sorted(group, key=lambda c: self.global_ranks[c])  # process-group rank order
        if forward.pattern == "ring":
            return _Ring(self, spec, members, device)
        transfers = forward.steps[0].transfers
        sends = {t.dst: t.rows for t in transfers if t.src == self.me}
        recvs = {t.src: t.rows for t in transfers if t.dst == self.me}
        received = torch.cat([positions_of(recvs.get(c, ())) for c in members])
        common = dict(comm=self.comm, group=self.groups[group], me=members.index(self.me),
                      local=self._mask(self.positions, window),
                      remote=self._mask(received, window))
        if forward.pattern == "all-gather":
            (shard,) = {sends[c] for c in members if c != self.me}  # the same rows to everyone
            if {size(recvs[c]) for c in members if c != self.me} != {size(shard)}:
                raise RuntimeError("all-gather needs every member to own equal shards")
            return _Gather(index=self._index(shard, device), size=len(members), **common)
        return _AllToAll(index=self._index(tuple(r for c in members for r in sends.get(c, ())),
                                           device),
                         send_splits=[size(sends.get(c, ())) for c in members],
                         recv_splits=[size(recvs.get(c, ())) for c in members], **common)


class _Local:
    def __init__(self, vis: Visibility):
        self.vis = vis

    def attend(self, q, k, v, scale):
        return dense_attention(q, k, v, self.vis, scale)


class _Exchange(torch.autograd.Function):
    """K/V rows out to other ranks (forward) and their gradients back to the owners (backward)."""

    @staticmethod
    def forward(ctx, rows, route):
        ctx.route = route
        return route.send_forward(rows)

    @staticmethod
    def backward(ctx, grad):
        return ctx.route.send_back(grad.contiguous()), None


class _Collective:
    """Keys = local rows + rows received from the group members (in group order).

    Two calls merged by their LSE, as the step graph prices them: the local keys first (on a GPU
    this runs while the exchange is in flight), then the received ones.
    """

    def __init__(self, comm, group, me: int, local: Visibility, remote: Visibility,
                 index: torch.Tensor):
        self.comm, self.group, self.me, self.index = comm, group, me, index
        self.local, self.remote = local, remote

    def attend(self, q, k, v, scale):
        out, lse = attend(q, k, v, self.local, scale)
        k_r, v_r = _unpack(_Exchange.apply(_pack(k, v, self.index), self), k)
        return merge(out, lse, *attend(q, k_r, v_r, self.remote, scale))[0]


class _Gather(_Collective):
    """All-gather of equal owned shards; backward reduce-scatters dK/dV to the owners."""

    def __init__(self, size: int, **kw):
        super().__init__(**kw)
        self.size = size

    def send_forward(self, rows):
        slots = self.comm.all_gather(rows, self.group, KV, self.comm.forward_phase())
        slots = slots.view(self.size, *rows.shape)
        return torch.cat([slots[:self.me], slots[self.me + 1:]]).flatten(0, 1)

    def send_back(self, grad):
        slots = grad.view(self.size - 1, -1, grad.shape[-1])
        own = slots.new_zeros((1, *slots.shape[1:]))  # own rows were used locally, not sent
        full = torch.cat([slots[:self.me], own, slots[self.me:]]).flatten(0, 1)
        return self.comm.reduce_scatter(full, self.group, KV, "backward")


class _AllToAll(_Collective):
    """Each member sends each other member exactly the rows it needs (variable sizes)."""

    def __init__(self, send_splits: list[int], recv_splits: list[int], **kw):
        super().__init__(**kw)
        self.send_splits, self.recv_splits = send_splits, recv_splits

    def send_forward(self, rows):
        return self.comm.all_to_all(rows, self.send_splits, self.recv_splits, self.me, self.group,
                                    KV, self.comm.forward_phase())

    def send_back(self, grad):
        return self.comm.all_to_all(grad, self.recv_splits, self.send_splits, self.me, self.group,
                                    KV, "backward")


class _Ring:
    """Ring exchange of one layer kind, following the layout's ring steps transfer by transfer."""

    def __init__(self, attention: Attention, spec: AttentionSpec, members: list[int],
                 device: torch.device):
        lay, me = attention.layout, attention.me
        self.comm, self.me, self.global_ranks = attention.comm, me, attention.global_ranks
        self.own_rows = lay.shares[me].owned_kv
        self.own_index = attention._index(self.own_rows, device)
        self.local_mask = attention._mask(attention.positions, spec.window)
        self.masks = {lay.shares[c].owned_kv: attention._mask(positions_of(lay.shares[c].owned_kv),
                                                              spec.window)
                      for c in members if c != me}
        self.forward_steps = lay.exchange(spec, "forward").steps
        self.backward_steps = lay.exchange(spec, "backward").steps

    def attend(self, q, k, v, scale):
        return _RingAttention.apply(q, k, v, self, scale)

    def own(self, k: torch.Tensor, v: torch.Tensor) -> dict:
        return {("kv", self.own_rows): torch.cat([k, v], -1).index_select(2, self.own_index)}

    def step(self, step: RingStep, held: dict, like: torch.Tensor, phase: str) -> dict:
        """Send what this rank holds for `step`, receive its messages: {(payload, rows): tensor}.

        All buffers between one pair of ranks in a step travel as one message.
        """
        b, h_kv, _, d = like.shape
        outgoing, expected = defaultdict(list), defaultdict(list)
        for t in step.transfers:
            if t.src == self.me:
                outgoing[self.global_ranks[t.dst]].append(held.pop((t.payload, t.rows)).flatten())
            if t.dst == self.me:
                expected[self.global_ranks[t.src]].append((t.payload, t.rows, t.n_rows))
        sends = {peer: torch.cat(parts) for peer, parts in outgoing.items()}
        numel = {peer: sum(n for *_, n in keys) * b * h_kv * 2 * d
                 for peer, keys in expected.items()}
        got = self.comm.send_recv(sends, numel, like, KV, phase)
        out = {}
        for peer, keys in expected.items():
            parts = got[peer].split([n * b * h_kv * 2 * d for *_, n in keys])
            for (payload, rows, n), part in zip(keys, parts):
                out[(payload, rows)] = part.view(b, h_kv, n, 2 * d)
        return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float):
        out, lse = attend(q, k, v, ring.local_mask, scale)
        held = ring.own(k, v)
        for step in ring.forward_steps:
            for key, kv in ring.step(step, held, k, ring.comm.forward_phase()).items():
                k_t, v_t = kv.chunk(2, -1)
                out, lse = merge(out, lse, *attend(q, k_t, v_t, ring.masks[key[1]], scale))
                held[key] = kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        dq, dk, dv = tile_backward(q, k, v, ring.local_mask, scale, out, lse, grad_out)
        held = ring.own(k, v)
        for step in ring.backward_steps:
            got = ring.step(step, held, k, "backward")
            for (payload, rows), kv in got.items():
                if payload != "kv":
                    continue
                k_t, v_t = kv.chunk(2, -1)
                dq_t, dk_t, dv_t = tile_backward(q, k_t, v_t, ring.masks[rows], scale, out,
                                                 lse, grad_out)
                dq += dq_t
                partial = torch.cat([dk_t, dv_t], -1)  # this rank's share of the owner's dK/dV
                if ("dkv", rows) in got:
                    partial += got[("dkv", rows)]
                held[("kv", rows)], held[("dkv", rows)] = kv, partial
            home = got.get(("dkv", ring.own_rows))  # the last hop: everyone's dK/dV of my rows
            if home is not None:
                dk_home, dv_home = home.chunk(2, -1)
                dk.index_add_(2, ring.own_index, dk_home)
                dv.index_add_(2, ring.own_index, dv_home)
        return dq, dk, dv, None, None
