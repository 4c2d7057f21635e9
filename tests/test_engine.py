"""Step graph and engines: mechanisms, agreement of the closed form with the DES, every preset."""

import json
import time

import numpy as np
import pytest

from csbp.simulator.workload.objectives import default_objective
from csbp.simulator.engine import simulate_graph, summarize
from csbp.simulator.errors import InputError
from csbp.simulator.cost.graph import Comm, Compute, StepGraph, group_on_nodes, pairs_with_keys
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.layout import mask
from csbp.simulator.layout.layout import Layout, attention_bytes_received
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.presets import PRESET_NAMES, load_model
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.report.trace import write_trace
from csbp.simulator.workload.workload import Workload

K64, K256 = 64 * 1024, 256 * 1024
M8 = load_model("nemotron-diffusion-8b")
GEMMA = load_model("diffusiongemma-26b-a4b")
QWEN = load_model("qwen3.5-27b")


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200")


def graph(model, plan, seq_len=K64, gpn=8, implementation="ideal", **kw):
    """The step graph under `ideal` by default: these tests pin the method's mechanisms (what an
    implementation changes is pinned in test_implementation.py)."""
    w = Workload(seq_len=seq_len, **kw)
    return StepGraph.build(model, w, plan, Layout.build(w, plan), gpn, implementation=implementation)


ENGINE_CASES = [
    ("cp", M8, Plan(cp=16), {}),
    ("csbp", M8, Plan(cp=8, bp=16), {}),
    ("csbp-dp", M8, Plan(dp=2, cp=8, bp=8), {}),
    ("pure-bp", M8, Plan(bp=16), {}),
    ("dp", load_model("nemotron-diffusion-3b"), Plan(dp=16), {"seq_len": 4096}),
    ("tp", M8, Plan(dp=2, tp=8), {}),
    ("ep", GEMMA, Plan(ep=2, cp=4, bp=8), {}),
    ("ring", M8, Plan(cp=8, dp=2, transport="ring"), {}),
    ("linear", QWEN, Plan(cp=4, bp=8, dp=2), {"objective": "fast-dllm-v2"}),
    ("zero3", M8, Plan(cp=8, bp=16), {"zero_stage": 3}),
    ("zero0-none", M8, Plan(cp=16), {"zero_stage": 0, "checkpointing": "none"}),
]


