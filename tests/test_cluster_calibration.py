"""The cluster calibration (torchrun --calibrate) and the cluster run's measured vs predicted.

Pure parts on synthetic input: the alpha-beta fit recovers the figures timings were made from,
the groups follow the planner's placement, the profile writer marks every figure measured or
copied and loads, the phase split charges kernels to phases. Then world 2 on gloo through
torchrun in a subprocess (small sizes, a timeout each): the calibration writes a profile that
`csbp simulate` accepts, and a run priced on it reports predicted, measured and error fields.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from csbp.runtime.calibration.cluster_groups import group_kinds, nodes_of
from csbp.runtime.calibration.cluster_calibrate import parse_sizes
from csbp.runtime.calibration.fit_figures import MIB
from csbp.runtime.calibration.link_fit import Sample, alpha_beta, fit_level, ring_steps, wire_bytes
from csbp.runtime.calibration import cluster_profile
from csbp.runtime.training import step_phases
from csbp.runtime.training.step_phases import KernelEvent
from csbp.simulator.errors import InputError
from csbp.simulator.system.hardware import load_profile

SIZES = (1 * MIB, 8 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB)
CALL, STEP, P2P = 10e-6, 2e-6, 7e-6  # seconds: the synthetic fabric's latencies
GBS = {"all_gather": 360.0, "reduce_scatter": 340.0, "all_reduce": 300.0, "all_to_all": 320.0,
       "send_recv": 150.0}


def synthetic(group: str, level: str, size: int, per_node: int, ops, gbs=GBS, call=CALL,
              step=STEP, p2p=P2P) -> list[Sample]:
    """Exact alpha-beta timings of the cost model's formulas (efficiency 1 at every size)."""
    out = []
    for op in ops:
        for n in SIZES:
            latency = {"send_recv": p2p, "all_to_all": call}.get(op, call + ring_steps(op, size) * step)
            t = latency + wire_bytes(op, n, size) / (gbs[op] * 1e9)
            out.append(Sample(group, level, size, per_node, op, n, t))
    return out


@pytest.mark.floats
def test_alpha_beta_recovers_latency_and_bandwidth():
    points = [(x, 5e-6 + x / 200e9) for x in (1e6, 1e7, 1e8, 1e9)]
    alpha, bandwidth = alpha_beta(points)
    assert alpha == pytest.approx(5e-6) and bandwidth == pytest.approx(200e9)


@pytest.mark.floats
def test_nvlink_fit_recovers_the_figures_the_timings_came_from():
    ring = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    samples = synthetic("pair", "nvlink", 2, 2, (*ring, "send_recv")) + synthetic("node", "nvlink", 8, 8, ring)
    fit = fit_level(samples, "nvlink", "measured by test")
    f = {k: v["value"] for k, v in fit.figures.items()}
    assert fit.skipped == []
    # rounded to 4 significant digits (fit_figures.rounded): 1e-3 relative is their resolution
    assert f["call_latency_us"] == pytest.approx(CALL * 1e6, rel=1e-3)
    assert f["step_latency_us"] == pytest.approx(STEP * 1e6, rel=1e-3)
    assert f["p2p_latency_us"] == pytest.approx(P2P * 1e6, rel=1e-3)
    for op, field in (("all_gather", "collective_gbs"), ("reduce_scatter", "reduce_scatter_gbs"),
                      ("all_reduce", "all_reduce_gbs"), ("all_to_all", "alltoall_gbs"),
                      ("send_recv", "p2p_gbs")):
        assert f[field] == pytest.approx(GBS[op], rel=1e-3)
    assert all(y == pytest.approx(1.0, rel=1e-3) for _, y in f["size_efficiency"])
    assert all(v["source"].startswith("measured by test") for v in fit.figures.values())


@pytest.mark.floats
def test_infiniband_fit_uses_one_rank_per_node_groups():
    ib = {op: g / 8 for op, g in GBS.items()}  # a NIC per GPU: slower than NVLink
    samples = (synthetic("striped", "infiniband", 4, 1, ("all_gather", "reduce_scatter", "all_reduce",
                                                          "all_to_all"), gbs=ib, call=20e-6, step=5e-6)
               + synthetic("cross-pair", "infiniband", 2, 1, ("send_recv",), gbs=ib, p2p=10e-6)
               + synthetic("world", "check", 16, 4, ("all_gather",)))
    f = {k: v["value"] for k, v in fit_level(samples, "infiniband", "measured").figures.items()}
    assert f["call_latency_us"] == pytest.approx(20, rel=1e-3)
    assert f["step_latency_us"] == pytest.approx(5, rel=1e-3)
    assert f["collective_gbs"] == pytest.approx(ib["all_gather"], rel=1e-3)
    assert f["p2p_gbs"] == pytest.approx(ib["send_recv"], rel=1e-3)


