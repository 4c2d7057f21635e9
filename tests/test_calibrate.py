"""Calibration: the fit inverts its own model, writes a loadable measured profile, rejects bad input.

Synthetic measurements (made from known figures) test the fit without timing anything; one small
gloo run checks that the collective benchmark works end to end (no timing assertion).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from csbp.runtime.calibration.attention_fit import dense_attention_check
from csbp.runtime.calibration.calibration_measurements import COLLECTIVE_SIZES, Measurements
from csbp.runtime.calibration.collective_fit import GROUP_OPS, residuals, ring_steps, wire_bytes
from csbp.runtime.calibration.fit_figures import efficiency_curve
from csbp.runtime.calibration.host_identity import HostIdentity
from csbp.runtime.calibration.profile_fit import fit_profile
from csbp.simulator.system.hardware import HardwareProfile, load_profile

ROOT = Path(__file__).resolve().parent.parent
CALL_US, STEP_US, WAKE_US, CORES = 150.0, 60.0, 3000.0, 2
GBS = {"all_gather": 1.5, "reduce_scatter": 0.4, "all_reduce": 1.2, "all_to_all": 2.5, "send_recv": 2.0}
P2P_US = 120.0
IDENTITY = HostIdentity(host="testhost", cpu_model="Test CPU", cpus=2, torch="2.0.0", date="2026-01-01")


def _synthetic_time(op: str, n_bytes: int, world: int) -> float:
    """The fit's own model with known figures and a flat size curve."""
    if op == "send_recv":
        latency = P2P_US
    else:
        latency = CALL_US + ring_steps(op, world) * STEP_US + (WAKE_US if world > CORES else 0)
    return latency * 1e-6 + wire_bytes(op, n_bytes, world) / (GBS[op] * 1e9)


def _measurements() -> Measurements:
    sizes = COLLECTIVE_SIZES
    ops = (*GROUP_OPS, "send_recv")
    return Measurements(
        identity=IDENTITY, load="0.00 0.00 0.00 -> 0.00 0.00 0.00",
        threads=1, memory_bytes=8 * 1024**3, baseline_rss_bytes=300 * 1024**2,
        gemm=[(m, 128, 384, 2 * m * 128 * 384 / (100e9 * min(1.0, m / 1024))) for m in (128, 512, 2048)],
        attention=[(t, 32, b, 4.0 * t * t * 32 * 4 * (2.5 if b else 1), 1e-3 * (t / 128) ** 2)
                   for t in (128, 512) for b in (False, True)],
        masked_attention=(1.0e-3, 1.1e-3), copy=(2 * 64 * 1024**2, 0.01),
        layer_elementwise=[(512, 0.004), (1024, 0.009)], op_overhead_s=2e-6,
        gemm_load={1: [100e9], 2: [100e9, 100e9], 4: [50e9] * 4},
        collectives={w: {(op, s): _synthetic_time(op, s, w) for op in ops for s in sizes} for w in (2, 4)})


@pytest.mark.floats
# The synthetic measurements are the fit's own model evaluated at known figures, so a fit returns
# them up to its solver's rounding and to the profile's 4 significant digits (fit_figures.rounded):
# rel 1e-3 is that rounding with a margin. Looser bounds say what else enters (beside them).
def test_fit_recovers_the_figures_it_was_made_from():
    raw = fit_profile(_measurements(), "synthetic")
    p = HardwareProfile.model_validate(raw)
    link = p.links.nvlink
    assert link.call_latency_us == pytest.approx(CALL_US, rel=1e-3)
    assert link.step_latency_us == pytest.approx(STEP_US, rel=1e-3)
    assert link.p2p_latency_us == pytest.approx(P2P_US, rel=0.05)  # 4 KiB of wire time included
    for op, gbs in GBS.items():
        assert link.bus_gbs(op) == pytest.approx(gbs, rel=1e-3)
    # the size curve (measured over modelled times) and the wake-up (world-4 times less the
    # world-2 model) are read off the rounded figures, compounding their rounding: 1 %
    assert all(y == pytest.approx(1.0, abs=0.01) for _, y in link.size_efficiency)
    assert p.node.wakeup_latency_us == pytest.approx(WAKE_US, rel=0.01)
    assert p.gpu.peak_tflops == pytest.approx(0.1)
    assert p.gpu.dense_attention is True


