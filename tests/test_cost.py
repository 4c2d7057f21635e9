"""Cost model: each formula against its definition, on the shipped H200 profile."""

import numpy as np
import pytest

from csbp.simulator.cost.cost import along, collective_seconds, comm_seconds, compute_seconds, seconds
from csbp.simulator.cost.graph import Comm, Compute, Group
from csbp.simulator.system.hardware import interpolate, load_profile

pytestmark = pytest.mark.floats  # float results of numeric kernels: re-run under baseline kernels in CI


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200")


def inside(n):
    return Group(n, n, ((0,),))


def test_gemm_is_flops_over_peak_times_efficiency_of_one_call(h200):
    flops = 4e12
    one = compute_seconds(Compute("gemm", (flops,), (0.0,), kernels=1), h200)[0]
    assert one == pytest.approx(flops / (h200.gpu.peak_tflops * 1e12 * h200.gemm_efficiency(flops / 1e9)))
    many = compute_seconds(Compute("gemm", (flops,), (0.0,), kernels=4000), h200)[0]
    assert many > one  # the same FLOPs in small calls run less efficiently


def test_memory_bound_ops_use_hbm_bandwidth(h200):
    nbytes = 48e9
    t = compute_seconds(Compute("elementwise", (0.0,), (nbytes,)), h200)[0]
    assert t == pytest.approx(nbytes / (h200.gpu.hbm_gbs * 1e9 * h200.gpu.hbm_efficiency))


def test_attention_reads_the_tile_curve_and_masked_factor(h200):
    def t(tile, masked=False, kind="attention-fwd"):
        return compute_seconds(Compute(kind, (1e15,), (0.0,), 1, (tile,), masked), h200)[0]

    assert t(8192) == pytest.approx(1e15 / (h200.gpu.peak_tflops * 1e12 * h200.attention_efficiency(8192, False)))
    assert t(512) > t(8192)  # short tiles run further from peak
    assert t(8192, masked=True) == pytest.approx(t(8192) / h200.gpu.masked_attention_efficiency_factor)
    assert t(8192, kind="attention-bwd") == pytest.approx(
        1e15 / (h200.gpu.peak_tflops * 1e12 * h200.attention_efficiency(8192, True)))


def test_dense_attention_profiles_price_the_whole_rectangle(h200):
    work = Compute("attention-fwd", (1e12,), (0.0,), 1, (4096.0,), False, (3e12,))
    dense = h200.model_copy(update={"gpu": h200.gpu.model_copy(update={"dense_attention": True})})
    assert compute_seconds(work, dense)[0] == pytest.approx(3 * compute_seconds(work, h200)[0])


def test_ring_all_gather_alpha_beta_inside_a_node(h200):
    nvl, n, recv = h200.links.nvlink, 8, 7 * 2**26
    work = Comm("all-gather", (recv,), inside(n), "attention-kv")
    expect = (nvl.call_latency_us + (n - 1) * nvl.step_latency_us) * 1e-6 + recv / (
        nvl.collective_gbs * 1e9 * nvl.bandwidth_fraction(recv / (n - 1)))
    assert collective_seconds(work, recv, h200) == pytest.approx(expect)


def test_all_reduce_is_two_passes(h200):
    n, buffer = 8, 2**30
    rs = Comm("reduce-scatter", (buffer * (n - 1) / n,), inside(n), "gradients")
    ar = Comm("all-reduce", (2 * buffer * (n - 1) / n,), inside(n), "gradients")
    # not exactly 2x: one call's base latency is paid once by the all-reduce and twice by two
    # reduce-scatters (0.2 % of 1 GiB's ~5 ms on NVLink); 5 % is the bound this test holds the
    # two-pass model to, a modelling margin, not rounding
    assert seconds(ar, h200)[0] == pytest.approx(2 * seconds(rs, h200)[0], rel=0.05)


def test_groups_spanning_nodes_are_priced_on_infiniband(h200):
    recv = 2**30
    inside_node = seconds(Comm("all-gather", (recv,), Group(16, 16, ((0,),)), "gradients"), h200)[0]
    eight_per_node = seconds(Comm("all-gather", (recv,), Group(16, 8, ((0,),)), "gradients"), h200)[0]
    one_per_node = seconds(Comm("all-gather", (recv,), Group(16, 1, ((0,),)), "gradients"), h200)[0]
    assert inside_node < eight_per_node < one_per_node
    ib = h200.links.infiniband
    assert one_per_node > recv / (ib.collective_gbs * 1e9)  # one NIC per member
    # eight members per node use eight NICs: close to NVLink speed (hardware.md 3.3)
    assert eight_per_node < 2 * inside_node


