"""Live tensor bytes of each rank over one training step, op by op, and where they peak.

Why a timeline and not a sum: a step never holds everything at once. The forward stacks the
checkpointed input of every layer; the backward frees them one layer at a time while gradients
build up; a recomputed layer's activations, its gathered K/V and its attention scores live only
around that layer's backward; the gradient sync and the optimizer come after all activations
are gone. Summing each category's maximum overstates the peak (by the activations when the
optimizer step is the peak, by the gradients when the last layer's backward is), and the report
must say *where* the peak is for a user to act on it. So the step is walked in program order
- forward layers, loss, backward (recompute, then the layer's backward) layer by layer, gradient
sync, optimizer - and at every moment the live bytes are the sum of what is alive then.

Cost: the planner asks this for thousands of candidates. Layers of one kind are identical and
everything that accumulates over layers (checkpointed inputs, saved activations, gradients) is
linear in the layer index, so the live bytes inside a run of same-kind layers peak at its first
or last layer: the walk visits each layer kind at those two indices only, a few dozen moments
per step, each a sum of per-rank numpy arrays (no per-tensor, per-rank or per-layer loop).

Two implementations, chosen by the profile (`gpu.dense_attention`):
- fused (the reference implementation on GPUs, implementation.md sections 1-3): FlashAttention
  keeps out + LSE; fp32 accumulators (dQ in backward, the LSE merge numerator) are transient;
  CP keeps the gathered 2L K/V (its reorder copies) for backward, CSBP its clean L rows; pure BP
  runs its whole replicated clean prefix; MLP chunking off (the full intermediate).
- eager (the CPU runtime, runtime/models/attention.py and runtime/models/model.py op by op): explicit masked
  attention keeps each call's exp-scores for backward and holds three score matrices at its
  forward and backward peaks; the K/V of a call are kept as their query-head copies (the
  broadcast matmul copies them); RMSNorm, RoPE and SwiGLU keep what their autograd nodes save.
The byte counts follow the code they describe; nothing here is fitted to a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from csbp.simulator.layout import kv_rows
from csbp.simulator.layout.layout import Layout
from csbp.simulator.system.implementation import OptimizerPath
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec

# Fraction of a block's noisy tokens that are masked (and enter the loss) in expectation: the
# noise level t of a block is uniform on (0, 1] (BD3-LM; runtime/models/objective.py), E[t] = 1/2.
MASKED_FRACTION = 0.5

LABELS = {
    "params": "params", "master": "fp32 master", "grads": "grads", "optimizer": "optimizer",
    "checkpointed": "checkpointed inputs", "saved": "saved activations",
    "layer": "recomputed layer", "scores": "attention scores", "kv": "K/V buffers",
    "dkv": "dK/dV buffers", "transient": "op buffers", "loss": "loss buffers",
    "comm": "communication buffers", "masks": "attention masks", "context": "context features",
    "fp8": "FP8 weight copies", "allocator": "allocator", "outside": "outside the allocator",
    "routing": "MoE routing indices"}


@dataclass(frozen=True)
class Moment:
    """One point of the step: the phase, the step graph's op name, the layer (None outside)."""

    phase: str
    op: str
    layer: int | None = None

    def describe(self) -> str:
        where = f" of layer {self.layer}" if self.layer is not None else ""
        return f"{self.phase} {self.op}{where}"


@dataclass
class Timeline:
    """Moments in program order and, for each, the live bytes by category (array over ranks or
    a number, the same on every rank), given as a few shared groups of categories (the weights,
    what the layers below keep, the layer's own buffers): their sums are found once per group."""

    n_ranks: int
    moments: list[Moment] = field(default_factory=list)
    _groups: list[tuple[dict, ...]] | None = field(default_factory=list, repr=False)
    _totals: np.ndarray | None = field(default=None, repr=False)  # found once (`StepBytes` gives it)
    _make_groups: object = field(default=None, repr=False)  # makes `_groups` when first read

    @property
    def groups(self) -> list[tuple[dict, ...]]:
        """Per moment, its groups of categories (a search reads only the totals of most plans,
        so `StepBytes` leaves them to be made here, when asked)."""
        if self._groups is None:
            self._groups = self._make_groups()
        return self._groups

    def at(self, moment: Moment, *groups: dict) -> None:
        self.moments.append(moment)
        self.groups.append(groups)
        self._totals = None

    @property
    def parts(self) -> list[dict[str, np.ndarray | float]]:
        """Each moment's bytes by category, its groups merged."""
        return [_merge(*g) for g in self.groups]

    def totals(self) -> np.ndarray:
        """[moments, ranks] live bytes: each distinct group summed once, then one product of
        the moments' group incidence with the groups' sums."""
        if self._totals is None:
            self._totals = self._summed()
        return self._totals

    def _summed(self) -> np.ndarray:
        index: dict[int, int] = {}
        sums: list[np.ndarray | float] = []
        which: list[int] = []  # per (moment, group), the group's row in `sums`
        for groups in self.groups:
            for g in groups:
                k = index.get(id(g))
                if k is None:
                    k = index[id(g)] = len(sums)
                    numbers, arrays = 0.0, []
                    for v in g.values():
                        if isinstance(v, np.ndarray):
                            arrays.append(v)
                        else:
                            numbers += v
                    total = numbers
                    for v in arrays:
                        total = v + total
                    sums.append(total)
                which.append(k)
        moments, k = len(self.groups), len(sums)
        moment = np.repeat(np.arange(moments), [len(groups) for groups in self.groups])
        incidence = np.bincount(moment * k + np.array(which, dtype=np.intp),
                                minlength=moments * k).reshape(moments, k).astype(float)
        matrix = np.empty((len(sums), self.n_ranks))
        for k, v in enumerate(sums):
            matrix[k] = v
        return incidence @ matrix

    def peaks(self) -> tuple[np.ndarray, np.ndarray]:
        """Per rank: the peak live bytes and the index of the moment where it is reached."""
        totals = self.totals()
        where = totals.argmax(axis=0)
        return totals[where, np.arange(self.n_ranks)], where

    def breakdown(self, moment: int, rank: int) -> dict[str, float]:
        """Bytes by category at one moment on one rank (categories summed, zeros dropped)."""
        out: dict[str, float] = {}
        for k, v in _merge(*self.groups[moment]).items():
            b = float(v[rank]) if isinstance(v, np.ndarray) else float(v)
            if b:
                out[k] = out.get(k, 0.0) + b
        return out


