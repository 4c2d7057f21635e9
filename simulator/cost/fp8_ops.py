"""What a framework adds around FP8 linears: the casts around the transformer blocks' linear
GEMMs (amax reduction, scale-and-cast, transposed copies) and the amax all-reduce after the
optimizer step, as `implementation.fp8` says (frameworks.md A2, B3). Which GEMMs run
FP8 and at what rate is `linear_ops.LinearGemmOps`' (the linear dtype, `linear_dtype()`) and
the hardware profile's. A mixin of the builder.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from csbp.simulator.cost.step_ops import LOSS_BYTES, Comm, Compute, Deps, Phase
from csbp.simulator.workload.spec import AttentionSpec
from csbp.simulator.cost.linear_ops import resolve_linear_dtype

# Weight tensors per layer whose amax one all-reduce carries (Llama's wq, wk, wv, wo, w1, w2, w3);
# the all-reduce is a few KB, its latency is what costs [U].
LINEARS_PER_LAYER = 7


class FP8Ops:
    """FP8 linears' casts and amax (mixed into the builder)."""

    def linear_dtype(self) -> str:
        """The blocks' linear dtype: the workload's, else the implementation profile's."""
        return self.cached(("linear-dtype",), lambda: resolve_linear_dtype(self.w, self.impl))

    def fp8_gemm(self, which: str) -> bool:
        """Whether one GEMM (forward, dgrad, wgrad) of the block linears runs FP8: the linear
        dtype is fp8 and the implementation runs that GEMM in it (`implementation.fp8.gemms`);
        read by `linear_ops.LinearGemmOps` for the GEMM's rate."""
        return self.linear_dtype() == "fp8" and which in self.impl.fp8.gemms

    def linear_elements(self, a: AttentionSpec) -> tuple[np.ndarray, np.ndarray, float]:
        """Elements per rank of a layer's linears: (inputs, output gradients, weights). Inputs:
        the normed hidden state into the input projections and into gate/up (gathered over TP:
        every token), the attention output into the output projection and the SwiGLU product
        into down (TP-sharded widths); output gradients the same with the outputs' widths.
        A MoE layer's experts are left out (their FP8 path is not modelled [U])."""
        m, h, tp = self.m, self.m.hidden, self.tp
        q = a.n_heads * a.head_dim
        in_width = (m.mixer_params(a) - q * h) / h  # q, k, v (and gates) projections' outputs
        ffn = m.moe.dense_ffn if m.moe else m.ffn
        inputs = self.tokens * (h + q / tp + (h + ffn / tp if ffn else 0))
        outputs = self.tokens * (in_width / tp + h + (2 * ffn / tp + h if ffn else 0))
        weights = (m.mixer_params(a) + 3 * h * ffn) / tp
        return inputs, outputs, weights

    def fp8_casts(self, a: AttentionSpec, phase: Phase) -> Compute | None:
        """One layer's cast traffic in `phase` (memory-bound, HBM bytes from the profile's bytes
        per element): inputs (and weights unless cached once per step) in forward; the weights
        again in recompute unless cached; output gradients, recast inputs and transposed weights
        (unless cached) in backward. None with bf16 linears."""
        if self.linear_dtype() != "fp8":
            return None
        f = self.impl.fp8
        inputs, outputs, weights = self.linear_elements(a)
        cached = f.weight_cache_bytes > 0
        if phase == "backward":
            nbytes = (outputs * f.gradient_cast_bytes + inputs * f.backward_input_cast_bytes
                      + (0.0 if cached else weights * f.backward_weight_cast_bytes))
        else:  # a cache is filled once, in the step's first forward
            nbytes = inputs * f.activation_cast_bytes + (
                0.0 if cached and phase == "recompute" else weights * f.weight_cast_bytes)
        return self.memory_bound(nbytes) if np.any(nbytes) else None

    def norm_gather(self, mlp: bool = False) -> Comm | None:
        """The forward's sequence-parallel all-gather of a norm output into the linears (attention
        or, `mlp`, the MLP's): in the implementation's FP8 element when the linears run FP8 and it
        gathers the cast copy (Transformer Engine, frameworks.md B2), else the step dtype's."""
        base = self.mlp_collective("all-gather") if mlp else self.tp_collective("all-gather")
        nbytes = self.impl.fp8.tp_gather_bytes
        if base is None or not nbytes or self.linear_dtype() != "fp8":
            return base
        return self.cached(("tp-fp8-gather", mlp), lambda: replace(
            base, bytes=tuple(b * nbytes / self.dt for b in base.bytes)))

    def fp8_amax(self, x: Deps) -> Deps:
        """The weights' amax all-reduced over the shard group once the optimizer has stepped
        (torchao's precompute_float8_dynamic_scale_for_fsdp), one fp32 per weight tensor."""
        if self.linear_dtype() != "fp8" or not self.impl.fp8.amax_all_reduce:
            return x
        group = self.grad_groups()[0]
        n = LINEARS_PER_LAYER * self.m.n_layers * LOSS_BYTES
        return self.add("fp8.amax.all-reduce", "param-sync", None, self.comm(
            "all-reduce", n * 2 * self.ring_share(group), group, "other"), x)
