"""Implementation profiles: each mechanism priced as the profile says (issue 13)."""

import json
import random

import numpy as np
import pytest

from csbp.simulator.layout import kv_rows, mask
from csbp.simulator.cost.cost import GB, seconds
from csbp.simulator.engine import program, simulate_graph
from csbp.simulator.errors import InputError
from csbp.simulator.cost.graph import Compute, StepGraph
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.system.implementation import Implementation, load_implementation
from csbp.simulator.layout.layout import Layout, kv_row_bytes
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.layout.tiles import tile_counts
from csbp.simulator.workload.workload import Workload

M8 = load_model("nemotron-diffusion-8b")
K64 = 64 * 1024


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200")


def graph(plan, impl, seq_len=K64, model=M8, **kw):
    w = Workload(seq_len=seq_len, **kw)
    return StepGraph.build(model, w, plan, Layout.build(w, plan), 8, implementation=impl)


def one(g, name, layer=3, phase="forward"):
    return next(op for op in g.ops if op.name == name and op.layer == layer and op.phase == phase)


def test_shipped_profiles_load_with_a_source_for_every_fact():
    for name in ("turbo-dllm", "ideal", "csbp-runtime"):
        impl = load_implementation(name)
        assert impl.sources and all(s.strip() for s in impl.sources.values())
    turbo = load_implementation("turbo-dllm")
    cp = turbo.family("cp", "collective")
    assert cp.forward.kernel("attn") == "flex-triton" and cp.backward.kernel("attn") == "fa4"
    assert cp.forward.exchange == "immediate" and cp.forward.pad_to_largest_shard
    assert turbo.family("csbp", "collective").forward.packs("prefix")


@pytest.mark.floats
def test_a_flex_call_costs_the_profiles_ratio_more_than_fa3(h200):
    base = Compute("attention-fwd", (4e12,), (0.0,), 1, (4096.0,), False, (8e12,), "fa3",
                   (3e12,), (1e12,))
    flex = Compute("attention-fwd", (4e12,), (0.0,), 1, (4096.0,), False, (8e12,), "flex-triton",
                   (3e12,), (1e12,))
    ratio = seconds(flex, h200)[0] / seconds(base, h200)[0]
    kernels = h200.gpu.attention_kernels
    assert ratio == pytest.approx(kernels["fa3"].forward_factor / kernels["flex-triton"].forward_factor)
    # a partial tile costs a whole tile plus the mask
    partial = Compute("attention-fwd", (4e12,), (0.0,), 1, (4096.0,), False, (8e12,), "fa3", (3e12,), (2e12,))
    extra = seconds(partial, h200)[0] - seconds(base, h200)[0]
    assert extra == pytest.approx(seconds(base, h200)[0] * (1e12 / h200.gpu.masked_attention_efficiency_factor)
                                  / (3e12 + 1e12 / h200.gpu.masked_attention_efficiency_factor))


def test_unknown_kernel_family_is_one_line(h200):
    with pytest.raises(InputError, match="lists no attention kernel 'nope'"):
        h200.gpu.kernel_factor("nope", False)


def _with_exchange(kind: str) -> Implementation:
    fact = lambda v: {"value": v, "source": "test"}  # noqa: E731
    passes = {"split": fact("noisy-prefix"), "kernels": fact({"default": "fa3"}), "exchange": fact(kind)}
    return Implementation.model_validate({"name": f"test-{kind}", "notes": "test",
                                          "families": {"csbp": {"forward": passes, "backward": passes}}})


@pytest.mark.floats
def test_a_waited_collective_adds_its_time_an_overlapped_one_only_its_exposed_part(h200):
    plan = Plan(dp=2, cp=8, bp=8)
    times = {}
    for kind in ("immediate", "overlapped"):
        g = graph(plan, _with_exchange(kind))
        t, d = simulate_graph(g, h200, "des")
        gather, block = one(g, "kv.gather"), one(g, "attn.noisy-block")
        times[kind] = (t.start[gather.index], t.finish[gather.index], t.start[block.index], t.step_time_s)
    g0, g1, b, _ = times["immediate"]
    assert (b >= g1).all()  # waited on: the noisy blocks start once the gather has ended
    g0, g1, b, _ = times["overlapped"]
    assert (b < g1).all()  # overlapped: they run while it does
    assert times["overlapped"][3] < times["immediate"][3]


