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
from dataclasses import dataclass, field, replace
from itertools import count

import numpy as np

from csbp.simulator.layout import kv_rows, pairs
from csbp.simulator.cost.attention_ops import (ATTENTION_BACKWARD_FLOP_RATIO, ATTENTION_KERNEL_TILE,  # noqa: F401
                                          MERGE_BACKWARD_PASSES, MERGE_FORWARD_PASSES, AttentionOps)
from csbp.simulator.system.implementation import DEFAULT_IMPLEMENTATION, Implementation, load_implementation
from csbp.simulator.cost.layer_template import _LayerTemplate
from csbp.simulator.layout.layout import Layout
from csbp.simulator.layout.layout import clear_caches as clear_layout_caches
from csbp.simulator.cost.linear_ops import (DELTA_RULE_CHUNK, LINEAR_STATE_BYTES,  # noqa: F401 (re-exported)
                                       LinearAttentionOps, LinearGemmOps, delta_rule_flops_per_token)
from csbp.simulator.cost.fp8_ops import FP8Ops
from csbp.simulator.cost.loss_ops import LossOps
from csbp.simulator.cost.moe_ops import MoEOps
from csbp.simulator.cost.objective_ops import (ObjectiveOps, _anchor_pairs_of, _canvas_pairs, _causal_pairs,
                                               _context_rows_of, _sequence_pairs)
from csbp.simulator.cost.optimizer_ops import ADAMW_BYTES_PER_PARAM, OptimizerOps  # noqa: F401 (re-exported)
from csbp.simulator.workload.objectives import ObjectiveShape, batch_rows, objective_shape
from csbp.simulator.layout.pairs import pairs_with_keys  # noqa: F401 (re-exported)
from csbp.simulator.cost.placement import _placed_group, group_on_nodes
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec
from csbp.simulator.cost.step_ops import (COUNT_BYTES, LOSS_BYTES, Category, Collective, Comm, Compute,  # noqa: F401
                                     ComputeKind, Deps, Group, Op, PerRank, Phase, Work)
from csbp.simulator.workload.workload import Workload

_TEMPLATE_IDS = count()
# what the engines keep with a graph per profile (`engine.durations`, `engine.stretch`): a graph
# placed again (`StepGraph.placed_as`) prices its transfers again
PRICED_ARRAYS = ("durations", "stretch")

# Training does dgrad + wgrad: a linear layer's backward is twice its forward.
GEMM_BACKWARD_FLOP_RATIO = 2.0


