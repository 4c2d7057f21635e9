"""The step graph's softmax attention: calls, their kernels and tiles, and the K/V exchange.

Beyond the method's exchanges, the implementation profile can say how a framework's context
parallelism runs them (issue 24, frameworks.md A1, B1): calls per step of the head-tail schedule
(`split: steps`: TorchTitan's all-gather waited after step 0, the pass-KV ring with each hop
beside that step's attention), K/V repeated to the query heads before the exchange
(`kv_heads`), the backward re-gathering K/V (`refetch_kv`) and moving dK/dV on a ring of its
own in fp32 (`dkv_exchange`), or Ulysses all-to-alls of Q, K, V and O (`context_exchange:
heads`).

How a layer's attention is cut into kernel calls, which kernel family runs each, whether the K/V
collective is waited on at once or hidden behind the calls over keys already at home, the copies
around it and its padding are the implementation profile's facts (`implementation.py`); which
pairs each call computes and which rows move come from the layout. A mixin of the builder
(`graph._Builder`): it uses the builder's sizes, groups and op constructors.
"""

from __future__ import annotations

import math

import numpy as np

from csbp.simulator.layout import kv_rows, pairs
from csbp.simulator.system.implementation import Pass
from csbp.simulator.layout.layout import kv_row_bytes
from csbp.simulator.layout.pairs import QueryIntervals
from csbp.simulator.layout.spans import Span, normalize
from csbp.simulator.workload.spec import AttentionSpec
from csbp.simulator.cost.step_ops import Comm, Compute, Deps, Phase
from csbp.simulator.layout.tiles import tile_counts_each, tiles_aligned

# FlashAttention backward does 5 matmuls against the forward's 2 (FlashAttention-2 paper, sec. 3).
ATTENTION_BACKWARD_FLOP_RATIO = 2.5

# Combining partial attention by LSE (out = w out_a + w_b out_b, lse = logaddexp): forward reads
# both partial outputs and writes one, backward reads the output gradient and writes both
# partial ones and the output; in query x head x head_dim elements (the LSEs are 1/head_dim).
MERGE_FORWARD_PASSES, MERGE_BACKWARD_PASSES = 3, 4

# Query/key tile of FA3 at head dim <= 256 (kBlockM = 128): masks not aligned to it waste work.
ATTENTION_KERNEL_TILE = 128


