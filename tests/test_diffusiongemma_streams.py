"""DiffusionGemma's objective as the reference executes it, in step time (implementation.md
section 12): pure BP runs the whole clean stream on every rank (the objective's
`bp_whole_clean`, read by the layout), and the two trained streams run in sequence: the encoder
over the clean rows through every layer and its AR loss, then the decoder over the canvas
reading each layer's encoder K/V; backward: every decoder layer, then every encoder layer. The
decoder gathers the encoder's remote clean K/V again (`encoder_kv: regather`)."""

import numpy as np
import pytest
from pydantic import ValidationError

from csbp.simulator.cost import objective_ops
from csbp.simulator.cost.graph import Comm, Compute, StepGraph
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.layout import kv_rows
from csbp.simulator.layout.layout import Layout
from csbp.simulator.layout.objective_layout import EncoderLayout, WholeCleanLayout, stream_views
from csbp.simulator.plan.plan import Plan
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.system.implementation import Implementation, load_implementation
from csbp.simulator.workload.objectives import objective_shape, replicates_clean_under_bp
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

# FLOPs and bytes as numpy sums of the same terms in another grouping: tests/README.md
pytestmark = pytest.mark.floats
TINY = load_model("tiny")
GEMMA = load_model("diffusiongemma-26b-a4b")
L = 1024
# sums of the same per-op terms added in another order: float rounding only (< 1e-12 relative
# for a few thousand positive terms in float64); 1e-9 leaves room without hiding a missing term
ROUNDING = 1e-9


def build(model, plan, objective="diffusiongemma", **extra):
    w = Workload(seq_len=L, block_size=64, objective=objective, **extra)
    lay = Layout.build(w, plan)
    return StepGraph.build(model, w, plan, lay, 8), lay


def one_pass(model, plan, monkeypatch, **extra):
    """The same step built as one 2L pass (what the graph did before the two streams)."""
    with monkeypatch.context() as mp:
        mp.setattr(objective_ops.ObjectiveOps, "stream_builders", lambda self: [self])
        return build(model, plan, **extra)[0]


def stream_flops(graph, stream: str) -> np.ndarray:
    return sum((np.array(op.work.flops) for op in graph.ops
                if isinstance(op.work, Compute) and op.name.startswith(stream + ".")), np.zeros(graph.ranks))


def test_the_layout_reads_the_objectives_fact():
    assert replicates_clean_under_bp("diffusiongemma") and not replicates_clean_under_bp("bd3lm")
    w = Workload(seq_len=L, block_size=64, objective="diffusiongemma")
    assert objective_shape(w, GEMMA).bp_whole_clean
    assert isinstance(Layout.build(w, Plan(bp=2)), WholeCleanLayout)
    for plan in (Plan(cp=2), Plan(cp=2, bp=2), Plan(dp=2)):  # only pure BP replicates the stream
        assert not isinstance(Layout.build(w, plan), WholeCleanLayout)


@pytest.mark.parametrize("bp", [2, 4])
def test_pure_bp_every_rank_computes_the_whole_clean_stream(bp):
    graph, lay = build(TINY, Plan(bp=bp), self_conditioning=0.0)
    clean = kv_rows.held(lay, "positions") - kv_rows.held(lay, "noisy")
    assert clean.tolist() == [L] * bp  # integers: exact
    single, _ = build(TINY, Plan(), self_conditioning=0.0)
    encoder = stream_flops(graph, "encoder")
    # rank 1 computes as many clean FLOPs as rank 0, and both the whole stream's (one rank, dp)
    np.testing.assert_allclose(encoder, np.full(bp, stream_flops(single, "encoder")[0]), rtol=ROUNDING)


def test_a_dense_bd3lm_model_under_pure_bp_is_unchanged():
    graph, lay = build(TINY, Plan(bp=2), objective="bd3lm")
    assert type(lay) is Layout
    clean = kv_rows.held(lay, "positions") - kv_rows.held(lay, "noisy")
    assert clean[0] != clean[1] and max(clean) <= L  # each rank its blocks' prefix
    assert not any(op.name.startswith(("encoder.", "decoder.")) for op in graph.ops)


@pytest.mark.parametrize("plan", [Plan(bp=2), Plan(cp=2), Plan(cp=2, bp=2), Plan(cp=2, bp=4, transport="ring"),
                                  Plan(dp=2)])
def test_two_streams_do_the_one_pass_flops(plan, monkeypatch):
    streams, _ = build(TINY, plan)
    single = one_pass(TINY, plan, monkeypatch)
    np.testing.assert_allclose(streams.flops(), single.flops(), rtol=ROUNDING)
    np.testing.assert_allclose(streams.flops(False), single.flops(False), rtol=ROUNDING)
    assert streams.model_flops == pytest.approx(single.model_flops, rel=ROUNDING)


def test_moe_two_streams_do_the_one_pass_flops(monkeypatch):
    moe = load_model("tiny-moe")
    plan = Plan(ep=2, cp=2, bp=2)
    np.testing.assert_allclose(build(moe, plan)[0].flops(), one_pass(moe, plan, monkeypatch).flops(), rtol=ROUNDING)


