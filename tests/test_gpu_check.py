"""The one-GPU kit's CPU dry run (`benchmarks/gpu_check.sh --dry-run`): every step runs, the
profile it writes loads with the simulator's loader, and the report has its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from csbp.simulator.system.hardware import load_profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_bench as kb  # noqa: E402
import measured_profile  # noqa: E402


@pytest.mark.timeout(180)
def test_the_dry_run_writes_a_loadable_profile_and_a_report(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=170, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = load_profile(str(tmp_path / "h200-dry-run.yaml"))
    assert profile.kind == "measured" and profile.links == load_profile("h200").links
    measured = [k for k, v in profile.sources.items() if v.startswith("measured")]
    assert {"gpu.gemm_efficiency", "gpu.hbm_gbs", "gpu.op_overhead_us"} <= set(measured)
    report = json.loads((tmp_path / "gpu_check_report.json").read_text())
    assert {"environment", "steps", "kernels", "emulations", "within_budget", "elapsed_s"} <= \
        report.keys()
    assert report["within_budget"] and report["elapsed_s"] <= report["budget_s"]
    emulations = report["emulations"]
    assert {(e["kind"], e["seq_len"]) for e in emulations} == \
        {(k, n) for k in ("cp", "csbp") for n in ("128", "256", "512")}
    ran = [e for e in emulations if e["status"] == "ok"]
    assert ran, [e["status"] for e in emulations]
    for e in ran:
        assert e["step_time_s"] > 0 and e["predicted_compute_s"] > 0
        assert e["collective_bytes_match"] and e["measured_peak_memory_gib"] > 0
        assert {"measured_s", "predicted_s"} <= e["by_phase"][0].keys()
    families = {k["family"] for k in report["kernels"] if k["what"] == "attention"}
    assert {"fa2", "cudnn", "efficient", "flex-triton", "fa3", "fa4"} <= families
    # issue 23's families: grouped GEMM measured (F.grouped_mm runs on CPU in bf16), the delta
    # rule listed with the reason it did not run (flash-linear-attention needs Triton on a GPU)
    kinds = {(k["what"], k["family"], k["direction"]) for k in report["kernels"]}
    assert {("grouped-gemm", "grouped-mm", d) for d in ("fwd", "bwd")} <= kinds
    assert {("linear", "fla-triton", d) for d in ("fwd", "bwd")} <= kinds
    assert all(k["seconds"] is not None or k["note"] for k in report["kernels"]
               if k["what"] in ("grouped-gemm", "linear"))
    if any(k["what"] == "grouped-gemm" and k["seconds"] for k in report["kernels"]):
        assert profile.sources["gpu.gemm_kernels.grouped-mm.efficiency"].startswith("measured")
    assert "## Emulated ranks" in (tmp_path / "gpu_check_report.md").read_text()


def _point(family: str, direction: str, tile: int, tflops: float, causal: bool = False):
    flop = 1e12
    return kb.Point("attention", family, direction, f"S{tile} D128" + (" causal" if causal else ""),
                    flop / (tflops * 1e12), flop, tflops, size=tile, head_dim=128)


def test_the_profile_keeps_unmeasured_figures_with_their_sources_and_marks_measured_ones(tmp_path):
    points = [kb.Point("gemm", "torch.mm", "fwd", f"{m}x4096x4096", 1e-3, 2.0 * m * 4096 ** 2,
                       2.0 * m * 4096 ** 2 / 1e-3 / 1e12, size=2.0 * m * 4096 ** 2 / 1e9)
              for m in (1024, 8192)]
    points += [kb.Point("memory", "copy_", "copy", "1", 1e-3, 0, None, size=4300.0),
               kb.Point("memory", "silu(x)*y", "elementwise", "1", 1e-3, 0, None, size=3000.0),
               kb.Point("memory", "add_", "launch", "8", 4e-6, 0, None)]
    points += [_point(f, d, t, r) for f, r in (("fa2", 300.0), ("flex-triton", 250.0))
               for d in ("fwd", "bwd") for t in (1024, 4096)]
    points += [_point("fa2", d, 4096, 200.0, causal=True) for d in ("fwd", "bwd")]
    env = {"where": "a test", "torch": "x", "device_name": "NVIDIA H200", "dtype": "bfloat16",
           "memory_total_bytes": 141 * 2**30, "context_bytes": 2**29}
    profile = measured_profile.build(ROOT / "hardware_profiles" / "h200.yaml", points, env,
                                     "h200-measured")
    path = tmp_path / "h200-measured.yaml"
    measured_profile.write(path, profile)
    loaded, base = load_profile(str(path)), load_profile("h200")
    assert loaded.kind == "measured" and loaded.gpu.hbm_gbs == 4300.0
    assert loaded.gpu.op_overhead_us == 4.0 and loaded.links == base.links
    assert loaded.gpu.masked_attention_efficiency_factor < 1.0
    for key, source in loaded.sources.items():
        assert source.startswith(("measured", "copied from h200")), key
        if source.startswith("copied"):
            assert base.sources[key] in source, key


@pytest.mark.floats
def test_the_profile_writes_grouped_linear_and_head_dim_families_from_their_points(tmp_path):
    peak = 989.4
    points = [kb.Point("grouped-gemm", "grouped-mm", d, "E64 rows262144 h2816 I704", 1e-3,
                       f, f / 1e-3 / 1e12, size=704.0) for d, f in (("fwd", 2e11), ("bwd", 4e11))]
    points += [kb.Point("linear", "fla-triton", d, "T32768 H48 d128", 1e-3, f, f / 1e-3 / 1e12,
                        "clean", 1.0) for d, f in (("fwd", 1e11), ("bwd", 2e11))]
    points += [kb.Point("attention", "fa4", d, f"S4096 D{hd}", 1e-3, 1e12, r, size=4096.0,
                        head_dim=hd) for d in ("fwd", "bwd") for hd, r in ((128, 600.0), (256, 540.0))]
    env = {"where": "a test", "torch": "x", "device_name": "NVIDIA H200", "dtype": "bfloat16"}
    profile = measured_profile.build(ROOT / "hardware_profiles" / "h200.yaml", points, env, "t")
    path = tmp_path / "t.yaml"
    measured_profile.write(path, profile)
    loaded = load_profile(str(path))
    # (2e11 + 4e11) FLOP in 2 ms; 1e11 in 1 ms; 540 / 600; written to three significant digits
    # (_significant), hence abs=5e-4 on values below 1
    (width, eff), = loaded.gpu.gemm_kernels["grouped-mm"].efficiency
    assert width == 704 and eff == pytest.approx(300 / peak, abs=5e-4)
    assert loaded.gpu.linear_attention_kernels["fla-triton"].forward_efficiency == pytest.approx(100 / peak, abs=5e-4)
    (hd, fwd, bwd), = loaded.gpu.attention_kernels["fa4"].head_dim_factors
    assert hd == 256 and fwd == pytest.approx(0.9, abs=5e-4) and bwd == pytest.approx(0.9, abs=5e-4)
    for key in ("gpu.gemm_kernels.grouped-mm.efficiency", "gpu.linear_attention_kernels.fla-triton.forward_efficiency",
                "gpu.attention_kernels.fa4.head_dim_factors"):
        assert loaded.sources[key].startswith("measured"), key
