"""Study d: pure BP (replicated clean prefix) against CP, CSBP and DP at 64K and 128K."""

from __future__ import annotations

from pathlib import Path

from csbp.experiments import StudyOutput
from csbp.experiments.plots import bars
from csbp.experiments.runner import FAMILIES, H200_2x8, Runner
from csbp.experiments.workloads import full_model
from csbp.simulator.workload.presets import load_model

NAME = "d-pure-bp"
TITLE = "Pure-BP ablation at 64K and 128K on 2 x 8 H200"
MODELS = ("nemotron-diffusion-14b", "diffusiongemma-26b-a4b")
CONTEXTS = ("64k", "128k")
ASSUMPTIONS = ("same recipes and hardware profile as study a; best plan of each family as the "
               "planner ranks it (event engine)",)
UNVERIFIED = ("Nemotron 14B shapes (Ministral 3 14B), DiffusionGemma config (third-party copy)",)
COLUMNS = [("model", "model"), ("context", "context")] + [
    (f"{f}_tokens_s", f"best {f.upper()} tok/s") for f in FAMILIES] + [
    ("bp_plan", "best pure-BP plan"), ("csbp_plan", "best CSBP plan"), ("bp_vs_csbp", "BP / CSBP")]


def run(runner: Runner, out: Path) -> StudyOutput:
    rows, findings = [], []
    for name in MODELS:
        model = load_model(name)
        for c in CONTEXTS:
            row = runner.row(model, full_model(model, c), H200_2x8)
            bp, csbp = row.get("bp_tokens_s"), row.get("csbp_tokens_s")
            row["bp_vs_csbp"] = bp / csbp if bp and csbp else None
            rows.append(row)
            findings.append(f"{name} at {row['context']}: pure BP " + (
                f"reaches {row['bp_vs_csbp']:.2f}x CSBP's tokens/s ({row['bp_plan']} vs {row['csbp_plan']})"
                if row["bp_vs_csbp"] else f"{'does not fit' if not bp else 'fits'}; CSBP "
                f"{'does not fit' if not csbp else 'fits'}") + f"; best overall {row.get('best_plan')}")
    cats = [f"{r['model'].split('-')[0]} {r['context']}" for r in rows]
    plot = bars(out / "d_pure_bp.png", "Best plan of each family (2x8 H200)", [
        ("tokens/s", cats, {f.upper(): [r.get(f"{f}_tokens_s") for r in rows] for f in FAMILIES})])
    return StudyOutput(rows, COLUMNS, findings, [plot])