@pytest.mark.floats
def test_interference_stretches_overlapped_compute_by_the_profile_factor():
    f = 1.25
    begin, took, until = np.array([0.0]), np.array([1.0]), np.array([2.0])

    def end(until):  # the engine's arguments: took x f (all beside a transfer), 1 - 1/f
        return program._stretched(begin, took, took * f, until, 1 - 1 / f)[0]

    assert end(until) == pytest.approx(1.25)  # wholly beside
    assert end(np.array([0.5])) == pytest.approx(0.5 + (1 - 0.5 / f))  # 0.5 s beside, then the rest
    assert end(np.array([0.0])) == 1.0  # nothing beside it


@pytest.mark.floats
def test_interference_in_the_step_follows_the_sm_share(h200):
    g = graph(Plan(cp=8), "ideal", seq_len=4 * K64)  # local attention beside the K/V gather
    slow, _ = simulate_graph(g, h200, "des")
    gpu = h200.gpu.model_copy(update={"comm_sm_share": None, "comm_hbm_traffic_ratio": None})
    quiet, _ = simulate_graph(g, h200.model_copy(update={"gpu": gpu}), "des")
    assert slow.step_time_s > quiet.step_time_s
    assert h200.overlap_slowdown(False) == pytest.approx(1 / (1 - 0.15))
    r = simulate(M8, Workload(seq_len=K64), Plan(dp=2, cp=8, bp=8), h200, 2)
    assert r.stretched_compute_s > 0 and r.exposed_comm_s >= 0
    assert r.step_time_s == pytest.approx(sum(r.phases_s.values()), rel=1e-6)  # regrouped sums


@pytest.mark.floats
def test_copies_add_their_bytes_at_hbm_speed(h200):
    plan = Plan(dp=2, cp=8)
    g = graph(plan, "turbo-dllm")
    lay = Layout.build(Workload(seq_len=K64), plan)
    a = M8.layers[3]
    rows = kv_rows.held(lay, "positions") + kv_rows.received(lay, a, "forward")
    assert (rows == 2 * K64).all()  # CP's call reads the whole 2L
    copy = one(g, "kv.reorder")
    expected = 1.0 * 2 * rows * kv_row_bytes(a, 2, 1)
    assert np.allclose(copy.work.bytes, expected)
    s = seconds(copy.work, h200)
    assert np.allclose(s, expected / (h200.gpu.hbm_gbs * GB * h200.gpu.hbm_efficiency))
    back = one(g, "dkv.copies", phase="backward")
    assert np.allclose(back.work.bytes, 3.0 * 2 * rows * kv_row_bytes(a, 2, 1))
    assert not any(op.name == "kv.reorder" for op in graph(plan, "ideal").ops)


@pytest.mark.floats
def test_padding_sizes_every_member_by_the_largest_shard():
    plan = Plan(cp=3)
    w = Workload(seq_len=256 * 5, block_size=256)
    lay = Layout.build(w, plan)
    owned = kv_rows.owned_rows(lay)
    g = StepGraph.build(M8, w, plan, lay, 8, implementation="turbo-dllm")
    gather = one(g, "kv.gather")
    assert np.allclose(gather.work.bytes, 2 * owned.max() * kv_row_bytes(M8.layers[3], 2, 1))


@pytest.mark.parametrize("plan", [Plan(dp=2, cp=8), Plan(dp=2, cp=8, bp=8), Plan(cp=4, bp=16),
                                  Plan(bp=16), Plan(dp=2, cp=8, transport="ring"), Plan(dp=16)])
