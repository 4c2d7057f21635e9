"""One training step as ops on the representative ranks of one context group: what runs, not how fast.

The representative ranks are the max(cp, bp) ranks that share one sequence; their DP, EP and TP
peers run the same ops on other data, so they are copies (symmetry). An op holds one size per
representative rank (ranks differ in positions, blocks and pairs), so the op list is one
structure for the whole group and the engines evaluate it for all ranks at once.

Compute ops carry FLOPs, HBM bytes, a kind and (attention) a tile length; communication ops carry
the bytes each rank receives, the collective, the group (its size, whether it spans nodes, and
which representative ranks wait for each other) and a traffic category. Attention K/V bytes are
the Layout's exchanges, counted per rank from its ownership (`kv_rows`, which the tests hold equal
to the exchanges' transfers; listing n(n-1) transfers per layer kind costs more than the step).
Dependencies are data dependencies; the order of `ops` is program order, which is also each
stream's issue order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple, Union

import numpy as np

from csbp.simulator import kv_rows, mask, pairs
from csbp.simulator.implementation import DEFAULT_IMPLEMENTATION, Implementation, Pass, load_implementation
from csbp.simulator.layout import Layout, kv_row_bytes
from csbp.simulator.tiles import tile_counts, tiles_aligned
from csbp.simulator.layout import clear_caches as clear_layout_caches
from csbp.simulator.objective_layout import anchor_blocks, canvas_view
from csbp.simulator.objectives import ObjectiveShape, batch_rows, objective_shape
from csbp.simulator.pairs import QueryIntervals, pairs_with_keys  # noqa: F401 (pairs_with_keys: re-exported)
from csbp.simulator.plan import Plan
from csbp.simulator.spans import Span, normalize
from csbp.simulator.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload import Workload

ComputeKind = Literal["gemm", "attention-fwd", "attention-bwd", "elementwise", "optimizer", "storage-read"]
Collective = Literal["all-gather", "reduce-scatter", "all-reduce", "all-to-all", "p2p"]
Category = Literal["attention-kv", "gradients", "tp", "ep", "params", "other"]
Phase = Literal["data", "forward", "recompute", "backward", "grad-sync", "optimizer", "param-sync"]

# FlashAttention backward does 5 matmuls against the forward's 2 (FlashAttention-2 paper, sec. 3).
ATTENTION_BACKWARD_FLOP_RATIO = 2.5
# Combining partial attention by LSE (out = w out_a + w_b out_b, lse = logaddexp): forward reads
# both partial outputs and writes one, backward reads the output gradient and writes both
# partial ones and the output; in query x head x head_dim elements (the LSEs are 1/head_dim).
MERGE_FORWARD_PASSES, MERGE_BACKWARD_PASSES = 3, 4
# Training does dgrad + wgrad: a linear layer's backward is twice its forward.
GEMM_BACKWARD_FLOP_RATIO = 2.0
# Query/key tile of FA3 at head dim <= 256 (kBlockM = 128): masks not aligned to it waste work.
ATTENTION_KERNEL_TILE = 128
# Chunk length of the chunked (gated) delta rule in flash-linear-attention (chunk_size = 64).
DELTA_RULE_CHUNK = 64
# Bytes per element of a linear-attention recurrent state passed between ranks: fp32, as chunked
# delta-rule kernels keep their state (assumed [U]; bf16 would halve the boundary-state traffic).
LINEAR_STATE_BYTES = 4
# Fused AdamW per parameter: reads fp32 master, m, v and a bf16 grad, writes master, m, v and the
# bf16 weight: 3*4+2 bytes each way.
ADAMW_BYTES_PER_PARAM = 28
LOSS_BYTES = 4  # the step's loss, fp32
COUNT_BYTES = 8  # a row count of the EP dispatch, int64

PerRank = tuple[float, ...]


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


@dataclass(frozen=True)
class Comm:
    collective: Collective
    bytes: PerRank  # received per rank
    group: Group
    category: Category
    peer: tuple[int, ...] = ()  # p2p: the rank each one receives from; both ends must be there


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
        return "comm" if isinstance(self.work, Comm) else "compute"


@dataclass(frozen=True)
class StepGraph:
    """The ops of one training step for the representative ranks of one context group."""

    ranks: int
    ops: tuple[Op, ...]
    model_flops: float  # FLOPs of the step's math for one context group, once, without recompute
    views: int = 1  # layout sequences per example the step runs: rows x passes (objective)
    notes: tuple[str, ...] = field(default=())
    _arrays: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(cls, model: ModelSpec, workload: Workload, plan: Plan, layout: Layout,
              gpus_per_node: int, one_bucket: bool = False, keys_at_home: bool = False,
              implementation: "Implementation | str | None" = None) -> "StepGraph":
        """`one_bucket`: reduce all gradients in one call after the backward pass, as a step
        that overlaps nothing does (per-layer buckets exist to hide behind the next layer's
        backward; without overlap each would only add a call's latency).

        `keys_at_home`: every attention call reads all its keys where it runs, one call per layer
        and pass (no K/V exchange, no merge, no packing): the least attention compute the plan's
        ownership allows, for the planner's lower bounds (`bounds.py`); not a step that runs.

        `implementation`: what the framework executes per plan family (kernels, call split,
        waits, copies, padding; `implementation.py`); default `turbo-dllm`.

        The builder sees the batch as the GPU runs it (`objectives.batch_rows`: an objective's
        rows per example are rows of the batch)."""
        return _Builder(model, batch_rows(workload, model), plan, layout, gpus_per_node,
                        one_bucket=one_bucket, keys_at_home=keys_at_home,
                        implementation=implementation).build()

    def flops(self, include_recompute: bool = True) -> np.ndarray:
        """FLOPs each representative rank executes in one step."""
        works, which = self.works()
        counted = [i for i, op in enumerate(self.ops) if isinstance(op.work, Compute)
                   and (include_recompute or op.phase != "recompute")]
        rows = np.array([w.flops if isinstance(w, Compute) else (0.0,) * self.ranks for w in works])
        return rows[which[counted]].sum(axis=0) if counted else np.zeros(self.ranks)

    def received_bytes(self) -> dict[str, np.ndarray]:
        """Bytes each representative rank receives per step, by traffic category."""
        works, which = self.works()
        rows = np.array([w.bytes for w in works]) if works else np.zeros((0, self.ranks))
        by_category: dict[str, list[int]] = {}
        for i, op in enumerate(self.ops):
            if isinstance(op.work, Comm):
                by_category.setdefault(op.work.category, []).append(i)
        return {c: rows[which[ops]].sum(axis=0) for c, ops in by_category.items()}

    def works(self) -> tuple[list[Work], np.ndarray]:
        """The distinct work objects (identical layers share them) and, per op, its index among
        them: what is priced, summed or compiled once per work instead of once per op."""
        if "works" not in self._arrays:
            row: dict[int, int] = {}
            works: list[Work] = []
            which = []
            for op in self.ops:
                key = id(op.work)
                if key not in row:
                    row[key] = len(works)
                    works.append(op.work)
                which.append(row[key])
            self._arrays["works"] = (works, np.array(which, dtype=np.intp))
        return self._arrays["works"]


# ---- placement: which ranks of a group share a node --------------------------------------------
def group_on_nodes(plan: Plan, gpus_per_node: int, axes: tuple[str, ...],
                   ctx_block: int | None = None) -> tuple[int, int]:
    """(size, fewest members on one node over all instances) of the groups spanning `axes`.

    Global ranks follow `plan.placement`, innermost axis first. `ctx_block` splits the context
    axis into consecutive sub-groups of that size (the cp groups of CSBP).
    """
    return _placed_group((plan.tp, plan.ctx, plan.ep, plan.dp), plan.placement, gpus_per_node,
                         axes, ctx_block)


@functools.lru_cache(maxsize=1024)
def _placed_group(degrees: tuple[int, ...], placement: str, gpus_per_node: int,
                  axes: tuple[str, ...], ctx_block: int | None) -> tuple[int, int]:
    """`group_on_nodes` from the degrees alone: plans differing in transport or schedule share it."""
    dims = dict(zip(("tp", "ctx", "ep", "dp"), degrees))
    order = placement.split(",")
    coords = np.indices([dims[a] for a in order]).reshape(len(order), -1)
    strides = np.cumprod([1] + [dims[a] for a in order[:-1]])
    node = (strides[:, None] * coords).sum(axis=0) // gpus_per_node
    key = np.zeros(coords.shape[1], dtype=np.int64)
    for i, a in enumerate(order):
        if a not in axes:
            key = key * dims[a] + coords[i]
    n = int(np.prod([dims[a] for a in axes]))
    if ctx_block is not None and "ctx" in axes:
        ci = order.index("ctx")
        key = key * dims["ctx"] + coords[ci] // ctx_block
        n = n // dims["ctx"] * ctx_block
    _, counts = np.unique(key * (int(node.max()) + 1) + node, return_counts=True)
    return n, int(counts.min())


@functools.lru_cache(maxsize=64)
def _sequence_pairs(seq_len: int, block: int, window: int | None) -> int:
    return QueryIntervals(((0, 2 * seq_len),), seq_len, block, window).total()  # = mask.pairs


def delta_rule_flops_per_token(head_dim_k: int, head_dim_v: int, chunk: int = DELTA_RULE_CHUNK) -> float:
    """Forward FLOPs per token and value head of the chunked (gated) delta rule.

    Per chunk of C tokens (Yang et al., arXiv 2406.06484 / 2412.06464): K K^T (2C^2 dk), the
    triangular solve (~2C^3/3), W = T K and U = T V (2C^2 dk + 2C^2 dv), the state terms W S,
    Q S and the update K^T V' (3 x 2C dk dv), and the intra-chunk Q K^T and its product with V'
    (2C^2 dk + 2C^2 dv); divided by C.
    """
    c, dk, dv = chunk, head_dim_k, head_dim_v
    return 6 * c * dk + 4 * c * dv + 2 * c * c / 3 + 6 * dk * dv


# ---- the builder --------------------------------------------------------------------------------
Deps = tuple[int, ...]


class _Builder:
    """Appends the ops of one step in program order; each helper returns the ops that end it."""

    def __init__(self, model: ModelSpec, workload: Workload, plan: Plan, layout: Layout,
                 gpus_per_node: int, ops: list | None = None, notes: list | None = None,
                 one_bucket: bool = False, keys_at_home: bool = False,
                 implementation: "Implementation | str | None" = None) -> None:
        self.m, self.w, self.p, self.lay = model, workload, plan, layout
        self.impl = load_implementation(implementation or DEFAULT_IMPLEMENTATION)
        self.family = self.impl.family(layout.kind, plan.transport)
        self.one_bucket = one_bucket
        self.keys_at_home = keys_at_home
        self.obj: ObjectiveShape = objective_shape(workload, model, plan)
        self.gpn = gpus_per_node
        self.n = layout.size
        self.dt = workload.dtype_bytes
        self.tp = plan.tp
        mb = workload.micro_batch
        self.positions = kv_rows.held(layout, "positions").astype(float)
        self.tokens = self.positions * mb
        self.noisy = kv_rows.held(layout, "noisy").astype(float) * mb
        # drafters: target-feature tokens the rank turns into K/V (keys only, not queries)
        self.context = kv_rows.held(layout, "context").astype(float) * mb \
            if self.obj.context_as_kv else np.zeros(self.n)
        self.ops: list[Op] = [] if ops is None else ops  # a sub-pass appends to its parent's ops
        self.notes: list[str] = [] if notes is None else notes
        self._cache: dict = {}
        self._layers: dict[tuple, _LayerTemplate | tuple | None] = {}
        every = tuple(range(self.n))
        self.cp_sync = layout.cp_groups()
        self.g_tp = self._group(("tp",), tuple((r,) for r in every))
        self.g_ep = self._group(("ep",), tuple((r,) for r in every))
        self.g_cp = self._group(("ctx",), self.cp_sync, ctx_block=len(self.cp_sync[0]))
        # A ring over a cp group that spans nodes has a pair that does: price its steps there.
        self.g_ring = Group(2, 1 if self.g_cp.spans_nodes else 2, tuple((r,) for r in every))
        self.g_dense = self._group(("dp", "ctx", "ep"), (every,))
        self.g_expert = self._group(("dp", "ctx", "tp"), (every,))

    def _group(self, axes, sync, ctx_block=None) -> Group:
        n, per_node = group_on_nodes(self.p, self.gpn, axes, ctx_block)
        return Group(n, per_node, sync)

    # -- small constructors -------------------------------------------------------------------
    def add(self, name: str, phase: Phase, layer: int | None, work: Work | None, *deps: Deps) -> Deps:
        """Append an op after `deps`; with no work (None) the deps pass through unchanged."""
        flat = tuple(sorted({d for ds in deps for d in ds}))
        if work is None:
            return flat
        self.ops.append(Op(len(self.ops), name, phase, layer, work, flat))
        return (len(self.ops) - 1,)

    def derived(self, key, make):
        """Counts that depend only on the layout's shares, made once per layout ownership (many
        candidates of a search share it)."""
        if key not in self.lay.derived:
            self.lay.derived[key] = make()
        return self.lay.derived[key]

    def cached(self, key, make):
        """Identical layers share their work objects (and the engines price each once)."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def per_rank(self, values) -> PerRank:
        if np.ndim(values) == 0:
            return (float(values),) * self.n
        return tuple(np.asarray(values, dtype=float).tolist())

    def gemm(self, flops, kernels: int = 1) -> Compute:
        return Compute("gemm", self.per_rank(flops), self.per_rank(0), kernels)

    def memory_bound(self, nbytes, kind: ComputeKind = "elementwise") -> Compute:
        return Compute(kind, self.per_rank(0), self.per_rank(nbytes))

    def comm(self, collective: Collective, recv, group: Group, category: Category,
             peer: tuple[int, ...] = ()) -> Comm | None:
        recv = self.per_rank(recv)
        if group.size <= 1 or not any(recv):
            return None
        return Comm(collective, recv, group, category, peer)

    @staticmethod
    def ring_share(group: Group) -> float:
        """Fraction of a buffer each member receives in a ring all-gather / reduce-scatter."""
        return (group.size - 1) / group.size

    def tp_collective(self, collective: Collective, tokens=None) -> Comm | None:
        """Sequence-parallel all-gather / reduce-scatter of hidden states (tokens x hidden)."""
        if tokens is None:  # every layer's: one work object (the engines price it once)
            return self.cached(("tp", collective), lambda: self.tp_collective(collective, self.tokens))
        return self.comm(collective, tokens * self.m.hidden * self.dt * self.ring_share(self.g_tp),
                         self.g_tp, "tp")

    def mlp_collective(self, collective: Collective) -> Comm | None:
        """The MLP's sequence-parallel boundary; a MoE without a dense branch has none (its experts
        take the shard's own tokens)."""
        moe = self.m.moe
        return None if moe and not moe.dense_ffn else self.tp_collective(collective)

    # -- sizes of one layer kind ----------------------------------------------------------------
    def mixer_gemms(self, a: AttentionSpec) -> tuple[np.ndarray, np.ndarray]:
        """Forward FLOPs of the input projections and of the output projection, per rank."""
        out_params = a.n_heads * a.head_dim * self.m.hidden
        in_params = self.m.mixer_params(a) - out_params
        return 2 * self.tokens * in_params / self.tp, 2 * self.tokens * out_params / self.tp

    def norm_bytes(self, a: AttentionSpec) -> np.ndarray:
        """Forward bytes of a layer's memory-bound ops, half before and half after attention.

        Per token: 2 RMSNorms (read + write h), RoPE on q and k (read + write), 2 residual adds
        (read 2h, write h), the SwiGLU product (read 2 ffn, write ffn); sharded over TP/SP.
        """
        m, h = self.m, self.m.hidden
        ffn = m.moe.dense_ffn + m.moe.top_k * m.moe.expert_ffn if m.moe else m.ffn
        per_token = 4 * h + 2 * (a.n_heads * a.head_dim + a.kv_width) + 6 * h + 3 * ffn
        return self.tokens * per_token * self.dt / self.tp / 2

    def local_keys(self, rank: int) -> tuple[Span, ...]:
        """Keys a rank has without any exchange: its own positions and the K/V rows it owns."""
        share = self.lay.shares[rank]
        return normalize(share.positions + share.owned_kv)

    def facts(self, phase: Phase) -> Pass:
        """What the implementation runs for this plan family's attention in `phase`."""
        return self.family.phase(phase)

    def cut(self, pattern: str, phase: Phase) -> str:
        """How the phase's attention is cut into calls: `none` (one call, keys at home), `ring`
        (one call per step), or the implementation's split of a collective."""
        if pattern in ("none", "ring"):
            return pattern
        return self.facts(phase).split

    def split(self, a: AttentionSpec, pattern: str, cut: str | None = None) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """The layer kind's attention split, counted once per layout ownership: it depends only on
        the shares, the window and the cut, which most candidates of a search share."""
        window = a.window if a.kind == "sliding" else None
        cut = cut or ("local-remote" if pattern not in ("none", "ring") else pattern)
        return self.derived(("attention-split", window, pattern, cut),
                            lambda: self.attention_split(a, window, pattern, cut))

    def attention_split(self, a: AttentionSpec, window: int | None, pattern: str,
                        cut: str = "local-remote") -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(name, pairs, keys in the call) per rank, by where the keys come from.

        `whole`: one call over every key after the exchange; `local-remote`: the rank's own
        positions and owned rows apart from the rows it receives; `noisy-prefix`: the noisy
        queries over their own blocks apart from every query over the clean prefix; a ring
        splits the rest by step (the shard of the rank s places back in the ring).
        """
        lay = self.lay
        total = self.derived(("pairs", window), lambda: pairs.totals(lay, window)).astype(float)
        if pattern == "none":
            return [("attn", total, self.positions)]
        queries = [QueryIntervals.of(lay, r, window) for r in range(self.n)]
        if pattern != "ring":
            received = kv_rows.received(lay, a, "forward").astype(float)
            if cut == "whole":
                return [("attn", total, self.positions + received)]
            if cut == "noisy-prefix":
                own = [self.noisy_spans(r) for r in range(self.n)]
                block = np.array([queries[r].pairs_with(own[r]) for r in range(self.n)], dtype=float)
                noisy = np.array([sum(z - q for q, z in own[r]) for r in range(self.n)], dtype=float)
                clean = self.positions - noisy + received
                return [("attn.noisy-block", block, noisy), ("attn.prefix", total - block, clean)]
            local = np.array([queries[r].pairs_with(self.local_keys(r)) for r in range(self.n)], dtype=float)
            return [("attn.local", local, self.positions), ("attn.remote", total - local, received)]
        local = np.array([queries[r].pairs_with(self.local_keys(r)) for r in range(self.n)], dtype=float)
        parts = [("attn.local", local, self.positions)]
        owned = kv_rows.owned_rows(lay).astype(float)
        m = len(self.cp_sync[0])
        step_pairs = np.zeros((m, self.n))  # [s, rank]: pairs with the shard s places back
        step_keys = np.zeros((m, self.n))
        for g in self.cp_sync:
            shards = [lay.shares[r].owned_kv for r in g]
            back = (np.arange(m)[:, None] - np.arange(m)[None, :]) % m  # [i, s] -> member i - s
            for i, r in enumerate(g):
                with_each = queries[r].pairs_with_each(shards)  # pairs with member j's shard
                step_pairs[:, r] = with_each[back[i]]
                step_keys[:, r] = owned[np.array(g)[back[i]]]
        for s in range(1, m):
            parts.append((f"attn.ring{s}", step_pairs[s], step_keys[s]))
        return parts

    def noisy_spans(self, rank: int) -> tuple[Span, ...]:
        """The noisy positions a rank holds (whole blocks under BP/CSBP)."""
        L = self.lay.seq_len
        return tuple((a, min(z, L)) for a, z in self.lay.shares[rank].positions if a < L)

    def call_spans(self, rank: int, name: str) -> tuple[tuple[Span, ...], tuple[Span, ...]]:
        """(query spans, key spans) of one named call of a rank, for counting its kernel tiles."""
        L2 = 2 * self.lay.seq_len
        everything = ((0, L2),)
        positions = self.lay.shares[rank].positions
        if name == "attn":
            return positions, everything
        if name == "attn.local":
            return positions, self.local_keys(rank)
        if name == "attn.remote":
            local, out, at = self.local_keys(rank), [], 0
            for a, z in local:
                if a > at:
                    out.append((at, a))
                at = z
            return positions, tuple(out) + (((at, L2),) if at < L2 else ())
        if name == "attn.noisy-block":
            own = self.noisy_spans(rank)
            return own, own
        if name == "attn.prefix":
            return positions, ((self.lay.seq_len, L2),)
        raise KeyError(name)

    def tiles(self, a: AttentionSpec, name: str, pack: bool, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(full, partial) kernel tiles per rank of one call, in tiles per query head (per K/V
        head when GQA heads are packed: then a tile holds 128 / group positions), or None for a
        ring step (priced by pairs, its masked flag standing for partial tiles) [U]."""
        if name.startswith("attn.ring"):
            return None
        window = a.window if a.kind == "sliding" else None
        group = max(1, a.n_heads // max(a.n_kv_heads, 1)) if pack else 1
        rows = max(1, ATTENTION_KERNEL_TILE // group)

        def count():
            out = np.zeros((2, self.n))
            for r in range(self.n):
                q, k = self.call_spans(r, name)
                if tiles_aligned(q, k, self.lay.seq_len, self.lay.block, window, rows, ATTENTION_KERNEL_TILE):
                    out[0, r] = pairs[r] / (rows * ATTENTION_KERNEL_TILE)  # every touched tile is full
                else:
                    out[:, r] = tile_counts(q, k, self.lay.seq_len, self.lay.block, window, rows,
                                            ATTENTION_KERNEL_TILE)
            return out
        return self.derived(("tiles", name, window, rows), count)

    def attention_work(self, a: AttentionSpec, part: tuple, backward: bool, kernel: str = "best",
                       pack: bool = False) -> Compute:
        """pairs x 4 x head_dim x heads/tp forward (QK^T and PV), 2.5x that backward; and the
        same for the kernel tiles the call really computes (`tiles.py`)."""
        name, pairs, keys = part
        per_pair = self.w.micro_batch * 4 * a.head_dim * a.n_heads / self.tp
        if backward:
            per_pair *= ATTENTION_BACKWARD_FLOP_RATIO
        queries = self.noisy / self.w.micro_batch if name == "attn.noisy-block" else self.positions
        tile = pairs / np.maximum(queries, 1)
        masked = a.kind == "sliding" or self.w.block_size % ATTENTION_KERNEL_TILE != 0
        counted = self.tiles(a, name, pack, pairs)
        full = partial = ()
        if counted is not None:
            heads = (a.n_kv_heads if pack else a.n_heads) / self.tp
            per_tile = self.w.micro_batch * 4 * ATTENTION_KERNEL_TILE ** 2 * a.head_dim * heads
            if backward:
                per_tile *= ATTENTION_BACKWARD_FLOP_RATIO
            full, partial = self.per_rank(counted[0] * per_tile), self.per_rank(counted[1] * per_tile)
        return Compute("attention-bwd" if backward else "attention-fwd", self.per_rank(pairs * per_pair),
                       self.per_rank(0), 1, self.per_rank(tile), masked,
                       self.per_rank(queries * keys * per_pair), kernel, full, partial)

    def kv_comm(self, a: AttentionSpec, phase: Phase, step: int, payload: str | None) -> Comm | None:
        """The K/V (or dK/dV) rows one step of a layout exchange delivers to each rank (counted
        from the ownership by `kv_rows`, equal to the exchange's transfers). An implementation
        that pads collectives sizes every member's buffer by the group's largest shard; dK/dV
        travel in its gradient dtype."""
        rows = kv_rows.step_received(self.lay, a, phase, step, payload)
        pattern = self.pattern(a, phase)
        facts = self.facts(phase)
        if pattern == "all-gather" and facts.pad_to_largest_shard:
            rows = self.padded_rows()
        gradients = phase == "backward" and (pattern != "ring" or payload == "dkv")
        dt = facts.gradient_bytes or self.dt if gradients else self.dt
        nbytes = rows * kv_row_bytes(a, dt, self.tp) * self.w.micro_batch
        if pattern == "ring":
            return self.comm("p2p", nbytes, self.g_ring, "attention-kv", kv_rows.ring_senders(self.lay))
        collective = "all-to-all" if pattern == "all-to-all" else (
            "reduce-scatter" if phase == "backward" else "all-gather")
        return self.comm(collective, nbytes, self.g_cp, "attention-kv")

    def padded_rows(self) -> np.ndarray:
        """Rows each member receives in an all-gather padded to its group's largest shard."""
        owned = kv_rows.owned_rows(self.lay).astype(float)
        out = np.zeros(self.n)
        for g in self.cp_sync:
            idx = list(g)
            out[idx] = (len(g) - 1) * owned[idx].max()
        return out

    def ulysses(self, a: AttentionSpec) -> tuple[Comm | None, Comm | None]:
        """Linear attention under CP/CSBP: sequence->head all-to-all of the clean rows' q, k, v,
        and back for their output; noisy blocks stay with their owners (`boundary_states`)."""
        if self.lay.kind not in ("cp", "csbp"):
            return None, None
        n = len(self.cp_sync[0])
        width_in = 2 * a.n_kv_heads * a.head_dim + a.n_heads * a.head_dim
        width_out = a.n_heads * a.head_dim
        clean = self.tokens - self.noisy
        recv = lambda width: clean * width * self.dt / self.tp * (n - 1) / n  # noqa: E731
        return (self.comm("all-to-all", recv(width_in), self.g_cp, "other"),
                self.comm("all-to-all", recv(width_out), self.g_cp, "other"))

    def boundary_states(self, a: AttentionSpec) -> Comm | None:
        """Linear attention under CP/CSBP: the clean prefix's recurrent and conv state at every
        block boundary, computed head-sharded, routed to the owners of the noisy blocks that
        restart from them: an all-to-all to the block owners, an all-gather of every boundary
        when bp = 1 (implementation.md section 4, Fast-dLLM v2's Gated-DeltaNet layers). In
        backward the state gradients go back the same way. Block 0 starts from zero.

        A state is heads x dk x dv in fp32 (the chunked kernels' state dtype, assumed [U]) plus
        the conv's last conv_kernel - 1 inputs in the compute dtype, split over TP by heads.
        """
        if self.lay.kind not in ("cp", "csbp"):
            return None
        n = len(self.cp_sync[0])
        conv = max(a.conv_kernel - 1, 0) * (2 * a.n_kv_heads + a.n_heads) * a.head_dim * self.dt
        state = (a.n_heads * a.head_dim * a.head_dim * LINEAR_STATE_BYTES + conv) / self.tp
        if self.lay.kind == "cp":  # noisy rows are zigzag shards, not blocks: every boundary
            blocks = np.full(self.n, self.w.n_blocks - 1, dtype=float)
            collective: Collective = "all-gather"
        else:
            blocks = np.array([len(s.noisy_blocks) - (0 in s.noisy_blocks) for s in self.lay.shares], dtype=float)
            collective = "all-to-all"
        return self.comm(collective, blocks * state * self.w.micro_batch * (n - 1) / n, self.g_cp, "other")

    def delta_rule(self, a: AttentionSpec, backward: bool, rows: str = "all") -> Compute:
        """Chunked Gated-DeltaNet: FLOPs linear in tokens, run as a fused kernel on chunk tiles,
        over the rank's rows: "all", or (CP/CSBP) the "clean" ones head-sharded after the
        all-to-all or the "noisy" blocks at their owners."""
        tokens = {"all": self.tokens, "clean": self.tokens - self.noisy, "noisy": self.noisy}[rows]
        flops = tokens * a.n_heads / self.tp * delta_rule_flops_per_token(a.head_dim, a.head_dim)
        if backward:
            flops = flops * ATTENTION_BACKWARD_FLOP_RATIO
        return Compute("attention-bwd" if backward else "attention-fwd", self.per_rank(flops),
                       self.per_rank(0), 1, self.per_rank(DELTA_RULE_CHUNK), False)

    def linear_forward(self, li: int, a: AttentionSpec, phase: Phase, x: Deps) -> Deps:
        """Gated-DeltaNet in forward or recompute: under CP/CSBP the clean rows go head-sharded
        through the delta rule, their boundary states travel to the noisy blocks' owners, and
        each noisy block restarts from its state where it lives."""
        c = self.cached
        a2a_in, a2a_out = c(("ulysses", a), lambda: self.ulysses(a))
        if self.lay.kind not in ("cp", "csbp"):
            return self.add("delta-rule", phase, li, c(("dr", a, False), lambda: self.delta_rule(a, False)), x)
        x = self.add("lin.a2a-in", phase, li, a2a_in, x)
        clean = self.add("delta-rule.clean", phase, li, c(("dr-clean", a, False), lambda: self.delta_rule(
            a, False, "clean")), x)
        states = self.add("lin.states", phase, li, c(("states", a), lambda: self.boundary_states(a)), clean)
        out = self.add("lin.a2a-out", phase, li, a2a_out, clean)
        noisy = self.add("delta-rule.noisy", phase, li, c(("dr-noisy", a, False), lambda: self.delta_rule(
            a, False, "noisy")), states)
        return out + noisy

    def linear_backward(self, li: int, a: AttentionSpec, x: Deps) -> Deps:
        """The backward of `linear_forward`: the noisy blocks' state gradients go home to the
        rows that computed the states before the clean rows' backward can finish."""
        c, ph = self.cached, "backward"
        a2a_in, a2a_out = c(("ulysses", a), lambda: self.ulysses(a))
        if self.lay.kind not in ("cp", "csbp"):
            return self.add("delta-rule-bwd", ph, li, c(("dr", a, True), lambda: self.delta_rule(a, True)), x)
        out = self.add("lin.a2a-out-bwd", ph, li, a2a_out, x)
        noisy = self.add("delta-rule-bwd.noisy", ph, li, c(("dr-noisy", a, True), lambda: self.delta_rule(
            a, True, "noisy")), x)
        dstates = self.add("lin.states-bwd", ph, li, c(("dstates", a), lambda: self.state_gradients(a)), noisy)
        clean = self.add("delta-rule-bwd.clean", ph, li, c(("dr-clean", a, True), lambda: self.delta_rule(
            a, True, "clean")), out, dstates)
        return self.add("lin.a2a-in-bwd", ph, li, a2a_in, clean)

    def state_gradients(self, a: AttentionSpec) -> Comm | None:
        """Boundary-state gradients home: the reverse all-to-all, or a reduce-scatter of the
        all-gathered boundaries when bp = 1 (the same bytes)."""
        fwd = self.boundary_states(a)
        if fwd is None or fwd.collective == "all-to-all":
            return fwd
        return replace(fwd, collective="reduce-scatter")

    # -- one layer ----------------------------------------------------------------------------
    def layer(self, li: int, a: AttentionSpec, phase: Phase, x: Deps) -> Deps:
        """Append layer li in `phase` (forward, recompute or backward).

        Layers of one kind append the same ops, so the first is built and the rest are stamped
        from it with shifted indices: the builder's logic runs once per kind, not once per layer.
        """
        key = (a, phase)
        template = self._layers.get(key)
        if isinstance(template, tuple):  # the second layer of its kind: record the first now
            start, end, first_x, first_out = template
            template = self._layers[key] = _LayerTemplate.record(self.ops[start:end], start, first_x,
                                                                 first_out)
        if template is not None:
            return template.stamp(self.ops, li, x)
        start = len(self.ops)
        out = self.layer_backward(li, a, x) if phase == "backward" else self.layer_forward(li, a, phase, x)
        if x and key not in self._layers:  # with no input, which ops wait for it cannot be seen
            self._layers[key] = (start, len(self.ops), x, out)  # recorded if a second one comes
        return out

    def layer_forward(self, li: int, a: AttentionSpec, phase: Phase, x: Deps) -> Deps:
        c = self.cached
        norm_work = c(("norm", a), lambda: self.memory_bound(self.norm_bytes(a)))
        f_in, f_out = c(("mix", a), lambda: self.mixer_gemms(a))
        x = self.add("attn-in.ag", phase, li, self.tp_collective("all-gather"), x)
        x = self.add("norm-rope", phase, li, norm_work, x)
        x = self.add("qkv", phase, li, c(("qkv", a), lambda: self.gemm(f_in)), x)
        x = self.add("context-kv", phase, li, c(("ctx-kv", a), lambda: self.context_kv(a, 1.0)), x)
        if a.kind == "linear":
            x = self.linear_forward(li, a, phase, x)
        else:
            x = self.attention_forward(li, a, phase, x)
        x = self.add("out-proj", phase, li, c(("out", a), lambda: self.gemm(f_out)), x)
        x = self.add("attn-out.rs", phase, li, self.tp_collective("reduce-scatter"), x)
        x = self.add("mlp-in.ag", phase, li, self.mlp_collective("all-gather"), x)
        x = self.add("norm-swiglu", phase, li, norm_work, x)
        x = self.ffn(li, phase, x, backward=False)
        return self.add("mlp-out.rs", phase, li, self.mlp_collective("reduce-scatter"), x)

    def attend(self, li: int, a: AttentionSpec, phase: Phase, pattern: str, part: int, *deps: Deps) -> Deps:
        """Append attention of the rank's queries over one key part of the layer kind's split,
        on the kernel family the implementation runs for that call."""
        backward = phase == "backward"
        cut = self.cut(pattern, phase)
        split = self.split(a, pattern, cut)
        name = split[part][0]
        call = "ring" if name.startswith("attn.ring") else name.removeprefix("attn.")
        if self.keys_at_home:  # the bound: the fastest kernel, GQA packed (fewest tiles)
            kernel, pack = "best", True
        else:
            facts = self.facts(phase)
            kernel, pack = facts.kernel(call), facts.packs(call)
        work = self.cached(("attn", a, pattern, cut, part, backward, kernel, pack),
                           lambda: self.attention_work(a, split[part], backward, kernel, pack))
        return self.add(name, phase, li, work, *deps)

    def merge(self, li: int, a: AttentionSpec, phase: Phase, *deps: Deps) -> Deps:
        """Combine two partial attention outputs by their LSE (memory-bound, per query row)."""
        passes = MERGE_BACKWARD_PASSES if phase == "backward" else MERGE_FORWARD_PASSES
        work = self.cached(("merge", a, passes), lambda: self.memory_bound(
            passes * self.positions * self.w.micro_batch * a.n_heads / self.tp * a.head_dim * self.dt))
        return self.add("attn.merge", phase, li, work, *deps)

    def pack_kv(self, li: int, a: AttentionSpec, phase: Phase, *deps: Deps) -> Deps:
        """Copy the K/V rows a rank sends into one buffer (read + write; backward: their
        gradients added back into dK/dV). All-gather sends one shard to every member, so it is
        packed once."""
        nbytes = 2 * kv_rows.packed_rows(self.lay, a) * kv_row_bytes(a, self.dt, self.tp) * self.w.micro_batch
        work = self.cached(("pack", a, phase == "backward"), lambda: self.memory_bound(
            nbytes * (1.5 if phase == "backward" else 1.0)))
        return self.add("kv.pack", phase, li, work, *deps)

    def move_kv(self, name: str, li: int, a: AttentionSpec, phase: Phase, step: int,
                payload: str | None, *deps: Deps) -> Deps:
        """Append one step of the layer kind's K/V exchange in `phase` (rows from the layout)."""
        work = self.cached(("kv", a, phase, step, payload), lambda: self.kv_comm(a, phase, step, payload))
        return self.add(name, phase, li, work, *deps)

    def pattern(self, a: AttentionSpec, phase: Phase) -> str:
        return "none" if self.keys_at_home else kv_rows.pattern(self.lay, a, phase)

    def copies(self, name: str, li: int, a: AttentionSpec, phase: Phase, *deps: Deps) -> Deps:
        """Copies the implementation puts on the critical path around a collective: full passes
        (read + write) over every K/V row of the call, or their dK/dV in the gradient dtype."""
        facts = self.facts(phase)
        if not facts.copy_passes:
            return self.add(name, phase, li, None, *deps)
        backward = phase == "backward"
        dt = (facts.gradient_bytes or self.dt) if backward else self.dt
        rows = self.positions + kv_rows.received(self.lay, a, "forward")
        work = self.cached(("copies", a, phase), lambda: self.memory_bound(
            facts.copy_passes * 2 * rows * kv_row_bytes(a, dt, self.tp) * self.w.micro_batch))
        return self.add(name, phase, li, work, *deps)

    def attention_forward(self, li: int, a: AttentionSpec, phase: Phase, x: Deps) -> Deps:
        """Attention over keys at home runs while the rest arrive, unless the implementation
        waits on the exchange at once; the call over received keys waits for them."""
        pattern = self.pattern(a, phase)
        if pattern == "none":
            return self.attend(li, a, phase, pattern, 0, x)
        if pattern != "ring":
            gather = self.move_kv("kv.gather", li, a, phase, 0, None, self.pack_kv(li, a, phase, x))
            ready = self.copies("kv.reorder", li, a, phase, gather)
            if self.cut(pattern, phase) == "whole":
                return self.attend(li, a, phase, pattern, 0, x, ready)
            waited = ready if self.facts(phase).exchange == "immediate" else ()
            local = self.attend(li, a, phase, pattern, 0, x, waited)
            return self.merge(li, a, phase, self.attend(li, a, phase, pattern, 1, local, ready))
        # ring with two K/V buffers: step s lands once step s-2 has been consumed
        done, kv = [self.attend(li, a, phase, pattern, 0, x)], x
        for s in range(1, len(self.split(a, pattern))):
            kv = self.move_kv(f"kv.ring{s}", li, a, phase, s - 1, None, kv, done[s - 2] if s >= 2 else ())
            done.append(self.merge(li, a, phase, self.attend(li, a, phase, pattern, s, done[-1], kv)))
        return done[-1]

    def attention_backward(self, li: int, a: AttentionSpec, x: Deps) -> Deps:
        """Remote pairs first, so their dK/dV travel home while the local backward runs (unless
        the implementation waits on the reduce-scatter at once)."""
        ph: Phase = "backward"
        pattern = self.pattern(a, ph)
        if pattern == "none":
            return self.attend(li, a, ph, pattern, 0, x)
        if pattern != "ring":
            if self.cut(pattern, ph) == "whole":
                call = self.attend(li, a, ph, pattern, 0, x)
                scatter = self.move_kv("dkv.scatter", li, a, ph, 0, None, self.copies("dkv.copies", li, a, ph, call))
                return self.pack_kv(li, a, ph, scatter, call)
            remote = self.attend(li, a, ph, pattern, 1, self.merge(li, a, ph, x))
            scatter = self.move_kv("dkv.scatter", li, a, ph, 0, None, self.copies("dkv.copies", li, a, ph, remote))
            waited = scatter if self.facts(ph).exchange == "immediate" else ()
            local = self.attend(li, a, ph, pattern, 0, remote, waited)  # while dK/dV travel home
            return local + self.pack_kv(li, a, ph, scatter, local)
        # ring with two K/V buffers: K/V of step s land once step s-2 is consumed; the partial
        # dK/dV of a shard move on after the rank has added its share (step s-1), and the last
        # hop takes them home. K/V go first so they never queue behind a dK/dV hop.
        n = len(self.split(a, pattern))
        done = [self.attend(li, a, ph, pattern, 0, x)]
        kv = [(), self.move_kv("kv.ring1", li, a, ph, 0, "kv", x)]
        dkv: Deps = ()
        for s in range(1, n):
            if s + 1 < n:
                kv.append(self.move_kv(f"kv.ring{s + 1}", li, a, ph, s, "kv", kv[s], done[s - 1]))
            dkv = self.move_kv(f"dkv.ring{s}", li, a, ph, s - 1, "dkv", done[s - 1], dkv)
            done.append(self.attend(li, a, ph, pattern, s, done[s - 1], kv[s]))
        home = self.move_kv("dkv.ring-home", li, a, ph, n - 1, "dkv", done[-1], dkv)
        return done[-1] + home

    def ffn(self, li: int, phase: Phase, x: Deps, backward: bool) -> Deps:
        """Dense SwiGLU, or router + routed experts (EP all-to-all around them) + dense branch."""
        m, h = self.m, self.m.hidden
        ratio = GEMM_BACKWARD_FLOP_RATIO if backward else 1.0
        kernels = 4 if backward else 2  # gate+up and down GEMMs (dgrad and wgrad of each)
        if m.moe is None:
            return self.add("mlp", phase, li, self.cached(("mlp", backward), lambda: self.gemm(
                ratio * 2 * self.tokens * 3 * h * m.ffn / self.tp, kernels)), x)
        moe, ep = m.moe, self.p.ep
        tokens = self.tokens / self.tp  # each sequence-parallel shard routes its own tokens
        a2a = self.cached("ep-a2a", lambda: self.comm(
            "all-to-all", tokens * h * moe.top_k * self.dt * (ep - 1) / ep, self.g_ep, "ep"))
        router_ratio = 1.0 if backward and self.obj.frozen_router else ratio  # input gradient only
        router = self.add("router", phase, li, self.cached(("router", backward), lambda: self.gemm(
            router_ratio * 2 * tokens * h * moe.n_experts)), x)
        if not backward:  # each expert's row count to its owner, so it knows what will arrive
            router = self.add("ep.counts", phase, li, self.cached("ep-counts", lambda: self.comm(
                "all-to-all", moe.n_experts * COUNT_BYTES * (ep - 1) / ep, self.g_ep, "ep")), router)
        sent = self.add("ep.combine-grad" if backward else "ep.dispatch", phase, li, a2a, router)
        experts = self.add("experts", phase, li, self.cached(("experts", backward), lambda: self.gemm(
            ratio * 2 * tokens * moe.top_k * 3 * h * moe.expert_ffn,
            kernels * 3 // 2 * (moe.n_experts // ep))), router, sent)
        back = self.add("ep.dispatch-grad" if backward else "ep.combine", phase, li, a2a, experts)
        if not moe.dense_ffn:
            return back
        dense = self.add("dense-mlp", phase, li, self.cached(("dense", backward), lambda: self.gemm(
            ratio * 2 * self.tokens * 3 * h * moe.dense_ffn / self.tp, kernels)), experts)
        return dense + back

    def layer_backward(self, li: int, a: AttentionSpec, x: Deps) -> Deps:
        c, g = self.cached, GEMM_BACKWARD_FLOP_RATIO
        norm_work = c(("normb", a), lambda: self.memory_bound(2 * self.norm_bytes(a)))
        f_in, f_out = c(("mix", a), lambda: self.mixer_gemms(a))
        x = self.add("mlp-out.ag-bwd", "backward", li, self.mlp_collective("all-gather"), x)
        x = self.ffn(li, "backward", x, backward=True)
        x = self.add("norm-swiglu-bwd", "backward", li, norm_work, x)
        x = self.add("mlp-in.rs-bwd", "backward", li, self.mlp_collective("reduce-scatter"), x)
        x = self.add("attn-out.ag-bwd", "backward", li, self.tp_collective("all-gather"), x)
        x = self.add("out-proj-bwd", "backward", li, c(("outb", a), lambda: self.gemm(g * f_out, 2)), x)
        if a.kind == "linear":
            x = self.linear_backward(li, a, x)
        else:
            x = self.attention_backward(li, a, x)
        x = self.add("context-kv-bwd", "backward", li, c(("ctx-kvb", a), lambda: self.context_kv(a, g)), x)
        x = self.add("qkv-bwd", "backward", li, c(("qkvb", a), lambda: self.gemm(g * f_in, 2)), x)
        x = self.add("norm-rope-bwd", "backward", li, norm_work, x)
        return self.add("attn-in.rs-bwd", "backward", li, self.tp_collective("reduce-scatter"), x)

    # -- parameters and gradients -------------------------------------------------------------
    def layer_params(self, a: AttentionSpec) -> tuple[float, float]:
        """(dense, expert) parameters one rank holds of a layer: dense /tp, experts /ep; norms
        and the router whole (every rank routes its own tokens)."""
        m = self.m
        router = m.hidden * m.moe.n_experts if m.moe else 0
        dense = (m.mixer_params(a) + m.dense_ffn_params()) / self.tp + 2 * m.hidden + router
        return dense, (m.expert_params_per_layer() - router) / self.p.ep

    def sequence_parallel_params(self) -> float:
        """Weights every TP rank holds whole but applies to its own sequence shard (norms, a
        trained router): their gradients are partial sums over the TP group."""
        m = self.m
        router = m.hidden * m.moe.n_experts if m.moe and not self.obj.frozen_router else 0
        return m.n_layers * (2 * m.hidden + router) + m.hidden

    def edge_params(self) -> tuple[float, float]:
        """(LM head, embedding + final norm + conditioning) parameters one rank trains.

        A drafter's embedding and LM head are the frozen target's: only the norm and the
        conditioning projection remain.
        """
        m, tp = self.m, self.tp
        cond = (m.conditioning_layers * m.hidden ** 2) / tp + m.hidden
        if self.obj.frozen_embeddings:
            return 0.0, cond
        head = m.vocab * m.hidden / tp
        return head, m.embedding_params() / tp - head + cond

    def trained_params(self) -> tuple[float, float]:
        """(dense, expert) parameters one rank trains: every layer plus the edges."""
        layers = [self.layer_params(a) for a in self.m.layers]
        return sum(d for d, _ in layers) + sum(self.edge_params()), sum(e for _, e in layers)

    def grad_sync(self, layer: int | None, dense: float, expert: float, x: Deps) -> Deps:
        """Reduce one bucket of gradients over its data-parallel group (ZeRO >= 1: reduce-scatter)."""
        collective: Collective = "reduce-scatter" if self.w.zero_stage >= 1 else "all-reduce"
        out: Deps = ()
        for what, params, group in (("dense", dense, self.g_dense), ("experts", expert, self.g_expert)):
            share = self.ring_share(group) * (2 if collective == "all-reduce" else 1)
            work = self.cached(("grads", what, params), lambda: self.comm(
                collective, params * self.dt * share, group, "gradients"))
            out += self.add(f"grads.{what}.{collective}", "grad-sync", layer, work, x) if work else ()
        return out

    def param_gather(self, name: str, phase: Phase, layer: int | None, dense: float,
                     expert: float, x: Deps) -> Deps:
        """ZeRO: all-gather parameter shards (a layer's for ZeRO-3, all updated ones for 1/2)."""
        out: Deps = ()
        for what, params, group in (("dense", dense, self.g_dense), ("experts", expert, self.g_expert)):
            work = self.cached(("params", what, params), lambda: self.comm(
                "all-gather", params * self.dt * self.ring_share(group), group, "params"))
            out += self.add(f"{name}.{what}", phase, layer, work, x) if work else ()
        return out

    def optimizer(self) -> Compute:
        dense, expert = self.trained_params()
        if self.w.zero_stage >= 1:
            dense, expert = dense / self.g_dense.size, expert / self.g_expert.size
        return self.memory_bound((dense + expert) * ADAMW_BYTES_PER_PARAM, "optimizer")

    # -- objective-specific work -----------------------------------------------------------------
    def context_kv(self, a: AttentionSpec, ratio: float) -> Compute | None:
        """Drafter: K and V projections of the target-feature tokens a rank holds (x ratio backward)."""
        if not self.context.any() or a.kind == "linear":
            return None
        return self.gemm(ratio * 2 * self.context * self.m.hidden * a.kv_width * a.kv_tensors / self.tp,
                         a.kv_tensors * (2 if ratio > 1 else 1))

    def conditioning(self, backward: bool) -> Compute | None:
        """Drafter: fc projection of the concatenated target layers to the hidden size.

        The features are data (captured offline), so the backward is the weight gradient only.
        """
        if not self.context.any():
            return None
        return self.gemm(2 * self.context * self.m.conditioning_layers * self.m.hidden ** 2 / self.tp)

    def storage_read(self) -> Compute | None:
        """Stored inputs read inside the step (a drafter's offline target features): each rank
        reads the features of the context tokens it holds, at its share of the node's storage
        bandwidth, since every rank of a node reads at the step's start (implementation.md
        section 5: the measured step includes loading its data and target features).

        Which tokens a rank reads is an assumption [U]: the ones it turns into K/V (a loader that
        reads the whole example on every context rank reads cp x more); TP peers read the same.
        """
        per_token = self.obj.stored_bytes_per_token(self.m)
        if not per_token or not self.context.any():
            return None
        return Compute("storage-read", self.per_rank(0), self.per_rank(self.context * per_token),
                       readers=min(self.gpn, self.p.world))

    def canvas_sync(self, x: Deps) -> Deps:
        """Whether the self-conditioning pass runs is one MAX all-reduce of a flag over its sync
        group, every step (implementation.md section 4, DiffusionGemma)."""
        axis = self.obj.canvas_sync_axis
        if axis is None or not self.obj.canvas_passes:
            return x
        group = {"ep": self.g_ep}[axis]
        return self.add(f"selfcond.draw.{axis}-max", "forward", None, self.comm(
            "all-reduce", COUNT_BYTES * 2 * self.ring_share(group), group, "other"), x)

    def canvas_pass(self, x: Deps) -> Deps:
        """Self-conditioning: the expected share of a gradient-free forward of the canvas tokens,
        their LM head and softmax, and the soft embedding they feed, appended as work scaled by
        the pass's probability."""
        p = self.obj.canvas_passes
        sub = _Builder(self.m, self.w, self.p, canvas_view(self.lay), self.gpn, self.ops, self.notes,
                       keys_at_home=self.keys_at_home, implementation=self.impl)
        start = len(self.ops)
        for li, a in enumerate(self.m.layers):
            x = sub.layer(li, a, "forward", x)
        x = sub.loss_forward(x, sub.noisy)
        if self.obj.soft_embedding:
            x = sub.soft_embedding(x)
        scaled: dict[int, Work] = {}
        for op in self.ops[start:]:
            if id(op.work) not in scaled:
                scaled[id(op.work)] = _scaled(op.work, p)
            self.ops[op.index] = op._replace(name=f"selfcond.{op.name}", work=scaled[id(op.work)])
        return x

    def loss_rows(self) -> np.ndarray:
        """Rows the LM head and loss run on: the noisy tokens, and every clean row too when the
        objective adds an autoregressive loss on the clean stream (DiffusionGemma); a clean row
        replicated on several ranks (pure BP, CSBP's replicas) runs it on each [U]."""
        return self.tokens if self.obj.clean_loss else self.noisy

    def head_calls(self, per_block: int) -> int:
        """GEMM calls of the LM head: `per_block` per vocabulary block of the rank's V/tp."""
        blk = self.obj.vocab_block
        return per_block * (math.ceil(self.m.vocab / self.tp / blk) if blk else 1)

    def loss_forward(self, x: Deps, rows: np.ndarray | None = None) -> Deps:
        """Vocabulary-parallel LM head and cross-entropy over the loss rows (`loss_rows`)."""
        h, V = self.m.hidden, self.m.vocab
        rows = self.loss_rows() if rows is None else rows
        x = self.add("head-in.ag", "forward", None, self.tp_collective("all-gather", rows), x)
        x = self.add("lm-head", "forward", None, self.gemm(2 * rows * h * V / self.tp, self.head_calls(1)), x)
        # vocabulary-parallel cross-entropy: each row's max logit, then its target logit and sum
        # of exponentials, all-reduced over TP in fp32 (Megatron's algorithm)
        for name, values in (("max", 1), ("sums", 2)):
            x = self.add(f"cross-entropy.{name}.ar", "forward", None, self.comm(
                "all-reduce", rows * values * LOSS_BYTES * 2 * self.ring_share(self.g_tp),
                self.g_tp, "tp"), x)
        return self.add("cross-entropy", "forward", None, self.memory_bound(rows * V / self.tp * 4 * 3), x)

    def soft_embedding(self, x: Deps) -> Deps:
        """Self-conditioning's soft embedding: the canvas's probabilities times the embedding
        matrix, each TP rank over its V/tp rows, the partial sums reduce-scattered to the
        sequence shards as the embedding's are (implementation.md section 4, DiffusionGemma (2))."""
        h, V = self.m.hidden, self.m.vocab
        x = self.add("soft-embed", "forward", None, self.gemm(2 * self.noisy * h * V / self.tp), x)
        return self.add("soft-embed.rs", "forward", None, self.tp_collective("reduce-scatter", self.noisy), x)

    # -- the step ------------------------------------------------------------------------------
    def build(self) -> StepGraph:
        m, w, layers, obj = self.m, self.w, self.m.layers, self.obj
        h, V = m.hidden, m.vocab
        zero3, recompute = w.zero_stage == 3, w.checkpointing == "full"
        head_params, edge_params = self.edge_params()
        self.notes.extend(obj.notes)
        if any(a.kind == "linear" for a in layers) and self.lay.kind in ("cp", "csbp"):
            self.notes.append("linear-attention layers under CP/CSBP: sequence<->head all-to-all "
                              "of the clean rows' q, k, v and of their output over each cp group "
                              "(Ulysses-style), the chunked delta rule over the whole clean sequence "
                              "per head, its recurrent (fp32 [U]) and conv state at every block "
                              "boundary routed to the noisy blocks' owners (all-to-all; all-gather "
                              "when bp = 1, gradients back in backward), and each noisy block's "
                              "delta rule restarting from its state at its owner (implementation.md 4)")
        if m.is_moe:
            self.notes.append("MoE: balanced routing; experts sharded over ep and not "
                              "tensor-parallel; each sequence-parallel shard routes its own tokens")
        reduce = "reduce-scatter" if w.zero_stage else "all-reduce"
        buckets = ("one bucket after the backward pass (nothing to hide behind)" if self.one_bucket
                   else "per layer bucket")
        self.notes.append(f"gradients: {reduce} in {w.dtype} {buckets} over the dp x ctx "
                          "(x ep) ranks" + ("" if self.one_bucket else ", hidden behind the next layer's backward")
                          + ("; updated parameters all-gathered after the optimizer, not hidden "
                             "behind the next step" if w.zero_stage in (1, 2) else ""))
        embed = self.memory_bound(self.tokens * h * self.dt * 2 / self.tp)
        # the LM head's backward: input and weight gradients, or the input gradient of a frozen
        # head; plus the forward again where the logits are recomputed in backward
        head_ratio = (1.0 if obj.frozen_embeddings else GEMM_BACKWARD_FLOP_RATIO) + obj.head_recompute
        head_calls = (1 if obj.frozen_embeddings else 2) + obj.head_recompute
        loss_rows = self.loss_rows()
        grads, x = (), ()
        bucketed = not self.one_bucket
        # the step's stored inputs, read before anything can use them: exposed
        x = self.add("data.storage-read", "data", None, self.storage_read(), x)
        if obj.canvas_passes:
            x = self.canvas_pass(self.canvas_sync(x))
        for v in range(obj.passes):
            last_view = v == obj.passes - 1
            x = self.add("embed", "forward", None, embed, x)
            # vocabulary-parallel embedding: partial embeddings reduce-scattered to the shards
            x = self.add("embed.rs", "forward", None, self.tp_collective("reduce-scatter"), x)
            x = self.add("fc-conditioning", "forward", None, self.conditioning(False), x)
            prefetch: Deps = ()
            for li, a in enumerate(layers):
                if zero3:  # gather layer li's parameters while layer li-1 computes
                    prefetch = self.param_gather("zero3.params", "forward", li, *self.layer_params(a), prefetch)
                x = self.layer(li, a, "forward", x + prefetch)
            x = self.loss_forward(x)
            x = self.add("lm-head-bwd", "backward", None, self.gemm(
                head_ratio * 2 * loss_rows * h * V / self.tp, self.head_calls(head_calls)), x)
            x = self.add("head-in.rs-bwd", "backward", None, self.tp_collective("reduce-scatter", loss_rows), x)
            if last_view and bucketed and head_params and not m.tie_embeddings:
                grads += self.grad_sync(None, head_params, 0.0, x)
            prefetch = ()
            for li in range(len(layers) - 1, -1, -1):
                a = layers[li]
                if zero3:
                    prefetch = self.param_gather("zero3.params", "backward", li, *self.layer_params(a), prefetch)
                if recompute:  # rerun the layer from its checkpointed input, then backward
                    x = self.layer(li, a, "recompute", x + prefetch)
                x = self.layer(li, a, "backward", x + prefetch)
                if last_view and bucketed:
                    grads += self.grad_sync(li, *self.layer_params(a), x)
            x = self.add("fc-conditioning-bwd", "backward", None, self.conditioning(True), x)
            if not obj.frozen_embeddings:
                x = self.add("embed.ag-bwd", "backward", None, self.tp_collective("all-gather"), x)
                x = self.add("embed-bwd", "backward", None, embed, x)
            if last_view:  # norms' and router's partial gradients summed over TP, once
                grads += self.add("grads.sequence-parallel.all-reduce", "grad-sync", None, self.comm(
                    "all-reduce", self.sequence_parallel_params() * self.dt * 2 * self.ring_share(self.g_tp),
                    self.g_tp, "gradients"), x)
            if last_view and bucketed:
                tied = head_params if m.tie_embeddings else 0.0
                grads += self.grad_sync(None, edge_params + tied, 0.0, x)
            elif last_view:  # every gradient at once
                grads += self.grad_sync(None, *self.trained_params(), x)
        # the step's loss summed over every rank (to check it and to log it): one fp32 scalar,
        # nothing on a GPU cluster, a whole call's wake-up on a CPU host
        loss = self.add("loss.all-reduce", "grad-sync", None, self.comm(
            "all-reduce", LOSS_BYTES * 2 * self.ring_share(self.g_dense), self.g_dense, "other"), x, grads)
        step = self.add("adamw", "optimizer", None, self.optimizer(), x, grads, loss)
        if w.zero_stage in (1, 2):
            self.param_gather("updated-params", "param-sync", None, *self.trained_params(), step)
        return StepGraph(self.n, tuple(self.ops), self.model_flops(), obj.passes * obj.rows_per_example,
                         tuple(self.notes))

    def model_flops(self) -> float:
        """One context group's step math, counted once: 3x forward GEMMs, 3.5x attention.

        The graph's formulas on the unsplit sequence (every row, the clean stream's AR loss, the
        expected self-conditioning forward with its soft embedding), so replicated work (pure
        BP's clean prefix, CSBP's clean replicas, CP's replicated draft decoder) and recompute
        (a frozen head's recomputed logits included) do not count as useful work.
        """
        m, obj = self.m, self.obj
        draft = _anchor_tokens(self.w) if obj.context_as_kv else None
        if draft is not None:  # drafter: draft tokens through the layers, context as K/V only
            L, T = self.w.seq_len, draft
            ctx = sum(3 * 2 * L * m.hidden * a.kv_width * a.kv_tensors for a in m.layers if a.kind != "linear")
            pairs = dict.fromkeys(m.attention_kinds(), _anchor_pairs(self.w))
            total = self._layers_flops(T, pairs, 3.0) + ctx
            total += 2 * 2 * L * m.conditioning_layers * m.hidden ** 2  # fc: forward + weight gradient
            total += 2 * 2 * T * m.hidden * m.vocab  # frozen head: forward + input gradient
            return total * self.w.micro_batch
        L, b = self.w.seq_len, self.w.block_size
        pairs = {a: _sequence_pairs(L, b, a.window if a.kind == "sliding" else None) for a in m.attention_kinds()}
        head = 2 * L * m.hidden * m.vocab  # the LM head's forward over L rows
        main = self._layers_flops(2 * L, pairs, 3.0) + 3 * head * (2 if obj.clean_loss else 1)
        canvas = {a: _canvas_pairs(L, b, a.window if a.kind == "sliding" else None) for a in m.attention_kinds()}
        selfcond = self._layers_flops(L, canvas, 1.0) + head * (2 if obj.soft_embedding else 1)
        # micro_batch counts the batch's rows (`batch_rows`): an objective's rows are all useful
        return (obj.passes * main + obj.canvas_passes * selfcond) * self.w.micro_batch

    def _layers_flops(self, tokens: float, pairs: dict[AttentionSpec, float], gemm_x: float) -> float:
        """Every layer's GEMMs on `tokens` (x gemm_x) and attention on its pairs (x gemm_x + 0.5
        for forward+backward, x1 for a forward only)."""
        m, total = self.m, 0.0
        attn_x = gemm_x + 0.5 if gemm_x > 1 else 1.0
        for a in m.layers:
            gemm = m.mixer_params(a) + m.dense_ffn_params()
            if m.moe:
                gemm += m.moe.top_k * 3 * m.hidden * m.moe.expert_ffn + m.hidden * m.moe.n_experts
            total += gemm_x * 2 * tokens * gemm
            if a.kind == "linear":
                total += attn_x * tokens * a.n_heads * delta_rule_flops_per_token(a.head_dim, a.head_dim)
            else:
                total += attn_x * pairs[a] * 4 * a.head_dim * a.n_heads
        return total


Relative = tuple[bool, tuple[int, ...]]  # (after the layer's input?, after these ops of the layer)


@dataclass(frozen=True)
class _LayerTemplate:
    """The ops one layer appended, with dependencies relative to its input and its first op."""

    ops: tuple[tuple[str, Phase, Work, Relative], ...]
    out: Relative

    @classmethod
    def record(cls, ops: list[Op], start: int, x: Deps, out: Deps) -> "_LayerTemplate | None":
        """None if some op waits for only part of the input (then the layer cannot be stamped)."""
        inputs = set(x)

        def relative(deps: Deps) -> Relative | None:
            outer = {d for d in deps if d < start}
            inner = tuple(sorted({d - start for d in deps if d >= start}))
            return (bool(outer), inner) if outer in (set(), inputs) else None

        rel = [relative(op.deps) for op in ops] + [relative(out)]
        if None in rel:
            return None
        return cls(tuple((op.name, op.phase, op.work, r) for op, r in zip(ops, rel)), rel[-1])

    def stamp(self, ops: list[Op], layer: int, x: Deps) -> Deps:
        """Append a copy for `layer` after input `x`; returns the ops that end it (as a set)."""
        base, inputs = len(ops), tuple(sorted(set(x)))  # inputs precede every op of the layer
        shift, new = base.__add__, tuple.__new__
        ops.extend([new(Op, (base + k, name, phase, layer, work,
                             (inputs if after_input else ()) + tuple(map(shift, inner))))
                    for k, (name, phase, work, (after_input, inner)) in enumerate(self.ops)])
        after_input, inner = self.out
        return (inputs if after_input else ()) + tuple(map(shift, inner))


def _scaled(work: Work, p: float) -> Work:
    """The expected work of something that runs with probability p."""
    if isinstance(work, Comm):
        return replace(work, bytes=tuple(b * p for b in work.bytes))
    return replace(work, flops=tuple(f * p for f in work.flops), bytes=tuple(b * p for b in work.bytes),
                   dense_flops=tuple(f * p for f in work.dense_flops))


@functools.lru_cache(maxsize=64)
def _canvas_pairs(seq_len: int, block: int, window: int | None) -> int:
    return QueryIntervals(((0, seq_len),), seq_len, block, window).total()  # = mask.pairs


# what other modules keep between graphs (prices, recent graphs), forgotten with the rest
ALSO_CLEARED: list = []


def clear_caches() -> None:
    """Forget what earlier graphs cached, layouts included (a benchmark measuring a cold start)."""
    clear_layout_caches()
    for cached in (_placed_group, _sequence_pairs, _canvas_pairs, pairs._window_prefix, pairs._block_counts):
        cached.cache_clear()
    for clear in ALSO_CLEARED:
        clear()


def _anchor_tokens(w: Workload) -> int:
    return min(w.max_anchors, w.n_blocks) * w.block_size


def _anchor_pairs(w: Workload) -> int:
    spans = tuple((k * w.block_size, (k + 1) * w.block_size) for k in anchor_blocks(w.n_blocks, w.max_anchors))
    return mask.pairs(spans, w.seq_len, w.block_size)
