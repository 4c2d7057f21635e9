"""What each training objective adds to the step: drafter conditioning and its storage read,
self-conditioning, the loss and its LM head, and the step's useful FLOPs (`objectives.py` holds
the facts, this module turns them into ops). A mixin of the builder.
"""

from __future__ import annotations

import functools
from functools import partial
from dataclasses import replace

from csbp.simulator.layout import mask
from csbp.simulator.layout import kv_rows
from csbp.simulator.layout.objective_layout import (canvas_view, locality_anchor_blocks, stream_views,
                                                      untrimmed, window_union)
from csbp.simulator.layout.pairs import QueryIntervals
from csbp.simulator.layout.spans import normalize
from csbp.simulator.workload.spec import AttentionSpec
from csbp.simulator.cost.linear_ops import delta_rule_flops_per_token
from csbp.simulator.cost.step_ops import COUNT_BYTES, Comm, Compute, Deps, Op, Work
from csbp.simulator.workload.workload import Workload

@functools.lru_cache(maxsize=64)
def _sequence_pairs(seq_len: int, block: int, window: int | None) -> int:
    return QueryIntervals(((0, 2 * seq_len),), seq_len, block, window).total()  # = mask.pairs

@functools.lru_cache(maxsize=64)
def _causal_pairs(seq_len: int, window: int | None) -> int:
    """Pairs of objective ar's causal sequence: the clean stream at block 1 (L(L+1)/2 unwindowed)."""
    return QueryIntervals(((seq_len, 2 * seq_len),), seq_len, 1, window).total()  # = mask.pairs

@functools.lru_cache(maxsize=64)
def _canvas_pairs(seq_len: int, block: int, window: int | None) -> int:
    return QueryIntervals(((0, seq_len),), seq_len, block, window).total()  # = mask.pairs

def _anchor_tokens(w: Workload) -> int:
    return min(w.max_anchors, w.n_blocks) * w.block_size

def _anchor_pairs(w: Workload, window: int | None = None) -> int:
    return _anchor_pairs_of(w.seq_len, w.block_size, w.max_anchors, window)

