"""Per training objective, what one step executes: the seam between an objective and the step graph.

The layout machinery knows one mask (BD3-LM over [noisy x_t ; clean x_0]); each objective says
how the reference implementation runs its step on it (implementation.md section 4, "Objectives
as executed"). Every such fact is a field of `ObjectiveShape`, with its source, so the step graph
reads data instead of testing objective names:
- bd3lm: one forward+backward over the 2L sequence, loss on the noisy tokens (a chunked fused
  linear cross-entropy: logits and their gradients in one chunked pass, never all logits at once).
- fast-dllm-v2: the two complementary masked views are two rows of the batch, each a packed
  [noisy | clean] 2L sequence, in one forward/backward: every GEMM, attention call and collective
  carries both rows (twice BD3-LM's work in calls of twice the size, one latency per collective).
- diffusiongemma: one tied transformer runs three role passes per example: a causal clean encoder
  with gradients and an autoregressive loss, a gradient-free self-conditioning decoder (its logits
  feed a soft embedding) that runs when any example of the EP group draws it, and the trained
  decoder over the noisy canvas; frozen router.
- dflash2: a drafter conditioned on the frozen target's features, read from storage inside the
  step: the clean stream holds target features that only become K/V (no queries, no MLP), draft
  blocks start at sampled anchors, the loss runs over vocabulary blocks with the frozen LM head's
  logits recomputed in backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

# Bytes per element of the target features stored for a drafter: bf16, as the target computes
# them. implementation.md section 4 ("if stored in bf16 -- an assumption") [U].
STORED_FEATURE_BYTES = 2


@dataclass(frozen=True)
class ObjectiveShape:
    name: str
    # sequential forward+backward passes over the batch per step; every objective of
    # implementation.md section 4 runs one (Fast-dLLM v2's two views are rows, not passes)
    passes: int
    # batch rows per example, each a [noisy | clean] 2L sequence of the layout, run in the same
    # forward/backward (implementation.md section 4, Fast-dLLM v2: "two rows of the batch ... in
    # one forward/backward"): GEMMs, attention and collectives carry all rows in one call, and
    # their activations are alive together (memory reads this)
    rows_per_example: int
    # expected gradient-free decoder forwards over the canvas (noisy) tokens per step: the
    # self-conditioning pass (implementation.md section 4, DiffusionGemma (2)), 1 - (1 - p)^e
    # when its draw is synchronised by a MAX over a group of e examples
    canvas_passes: float
    # the axis whose examples' draws are MAX-synchronised (DiffusionGemma: "ep"), or None
    canvas_sync_axis: str | None
    # the canvas pass's logits feed a soft embedding (probabilities x the embedding matrix,
    # computed in vocabulary chunks; implementation.md section 4, DiffusionGemma (2))
    soft_embedding: bool
    # an autoregressive loss on the clean stream too (LM head + cross-entropy over the clean
    # tokens, forward and backward; implementation.md section 4, DiffusionGemma (1), weight 1.0)
    clean_loss: bool
    frozen_router: bool  # MoE router gets no weight gradient (implementation.md 4: "Routers frozen")
    frozen_embeddings: bool  # embedding and LM head belong to a frozen target: no grads, no state
    context_as_kv: bool  # clean positions are target features: K/V projections only (section 4, DFlash2)
    vocab_block: int | None  # loss over the vocabulary in blocks of this size (None: token chunks)
    # the LM head's logits are recomputed in backward (DFlash2: "logits are recomputed in
    # backward, in vocabulary blocks"), so its backward repeats the forward GEMM
    head_recompute: bool
    # target hidden vectors per context token read from storage inside the measured step
    # (DFlash2: "read from disk every step (5 x target hidden wide per context token)"), and
    # the bytes of one element (bf16 assumed [U]); 0 = nothing read
    stored_features: int
    stored_feature_bytes: int
    notes: tuple[str, ...]

    def stored_bytes_per_token(self, model: ModelSpec) -> int:
        """Bytes of target features one context token reads from storage (0: none)."""
        return self.stored_features * model.hidden * self.stored_feature_bytes


_BASE = dict(passes=1, rows_per_example=1, canvas_passes=0.0, canvas_sync_axis=None,
             soft_embedding=False, clean_loss=False, frozen_router=False, frozen_embeddings=False,
             context_as_kv=False, vocab_block=None, head_recompute=False, stored_features=0,
             stored_feature_bytes=STORED_FEATURE_BYTES, notes=())


def self_conditioning_probability(p: float, examples: int) -> float:
    """Probability that a pass drawn with probability p per example runs, when its draw is
    MAX-synchronised over `examples` examples: it runs unless every one of them skips it.
    An inference from the reference code (implementation.md section 4) [U]."""
    return 1.0 - (1.0 - p) ** examples


def objective_shape(workload: Workload, model: ModelSpec, plan: Plan | None = None) -> ObjectiveShape:
    """What `workload.objective` makes one step of `model` do (under `plan`: the EP group's
    MAX-synchronised self-conditioning; without one, a single example)."""
    obj = workload.objective
    if obj == "fast-dllm-v2":
        return ObjectiveShape(**{**_BASE, "name": obj, "rows_per_example": 2, "notes": (
            "fast-dllm-v2: the two complementary masked views are two rows of the batch, each a "
            "packed [noisy | clean] 2L sequence, in one forward/backward (implementation.md 4): "
            "every GEMM, attention call and K/V collective carries both rows, gradients reduced "
            "once; throughput counts L context tokens per example",)})
    if obj == "diffusiongemma":
        p = workload.self_conditioning
        ep = plan.ep if plan is not None else 1
        run = self_conditioning_probability(p, ep)
        return ObjectiveShape(**{**_BASE, "name": obj, "canvas_passes": run, "canvas_sync_axis": "ep",
                                 "soft_embedding": True, "clean_loss": True,
                                 "frozen_router": model.is_moe, "notes": (
            "diffusiongemma: three role passes of one tied transformer (implementation.md 4): (1) "
            "causal clean encoder with gradients, (3) bidirectional decoder over the noisy canvas "
            f"(block = canvas = {workload.block_size}) reading the clean prefix: BD3-LM's 2L pairs, "
            "run here as one 2L pass (same FLOPs and K/V; separate encoder and decoder calls are "
            "not modelled) [U]; loss on every canvas token (uniform corruption)",
            "diffusiongemma (1): autoregressive loss (weight 1.0) on the clean stream: LM head and "
            "cross-entropy over every clean row a rank computes, forward and backward",
            f"diffusiongemma (2): self-conditioning p={p:g} per example, its draw MAX-synchronised "
            f"over the EP group of {ep}: runs with probability 1-(1-p)^{ep} = {run:.3g} (an "
            "inference [U]), as its expectation: a gradient-free canvas forward (canvas queries, "
            "clean K/V fetched again), its LM head, softmax and soft embedding (probabilities x "
            "embedding, priced as one GEMM call; the vocabulary chunk size is not known [U]) "
            "before the main pass; its transient memory is not counted",
            "frozen router: no router weight gradient; examples per step = DP x EP")})
    if obj == "dflash2":
        blk = workload.vocab_block
        shape = ObjectiveShape(**{**_BASE, "name": obj, "frozen_embeddings": True, "context_as_kv": True,
                                  "vocab_block": blk, "head_recompute": True,
                                  "stored_features": model.conditioning_layers})
        per_token = shape.stored_bytes_per_token(model)
        return replace(shape, notes=(
            f"dflash2: target features of {model.conditioning_layers} layers read from storage "
            f"inside the step ({model.conditioning_layers} x {model.hidden} x "
            f"{STORED_FEATURE_BYTES} B = {per_token / 1e3:.0f} KB per context token, bf16 assumed "
            "[U]; each rank reads the context it holds [U]) at the node's storage bandwidth shared "
            "by its GPUs, exposed at the step's start; then projected (fc) and injected as K/V "
            "into every draft layer; only draft blocks are queries",
            f"anchors: {workload.max_anchors} draft blocks of {workload.block_size} at evenly spaced "
            "positions (the expectation of uniform sampling); a block sees the context before its "
            "anchor and itself",
            "conventional CP: every context rank keeps all anchors and recomputes the draft layers "
            "and the loss (replication cp/bp); only the context K/V and context attention are "
            "sharded; BP/CSBP deal the anchors' blocks (dual-end over anchor order)",
            (f"loss over vocabulary blocks of {blk}" if blk else "loss over the whole vocabulary")
            + "; the frozen LM head's logits are recomputed in backward (its backward: the "
            "recomputed logits and the input gradient)",
            "embedding and LM head shared with the frozen target (assumed, as in DFlash): no "
            "gradients or optimizer state"))
    return ObjectiveShape(**{**_BASE, "name": "bd3lm"})


def batch_rows(workload: Workload, model: ModelSpec) -> Workload:
    """The workload as the GPU executes it: `rows_per_example` rows per example in the batch.

    Step-time and memory formulas scale with the rows of the batch; throughput keeps counting
    examples (L context tokens each), so callers that count tokens read the original workload.
    """
    rows = objective_shape(workload, model).rows_per_example
    if rows == 1:
        return workload
    return workload.model_copy(update={"micro_batch": workload.micro_batch * rows})


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
