"""Model FLOPs per step as Megatron-LM counts them, and the per-GPU throughput frameworks print.

`model_tflops_per_gpu` is Megatron-LM's `num_floating_point_operations(args, batch_size)` for
the step, divided by the step time and the GPUs: the figure Megatron logs as "throughput per
GPU (TFLOP/s/GPU)". The formula implemented is the standard-transformer branch as Megatron-Bridge
0.3.1 ships it (`megatron/bridge/training/utils/flop_utils.py`, read for this module; the same
code as Megatron-LM's `megatron/training/training.py` of 2025, which it mirrors [inference: the
Megatron-LM file itself was not read]), per sequence of s tokens:

    12 L h^2 s [ (1 + g/n + s / (2h)) q/h            attention: Q, K, V, O projections; QK^T, AV
                 + 3/2 ffn/h                         SwiGLU MLP (MoE: 3/2 (topk x expert + shared))
               ] + 6 s h V_padded                    LM head (forward, dgrad, wgrad)

with L layers, hidden h, n query heads, g K/V heads, q = n x head dim. The 12 = 3 (forward,
dgrad, wgrad) x 2 (two GEMMs of each size) x 2 (FLOPs per multiply-add).

Causal attention: this version counts half the s x s score matrix (its comment: "Only half of the
attention matrix is non-zero and needs to be multiplied with V"): the attention term is
6 s^2 q per layer (forward QK^T and AV are 2 s^2 q each in full, halved, times 3). Earlier
Megatron-LM versions (2021 to 2024, the "APPENDIX: FLOATING-POINT OPERATIONS" of arXiv
2104.04473) counted the full matrix, 12 s^2 q per layer; this module does not.

Not counted (as Megatron): embedding lookup, norms, RoPE, softmax, biases, the router,
activation recompute. V_padded is the vocabulary padded to a multiple of 128 x tp (Megatron's
default `--make-vocab-size-divisible-by 128`).

What csbp feeds it:
- ar: s = L, one sequence per example.
- block-diffusion objectives (bd3lm, fast-dllm-v2, diffusiongemma): s = 2L, the [noisy | clean]
  sequence as the model sees it, counted as Megatron would count a causal 2L sequence (the
  BD3-LM mask's visible pairs are about (2L)^2 / 4, not the causal (2L)^2 / 2 counted here, and
  the LM head over all 2L rows although the loss reads the noisy ones): a figure to compare with
  what Megatron would print for the same network and sequence, not the mask's own FLOPs (those
  are `mfu`'s numerator). Fast-dLLM v2's two rows per example are two sequences; DiffusionGemma's
  expected self-conditioning forward is not counted (Megatron's formula has no forward-only
  pass).
- per layer, with that layer's heads, K/V heads and head dim (the formula's GQA terms, the
  projections read from `ModelSpec.mixer_params` without biases, so gated queries and K = V
  layers count what they multiply); sliding-window layers count the full causal s x s as the
  formula does (it has no window term); linear-attention layers count their projections only
  (the formula has no term for a Gated-DeltaNet core; csbp leaves it out).
- dflash2 drafters: None (a drafter reads the target's features as K/V only; the formula has no
  term for it).
"""

from __future__ import annotations

import math

from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload.workload import Workload

# Megatron-LM's default --make-vocab-size-divisible-by; the padded vocabulary is a multiple of
# this times the tensor-parallel size (calculate_padded_vocab_size)
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
# Megatron's expansion factor: 3 GEMMs per weight (forward, dgrad, wgrad) x 2 FLOPs per multiply-add
GEMM_PASSES = 3


def padded_vocab(vocab: int, tp: int = 1) -> int:
    """Megatron's padded vocabulary: up to a multiple of 128 x tp."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return math.ceil(vocab / multiple) * multiple


def _projection_weights(model: ModelSpec, a: AttentionSpec) -> int:
    """Weights of a layer's mixer projections, biases left out (Megatron counts none)."""
    weights = model.mixer_params(a)
    if model.qkv_bias and a.kind != "linear":
        weights -= a.n_heads * a.head_dim * (2 if a.gated_q else 1) + a.kv_width * a.kv_tensors
    return weights


def layer_flops(model: ModelSpec, a: AttentionSpec, seq: int) -> float:
    """One layer over one sequence of `seq` tokens, forward + backward, Megatron's count."""
    projections = 2 * GEMM_PASSES * seq * _projection_weights(model, a)
    # QK^T and AV, 2 s^2 q FLOPs each over the whole matrix, half of it counted (causal)
    attention = 0.0 if a.kind == "linear" else GEMM_PASSES * 2 * (2 * seq * seq * a.n_heads * a.head_dim) / 2
    h = model.hidden
    if model.moe:
        ffn = model.moe.top_k * model.moe.expert_ffn + model.moe.dense_ffn
    else:
        ffn = model.ffn
    mlp = 2 * GEMM_PASSES * seq * 3 * h * ffn  # SwiGLU: gate, up, down
    return projections + attention + mlp


def flops_per_sequence(model: ModelSpec, seq: int, tp: int = 1) -> float:
    """Megatron's `num_floating_point_operations` for one sequence of `seq` tokens."""
    layers = sum(count * layer_flops(model, a, seq) for a, count in model.attention_kinds().items())
    logits = 2 * GEMM_PASSES * seq * model.hidden * padded_vocab(model.vocab, tp)
    return layers + logits


def sequences_as_seen(workload: Workload, model: ModelSpec) -> tuple[int, int] | None:
    """(tokens per sequence, sequences per example) as the model sees them, or None where the
    formula has no meaning (a drafter)."""
    if workload.objective == "ar":
        return workload.seq_len, 1
    if workload.objective == "dflash2":
        return None
    from csbp.simulator.workload.objectives import objective_shape

    return 2 * workload.seq_len, objective_shape(workload, model).rows_per_example


def model_flops_per_step(model: ModelSpec, workload: Workload, plan: Plan) -> float | None:
    """Megatron's model FLOPs of one step: every sequence of every example of the step."""
    seen = sequences_as_seen(workload, model)
    if seen is None:
        return None
    seq, rows = seen
    sequences = workload.micro_batch * plan.sequences * rows
    return sequences * flops_per_sequence(model, seq, plan.tp)


def per_gpu(model: ModelSpec, workload: Workload, plan: Plan, gpus: int, step_s: float | None,
            tokens_per_s: float | None) -> tuple[float | None, float | None]:
    """(tokens/s per GPU, model TFLOP/s per GPU); None where the step has no tokens/s (it does
    not fit) or the formula no meaning. tokens/s per GPU is `tokens_per_s` (context tokens) over
    every GPU of the job: TorchTitan's figure for a dp x cp job (a replica's tokens before CP
    sharding over step x cp, frameworks.md A3)."""
    if not tokens_per_s or not step_s or gpus < 1:
        return None, None
    flops = model_flops_per_step(model, workload, plan)
    tflops = flops / step_s / gpus / 1e12 if flops is not None else None
    return tokens_per_s / gpus, tflops