@functools.lru_cache(maxsize=64)
def _anchor_pairs_of(seq_len: int, block: int, anchors: int, window: int | None) -> int:
    blocks = locality_anchor_blocks(seq_len // block, anchors)
    spans = normalize((k * block, (k + 1) * block) for k in blocks)  # one run: one span
    return mask.pairs(spans, seq_len, block, window)

def _context_rows(w: Workload) -> int:
    """Context rows a drafter turns into K/V: all L, or a windowed drafter's trimmed union."""
    return _context_rows_of(w.seq_len, w.block_size, w.max_anchors, w.drafter_window)

@functools.lru_cache(maxsize=64)
def _context_rows_of(seq_len: int, block: int, anchors: int, window: int | None) -> int:
    trim = window_union(locality_anchor_blocks(seq_len // block, anchors), seq_len, block, window)
    return seq_len if trim is None else sum(b - a for a, b in trim)

def _scaled(work: Work, p: float) -> Work:
    """The expected work of something that runs with probability p."""
    if isinstance(work, Comm):
        return replace(work, bytes=tuple(b * p for b in work.bytes))
    return replace(work, flops=tuple(f * p for f in work.flops), bytes=tuple(b * p for b in work.bytes),
                   dense_flops=tuple(f * p for f in work.dense_flops),
                   full_tile_flops=tuple(f * p for f in work.full_tile_flops),
                   partial_tile_flops=tuple(f * p for f in work.partial_tile_flops))


class ObjectiveOps:
    """Objective-specific ops of the step (mixed into the builder)."""

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

    def feature_rows(self) -> np.ndarray:
        """Drafter: context rows of the rank's feature shard before a windowed drafter's trim
        (the trim runs on the GPU after the copy, implementation.md section 14)."""
        lay = untrimmed(self.lay)
        if lay is self.lay:
            return self.context
        return kv_rows.held(lay, "context").astype(float) * self.w.micro_batch

    def feature_io(self, x: Deps) -> Deps:
        """Drafter, offline features (implementation.md section 14): the rank's shard read from
        storage (memory-mapped, at its share of the node's storage bandwidth) and copied from
        pinned host memory to the GPU by a background reader one batch ahead: both on the io
        stream, which nothing waits for, so the steady-state step is the longer of the step and
        the reader [inference]. A CP rank reads only its token ranges; TP peers read the same
        [U]. Synthetic features (the published benchmark runs) are already on the GPU: no op."""
        per_token = self.obj.stored_bytes_per_token(self.m)
        if self.obj.features != "offline" or not per_token:
            return x
        nbytes = self.feature_rows() * per_token
        if not nbytes.any():
            return x
        self.add("data.storage-read", "data", None, Compute(
            "storage-read", self.per_rank(0), self.per_rank(nbytes), readers=min(self.gpn, self.p.world)))
        # the copy of batch n+1 runs while the reader fills batch n+2: pipelined, so neither
        # waits for the other in steady state [inference]
        self.add("data.h2d", "data", None, Compute("h2d", self.per_rank(0), self.per_rank(nbytes)))
        return x

    def canvas_sync(self, x: Deps) -> Deps:
        """Whether the self-conditioning pass runs is one MAX all-reduce of a flag over its sync
        group, every step (implementation.md section 4, DiffusionGemma)."""
        axis = self.obj.canvas_sync_axis
        if axis is None or not self.obj.canvas_passes:
            return x
        group = {"ep": self.g_ep}[axis]
        return self.add(f"selfcond.draw.{axis}-max", "forward", None, self.comm(
            "all-reduce", COUNT_BYTES * 2 * self.ring_share(group), group, "other"), x)

    def stream_builders(self) -> list:
        """The step's trained streams in program order, each a builder over its layout view:
        this builder for one pass over the layout; for an objective whose `streams` are
        ("encoder", "decoder") (DiffusionGemma, implementation.md 12) the encoder over the
        clean rows and the decoder over the canvas (`objective_layout.stream_views`), appending
        to this builder's ops with their stream's name. The decoder gathers the encoder's remote
        clean K/V again in its own layers (`encoder_kv: regather`, the profile's fact): its view
        owns its canvas rows and the clean rows the encoder made on its rank, so its exchange
        moves them as the one pass did. Under pure CP the views keep the 2L zigzag's ownership or shard each stream
        on its own, as the profile's `stream_ownership` says."""
        if self.obj.streams == ("main",):
            return [self]
        if self.obj.streams != ("encoder", "decoder") or self.impl.encoder_kv != "regather":
            raise ValueError(f"trained streams {self.obj.streams} with encoder_kv "
                             f"{self.impl.encoder_kv!r} are not modelled")
        ownership = self.impl.stream_ownership
        if self.lay.kind == "cp" and ownership == "per-stream":
            self.notes.append(
                "two streams under pure CP, each sharded on its own (the implementation's "
                "`stream_ownership: per-stream`): rank r runs chunks r and 2cp-1-r of the noisy "
                "stream's 2cp chunks and the same of the clean stream's, so each stream alone is "
                "balanced (the 2L zigzag of implementation.md 1 balances only the two together)")
        elif self.lay.kind == "cp":
            self.notes.append(
                "two streams under pure CP: each stream runs on the rank's rows of the 2L two-chunk "
                "zigzag (implementation.md 1), noisy chunk r and clean chunk 2cp-1-r, so each "
                "stream alone is unbalanced (the heaviest clean chunk and the heaviest noisy chunk "
                "sit on different ranks, and every layer's K/V collective waits for the slowest) "
                "[U: whether the reference shards each stream on its own]")
        return [type(self)(self.m, self.w, self.p, view, self.gpn, self.ops, self.notes,
                           keys_at_home=self.keys_at_home, implementation=self.impl, prefix=f"{name}.",
                           repeats=self.repeats, placed=self.placed)
                for name, view in zip(self.obj.streams, stream_views(self.lay, ownership))]

    def canvas_pass(self, x: Deps) -> Deps:
        """Self-conditioning: the expected share of a gradient-free forward of the canvas tokens,
        their LM head and softmax, and the soft embedding they feed, appended as work scaled by
        the pass's probability. A two-stream objective's canvas is sharded as its trained
        decoder's (the profile's `stream_ownership`)."""
        p = self.obj.canvas_passes
        per_stream = self.obj.streams != ("main",) and self.impl.stream_ownership == "per-stream"
        sub = type(self)(self.m, self.w, self.p, canvas_view(self.lay, per_stream), self.gpn, self.ops, self.notes,
                       keys_at_home=self.keys_at_home, implementation=self.impl, repeats=self.repeats, placed=self.placed)
        start = len(self.ops)
        for li, a in enumerate(self.m.layers):
            x = sub.layer(li, a, "forward", x)
        x = sub.loss_forward(x, sub.noisy)
        if self.obj.soft_embedding:
            x = sub.soft_embedding(x)
        scaled: dict[int, Work] = {}
        renamed: dict[str, str] = {}
        new = tuple.__new__  # an Op made as its namedtuple's _replace makes it, without the call
        for op in self.ops[start:]:
            work = scaled.get(id(op.work))
            if work is None:  # by value, once per view (candidates share the works)
                work = scaled[id(op.work)] = sub.derived(("scaled", op.work, p), partial(_scaled, op.work, p))
            name = renamed.get(op.name)
            if name is None:
                name = renamed[op.name] = f"selfcond.{op.name}"
            self.ops[op.index] = new(Op, (op.index, name, op.phase, op.layer, work, op.deps))
        return x

    def model_flops(self) -> float:
        """One context group's step math, counted once: 3x forward GEMMs, 3.5x attention.

        The graph's formulas on the unsplit sequence (every row, the clean stream's AR loss, the
        expected self-conditioning forward with its soft embedding), so replicated work (pure
        BP's clean prefix, CSBP's clean replicas, CP's replicated draft decoder) and recompute
        (a frozen head's recomputed logits included) do not count as useful work. Objective ar
        counts its L causal tokens: L(L+1)/2 pairs per head and layer, the LM head over L rows.
        """
        m, obj = self.m, self.obj
        draft = _anchor_tokens(self.w) if obj.context_as_kv else None
        if draft is not None:  # drafter: draft tokens through the layers, context as K/V only
            L, T = _context_rows(self.w), draft  # the context as the drafter keeps it (trimmed)
            ctx = sum(3 * 2 * L * m.hidden * a.kv_width * a.kv_tensors for a in m.layers if a.kind != "linear")
            pairs = {a: _anchor_pairs(self.w, a.window if a.kind == "sliding" else None)
                     for a in m.attention_kinds()}
            total = self._layers_flops(T, pairs, 3.0) + ctx
            total += 2 * 2 * L * m.conditioning_layers * m.hidden ** 2  # fc: forward + weight gradient
            total += 2 * 2 * T * m.hidden * m.vocab  # frozen head: forward + input gradient
            return total * self.w.micro_batch
        L, b = self.w.seq_len, self.w.block_size
        head = 2 * L * m.hidden * m.vocab  # the LM head's forward over L rows
        if obj.causal:  # ar: L tokens through the layers, causal pairs, the head over all L
            pairs = {a: _causal_pairs(L, a.window if a.kind == "sliding" else None) for a in m.attention_kinds()}
            return (self._layers_flops(L, pairs, 3.0) + 3 * head) * self.w.micro_batch
        pairs = {a: _sequence_pairs(L, b, a.window if a.kind == "sliding" else None) for a in m.attention_kinds()}
        main = self._layers_flops(2 * L, pairs, 3.0) + 3 * head * (2 if obj.clean_loss else 1)
        canvas = {a: _canvas_pairs(L, b, a.window if a.kind == "sliding" else None) for a in m.attention_kinds()}
        selfcond = self._layers_flops(L, canvas, 1.0) + head * (2 if obj.soft_embedding else 1)
        useful = obj.passes * main + obj.canvas_passes * selfcond
        rows = obj.rows_per_example
        if obj.clean_stream_counted_once and rows > 1:
            # Fast-dLLM v2 (implementation.md 13): every row runs the clean stream; the useful
            # work is one row's 2L and the other rows' noisy halves (their own views)
            # the head and loss over the L - 1 valid rows of the example (section 13)
            layers = self._layers_flops(2 * L, pairs, 3.0) + (rows - 1) * self._layers_flops(L, canvas, 3.0)
            valid = 3 * head * obj.loss_row_share * rows
            useful = (obj.passes * (layers + valid) + obj.canvas_passes * selfcond) / rows
        # micro_batch counts the batch's rows (`batch_rows`)
        return useful * self.w.micro_batch

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