@dataclass(frozen=True)
class Sizes:
    """Per-rank sizes the walk reads (bytes unless named otherwise), from the layout."""

    tokens: np.ndarray  # positions x micro-batch x rows per example
    noisy: np.ndarray
    hidden: np.ndarray  # one hidden-state tensor (SP-sharded)
    dt: int
    tp: int
    batch: int  # sequences in one call (micro-batch x rows per example)
    # what the framework runs for this plan family (implementation.py): its copies around the
    # K/V exchange are buffers too; None = the reference implementation's (implementation.md)
    family: object | None = None
    # the whole implementation profile (its moe, linear_attention, head_dim_copies facts add
    # buffers: `implementation_extras`); None = none of them
    impl: object | None = None
    block: int = 1  # diffusion block size (linear attention's boundary states)
    linear_dtype: str = "bf16"  # the blocks' linears (fp8: the implementation's FP8 copies beside them)
    # one MoE layer's routing metadata kept with its checkpoint for the backward (top-k indices
    # replayed in recompute, implementation.md 11): alive from the layer's forward to its backward
    routing: np.ndarray | float = 0.0


@dataclass
class LayerMemory:
    """One layer kind: what its forward keeps for backward and what each op holds briefly.

    `attn_saved` / `mlp_saved`: kept from the forward until the attention / MLP backward (both
    include K/V and score buffers where the implementation keeps them); the `*_transient` entries
    are the extra bytes at the op's own peak, by category.
    """

    attn_saved: dict[str, np.ndarray]
    mlp_saved: dict[str, np.ndarray]
    forward: list[tuple[str, dict[str, np.ndarray], dict[str, np.ndarray]]]  # op, saved so far, extra
    # op, what of the layer is still saved then (None: the attention's part), extra
    backward: list[tuple[str, dict | None, dict[str, np.ndarray]]]
    masks: np.ndarray | float = 0.0  # kept across the step (the runtime builds them once)

    def saved(self) -> np.ndarray:
        return _sum(self.attn_saved) + _sum(self.mlp_saved)


def _sum(parts: dict[str, np.ndarray | float]) -> np.ndarray | float:
    total = 0.0
    for v in parts.values():
        total = total + v
    return total


def _merge(*dicts: dict) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out[k] + v if k in out else v
    return out


def ffn_elements(model: ModelSpec, eager: bool) -> float:
    """Elements per token the MLP keeps for backward: SwiGLU's gate, up and product (fused
    Megatron accounting, 3 x ffn) or, eager, also silu(gate) (4 x ffn); a routed copy per
    top-k expert with its input."""
    per = 4 if eager else 3
    if model.moe:
        moe = model.moe
        return moe.top_k * (model.hidden + per * moe.expert_ffn) + per * moe.dense_ffn
    return per * model.ffn


def layer_memory(model: ModelSpec, layout: Layout, a: AttentionSpec, s: Sizes,
                 eager: bool) -> LayerMemory:
    """The per-op live bytes of one layer of kind `a` on every rank."""
    dt, tp, h = s.dt, s.tp, model.hidden
    T = s.tokens
    unit = T * dt / tp  # bytes of one element per token, TP-sharded
    q_width = a.n_heads * a.head_dim
    gate = q_width if a.gated_q else 0
    kv_w = a.kv_width
    hid, f = s.hidden, ffn_elements(model, eager) * unit
    width = model.moe.top_k * model.moe.expert_ffn + model.moe.dense_ffn if model.moe else model.ffn
    f_one = width * unit  # one intermediate tensor (gate, up, or their gradients)
    if a.kind == "linear":  # Gated-DeltaNet: q, k, v, gate and output; no K/V exchange
        mixer = (2 * a.n_kv_heads * a.head_dim + 3 * q_width) * unit
        attn = {"saved": 2 * hid + mixer}
        return LayerMemory(attn, {"saved": 3 * hid + f},
                           [("attn", attn, {}), ("mlp", _merge(attn, {"saved": 3 * hid + f}), {})],
                           [("mlp", None, {"transient": 2 * f_one}),
                            ("attn", None, {"transient": mixer})])
    positions = T / s.batch  # queries (and local keys) per sequence
    pattern = kv_rows.pattern(layout, a, "forward")
    received = kv_rows.held_at_once(layout, a).astype(float)  # remote K/V rows per sequence
    if pattern != "none" and s.family is not None and s.family.forward.context_exchange == "heads":
        pattern, received = "heads", np.zeros_like(received)  # Ulysses: head shards, no K/V rows
    own = kv_rows.packed_rows(layout, a).astype(float)  # rows this rank sends (its shard)
    row = s.batch * kv_w * a.kv_tensors * dt / tp  # one K/V row (K and V) of every sequence
    if s.family is not None and s.family.forward.kv_heads == "query":  # repeated to the query heads
        row *= a.n_heads / max(a.n_kv_heads, 1)  # before the exchange (TorchTitan's repeat_kv)
    heads = a.n_heads / tp
    if eager:
        return _eager_layer(s, hid, f, f_one, unit, q_width, gate, kv_w, positions, received, own, row,
                            heads, a.n_kv_heads / tp, pattern)
    return _fused_layer(layout, s, hid, f, f_one, unit, q_width, gate, kv_w, positions, received, own,
                        row, heads, pattern, a)


