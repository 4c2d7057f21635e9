"""The step graph's MoE layers: router, the expert-parallel dispatch and combine, the routed
experts and the dense branch beside them (a mixin of the builder).

How the experts run (one GEMM per expert, or one grouped GEMM over jagged groups), which kernel
moves the all-to-alls and in what dtype, which all-to-all the dense branch hides, host syncs and
route-expanded copies are the implementation profile's `moe` facts (implementation.md 11);
routing is balanced (every expert gets rows x top-k / experts).
"""

from __future__ import annotations

from dataclasses import replace

from csbp.simulator.cost.step_ops import COUNT_BYTES, Comm, Compute, Deps, Phase

# Training does dgrad + wgrad: a linear layer's backward is twice its forward (as graph.py).
_BACKWARD = 2.0


class MoEOps:
    """MoE feed-forward of one layer (mixed into the builder)."""

    def routed_rows(self):
        """Routed rows of this rank: each sequence-parallel shard routes its own tokens, top-k
        copies each."""
        return self.tokens / self.tp * self.m.moe.top_k

    def ep_exchange(self, backward: bool, send_weights: bool) -> Comm | None:
        """One EP all-to-all of the routed rows, in the profile's dtype and kernel; the dispatch
        also carries the routing weights where the implementation sends them."""
        f, ep, h = self.impl.moe, self.p.ep, self.m.hidden
        per_row = h * (f.dispatch_bytes or self.dt) + (f.weight_bytes if send_weights else 0)
        work = self.comm("all-to-all", self.routed_rows() * per_row * (ep - 1) / ep, self.g_ep, "ep")
        return replace(work, kernel=f.a2a_kernel) if work is not None else None

    def experts_work(self, backward: bool) -> Compute:
        """The routed experts' GEMMs (gate, up, down): one call per local expert on the dense
        curve, or one grouped call per GEMM stage priced on the family's curve at the expert
        width (`best`: the faster of the two)."""
        moe, ep, h = self.m.moe, self.p.ep, self.m.hidden
        f = self.impl.moe
        ratio = _BACKWARD if backward else 1.0
        flops = ratio * 2 * self.routed_rows() * 3 * h * moe.expert_ffn
        stages = 6 if backward else 3  # gate, up, down (dgrad and wgrad of each)
        if f.expert_gemm == "per-expert":
            return self.gemm(flops, stages * (moe.n_experts // ep))
        calls = stages * (moe.n_experts // ep) if f.expert_gemm == "best" else stages
        work = self.gemm(flops, calls)
        return replace(work, kernel=f.expert_gemm, shape_x=float(moe.expert_ffn))

    def dense_branch(self, backward: bool) -> Compute | None:
        """The dense SwiGLU beside the experts (its GEMMs; dgrad and wgrad backward), or None."""
        moe = self.m.moe
        if not moe.dense_ffn:
            return None
        ratio = _BACKWARD if backward else 1.0
        return self.gemm(ratio * 2 * self.tokens * 3 * self.m.hidden * moe.dense_ffn / self.tp,
                         4 if backward else 2)

    def route_copies(self) -> Compute | None:
        """Route-expanded copies of the rows (index_select and its backward): full read + write
        passes over rows x top-k x hidden."""
        f = self.impl.moe
        if not f.route_copy_passes:
            return None
        return self.memory_bound(f.route_copy_passes * 2 * self.routed_rows() * self.m.hidden
                                 * (f.dispatch_bytes or self.dt))

    def host_syncs(self) -> Compute | None:
        n = self.impl.moe.host_syncs_per_layer
        return Compute("host-sync", self.per_rank(0), self.per_rank(0), n) if n else None

    def moe_ffn(self, li: int, phase: Phase, x: Deps, backward: bool) -> Deps:
        """Router, EP all-to-all, experts, all-to-all back, and the dense branch beside one of
        the two all-to-alls (`moe.dense_overlaps`)."""
        m, h = self.m, self.m.hidden
        moe, ep, f, c = m.moe, self.p.ep, self.impl.moe, self.cached
        ratio = _BACKWARD if backward else 1.0
        tokens = self.tokens / self.tp
        router_ratio = 1.0 if backward and self.obj.frozen_router else ratio  # input gradient only
        router = self.add("router", phase, li, c(("router", backward), lambda: self.gemm(
            router_ratio * 2 * tokens * h * moe.n_experts)), x)
        if not backward:  # each expert's row count to its owner, so it knows what will arrive
            router = self.add("ep.counts", phase, li, c("ep-counts", lambda: self.comm(
                "all-to-all", moe.n_experts * COUNT_BYTES * (ep - 1) / ep, self.g_ep, "ep")), router)
            router = self.add("moe.host-sync", phase, li, c("moe-sync", self.host_syncs), router)
        dense_work = c(("dense", backward), lambda: self.dense_branch(backward))
        copy = c("moe-route-copy", self.route_copies)
        routed = self.add("moe.route-copy", phase, li, copy, router)
        early = f.dense_overlaps == "dispatch"  # computed while the dispatch moves the rows
        dense = self.add("dense-mlp", phase, li, dense_work, router) if early and dense_work else ()
        sent = self.add("ep.combine-grad" if backward else "ep.dispatch", phase, li,
                        c(("ep-a2a-out", backward), lambda: self.ep_exchange(backward, not backward)), routed)
        experts = self.add("experts", phase, li, c(("experts", backward), lambda: self.experts_work(backward)),
                           routed, sent)
        back = self.add("ep.dispatch-grad" if backward else "ep.combine", phase, li,
                        c(("ep-a2a-back", backward), lambda: self.ep_exchange(backward, False)), experts)
        back = self.add("moe.route-copy-back", phase, li, copy, back)
        if dense_work is None:
            return back
        if not early:
            dense = self.add("dense-mlp", phase, li, dense_work, experts)
        return dense + back
