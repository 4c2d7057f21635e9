"""How ranks share a CPU host (issue 26): the measured per-class speed curves and the crowd
wake-ups are priced as measured, never as cores / ranks; profiles without them price as before.

Synthetic measurements (made from known figures) test the fit and the cost model without timing
anything; one short multi-process run checks that the benchmark itself works (no timing assertion).
"""

import pytest

from csbp.runtime.calibration.profile_fit import fit_profile
from csbp.runtime.calibration.sharing_fit import rank_speed_curves, step_check
from csbp.simulator.cost.cost import HOST_OP_CLASS, collective_seconds, compute_seconds
from csbp.simulator.cost.graph import Comm, Compute, Group
from csbp.simulator.system.hardware import HardwareProfile, load_profile

from test_calibrate import _measurements

# A host whose summed speed saturates: 2 ranks each keep 90 % (not the whole core cores / R would
# give them), 3 and 4 share what 2 had and lose more to switching (the issue-26 shape).
SPEED = {"gemm": (1.0, 0.9, 0.55, 0.38), "memory": (1.0, 0.8, 0.5, 0.35),
         "attention": (1.0, 0.85, 0.5, 0.3), "host": (1.0, 0.95, 0.6, 0.45)}
ALONE = {"gemm": 40.0, "memory": 30.0, "attention": 12.0, "host": 50.0}  # calls per second
PAIR_CALLS = {2: 800e-6, 4: 5800e-6}


def _sharing_measurements():
    m = _measurements()
    # each rank of R gets the class's speed x its share; ranks differ (the scheduler is not fair
    # within a window) but their mean is the share: the fit reads summed rate / R
    m.rank_rates = {r: {c: [ALONE[c] * SPEED[c][r - 1] * (1 + 0.1 * (i - (r - 1) / 2)) for i in range(r)]
                        for c in SPEED} for r in (1, 2, 3, 4)}
    m.rank_window_s = 1.0
    m.pair_calls = dict(PAIR_CALLS)
    return m


@pytest.fixture(scope="module")
def host():
    return HardwareProfile.model_validate(fit_profile(_sharing_measurements(), "synthetic"))


@pytest.mark.floats
# the fit divides measured means and rounds to 4 significant digits (fit_figures.rounded): 1e-3
def test_fit_keeps_the_measured_curve(host):
    for c, speeds in SPEED.items():
        curve = host.node.rank_speed[c]
        assert [r for r, _ in curve] == [1, 2, 3, 4]
        assert [s for _, s in curve] == pytest.approx(speeds, rel=1e-3)
    assert host.node.rank_wakeup_us == {2: pytest.approx(800.0), 4: pytest.approx(5800.0)}
    assert {"node.rank_speed", "node.rank_wakeup_us"} <= set(host.sources)
    assert host.sources["node.rank_speed"].startswith("measured")


def test_written_profile_loads_the_curves_back(tmp_path):
    import yaml

    path = tmp_path / "sharing.yaml"
    raw = fit_profile(_sharing_measurements(), "synthetic")
    path.write_text(yaml.safe_dump(raw, sort_keys=False, width=100, default_flow_style=None))
    p = load_profile(str(path))  # as `csbp calibrate` writes it: int keys and [R, speed] pairs
    assert p.node.rank_speed == HardwareProfile.model_validate(raw).node.rank_speed
    assert sorted(p.node.rank_wakeup_us) == [2, 4]


@pytest.mark.floats
def test_a_saturating_curve_is_used_as_measured_not_as_cores_over_ranks(host):
    node = host.node
    assert node.cores == 2.0
    # two ranks on two cores: cores / ranks would give each a whole core; the host gave 90 %
    assert node.rank_share("gemm", 2) == pytest.approx(0.9, rel=1e-3)
    assert node.core_share(2) == 1.0
    # four: the measured 0.38, not 2 / 4 (x any efficiency the profile may also carry)
    assert node.rank_share("gemm", 4) == pytest.approx(0.38, rel=1e-3)
    assert node.rank_share("memory", 4) == pytest.approx(0.35, rel=1e-3)
    # beyond the last measured count, the summed speed stays where it was measured [U]
    assert node.rank_share("gemm", 8) == pytest.approx(0.38 * 4 / 8, rel=1e-3)