class AttentionOps:
    """Softmax attention layers of the step (mixed into the builder)."""

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
        if pattern == "none":
            return pattern
        split = self.facts(phase).split
        if pattern == "ring":  # one call per step; `steps` shapes them as the frameworks do,
            # as does any causal (ar) layout: its head-tail steps are unmasked rectangles
            return "steps" if split == "steps" or self.obj.causal else "ring"
        return split

    def split(self, a: AttentionSpec, pattern: str, cut: str | None = None) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """The layer kind's attention split, counted once per layout ownership: it depends only on
        the shares, the window and the cut, which most candidates of a search share."""
        window = a.window if a.kind == "sliding" else None
        cut = cut or ("local-remote" if pattern not in ("none", "ring") else pattern)
        if self.ulysses(pattern):
            cut = "heads"
        return self.derived(("attention-split", window, pattern, cut),
                            lambda: self.attention_split(a, window, pattern, cut))

    def attention_split(self, a: AttentionSpec, window: int | None, pattern: str,
                        cut: str = "local-remote") -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(name, pairs, keys in the call) per rank, by where the keys come from.

        `whole`: one call over every key after the exchange; `local-remote`: the rank's own
        positions and owned rows apart from the rows it receives; `noisy-prefix`: the noisy
        queries over their own blocks apart from every query over the clean prefix; a ring
        splits the rest by step (the shard of the rank s places back in the ring); `steps` does
        so under any exchange, each step's call over only the queries that see its shard (a
        fourth entry: those queries per rank); `heads` (Ulysses) is one call over the whole
        sequence of the cp group, on heads / cp.
        """
        lay = self.lay
        total = self.derived(("pairs", window), lambda: pairs.totals(lay, window)).astype(float)
        if pattern == "none":
            return [("attn", total, self.positions)]
        if cut == "heads":  # every position of the group's sequence, per head
            whole = self.group_sequence()
            every = float(QueryIntervals(whole, lay.seq_len, lay.block, window).total())
            length = float(sum(z - q for q, z in whole))
            return [("attn.heads", np.full(self.n, every), np.full(self.n, length), np.full(self.n, length))]
        if pattern != "ring" and cut == "whole":
            return [("attn", total, self.positions + kv_rows.received(lay, a, "forward").astype(float))]
        local_keys = [self.local_keys(r) for r in range(self.n)]
        if pattern != "ring" and cut != "steps":  # every rank's pairs at once (pairs.pairs_with_ranks)
            received = kv_rows.received(lay, a, "forward").astype(float)
            if cut == "noisy-prefix":
                own = [self.noisy_spans(r) for r in range(self.n)]
                block = pairs.pairs_with_ranks(lay, own, window).astype(float)
                noisy = np.array([sum(z - q for q, z in own[r]) for r in range(self.n)], dtype=float)
                clean = self.positions - noisy + received
                return [("attn.noisy-block", block, noisy), ("attn.prefix", total - block, clean)]
            local = pairs.pairs_with_ranks(lay, local_keys, window).astype(float)
            return [("attn.local", local, self.positions), ("attn.remote", total - local, received)]
        queries = self.derived(("query-intervals", window),
                               lambda: [QueryIntervals.of(lay, r, window) for r in range(self.n)])
        local = pairs.pairs_with_ranks(lay, local_keys, window).astype(float)
        parts = [("attn.local", local, self.positions)]
        owned = kv_rows.owned_rows(lay).astype(float)
        m = len(self.cp_sync[0])
        step_pairs = np.zeros((m, self.n))  # [s, rank]: pairs with the shard s places back
        step_keys = np.zeros((m, self.n))
        step_queries = np.zeros((m, self.n))  # `steps`: the queries that see that shard
        for g in self.cp_sync:
            shards = pairs.KeySets([lay.shares[r].owned_kv for r in g])  # asked by every member
            back = (np.arange(m)[:, None] - np.arange(m)[None, :]) % m  # [i, s] -> member i - s
            for i, r in enumerate(g):
                with_each = queries[r].pairs_with_each(shards)  # pairs with member j's shard
                step_pairs[:, r] = with_each[back[i]]
                step_keys[:, r] = owned[np.array(g)[back[i]]]
                if cut == "steps":  # the call's queries and keys: those that meet the mask
                    step_queries[:, r] = queries[r].queries_seeing_each(shards)[back[i]]
                    step_keys[:, r] = queries[r].keys_seen_each(shards)[back[i]]
        name = "attn.ring" if pattern == "ring" else "attn.step"
        if cut == "steps":
            parts = [parts[0] + (self.positions,)]
            return parts + [(f"{name}{s}", step_pairs[s], step_keys[s], step_queries[s]) for s in range(1, m)]
        for s in range(1, m):
            parts.append((f"attn.ring{s}", step_pairs[s], step_keys[s]))
        return parts

    def attention_notes(self) -> list[str]:
        """What the report says about how this plan's context exchange runs (issue 24)."""
        if self.lay.kind not in ("cp", "csbp") or self.keys_at_home:
            return []
        fwd, bwd, out = self.facts("forward"), self.facts("backward"), []
        if fwd.context_exchange == "heads":
            out.append("CP as Ulysses: all-to-alls of Q, K, V to head shards and of O back, waited on; "
                       "one attention call over every position on heads / cp; memory holds the head "
                       "shards (as large as the rank's own q, k, v) and the all-to-all buffers [U]")
            return out
        ring = self.p.transport == "ring"
        if self.cut("ring" if ring else "all-gather", "forward") == "steps":
            out.append("CP attention in steps (frameworks.md A1, B1): one call per shard, each over the "
                       "queries that see it" + (", each ring hop beside the previous step's call" if ring
                                                else "; step 0 beside the K/V all-gather, later steps after it"))
        if fwd.kv_heads == "query":
            out.append("K/V repeated to the query heads before CP (repeat_kv): exchanged at the query-head count")
        if bwd.refetch_kv and not ring:
            out.append("backward gathers K/V again")
        if bwd.dkv_exchange == "ring":
            out.append(f"dK/dV on their own ring of cp hops in {bwd.gradient_bytes or self.dt}-byte elements")
        return out

    def group_sequence(self) -> tuple[Span, ...]:
        """Every position the cp group holds (Ulysses' call runs over all of them)."""
        return normalize(p for r in self.cp_sync[0] for p in self.lay.shares[r].positions)

    def ulysses(self, pattern: str) -> bool:
        """Ulysses CP (`context_exchange: heads`): the plan's attention over heads / cp."""
        return pattern != "none" and self.family.forward.context_exchange == "heads"

    def step_shard(self, rank: int, step: int) -> tuple[Span, ...]:
        """The K/V shard a rank attends at `step` of a ring or a stepped gather: the member
        `step` places back in its group."""
        for g in self.cp_sync:
            if rank in g:
                i = g.index(rank)
                return self.lay.shares[g[(i - step) % len(g)]].owned_kv
        return ()

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
        for prefix in ("attn.ring", "attn.step"):
            if name.startswith(prefix):
                return positions, self.step_shard(rank, int(name.removeprefix(prefix)))
        if name == "attn.heads":
            return self.group_sequence(), everything
        raise KeyError(name)

    def tiles(self, a: AttentionSpec, name: str, pack: bool, pairs: np.ndarray,
              shaped: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """(full, partial) kernel tiles per rank of one call, in tiles per query head (per K/V
        head when GQA heads are packed: then a tile holds 128 / group positions), or None for a
        ring step not `shaped` by a `steps` split (priced by pairs, its masked flag standing for
        partial tiles) [U]."""
        if name.startswith("attn.ring") and not shaped:
            return None
        window = a.window if a.kind == "sliding" else None
        group = max(1, a.n_heads // max(a.n_kv_heads, 1)) if pack else 1
        rows = max(1, ATTENTION_KERNEL_TILE // group)

        def count():
            out = np.zeros((2, self.n))
            counted = []  # every rank's call that is not aligned, counted in one pass
            for r in range(self.n):
                q, k = self.call_spans(r, name)
                if tiles_aligned(q, k, self.lay.seq_len, self.lay.block, window, rows, ATTENTION_KERNEL_TILE):
                    out[0, r] = pairs[r] / (rows * ATTENTION_KERNEL_TILE)  # every touched tile is full
                else:
                    counted.append((r, q, k))
            if counted:
                each = tile_counts_each([(q, k) for _, q, k in counted], self.lay.seq_len, self.lay.block,
                                        window, rows, ATTENTION_KERNEL_TILE)
                for (r, _, _), fp in zip(counted, each):
                    out[:, r] = fp
            return out
        return self.derived(("tiles", name, window, rows), count)

    def attention_work(self, a: AttentionSpec, part: tuple, backward: bool, kernel: str = "best",
                       pack: bool = False) -> Compute:
        """pairs x 4 x head_dim x heads/tp forward (QK^T and PV), 2.5x that backward; and the
        same for the kernel tiles the call really computes (`tiles.py`)."""
        name, pairs, keys = part[:3]
        # Ulysses: the call runs every position of the sequence over heads / cp
        share = 1.0 / len(self.cp_sync[0]) if name == "attn.heads" else 1.0
        per_pair = self.w.micro_batch * 4 * a.head_dim * a.n_heads / self.tp * share
        if backward:
            per_pair *= ATTENTION_BACKWARD_FLOP_RATIO
        queries = self.noisy / self.w.micro_batch if name == "attn.noisy-block" else self.positions
        if len(part) > 3:  # a shaped call: only the queries that see its keys
            queries = part[3]
        tile = pairs / np.maximum(queries, 1)
        masked = a.kind == "sliding" or self.w.block_size % ATTENTION_KERNEL_TILE != 0
        counted = self.tiles(a, name, pack, pairs, shaped=len(part) > 3)
        full = partial = ()
        if counted is not None:
            group = max(1, a.n_heads // max(a.n_kv_heads, 1)) if pack else 1
            rows = max(1, ATTENTION_KERNEL_TILE // group) * group  # packed: whole positions per tile
            heads = (a.n_kv_heads if pack else a.n_heads) / self.tp * share
            per_tile = self.w.micro_batch * 4 * rows * ATTENTION_KERNEL_TILE * a.head_dim * heads
            if backward:
                per_tile *= ATTENTION_BACKWARD_FLOP_RATIO
            full, partial = self.per_rank(counted[0] * per_tile), self.per_rank(counted[1] * per_tile)
        return Compute("attention-bwd" if backward else "attention-fwd", self.per_rank(pairs * per_pair),
                       self.per_rank(0), 1, self.per_rank(tile), masked,
                       self.per_rank(queries * keys * per_pair), kernel, full, partial, head_dim=a.head_dim)

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
        nbytes = rows * self.kv_bytes(a, dt, phase) * self.w.micro_batch
        if pattern == "ring":
            return self.comm("p2p", nbytes, self.g_ring, "attention-kv", kv_rows.ring_senders(self.lay))
        collective = "all-to-all" if pattern == "all-to-all" else (
            "reduce-scatter" if phase == "backward" else "all-gather")
        return self.comm(collective, nbytes, self.g_cp, "attention-kv")

    def kv_bytes(self, a: AttentionSpec, dtype_bytes: int, phase: Phase) -> float:
        """Bytes of one K/V row as the phase moves it: at the K/V heads (`layout.kv_row_bytes`),
        or repeated to the query heads first (`kv_heads: query`, TorchTitan's repeat_kv)."""
        if self.facts(phase).kv_heads == "query":
            return a.kv_tensors * a.n_heads / self.tp * a.head_dim * dtype_bytes
        return kv_row_bytes(a, dtype_bytes, self.tp)

    def repeat_kv(self, li: int, a: AttentionSpec, phase: Phase, *deps: Deps) -> Deps:
        """`kv_heads: query`: K/V repeated to the query heads before attention and its exchange
        (read the K/V heads, write the query heads); backward: the repeated gradients summed
        back (read the query heads, write the K/V heads). Over the rank's own rows."""
        if self.facts(phase).kv_heads != "query" or a.n_heads == a.n_kv_heads:
            return self.add("kv.repeat_kv", phase, li, None, *deps)
        work = self.cached(("repeat_kv", a), lambda: self.memory_bound(
            self.positions * self.w.micro_batch * a.kv_tensors * a.head_dim * (a.n_heads + a.n_kv_heads)
            / self.tp * self.dt))
        return self.add("dkv.repeat_kv-sum" if phase == "backward" else "kv.repeat_kv", phase, li, work, *deps)

    def dkv_hop(self, li: int, a: AttentionSpec, hop: int, *deps: Deps) -> Deps:
        """One hop of a dK/dV ring of its own (`dkv_exchange: ring`, torch CP's all-to-all
        rotater): after a step's backward call each rank sends the partial dK/dV of the shard it
        just used to the next member, in the gradient dtype; `hop` 0..cp-1, the last one home.
        Each hop carries one member's shard (rank i receives that of member i - 1 - hop)."""
        facts = self.facts("backward")

        def make() -> Comm | None:
            owned = kv_rows.owned_rows(self.lay).astype(float)
            rows = np.zeros(self.n)
            for g in self.cp_sync:
                m = len(g)
                for i, r in enumerate(g):
                    rows[r] = owned[g[(i - 1 - hop) % m]] if m > 1 else 0.0
            dt = facts.gradient_bytes or self.dt
            nbytes = rows * self.kv_bytes(a, dt, "backward") * self.w.micro_batch
            return self.comm("p2p", nbytes, self.g_ring, "attention-kv", kv_rows.ring_senders(self.lay))
        work = self.cached(("dkv-hop", a, hop), make)
        return self.add(f"dkv.hop{hop}", "backward", li, work, *deps)

    def heads_exchange(self, li: int, a: AttentionSpec, phase: Phase, what: str, *deps: Deps) -> Deps:
        """Ulysses: one all-to-all between sequence and head shards of the cp group, waited on.
        `what`: "qkv" (Q, K, V in; backward dQ, dK, dV out) or "o" (O out; backward dO in).
        Each rank keeps 1/cp of its rows' width and receives (cp-1)/cp of it."""
        n = len(self.cp_sync[0])
        q = a.n_heads * a.head_dim
        kv = a.kv_tensors * (a.n_heads if self.facts(phase).kv_heads == "query" else a.n_kv_heads) * a.head_dim
        width = q + kv if what == "qkv" else q
        work = self.cached(("ulysses", a, what), lambda: self.comm(
            "all-to-all", self.positions * self.w.micro_batch * width / self.tp * self.dt * (n - 1) / n,
            self.g_cp, "attention-kv"))
        names = {("qkv", False): "qkv.a2a", ("o", False): "o.a2a",
                 ("qkv", True): "dqkv.a2a", ("o", True): "do.a2a"}
        return self.add(names[what, phase == "backward"], phase, li, work, *deps)

    def padded_rows(self) -> np.ndarray:
        """Rows each member receives in an all-gather padded to its group's largest shard."""
        owned = kv_rows.owned_rows(self.lay).astype(float)
        out = np.zeros(self.n)
        for g in self.cp_sync:
            idx = list(g)
            out[idx] = (len(g) - 1) * owned[idx].max()
        return out

    def attend(self, li: int, a: AttentionSpec, phase: Phase, pattern: str, part: int, *deps: Deps) -> Deps:
        """Append attention of the rank's queries over one key part of the layer kind's split,
        on the kernel family the implementation runs for that call."""
        backward = phase == "backward"
        cut = self.cut(pattern, phase)
        split = self.split(a, pattern, cut)
        name = split[part][0]
        call = "ring" if name.startswith("attn.ring") else "step" if name.startswith("attn.step") \
            else name.removeprefix("attn.")
        if self.keys_at_home:  # the bound: the fastest kernel the phase runs, the fewer tiles:
            # packed where the GQA group divides a tile's rows (a tile of 128 query rows then
            # holds `group` packed ones: touched if any of them is, full only if all are, so
            # packed never computes more, tile by tile, full or masked), else counted both ways
            group = max(1, a.n_heads // max(a.n_kv_heads, 1))
            kernel = "|".join(sorted(set(self.facts(phase).kernels.values())))
            pack = True if ATTENTION_KERNEL_TILE % group == 0 else "auto"
        else:
            facts = self.facts(phase)
            kernel, pack = facts.kernel(call), facts.packs(call)
            if facts.kv_heads == "query":  # K/V already at the query heads: nothing to pack
                pack = False

        def work_of(packed: bool) -> Compute:
            return self.attention_work(a, split[part], backward, kernel, packed)

        def fewer_tiles() -> Compute:  # packing GQA heads into query tiles when it wastes less
            both = [work_of(False), work_of(True)]
            return min(both, key=lambda w: sum(w.full_tile_flops) + sum(w.partial_tile_flops))
        key = ("attn", a, pattern, cut, part, backward, kernel, pack)
        # made once per layout ownership and what else it reads (candidates of a search that
        # differ in dp, ep, placement or checkpointing, and a plan's bound and its simulation,
        # share the work)
        work = self.cached(key, lambda: self.derived(
            key + (self.tp, self.w.micro_batch, self.w.block_size, self.impl.name),
            fewer_tiles if pack == "auto" else lambda: work_of(pack)))
        repeat = self.head_dim_repeat(a, kernel)
        if repeat > 1:  # the kernel's K/V heads repeated first (backward: and dK/dV summed back)
            keys = split[part][2]
            copy = self.cached(("kv-repeat", a, pattern, cut, part, backward, repeat), lambda: self.memory_bound(
                (2 if backward else 1) * (1 + repeat) * keys * kv_row_bytes(a, self.dt, self.tp) * self.w.micro_batch))
            deps = (self.add("dkv.repack" if backward else "kv.repeat", phase, li, copy, *deps),)
        return self.add(name, phase, li, work, *deps)

    def head_dim_repeat(self, a: AttentionSpec, kernel: str) -> int:
        """Times a kernel family repeats each K/V head at this layer's head dim: it packs at most
        `max_group` query heads per K/V head there (implementation profile `head_dim_copies`)."""
        for copy in self.impl.head_dim_copies:
            if copy.head_dim == a.head_dim and (not copy.kernels or kernel in copy.kernels):
                return math.ceil(max(1, a.n_heads // max(a.n_kv_heads, 1)) / copy.max_group)
        return 1

    def query_gather(self, li: int, a: AttentionSpec, what: str, *deps: Deps) -> Deps:
        """Pure CP at a head dim whose profile entry says so (`head_dim_copies[].cp_gathers`,
        implementation.md 13): the backward all-gathers every member's query rows of the
        attention output (before the call) or of dQ (after it, in the gradient dtype) over the
        CP group, padded as the K/V gather is, waited on. Nothing otherwise."""
        ph: Phase = "backward"
        facts = self.facts(ph)
        if self.lay.kind != "cp" or self.pattern(a, ph) != "all-gather" or not any(
                what in c.cp_gathers and c.head_dim == a.head_dim and a.kind in c.cp_gather_kinds
                for c in self.impl.head_dim_copies):
            return self.add(f"attn.{what}-gather", ph, li, None, *deps)

        def make() -> Comm | None:
            rows = np.zeros(self.n)
            for g in self.cp_sync:
                idx = list(g)
                own = self.positions[idx]
                rows[idx] = (len(g) - 1) * own.max() if facts.pad_to_largest_shard else own.sum() - own
            dt = (facts.gradient_bytes or self.dt) if what == "dq" else self.dt
            width = a.n_heads / self.tp * a.head_dim
            return self.comm("all-gather", rows * self.w.micro_batch * width * dt, self.g_cp, "other")
        return self.add(f"attn.{what}-gather", ph, li, self.cached(("query-gather", a, what), make), *deps)

    def merge(self, li: int, a: AttentionSpec, phase: Phase, *deps: Deps) -> Deps:
        """Combine two partial attention outputs by their LSE (memory-bound, per query row)."""
        passes = MERGE_BACKWARD_PASSES if phase == "backward" else MERGE_FORWARD_PASSES
        work = self.cached(("merge", a, passes), lambda: self.memory_bound(
            passes * self.positions * self.w.micro_batch * a.n_heads / self.tp * a.head_dim * self.dt))
        return self.add("attn.merge", phase, li, work, *deps)

    def pack_kv(self, li: int, a: AttentionSpec, phase: Phase, *deps: Deps, gradients: bool | None = None) -> Deps:
        """Copy the K/V rows a rank sends into one buffer (read + write; backward: their
        gradients added back into dK/dV). All-gather sends one shard to every member, so it is
        packed once. `gradients=False` in the backward: K/V packed again for a re-gather."""
        grads = phase == "backward" if gradients is None else gradients
        nbytes = 2 * kv_rows.packed_rows(self.lay, a) * self.kv_bytes(a, self.dt, phase) * self.w.micro_batch
        work = self.cached(("pack", a, grads, self.facts(phase).kv_heads), lambda: self.memory_bound(
            nbytes * (1.5 if grads else 1.0)))
        return self.add("kv.pack", phase, li, work, *deps)

    def move_kv(self, name: str, li: int, a: AttentionSpec, phase: Phase, step: int,
                payload: str | None, *deps: Deps) -> Deps:
        """Append one step of the layer kind's K/V exchange in `phase` (rows from the layout)."""
        return self.add(name, phase, li, self.kv_work(a, phase, step, payload), *deps)

    def kv_work(self, a: AttentionSpec, phase: Phase, step: int, payload: str | None) -> Comm | None:
        """`kv_comm`, made once per layout ownership and what else the transfer reads (candidates
        that differ in dp, ep or checkpointing where their groups match share it, and the
        engines price it once). A recompute moves what the forward moved where the
        implementation runs the two alike (`kv_comm` reads the phase only through its pattern
        and facts): one work for both."""
        if phase == "recompute" and self.facts("recompute") is self.facts("forward") \
                and self.pattern(a, "recompute") == self.pattern(a, "forward"):
            phase = "forward"

        def shared() -> Comm | None:
            group = self.g_ring if self.pattern(a, phase) == "ring" else self.g_cp  # the one it moves on
            f = self.facts(phase)  # what kv_comm reads of them
            return self.derived(("kv-comm", a, phase, step, payload, self.lay.plan.transport, self.lay.checkpointing,
                                 self.keys_at_home, self.tp, self.w.micro_batch, self.dt, group,
                                 f.pad_to_largest_shard, f.gradient_bytes, f.kv_heads),
                                lambda: self.kv_comm(a, phase, step, payload))
        return self.cached(("kv", a, phase, step, payload), shared)

    def ring_steps(self) -> int:
        """Steps of a ring over the context group (the calls of `attention_split`'s ring)."""
        return len(self.cp_sync[0])

    def ring_shards(self, a: AttentionSpec, phase: Phase, payload: str | None) -> Comm | None:
        """Each rank's own K/V shard (`payload` "dkv": its dK/dV, in the gradient dtype) as one
        hop of the layer kind's ring in `phase` moves it. Every hop of `kv_work` (forward,
        recompute, backward "kv" or "dkv") delivers one member's shard, with these bytes, on
        this group: a rank's hop costs what the shard it receives (`kv_rows.ring_sources`) costs
        here, without making each hop's work. (A backward hop with no `payload` carries both.)"""
        if phase == "backward" and payload is None:
            raise ValueError("a backward ring hop carries two shards: ask for 'kv' or 'dkv'")
        gradients = phase == "backward" and payload == "dkv"  # as kv_comm reads a ring
        dt = self.facts(phase).gradient_bytes or self.dt if gradients else self.dt
        nbytes = kv_rows.owned_rows(self.lay) * self.kv_bytes(a, dt, phase) * self.w.micro_batch
        return self.comm("p2p", nbytes, self.g_ring, "attention-kv", kv_rows.ring_senders(self.lay))

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
            facts.copy_passes * 2 * rows * self.kv_bytes(a, dt, phase) * self.w.micro_batch))
        return self.add(name, phase, li, work, *deps)

    def attention_forward(self, li: int, a: AttentionSpec, phase: Phase, x: Deps) -> Deps:
        """Attention over keys at home runs while the rest arrive, unless the implementation
        waits on the exchange at once; the call over received keys waits for them."""
        pattern = self.pattern(a, phase)
        x = self.repeat_kv(li, a, phase, x)
        if pattern == "none":
            return self.attend(li, a, phase, pattern, 0, x)
        if self.ulysses(pattern):  # Q, K, V to head shards, one call, O back: all waited on
            x = self.heads_exchange(li, a, phase, "qkv", x)
            return self.heads_exchange(li, a, phase, "o", self.attend(li, a, phase, pattern, 0, x))
        if pattern != "ring":
            gather = self.move_kv("kv.gather", li, a, phase, 0, None, self.pack_kv(li, a, phase, x))
            ready = self.copies("kv.reorder", li, a, phase, gather)
            cut = self.cut(pattern, phase)
            if cut == "whole":
                return self.attend(li, a, phase, pattern, 0, x, ready)
            waited = ready if self.facts(phase).exchange == "immediate" else ()
            local = self.attend(li, a, phase, pattern, 0, x, waited)
            if cut == "steps":  # step 0 beside the gather; every later step waits for it
                done = local
                for s in range(1, len(self.split(a, pattern, cut))):
                    done = self.merge(li, a, phase, self.attend(li, a, phase, pattern, s, done, ready))
                return done
            return self.merge(li, a, phase, self.attend(li, a, phase, pattern, 1, local, ready))
        # ring with two K/V buffers: step s lands once step s-2 has been consumed
        done, kv = [self.attend(li, a, phase, pattern, 0, x)], x
        for s in range(1, len(self.split(a, pattern))):
            kv = self.move_kv(f"kv.ring{s}", li, a, phase, s - 1, None, kv, done[s - 2] if s >= 2 else ())
            done.append(self.merge(li, a, phase, self.attend(li, a, phase, pattern, s, done[-1], kv)))
        return done[-1]

    def attention_backward(self, li: int, a: AttentionSpec, x: Deps) -> Deps:
        """The layer's attention backward, then (`kv_heads: query`) the repeated K/V's
        gradients summed back to the K/V heads."""
        return self.repeat_kv(li, a, "backward", self.attention_backward_calls(li, a, x))

    def attention_backward_calls(self, li: int, a: AttentionSpec, x: Deps) -> Deps:
        """Remote pairs first, so their dK/dV travel home while the local backward runs (unless
        the implementation waits on the reduce-scatter at once)."""
        ph: Phase = "backward"
        pattern = self.pattern(a, ph)
        if pattern == "none":
            return self.attend(li, a, ph, pattern, 0, x)
        if self.ulysses(pattern):  # dO to head shards, one call, dQ, dK, dV back
            x = self.heads_exchange(li, a, ph, "o", x)
            return self.heads_exchange(li, a, ph, "qkv", self.attend(li, a, ph, pattern, 0, x))
        if self.cut(pattern, ph) == "steps":
            return self.stepped_backward(li, a, pattern, x)
        if pattern != "ring":
            if self.cut(pattern, ph) == "whole":
                x = self.query_gather(li, a, "output", x)  # head-dim copies under pure CP
                call = self.query_gather(li, a, "dq", self.attend(li, a, ph, pattern, 0, x))
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

    def stepped_backward(self, li: int, a: AttentionSpec, pattern: str, x: Deps) -> Deps:
        """Backward of a `steps` split, as torch CP and Transformer Engine run it (frameworks.md
        A1, B1): step 0 over the rank's own K/V, then one call per other member's shard. K/V
        come from a gather done again by the backward (`refetch_kv`; else the one of the
        forward or recompute is at hand) or, on a ring, hop by hop (K/V of step s land once
        step s-2 is consumed). dK/dV go home as the layout moves them (the ring's dK/dV hops,
        or one reduce-scatter after the last step) or on their own ring (`dkv_exchange: ring`):
        after step s's call its partial sums move one hop on, waited on before step s+1's sums
        are added, the last hop home."""
        ph: Phase = "backward"
        facts = self.facts(ph)
        n = len(self.split(a, pattern, "steps"))
        own_ring = facts.dkv_exchange == "ring"
        if pattern != "ring":
            ready: Deps = ()
            if facts.refetch_kv:  # the forward's gather again, in the backward
                pack = self.pack_kv(li, a, ph, x, gradients=False)
                gather = self.add("kv.gather-bwd", ph, li, self.cached(
                    ("kv-refetch", a), lambda: self.kv_comm(a, "forward", 0, None)), pack)
                ready = gather
            waited = ready if facts.exchange == "immediate" else ()
            done = [self.attend(li, a, ph, pattern, 0, x, waited)]
            hop: Deps = self.dkv_hop(li, a, 0, done[0]) if own_ring else ()
            for s in range(1, n):
                done.append(self.attend(li, a, ph, pattern, s, done[-1], ready))
                if own_ring:
                    hop = self.dkv_hop(li, a, s, done[-1], hop)
            if own_ring:
                return done[-1] + hop
            scatter = self.move_kv("dkv.scatter", li, a, ph, 0, None, self.copies("dkv.copies", li, a, ph, done[-1]))
            return done[-1] + self.pack_kv(li, a, ph, scatter, done[-1])
        done = [self.attend(li, a, ph, pattern, 0, x)]
        kv = [(), self.move_kv("kv.ring1", li, a, ph, 0, "kv", x)]
        dkv: Deps = self.dkv_hop(li, a, 0, done[0]) if own_ring else ()
        for s in range(1, n):
            if s + 1 < n:
                kv.append(self.move_kv(f"kv.ring{s + 1}", li, a, ph, s, "kv", kv[s], done[s - 1]))
            if not own_ring:
                dkv = self.move_kv(f"dkv.ring{s}", li, a, ph, s - 1, "dkv", done[s - 1], dkv)
            done.append(self.attend(li, a, ph, pattern, s, done[s - 1], kv[s]))
            if own_ring:
                dkv = self.dkv_hop(li, a, s, done[s], dkv)
        if own_ring:
            return done[-1] + dkv
        home = self.move_kv("dkv.ring-home", li, a, ph, n - 1, "dkv", done[-1], dkv)
        return done[-1] + home
