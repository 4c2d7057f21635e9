"""Which positions each of DiffusionGemma's two trained streams runs on a pure-CP rank, as the
implementation profile says (`stream_ownership`): `shared-2l` keeps the 2L two-chunk zigzag
(implementation.md 1: noisy chunk r, clean chunk 2cp-1-r; turbo-dllm, [U]), balanced only when
both streams run in one pass; `per-stream` zigzags each stream's own L positions over the CP
group (`ideal`), each stream balanced on its own. CSBP, BP and DP are the same either way."""

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from csbp.simulator.cost.graph import Compute, StepGraph
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.layout import kv_rows
from csbp.simulator.layout.layout import Layout, attention_bytes_received
from csbp.simulator.layout.objective_layout import stream_views
from csbp.simulator.layout.spans import intersect, normalize, size
from csbp.simulator.plan.plan import Plan
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.system.implementation import IMPLEMENTATION_DIR, Implementation, load_implementation
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


@pytest.fixture(scope="module")
def shared_ideal(tmp_path_factory) -> str:
    """`ideal` with the 2L zigzag kept per stream: the profile's one other choice."""
    raw = yaml.safe_load((IMPLEMENTATION_DIR / "ideal.yaml").read_text())
    raw["name"] = "ideal-shared-2l"
    raw["stream_ownership"] = {"value": "shared-2l", "source": "test: ideal's other choice"}
    path = tmp_path_factory.mktemp("impl") / "ideal-shared-2l.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def build(plan, impl, model=TINY, block=64, **extra):
    w = Workload(seq_len=L, block_size=block, objective="diffusiongemma", **extra)
    lay = Layout.build(w, plan)
    return StepGraph.build(model, w, plan, lay, 8, implementation=impl), lay


def attention(graph, stream: str) -> np.ndarray:
    return sum((np.array(op.work.flops) for op in graph.ops if isinstance(op.work, Compute)
                and op.work.kind.startswith("attention") and op.name.startswith(stream + ".")),
               np.zeros(graph.ranks))


def test_stream_ownership_is_a_profile_fact_with_a_source():
    turbo, ideal = load_implementation("turbo-dllm"), load_implementation("ideal")
    assert turbo.stream_ownership == "shared-2l" and "[U]" in turbo.sources["stream_ownership"]
    assert ideal.stream_ownership == "per-stream" and ideal.sources["stream_ownership"].strip()
    for name in ("csbp-runtime", "torchtitan", "megatron-te"):  # they run no two-stream objective
        assert load_implementation(name).stream_ownership == "shared-2l"
    with pytest.raises(ValidationError):
        Implementation.model_validate({"name": "x", "notes": "", "stream_ownership": "per-layer"})


@pytest.mark.parametrize("cp,block", [(2, 64), (4, 64), (8, 64), (8, 128), (8, 256)])
def test_per_stream_views_balance_each_stream_exactly(cp, block):
    """Each stream's pairs per rank are equal under `per-stream` (integers: exact). Why exact:
    a query at position i of a stream sees (i // b + 1) b keys (its own block's and the earlier
    clean blocks'), and i and L-1-i together see (L / b + 1) b whatever i is, so the mirrored
    chunks r and 2cp-1-r hold the same pairs on every rank, blocks straddling chunks or not
    (cp=8, b=128 and 256: chunks of 64 rows)."""
    w = Workload(seq_len=L, block_size=block, objective="diffusiongemma")
    lay = Layout.build(w, Plan(cp=cp))
    shared = stream_views(lay)
    enc, dec = stream_views(lay, "per-stream")
    for view in (enc, dec):
        assert len({view.pairs(r) for r in range(cp)}) == 1
    assert max(shared[0].pairs(r) for r in range(cp)) > enc.pairs(0)  # the 2L zigzag's encoder is not
    for r in range(cp):
        # the same rows per rank as the 2L zigzag, each stream's cut in two chunks of L / 2cp
        assert size(enc.shares[r].positions) == size(shared[0].shares[r].positions) == L // cp
        assert size(dec.shares[r].positions) == size(shared[1].shares[r].positions) == L // cp
        # the decoder reads the clean K/V the encoder made where it made them
        assert intersect(dec.shares[r].owned_kv, ((L, 2 * L),)) == enc.shares[r].owned_kv
        assert enc.shares[r].positions == enc.shares[r].owned_kv
    # every row of both streams owned once
    owned = [s for share in dec.shares for s in share.owned_kv]
    assert size(owned) == 2 * L and normalize(owned) == ((0, 2 * L),)


def test_per_stream_is_no_less_balanced_under_a_window():
    """Sliding-window layers: queries past the first window see W keys wherever they sit, so
    either ownership is nearly balanced; per-stream is never the less balanced one."""
    w = Workload(seq_len=8 * L, block_size=32, objective="diffusiongemma")
    lay = Layout.build(w, Plan(cp=4))
    for shared, own in zip(stream_views(lay), stream_views(lay, "per-stream")):
        assert max(own.pairs(r, 1024) for r in range(4)) <= max(shared.pairs(r, 1024) for r in range(4))


