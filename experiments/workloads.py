"""The study's workloads as the recipes give them (workloads.md, "Recipes"), in one place."""

from __future__ import annotations

from csbp.simulator.workload.objectives import default_objective
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload, parse_tokens

FULL_MODELS_256K = ("nemotron-diffusion-3b", "nemotron-diffusion-8b", "nemotron-diffusion-14b",
                    "diffusiongemma-26b-a4b", "qwen3.5-27b", "qwen3.8-27b")


def full_model(model: ModelSpec, context: str) -> Workload:
    """Block 256, batch 1 per replica, ZeRO-2, bf16, the preset's objective (Fast-dLLM v2 for the
    Qwen conversions, DiffusionGemma's native SFT with self-conditioning 0.5)."""
    return Workload(seq_len=parse_tokens(context), block_size=256, objective=default_objective(model),
                    micro_batch=1, zero_stage=2, self_conditioning=0.5)
