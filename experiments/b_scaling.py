"""Study b: context scaling 64K-512K for DiffusionGemma and the Qwen3.8 conversion on 2 x 8 H200."""

from __future__ import annotations

from pathlib import Path

from csbp.experiments import StudyOutput
from csbp.experiments.a_256k import COLUMNS as A_COLUMNS, winner_line
from csbp.experiments.plots import lines
from csbp.experiments.runner import H200_2x8, Runner
from csbp.experiments.workloads import full_model
from csbp.simulator.workload.presets import load_model

NAME = "b-scaling"
TITLE = "Context scaling 64K-512K on 2 x 8 H200"
MODELS = ("diffusiongemma-26b-a4b", "qwen3.8-27b")
CONTEXTS = ("64k", "128k", "256k", "512k")
ASSUMPTIONS = ("same recipes and hardware profile as study a",)
UNVERIFIED = ("DiffusionGemma config (third-party copy); Qwen3.8-27B = Qwen3.5-27B shapes",)
COLUMNS = [("context", "context")] + A_COLUMNS[:1] + A_COLUMNS[2:]


def run(runner: Runner, out: Path) -> StudyOutput:
    rows = []
    for name in MODELS:
        model = load_model(name)
        rows += [runner.row(model, full_model(model, c), H200_2x8) for c in CONTEXTS]
    xs = [c.upper() for c in CONTEXTS]

    def series(key: str) -> dict:
        out = {}
        for name in MODELS:
            mine = [r for r in rows if r["model"] == name]
            if key == "speedup":
                out[name] = [r.get("speedup") for r in mine]
            else:
                out[f"{name} baseline"] = [r.get(f"baseline_{key}") for r in mine]
                out[f"{name} best"] = [r.get(f"best_{key}") for r in mine]
        return out

    plot = lines(out / "b_scaling.png", "Context scaling on 2x8 H200", [
        ("tokens/s", xs, series("tokens_s")), ("speedup over baseline", xs, series("speedup")),
        ("peak memory (GiB)", xs, series("peak_gib"))], "context")
    return StudyOutput(rows, COLUMNS, [winner_line(r) for r in rows], [plot])
