"""The validation suite: the model, the plans and the context lengths `csbp validate` runs.

Its own module because three parts time the same model: the suite itself, the calibration's
microbenchmarks (measured at the shapes the suite's ranks make) and the reference probe that
both record. None of them may need the others to know what the model is.
"""

from __future__ import annotations

from dataclasses import dataclass

from csbp.simulator.plan.plan import Plan, parse_plan
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload.workload import Workload

VALIDATION_MODEL = ModelSpec(
    name="validate-small", hidden=256, ffn=768, vocab=512,
    layers=(AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=64),) * 2,
    source="csbp validate: a small dense GQA model whose CPU step (0.2-4 s at L = 512-1024) is "
           "dominated by arithmetic and collectives, not by per-op overhead or timer noise, yet "
           "the whole suite runs in minutes on 2 cores")
PLANS = {2: ("dp=2", "cp=2", "bp=2", "cp=2,bp=2"), 4: ("dp=4", "cp=4", "bp=4", "cp=4,bp=4")}
QUICK_PLANS = {2: ("cp=2", "cp=2,bp=2"), 4: ("cp=4", "cp=4,bp=4")}
SEQ_LENS, QUICK_SEQ_LENS = (512, 1024), (128,)
# both activation-checkpointing settings: the memory model's two regimes (every layer's input
# kept and one layer recomputed, or every layer's activations kept) and two step graphs
CHECKPOINTING, QUICK_CHECKPOINTING = ("full", "none"), ("full",)
BLOCK = 32


@dataclass(frozen=True)
class Case:
    """One plan at one context length: what is run and what is predicted."""

    plan: Plan
    workload: Workload

    @property
    def label(self) -> str:
        return f"{self.plan.label()} L={self.workload.seq_len} ckpt={self.workload.checkpointing}"


def suite(quick: bool) -> list[Case]:
    plans, lengths, ckpts = ((QUICK_PLANS, QUICK_SEQ_LENS, QUICK_CHECKPOINTING) if quick
                             else (PLANS, SEQ_LENS, CHECKPOINTING))
    # fp32 is the CPU runtime's reference; zero_stage 0: the runtime replicates AdamW
    return [Case(parse_plan(p), Workload(seq_len=L, block_size=BLOCK, dtype="fp32", zero_stage=0,
                                         checkpointing=c))
            for world in sorted(plans) for c in ckpts for L in lengths for p in plans[world]]