def _eager_layer(s, hid, f, f_one, unit, q_width, gate, kv_w, positions, received, own, row, heads,
                 kv_heads, pattern) -> LayerMemory:
    """runtime/models/model.py + runtime/models/attention.py as autograd runs them (module docstring)."""
    dt, batch = s.dt, s.batch
    qw = q_width * unit
    # attn_norm keeps x*rsqrt and its output (the q/k/v GEMMs' input), the score matmul the
    # rotated q (in place: its broadcast over K/V heads is a view); RoPE keeps only its tables
    # (its products with cos/sin need no input saved: the tables do not require grad)
    pre = {"saved": 2 * hid + qw + gate * unit}
    calls = [("attn.local", positions)]
    if pattern in ("all-gather", "all-to-all"):
        calls.append(("attn.remote", received))
    merged = len(calls) > 1
    scores_of = {name: batch * heads * positions * keys * dt for name, keys in calls}
    kept = {"saved": 0.0, "scores": 0.0, "kv": 0.0, "masks": 0.0}
    forward, kept_after = [], []
    # The score and output matmuls broadcast K and V over the query heads of their group and
    # flatten the batch dims: a view when there is one group per call (batch x K/V heads = 1)
    # or one query head per K/V head, else a copy of K and of V at query width (torch.matmul's
    # expand + reshape), which autograd keeps instead of the K/V themselves
    copies = heads > kv_heads and batch * kv_heads > 1
    for name, keys in calls:
        if copies:
            kv_kept = 2 * batch * keys * q_width * dt / s.tp
        else:  # views of the rank's own K/V (local) or of the received buffer (remote)
            kv_kept = 2 * kv_w * unit if name == "attn.local" else received * row
        scores = scores_of[name]
        if name == "attn.remote":  # the gathered rows arrive: send buffer, gather slots, rows
            exchange = (2 * kv_w * unit + own * row * (own > 0)
                        + (received + own) * row + received * row)
            forward.append(("kv.gather", _merge(pre, kept), {"comm": exchange}))
        mask = positions * keys  # ~allowed, bool, saved by masked_fill
        during = _merge(pre, kept, {"kv": kv_kept, "masks": mask})
        extra = {"scores": 3 * scores}  # masked scores, scores - max, exp: at the exp
        if name == "attn.remote" and copies:
            extra["comm"] = received * row  # the received rows, until the call returns
        forward.append((name, during, extra))
        kept = _merge(kept, {"kv": kv_kept, "masks": mask, "scores": scores,
                             "saved": qw * (2 if merged else 1)})  # e@v (and out, for the merge)
        kept_after.append(_merge(pre, kept))
    attn = _merge(pre, kept, {"saved": qw})  # the attention output, copied for the out GEMM
    if merged:
        forward.append(("attn.merge", _merge(pre, kept), {"transient": 3 * qw}))
    # x + attn (the MLP's residual input), ffn_norm's two, gate, silu, up, product
    mlp = {"saved": 3 * hid + f}
    forward.append(("mlp", _merge(attn, mlp), {"transient": 2 * hid}))
    # backward: the MLP (gradients of two intermediates at once), then the calls in reverse;
    # at a call's backward its own exp-scores are saved and the gradient of e and the sum of
    # its two uses are two more score matrices; a later call's buffers are gone by then
    backward = [("mlp", None, {"transient": 2 * f_one})]
    for c in reversed(range(len(calls))):
        name = calls[c][0]
        backward.append((name, kept_after[c], {"scores": 2 * scores_of[name], "transient": 2 * qw}))
        if name == "attn.remote":  # dK/dV of the received rows go home: the rows, the full
            backward.append(("dkv.scatter", kept_after[c - 1],  # buffer with own zeros, out
                             {"dkv": received * row + (received + own) * row + own * row}))
    masks = positions * (positions + (received if merged else 0))  # each route's, built once
    return LayerMemory(attn, mlp, forward, backward, masks)


def _fused_layer(layout, s, hid, f, f_one, unit, q_width, gate, kv_w, positions, received, own, row,
                 heads, pattern, a) -> LayerMemory:
    """The reference implementation on a GPU (implementation.md sections 1-3)."""
    batch = s.batch
    qw = q_width * unit
    lse = batch * heads * positions * 4  # fp32 log-sum-exp per query head
    acc = batch * positions * q_width * 4 / s.tp  # one fp32 [queries x q width] accumulator
    # norm inputs and the q/k/v GEMM input (Megatron: 2h before attention), q, k, v, out
    pre = {"saved": 2 * hid + 2 * qw + gate * unit + 2 * kv_w * unit + lse}
    forward, kept = [], {"kv": 0.0}
    if pattern == "all-gather":
        gathered = (received + own) * row  # the whole exchange's K and V (CP: 2L, CSBP: L)
        # a reorder copy (CP: into logical order, kept for backward) is a second buffer of them;
        # further passes replace it, so at most two are live
        passes = s.family.forward.copy_passes if s.family is not None else (1 if layout.plan.bp == 1 else 0)
        forward.append(("kv.gather", pre, {"comm": gathered * (1 + min(passes, 1))}))
        kept = {"kv": gathered}
    elif pattern == "all-to-all":
        kept = {"kv": received * row}
        forward.append(("kv.gather", pre, {"comm": 2 * kept["kv"]}))
    elif pattern == "ring":  # two ring buffers in flight; nothing kept (streamed again)
        forward.append(("kv.ring1", pre, {"comm": 2 * received * row}))
    elif pattern == "heads":  # Ulysses: every position's q, k, v on heads / cp, as large as the
        # rank's own; its send and receive buffers at the all-to-all, the head shards kept [U]
        shards = qw + kv_w * a.kv_tensors * unit
        forward.append(("qkv.a2a", pre, {"comm": 2 * shards}))
        kept = {"kv": shards}
    split = pattern not in ("none", "heads") or layout.kind == "bp"
    # a split attention merges partial outputs by LSE with an fp32 numerator
    forward.append(("attn.local" if split else "attn", _merge(pre, kept),
                    {"transient": (acc + qw) if split else 0.0}))
    attn = _merge(pre, kept)
    mlp = {"saved": 2 * hid + f}  # the residual's norm input and output, SwiGLU's three
    forward.append(("mlp", _merge(attn, mlp), {"transient": 2 * hid}))
    keys = positions + received if pattern != "ring" else positions + 2 * received
    dkv = batch * keys * kv_w * a.kv_tensors * s.dt / s.tp  # dK, dV of every key it read
    backward = [("mlp", None, {"transient": 2 * f_one}),
                ("attn.local" if split else "attn", None, {"transient": acc + qw, "dkv": dkv})]
    if pattern in ("all-gather", "all-to-all"):
        # CP: concatenation, index_select and a copy into the send buffer (section 1); CSBP
        # writes straight into the reduce-scatter buffer (section 2)
        passes = s.family.backward.copy_passes if s.family is not None else (3 if layout.plan.bp == 1 else 0)
        copies = 2 if passes else 1  # the send buffer, and one copy beside it while copying
        backward.append(("dkv.scatter", None, {"dkv": dkv + copies * (received + own) * row}))
    if pattern == "heads":  # dQ, dK, dV of the head shards back to the sequence shards
        backward.append(("dqkv.a2a", None, {"comm": 2 * kept["kv"]}))
    return LayerMemory(attn, mlp, forward, backward)