@dataclass(frozen=True)
class StepGraph:
    """The ops of one training step for the representative ranks of one context group."""

    ranks: int
    ops: tuple[Op, ...]
    model_flops: float  # FLOPs of the step's math for one context group, once, without recompute
    views: int = 1  # layout sequences per example the step runs: rows x passes (objective)
    notes: tuple[str, ...] = field(default=())
    # stamped layers, in program order: (first op, end, template, the ops before it that its ops
    # wait for). Instances of one template run the same ops with the same relative waits: the
    # engines time one that enters as an earlier one did, shifted, as that one shifted (`program`)
    repeats: tuple[tuple[int, int, int, tuple[int, ...]], ...] = field(default=(), repr=False, compare=False)
    # each group the builder made and how (`_Builder._regroup`'s recipes): what `placed_as` redoes
    placed: tuple[tuple[Group, frozenset], ...] = field(default=(), repr=False, compare=False)
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
        return cls.builder(model, workload, plan, layout, gpus_per_node, one_bucket=one_bucket,
                           keys_at_home=keys_at_home, implementation=implementation).build()

    @staticmethod
    def builder(model: ModelSpec, workload: Workload, plan: Plan, layout: Layout, gpus_per_node: int,
                **options) -> "_Builder":
        """The builder `build` runs, before it appends any op: the planner's bounds read single
        works of it (a ring's hops, the EP all-to-alls, a drafter's reader ops) without a graph."""
        return _Builder(model, batch_rows(workload, model), plan, layout, gpus_per_node, **options)

    def placed_as(self, plan: Plan, gpus_per_node: int) -> "StepGraph | None":
        """This step under `plan`, a plan that differs from the one it was built for only in
        where its groups sit (`Plan.placement`), without building it again: the builder reads a
        placement only where it makes a group (`_regroup`; nothing else it does depends on it),
        so the ops, waits and layers are these, each transfer on its group made again for `plan`
        (issue 25: a re-scored plan's other placement costs a graph per search otherwise). What
        the engines derive from the ops (steps, streams, chains) is shared. None where a group
        cannot be told apart: one made by recipes that now give different groups."""
        regrouped: dict[Group, Group] = {}
        recipes: dict[Group, frozenset] = {}
        for group, made in self.placed:
            new = {_regroup(r, plan, gpus_per_node) for r in made}
            if len(new) != 1:
                return None
            regrouped[group] = new.pop()
            recipes[regrouped[group]] = recipes.get(regrouped[group], frozenset()) | made
        works, which = self.works()
        placed, moved = [], []
        for k, w in enumerate(works):
            if isinstance(w, Comm):
                if w.group not in regrouped:
                    return None
                if regrouped[w.group] is not w.group:
                    w = replace(w, group=regrouped[w.group])
                    moved.append(k)
            placed.append(w)
        ops = list(self.ops)  # only the ops of a regrouped transfer change
        for i in np.flatnonzero(np.isin(which, moved)).tolist():
            ops[i] = ops[i]._replace(work=placed[which[i]])
        graph = StepGraph(self.ranks, tuple(ops), self.model_flops, self.views, self.notes, self.repeats,
                          tuple(recipes.items()))
        graph._arrays.update((k, v) for k, v in self._arrays.items()
                             if not (isinstance(k, tuple) and k[0] in PRICED_ARRAYS))
        graph._arrays["works"] = (placed, which)
        return graph

    def flops(self, include_recompute: bool = True) -> np.ndarray:
        """FLOPs each representative rank executes in one step."""
        works, which = self.works()
        counted = np.array([isinstance(w, Compute) for w in works], dtype=bool)[which]
        if not include_recompute:
            counted &= np.array([op.phase != "recompute" for op in self.ops], dtype=bool)
        counted = np.flatnonzero(counted)  # per op, in program order (the sum's order)
        rows = np.array([w.flops if isinstance(w, Compute) else (0.0,) * self.ranks for w in works])
        return rows[which[counted]].sum(axis=0) if counted.size else np.zeros(self.ranks)

    def received_bytes(self) -> dict[str, np.ndarray]:
        """Bytes each representative rank receives per step, by traffic category."""
        works, which = self.works()
        rows = np.array([w.bytes for w in works]) if works else np.zeros((0, self.ranks))
        category = [w.category if isinstance(w, Comm) else None for w in works]
        names = list(dict.fromkeys(c for c in category if c is not None))  # works: as first issued
        code = np.array([-1 if c is None else names.index(c) for c in category], dtype=np.intp)[which]
        # per category its ops in program order (the sum's order)
        return {c: rows[which[np.flatnonzero(code == k)]].sum(axis=0) for k, c in enumerate(names)}

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


# ---- the builder --------------------------------------------------------------------------------

_GROUPS: dict[tuple, Group] = {}
_MISSING = object()  # a cache's "not made yet" (None is a made value: no transfer)


def _interned(size: int, per_node: int, sync: tuple[tuple[int, ...], ...]) -> Group:
    """One Group object per value: the builder's per-ownership caches key works by their group,
    and a key found again compares its group by identity, not member by member (a 256-rank ring's
    sync lists 256 tuples)."""
    key = (size, per_node, sync)
    group = _GROUPS.get(key)
    if group is None:
        if len(_GROUPS) >= 4096:
            _GROUPS.clear()
        group = _GROUPS[key] = Group(size, per_node, sync)
    return group