def test_p2p_is_priced_separately_and_slower_than_a_ring(h200):
    recv = 2**28
    p2p = seconds(Comm("p2p", (recv,), Group(2, 2, ((0,),)), "attention-kv", (0,)), h200)[0]
    nvl = h200.links.nvlink
    assert p2p == pytest.approx(nvl.p2p_latency_us * 1e-6 + recv / (nvl.p2p_gbs * 1e9 * nvl.bandwidth_fraction(recv)))
    ring = seconds(Comm("all-gather", (recv,), inside(2), "attention-kv"), h200)[0]
    assert p2p > ring


def test_all_to_all_across_nodes_runs_at_one_nic(h200):
    recv = 2**30
    across = seconds(Comm("all-to-all", (recv,), Group(16, 1, ((0,),)), "ep"), h200)[0]
    ib = h200.links.infiniband
    assert across == pytest.approx(ib.call_latency_us * 1e-6 + recv / (ib.alltoall_gbs * 1e9 * ib.bandwidth_fraction(recv / 15)))
    assert seconds(Comm("all-to-all", (recv,), inside(8), "ep"), h200)[0] < across


def test_a_collective_lasts_as_long_as_its_slowest_member(h200):
    work = Comm("all-to-all", (1e6, 4e8, 2e7, 3e7), Group(4, 4, ((0, 1), (2, 3))), "attention-kv")
    t = comm_seconds(work, h200)
    own = [collective_seconds(work, b, h200) for b in work.bytes]
    assert t[0] == t[1] == pytest.approx(max(own[:2]))
    assert t[2] == t[3] == pytest.approx(max(own[2:]))


def test_cpu_host_profile_adds_per_op_overhead_and_core_share():
    measured = load_profile("cpu-measured").on_one_host(4)
    # a profile without measured sharing curves (rank_speed): one core share for everything
    cpu = measured.model_copy(update={"node": measured.node.model_copy(update={"rank_speed": None})})
    work = Compute("elementwise", (0.0, 0.0), (1e6, 0.0))
    t = compute_seconds(work, cpu)
    base = 1e6 / (cpu.gpu.hbm_gbs * 1e9 * cpu.gpu.hbm_efficiency)
    # host overhead is CPU time too: it shares the cores like the arithmetic
    assert t[0] == pytest.approx((base + cpu.gpu.op_overhead_us * 1e-6) / cpu.node.core_share(4))
    if measured.node.rank_speed:  # with curves: memory-bound work and host time each by its own
        t = compute_seconds(work, measured)
        assert t[0] == pytest.approx(base / measured.node.rank_share("memory", 4)
                                     + cpu.gpu.op_overhead_us * 1e-6 / measured.node.rank_share("host", 4))
    assert t[1] == 0.0  # no work, no op
    assert np.all(t >= 0)


def test_curves_read_at_once_equal_the_scalar_reads():
    """`along` (every rank's efficiency in one call) gives the scalar `interpolate`, bit for bit.

    Exact equality is allowed here because `along` is the scalar read applied per element (one
    code path): a vectorised log10 would round differently on CPUs with AVX-512 loops."""
    x = np.concatenate([np.exp(np.random.default_rng(1).uniform(-12, 25, 5000)),
                        [0.0, 1e-3, 0.01, 1, 16, 128, 128.0000001, 8192, 1e9]])
    for name in ("h200", "h100", "cpu-measured"):
        gpu = load_profile(name).gpu
        for curve in (gpu.gemm_efficiency, gpu.attention_forward_efficiency, ((5.0, 0.5),)):
            for factor in (1.0, 0.8):
                want = [interpolate(curve, v) * factor if v else 1.0 for v in x.tolist()]
                assert along(curve, x, factor).tolist() == want
    assert along(((5.0, 0.5),), np.zeros((2, 3))).shape == (2, 3)  # keeps the ranks' shape