@pytest.mark.floats
def test_fitted_model_reproduces_the_measurements():
    m = _measurements()
    p = HardwareProfile.model_validate(fit_profile(m, "synthetic"))
    errors = [abs(r["error"]) for r in residuals(p, m)]
    assert max(errors) < 0.01


def test_written_profile_is_measured_and_every_figure_sourced(tmp_path):
    raw = fit_profile(_measurements(), "synthetic")
    path = tmp_path / "synthetic.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False, default_flow_style=None))
    p = load_profile(str(path))
    assert p.kind == "measured" and p.host == "testhost" and p.date == "2026-01-01"
    assert (p.cpu_model, p.cpus, p.torch) == ("Test CPU", 2, "2.0.0")  # where it was measured
    assert "load" in p.notes
    assert {"gpu.peak_tflops", "node.cores", "node.wakeup_latency_us", "links.nvlink.reduce_scatter_gbs",
            "gpu.op_overhead_us"} <= set(p.sources)
    assert all(s.startswith(("measured", "CPUs", "MemTotal", "ranks", "runtime/models/attention"))
               for s in p.sources.values())
    assert p.links.infiniband is None


def test_single_host_profile_has_no_infiniband(tmp_path):
    from csbp.simulator.errors import InputError

    p = HardwareProfile.model_validate(fit_profile(_measurements(), "synthetic"))
    with pytest.raises(InputError, match="describes one host"):
        p.link("infiniband")
    assert p.on_one_host(4).node.gpus_per_node == 4 and p.on_one_host(4).sources == p.sources


def test_core_sharing_and_wakeup_only_when_ranks_outnumber_cores():
    p = HardwareProfile.model_validate(fit_profile(_measurements(), "synthetic"))
    assert p.node.core_share(2) == 1.0 and p.node.core_share(4) == 0.5
    assert p.node.call_wakeup_us(2) == 0.0 and p.node.call_wakeup_us(4) > 0
    assert load_profile("h100").node.core_share(8) == 1.0  # GPUs do not share cores


@pytest.mark.floats
def test_efficiency_curve_is_a_valid_profile_curve():
    curve = efficiency_curve([(0.01, 0.1), (0.012, 0.2), (1.0, 0.5), (100.0, 1.3)])
    xs = [x for x, _ in curve]
    assert xs == sorted(set(xs)) and all(0 < y <= 1 for _, y in curve)
    assert curve[0][1] == pytest.approx(0.15)


def _csbp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "csbp.simulator.commands.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("args, expected", [
    (["--name", "bad name!"], "bad profile name"),
    (["--out", "profile.txt"], "must end in .yaml"),
    (["--out", "/nonexistent/dir/p.yaml"], "no such directory"),
])
def test_bad_input_is_one_line_exit_2(args, expected):
    r = _csbp("calibrate", *args)
    assert r.returncode == 2 and expected in r.stderr and r.stderr.count("\n") == 1
    assert r.stdout == ""


@pytest.mark.timeout(120)
def test_collective_benchmark_runs_through_the_comm_layer():
    from csbp.runtime.calibration import microbench as mb

    got = mb.collective_seconds(2, [4096], ops=("all_gather", "send_recv"), repeats=1, calls=2, gap_s=0.005,
                                timeout_s=90)
    assert set(got) == {("all_gather", 4096), ("send_recv", 4096)} and all(t > 0 for t in got.values())