def _regroup(recipe: tuple, plan: Plan, gpus_per_node: int) -> Group:
    """The group a recipe makes under `plan`: ("axes", axes, sync, ctx_block) spans those axes
    (`group_on_nodes`); ("ring", sync, ctx_block) is a ring step's pair, across nodes where the
    context group it runs in spans them. The builder makes every group here, so a graph placed
    again (`StepGraph.placed_as`) gets the groups a build under that placement would."""
    if recipe[0] == "ring":
        _, sync, ctx_block = recipe
        n, per_node = group_on_nodes(plan, gpus_per_node, ("ctx",), ctx_block)
        return _interned(2, 1 if per_node < n else 2, sync)
    _, axes, sync, ctx_block = recipe
    return _interned(*group_on_nodes(plan, gpus_per_node, axes, ctx_block), sync)


class _Builder(AttentionOps, LinearAttentionOps, LinearGemmOps, MoEOps, ObjectiveOps, LossOps, OptimizerOps,
               FP8Ops):
    """Appends the ops of one step in program order; each helper returns the ops that end it."""

    def __init__(self, model: ModelSpec, workload: Workload, plan: Plan, layout: Layout,
                 gpus_per_node: int, ops: list | None = None, notes: list | None = None,
                 one_bucket: bool = False, keys_at_home: bool = False,
                 implementation: "Implementation | str | None" = None, prefix: str = "",
                 repeats: list | None = None, placed: dict | None = None) -> None:
        self.m, self.w, self.p, self.lay = model, workload, plan, layout
        self.prefix = prefix  # a trained stream's ops are named after it ("encoder.", "decoder.")
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
        self.repeats: list = [] if repeats is None else repeats  # StepGraph.repeats, shared likewise
        self.placed: dict = {} if placed is None else placed  # StepGraph.placed, shared likewise
        self._cache: dict = {}
        self._layers: dict[tuple, _LayerTemplate | tuple | None] = {}
        self._layer_ids: dict[tuple, int] = {}  # StepGraph.repeats' template numbers
        every = tuple(range(self.n))
        self.cp_sync = layout.cp_groups()
        self.g_tp = self._group(("tp",), tuple((r,) for r in every))
        self.g_ep = self._group(("ep",), tuple((r,) for r in every))
        self.g_cp = self._group(("ctx",), self.cp_sync, ctx_block=len(self.cp_sync[0]))
        self.g_dense = self._group(("dp", "ctx", "ep"), (every,))
        self.g_expert = self._group(("dp", "ctx", "tp"), (every,))

    @functools.cached_property
    def g_ring(self) -> Group:
        """A ring step's pair: across nodes where the cp group spans them (its steps priced there).
        Made when a ring transfer asks for it, so that a plan without one records no ring group
        (`StepGraph.placed_as`: under TP 2 it equals the TP group until the plan is placed again)."""
        return self._made(("ring", tuple((r,) for r in range(self.n)), len(self.cp_sync[0])))

    def _group(self, axes, sync, ctx_block=None) -> Group:
        return self._made(("axes", tuple(axes), sync, ctx_block))

    def _made(self, recipe: tuple) -> Group:
        """The group of a recipe (`_regroup`), remembered with it for `StepGraph.placed_as`."""
        group = _regroup(recipe, self.p, self.gpn)
        self.placed.setdefault(group, set()).add(recipe)
        return group

    # -- small constructors -------------------------------------------------------------------
    def add(self, name: str, phase: Phase, layer: int | None, work: Work | None, *deps: Deps) -> Deps:
        """Append an op after `deps`; with no work (None) the deps pass through unchanged."""
        if len(deps) == 1 and len(deps[0]) <= 1:  # most ops: after the one op before them
            flat = tuple(deps[0])
        else:
            flat = tuple(sorted({d for ds in deps for d in ds}))
        if work is None:
            return flat
        if self.prefix:
            name = self.prefix + name
        self.ops.append(Op(len(self.ops), name, phase, layer, work, flat))
        return (len(self.ops) - 1,)

    def derived(self, key, make):
        """Counts that depend only on the layout's shares, made once per layout ownership (many
        candidates of a search share it)."""
        found = self.lay.derived.get(key, _MISSING)  # one lookup where found (most calls)
        if found is _MISSING:
            found = self.lay.derived[key] = make()
        return found

    def cached(self, key, make):
        """Identical layers share their work objects (and the engines price each once)."""
        found = self._cache.get(key, _MISSING)
        if found is _MISSING:
            found = self._cache[key] = make()
        return found

    def per_rank(self, values) -> PerRank:
        if isinstance(values, np.ndarray) and values.ndim == 1:  # most calls: a row per rank
            return tuple(values.astype(float, copy=False).tolist())
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

    def tp_step(self, name: str, phase: Phase, li: int, work: Comm | None, x: Deps) -> Deps:
        """A layer's TP collective as the implementation runs it (`implementation.tp`): waited
        on by the next op, or overlapped with the GEMMs (the layer's end waits for it, see
        `tp_side`); a recompute replays it or not."""
        tp = self.impl.tp
        if phase == "recompute" and not tp.replay_in_recompute:
            return x
        out = self.add(name, phase, li, work, x)
        if tp.mode(phase) == "waited" or work is None:
            return out
        self._tp_side = getattr(self, "_tp_side", ()) + out
        return x

    def tp_side(self) -> Deps:
        """The overlapped TP collectives of the layer just built (the layer ends after them)."""
        side, self._tp_side = getattr(self, "_tp_side", ()), ()
        return side

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
            if template is not None:  # the first layer of its kind is an instance too
                self._layer_ids[key] = next(_TEMPLATE_IDS)  # unique in the process (not id())
                self.repeats.append((start, end, self._layer_ids[key], tuple(sorted(set(first_x)))))
        if template is not None:
            base = len(self.ops)
            out = template.stamp(self.ops, li, x)
            self.repeats.append((base, len(self.ops), self._layer_ids[key], tuple(sorted(set(x)))))
            return out
        start = len(self.ops)
        out = self.layer_backward(li, a, x) if phase == "backward" else self.layer_forward(li, a, phase, x)
        if x and key not in self._layers:  # with no input, which ops wait for it cannot be seen
            self._layers[key] = (start, len(self.ops), x, out)  # recorded if a second one comes
        return out

    def layer_forward(self, li: int, a: AttentionSpec, phase: Phase, x: Deps) -> Deps:
        c = self.cached
        norm_work = c(("norm", a), lambda: self.memory_bound(self.norm_bytes(a)))
        f_in, f_out = c(("mix", a), lambda: self.mixer_gemms(a))
        x = self.tp_step("attn-in.ag", phase, li, self.norm_gather(), x)  # FP8 under TE (fp8_ops)
        x = self.add("norm-rope", phase, li, norm_work, x)
        x = self.add("fp8.cast", phase, li, c(("fp8", a, phase), lambda: self.fp8_casts(a, phase)), x)
        x = self.add("qkv", phase, li, c(("qkv", a), lambda: self.linear_gemm(f_in)), x)
        x = self.add("context-kv", phase, li, c(("ctx-kv", a), lambda: self.context_kv(a, 1.0)), x)
        if a.kind == "linear":
            x = self.linear_forward(li, a, phase, x)
        else:
            x = self.attention_forward(li, a, phase, x)
        x = self.add("out-proj", phase, li, c(("out", a), lambda: self.linear_gemm(f_out)), x)
        x = self.tp_step("attn-out.rs", phase, li, self.tp_collective("reduce-scatter"), x)
        x = self.tp_step("mlp-in.ag", phase, li, self.norm_gather(mlp=True), x)
        x = self.add("norm-swiglu", phase, li, norm_work, x)
        x = self.ffn(li, phase, x, backward=False)
        return self.tp_step("mlp-out.rs", phase, li, self.mlp_collective("reduce-scatter"), x) + self.tp_side()


    def ffn(self, li: int, phase: Phase, x: Deps, backward: bool) -> Deps:
        """Dense SwiGLU, or router + routed experts (EP all-to-all around them) + dense branch."""
        m, h = self.m, self.m.hidden
        ratio = GEMM_BACKWARD_FLOP_RATIO if backward else 1.0
        kernels = 4 if backward else 2  # gate+up and down GEMMs (dgrad and wgrad of each)
        if m.moe is None:
            return self.add("mlp", phase, li, self.cached(("mlp", backward), lambda: self.linear_gemm(
                ratio * 2 * self.tokens * 3 * h * m.ffn / self.tp, kernels, backward)), x)
        return self.moe_ffn(li, phase, x, backward)  # moe_ops.py

    def layer_backward(self, li: int, a: AttentionSpec, x: Deps) -> Deps:
        c, g = self.cached, GEMM_BACKWARD_FLOP_RATIO
        norm_work = c(("normb", a), lambda: self.memory_bound(2 * self.norm_bytes(a)))
        f_in, f_out = c(("mix", a), lambda: self.mixer_gemms(a))
        x = self.tp_step("mlp-out.ag-bwd", "backward", li, self.mlp_collective("all-gather"), x)
        x = self.add("fp8.cast-bwd", "backward", li, c(("fp8", a, "backward"), lambda: self.fp8_casts(a, "backward")), x)
        x = self.ffn(li, "backward", x, backward=True)
        x = self.add("norm-swiglu-bwd", "backward", li, norm_work, x)
        x = self.tp_step("mlp-in.rs-bwd", "backward", li, self.mlp_collective("reduce-scatter"), x)
        x = self.tp_step("attn-out.ag-bwd", "backward", li, self.tp_collective("all-gather"), x)
        x = self.add("out-proj-bwd", "backward", li, c(("outb", a), lambda: self.linear_gemm(g * f_out, 2, True)), x)
        if a.kind == "linear":
            x = self.linear_backward(li, a, x)
        else:
            x = self.attention_backward(li, a, x)
        x = self.add("context-kv-bwd", "backward", li, c(("ctx-kvb", a), lambda: self.context_kv(a, g)), x)
        x = self.add("qkv-bwd", "backward", li, c(("qkvb", a), lambda: self.linear_gemm(g * f_in, 2, True)), x)
        x = self.add("norm-rope-bwd", "backward", li, norm_work, x)
        return self.tp_step("attn-in.rs-bwd", "backward", li, self.tp_collective("reduce-scatter"), x) + self.tp_side()

    def embed_work(self) -> Compute:
        """The embedding lookup of the builder's rows (read and write one hidden row each)."""
        return self.memory_bound(self.tokens * self.m.hidden * self.dt * 2 / self.tp)

    # -- the step ------------------------------------------------------------------------------
    def build(self) -> StepGraph:
        m, w, layers, obj = self.m, self.w, self.m.layers, self.obj
        h = m.hidden
        zero3, recompute = self.zero_stage == 3, w.checkpointing == "full"
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
        self.notes.extend(self.attention_notes())  # how the CP exchange runs (attention_ops)
        self.notes.append(self.gradient_note())
        self.notes.extend(self.loss_notes())
        embed = self.embed_work()
        grads, x = (), ()
        bucketed = not self.one_bucket
        # a drafter's offline features: a background reader beside the step (objective_ops)
        x = self.feature_io(x)
        x = self.root_gather(x)  # FSDP2's root module, gathered once (optimizer_ops)
        if obj.canvas_passes:
            x = self.canvas_pass(self.canvas_sync(x))
        # the trained streams in program order: one pass over the layout, or (DiffusionGemma,
        # implementation.md 12) the encoder over the clean rows, then the decoder over the canvas
        streams = self.stream_builders()  # objective_ops
        for v in range(obj.passes):
            last_view = v == obj.passes - 1
            for s in streams:  # forward: each stream through every layer and its loss
                x = s.add("embed", "forward", None, embed if s is self else s.embed_work(), x)
                # vocabulary-parallel embedding: partial embeddings reduce-scattered to the shards
                x = s.add("embed.rs", "forward", None, s.tp_collective("reduce-scatter"), x)
                x = s.add("fc-conditioning", "forward", None, s.conditioning(False), x)
                prefetch: Deps = ()
                for li, a in enumerate(layers):
                    if zero3:  # gather layer li's parameters while layer li-1 computes
                        prefetch = self.param_gather("zero3.params", "forward", li, *self.layer_params(a), prefetch)
                    x = s.layer(li, a, "forward", x + prefetch)
                x = s.loss_forward(x)
                x = s.loss_backward(x)
            if last_view and bucketed and head_params and not m.tie_embeddings:
                grads += self.bucket_ready(None, head_params, 0.0, x)
            for s in reversed(streams):  # backward: the last stream first; the first one's
                done = s is streams[0]  # backward completes each layer's weight gradients
                prefetch = ()
                for li in range(len(layers) - 1, -1, -1):
                    a = layers[li]
                    if zero3 and self.regathers(li):
                        prefetch = self.param_gather("zero3.params", "backward", li, *self.layer_params(a), prefetch)
                    if recompute:  # rerun the layer from its checkpointed input, then backward
                        x = s.layer(li, a, "recompute", x + prefetch)
                    x = s.layer(li, a, "backward", x + prefetch)
                    if last_view and bucketed and done:
                        grads += self.bucket_ready(li, *self.layer_params(a), x)
                x = s.add("fc-conditioning-bwd", "backward", None, s.conditioning(True), x)
                if not obj.frozen_embeddings:
                    x = s.add("embed.ag-bwd", "backward", None, s.tp_collective("all-gather"), x)
                    x = s.add("embed-bwd", "backward", None, embed if s is self else s.embed_work(), x)
            if last_view:  # norms' and router's partial gradients summed over TP, once
                grads += self.add("grads.sequence-parallel.all-reduce", "grad-sync", None, self.comm(
                    "all-reduce", self.sequence_parallel_params() * self.dt * 2 * self.ring_share(self.g_tp),
                    self.g_tp, "gradients"), x)
            if last_view and bucketed:
                tied = head_params if m.tie_embeddings else 0.0
                grads += self.bucket_ready(None, edge_params + tied, 0.0, x, last=True)
            elif last_view:  # every gradient at once
                grads += self.grad_sync(None, *self.trained_params(), x)
        # the step's loss summed over every rank (to check it and to log it): one fp32 scalar,
        # nothing on a GPU cluster, a whole call's wake-up on a CPU host
        loss = self.add("loss.all-reduce", "grad-sync", None, self.comm(
            "all-reduce", LOSS_BYTES * 2 * self.ring_share(self.g_dense), self.g_dense, "other"), x, grads)
        step = self.add("adamw", "optimizer", None, self.optimizer(), self.clip_norm(x + grads + loss))
        if self.zero_stage in (1, 2):
            self.param_gather("updated-params", "param-sync", None, *self.trained_params(), step)
        self.fp8_amax(step)
        return StepGraph(self.n, tuple(self.ops), self.model_flops(), obj.passes * obj.rows_per_example,
                         tuple(self.notes), tuple(sorted(self.repeats)),
                         tuple((g, frozenset(made)) for g, made in self.placed.items()))


# what other modules keep between graphs (prices, recent graphs), forgotten with the rest
ALSO_CLEARED: list = [_GROUPS.clear]


def clear_caches() -> None:
    """Forget what earlier graphs cached, layouts included (a benchmark measuring a cold start)."""
    clear_layout_caches()
    for cached in (_placed_group, _sequence_pairs, _canvas_pairs, _causal_pairs, _anchor_pairs_of, _context_rows_of,
                   pairs._window_prefix, pairs._block_counts):
        cached.cache_clear()
    for clear in ALSO_CLEARED:
        clear()
    from csbp.simulator.plan import rules  # its checked plans

    rules._VIOLATIONS.clear()