@pytest.mark.parametrize("cp", [2, 4])
def test_per_stream_graph_balances_each_streams_attention_and_keeps_the_flops(cp, shared_ideal):
    per, _ = build(Plan(cp=cp), "ideal")
    two_l, _ = build(Plan(cp=cp), shared_ideal)
    for stream in ("encoder", "decoder"):
        a = attention(per, stream)
        # every rank the same pairs (exact integers above): the same FLOPs up to float rounding
        np.testing.assert_allclose(a, np.full(cp, a.mean()), rtol=ROUNDING)
        b = attention(two_l, stream)
        assert b.max() / b.mean() > 1.4  # 1.47 at cp = 2 (the encoder's last clean chunk on rank 0)
    # the same work in all (the self-conditioning canvas pass, unbalanced on the 2L zigzag and
    # balanced per stream, included)
    assert per.flops().sum() == pytest.approx(two_l.flops().sum(), rel=ROUNDING)
    assert per.flops(False).sum() == pytest.approx(two_l.flops(False).sum(), rel=ROUNDING)
    assert per.model_flops == pytest.approx(two_l.model_flops, rel=ROUNDING)
    # without it, per rank too: each rank the same rows and, both balanced, the same pairs
    per, _ = build(Plan(cp=cp), "ideal", self_conditioning=0.0)
    two_l, _ = build(Plan(cp=cp), shared_ideal, self_conditioning=0.0)
    np.testing.assert_allclose(per.flops(), two_l.flops(), rtol=ROUNDING)
    assert any("each sharded on its own" in n for n in per.notes)
    assert any("each stream alone is unbalanced" in n for n in two_l.notes)


@pytest.mark.parametrize("plan", [Plan(cp=2), Plan(cp=4, tp=2), Plan(cp=4, transport="ring")])
@pytest.mark.parametrize("impl", ["ideal", "turbo-dllm"])
def test_kv_bytes_counted_are_the_views_exchanges(plan, impl):
    """Every K/V byte of both streams comes from the views' `Layout.exchange` (the encoder's clean
    rows, the decoder's gather of its canvas and the encoder's clean rows again): the same rows
    under either ownership, only from other owners."""
    g, lay = build(plan, impl, self_conditioning=0.0)
    views = stream_views(lay, load_implementation(impl).stream_ownership)
    expect = sum(np.array(attention_bytes_received(v, TINY.layers, 2, plan.tp), dtype=float) for v in views)
    np.testing.assert_allclose(g.received_bytes()["attention-kv"], expect, rtol=ROUNDING)
    per = sum(np.array(attention_bytes_received(v, TINY.layers, 2, plan.tp), dtype=float)
              for v in stream_views(lay, "per-stream"))
    np.testing.assert_allclose(per, expect, rtol=ROUNDING)  # each rank L / cp rows of each stream


@pytest.mark.parametrize("plan", [Plan(cp=2, bp=2), Plan(cp=2, bp=4), Plan(bp=2), Plan(dp=2), Plan()])
def test_csbp_bp_and_dp_are_the_same_under_either_ownership(plan, shared_ideal):
    """CSBP's noisy blocks are whole per rank and its clean shard already the clean stream's own
    zigzag; BP and DP hold whole streams or blocks: the views and the step do not change."""
    w = Workload(seq_len=L, block_size=64, objective="diffusiongemma")
    lay = Layout.build(w, plan)
    for a, b in zip(stream_views(lay), stream_views(lay, "per-stream")):
        assert a.shares == b.shares
    per, _ = build(plan, "ideal")
    two_l, _ = build(plan, shared_ideal)
    # one code path on identical inputs: exact
    assert [(op.name, op.work) for op in per.ops] == [(op.name, op.work) for op in two_l.ops]


@pytest.mark.parametrize("plan", [Plan(ep=2, cp=4), Plan(tp=2, cp=2)])
def test_memory_follows_the_views_and_holds_the_same_rows_per_rank(plan, shared_ideal):
    """Each pure-CP rank holds L / cp rows of each stream and owns L / cp clean K/V rows under
    either ownership: the same peak (the walk reads counts, and these are the same integers)."""
    from csbp.simulator.cost.memory import estimate_memory

    w = Workload(seq_len=8 * L, objective="diffusiongemma")
    lay = Layout.build(w, plan)
    for a, b in zip(stream_views(lay), stream_views(lay, "per-stream")):
        for what in ("positions", "noisy", "context"):
            assert kv_rows.held(a, what).tolist() == kv_rows.held(b, what).tolist()
    h200 = load_profile("h200")
    peak = {impl: estimate_memory(GEMMA, w, plan, lay, h200.model_copy(update={"implementation": impl})).peak_gib
            for impl in ("ideal", shared_ideal)}
    # one code path on equal counts; float sums in the same order
    np.testing.assert_allclose(peak["ideal"], peak[shared_ideal], rtol=ROUNDING)


@pytest.mark.parametrize("plan", [Plan(dp=2, tp=2, ep=2, cp=2), Plan(ep=2, cp=8)])
def test_ideal_is_never_slower_than_turbo_on_pure_cp_diffusiongemma(plan, shared_ideal):
    w = Workload(seq_len=64 * L, objective="diffusiongemma")
    h200 = load_profile("h200")
    step = {impl: simulate(GEMMA, w, plan, h200.model_copy(update={"implementation": impl}), 2,
                           with_trace=False).step_time_s
            for impl in ("ideal", shared_ideal, "turbo-dllm")}
    # 1e-9: two graphs whose shared ops sum in other orders (~1e4 additions, ~1e-12)
    assert step["ideal"] <= step["turbo-dllm"] * (1 + 1e-9)
    # and per-stream is ideal's better choice: each stream's collectives wait for no slow rank
    assert step["ideal"] < step[shared_ideal]