@pytest.mark.floats
def test_cost_divides_each_class_by_its_own_curve(host):
    for ranks in (1, 2, 4):
        on = host.on_one_host(ranks)
        alone = host.on_one_host(1)
        for kind, work in (("gemm", Compute("gemm", (1e9,), (0.0,))),
                           ("elementwise", Compute("elementwise", (0.0,), (1e8,)))):
            klass = HOST_OP_CLASS[kind]
            overhead = host.gpu.op_overhead_us * 1e-6
            busy = compute_seconds(work, alone)[0] - overhead  # alone: both shares are 1
            want = busy / SPEED[klass][ranks - 1] + overhead / SPEED["host"][ranks - 1]
            # the shares are the fitted curve's 4 significant digits: 1e-3
            assert compute_seconds(work, on)[0] == pytest.approx(want, rel=1e-3)


def test_profiles_without_curves_price_as_before():
    """An old profile (cores and sharing efficiency only) keeps its single share, bit for bit:
    the same IEEE operations as before the curves existed."""
    cpu = load_profile("cpu-measured").on_one_host(4)
    assert cpu.node.rank_speed is None or "node.rank_speed" in cpu.sources
    old = cpu.model_copy(update={"node": cpu.node.model_copy(update={"rank_speed": None,
                                                                     "rank_wakeup_us": None})})
    work = Compute("gemm", (2e9,), (0.0,))
    flops = 2e9
    eff = old.gpu.gemm_efficiency
    from csbp.simulator.system.hardware import interpolate

    busy = flops / (old.gpu.peak_tflops * 1e12 * interpolate(eff, flops / 1e9))
    want = (busy + old.gpu.op_overhead_us * 1e-6) / old.node.core_share(4)
    assert compute_seconds(work, old)[0] == want
    assert old.node.rank_share("gemm", 4) == old.node.core_share(4)
    # a class the curves do not list falls back to the single share too
    some = old.node.model_copy(update={"rank_speed": {"gemm": ((1, 1.0), (4, 0.5))}})
    assert some.rank_share("memory", 4) == old.node.core_share(4)
    assert some.rank_share("gemm", 4) == 0.5


def test_a_call_measured_with_fewer_ranks_adds_the_crowd_wakeup(host):
    group = Group(size=2, per_node=2, sync=((0,),))
    work = Comm("all-gather", (1e5,), group, "other")
    table = host.links.nvlink.measured_seconds("all_gather", 2, 1e5)
    assert collective_seconds(work, 1e5, host.on_one_host(2)) == table  # its own measurement
    crowded = collective_seconds(work, 1e5, host.on_one_host(4))
    assert crowded == pytest.approx(table + (5800 - 800) * 1e-6)
    four = Comm("all-gather", (1e5,), Group(size=4, per_node=4, sync=((0,),)), "other")
    # a group of 4 was measured with 4 ranks on the host: nothing to add
    assert collective_seconds(four, 1e5, host.on_one_host(4)) == host.links.nvlink.measured_seconds("all_gather", 4, 1e5)
    old = host.on_one_host(4).model_copy(update={"node": host.node.model_copy(update={
        "rank_wakeup_us": None, "gpus_per_node": 4})})
    assert collective_seconds(work, 1e5, old) == table


@pytest.mark.floats
def test_curve_is_the_mean_rank_over_the_rank_alone():
    curves = rank_speed_curves({1: {"gemm": [10.0]}, 2: {"gemm": [8.0, 10.0]}, 4: {"gemm": [2.0, 3.0, 4.0, 5.0]}})
    assert curves["gemm"] == [[1, 1.0], [2, 0.9], [4, 0.35]]


def test_whole_step_check_prices_the_step_with_ranks_at_once(host):
    m = _sharing_measurements()
    m.step_load = {2: 0.2, 4: 0.5}
    m.probe = (0.1, 0.1)
    rows = step_check(host, m)
    assert [r["ranks"] for r in rows] == [1, 2, 4]
    # more ranks at once: a slower step, by the curves (each share at 4 below its share at 2)
    assert rows[0]["predicted_s"] < rows[1]["predicted_s"] < rows[2]["predicted_s"]


@pytest.mark.timeout(240)
def test_sharing_benchmark_runs():
    from csbp.runtime.calibration.rank_sharing import OP_CLASSES, measure_sharing

    got = measure_sharing(2, seconds=0.1, repeats=1, timeout_s=200)
    assert sorted(got.rates) == [1, 2]
    assert all(len(got.rates[busy][c]) == busy and min(got.rates[busy][c]) > 0
               for busy in (1, 2) for c in OP_CLASSES)
    assert sorted(got.pair_calls) == [2] and got.baseline_rss_bytes > 0


