"""The step graph's linear ops, two mixins of the builder:

- the transformer blocks' linear GEMMs (attention projections, dense MLP) at the step's linear
  dtype: bf16, or FP8 as torchao Float8 and Transformer Engine run them (frameworks.md A2, B3);
- linear-attention (Gated-DeltaNet) layers: the chunked delta rule, the sequence<->head
  all-to-all around it under CP/CSBP, and the clean prefix's states at block boundaries routed
  to the noisy blocks' owners (implementation.md 4).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from csbp.simulator.cost.attention_ops import ATTENTION_BACKWARD_FLOP_RATIO
from csbp.simulator.cost.memory_timeline import linear_a2a_width
from csbp.simulator.system.implementation import DEFAULT_IMPLEMENTATION, Implementation, load_implementation
from csbp.simulator.workload.spec import AttentionSpec
from csbp.simulator.cost.step_ops import Collective, Comm, Compute, Deps, Phase
from csbp.simulator.workload.workload import Workload

# Chunk length of the chunked (gated) delta rule in flash-linear-attention (chunk_size = 64).
DELTA_RULE_CHUNK = 64

# Bytes per element of a linear-attention recurrent state passed between ranks: fp32, as chunked
# delta-rule kernels keep their state (assumed [U]; bf16 would halve the boundary-state traffic).
LINEAR_STATE_BYTES = 4


def resolve_linear_dtype(workload: Workload, implementation: "Implementation | str | None" = None) -> str:
    """The dtype of the blocks' linear GEMMs: the workload's (`--linear-dtype`), else the
    implementation profile's `linear_dtype` (absent or None: it names none), else bf16."""
    if workload.linear_dtype is not None:
        return workload.linear_dtype
    impl = load_implementation(implementation or DEFAULT_IMPLEMENTATION)
    return getattr(impl, "linear_dtype", None) or "bf16"


FP8_NOTE = ("linear dtype fp8: the blocks' linear GEMMs (q/k/v and output projections, dense MLP) "
            "that the implementation runs in FP8 (forward, dgrad, wgrad) at the GPU's FP8 peak and "
            "FP8 GEMM curve (frameworks.md A2, B3); the LM head, attention, norms, MoE experts and "
            "router and a drafter's context K/V projections stay in the step's dtype")

GEMMS = ("forward", "dgrad", "wgrad")  # the three GEMMs of a linear (dgrad and wgrad: equal FLOPs)


class LinearGemmOps:
    """The transformer blocks' linear GEMMs (mixed into the builder): q/k/v and output
    projections and the dense SwiGLU MLP, forward and backward, at the step's linear dtype.

    FP8 as torchao Float8 (TorchTitan, frameworks.md A2) and Transformer Engine (Megatron, B3)
    run it: the forward, dgrad and wgrad GEMMs of each block linear in FP8, while the output
    projection (LM head), attention and norms stay bf16. Only the GEMMs' rate changes here (the
    GPU's `fp8_peak_tflops` and `fp8_gemm_efficiency`, `cost.compute_seconds`), not their FLOPs;
    which GEMMs run FP8, and the casts, amax and FP8 weight copies around them, are the
    implementation's (`fp8_ops.FP8Ops.fp8_gemm`, mixed into the same builder). MoE experts (grouped
    GEMMs) stay bf16 [U: neither framework's FP8
    expert path is in frameworks.md]."""

    def fp8_share(self, gemms: tuple[str, ...]) -> float:
        """Share of the FLOPs of `gemms` (GEMMs of equal FLOPs) that run FP8."""
        share = sum(bool(self.fp8_gemm(g)) for g in gemms) / len(gemms)  # the implementation's (fp8_ops)
        if share and FP8_NOTE not in self.notes:  # a sub-pass shares the notes
            self.notes.append(FP8_NOTE)
        return share

    def linear_gemm(self, flops, kernels: int = 1, backward: bool = False) -> Compute:
        """A block linear's GEMM(s): `flops` split into `kernels` calls, forward or (`backward`)
        dgrad + wgrad, each GEMM at its dtype."""
        share = self.fp8_share(GEMMS[1:] if backward else GEMMS[:1])
        return Compute("gemm", self.per_rank(flops), self.per_rank(0), kernels, fp8_share=share)