@pytest.mark.floats
def test_ideal_is_never_slower_than_turbo(plan, h200):
    qwen = load_model("qwen3.5-27b")
    for model, seq_len, objective in ((M8, K64, "bd3lm"), (M8, 4 * K64, "bd3lm"), (qwen, 2 * K64, "fast-dllm-v2")):
        w = Workload(seq_len=seq_len, objective=objective)
        p = plan.model_copy(update={"tp": 2, "dp": max(1, plan.dp // 2)}) if model is qwen and plan.world >= 16 \
            and plan.dp >= 2 else plan
        r = {impl: simulate(model, w, p, h200.model_copy(update={"implementation": impl}), 2)
             for impl in ("ideal", "turbo-dllm")}
        # 1e-9: two graphs whose shared ops sum in other orders (~1e4 additions, ~1e-12)
        assert r["ideal"].step_time_s <= r["turbo-dllm"].step_time_s * (1 + 1e-9), (model.name, p.label())


@pytest.mark.parametrize("name,plan,hardware,nodes", [
    ("diffusiongemma-26b-a4b", Plan(ep=2, cp=8, bp=8), "h200", 2),
    ("diffusiongemma-26b-a4b", Plan(ep=2, cp=8), "h200", 2),
    ("diffusiongemma-26b-a4b", Plan(ep=2, bp=8), "h200", 2),
    ("qwen3.8-27b", Plan(tp=2, cp=8), "h200", 2),
    ("dflash2-qwen3.8-27b", Plan(cp=8, bp=8), "h100", 1),
    ("dflash2-qwen3.8-27b", Plan(dp=8), "h100", 1),
])
@pytest.mark.floats
def test_ideal_is_never_slower_than_turbo_on_moe_hybrid_and_drafters(name, plan, hardware, nodes):
    """Every section of the ideal profile (optimizer, loss, TP, MoE, linear attention, head-dim
    copies, attention) is the faster choice: also under EP, TP and a drafter's own optimizer."""
    from csbp.simulator.workload.objectives import default_objective
    model, prof = load_model(name), load_profile(hardware)
    extra = dict(block_size=8, max_anchors=512, checkpointing="none") if name.startswith("dflash2") else {}
    w = Workload(seq_len=K64, objective=default_objective(model), **extra)
    r = {impl: simulate(model, w, plan, prof.model_copy(update={"implementation": impl}), nodes, with_trace=False)
         for impl in ("ideal", "turbo-dllm")}
    # 1e-9: two graphs whose shared ops sum in other orders (~1e4 additions, ~1e-12)
    assert r["ideal"].step_time_s <= r["turbo-dllm"].step_time_s * (1 + 1e-9)


def test_noisy_prefix_split_is_csbp_only():
    fact = lambda v: {"value": v, "source": "test"}  # noqa: E731
    with pytest.raises(ValueError, match="csbp only"):
        Implementation.model_validate({"name": "x", "notes": "x", "families": {
            "cp": {"forward": {"split": fact("noisy-prefix")}}}})


@pytest.mark.floats
def test_cp_gains_most_from_the_implementation_csbp_from_the_method(h200):
    """Under turbo-dllm CP pays Flex, waits and copies; under ideal only the method differs."""
    w = Workload(seq_len=4 * K64)
    step = {(impl, p.kind): simulate(M8, w, p, h200.model_copy(update={"implementation": impl}), 2).step_time_s
            for impl in ("ideal", "turbo-dllm") for p in (Plan(dp=2, cp=8), Plan(dp=2, cp=8, bp=8))}
    assert step[("turbo-dllm", "cp")] / step[("ideal", "cp")] > 1.2
    assert step[("turbo-dllm", "csbp")] / step[("ideal", "csbp")] < 1.05


def _brute_tiles(queries, keys, L, b, w, qr, kt):
    kset = np.zeros(2 * L, bool)
    for a, z in keys:
        kset[a:z] = True
    full = part = 0
    positions = np.sort(mask.span_positions(queries)) if queries else np.zeros(0, int)
    for side in (positions[positions < L], positions[positions >= L]):  # the packed query buffer
        for s in range(0, side.size, qr):
            q = side[s:s + qr]
            if True:
                for t in range(0, 2 * L, kt):
                    k = np.arange(t, min(t + kt, 2 * L))
                    vis = mask.visible(q[:, None], k[None, :], L, b, w) & kset[k][None, :]
                    full += bool(vis.all())
                    part += bool(vis.any() and not vis.all())
    return full, part


def _spans(rng, L):
    p = sorted(rng.sample(range(2 * L + 1), 4))
    return tuple(s for s in ((p[0], p[1]), (p[2], p[3])) if s[1] > s[0])


def test_tile_counts_equal_the_mask_tile_by_tile():
    """Exact wherever a tile's queries are consecutive; where a tile packs queries of distant
    blocks, full tiles stay exact and touched ones may count gap tiles (checked below)."""
    rng = random.Random(0)
    checked = 0
    while checked < 150:
        L, b = rng.choice([16, 32, 48]), rng.choice([1, 2, 4, 8, 16])
        if L % b:
            continue
        q, k = _spans(rng, L), _spans(rng, L)
        qr, kt = rng.choice([1, 2, 4, 8]), rng.choice([2, 4, 8])
        got, exp = tile_counts(q, k, L, b, None, qr, kt), _brute_tiles(q, k, L, b, None, qr, kt)
        assert got[0] == exp[0] and got[1] >= exp[1]
        contiguous = all((z - a) % qr == 0 for a, z in q[:-1]) and all(not (a < L < z) for a, z in q)
        if contiguous:
            assert got == exp
        checked += 1


def test_windowed_full_tiles_are_exact():
    rng = random.Random(1)
    for _ in range(80):
        L, b, w = 32, rng.choice([2, 4, 8]), rng.choice([3, 7, 20])
        q = ((rng.randrange(0, 30), 60),)
        k = ((0, 64),)
        got, exp = tile_counts(q, k, L, b, w, 4, 4), _brute_tiles(q, k, L, b, w, 4, 4)
        assert got[0] == exp[0] and got[1] >= exp[1]


def test_simulate_command_reports_the_implementation(capsys):
    from csbp.simulator.commands.cli import main

    rc = main(["simulate", "--plan", "dp=2,cp=8", "--seq-len", "64k", "--implementation", "ideal", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["implementation"] == "ideal" and "stretched_compute_s" in out
    rc = main(["simulate", "--plan", "dp=2,cp=8", "--seq-len", "64k", "--implementation", "nope"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "unknown implementation 'nope'" in err[0]


def test_placement_is_searched_where_it_changes_groups():
    from csbp.simulator.planner.planner import STRIPED_PLACEMENT, enumerate_space

    w = Workload(seq_len=K64)
    two = enumerate_space(M8, w, 16, ("full",), gpus_per_node=8).candidates
    striped = {c.plan.label() for c in two if c.plan.placement == STRIPED_PLACEMENT}
    assert "dp=2,cp=8,bp=8" in striped and "dp=16" not in striped and "cp=16,bp=16" not in striped
    one = enumerate_space(M8, w, 8, ("full",), gpus_per_node=8).candidates
    assert all(c.plan.placement != STRIPED_PLACEMENT for c in one)  # one node: nothing to choose


@pytest.mark.floats
def test_striped_context_group_moves_kv_across_nodes(h200):
    from csbp.simulator.planner.planner import STRIPED_PLACEMENT

    w = Workload(seq_len=4 * K64)
    inside = simulate(M8, w, Plan(dp=2, cp=8), h200, 2)
    striped = simulate(M8, w, Plan(dp=2, cp=8, placement=STRIPED_PLACEMENT), h200, 2)
    assert striped.step_time_s > inside.step_time_s  # K/V over InfiniBand instead of NVLink


@pytest.mark.floats
def test_plan_json_carries_speedup_by_implementation(capsys):
    from csbp.simulator.commands.cli import main

    rc = main(["plan", "--seq-len", "64k", "--nodes", "1", "--top", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    by = out["speedup_by_implementation"]
    assert rc == 0 and set(by) == {"ideal", "turbo-dllm"} and out["implementation"] == "turbo-dllm"
    assert by["turbo-dllm"] == pytest.approx(out["speedup"])
    assert all(v is None or v > 0 for v in by.values())