def test_calibrate_writes_the_curves_and_prints_the_step_check(tmp_path, monkeypatch, capsys):
    """The command end to end on synthetic measurements: the profile it writes carries the
    curves, and the summary sets the step with R processes at once beside its price."""
    import json

    from csbp.runtime.calibration import calibrate
    from csbp.simulator.commands.cli import main

    m = _sharing_measurements()
    m.step_load, m.probe = {2: 0.2, 4: 0.5}, (0.1, 0.1)
    monkeypatch.setattr(calibrate, "measure", lambda quick, step: m)
    out = tmp_path / "sharing.yaml"
    assert main(["calibrate", "--out", str(out), "--name", "sharing"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "R = 2 200 /" in text and "R = 4 500 /" in text
    assert load_profile(str(out)).node.rank_speed is not None
    assert main(["calibrate", "--out", str(out), "--name", "sharing", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["ranks"] for r in got["sharing_check"]] == [1, 2, 4]


def test_rounds_alternate_so_every_rank_count_meets_the_start_and_the_end():
    """A drifting host biases a ratio to R = 1 when R = 1 is always measured first: the rounds
    alternate (ABBA), so over two rounds every R has the same mean position in time."""
    from csbp.runtime.calibration.rank_sharing import round_orders

    orders = round_orders(4, 3)
    assert orders == [[1, 2, 3, 4], [4, 3, 2, 1], [1, 2, 3, 4]]
    two = round_orders(4, 2)
    mean_slot = {r: sum(o.index(r) for o in two) / 2 for r in range(1, 5)}
    assert len(set(mean_slot.values())) == 1  # 1.5 for every R
    assert round_orders(3, 0) == [[1, 2, 3]]  # at least one round


# attention at a call 8 times larger shares worse (the issue-26 host: a large call slowed more
# beside the other ranks than the small call's curve said)
LARGE = (1.0, 0.7, 0.4, 0.25)


def _sized_measurements():
    m = _sharing_measurements()
    for r in (1, 2, 3, 4):
        m.rank_rates[r]["attention-large"] = [3.0 * LARGE[r - 1]] * r
    return m


@pytest.mark.floats
def test_a_class_measured_at_two_call_sizes_is_read_between_them(tmp_path):
    import yaml

    from csbp.runtime.calibration.rank_sharing import ATTENTION_CALL, ATTENTION_LARGE_CALL, call_elements

    raw = fit_profile(_sized_measurements(), "synthetic")
    path = tmp_path / "sized.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False, width=100, default_flow_style=None))
    node = load_profile(str(path)).node  # written and read back as `csbp calibrate` does
    small, large = call_elements(ATTENTION_CALL), call_elements(ATTENTION_LARGE_CALL)
    assert sorted(node.rank_speed_by_size["attention"]) == [small, large]
    assert "attention-large" not in node.rank_speed  # a measurement, not a class of its own
    # each measured size reads its own curve (4 significant digits: 1e-3) ...
    assert node.rank_share("attention", 4, small) == pytest.approx(SPEED["attention"][3], rel=1e-3)
    assert node.rank_share("attention", 4, large) == pytest.approx(LARGE[3], rel=1e-3)
    # ... a call between them is read in log size, past them held at the ends
    mid = (small * large) ** 0.5
    assert node.rank_share("attention", 4, mid) == pytest.approx((SPEED["attention"][3] + LARGE[3]) / 2, rel=1e-3)
    assert node.rank_share("attention", 4, large * 10) == pytest.approx(LARGE[3], rel=1e-3)
    # no size (or another class): the class's one curve as before
    assert node.rank_share("attention", 4) == pytest.approx(SPEED["attention"][3], rel=1e-3)


@pytest.mark.floats
def test_a_large_attention_call_is_priced_on_the_large_curve():
    host = HardwareProfile.model_validate(fit_profile(_sized_measurements(), "synthetic"))
    from csbp.runtime.calibration.rank_sharing import ATTENTION_LARGE_CALL, call_elements

    head_dim = 64
    elements = call_elements(ATTENTION_LARGE_CALL)
    dense = 4.0 * head_dim * elements  # the graph's forward rectangle FLOPs (attention_ops)
    work = Compute("attention-fwd", (dense / 2,), (0.0,), tile_len=(1024.0,), dense_flops=(dense,),
                   head_dim=head_dim)
    alone, four = compute_seconds(work, host.on_one_host(1))[0], compute_seconds(work, host.on_one_host(4))[0]
    overhead = host.gpu.op_overhead_us * 1e-6
    want = (alone - overhead) / LARGE[3] + overhead / SPEED["host"][3]
    assert four == pytest.approx(want, rel=1e-3)  # the fitted curves' 4 significant digits