@pytest.mark.parametrize("plan", [Plan(bp=2), Plan(cp=2, bp=2)])
def test_the_encoder_runs_first_and_its_backward_last(plan):
    graph, _ = build(TINY, plan, self_conditioning=0.0)
    ops = graph.ops
    n = TINY.n_layers
    enc_fwd = [op.index for op in ops if op.name.startswith("encoder.") and op.phase == "forward"]
    dec_fwd = [op.index for op in ops if op.name.startswith("decoder.") and op.phase == "forward"]
    dec_attn = [op.index for op in ops if op.name.startswith("decoder.attn") and op.phase == "forward"]
    enc_last_layer = [op.index for op in ops if op.name.startswith("encoder.") and op.layer == n - 1
                      and op.phase == "forward"]
    assert dec_attn and min(dec_attn) > max(enc_last_layer)  # after the encoder's last layer
    assert min(dec_fwd) > max(enc_fwd)  # the encoder's loss too
    def layers_back(stream):
        """The layers' recompute and backward (the fused loss's backward runs beside its forward)."""
        return [op.index for op in ops if op.name.startswith(stream) and op.layer is not None
                and op.phase in ("recompute", "backward")]

    dec_bwd, enc_bwd = layers_back("decoder."), layers_back("encoder.")
    assert max(dec_bwd) < min(enc_bwd)  # every decoder layer's backward, then the encoder's
    assert [op.layer for op in ops if op.name == "decoder.qkv-bwd"] == list(range(n - 1, -1, -1))
    # the layers' gradients are reduced as the encoder's backward completes them (tied weights)
    buckets = [op.index for op in ops if op.name.startswith("grads.") and op.layer is not None]
    assert buckets and min(buckets) > min(enc_bwd)


def test_under_cp_the_decoder_gathers_the_encoders_clean_kv_again(monkeypatch):
    plan = Plan(cp=2)  # pure CP: the one pass gathers all 2L rows per layer
    streams, lay = build(TINY, plan, self_conditioning=0.0)
    single = one_pass(TINY, plan, monkeypatch, self_conditioning=0.0)

    def kv(graph, prefix=""):
        return sum((np.array(op.work.bytes) for op in graph.ops if isinstance(op.work, Comm)
                    and op.work.category == "attention-kv" and op.name.startswith(prefix)), np.zeros(graph.ranks))

    # the decoder's view owns what the layout owns: its exchange moves the one pass's rows,
    # and the encoder's own exchange of the clean rows comes on top
    np.testing.assert_allclose(kv(streams, "decoder."), kv(single), rtol=ROUNDING)
    enc = kv(streams, "encoder.")
    assert np.all(enc > 0)
    np.testing.assert_allclose(kv(streams), kv(single) + enc, rtol=ROUNDING)
    encoder, _ = stream_views(lay)
    assert isinstance(encoder, EncoderLayout)
    assert all(a >= L for s in encoder.shares for a, _ in s.positions + s.owned_kv)  # clean rows only


def test_encoder_kv_is_a_profile_fact_with_a_source():
    impl = load_implementation("turbo-dllm")
    assert impl.encoder_kv == "regather" and "[U]" in impl.sources["encoder_kv"]
    with pytest.raises(ValidationError):  # keeping the gathered K/V is not modelled
        Implementation.model_validate({"name": "x", "notes": "", "encoder_kv": "gathered"})


def test_pure_bp_diffusiongemma_simulates_with_two_streams():
    w = Workload(seq_len=8192, objective="diffusiongemma")
    r = simulate(GEMMA, w, Plan(ep=2, bp=4), load_profile("h200"), nodes=1, with_trace=False)
    assert r.step_time_s > 0 and r.tokens_per_s > 0
    assert any("two streams in sequence" in n for n in r.notes)


def test_under_pure_cp_each_stream_alone_is_unbalanced():
    """The 2L two-chunk zigzag (the default profile turbo-dllm's `stream_ownership: shared-2l`;
    `ideal` shards each stream on its own: tests/test_stream_ownership.py) balances a rank's noisy
    and clean chunks together (implementation.md 1); run one stream after the other, the encoder's heaviest chunk (the last clean one, rank 0)
    and the decoder's (the last noisy one, rank cp-1) sit on different ranks."""
    graph, _ = build(TINY, Plan(cp=2), self_conditioning=0.0)

    def attention(stream):
        return sum((np.array(op.work.flops) for op in graph.ops if isinstance(op.work, Compute)
                    and op.work.kind.startswith("attention") and op.name.startswith(stream)), np.zeros(2))

    enc, dec = attention("encoder."), attention("decoder.")
    assert enc[0] > enc[1] and dec[1] > dec[0]
    # together balanced: noisy chunk r and clean chunk 2cp-1-r hold the same pairs at L = 1024,
    # b = 64 (block-aligned chunks); only float rounding apart
    np.testing.assert_allclose(enc + dec, np.full(2, (enc + dec).mean()), rtol=ROUNDING)
    assert any("two streams under pure CP" in n for n in graph.notes)


def test_each_streams_recomputed_layer_holds_its_own_rows():
    """Memory follows the two streams: the encoder's recomputed layer holds the clean rows only
    (the same on every pure-BP rank, each running the whole clean stream, though their noisy
    rows differ), the decoder's the canvas rows (L / bp of them, fewer than the encoder's L)."""
    from csbp.simulator.cost.memory import step_timeline

    w = Workload(seq_len=9 * 1024, objective="diffusiongemma")  # 36 blocks: 10, 10, 8, 8 per rank
    plan = Plan(bp=4)
    lay = Layout.build(w, plan)
    noisy = kv_rows.held(lay, "noisy")
    tl = step_timeline(GEMMA, w, plan, lay, load_profile("h200"))
    last = GEMMA.n_layers - 1

    def layer_bytes(encoder: bool) -> np.ndarray:
        k = next(k for k, m in enumerate(tl.moments) if m.phase == "recompute" and m.layer == last
                 and m.op.startswith("encoder.") == encoder)
        return np.array([tl.breakdown(k, r).get("layer", 0.0) for r in range(lay.size)])

    enc, dec = layer_bytes(True), layer_bytes(False)
    assert len(set(noisy.tolist())) > 1
    assert len(set(enc.tolist())) == 1 and enc[0] > 0  # one code path on equal sizes: exact
    assert np.all(dec < enc)
