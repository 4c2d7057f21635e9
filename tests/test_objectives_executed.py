"""Objectives as the reference executes them, Part II (implementation.md sections 12-15):
DiffusionGemma's live encoder K/V and pure BP's whole clean stream, the windowed drafter's
trimmed context and features modes, the Muse-Glimmer drafter preset, and the tokens each
objective's users count."""

import json
import numpy as np
import pytest

from csbp.simulator.cost.memory import encoder_retained, estimate_memory, step_timeline
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.layout import kv_rows
from csbp.simulator.layout.layout import Layout, kv_row_bytes
from csbp.simulator.layout.objective_layout import WholeCleanLayout, untrimmed
from csbp.simulator.plan.plan import Plan
from csbp.simulator.report.result import GIB
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.workload.objectives import as_executed, objective_shape
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

pytestmark = pytest.mark.floats  # byte sums compared with their formulas (tests/README.md)
GEMMA = load_model("diffusiongemma-26b-a4b")
DRAFTER = load_model("dflash2-qwen3.8-27b")
H200, H100 = load_profile("h200"), load_profile("h100")


def gemma_kv_per_token() -> int:
    """Encoder K/V bytes per clean token over every layer, bf16, no TP."""
    return sum(kv_row_bytes(a, 2, 1) for a in GEMMA.layers)


def test_diffusiongemma_keeps_210_kib_of_encoder_kv_per_clean_token():
    # 25 sliding layers of 8 K/V heads x 256 (K and V) + 5 global of 2 heads x 512 (K = V), bf16
    assert gemma_kv_per_token() == 25 * 8 * 256 * 2 * 2 + 5 * 2 * 512 * 2 == 210 * 1024
    shape = objective_shape(Workload(seq_len=65536, objective="diffusiongemma"), GEMMA)
    assert shape.streams == ("encoder", "decoder") and shape.retain_encoder_kv and shape.bp_whole_clean


@pytest.mark.parametrize("plan", [Plan(ep=2, cp=8), Plan(ep=2, cp=8, bp=8)])
def test_every_layers_encoder_kv_is_alive_at_the_decoders_first_backward_layer(plan):
    w = Workload(seq_len=65536, objective="diffusiongemma")
    lay = Layout.build(w, plan)
    tl = step_timeline(GEMMA, w, plan, lay, H200)
    owned = kv_rows.held(lay, "context").astype(float)  # clean K/V rows each rank owns
    every_layer = owned * gemma_kv_per_token()
    last = GEMMA.n_layers - 1
    first_backward = [k for k, m in enumerate(tl.moments) if m.phase in ("recompute", "backward")
                      and m.layer == last and not m.op.startswith("encoder.")]
    assert first_backward
    for k in first_backward:
        for r in range(lay.size):
            assert tl.breakdown(k, r).get("kv", 0.0) >= every_layer[r] > 0
    # the encoder's backward starts with all of them and all their gradients
    encoder = [k for k, m in enumerate(tl.moments) if m.op.startswith("encoder.")]
    assert encoder and all(tl.breakdown(k, r).get("dkv", 0.0) >= every_layer[r]
                           for k in encoder for r in range(lay.size))


def test_pure_bp_diffusiongemma_holds_the_whole_clean_stream_on_every_rank():
    L = 65536
    w = Workload(seq_len=L, objective="diffusiongemma")
    plan = Plan(ep=2, bp=8)
    lay = Layout.build(w, plan)
    assert isinstance(lay, WholeCleanLayout)
    for s in lay.shares:  # clean_positions = arange(seq_len) on every rank (section 12)
        assert s.owned_kv == ((L, 2 * L),)
        assert sum(b - a for a, b in s.positions) == L + len(s.noisy_blocks) * w.block_size
    retained = encoder_retained(GEMMA, lay, 1, 2, 1)
    total = sum(retained.kv[a] * GEMMA.layers.count(a) for a in retained.kv)
    np.testing.assert_array_equal(total, np.full(8, L * 210 * 1024.0))  # integers: exact
    est = estimate_memory(GEMMA, w, plan, lay, H200)
    for r in range(8):  # K/V and their gradients of the whole stream at the encoder's backward
        assert est.timeline.breakdown(int(est.where[r]), r).get("kv", 0.0) >= L * 210 * 1024


def drafter_step(seq_len: str, plan: Plan, features: str = "synthetic"):
    w = Workload(seq_len=seq_len, block_size=8, objective="dflash2", checkpointing="none",
                 max_anchors=2048, features=features)
    return simulate(DRAFTER, w, plan, H100, nodes=1, with_trace=False)