def delta_rule_flops_per_token(head_dim_k: int, head_dim_v: int, chunk: int = DELTA_RULE_CHUNK) -> float:
    """Forward FLOPs per token and value head of the chunked (gated) delta rule.

    Per chunk of C tokens (Yang et al., arXiv 2406.06484 / 2412.06464): K K^T (2C^2 dk), the
    triangular solve (~2C^3/3), W = T K and U = T V (2C^2 dk + 2C^2 dv), the state terms W S,
    Q S and the update K^T V' (3 x 2C dk dv), and the intra-chunk Q K^T and its product with V'
    (2C^2 dk + 2C^2 dv); divided by C.
    """
    c, dk, dv = chunk, head_dim_k, head_dim_v
    return 6 * c * dk + 4 * c * dv + 2 * c * c / 3 + 6 * dk * dv


class LinearAttentionOps:
    """Linear-attention layers of the step (mixed into the builder)."""

    def linear_ulysses(self, a: AttentionSpec, rows: str = "clean") -> tuple[Comm | None, Comm | None]:
        """Linear attention under CP/CSBP: sequence->head all-to-all of the clean rows' q, k, v,
        and back for their output; noisy blocks stay with their owners (`boundary_states`),
        unless the implementation moves them too (`rows="noisy"`, pure CP)."""
        if self.lay.kind not in ("cp", "csbp"):
            return None, None
        n = len(self.cp_sync[0])
        width_in = linear_a2a_width(a, self.impl)  # q, k, v (+ z, beta, a where the profile says)
        width_out = a.n_heads * a.head_dim
        clean = self.noisy if rows == "noisy" else self.tokens - self.noisy
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
        if self.lay.kind not in ("cp", "csbp") or self.obj.causal:  # ar: no noisy block restarts
            return None
        n = len(self.cp_sync[0])
        if self.moves_noisy():  # noisy rows head-parallel too: each rank has its heads' states
            return None
        state = self.state_bytes(a)
        if self.lay.kind == "cp":  # noisy rows are zigzag shards, not blocks: every boundary
            blocks = np.full(self.n, self.w.n_blocks - 1, dtype=float)
            collective: Collective = "all-gather"
        else:
            blocks = np.array([len(s.noisy_blocks) - (0 in s.noisy_blocks) for s in self.lay.shares], dtype=float)
            collective = "all-to-all"
        return self.comm(collective, blocks * state * self.w.micro_batch * (n - 1) / n, self.g_cp, "other")

    def state_bytes(self, a: AttentionSpec) -> float:
        """One block boundary's state: heads x dk x dv in the implementation's state dtype, plus
        the conv's last conv_kernel - 1 inputs in the compute dtype, split over TP by heads."""
        conv = max(a.conv_kernel - 1, 0) * (2 * a.n_kv_heads + a.n_heads) * a.head_dim * self.dt
        return (a.n_heads * a.head_dim * a.head_dim * self.impl.linear_attention.state_bytes + conv) / self.tp

    def moves_noisy(self) -> bool:
        """Pure CP with an implementation that takes the noisy rows head-parallel too."""
        return self.lay.kind == "cp" and self.impl.linear_attention.cp_moves_noisy

    def states_io(self, a: AttentionSpec) -> Compute | None:
        """Two passes: the clean pass writes a state at every block boundary of its rows, the
        noisy pass reads the one each of its blocks starts from (HBM traffic)."""
        if not self.impl.linear_attention.two_passes or self.obj.causal:  # ar: no noisy blocks
            return None
        blocks = self.tokens / self.w.block_size  # clean boundaries written + noisy starts read
        return self.memory_bound(blocks * self.state_bytes(a))

    def delta_rule(self, a: AttentionSpec, backward: bool, rows: str = "all") -> Compute:
        """Chunked Gated-DeltaNet: FLOPs linear in tokens, run as a fused kernel on chunk tiles,
        over the rank's rows: "all", or (CP/CSBP) the "clean" ones head-sharded after the
        all-to-all or the "noisy" blocks at their owners."""
        tokens = {"all": self.tokens, "clean": self.tokens - self.noisy, "noisy": self.noisy}[rows]
        flops = tokens * a.n_heads / self.tp * delta_rule_flops_per_token(a.head_dim, a.head_dim)
        if backward:
            flops = flops * ATTENTION_BACKWARD_FLOP_RATIO
        return Compute("linear-bwd" if backward else "linear-fwd", self.per_rank(flops),
                       self.per_rank(0), 1, self.per_rank(DELTA_RULE_CHUNK), False,
                       kernel=self.impl.linear_attention.kernel)

    def linear_forward(self, li: int, a: AttentionSpec, phase: Phase, x: Deps) -> Deps:
        """Gated-DeltaNet in forward or recompute: under CP/CSBP the clean rows go head-sharded
        through the delta rule, their boundary states travel to the noisy blocks' owners, and
        each noisy block restarts from its state where it lives."""
        c, f = self.cached, self.impl.linear_attention
        a2a_in, a2a_out = c(("lin-ulysses", a), lambda: self.linear_ulysses(a))
        io = c(("states-io", a), lambda: self.states_io(a))
        if self.lay.kind not in ("cp", "csbp"):
            if not f.two_passes:
                return self.add("delta-rule", phase, li, c(("dr", a, False), lambda: self.delta_rule(a, False)), x)
            x = self.add("delta-rule.clean", phase, li, c(("dr-clean", a, False), lambda: self.delta_rule(
                a, False, "clean")), x)
            x = self.add("lin.states-io", phase, li, io, x)
            return self.add("delta-rule.noisy", phase, li, c(("dr-noisy", a, False), lambda: self.delta_rule(
                a, False, "noisy")), x)
        x = self.add("lin.a2a-in", phase, li, a2a_in, x)
        clean = self.add("delta-rule.clean", phase, li, c(("dr-clean", a, False), lambda: self.delta_rule(
            a, False, "clean")), x)
        states = self.add("lin.states", phase, li, c(("states", a), lambda: self.boundary_states(a)), clean)
        out = self.add("lin.a2a-out", phase, li, a2a_out, clean)
        waited = out if f.exchange == "waited" else ()  # a synchronous call blocks the stream
        states = self.add("lin.states-io", phase, li, io, states, waited)
        if self.moves_noisy():  # the noisy rows through their own all-to-alls
            n_in, n_out = c(("lin-ulysses-noisy", a), lambda: self.linear_ulysses(a, "noisy"))
            states = self.add("lin.a2a-in.noisy", phase, li, n_in, states)
        noisy = self.add("delta-rule.noisy", phase, li, c(("dr-noisy", a, False), lambda: self.delta_rule(
            a, False, "noisy")), states, waited)
        if self.moves_noisy():
            noisy = self.add("lin.a2a-out.noisy", phase, li, n_out, noisy)
        return out + noisy

    def linear_backward(self, li: int, a: AttentionSpec, x: Deps) -> Deps:
        """The backward of `linear_forward`: the noisy blocks' state gradients go home to the
        rows that computed the states before the clean rows' backward can finish."""
        c, ph, f = self.cached, "backward", self.impl.linear_attention
        a2a_in, a2a_out = c(("lin-ulysses", a), lambda: self.linear_ulysses(a))
        io = c(("states-io", a), lambda: self.states_io(a))
        if self.lay.kind not in ("cp", "csbp"):
            if not f.two_passes:
                return self.add("delta-rule-bwd", ph, li, c(("dr", a, True), lambda: self.delta_rule(a, True)), x)
            x = self.add("delta-rule-bwd.noisy", ph, li, c(("dr-noisy", a, True), lambda: self.delta_rule(
                a, True, "noisy")), x)
            x = self.add("lin.states-io-bwd", ph, li, io, x)  # state gradients written and read
            return self.add("delta-rule-bwd.clean", ph, li, c(("dr-clean", a, True), lambda: self.delta_rule(
                a, True, "clean")), x)
        out = self.add("lin.a2a-out-bwd", ph, li, a2a_out, x)
        waited = out if f.exchange == "waited" else ()
        if self.moves_noisy():
            n_in, n_out = c(("lin-ulysses-noisy", a), lambda: self.linear_ulysses(a, "noisy"))
            x = self.add("lin.a2a-out-bwd.noisy", ph, li, n_out, x)
        noisy = self.add("delta-rule-bwd.noisy", ph, li, c(("dr-noisy", a, True), lambda: self.delta_rule(
            a, True, "noisy")), x, waited)
        if self.moves_noisy():
            noisy = self.add("lin.a2a-in-bwd.noisy", ph, li, n_in, noisy)
        noisy = self.add("lin.states-io-bwd", ph, li, io, noisy)
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