def implementation_extras(model: ModelSpec, layout: Layout, a: AttentionSpec, s: Sizes,
                          mem: LayerMemory) -> LayerMemory:
    """Buffers the implementation's MoE, linear-attention and head-dim facts add to a layer
    (implementation.md 11, 13), merged into the ops where they are alive:
    - route-expanded copies of the routed rows (rows x top-k x hidden) at the MLP, forward and
      backward, one at a time;
    - two-pass linear attention: the fp32 state at every block boundary of the rank's rows,
      kept from the clean pass through the layer's backward (saved with the attention);
    - K/V repeated at a head dim whose kernel packs few query heads: the repeated K/V beside the
      call in forward; in backward the repacked K/V and a gradient buffer as large;
    - FP8 linears: the FP8 copies (and transposes) of the MLP's largest input beside its GEMMs."""
    impl = s.impl
    if impl is None:
        return mem
    unit = s.tokens * s.dt / s.tp
    if model.moe is not None:
        passes = impl.moe.route_copy_passes
        if passes:
            routed = model.moe.top_k * model.hidden * unit / s.dt * (impl.moe.dispatch_bytes or s.dt)
            mem.forward = [(op, d, _merge(e, {"transient": routed}) if op == "mlp" else e) for op, d, e in mem.forward]
            mem.backward = [(op, d, _merge(e, {"transient": routed}) if op == "mlp" else e) for op, d, e in mem.backward]
    copy = impl.fp8.activation_copy_bytes if s.linear_dtype == "fp8" else 0.0
    if copy:  # FP8 copies of the largest linear input (the SwiGLU product into down) at its GEMM
        ffn = model.moe.dense_ffn if model.moe else model.ffn
        fp8 = {"transient": s.tokens * max(model.hidden, ffn / s.tp) * copy}
        mem.forward = [(op, d, _merge(e, fp8) if op == "mlp" else e) for op, d, e in mem.forward]
        mem.backward = [(op, d, _merge(e, fp8) if op == "mlp" else e) for op, d, e in mem.backward]
    if a.kind == "linear" and layout.kind in ("cp", "csbp"):
        # the sequence<->head all-to-alls (implementation.md 13): all_to_all_single's input and
        # its output buffer of the widths it moves, both alive at the call, one pass's rows at a
        # time (the clean stream, or pure CP's noisy rows if the profile moves them too); the
        # gradients go back the same way in backward
        clean = s.tokens - s.noisy
        rows = np.maximum(clean, s.noisy) if (layout.kind == "cp" and impl.linear_attention.cp_moves_noisy) else clean
        a2a = {"comm": 2 * rows * linear_a2a_width(a, impl) * s.dt / s.tp}
        mem.forward = [(op, d, _merge(e, a2a) if op == "attn" else e) for op, d, e in mem.forward]
        mem.backward = [(op, d, _merge(e, a2a) if op == "attn" else e) for op, d, e in mem.backward]
    if a.kind == "linear" and impl.linear_attention.two_passes and np.any(s.noisy):  # ar: no noisy pass
        conv = max(a.conv_kernel - 1, 0) * (2 * a.n_kv_heads + a.n_heads) * a.head_dim * s.dt
        state = (a.n_heads * a.head_dim ** 2 * impl.linear_attention.state_bytes + conv) / s.tp
        states = s.tokens / max(s.block, 1) * state
        mem.attn_saved = _merge(mem.attn_saved, {"saved": states})
        mem.forward = [(op, _merge(d, {"saved": states}) if op == "mlp" else d,
                        _merge(e, {"transient": states}) if op == "attn" else e) for op, d, e in mem.forward]
    gathers = sum(len(c.cp_gathers) for c in getattr(impl, "head_dim_copies", ())
                  if c.head_dim == a.head_dim and a.kind in c.cp_gather_kinds)
    if gathers and layout.kind == "cp" and kv_rows.pattern(layout, a, "backward") == "all-gather":
        # pure CP's gathered query rows (output, dQ) of every member around the backward call:
        # one such buffer alive at a time [U: the output's may live on beside dQ's]
        rows = s.tokens + kv_rows.held_at_once(layout, a).astype(float) * s.batch
        comm = {"comm": rows * a.n_heads * a.head_dim * s.dt / s.tp}
        mem.backward = [(op, d, _merge(e, comm) if op in ("attn", "attn.local") else e) for op, d, e in mem.backward]
    repeat = 1
    for copy in getattr(impl, "head_dim_copies", ()):
        if copy.head_dim == a.head_dim and a.kind != "linear":
            fam = s.family
            kernels = set(fam.forward.kernels.values()) | set(fam.backward.kernels.values()) if fam else set()
            if not copy.kernels or kernels & set(copy.kernels):
                repeat = math.ceil(max(1, a.n_heads // max(a.n_kv_heads, 1)) / copy.max_group)
            break
    if repeat > 1:
        received = kv_rows.held_at_once(layout, a).astype(float)  # remote K/V rows per sequence
        keys = s.tokens / s.batch + received
        row = s.batch * a.kv_width * a.kv_tensors * s.dt / s.tp
        kv = repeat * keys * row
        grad = 2 if any(c.backward_grad_buffer for c in impl.head_dim_copies if c.head_dim == a.head_dim) else 1
        attn_ops = ("attn", "attn.local")
        mem.forward = [(op, d, _merge(e, {"kv": kv}) if op in attn_ops else e) for op, d, e in mem.forward]
        mem.backward = [(op, d, _merge(e, {"dkv": grad * kv}) if op in attn_ops else e) for op, d, e in mem.backward]
    return mem


def linear_a2a_width(a: AttentionSpec, impl=None) -> int:
    """Elements per token a Gated-DeltaNet layer sends sequence -> head: q, k (key heads) and v
    (value heads), plus the output gate z and the per-head beta and a when the implementation
    moves them with the rest (`linear_attention.a2a_gate_inputs`, implementation.md 13)."""
    width = 2 * a.n_kv_heads * a.head_dim + a.n_heads * a.head_dim
    if impl is not None and impl.linear_attention.a2a_gate_inputs:
        width += a.n_heads * a.head_dim + 2 * a.n_heads
    return width


# ---- weights, gradients, optimizer state ----------------------------------------------------

# AdamW's two moments in fp32, and the fp32 master copy of weights trained in bf16/fp16
# (mixed precision); fp32 training (the CPU runtime) updates the weights themselves.
ADAM_BYTES_PER_PARAM = 8
MASTER_BYTES_PER_PARAM = 4
_DEFAULT_PATH = OptimizerPath()  # the default optimizer path (= the two figures above)


@dataclass(frozen=True)
class WeightState:
    """Per rank bytes of the weight side under the ZeRO stage (module docstring of memory.py)."""

    params: float
    master: float
    optimizer: float
    layer_grads: dict[AttentionSpec, float]  # one layer's gradients as the backward leaves them
    head_grads: float  # LM head and final norm (first in the backward)
    embed_grads: float  # embedding (last in the backward; 0 when tied or frozen)
    grads: float  # all of them, after the backward
    bucket: float  # ZeRO-2/3: a layer's full gradients before the reduce-scatter shards them
    largest_tensor: float  # the largest parameter tensor (an optimizer temporary's size)
    trainable: float  # this rank's trainable parameters (elements) the optimizer updates
    replicas: int  # ranks summing the same gradients (1: no gradient sync)
    clip: float = 0.0  # gradient clipping's temporaries at the optimizer (implementation.md 8)
    # ZeRO-3 with the root gathered once (FSDP2): the whole embedding, final norm and LM head in the
    # step dtype, alive from the forward's start to the end of the backward
    root_gathered: float = 0.0
    persistent_grads: float = 0.0  # a gradient buffer alive the whole step (Megatron's main_grad)
    fp8_cache: float = 0.0  # cached FP8 weight copies (Transformer Engine), alive the whole step


_WEIGHTS: dict[tuple, tuple[ModelSpec, WeightState]] = {}


def weight_state(model: ModelSpec, zero: int, dt: int, plan, frozen_embeddings: bool,
                 frozen_router: bool = False, opt=None, fp8_cache_bytes: int = 0) -> WeightState:
    """Parameters, master copy, gradients and AdamW state per rank, sharded by ZeRO stage:
    stage 1 shards optimizer state and master, 2 also gradients, 3 also parameters (gathered a
    layer at a time, the next one prefetched). `opt`: the implementation's optimizer path
    (`implementation.OptimizerPath`: shard groups, buckets, state and master bytes, clipping);
    None = its defaults. `fp8_cache_bytes`: cached FP8 copies per block-linear parameter (FP8
    linears under Transformer Engine). Kept per model and degrees (a search asks the same few
    many times)."""
    key = (id(model), zero, dt, plan.dp, plan.ctx, plan.tp, plan.ep, frozen_embeddings,
           frozen_router, opt, fp8_cache_bytes)
    hit = _WEIGHTS.get(key)
    if hit is None or hit[0] is not model:
        if len(_WEIGHTS) > 4096:
            _WEIGHTS.clear()
        hit = _WEIGHTS[key] = (model, _weight_state(model, zero, dt, plan, frozen_embeddings,
                                                    frozen_router, opt or _DEFAULT_PATH, fp8_cache_bytes))
    return hit[1]


def _weight_state(model: ModelSpec, zero: int, dt: int, plan, frozen_embeddings: bool,
                  frozen_router: bool, opt, fp8_cache_bytes: int = 0) -> WeightState:
    h = model.hidden
    if opt.shard_group == "none" and opt.expert_shard_group == "none":
        zero = 0  # replicated: every rank holds and updates all of it (a drafter, section 14)
    n_dense = opt.dense_group(plan)  # ranks sharing one dense shard (dp x ctx x ep by default)
    n_expert = opt.expert_group(plan)
    embed = model.embedding_params() / plan.tp
    frozen = embed if frozen_embeddings else 0.0
    expert_layer = model.expert_params_per_layer() / plan.ep
    router = h * model.moe.n_experts / plan.ep if (model.moe and frozen_router) else 0.0
    layer = {a: (model.mixer_params(a) + model.dense_ffn_params() + 2 * h) / plan.tp + expert_layer
             - router for a in _layer_structure(model).kinds}
    dense = model.dense_params() / plan.tp - frozen
    expert = model.n_layers * expert_layer
    trainable_full = dense + expert - model.n_layers * router
    sharded = dense / n_dense + expert / n_expert
    shard = sharded / max(trainable_full, 1.0)
    largest_layer = max(layer.values()) if layer else 0.0
    # ZeRO-3: the shards (in the profile's element: FSDP2 keeps fp32 ones) and two gathered
    # layers in the step dtype (the one computing, the next prefetched)
    params = ((dense + expert) * dt if zero < 3 else sharded * (opt.param_bytes or dt) + 2 * largest_layer * dt) \
        + frozen * dt
    root = embed * dt if zero >= 3 and opt.root == "gathered-once" and not frozen_embeddings else 0.0
    owned = trainable_full if zero < 1 else sharded
    stored = opt.param_bytes or dt if zero >= 3 else dt
    master = owned * MASTER_BYTES_PER_PARAM if stored < 4 and opt.master else 0.0
    tied = model.tie_embeddings
    head = 0.0 if frozen_embeddings else (model.vocab * h / plan.tp + h)
    emb = 0.0 if (frozen_embeddings or tied) else model.vocab * h / plan.tp
    g = (opt.grad_bytes or dt) * (1.0 if zero < 2 else shard)
    widths = [model.vocab, model.ffn, *(a.n_heads * a.head_dim for a in layer)]
    if model.moe:
        widths.append(model.moe.expert_ffn)
    # gradient buckets alive through the backward (ZeRO-2): two of the largest layer, or the
    # profile's IPG buffers of the largest trainable parameter (implementation.md 8), plus the
    # flattened copy an all-reduce fallback makes of one
    if opt.buckets == "step":  # reduced once after the backward, from the gradients themselves
        bucket = 0.0
    elif opt.buckets == "largest-parameter":
        trained = [model.ffn, *(a.n_heads * a.head_dim for a in layer)]
        largest = max(trained + ([] if frozen_embeddings else [model.vocab])) * h / plan.tp
        flat = opt.flatten_all_reduce and opt.collective(plan) == "all-reduce"
        bucket = (opt.bucket_buffers + flat) * largest * (opt.bucket_bytes or dt)
    else:  # a layer's whole gradients (and the one before, still reducing) in the wire's element
        bucket = opt.bucket_buffers * largest_layer * (opt.bucket_bytes or dt)
    # clipping: each gradient slice copied at clip_temporary_bytes for its norm, one at a time
    clip = opt.clip_temporary_bytes * min(max(widths) * h / plan.tp, owned)
    linears = sum(n * (model.mixer_params(a) + model.dense_ffn_params())
                  for a, n in _layer_structure(model).count.items()) / plan.tp
    # a buffer allocated before the step holds every gradient; none appear during the backward
    persistent = trainable_full * g if opt.persistent_grads else 0.0
    keep = 0.0 if opt.persistent_grads else 1.0
    return WeightState(
        params=params, master=master, optimizer=owned * 2 * opt.state_bytes,
        layer_grads={a: v * g * keep for a, v in layer.items()}, head_grads=head * g * keep,
        embed_grads=emb * g * keep, grads=trainable_full * g * keep, bucket=bucket if zero >= 2 else 0.0,
        largest_tensor=max(widths) * h / plan.tp * 4, trainable=owned,
        replicas=plan.dp * plan.ctx * plan.ep, clip=clip, root_gathered=root,
        persistent_grads=persistent, fp8_cache=fp8_cache_bytes * linears)


# ---- the walk -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Structure:
    """Where each layer kind sits in the stack: found once per model (a search asks thousands
    of times, and comparing layer specs is slow)."""

    n: int
    kinds: tuple[AttentionSpec, ...]
    first: dict
    last: dict
    count: dict
    before_count: dict  # kind -> layers of that kind before index i, i = 0..n
    after_count: dict  # kind -> layers of that kind after index i, i = 0..n-1 (Python ints)


_STRUCTURES: dict[int, tuple[ModelSpec, _Structure]] = {}


def _layer_structure(model: ModelSpec) -> _Structure:
    hit = _STRUCTURES.get(id(model))
    if hit is None or hit[0] is not model:
        if len(_STRUCTURES) > 64:
            _STRUCTURES.clear()
        layers = model.layers
        kinds = tuple(dict.fromkeys(layers))
        index = [kinds.index(a) for a in layers]
        n = len(layers)
        before = {a: np.cumsum([0] + [int(j == k) for j in index]) for k, a in enumerate(kinds)}
        st = _Structure(
            n=n, kinds=kinds,
            first={a: index.index(k) for k, a in enumerate(kinds)},
            last={a: n - 1 - index[::-1].index(k) for k, a in enumerate(kinds)},
            count={a: index.count(k) for k, a in enumerate(kinds)},
            before_count=before,
            after_count={a: tuple((c[n] - c[1:]).tolist()) for a, c in before.items()})
        hit = _STRUCTURES[id(model)] = (model, st)
    return hit[1]


@dataclass(frozen=True)
class RetainedEncoder:
    """DiffusionGemma's two trained streams (implementation.md section 12): the causal clean
    encoder runs every layer first, then the decoder over the noisy canvas. Every layer's encoder
    K/V stay alive until the decoder's backward (inputs of the decoder's checkpoints), their
    gradients accumulate over the whole decoder backward, and the encoder's own checkpoints wait
    for the encoder's backward, which comes last.

    A recomputed layer's own buffers in the backward are those of its stream's rows (`streams`:
    the decoder's canvas rows in the decoder's backward, the encoder's clean rows in the
    encoder's), as the step graph runs them; the forward (without checkpointing) keeps one pass
    over all the rank's rows, both streams' saved activations being alive together. This adds
    what the two streams keep beyond the walk's layers, per rank."""

    kv: dict[AttentionSpec, np.ndarray]  # one layer's encoder K (and V) of the clean rows it owns
    clean_hidden: np.ndarray  # one encoder checkpoint: the clean rows' hidden state
    clean_routing: np.ndarray | float = 0.0  # one encoder layer's routing indices (MoE), kept with it
    # ((encoder layout view, its Sizes), (decoder view, its Sizes)); empty: one pass's buffers
    streams: tuple = ()

    def total(self, shape: "_Structure") -> np.ndarray | float:
        return _sum({a: shape.count[a] * v for a, v in self.kv.items()})

    def grads_after(self, shape: "_Structure", i: int) -> np.ndarray | float:
        """dK/dV of the encoder K/V of the layers after i (the decoder's backward done there)."""
        return _sum({a: shape.after_count[a][i] * v for a, v in self.kv.items()})

    def decoder_backward(self, shape: "_Structure", i: int, stored: str) -> dict:
        """At the decoder's backward of layer i: every layer's encoder K/V, the gradients of
        those after i, and the encoder checkpoints of the layers from i + 1 on (the walk's
        checkpoints of the layers below i hold both streams' rows)."""
        out = {"kv": self.total(shape), "dkv": self.grads_after(shape, i),
               stored: (shape.n - i - 1) * self.clean_hidden}
        if np.any(self.clean_routing):
            out["routing"] = (shape.n - i - 1) * self.clean_routing
        return out


def weight_bytes(terms: list, weights: WeightState, shape: _Structure, zero: int,
                 eager: bool) -> dict:
    """Per term of the walk (`StepBytes.terms`), the weight side's bytes alive then by category:
    the same on every rank, and the only part of the step's bytes that depends on dp and ep
    (through the ZeRO shards and the experts per rank)."""
    bucket = weights.bucket if zero >= 2 else 0.0  # ZeRO-2/3's buckets, alive through the backward
    # per kind, in `shape.kinds` order, looked up once (hashing a layer spec is slow)
    grads = [weights.layer_grads[a] for a in shape.kinds]
    after = [shape.after_count[a] for a in shape.kinds]
    layers_grads = sum(g * shape.count[a] for g, a in zip(grads, shape.kinds))
    all_grads = weights.grads if zero >= 2 else layers_grads + weights.head_grads + weights.embed_grads
    fixed = {"params": weights.params, "master": weights.master, "optimizer": weights.optimizer,
             "grads": weights.persistent_grads, "fp8": weights.fp8_cache}
    # AdamW: per tensor (CPU: foreach off) sqrt and division temporaries of the largest tensor;
    # foreach (CUDA) one fp32 temporary list of every updated parameter
    temp = 2 * weights.largest_tensor if eager else weights.trainable * 4
    known = {
        # the root (FSDP2) is gathered from the forward's start to its backward's end
        "fixed": fixed | {"params": weights.params + weights.root_gathered}, "fixed-after": fixed,
        "head": {"grads": weights.head_grads + bucket},
        "encoder": {"grads": layers_grads + weights.head_grads + bucket},  # the decoder's backward done
        "all": {"grads": all_grads}, "bucket": {"grads": bucket},
        # the gradients flattened into one buffer (runtime/plans/dp.py) or DDP's buckets
        "sync": {"grads": all_grads, "comm": all_grads},
        "optimizer": {"grads": all_grads, "transient": temp + weights.clip}}
    out = {}
    for term in terms:
        if isinstance(term, tuple) and term[0] == "after":  # the layers after term[1], and the head
            i = term[1]
            done = sum(g * c[i] for g, c in zip(grads, after))
            out[term] = {"grads": weights.head_grads + done + bucket}
        else:
            out[term] = known[term]
    return out


@dataclass
class StepBytes:
    """The step's moments with what the activations hold at each (per rank) and which weight
    terms are alive then (`weight_bytes`). The activations depend on the layout, TP, the
    transport and checkpointing, not on dp or ep, so a search walks the step once for all the
    plans that differ only there (most of them) and adds each one's weight side: a column of
    numbers, the same on every rank."""

    activations: Timeline
    terms: list[tuple]  # per moment, the weight terms alive
    shape: _Structure
    zero: int
    eager: bool
    # found at the first `timeline`: the activations' totals, the distinct terms and which
    # moments hold each
    _totals: np.ndarray | None = field(default=None, repr=False)
    _terms: list = field(default_factory=list, repr=False)
    _incidence: np.ndarray | None = field(default=None, repr=False)

    def timeline(self, weights: WeightState) -> Timeline:
        """The step's bytes under one weight state: its totals the activations' plus the terms'
        sums, its groups (for a breakdown) the activations' and the terms'."""
        if self._totals is None:
            self._totals = self.activations.totals()
            self._terms = list(dict.fromkeys(t for terms in self.terms for t in terms))
            index = {t: k for k, t in enumerate(self._terms)}
            self._incidence = np.zeros((len(self.terms), len(self._terms)))
            for m, terms in enumerate(self.terms):
                for t in terms:
                    self._incidence[m, index[t]] += 1.0
        values = weight_bytes(self._terms, weights, self.shape, self.zero, self.eager)
        column = self._incidence @ np.array([sum(values[t].values()) for t in self._terms])
        acts, terms = self.activations, self.terms
        return Timeline(acts.n_ranks, acts.moments, None, self._totals + column[:, None],
                        lambda: [g + tuple(values[t] for t in ts) for g, ts in zip(acts.groups, terms)])


def walk_activations(model: ModelSpec, layout: Layout, sizes: Sizes, eager: bool,
                     checkpointing: bool, loss: np.ndarray | float, context: np.ndarray | float = 0.0,
                     zero: int = 0, retained: RetainedEncoder | None = None,
                     loss_backward: np.ndarray | float | None = None, synced: bool = True) -> StepBytes:
    """The step in program order (module docstring) without the weight state: the moments, the
    activations' bytes and the weight terms alive at each (`StepBytes.timeline` adds a weight
    state's bytes). `synced`: gradients are summed over replicas (dp x ctx x ep > 1).
    `retained`: DiffusionGemma's encoder K/V and checkpoints held for the decoder (section 12)."""
    tl = Timeline(len(sizes.tokens))
    terms: list[tuple] = []
    shape = _layer_structure(model)
    layers, n = model.layers, shape.n

    def buffers_of(lay: Layout, s: Sizes) -> dict:
        """Each layer kind's buffers on the ranks of `lay` (sized by `s`)."""
        return {a: implementation_extras(model, lay, a, s, layer_memory(model, lay, a, s, eager))
                for a in shape.kinds}

    streams = retained.streams if retained is not None else ()
    # the whole layout's layers are read by the forward and the stored activations (without
    # checkpointing), the masks (eager) and the backward (one stream): only then are they made
    kinds = buffers_of(layout, sizes) if not checkpointing or eager or not streams else {}
    hid = sizes.hidden
    fixed = {"context": context}  # with the term "fixed": parameters, master, optimizer state, ...
    if eager:  # the runtime builds the masks once
        fixed["masks"] = _sum({i: m.masks for i, m in enumerate(kinds.values())})
    first, last = shape.first, shape.last
    stored_name = "checkpointed" if checkpointing else "saved"
    layer_name = "layer" if checkpointing else "saved"

    def at(moment: Moment, weight_terms: tuple, *groups: dict) -> None:
        tl.at(moment, *groups)
        terms.append(weight_terms)

    # prefix sums over layers: what the layers before i keep
    before_count = shape.before_count

    routing = sizes.routing if np.any(sizes.routing) else None  # per MoE layer, kept to its backward

    def stored_before(i: int) -> dict:
        if checkpointing:
            return {"checkpointed": i * hid} if routing is None else {"checkpointed": i * hid, "routing": i * routing}
        out: dict = {"saved": i * hid} if routing is None else {"saved": i * hid, "routing": i * routing}
        for a, mem in kinds.items():
            c = int(before_count[a][i])
            if c:
                out = _merge(out, {k: c * v for k, v in _merge(mem.attn_saved, mem.mlp_saved).items()})
        return out

    def rename(d: dict, saved_as: str) -> dict:
        return {(saved_as if k == "saved" else k): v for k, v in d.items()}

    # forward: the last layer of each kind holds the most (everything below it is stored).
    # Under full checkpointing a layer's forward holds what its recompute holds, less the
    # gradients and the incoming gradient the recompute has beside it: never the peak, skipped.
    own_input = {stored_name: hid}
    for a in ([] if checkpointing else sorted(kinds, key=lambda a: last[a])):
        i, mem = last[a], kinds[a]
        below = stored_before(i)
        for op, during, extra in mem.forward:
            # checkpointed forward keeps nothing once an op's output is consumed, but the
            # tensors an op reads and writes are the ones it would save
            at(Moment("forward", op, i), ("fixed",), fixed, below, own_input, rename(during, "transient"),
               extra)
    # loss: every layer's stored part, the final hidden state and norm, the loss buffers
    kept = {"kv": retained.total(shape)} if retained is not None else {}
    at(Moment("loss", "cross-entropy"), ("fixed",), fixed, stored_before(n),
       {stored_name: hid, "transient": 2 * hid, "loss": loss}, kept)
    if loss_backward is not None:  # a loss kernel whose backward allocates (implementation.md 9)
        at(Moment("loss", "head-bwd"), ("fixed", "head"), fixed, stored_before(n), kept,
           {stored_name: hid, "transient": 2 * hid, "loss": loss_backward})
    # backward, last layer first; each kind at its last layer (most stored below) and its first
    # (most gradients above)
    visits = sorted({(last[a], a) for a in shape.kinds} | {(first[a], a) for a in shape.kinds},
                    key=lambda x: -x[0])
    def layer_buffers(per_kind: dict) -> tuple[dict, dict]:
        """Each kind's recompute and backward buffers, renamed once (a kind is visited at two
        layers)."""
        recomputed = {a: [(op, rename(during, "layer"), extra) for op, during, extra in m.forward]
                      for a, m in per_kind.items()} if checkpointing else {}
        backwards = {a: [(m.backward[0][0], rename(_merge(m.attn_saved, m.mlp_saved), layer_name),
                          m.backward[0][2])]
                     + [(op, rename(m.attn_saved if still is None else still, layer_name), extra)
                        for op, still, extra in m.backward[1:]] for a, m in per_kind.items()}
        return recomputed, backwards

    encoder_buffers = encoder_hidden = None
    if streams:  # each stream's backward on its own rows
        (enc_layout, enc_sizes), (dec_layout, dec_sizes) = streams
        recomputed, backwards = layer_buffers(buffers_of(dec_layout, dec_sizes))
        encoder_buffers = layer_buffers(buffers_of(enc_layout, enc_sizes))
        encoder_hidden = enc_sizes.hidden
    else:
        recomputed, backwards = layer_buffers(kinds)
    for i, a in visits:
        below = stored_before(i)
        here = {stored_name: hid, "transient": hid}  # with the gradients of the layers after i
        if routing is not None:
            here["routing"] = routing
        kept = retained.decoder_backward(shape, i, stored_name) if retained is not None else {}
        grads = ("fixed", ("after", i))
        for op, during, extra in recomputed.get(a, ()):
            at(Moment("recompute", op, i), grads, fixed, below, here, during, extra, kept)
        for op, layer, extra in backwards[a]:
            at(Moment("backward", op, i), grads, fixed, below, here, layer, extra, kept)
    if retained is not None:
        # the encoder's backward starts at its last layer with every gradient of the decoder's
        # backward, all encoder K/V and their gradients, and every encoder checkpoint: its peak
        # (later layers free their K/V, gradients and checkpoints) [section 12]
        i, a = n - 1, layers[n - 1]
        total = retained.total(shape)
        here = {stored_name: n * retained.clean_hidden, "kv": total, "dkv": total,
                "transient": hid if encoder_hidden is None else encoder_hidden}
        if np.any(retained.clean_routing):
            here["routing"] = n * retained.clean_routing
        enc_recomputed, enc_backwards = encoder_buffers or (recomputed, backwards)
        for op, during, extra in enc_recomputed.get(a, ()):
            at(Moment("recompute", f"encoder.{op}", i), ("fixed", "encoder"), fixed, here, during, extra)
        for op, layer, extra in enc_backwards[a]:
            at(Moment("backward", f"encoder.{op}", i), ("fixed", "encoder"), fixed, here, layer, extra)
    # the gradient buckets are alive to the end of the backward (implementation.md 8)
    at(Moment("backward", "embed-bwd", 0), ("fixed", "all", "bucket"), fixed, {"transient": hid})
    if synced and zero < 2:
        at(Moment("grad-sync", "grads.all-reduce"), ("fixed-after", "sync"), fixed)
    at(Moment("optimizer", "adamw"), ("fixed-after", "optimizer"), fixed)
    return StepBytes(tl, terms, shape, zero, eager)


def masked_loss_bytes(model: ModelSpec, noisy: np.ndarray, dt: int, tp: int) -> np.ndarray:
    """The eager runtime's loss: logits of the masked noisy tokens only (the others weigh 0),
    their log-softmax and its gradient in fp32, and the gathered hidden rows."""
    hit = noisy * MASKED_FRACTION
    vocab = math.ceil(model.vocab / tp)
    return hit * (3 * vocab * 4 + model.hidden * dt)
