"""The optimizer and gradient path of a step: which parameters a rank trains, how their gradients
are reduced over the data-parallel ranks, and the optimizer's own pass. A mixin of the builder.
"""

from __future__ import annotations

from csbp.simulator.cost.step_ops import Collective, Compute, Deps, Phase
from csbp.simulator.workload.spec import AttentionSpec

# Fused AdamW per parameter: reads fp32 master, m, v and a bf16 grad, writes master, m, v and the
# bf16 weight: 3*4+2 bytes each way.
ADAMW_BYTES_PER_PARAM = 28


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
