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
- ar: plain autoregressive training (TorchTitan, Megatron-Core; shared/reference/frameworks.md):
  one causal L-token sequence, next-token loss on every token, no noisy stream and no 2L. Its
  mask is BD3-LM's clean-to-clean mask at block 1, so the layout holds it in the clean stream's
  coordinates (`layout.objective_layout.CausalLayout`) and every count of the mask applies.
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
    # trained streams in program order (implementation.md section 12: DiffusionGemma's causal clean
    # encoder, then the decoder over the noisy canvas; "main": one pass over the 2L sequence)
    streams: tuple[str, ...] = ("main",)
    # every layer's encoder K/V stay alive until the decoder's backward (inputs of the decoder's
    # checkpoints), their gradients accumulating over all layers first (section 12)
    retain_encoder_kv: bool = False
    # pure BP runs the whole clean stream on every BP rank (section 12: clean_positions =
    # arange(seq_len)), not only the prefix its blocks read
    bp_whole_clean: bool = False
    # Fast-dLLM v2's clean stream runs in both rows (section 13): counted once as useful FLOPs
    clean_stream_counted_once: bool = False
    # share of the loss rows (noisy, or every row with clean_loss) the LM head and loss run on:
    # Fast-dLLM v2 gathers the L - 1 valid rows of an example out of its two rows' noisy halves
    # (implementation.md 13), so (L - 1) / (2L); 1 elsewhere
    loss_row_share: float = 1.0
    # what the objective's users count per example (section 15): context tokens L, valid tokens
    # L - 1 (Fast-dLLM v2), or supervised draft tokens anchors x (block - 1) (DFlash2)
    counted_tokens: str = "context"
    # dflash2: features mode of the workload ("offline" | "synthetic"; section 14), else None
    features: str | None = None
    # ar: one causal stream of L tokens (the layout's clean coordinates at block 1), no noisy
    # stream: every token is a query, a K/V row and a loss row; no block parallelism (nothing to
    # deal out: bp/csbp are refused, plan/rules.py)
    causal: bool = False

    def stored_bytes_per_token(self, model: ModelSpec) -> int:
        """Bytes of target features one context token reads from storage (0: none)."""
        return self.stored_features * model.hidden * self.stored_feature_bytes


def counted_tokens_per_example(workload: Workload) -> tuple[str, float] | None:
    """(name, tokens per example) as the objective's users count them (implementation.md section
    15) where that differs from the L context tokens `tokens_per_s` counts; None for BD3-LM and
    DiffusionGemma (L per example)."""
    if workload.objective == "dflash2":
        return "supervised", float(anchor_count(workload) * (workload.block_size - 1))
    if workload.objective == "fast-dllm-v2":
        return "valid", float(workload.seq_len - 1)
    return None


def anchor_count(workload: Workload) -> int:
    """Draft blocks per example: max_anchors, at most one per block of the context."""
    return min(workload.max_anchors, workload.n_blocks)


def as_executed(workload: Workload, model: ModelSpec) -> Workload:
    """The workload with what the model decides about its execution: a DFlash2 drafter whose
    every layer is windowed trims its context to the anchors' windows (implementation.md section
    14, `compact_dflash_target_context`), so its layout needs the window."""
    if workload.objective != "dflash2" or not model.layers:
        return workload
    windows = {a.window if a.kind == "sliding" else None for a in model.layers}
    window = windows.pop() if len(windows) == 1 else None
    if window == workload.drafter_window:
        return workload
    return workload.model_copy(update={"drafter_window": window})


# Objectives whose pure-BP ranks run the whole clean stream (implementation.md section 12,
# DiffusionGemma's `kv_backend: replicated`: clean_positions = arange(seq_len)). A model-free fact:
# the layout needs it before a model is known (`Layout.build`), the shape carries it as
# `bp_whole_clean`.
_WHOLE_CLEAN_UNDER_BP = frozenset({"diffusiongemma"})


def replicates_clean_under_bp(objective: str) -> bool:
    """Whether a pure-BP rank of `objective` runs every clean row, not only its blocks' prefix."""
    return objective in _WHOLE_CLEAN_UNDER_BP


_BASE = dict(passes=1, rows_per_example=1, canvas_passes=0.0, canvas_sync_axis=None,
             soft_embedding=False, clean_loss=False, frozen_router=False, frozen_embeddings=False,
             context_as_kv=False, vocab_block=None, head_recompute=False, stored_features=0,
             stored_feature_bytes=STORED_FEATURE_BYTES, notes=())


def self_conditioning_probability(p: float, examples: int) -> float:
    """Probability that a pass drawn with probability p per example runs, when its draw is
    MAX-synchronised over `examples` examples: it runs unless every one of them skips it.
    An inference from the reference code (implementation.md section 4) [U]."""
    return 1.0 - (1.0 - p) ** examples