@pytest.mark.parametrize("plan", [Plan(dp=8), Plan(cp=8, bp=8)])
def test_windowed_drafter_step_time_is_flat_past_the_trim(plan):
    # 2048 anchors x 8 + window 2048 ~ 18K rows are all the step touches: at 256K and 512K the
    # step is the same work (rel 1e-9: the same sums, their rounding aside); memory grows only
    # by the resident features
    short, long_ = drafter_step(262144, plan), drafter_step(524288, plan)
    assert long_.step_time_s == pytest.approx(short.step_time_s, rel=1e-9)
    assert long_.tokens_per_s == pytest.approx(2 * short.tokens_per_s, rel=1e-9)


def test_supervised_tokens_per_s_counts_anchors_times_block_minus_one():
    r = drafter_step(262144, Plan(cp=8, bp=8))
    out = r.to_json()
    expected = out["tokens_per_s"] * 2048 * (8 - 1) / 262144
    assert out["objective_tokens_name"] == "supervised"
    # one product and one division more than tokens_per_s: rel 1e-12
    assert out["supervised_tokens_per_s"] == pytest.approx(expected, rel=1e-12)
    assert out["objective_tokens_per_s"] == out["supervised_tokens_per_s"]


def test_fast_dllm_v2_counts_valid_tokens():
    qwen = load_model("tiny")
    w = Workload(seq_len=4096, block_size=64, objective="fast-dllm-v2")
    r = simulate(qwen, w, Plan(dp=4, cp=2, bp=2), H200, nodes=1, with_trace=False)
    assert r.objective_tokens_name == "valid"
    assert r.to_json()["valid_tokens_per_s"] == pytest.approx(r.tokens_per_s * 4095 / 4096, rel=1e-12)
    bd3 = simulate(qwen, Workload(seq_len=4096, block_size=64), Plan(dp=4, cp=2, bp=2), H200, nodes=1)
    assert bd3.objective_tokens_name is None and "supervised_tokens_per_s" not in bd3.to_json()


@pytest.mark.parametrize("plan", [Plan(dp=8), Plan(cp=8, bp=8)])
def test_features_mode_changes_io_and_memory_as_stated(plan):
    offline, synthetic = (drafter_step(262144, plan, f) for f in ("offline", "synthetic"))
    w = as_executed(Workload(seq_len=262144, block_size=8, objective="dflash2",
                             checkpointing="none"), DRAFTER)
    shard = kv_rows.held(untrimmed(Layout.build(w, plan)), "context").astype(float)
    one_copy = shard * 5 * DRAFTER.hidden * 2 / GIB  # the next batch's features on the GPU
    # allocated: a sum of byte counts in GiB, the copy the only difference (rel 1e-9)
    assert offline.peak_allocated_gib - synthetic.peak_allocated_gib == pytest.approx(one_copy.max(), rel=1e-9)
    assert offline.step_time_s >= synthetic.step_time_s
    assert not synthetic.phases_s.get("data")
    assert any("offline" in n for n in offline.notes) and any("synthetic" in n for n in synthetic.notes)


def test_trim_keeps_about_nine_windows_of_context():
    w = as_executed(Workload(seq_len=1 << 20, block_size=8, objective="dflash2"), DRAFTER)
    assert w.drafter_window == 2048
    held = kv_rows.held(Layout.build(w, Plan(dp=8)), "context")
    # anchors x block + window - 1 rows: 2048 x 8 + 2047 ~ 9 x 2048 (section 14)
    assert held.tolist() == [2048 * 8 + 2048 - 1 - 8]


def test_muse_glimmer_drafter_preset_loads_with_its_sources():
    m = load_model("dflash2-muse-glimmer-30b")
    assert (m.n_layers, m.hidden, m.ffn, m.vocab, m.conditioning_layers) == (5, 6656, 19968, 202048, 5)
    assert all(a.kind == "sliding" and a.window == 2048 and (a.n_heads, a.n_kv_heads, a.head_dim) == (32, 8, 128)
               for a in m.layers)
    assert "implementation.md 14" in m.source and "[U]" in m.source
    assert as_executed(Workload(seq_len=65536, block_size=16, objective="dflash2"), m).drafter_window == 2048


def test_a_drafter_is_planned_at_its_recipes_block_unless_a_flag_says_otherwise(capsys):
    """The command's generic block of 256 would draft 2048 anchors x 256 rows, more than the
    context: a drafter preset takes its recipe's block, anchors and vocabulary block."""
    from csbp.simulator.commands.cli import main

    base = ["simulate", "--model", "dflash2-muse-glimmer-30b", "--hardware", "h100", "--nodes", "1",
            "--seq-len", "64k", "--plan", "dp=8", "--json"]
    for extra, block in (([], 16), (["--block-size", "32"], 32)):
        capsys.readouterr()
        assert main([*base, *extra]) == 0
        w = json.loads(capsys.readouterr().out)["workload"]
        assert (w["block_size"], w["max_anchors"], w["vocab_block"]) == (block, 512, 16384)
