"""Study f: operator profile at 256K, the planner's best CP plan against its best CSBP plan."""

from __future__ import annotations

from pathlib import Path

from csbp.experiments import StudyOutput
from csbp.experiments.plots import bars
from csbp.experiments.runner import H200_2x8, Runner, label
from csbp.experiments.workloads import full_model
from csbp.simulator.planner.planner import plan_of
from csbp.simulator.workload.presets import load_model
from csbp.simulator.report.result import Result
from csbp.simulator.engine.simulate import simulate

NAME = "f-profile"
TITLE = "Operator profile at 256K on 2 x 8 H200: CP vs CSBP"
MODELS = ("nemotron-diffusion-8b", "diffusiongemma-26b-a4b", "qwen3.8-27b")
ASSUMPTIONS = (
    "best CP and best CSBP plan of the planner's ranking, re-simulated with the event engine",
    "forward span = forward phase; backward span = recompute + backward phases, on the critical rank",
    "attention traffic = K/V and dK/dV bytes a GPU receives per step (every view and pass); exposed "
    "attention communication = compute-stream idle time whose releasing transfer was attention K/V",
)
UNVERIFIED = ("as study a",)
COLUMNS = [("model", "model"), ("family", "plan"), ("plan", "topology"), ("step_s", "step s"),
           ("forward_s", "forward s"), ("backward_s", "backward s"), ("attn_gib", "attn GiB/GPU"),
           ("exposed_attn_s", "exposed attn s"), ("exposed_s", "exposed comm s"), ("tokens_s", "tokens/s")]


def exposed_attention_s(result: Result) -> float:
    """Idle compute time released by an attention K/V transfer, on the rank where it is largest."""
    worst = 0.0
    for rank in {e.rank for e in result.trace}:
        events = [e for e in result.trace if e.rank == rank]
        compute = sorted((e for e in events if e.stream == "compute"), key=lambda e: e.start_s)
        comm = sorted((e for e in events if e.stream == "comm"), key=lambda e: e.start_s + e.duration_s)
        idle, end, j, last = 0.0, 0.0, 0, None
        for op in compute:
            while j < len(comm) and comm[j].start_s + comm[j].duration_s <= op.start_s + 1e-12:
                last, j = comm[j], j + 1
            if op.start_s - end > 1e-9 and last is not None and last.start_s + last.duration_s > end \
                    and last.category == "attention-kv":
                idle += op.start_s - end
            end = max(end, op.start_s + op.duration_s)
        worst = max(worst, idle)
    return worst


def run(runner: Runner, out: Path) -> StudyOutput:
    rows, findings = [], []
    for name in MODELS:
        model = load_model(name)
        w = full_model(model, "256k")
        pair = {}
        for fam in ("cp", "csbp"):
            best = runner.best_of_family(model, w, H200_2x8, fam)
            if best is None:
                findings.append(f"{name}: no {fam.upper()} plan fits at 256K")
                continue
            wl = w.model_copy(update={"checkpointing": best.workload["checkpointing"]})
            r = simulate(model, wl, plan_of(best), runner.profile(H200_2x8), H200_2x8.nodes)
            pair[fam] = row = {
                "model": name, "family": fam.upper(), "plan": label(best), "step_s": r.step_time_s,
                "forward_s": r.phases_s.get("forward", 0.0),
                "backward_s": r.phases_s.get("recompute", 0.0) + r.phases_s.get("backward", 0.0),
                "attn_gib": r.comm_gib_per_gpu.get("attention-kv", 0.0),
                "exposed_attn_s": exposed_attention_s(r), "exposed_s": r.exposed_comm_s,
                "tokens_s": r.tokens_per_s}
            rows.append(row)
        if len(pair) == 2:
            cp, cs = pair["cp"], pair["csbp"]
            findings.append(
                f"{name}: CSBP step {cs['step_s']:.2f} s vs CP {cp['step_s']:.2f} s; attention traffic "
                f"{cs['attn_gib']:.0f} vs {cp['attn_gib']:.0f} GiB/GPU; exposed attention comm "
                f"{cs['exposed_attn_s']:.3f} vs {cp['exposed_attn_s']:.3f} s")
    cats = [f"{r['model'].split('-')[0]} {r['family']}" for r in rows]
    plot = bars(out / "f_profile.png", "Operator profile at 256K (2x8 H200)", [
        ("seconds per step", cats, {k: [r[k] for r in rows] for k in ("step_s", "forward_s", "backward_s")}),
        ("attention K/V GiB per GPU", cats, {"attn_gib": [r["attn_gib"] for r in rows]}),
        ("exposed communication (s)", cats, {k: [r[k] for r in rows] for k in ("exposed_attn_s", "exposed_s")})])
    return StudyOutput(rows, COLUMNS, findings, [plot])