def test_groups_follow_the_planners_placement():
    nodes = nodes_of(["a"] * 4 + ["b"] * 4)
    kinds = {k.name: k for k in group_kinds(nodes)}
    assert set(kinds) == {"pair", "node", "striped", "world"}
    assert kinds["pair"].instances == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert kinds["striped"].instances == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert "send_recv" in kinds["striped"].ops and kinds["world"].level == "check"
    assert [k.name for k in group_kinds(nodes_of(["h", "h"]))] == ["pair"]
    assert [k.name for k in group_kinds(nodes_of(["h", "h"], ranks_per_node=1))] == ["striped"]
    with pytest.raises(InputError, match="ranks per host differ"):
        nodes_of(["a", "a", "b"])
    with pytest.raises(InputError, match="multiple of it"):
        nodes_of(["h"] * 4, ranks_per_node=3)


@pytest.mark.parametrize("text", ["abc", "1M", "1X,2M", "0,1M", "64G,1M"])
def test_bad_sizes_are_one_clear_line(text):
    with pytest.raises(InputError, match="--sizes"):
        parse_sizes(text)


def measurement(samples, nodes: int, per_node: int) -> dict:
    return {"samples": samples, "skipped": ["per-GPU kernels: no CUDA"], "hosts": ["n0", "n1"][:nodes],
            "nodes": nodes, "ranks_per_node": per_node, "backend": "nccl", "backend_version": "NCCL 2.21.5",
            "sizes": SIZES, "kernels": None, "date": "2026-12-01 12:00 UTC"}


@pytest.mark.parametrize("base", ["h200", "cpu-measured"])
def test_profile_marks_every_figure_measured_or_copied_and_loads(tmp_path, base):
    ring = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    samples = (synthetic("pair", "nvlink", 2, 2, (*ring, "send_recv")) + synthetic("node", "nvlink", 4, 4, ring)
               + synthetic("striped", "infiniband", 2, 1, (*ring, "send_recv"), gbs={o: g / 8 for o, g in GBS.items()}))
    raw, fits, skipped = cluster_profile.build(base, "my-cluster", measurement(samples, 2, 4), "torchrun x")
    path = tmp_path / "my-cluster.yaml"
    cluster_profile.write(path, raw, "torchrun x")
    profile = load_profile(str(path))
    base_profile = load_profile(base)
    assert profile.kind == "measured" and profile.node.gpus_per_node == 4 and set(fits) == {"nvlink", "infiniband"}
    measured = {k for k, v in profile.sources.items() if v.startswith("measured by `torchrun x`")}
    assert {"links.nvlink.collective_gbs", "links.nvlink.call_seconds", "links.infiniband.p2p_gbs",
            "node.gpus_per_node"} <= measured
    for key, source in profile.sources.items():
        if key not in measured:  # the base's figure, with the base's own source after the note
            assert source.startswith(f"copied from {base}") and base_profile.sources[key] in source
    assert profile.links.infiniband.collective_gbs == pytest.approx(GBS["all_gather"] / 8, rel=1e-3)
    # exact timings priced back within the figures' 4 digits (cpu-measured's base adds its
    # measured wake-up delay to groups larger than its 2 cores: only the pairs compare there)
    rows = [r for r in cluster_profile.residuals(profile, samples) if base == "h200" or r["size"] == 2]
    assert max(abs(r["alpha_beta_error"]) for r in rows) < 0.01


def kernel(name, start, dur, scopes=(), launched=None):
    return KernelEvent(name, start, dur, tuple(scopes), start if launched is None else launched)


def test_phase_split_charges_kernels_and_exposed_communication():
    bwd = "autograd::engine::evaluate_function: MmBackward0"
    events = [kernel("gemm", 0, 100), kernel("softmax", 100, 50),
              kernel("ncclKernel_AllGather", 120, 60),            # 30 us beside softmax, 30 exposed
              kernel("gemm", 200, 80, [bwd, step_phases.RECOMPUTE]),
              kernel("gemm_dgrad", 280, 120, [bwd]),
              kernel("ncclKernel_ReduceScatter", 300, 200),       # 100 beside dgrad, 100 exposed
              kernel("adam", 510, 40, launched=450),              # after the last backward launch
              kernel("adam", 550, 10, ["Optimizer.step#AdamW.step"], launched=5)]
    split = step_phases.split(events)
    assert split["forward"] == pytest.approx(150e-6)
    assert split["recompute"] == pytest.approx(80e-6)
    assert split["backward"] == pytest.approx(120e-6)
    assert split["optimizer"] == pytest.approx(50e-6)
    assert split["communication"] == pytest.approx(260e-6)
    assert split["exposed_communication"] == pytest.approx(130e-6)
    assert split["gpu_span"] == pytest.approx(560e-6)
    table = step_phases.compare(split, {"forward": 300e-6, "recompute": 0.0, "backward": 120e-6,
                                        "optimizer": 50e-6, "exposed_communication": 130e-6})
    assert table["forward"]["error"] == pytest.approx(1.0) and table["backward"]["error"] == pytest.approx(0.0)


