"""Study e: dual-end vs contiguous noisy-block schedule at 256K, on the planner's best CSBP plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from csbp.experiments import StudyOutput
from csbp.experiments.plots import bars
from csbp.experiments.runner import H200_2x8, Runner, label
from csbp.experiments.workloads import full_model
from csbp.simulator.layout.layout import Layout
from csbp.simulator.planner.planner import plan_of
from csbp.simulator.workload.presets import load_model
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.workload.workload import Workload

NAME = "e-schedule"
TITLE = "Dual-end vs contiguous block schedule at 256K on 2 x 8 H200"
MODELS = ("nemotron-diffusion-8b", "nemotron-diffusion-14b", "diffusiongemma-26b-a4b", "qwen3.8-27b")
SCHEDULES = ("dual-end", "contiguous")
ASSUMPTIONS = ("the planner's best CSBP topology at 256K, re-simulated (event engine) with each "
               "schedule, everything else unchanged",
               "imbalance = max / mean attention pairs per rank of a full-attention layer")
UNVERIFIED = ("as study a",)
COLUMNS = [("model", "model"), ("plan", "CSBP topology"), ("dual-end_tokens_s", "dual-end tok/s"),
           ("contiguous_tokens_s", "contiguous tok/s"), ("dual_end_gain", "dual-end / contiguous"),
           ("dual-end_imbalance", "dual-end imbalance"), ("contiguous_imbalance", "contiguous imbalance")]


def pair_imbalance(workload: Workload, plan) -> float:
    """Max over mean attention pairs per rank (full attention): what the schedule balances."""
    layout = Layout.build(workload, plan)
    pairs = np.array([layout.pairs(r) for r in range(layout.size)], dtype=float)
    return float(pairs.max() / pairs.mean())


def run(runner: Runner, out: Path) -> StudyOutput:
    rows, findings = [], []
    for name in MODELS:
        model = load_model(name)
        w = full_model(model, "256k")
        best = runner.best_of_family(model, w, H200_2x8, "csbp")
        if best is None:
            findings.append(f"{name}: no CSBP plan fits at 256K")
            continue
        w = w.model_copy(update={"checkpointing": best.workload["checkpointing"]})
        row = {"model": name, "context": "256K", "plan": label(best)}
        for schedule in SCHEDULES:
            plan = plan_of(best).model_copy(update={"schedule": schedule})
            r = simulate(model, w, plan, runner.profile(H200_2x8), H200_2x8.nodes, with_trace=False)
            row[f"{schedule}_tokens_s"] = r.tokens_per_s
            row[f"{schedule}_step_s"] = r.step_time_s
            row[f"{schedule}_imbalance"] = pair_imbalance(w, plan)
        row["dual_end_gain"] = (row["dual-end_tokens_s"] / row["contiguous_tokens_s"]
                                if row["dual-end_tokens_s"] and row["contiguous_tokens_s"] else None)
        rows.append(row)
        findings.append(f"{name} ({row['plan']}): dual-end {row['dual_end_gain']:.2f}x contiguous; "
                        f"attention pairs max/mean {row['dual-end_imbalance']:.2f} vs "
                        f"{row['contiguous_imbalance']:.2f}")
    plot = bars(out / "e_schedule.png", "Block schedule on the best CSBP plan, 256K", [
        ("tokens/s", [r["model"] for r in rows],
         {s: [r.get(f"{s}_tokens_s") for r in rows] for s in SCHEDULES})])
    return StudyOutput(rows, COLUMNS, findings, [plot])
