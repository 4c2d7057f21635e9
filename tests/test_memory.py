"""Memory model: ZeRO sharding, checkpointing, CP/BP/TP sharding, K/V buffers, infeasible reasons."""

import pytest

from csbp.simulator.hardware import load_profile
from csbp.simulator.layout import Layout, kv_row_bytes
from csbp.simulator.memory import OPTIMIZER_BYTES_PER_PARAM, estimate_memory, loss_chunk_tokens, weight_state
from csbp.simulator.plan import Plan
from csbp.simulator.presets import load_model
from csbp.simulator.result import GIB
from csbp.simulator.simulate import simulate
from csbp.simulator.workload import Workload

M8 = load_model("nemotron-diffusion-8b")
L256 = 256 * 1024


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200")


def memory(plan, h200, model=M8, **workload):
    w = Workload(seq_len=workload.pop("seq_len", L256), **workload)
    return estimate_memory(model, w, plan, Layout.build(w, plan), h200)


def test_zero_stages_shard_more_and_more():
    plan = Plan(dp=2, cp=8, bp=8)
    states = [weight_state(M8, Workload(seq_len=L256, zero_stage=z), plan) for z in range(4)]
    totals = [sum(s.values()) for s in states]
    assert totals == sorted(totals, reverse=True)
    n = plan.dp * plan.ctx
    assert states[1]["optimizer"] == pytest.approx(M8.total_params() * OPTIMIZER_BYTES_PER_PARAM / n)
    assert states[0]["optimizer"] == pytest.approx(M8.total_params() * OPTIMIZER_BYTES_PER_PARAM)
    assert states[1]["grads"] == states[0]["grads"] > states[2]["grads"]
    assert states[2]["params"] > states[3]["params"]


def test_full_checkpointing_saves_activations(h200):
    full = memory(Plan(cp=16), h200, checkpointing="full")
    none = memory(Plan(cp=16), h200, checkpointing="none")
    assert none.per_rank[0]["activations"] > 5 * full.per_rank[0]["activations"]
    assert none.per_rank[0]["kv_buffers"] > full.per_rank[0]["kv_buffers"]  # every layer keeps its K/V


def test_context_and_tensor_parallelism_shard_activations(h200):
    cp8 = memory(Plan(dp=2, cp=8), h200).per_rank[0]["activations"]
    cp16 = memory(Plan(cp=16), h200).per_rank[0]["activations"]
    tp2 = memory(Plan(tp=2, cp=8), h200).per_rank[0]["activations"]
    assert cp16 == pytest.approx(cp8 / 2, rel=0.01)
    assert tp2 == pytest.approx(cp8 / 2, rel=0.01)


def test_pure_bp_holds_its_replicated_prefix(h200):
    est = memory(Plan(bp=16), h200)
    lay = Layout.build(Workload(seq_len=L256), Plan(bp=16))
    acts = [p["activations"] for p in est.per_rank]
    tokens = [s.n_positions for s in lay.shares]
    assert acts.index(max(acts)) == tokens.index(max(tokens))
    assert max(tokens) > L256  # a clean prefix of almost L plus its noisy blocks
    csbp = memory(Plan(cp=16, bp=16), h200)
    assert max(acts) > 5 * max(p["activations"] for p in csbp.per_rank)  # ~L vs 2L/16 tokens


def test_gathered_kv_buffers_follow_the_layout(h200):
    for plan in (Plan(cp=16), Plan(cp=16, bp=16)):
        w = Workload(seq_len=L256)
        lay = Layout.build(w, plan)
        rows = lay.exchange(M8.layers[0], "forward").rows_received(0)
        got = estimate_memory(M8, w, plan, lay, h200).per_rank[0]["kv_buffers"] * GIB
        assert got == pytest.approx(2 * rows * kv_row_bytes(M8.layers[0], 2))  # K/V in, dK/dV out
    cp = memory(Plan(cp=16), h200).per_rank[0]["kv_buffers"]
    csbp = memory(Plan(cp=16, bp=16), h200).per_rank[0]["kv_buffers"]
    assert csbp == pytest.approx(cp / 2, rel=0.01)  # CSBP moves only clean K/V


def test_loss_chunks_follow_liger_rule():
    assert loss_chunk_tokens(65536, 131072, 4096) == 2048  # 65536 / (131072 / 4096)
    assert loss_chunk_tokens(100, 131072, 4096) == 4
    assert loss_chunk_tokens(0, 131072, 4096) == 0


def test_pure_bp_of_a_large_model_at_long_context_is_infeasible_with_numbers(h200):
    model = load_model("nemotron-diffusion-14b")
    r = simulate(model, Workload(seq_len=512 * 1024), Plan(bp=16), h200, nodes=2)
    assert not r.feasible
    assert r.reason.startswith("infeasible: needs ")
    assert "GiB per GPU on rank" in r.reason and "activations" in r.reason and "GiB usable" in r.reason
    need = float(r.reason.split("needs ")[1].split(" GiB")[0])
    assert need > h200.gpu.usable_gib
    assert r.peak_memory_gib == pytest.approx(need + h200.gpu.reserved_gib, abs=0.1)
    assert r.step_time_s > 0 and r.tokens_per_s is None  # time still estimated, but no throughput
    assert r.memory_gib["activations"] > 100


def test_reserved_memory_counts_against_capacity(h200):
    est = memory(Plan(cp=16), h200)
    assert all(p["reserved"] == h200.gpu.reserved_gib for p in est.per_rank)
    assert est.peak_gib == pytest.approx(max(est.totals_gib))
    assert est.feasible and est.reason is None