def test_bad_calibration_input_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    from csbp.runtime.training.torchrun import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for argv, message in ((["--calibrate"], "--calibrate needs --out"),
                          (["--calibrate", "--out", str(tmp_path / "c.txt")], "must end in .yaml"),
                          (["--calibrate", "--out", str(tmp_path / "c.yaml"), "--sizes", "1Q"], "--sizes"),
                          (["--calibrate", "--out", str(tmp_path / "c.yaml"), "--hardware", "nope"],
                           "unknown hardware profile"),
                          (["--plan", "cp=2", "--hardware", "nope"], "unknown hardware profile")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


# ---- world 2 on gloo, through torchrun ----------------------------------------------------------

def torchrun(*flags: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "-m", "csbp.runtime.training.torchrun", *flags],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cluster") / "c.yaml"
    done = torchrun("--calibrate", "--out", str(out), "--hardware", "cpu-measured",
                    "--sizes", "64K,256K,1M", "--repeats", "1", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    return out, json.loads(done.stdout)


@pytest.mark.timeout(150)
def test_calibration_writes_a_profile_simulate_accepts(calibrated, capsys):
    from csbp.simulator.commands.cli import main as csbp

    path, summary = calibrated
    profile = load_profile(str(path))
    assert profile.node.gpus_per_node == 2 and profile.links.nvlink.call_seconds[2]
    assert profile.sources["links.nvlink.p2p_gbs"].startswith("measured by `torchrun")
    assert "gloo" in profile.sources["links.nvlink.collective_gbs"]
    assert profile.sources["gpu.peak_tflops"].startswith("copied from cpu-measured")
    assert any("across nodes" in s for s in summary["skipped"])
    assert {r["op"] for r in summary["fit"]} == {"all_gather", "reduce_scatter", "all_reduce",
                                                 "all_to_all", "send_recv"}
    assert csbp(["simulate", "--hardware", str(path), "--plan", "cp=2", "--nodes", "1",
                 "--seq-len", "256", "--block-size", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0


@pytest.mark.timeout(150)
def test_cluster_run_reports_predicted_measured_and_error(calibrated):
    path, _ = calibrated
    done = torchrun("--plan", "cp=2", "--seq-len", "128", "--block-size", "16", "--steps", "1",
                    "--warmup", "0", "--hardware", str(path), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout)
    assert r["hardware"] == "c" and r["hardware_from"] == "--hardware"
    assert r["step_time_error"] == pytest.approx(r["predicted_step_s"] / r["step_time_s"] - 1)
    assert r["tokens_per_s_error"] is not None and r["predicted_tokens_per_s"] > 0
    assert len(r["predicted_peak_memory_gib_per_rank"]) == len(r["peak_memory_gib_per_rank"]) == 2
    assert all(e is not None for e in r["peak_memory_error_per_rank"])
    assert r["phase_split"] is None and "CUDA only" in r["phase_split_note"]


def test_kernel_events_follow_the_launching_ops_ranges():
    """torch.profiler's events as kernel_events reads them (CUDA-free stand-ins): a kernel's
    linked correlation id names the CPU op that launched it; its ranges are that op's parents."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def event(id_, name, start, end, device=DeviceType.CPU, parent=None, linked=0):
        return NS(id=id_, name=name, time_range=NS(start=start, end=end), device_type=device,
                  cpu_parent=parent, linked_correlation_id=linked)

    engine = event(1, "autograd::engine::evaluate_function: MmBackward0", 10, 50)
    mm = event(2, "aten::mm", 12, 20, parent=engine)
    gemm = event(99, "sm90_gemm", 30, 45, device=DeviceType.CUDA, linked=2)
    orphan = event(98, "ncclKernel_AllReduce", 60, 80, device=DeviceType.CUDA, linked=7)
    (k, o) = step_phases.kernel_events(NS(events=lambda: [engine, mm, gemm, orphan]))
    assert k == KernelEvent("sm90_gemm", 30, 15, (engine.name, "aten::mm"), 12)
    assert o == KernelEvent("ncclKernel_AllReduce", 60, 20, (), 60)


def test_recompute_mark_encloses_only_the_checkpointed_rerun():
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                with set_checkpoint_early_stop(False):  # as runtime/models/model.py re-runs blocks
                    x = checkpoint(b, x, use_reentrant=False)
            return x

    net = Net()
    hooks = step_phases.mark_recompute(net)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        net(torch.randn(4, 8, requires_grad=True)).sum().backward()
    for h in hooks:
        h.remove()
    marks = [e for e in prof.events() if e.name == step_phases.RECOMPUTE]
    assert len(marks) == 2  # one re-run per block, in backward only
    for m in marks:  # the re-run's forward, not the backward's own matmuls
        assert [c.name for c in m.cpu_children] == ["aten::linear"]
        assert m.cpu_parent.cpu_parent.name.startswith(step_phases.BACKWARD_SCOPE)  # inside the
        # backward node whose saved tensors it recomputes: phase_of checks recompute first


def test_a_level_the_base_lacks_must_be_measured_whole():
    ring = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")  # no send/recv across
    samples = synthetic("striped", "infiniband", 2, 1, ring)
    with pytest.raises(InputError, match="infiniband: the measurement gave no p2p_latency_us, p2p_gbs"):
        cluster_profile.build("cpu-measured", "c", measurement(samples, 2, 1), "torchrun x")
