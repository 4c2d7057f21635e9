"""Study a: every full model at 256K on 2 x 8 H200, best baseline (no BP) vs best plan overall."""

from __future__ import annotations

from pathlib import Path

from csbp.experiments import StudyOutput
from csbp.experiments.plots import bars
from csbp.experiments.runner import H200_2x8, Runner
from csbp.experiments.workloads import FULL_MODELS_256K, full_model
from csbp.simulator.workload.presets import load_model

NAME = "a-256k"
TITLE = "256K context on 2 x 8 H200: baseline (no BP) vs the planner's best"
ASSUMPTIONS = (
    "recipes of workloads.md: block 256, batch 1 per replica, ZeRO-2, bf16; checkpointing chosen "
    "by the planner (full or none)",
    "objective per preset: BD3-LM for Nemotron-Labs-Diffusion, Fast-dLLM v2 (two 2L views as two rows of one pass) for the "
    "Qwen3.5/3.8 conversions, DiffusionGemma native SFT with self-conditioning 0.5 as its expectation",
    "hardware: h200 profile (datasheet and public NCCL/FA3 figures; not calibrated on the cluster)",
    "implementation: turbo-dllm (what the reference framework executes: Flex for CP, FA4 for "
    "CSBP/BP, CP's gathers waited on, reorder copies); speedup (ideal) re-searches the row under "
    "the ideal profile (best kernel, every collective hidden), so the difference is the "
    "implementation's share of the gain",
)
UNVERIFIED = (
    "Nemotron 3B/14B head dim and FFN (Ministral shapes), DiffusionGemma config (third-party copy), "
    "Qwen3.8-27B assumed identical to Qwen3.5-27B, Gated-DeltaNet head counts",
)
COLUMNS = [("model", "model"), ("objective", "objective"), ("baseline_plan", "baseline (no BP)"),
           ("baseline_tokens_s", "tokens/s"), ("baseline_peak_gib", "peak GiB"),
           ("best_plan", "best plan"), ("best_tokens_s", "tokens/s"), ("best_peak_gib", "peak GiB"),
           ("speedup", "speedup (turbo-dllm)"), ("speedup_ideal", "speedup (ideal)"),
           ("note", "why (simulator's figures)")]


def run(runner: Runner, out: Path) -> StudyOutput:
    rows = []
    for name in FULL_MODELS_256K:
        model = load_model(name)
        rows.append(runner.row(model, full_model(model, "256k"), H200_2x8))
    names = [r["model"] for r in rows]
    plot = bars(out / "a_256k.png", "256K on 2x8 H200", [
        ("tokens/s", names, {"baseline (no BP)": [r.get("baseline_tokens_s") for r in rows],
                             "best plan": [r.get("best_tokens_s") for r in rows]}),
        ("peak memory (GiB)", names, {"baseline (no BP)": [r.get("baseline_peak_gib") for r in rows],
                                      "best plan": [r.get("best_peak_gib") for r in rows]})])
    return StudyOutput(rows, COLUMNS, [winner_line(r) for r in rows], [plot])


def winner_line(r: dict) -> str:
    """'model: best plan (kind) s.ss x over baseline; reasons' for one row."""
    if r.get("best_plan") == "none fits":
        return f"{r['model']} at {r['context']}: nothing fits — {r['note']}"
    speed = f"{r['speedup']:.2f}x" if r.get("speedup") else "no baseline fits"
    return (f"{r['model']} at {r['context']}: {r['best_plan']} ({r['best_kind']}) — {speed} over "
            f"{r['baseline_plan']}; {r['note']}")
