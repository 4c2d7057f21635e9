"""The optimizer and gradient path of a step: which parameters a rank trains, how their gradients
are reduced over the data-parallel ranks, and the optimizer's own pass. A mixin of the builder.
"""

from __future__ import annotations

from csbp.simulator.cost.step_ops import Collective, Compute, Deps, Group, Phase
from csbp.simulator.system.implementation import OptimizerPath
from csbp.simulator.workload.spec import AttentionSpec

# Fused AdamW per parameter: reads fp32 master, m, v and a bf16 grad, writes master, m, v and the
# bf16 weight: 3*4+2 bytes each way (the default profile's `optimizer`, which reproduces it).
ADAMW_BYTES_PER_PARAM = 28
MASTER_BYTES = 4
# mesh axes of each optimizer shard group (implementation.OptimizerPath.shard_group)
_AXES = {"dp-ctx-ep": ("dp", "ctx", "ep"), "dp-ctx": ("dp", "ctx"), "dp-ctx-tp": ("dp", "ctx", "tp")}


class OptimizerOps:
    """Parameters, gradient synchronisation and the optimizer (mixed into the builder)."""

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

    # -- the optimizer path of the implementation profile (implementation.OptimizerPath) -----
    @property
    def opt(self) -> OptimizerPath:
        """This objective's optimizer path (an objective may run its own, e.g. a drafter)."""
        return self.cached("opt-path", lambda: self.impl.optimizer.path(self.obj.name))

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage that runs: the framework's (FSDP2: 3), else the workload's."""
        return self.opt.stage(self.w.zero_stage)

    def root_gather(self, x: Deps) -> Deps:
        """ZeRO-3 with a root gathered once (FSDP2's root module: embedding, final norm, LM head):
        one all-gather of its shards before the forward; it stays unsharded until its backward."""
        if self.zero_stage != 3 or self.opt.root != "gathered-once":
            return x
        head, edge = self.edge_params()
        return self.param_gather("zero3.root", "forward", None, head + edge, 0.0, x)

    def regathers(self, li: int) -> bool:
        """ZeRO-3: whether layer li's parameters are gathered again for its backward (FSDP2 keeps
        the last block's from its forward: reshard_after_forward off for it)."""
        return not (self.opt.reshard_after_forward == "all-but-last" and li == self.m.n_layers - 1)

    def grad_groups(self) -> tuple[Group, int, Group, int]:
        """(dense group, dense shards, expert group, expert shards): who reduces each kind of
        gradient and over how many ranks its optimizer state is cut. A shard group of `none`
        (replicated state) reduces over every rank holding the same weights, cut nowhere."""
        def make():
            every = (tuple(range(self.n)),)
            out = ()
            for name, replicas in ((self.opt.shard_group, ("dp", "ctx", "ep")),
                                   (self.opt.expert_shard_group, ("dp", "ctx", "tp"))):
                sharded = name != "none" and self.zero_stage >= 1
                group = self._group(_AXES[name] if name != "none" else replicas, every)
                out += (group, group.size if sharded else 1)
            return out
        return self.cached("grad-groups", make)

    def reduce_collective(self, shards: int) -> Collective:
        return self.opt.collective(self.p) if shards > 1 else "all-reduce"

    def bucket_elements(self) -> float:
        """Elements of one gradient bucket (`largest-parameter`): the largest parameter this
        rank trains, the embedding (V x h / tp) unless it is frozen (implementation.md 8)."""
        def make() -> float:  # asked at every layer's bucket: found once per graph
            m = self.m
            widths = [m.ffn, *(a.n_heads * a.head_dim for a in m.layers)]
            if not self.obj.frozen_embeddings:
                widths.append(m.vocab)
            return max(widths) * m.hidden / self.tp
        return self.cached("bucket-elements", make)

    def bucket_ready(self, layer: int | None, dense: float, expert: float, x: Deps,
                     last: bool = False) -> Deps:
        """Gradients of (dense, expert) parameters just made: reduce them now (per-layer
        buckets), or add them to the bucket being filled and reduce it when it holds the
        largest parameter's size (`largest-parameter`); `last`: the backward is over, reduce
        what is left."""
        if self.opt.buckets == "layer":
            return self.grad_sync(layer, dense, expert, x)
        pending = getattr(self, "_pending", (0.0, 0.0))
        pending = (pending[0] + dense, pending[1] + expert)
        out: Deps = ()
        full = self.opt.buckets == "largest-parameter" and sum(pending) >= self.bucket_elements()
        if last or full:  # `step` buckets: everything once the backward is over
            out = self.grad_sync(layer, *pending, x)
            pending = (0.0, 0.0)
        self._pending = pending
        return out

    def grad_sync(self, layer: int | None, dense: float, expert: float, x: Deps) -> Deps:
        """Reduce one bucket of gradients over its group: a reduce-scatter onto the shards, or
        an all-reduce (replicated state, or the profile's fallback under EP); dense gradients
        of a shard group without the EP peers also all-reduced over EP (implementation.md 8)."""
        g_dense, n_dense, g_expert, n_expert = self.grad_groups()
        nbytes = self.opt.bucket_bytes or self.dt
        out: Deps = ()
        for what, params, group, shards in (("dense", dense, g_dense, n_dense),
                                            ("experts", expert, g_expert, n_expert)):
            collective = self.reduce_collective(shards)
            share = self.ring_share(group) * (2 if collective == "all-reduce" else 1)
            work = self.cached(("grads", what, params, collective), lambda: self.comm(
                collective, params * nbytes * share, group, "gradients"))
            out += self.add(f"grads.{what}.{collective}", "grad-sync", layer, work, x) if work else ()
            if what == "dense" and self.opt.ep_dense_all_reduce and self.p.ep > 1 and params:
                ep = self.cached(("grads", "ep", params), lambda: self.comm(
                    "all-reduce", params * nbytes * 2 * self.ring_share(self.g_ep), self.g_ep, "gradients"))
                out += self.add("grads.dense.ep-all-reduce", "grad-sync", layer, ep, x) if ep else ()
        return out

    def param_gather(self, name: str, phase: Phase, layer: int | None, dense: float,
                     expert: float, x: Deps) -> Deps:
        """ZeRO: all-gather parameter shards (a layer's for ZeRO-3, all updated ones for 1/2)."""
        g_dense, n_dense, g_expert, n_expert = self.grad_groups()
        out: Deps = ()
        for what, params, group, shards in (("dense", dense, g_dense, n_dense),
                                            ("experts", expert, g_expert, n_expert)):
            if shards <= 1:  # replicated: every rank updated all of it
                continue
            work = self.cached(("params", what, params), lambda: self.comm(
                "all-gather", params * self.dt * self.ring_share(group), group, "params"))
            out += self.add(f"{name}.{what}", phase, layer, work, x) if work else ()
        return out

    def gradient_note(self) -> str:
        """How the step reduces gradients and updates weights, in one line for the report."""
        o, w, zero = self.opt, self.w, self.zero_stage
        _, n_dense, _, n_expert = self.grad_groups()
        reduce = self.reduce_collective(n_dense)
        step = self.one_bucket or o.buckets == "step"
        buckets = ("one bucket after the backward pass (nothing to hide behind)" if step
                   else "per layer bucket" if o.buckets == "layer"
                   else f"buckets of the largest trainable parameter ({o.bucket_buffers} buffers alive "
                        "through the backward)")
        group = {"none": "every rank holding the same weights (replicated state)",
                 "dp-ctx": "the dp x ctx ranks", "dp-ctx-ep": "the dp x ctx x ep ranks",
                 "dp-ctx-tp": "the dp x ctx x tp ranks"}[o.shard_group]
        dtype = {1: "fp8", 2: "bf16", 4: "fp32"}[o.bucket_bytes] if o.bucket_bytes else w.dtype
        stage = (f"ZeRO-{zero} (the implementation's, whatever the workload's {w.zero_stage}); "
                 if o.zero_stage is not None and o.zero_stage != w.zero_stage else "")
        fsdp = ""
        if zero == 3:
            fsdp = ("; parameters all-gathered in bf16 a layer at a time in forward and again in backward"
                    + (" (the last layer kept from its forward)" if o.reshard_after_forward == "all-but-last" else "")
                    + (", the root (embedding, final norm, LM head) gathered once before the forward"
                       if o.root == "gathered-once" else "")
                    + (f", shards stored in {o.param_bytes} B" if o.param_bytes else ""))
        return (stage + f"gradients: {reduce} in {dtype}, {buckets}, over {group}"
                + ("" if step else ", hidden behind the next layers' backward")
                + ("; a gradient buffer alive through the step" if o.persistent_grads else "")
                + (f"; gradients kept in {o.grad_bytes} B" if o.grad_bytes else "") + fsdp
                + ("; dense gradients all-reduced again over ep" if o.ep_dense_all_reduce and self.p.ep > 1 else "")
                + (f"; clipping copies each gradient slice at {o.clip_temporary_bytes} B for its norm"
                   if o.clip_temporary_bytes else "")
                + (f"; AdamW state {o.state_bytes} B per moment" + (", fp32 master" if o.master else ", no master"))
                + ("; updated parameters all-gathered after the optimizer, not hidden behind the next step"
                   if zero in (1, 2) and n_dense > 1 else ""))

    def optimizer_shard(self) -> float:
        """Parameters this rank's optimizer updates."""
        _, n_dense, _, n_expert = self.grad_groups()
        dense, expert = self.trained_params()
        return dense / n_dense + expert / n_expert

    def optimizer(self) -> Compute:
        """AdamW over the rank's shard: reads the gradient, reads and writes both moments and
        the weights (the fp32 master, then the step-dtype copy written; or the weights themselves
        without a master)."""
        o, dt = self.opt, self.dt
        stored = o.param_bytes or dt if self.zero_stage == 3 else dt  # FSDP2: fp32 shards
        weights = 2 * MASTER_BYTES + stored if o.master and stored < MASTER_BYTES else 2 * stored
        # 28 B by default: a bf16 gradient, fp32 master and moments, the bf16 weight written
        per_param = (o.grad_bytes or dt) + 2 * 2 * o.state_bytes + weights
        return self.memory_bound(self.optimizer_shard() * per_param, "optimizer")

    def clip_norm(self, x: Deps) -> Deps:
        """Gradient clipping's global norm: each gradient slice read and copied at
        `clip_temporary_bytes` (fp64) for its norm, then one scalar all-reduce over the shard
        group (implementation.md 8); nothing without clipping temporaries."""
        o = self.opt
        if not o.clip_temporary_bytes:
            return x
        shard = self.optimizer_shard()
        x = self.add("clip.norm", "optimizer", None, self.memory_bound(
            shard * (self.dt + 2 * o.clip_temporary_bytes)), x)
        g_dense = self.grad_groups()[0]
        return self.add("clip.norm.all-reduce", "optimizer", None, self.comm(
            "all-reduce", o.clip_temporary_bytes * 2 * self.ring_share(g_dense), g_dense, "other"), x)