def test_gpu_script_writes_a_loadable_profile(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_calibrate", ROOT / "benchmarks" / "gpu_calibrate.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    text = gpu.profile_text(
        "h200-measured", str(ROOT / "hardware_profiles" / "h200.yaml"), "NVIDIA H200, torch x",
        "NVIDIA H200", 141 * 1024**3, 0.5, [(1.0, 0.5, "a"), (100.0, 0.8, "b")],
        [(128, 0.2, "FLASH"), (1024, 0.5, "CUDNN")], [(128, 0.1, "FLASH"), (1024, 0.3, "FLASH")],
        {"tile": 4096, "full_s": 1e-3, "causal_s": 0.6e-3, "factor": 0.83},
        {"copy_gbs": 4000.0, "swiglu_gbs": 3500.0, "launch_s": 3e-6})
    path = tmp_path / "h200-measured.yaml"
    path.write_text(text)
    p = load_profile(str(path))
    assert p.kind == "measured" and p.gpu.hbm_gbs == 4000.0 and p.gpu.op_overhead_us == 3.0
    assert p.links == load_profile("h200").links  # one GPU: fabric from the datasheet
    assert json.loads(json.dumps(p.sources))  # plain strings


def _dense_rows(e_visible: float, e_masked: float, peak: float) -> list[tuple]:
    """Attention calls priced by known visible / masked efficiencies (three masks per size)."""
    from csbp.runtime.validation.validation_suite import VALIDATION_MODEL

    a = VALIDATION_MODEL.layers[0]
    rows = []
    for q, k in ((256, 1024), (512, 1024), (1024, 2048)):
        dense = 4.0 * q * k * a.head_dim * a.n_heads
        for where, frac in (("spread", 0.27), ("early", 0.1), ("late", 0.45)):
            t = [frac * x / (peak * e_visible) + (1 - frac) * x / (peak * e_masked)
                 for x in (dense, 2.5 * dense)]
            rows.append((q, k, where, t[0], t[1], frac))
    return rows


@pytest.mark.floats
def test_dense_attention_fit_separates_visible_and_masked_scores():
    m = _measurements()
    m.dense_attention = _dense_rows(0.3, 0.1, 0.1e12)  # peak of the synthetic GEMMs: 100 GFLOP/s
    p = HardwareProfile.model_validate(fit_profile(m, "synthetic"))
    for field in ("dense_visible_forward_efficiency", "dense_visible_backward_efficiency"):
        assert all(y == pytest.approx(0.3, rel=1e-3) for _, y in getattr(p.gpu, field))
    for field in ("dense_masked_forward_efficiency", "dense_masked_backward_efficiency"):
        assert all(y == pytest.approx(0.1, rel=1e-3) for _, y in getattr(p.gpu, field))
    assert max(abs(r["error"]) for r in dense_attention_check(p, m)) < 1e-3


@pytest.mark.floats
def test_linear_and_tiny_step_figures():
    m = _measurements()
    m.linear = [(512, 256, 768, 2 * 512 * 256 * 768 / 50e9, 2 * 2 * 512 * 256 * 768 / 25e9)]
    m.tiny_step = (0.012, 60)
    p = HardwareProfile.model_validate(fit_profile(m, "synthetic"))
    # two forwards (F each at 50 GFLOP/s) and one backward (2F at 25): 4F in 3F / 25e9 s
    assert p.gpu.gemm_efficiency[0][1] == pytest.approx(1 / 3, rel=1e-3)
    assert p.gpu.op_overhead_us == pytest.approx(200.0)
    assert "kernels" in p.sources["gpu.op_overhead_us"]


@pytest.mark.floats
def test_sharing_efficiency_slows_only_oversubscribed_ranks():
    m = _measurements()
    cpus = m.identity.cpus
    m.step_load = {cpus: 0.1, 2 * cpus: 0.25}  # 0.2 s would be a fair half of a core
    p = HardwareProfile.model_validate(fit_profile(m, "synthetic"))
    assert p.node.sharing_efficiency == pytest.approx(0.8)
    assert p.node.core_share(cpus) == 1.0
    assert p.node.core_share(2 * cpus) == pytest.approx(0.5 * 0.8)
