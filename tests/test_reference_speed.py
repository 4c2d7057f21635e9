"""Calibration stages read at the reference probe's speed (`reference_speed`), on synthetic
measurements: nothing is timed."""

from dataclasses import replace

import pytest

from csbp.runtime.calibration.profile_fit import fit_profile
from csbp.runtime.calibration.reference_speed import STAGES, at_reference_speed, stage_factors
from csbp.simulator.system.hardware import HardwareProfile
from test_calibrate import _measurements

# GEMMs timed on a host twice the reference speed (probe 50 ms around them), attention across
# the change (50 then 100 ms: the mean, 75 ms), the rest at the reference's 100 ms
PROBES = (0.05, 0.05, 0.1, 0.1, 0.1, 0.1, 0.1)


def test_each_stage_is_scaled_by_the_median_probe_over_its_own_two():
    f = stage_factors(PROBES)
    assert list(f) == list(STAGES)
    # one division each: exact but for the last bit (rel 1e-12)
    assert f["GEMMs"] == pytest.approx(2.0, rel=1e-12)
    assert f["attention tiles"] == pytest.approx(0.1 / 0.075, rel=1e-12)
    assert all(f[s] == 1.0 for s in STAGES[2:])


def test_timings_scale_and_sizes_do_not():
    m = replace(_measurements(), probe=PROBES, step_load={2: 0.3}, pair_calls={4: 0.002},
                rank_rates={1: {"gemm": [10.0]}, 4: {"gemm": [2.0] * 4}})
    scaled = at_reference_speed(m)
    # seconds times the factor, rates over it: one multiplication each (rel 1e-12)
    for (mm, k, n, s), (mm2, k2, n2, s2) in zip(m.gemm, scaled.gemm):
        assert (mm, k, n) == (mm2, k2, n2) and s2 == pytest.approx(2 * s, rel=1e-12)
    for (*key, s), (*key2, s2) in zip(m.attention, scaled.attention):
        assert key == key2 and s2 == pytest.approx(s * 0.1 / 0.075, rel=1e-12)
    assert scaled.copy == m.copy and scaled.layer_elementwise == m.layer_elementwise  # factor 1
    assert scaled.collectives == m.collectives and scaled.step_load == m.step_load
    assert scaled.rank_rates == m.rank_rates and scaled.gemm_load == m.gemm_load
    assert scaled.memory_bytes == m.memory_bytes and scaled.score_copies == m.score_copies
    assert scaled.probe == m.probe  # the probes stay as timed: the profile records their median
    assert "GEMMs x2.000" in scaled.notes[-1]


def test_only_what_one_process_measured_alone_is_scaled():
    """The sharing stage at half the reference speed (probes 200 ms around it, median 100):
    the one-rank rates are read at the reference speed, the rates with 4 ranks busy, the steps
    under load, the pair calls and the collectives stay as measured (the host's throughput with
    its cores busy did not move with one process's speed)."""
    probes = (0.1, 0.1, 0.1, 0.2, 0.2, 0.1, 0.1)  # sharing stage: both probes 200 ms
    m = replace(_measurements(), probe=probes, step_load={2: 0.3, 4: 0.6}, pair_calls={4: 0.002},
                rank_rates={1: {"gemm": [10.0]}, 4: {"gemm": [2.0] * 4}})
    assert stage_factors(probes)["core sharing"] == 0.5
    scaled = at_reference_speed(m)
    assert scaled.rank_rates[1]["gemm"] == [20.0]  # at the reference speed: twice the rate
    assert scaled.rank_rates[4] == m.rank_rates[4] and scaled.gemm_load[4] == m.gemm_load[4]
    assert scaled.gemm_load[1] == [2 * r for r in m.gemm_load[1]]
    assert scaled.step_load == m.step_load and scaled.pair_calls == m.pair_calls
    assert scaled.collectives == m.collectives


def test_a_stage_timed_on_a_faster_host_fits_the_figures_of_the_reference_speed():
    """The fitted peak and GEMM curve are those the same host gives at the reference speed."""
    at_reference = replace(_measurements(), probe=(0.1,) * 7)
    fast = replace(at_reference, probe=PROBES,
                   gemm=[(mm, k, n, s / 2) for mm, k, n, s in at_reference.gemm],
                   attention=[(t, hd, b, flop, s * 0.075 / 0.1) for t, hd, b, flop, s in at_reference.attention])
    want = HardwareProfile.model_validate(fit_profile(at_reference_speed(at_reference), "a"))
    got = HardwareProfile.model_validate(fit_profile(at_reference_speed(fast), "b"))
    unscaled = HardwareProfile.model_validate(fit_profile(fast, "c"))
    # the profile rounds to 4 significant digits (fit_figures.rounded): rel 1e-3
    assert got.gpu.peak_tflops == pytest.approx(want.gpu.peak_tflops, rel=1e-3)
    flat = lambda curve: [x for point in curve for x in point]  # noqa: E731
    assert flat(got.gpu.attention_forward_efficiency) == pytest.approx(
        flat(want.gpu.attention_forward_efficiency), rel=1e-3)
    assert unscaled.gpu.peak_tflops == pytest.approx(2 * want.gpu.peak_tflops, rel=1e-3)


def test_without_a_probe_around_every_stage_nothing_changes():
    m = _measurements()
    assert at_reference_speed(m) is m
    short = replace(m, probe=(0.1, 0.2))
    assert at_reference_speed(short) is short