@pytest.mark.floats
@pytest.mark.parametrize("name,model,plan,kw", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_one_pass_is_the_event_queue_bit_for_bit(name, model, plan, kw, h200):
    """The event engine's one pass over the program gives the simpy event queue's timeline.

    Two code paths held bit for bit on purpose: both compute every start and finish with the same
    IEEE operations (max, +, the stretch's * and /) on the same durations in the same order
    (np.cumsum accumulates op after op), which round alike on every CPU; nothing here goes
    through a transcendental function or a reduction whose order a library picks."""
    from csbp.simulator.engine import des, durations, program

    g = graph(model, plan, **{"seq_len": 16 * 1024, **kw})
    d = durations(g, h200)
    for overlap in (True, False):  # every layer walked (repeats: a shift, equal up to rounding)
        fast = program.run(g, d, overlap, queue_comm=True, repeats=False)
        events = des.run_events(g, d, overlap)
        assert np.array_equal(fast[0], events.start) and np.array_equal(fast[1], events.finish)


REPEAT_CASES = [("csbp-ring", M8, Plan(dp=2, cp=32, bp=32, transport="ring"), "turbo-dllm"),
                ("cp-ring", M8, Plan(cp=16, transport="ring"), "turbo-dllm"),
                ("ep-ring", GEMMA, Plan(ep=2, cp=8, bp=8, transport="ring"), "turbo-dllm"),
                ("csbp-short-layers", GEMMA, Plan(dp=4, cp=4, bp=4), "turbo-dllm"),  # 14-15 ops a layer
                # no rank waits for another inside a layer: the two ranks drift apart, each
                # layer shifted by a time per rank
                ("bp-drift", M8, Plan(dp=4, tp=2, bp=2), "turbo-dllm")]


@pytest.mark.floats
@pytest.mark.parametrize("name,model,plan,impl", REPEAT_CASES, ids=[c[0] for c in REPEAT_CASES])
def test_repeated_layers_are_the_walked_ones_shifted(name, model, plan, impl, h200, monkeypatch):
    """A stamped layer that enters as an earlier one did, shifted, is timed as that one shifted
    (`program._Repeats`): both engines, with and without interference, every op's start and
    finish within rel 1e-9 of the step of the walk that times every layer. Basis: each repeated
    layer moves its times by at most REPEAT_TOLERANCE (1e-12) of the step plus rounding, not
    compounding (each is shifted from a walked one), over < 200 layers and passes: <= 2e-10."""
    from csbp.simulator.engine import durations, program, stretch

    g = graph(model, plan, seq_len=K256, implementation=impl)
    hits = []
    made = program._Repeats

    class Counted(made):
        def __init__(self, *args):
            super().__init__(*args)
            hits.append(self)

    monkeypatch.setattr(program, "_Repeats", Counted)
    for profile in (h200, without_interference(h200)):
        d, s = durations(g, profile), stretch(g, profile)
        for queue_comm in (True, False):
            walked = program.run(g, d, True, queue_comm, s, repeats=False)
            repeated = program.run(g, d, True, queue_comm, s)
            step = walked[1].max()
            for a, b in zip(walked, repeated):
                assert np.abs(a - b).max() <= 1e-9 * step
    assert sum(r.hits for r in hits) > 0  # the shortcut was taken (else this tests nothing)
    if name == "bp-drift":  # and its per-rank form
        assert sum(r.drifted for r in hits) > 0


@pytest.mark.floats
@pytest.mark.parametrize("name,model,plan,kw", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_chains_are_timed_as_single_ops(name, model, plan, kw, h200, monkeypatch):
    """Ops timed as a chain from its first op (`program.chained_ops`) get the times each would
    get on its own, interference included: a transfer issued between two of them may run beside
    the later one, so a chain ends there. Rel 1e-12 of the step: the same additions and maxima
    in the same order (equal today); the stretch's product and division rounding alike."""
    from csbp.simulator.engine import durations, program, stretch

    g = graph(model, plan, **{"seq_len": 16 * 1024, **kw})
    d, s = durations(g, h200), stretch(g, h200)
    chained = {q: program.run(g, d, True, q, s, repeats=False) for q in (True, False)}
    monkeypatch.setattr(program, "chained_ops", lambda *args, **kw: {})
    g._arrays.clear()
    for q, (start, finish) in chained.items():
        single = program.run(g, d, True, q, s, repeats=False)
        assert np.abs(single[0] - start).max() <= 1e-12 * finish.max()
        assert np.abs(single[1] - finish).max() <= 1e-12 * finish.max()


@pytest.mark.floats
@pytest.mark.parametrize("name,model,plan,kw", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_closed_form_agrees_with_des_without_overlap(name, model, plan, kw, h200):
    g = graph(model, plan, **kw)
    des, _ = simulate_graph(g, h200, "des", overlap=False)
    cf, _ = simulate_graph(g, h200, "closed-form", overlap=False)
    # without overlap a transfer holds its rank like a compute op, so there is nothing to queue
    # behind: both engines run the same program (engine/program.py) and differ by rounding at
    # most, a relative 1e-9 covering ~1e4 additions of a step a thousandfold (they agree exactly
    # today)
    assert cf.step_time_s == pytest.approx(des.step_time_s, rel=1e-9)
    on_des, _ = simulate_graph(g, h200, "des", overlap=True)
    on_cf, _ = simulate_graph(g, h200, "closed-form", overlap=True)
    # inequalities between runs that sum the same durations in other orders: a relative 1e-9
    # covers the rounding of the ~1e4 additions of a step (1e4 x 1.1e-16 ~ 1e-12) a thousandfold
    assert on_des.step_time_s <= des.step_time_s * (1 + 1e-9)  # overlap never slows a step
    assert on_cf.step_time_s <= cf.step_time_s * (1 + 1e-9)
    # the DES adds queueing only, when transfers do not slow compute beside them (with
    # interference the closed form, overlapping more, also stretches more compute)
    quiet = without_interference(h200)
    q_des, _ = simulate_graph(g, quiet, "des", overlap=True)
    q_cf, _ = simulate_graph(g, quiet, "closed-form", overlap=True)
    assert q_cf.step_time_s <= q_des.step_time_s * (1 + 1e-9)
    assert on_des.step_time_s >= q_des.step_time_s * (1 - 1e-9)  # interference only slows


def without_interference(profile):
    gpu = profile.gpu.model_copy(update={"comm_sm_share": None, "comm_hbm_traffic_ratio": None})
    return profile.model_copy(update={"gpu": gpu})


@pytest.mark.floats
def test_phases_and_exposed_communication_add_up(h200):
    r = simulate(M8, Workload(seq_len=K256), Plan(dp=2, cp=8), h200, nodes=2)
    # rel 1e-6 (pytest.approx's default): phases are the step's time regrouped, summed in another
    # order; their rounding is ~1e-12 of the step (tests/README.md)
    assert sum(r.phases_s.values()) == pytest.approx(r.step_time_s, rel=1e-6)
    assert 0 <= r.exposed_comm_s < r.step_time_s
    off = simulate(M8, Workload(seq_len=K256), Plan(dp=2, cp=8), h200, nodes=2, overlap=False)
    assert off.exposed_comm_s > r.exposed_comm_s
    assert r.tokens_per_s == pytest.approx(K256 * 2 / r.step_time_s)
    assert 0 < r.mfu < 1


@pytest.mark.floats
def test_csbp_moves_half_the_attention_bytes_of_cp(h200):
    cp = simulate(M8, Workload(seq_len=K256), Plan(dp=2, cp=8), h200, nodes=2)
    csbp = simulate(M8, Workload(seq_len=K256), Plan(dp=2, cp=8, bp=8), h200, nodes=2)
    assert csbp.attention_traffic_gib_per_gpu == pytest.approx(cp.attention_traffic_gib_per_gpu / 2)
    for r in (cp, csbp):
        assert r.comm_gib_per_gpu["attention-kv"] == pytest.approx(r.attention_traffic_gib_per_gpu)


@pytest.mark.parametrize("model,plan", [(M8, Plan(cp=16)), (M8, Plan(cp=4, bp=16)),
                                        (M8, Plan(cp=8, transport="ring", dp=2)),
                                        (GEMMA, Plan(cp=4, bp=8, ep=2)), (GEMMA, Plan(cp=8, dp=2)),
                                        (M8, Plan(cp=8, bp=8, tp=2))])
@pytest.mark.floats
def test_graph_kv_bytes_are_the_layouts(model, plan):
    """Every attention K/V byte of the step graph comes from Layout.exchange, none recomputed."""
    w = Workload(seq_len=K64)
    lay = Layout.build(w, plan)
    g = StepGraph.build(model, w, plan, lay, 8)
    expect = attention_bytes_received(lay, model.layers, w.dtype_bytes, plan.tp)
    assert g.received_bytes()["attention-kv"] == pytest.approx(np.array(expect, dtype=float))


@pytest.mark.floats
def test_attention_flops_of_a_rank_match_its_pairs():
    plan = Plan(cp=4, bp=8)
    w = Workload(seq_len=K64)
    lay = Layout.build(w, plan)
    g = StepGraph.build(M8, w, plan, lay, 8)
    a = M8.layers[0]
    fwd = sum(np.array(op.work.flops) for op in g.ops
              if op.layer == 0 and op.phase == "forward" and isinstance(op.work, Compute)
              and op.work.kind == "attention-fwd")
    pairs = np.array([lay.pairs(r) for r in range(lay.size)])
    assert fwd == pytest.approx(pairs * 4 * a.head_dim * a.n_heads)
    bwd = sum(np.array(op.work.flops) for op in g.ops if op.layer == 0 and isinstance(op.work, Compute)
              and op.work.kind == "attention-bwd")
    assert bwd == pytest.approx(2.5 * fwd)


def test_kv_gather_overlaps_local_attention_and_the_rest_waits():
    g = graph(M8, Plan(cp=8, bp=8, dp=2), implementation="csbp-runtime")  # the local-remote split
    ops = [op for op in g.ops if op.layer == 3 and op.phase == "forward"]
    by_name = {op.name: op for op in ops}
    gather, local, remote = by_name["kv.gather"], by_name["attn.local"], by_name["attn.remote"]
    assert gather.index not in local.deps and gather.index in remote.deps
    back = {op.name: op for op in g.ops if op.layer == 3 and op.phase == "backward"}
    assert back["attn.remote"].index < back["attn.local"].index  # remote first, then overlap
    # dK/dV home and added into the owner's gradients before the projection
    assert back["dkv.scatter"].index in back["kv.pack"].deps
    assert back["kv.pack"].index in back["qkv-bwd"].deps
    assert back["dkv.scatter"].index not in back["attn.local"].deps
    # the LSE merge ends the forward and starts the backward of the remote part
    assert by_name["attn.remote"].index in by_name["attn.merge"].deps
    assert back["attn.merge"].index in back["attn.remote"].deps


def test_pairs_with_keys_counts_the_mask():
    w = Workload(seq_len=48, block_size=4)
    for plan in (Plan(cp=4), Plan(cp=2, bp=4), Plan(bp=3)):
        lay = Layout.build(w, plan)
        for window in (None, 5):
            for r in range(lay.size):
                keys = lay.shares[(r + 1) % lay.size].owned_kv
                q = mask.span_positions(lay.shares[r].positions)
                k = mask.span_positions(keys)
                brute = int(mask.visible(q[:, None], k[None, :], 48, 4, window).sum())
                assert pairs_with_keys(lay, r, keys, window) == brute


def test_group_node_membership_follows_placement():
    plan = Plan(dp=2, cp=8, bp=8)  # tp,ctx,ep,dp: a context group fills one node
    assert group_on_nodes(plan, 8, ("ctx",)) == (8, 8)
    assert group_on_nodes(plan, 8, ("dp", "ctx", "ep")) == (16, 8)
    moved = Plan(dp=2, cp=8, bp=8, placement="dp,tp,ctx,ep")  # dp innermost: ctx strides over nodes
    assert group_on_nodes(moved, 8, ("ctx",)) == (8, 4)
    assert group_on_nodes(Plan(cp=4, bp=8, dp=2), 8, ("ctx",), ctx_block=4) == (4, 4)


@pytest.mark.floats
def test_linear_attention_and_objectives_are_noted(h200):
    r = simulate(QWEN, Workload(seq_len=K64, objective="fast-dllm-v2"), Plan(cp=8, bp=16), h200, nodes=2)
    assert any("Ulysses" in n for n in r.notes) and any("fast-dllm-v2" in n for n in r.notes)
    assert r.comm_gib_per_gpu["other"] > 0
    one = simulate(QWEN, Workload(seq_len=K64), Plan(cp=8, bp=16), h200, nodes=2)
    assert r.attention_traffic_gib_per_gpu == pytest.approx(2 * one.attention_traffic_gib_per_gpu)
    assert r.step_time_s > 1.8 * one.step_time_s


@pytest.mark.floats
def test_trace_is_a_perfetto_document(h200, tmp_path):
    r = simulate(M8, Workload(seq_len=K64), Plan(cp=8, bp=16), h200, nodes=2)
    path = tmp_path / "step.json"
    write_trace(r, path)
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(16))
    assert {e["tid"] for e in events} == {0, 1}
    # rel 1e-6: microseconds printed by json from floats (no rounding of the digits), end = ts + dur
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(r.step_time_s * 1e6, rel=1e-6)


def test_bad_input_is_an_input_error(h200):
    with pytest.raises(InputError, match="world"):
        simulate(M8, Workload(seq_len=K64), Plan(cp=8), h200, nodes=2)
    with pytest.raises(InputError, match="engine"):
        simulate(M8, Workload(seq_len=K64), Plan(cp=16), h200, nodes=2, engine="magic")


def test_a_1024_gpu_plan_simulates_quickly(h200):
    start = time.perf_counter()
    r = simulate(M8, Workload(seq_len=K256), Plan(dp=64, cp=16), h200, nodes=128)
    assert time.perf_counter() - start < 10
    assert r.feasible and r.engine == "des" and r.gpus == 1024


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if n != "tiny"])
@pytest.mark.parametrize("seq_len", [K64, 1024 * 1024])
def test_every_preset_gives_a_result_or_a_reason(name, seq_len):
    model = load_model(name)
    drafter = name.startswith("dflash")
    profile = load_profile("h100" if drafter else "h200")
    nodes = 1 if drafter else 2
    plan = Plan(cp=4, bp=8) if drafter else Plan(cp=8, bp=16)
    if default_objective(model) == "ar":  # no noisy blocks (plan/rules.py): CP over the same GPUs
        plan = Plan(cp=16)
    r = simulate(model, Workload(seq_len=seq_len, objective=default_objective(model)), plan, profile,
                 nodes, engine="closed-form")
    assert r.step_time_s > 0 and r.peak_memory_gib > 0
    assert r.feasible == (r.reason is None)
    if not r.feasible:
        assert r.reason.startswith("infeasible: ")
    json.dumps(r.to_json())
