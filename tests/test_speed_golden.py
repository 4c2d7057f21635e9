"""Speed work must not change a single result: simulate() and the planner against recorded output.

`tests/golden/speed.json` holds `simulate(...).to_json()` plus a fingerprint of the trace for
varied plans and models (dense, MoE with sliding layers, hybrid linear attention, a drafter;
CP/BP/CSBP/DP; ring and collective; checkpointing on and off; both engines), and the planner's
ranking for the default job. Floats must agree to 1e-9 relative (`RELATIVE`, its basis beside
it), strings, integers and rankings exactly. (Only datasheet profiles: the CPU-host model is still
being calibrated, and its changes are not speed work.) After a deliberate change of a result,
re-record with

    python tests/test_speed_golden.py --record
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest

from csbp.simulator.commands.cli_args import DEFAULT_MODEL, DEFAULT_NODES, DEFAULT_SEQ_LEN
from csbp.simulator.workload.objectives import default_objective
from csbp.simulator.cost.graph import StepGraph, _LayerTemplate
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.planner.planner import label_of, search
from csbp.simulator.workload.presets import load_model
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.workload.workload import Workload, parse_tokens

GOLDEN = Path(__file__).parent / "golden" / "speed.json"
# recorded floats, compared relatively (assert_close): tests/README.md
pytestmark = pytest.mark.floats
K = 1024

# (name, model, workload fields, plan, hardware, nodes, engine, overlap, trace)
CASES = [
    ("m8-cp16-collective", "nemotron-diffusion-8b", dict(seq_len=64 * K), Plan(cp=16), "h200", 2, "des", True, True),
    ("m8-cp8-tp2-ring", "nemotron-diffusion-8b", dict(seq_len=64 * K), Plan(tp=2, cp=8, transport="ring"), "h200", 2, "des", True, True),
    ("m8-csbp-dp2", "nemotron-diffusion-8b", dict(seq_len=256 * K), Plan(dp=2, cp=8, bp=8), "h200", 2, "des", True, False),
    ("m8-bp16-contig-nockpt", "nemotron-diffusion-8b", dict(seq_len=64 * K, checkpointing="none"), Plan(bp=16, schedule="contiguous"), "h200", 2, "closed-form", True, True),
    ("m8-csbp-ring-cf", "nemotron-diffusion-8b", dict(seq_len=256 * K), Plan(cp=4, bp=16, transport="ring"), "h200", 2, "closed-form", True, False),
    ("m8-dp16-zero3", "nemotron-diffusion-8b", dict(seq_len=16 * K, zero_stage=3), Plan(dp=16), "h200", 2, "des", True, True),
    ("m8-csbp-ring-des-nooverlap", "nemotron-diffusion-8b", dict(seq_len=32 * K, zero_stage=1), Plan(dp=2, cp=4, bp=8, transport="ring"), "h100", 2, "des", False, False),
    ("gemma-ep4-csbp", "diffusiongemma-26b-a4b", dict(seq_len=64 * K), Plan(ep=4, cp=2, bp=4), "h200", 2, "des", True, True),
    ("gemma-cp8-ring-nockpt", "diffusiongemma-26b-a4b", dict(seq_len=64 * K, checkpointing="none"), Plan(ep=2, cp=8, transport="ring"), "h200", 2, "closed-form", True, False),
    ("gemma-bp8-ep2", "diffusiongemma-26b-a4b", dict(seq_len=64 * K, zero_stage=1), Plan(ep=2, bp=8), "h200", 2, "des", True, False),
    ("qwen35-cp8-tp2", "qwen3.5-27b", dict(seq_len=64 * K), Plan(tp=2, cp=8), "h200", 2, "des", True, True),
    ("qwen35-csbp-ring", "qwen3.5-27b", dict(seq_len=128 * K, checkpointing="none"), Plan(tp=2, cp=4, bp=8, transport="ring"), "h200", 2, "closed-form", True, False),
    ("dflash2-cp8", "dflash2-qwen3.8-27b", dict(seq_len=64 * K), Plan(tp=2, cp=8), "h200", 2, "des", True, False),
    ("dflash2-csbp", "dflash2-qwen3.8-27b", dict(seq_len=64 * K), Plan(tp=2, cp=2, bp=8), "h200", 2, "des", True, True),
    ("dflash2-bp16", "dflash2-qwen3.8-27b", dict(seq_len=64 * K, checkpointing="none"), Plan(bp=16), "h200", 2, "closed-form", True, False),
    ("qwen25-fastdllm-csbp", "qwen2.5-7b", dict(seq_len=32 * K, objective="fast-dllm-v2"), Plan(cp=2, bp=8), "h200", 1, "des", True, True),
    ("tiny-dp2-cp2-bp4", "tiny", dict(seq_len=2 * K, block_size=64), Plan(dp=2, cp=2, bp=4), "h200", 1, "des", True, True),
]


def trace_fingerprint(trace) -> dict:
    """Count, order-sensitive sums and a hash of the names: enough to see any moved event."""
    names = "\n".join(f"{e.rank}|{e.stream}|{e.name}|{e.phase}|{e.category}" for e in trace)
    return {"events": len(trace),
            "names_sha1": hashlib.sha1(names.encode()).hexdigest(),
            "sum_start": math.fsum(e.start_s for e in trace),
            "sum_duration": math.fsum(e.duration_s for e in trace),
            "weighted_start": math.fsum(i * e.start_s for i, e in enumerate(trace))}


def run_case(case) -> dict:
    _, model_name, fields, plan, hardware, nodes, engine, overlap, trace = case
    model = load_model(model_name)
    workload = Workload(**{"objective": default_objective(model), **fields})
    result = simulate(model, workload, plan, load_profile(hardware), nodes, engine=engine,
                      overlap=overlap, with_trace=trace)
    out = result.to_json()
    if trace:
        out["trace"] = trace_fingerprint(result.trace)
    return out


def run_planner(top: int = 10) -> dict:
    model = load_model(DEFAULT_MODEL)
    workload = Workload(seq_len=parse_tokens(DEFAULT_SEQ_LEN), objective=default_objective(model))
    found = search(model, workload, load_profile("h200"), DEFAULT_NODES, workers=1)
    return {"candidates": found.candidates, "evaluations": found.evaluations,
            "ranking": [label_of(r) for r in found.ranked],
            "top": [r.to_json() for r in found.ranked[:top]],
            "baseline": found.baseline.to_json() if found.baseline else None,
            "infeasible": [g.to_json() for g in found.infeasible]}


# Tolerance for recorded floats, relative: the recording host and this one may differ in the
# last bit of a transcendental (libm's log/exp/log10 pick FMA or SSE variants by CPU; numpy's
# vectorised loops round differently again), and each figure passes through at most ~1e4 float
# operations, all well conditioned (sums of positive durations, maxima, products, quotients):
# 1e4 x 1.1e-16 ~ 1e-12 relative. 1e-9 leaves a thousandfold margin and still catches any change
# to the model itself (a changed formula moves a figure by far more than a part per billion).
RELATIVE = 1e-9
# A time that is a difference of step-long sums (exposed communication = step - busy, stretched
# compute = busy - nominal; both clamped at 0) carries the rounding of those sums in absolute
# terms: 1e4 operations x 1.1e-16 of the step. Such figures are held to 1e-11 of the step time
# besides the relative tolerance (a recorded 0.0 may come back as 1e-16 s elsewhere).
STEP_FRACTION = 1e-11


def assert_close(got, want, path: str = "", floor: float = 0.0) -> None:
    """`got` equals the recorded `want`: strings, ints, bools and structure exactly, floats to
    RELATIVE (and, for the seconds of a result, within STEP_FRACTION of its step time)."""
    if isinstance(want, float) and isinstance(got, (int, float)):
        assert math.isclose(got, want, rel_tol=RELATIVE, abs_tol=floor) or got == want, \
            f"{path}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{path}: keys differ"
        step = want.get("step_time_s")
        seconds = STEP_FRACTION * step if isinstance(step, float) else None
        for k in want:
            here = seconds if seconds is not None and k.endswith("_s") else floor
            assert_close(got[k], want[k], f"{path}.{k}", here)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: lengths differ"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{path}[{i}]", floor)
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _json(obj):
    return json.loads(json.dumps(obj))  # tuples -> lists, as in the recorded file


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_simulate_unchanged(case, golden):
    assert_close(_json(run_case(case)), golden["simulate"][case[0]], case[0])


@pytest.mark.parametrize("name", ["gemma-ep4-csbp", "qwen35-csbp-ring", "m8-dp16-zero3"])
def test_stamped_layers_equal_built_ones(name, monkeypatch):
    """Layers stamped from the first of their kind are the ops the builder would have appended."""
    _, model_name, fields, plan, hardware, *_ = next(c for c in CASES if c[0] == name)
    model = load_model(model_name)
    workload = Workload(**{"objective": default_objective(model), **fields})
    layout, gpn = Layout.build(workload, plan), load_profile(hardware).node.gpus_per_node
    stamped = StepGraph.build(model, workload, plan, layout, gpn)
    monkeypatch.setattr(_LayerTemplate, "record", classmethod(lambda cls, *args: None))
    assert StepGraph.build(model, workload, plan, layout, gpn) == stamped


def test_planner_unchanged(golden):
    assert_close(_json(run_planner()), golden["planner"], "planner")


if __name__ == "__main__" and "--record" in sys.argv:
    GOLDEN.write_text(json.dumps({"simulate": {c[0]: run_case(c) for c in CASES},
                                  "planner": run_planner()}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
