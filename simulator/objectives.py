"""Per training objective, what one step runs: the seam between an objective and the step graph.

The layout machinery knows one mask (BD3-LM over [noisy x_t ; clean x_0]); each objective says
how it uses it (workloads.md, "Objectives"):
- bd3lm: one forward+backward over the 2L sequence, loss on the noisy tokens.
- fast-dllm-v2: two complementary masked views per example, each a full 2L forward+backward
  (each supervised token is masked in exactly one view; the clean pass is not shared).
- diffusiongemma: a causal pass over the clean sequence builds K/V that a bidirectional decoder
  reads while denoising 256-token canvases; the pair structure is BD3-LM's with block = canvas,
  so the main pass is the 2L graph. Self-conditioning adds, with probability p, a gradient-free
  canvas pass before it (modelled as its expectation: p x the canvas forward). Frozen router.
- dflash2: a drafter conditioned on the frozen target's features: the clean stream holds target
  features that only become K/V (no queries, no MLP), draft blocks start at sampled anchors, the
  loss runs over vocabulary blocks, and the embedding and LM head are the target's, frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

from csbp.simulator.spec import ModelSpec
from csbp.simulator.workload import Workload


@dataclass(frozen=True)
class ObjectiveShape:
    name: str
    views: int  # forward+backward passes over the layout's positions per step
    canvas_passes: float  # expected gradient-free forward passes over the noisy (canvas) tokens
    frozen_router: bool  # MoE router gets no weight gradient
    frozen_embeddings: bool  # embedding and LM head belong to a frozen target: no grads, no state
    context_as_kv: bool  # clean positions are target features: K/V projections only
    vocab_block: int | None  # loss over the vocabulary in blocks of this size (None: token chunks)
    notes: tuple[str, ...]


def objective_shape(workload: Workload, model: ModelSpec) -> ObjectiveShape:
    """What `workload.objective` makes one step of `model` do."""
    obj = workload.objective
    if obj == "fast-dllm-v2":
        return ObjectiveShape(obj, 2, 0.0, False, False, False, None, (
            "fast-dllm-v2: two complementary masked views per example, each a full 2L "
            "forward+backward (the clean pass is not shared between views); gradients reduced "
            "once, during the second view's backward",))
    if obj == "diffusiongemma":
        p = workload.self_conditioning
        return ObjectiveShape(obj, 1, p, model.is_moe, False, False, None, (
            "diffusiongemma: clean causal pass + bidirectional canvas decoder = BD3-LM pairs with "
            f"block = canvas = {workload.block_size}; loss on every canvas token (uniform corruption)",
            f"self-conditioning p={p:g} as its expectation: {p:g} x a gradient-free canvas forward "
            "(canvas queries only, clean K/V fetched again as in the main forward) before the main "
            "pass; its transient memory is not counted",
            "frozen router: no router weight gradient"))
    if obj == "dflash2":
        blk = workload.vocab_block
        return ObjectiveShape(obj, 1, 0.0, False, True, True, blk, (
            f"dflash2: target features of {model.conditioning_layers} layers projected (fc) and "
            "injected as K/V into every draft layer; only draft blocks are queries",
            f"anchors: {workload.max_anchors} draft blocks of {workload.block_size} at evenly spaced "
            "positions (the expectation of uniform sampling); a block sees the context before its "
            "anchor and itself",
            "conventional CP replicates the draft decoder and the loss on every context rank; "
            "BP/CSBP deal the anchors' blocks (dual-end over anchor order)",
            f"loss over vocabulary blocks of {blk}" if blk else "loss over the whole vocabulary",
            "embedding and LM head shared with the frozen target (assumed, as in DFlash): no "
            "gradients or optimizer state; the LM head backward is its input gradient only"))
    return ObjectiveShape("bd3lm", 1, 0.0, False, False, False, None, ())


def default_objective(model: ModelSpec) -> str:
    """Each preset trains with the objective of its study (workloads.md)."""
    name = model.name
    if name.startswith(("qwen3.5", "qwen3.8")):
        return "fast-dllm-v2"
    if name.startswith("diffusiongemma"):
        return "diffusiongemma"
    if name.startswith("dflash"):
        return "dflash2"
    return "bd3lm"