_SHAPES: dict[tuple, tuple[ModelSpec, ObjectiveShape]] = {}


def objective_shape(workload: Workload, model: ModelSpec, plan: Plan | None = None) -> ObjectiveShape:
    """What `workload.objective` makes one step of `model` do (under `plan`: the EP group's
    MAX-synchronised self-conditioning; without one, a single example). Kept per (workload,
    model, EP degree), the only part of the plan it reads: a search asks for every candidate's
    memory, floor and graph (9,000 times at 1,024 GPUs), and each answer builds its notes."""
    key = (id(model), workload, plan.ep if plan is not None else None)
    hit = _SHAPES.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    if len(_SHAPES) > 1024:
        _SHAPES.clear()
    shape = _objective_shape(workload, model, plan)
    _SHAPES[key] = (model, shape)
    return shape


def _objective_shape(workload: Workload, model: ModelSpec, plan: Plan | None) -> ObjectiveShape:
    obj = workload.objective
    if obj == "ar":
        return ObjectiveShape(**{**_BASE, "name": obj, "causal": True, "notes": (
            f"ar: one causal sequence of {workload.seq_len} tokens (no noisy copy, no 2L), next-token "
            "cross-entropy on every token (frameworks.md A3, B1); the causal mask is BD3-LM's "
            "clean-to-clean mask at block 1, L(L+1)/2 pairs; CP shards it head-tail (2 cp chunks, "
            "rank r holds chunks r and 2cp-1-r) as TorchTitan and Megatron-Core do",)})
    if obj == "fast-dllm-v2":
        share = (workload.seq_len - 1) / (2 * workload.seq_len)
        return ObjectiveShape(**{**_BASE, "name": obj, "rows_per_example": 2,
                                 "clean_stream_counted_once": True, "counted_tokens": "valid",
                                 "loss_row_share": share, "notes": (
            "fast-dllm-v2: the two complementary masked views are two rows of the batch, each a "
            "packed [noisy | clean] 2L sequence, in one forward/backward (implementation.md 4): "
            "every GEMM, attention call and K/V collective carries both rows, gradients reduced "
            "once; tokens_per_s counts L context tokens per example, valid_tokens_per_s the L - 1 "
            "valid tokens the reference counts (implementation.md 15); the clean stream runs in "
            "both rows (section 13) and counts once in the useful FLOPs (MFU); the LM head and loss "
            "run on the L - 1 valid rows of an example, half of the two rows' noisy rows "
            "(section 13), spread evenly over the ranks' noisy rows [U]",)})
    if obj == "diffusiongemma":
        p = workload.self_conditioning
        ep = plan.ep if plan is not None else 1
        run = self_conditioning_probability(p, ep)
        return ObjectiveShape(**{**_BASE, "name": obj, "canvas_passes": run, "canvas_sync_axis": "ep",
                                 "soft_embedding": True, "clean_loss": True,
                                 "frozen_router": model.is_moe, "streams": ("encoder", "decoder"),
                                 "retain_encoder_kv": True, "bp_whole_clean": replicates_clean_under_bp(obj), "notes": (
            "diffusiongemma: three role passes of one tied transformer (implementation.md 4): (1) "
            "causal clean encoder with gradients, (3) bidirectional decoder over the noisy canvas "
            f"(block = canvas = {workload.block_size}) reading the clean prefix: BD3-LM's 2L pairs, "
            "run as two streams in sequence (implementation.md 12): the encoder over the rank's "
            "clean rows (every layer, then its AR loss), then the decoder over its canvas rows "
            "reading each layer's encoder K/V; backward: every decoder layer (recomputed), its "
            "encoder K/V gradients accumulating, then every encoder layer; the weights' gradients "
            "are reduced as the encoder's backward completes them (tied weights, [U]); under "
            "CP/CSBP the decoder gathers the encoder's remote clean K/V again in its own layers "
            "(forward, recompute; dK/dV sent home in its backward) as the implementation profile "
            "says (`encoder_kv`); same FLOPs as one 2L pass; loss on every canvas token (uniform "
            "corruption)",
            "diffusiongemma (1): autoregressive loss (weight 1.0) on the clean stream: LM head and "
            "cross-entropy over every clean row a rank computes, forward and backward",
            f"diffusiongemma (2): self-conditioning p={p:g} per example, its draw MAX-synchronised "
            f"over the EP group of {ep}: runs with probability 1-(1-p)^{ep} = {run:.3g} (an "
            "inference [U]), as its expectation: a gradient-free canvas forward (canvas queries, "
            "clean K/V fetched again), its LM head, softmax and soft embedding (probabilities x "
            "embedding, priced as one GEMM call; the vocabulary chunk size is not known [U]) "
            "before the main pass; its transient memory is not counted",
            "frozen router: no router weight gradient; examples per step = DP x EP",
            "diffusiongemma memory (implementation.md 12): every layer's encoder K/V stay alive "
            "until the decoder's backward and their gradients accumulate over all layers before "
            "the encoder's backward; both streams' checkpoints are alive through the decoder's "
            "backward; a recomputed layer holds its own stream's rows (the decoder's canvas rows, "
            "then the encoder's clean rows); pure BP runs the whole clean stream on every rank "
            "(clean compute, K/V and their gradients not divided by BP)")})
    if obj == "dflash2":
        blk = workload.vocab_block
        shape = ObjectiveShape(**{**_BASE, "name": obj, "frozen_embeddings": True, "context_as_kv": True,
                                  "vocab_block": blk, "head_recompute": True,
                                  "stored_features": model.conditioning_layers,
                                  "counted_tokens": "supervised", "features": workload.features})
        window = as_executed(workload, model).drafter_window
        per_token = shape.stored_bytes_per_token(model)
        features = (
            f"dflash2 features: synthetic (the published benchmark runs, implementation.md 14): "
            f"{model.conditioning_layers} x {model.hidden} x {STORED_FEATURE_BYTES} B = "
            f"{per_token / 1e3:.0f} KB per context token of the rank's shard resident on the GPU "
            "once, no I/O in the step" if workload.features == "synthetic" else
            f"dflash2 features: offline (the default for planning a real job; the published "
            f"benchmark runs use --features synthetic): {model.conditioning_layers} x "
            f"{model.hidden} x {STORED_FEATURE_BYTES} B = {per_token / 1e3:.0f} KB per context "
            "token (bf16 assumed [U]) of the rank's shard read from storage (the node's bandwidth "
            "shared by its GPUs) and copied host-to-device by a background reader one batch ahead "
            "(implementation.md 14): on their own stream beside the step, never waited on unless "
            "slower than it [inference]; two GPU copies of the shard (this batch's and the next)")
        trim = (f"every layer windowed ({window}): the context is trimmed on the GPU to the union "
                "of the anchors' windows (implementation.md 14): fc, context K/V and their "
                "exchange run on those rows only, whatever the context length; the features "
                "buffer holds the untrimmed shard" if window else
                "not every layer windowed: the whole context is kept")
        return replace(shape, notes=(
            features,
            "then projected (fc) and injected as K/V into every draft layer; only draft blocks "
            "are queries",
            f"anchors: {anchor_count(workload)} draft blocks of {workload.block_size} sampled with "
            "locality (adjacent anchors one block apart, implementation.md 14) as one run centred "
            "in the context [U: run position]; a block sees the context before its anchor and "
            "itself; " + trim,
            f"throughput: tokens_per_s counts context tokens (ranking); supervised_tokens_per_s "
            f"counts anchors x (block - 1) = {anchor_count(workload) * (workload.block_size - 1)} "
            "per example, as the reference does (implementation.md 15)",
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
    workload = as_executed(workload, model)
    rows = objective_shape(workload, model).rows_per_example
    if rows == 1:
        return workload
    return workload.model_copy(update={"micro_batch": workload.micro_batch * rows})


def recipe_checkpointing(objective: str) -> str | None:
    """Activation checkpointing an objective's recipe fixes: DFlash2 drafters run without it
    (implementation.md section 14, "No activation checkpointing in the recipes"); None: free."""
    return "none" if objective == "dflash2" else None


# What a preset's recipe fixes beyond the model (implementation.md 14, the DFlash2 recipes): the
# draft block, the anchors per example and the frozen head's vocabulary block. A drafter planned at
# the command's generic block of 256 would draft 2048 x 256 rows, more than its context.
PRESET_RECIPES: dict[str, dict[str, int]] = {
    "dflash2-qwen3.8-27b": {"block_size": 8, "max_anchors": 2048, "vocab_block": 32768},
    "dflash2-muse-glimmer-30b": {"block_size": 16, "max_anchors": 512, "vocab_block": 16384},
}


def preset_recipe(model: ModelSpec) -> dict[str, int]:
    """The workload fields a preset's recipe fixes; flags the user passes override them."""
    return dict(PRESET_RECIPES.get(model.name, {}))


# the presets of plain AR jobs; a user's own Hugging Face config (model_type "llama", "qwen2", ...)
# is a model to train with block diffusion unless --objective says otherwise, as csbp's users convert them
AR_PRESETS = ("llama3.1-8b", "llama2-7b")


def default_objective(model: ModelSpec) -> str:
    """Each preset trains with the objective of its study (workloads.md)."""
    name = model.name
    if name.startswith(("qwen3.5", "qwen3.8")):
        return "fast-dllm-v2"
    if name.startswith("diffusiongemma"):
        return "diffusiongemma"
    if name.startswith("dflash"):
        return "dflash2"
    if name in AR_PRESETS:  # plain AR models as TorchTitan / Megatron-Core train them (issue 24)
        return "ar"
    return "bd3lm"
