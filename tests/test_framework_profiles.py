"""The TorchTitan and Megatron-Core/TE implementation profiles (issue 24, frameworks.md A, B):
FSDP2 and the distributed optimizer in memory and in the step graph, TorchTitan's unchunked fp32
loss, Transformer Engine's FP8 weight cache and the casts around FP8 linears, TP waits per
phase, the plan families a framework runs, and the AR job's interop round trip.

Byte counts are compared with `pytest.approx(rel=1e-12)` where two code paths sum the same
products in another order (float rounding only); nothing else is approximate."""

from pathlib import Path

import numpy as np
import pytest
import yaml

from csbp.simulator.cost.graph import Comm, Compute, StepGraph
from csbp.simulator.cost.memory import estimate_memory, step_timeline
from csbp.simulator.cost.memory_timeline import weight_state
from csbp.simulator.errors import InputError
from csbp.simulator.interop import emit, read
from csbp.simulator.layout.layout import Layout
from csbp.simulator.plan.plan import Plan
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.system.implementation import IMPLEMENTATION_DIR, load_implementation
from csbp.simulator.workload.objectives import as_executed
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

TITAN, MEGATRON = load_implementation("torchtitan"), load_implementation("megatron-te")
M8 = load_model("nemotron-diffusion-8b")
EXACT = 1e-12  # the same byte products summed in another order


@pytest.fixture(scope="module")
def h200():
    return load_profile("h200")


def llama():
    return load_model("llama3.1-8b")


def graph(model, w, plan, impl):
    return StepGraph.build(model, w, plan, Layout.build(as_executed(w, model), plan), 8, implementation=impl)


def timeline(model, w, plan, impl, profile):
    prof = profile.model_copy(update={"implementation": impl})
    return step_timeline(model, w, plan, Layout.build(as_executed(w, model), plan), prof)


def estimate(model, w, plan, impl, profile):
    prof = profile.model_copy(update={"implementation": impl})
    return estimate_memory(model, w, plan, Layout.build(as_executed(w, model), plan), prof)


# ---- the profiles ---------------------------------------------------------------------------

def _facts(tree, prefix=""):
    """Every {value, source} leaf of a profile's YAML, by its dotted path."""
    if isinstance(tree, dict) and set(tree) == {"value", "source"}:
        yield prefix.rstrip("."), tree["source"]
        return
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _facts(v, f"{prefix}{k}.")


@pytest.mark.parametrize("name", ["torchtitan", "megatron-te"])
def test_profiles_load_and_every_fact_has_a_source(name):
    """Each fact cites frameworks.md or says it is assumed ([U], [U: why]) or deduced
    ([inference]); the loader records every one of them."""
    raw = yaml.safe_load((IMPLEMENTATION_DIR / f"{name}.yaml").read_text())
    impl = load_implementation(name)
    facts = dict(_facts({k: v for k, v in raw.items() if k not in ("name", "notes")}))
    assert len(facts) >= 40
    for path, source in facts.items():
        assert source.strip(), path
        assert ("frameworks.md" in source or "[U" in source or "[inference" in source
                or "one rank holds every key" in source), (path, source)
    assert set(impl.sources) == set(facts)


@pytest.mark.parametrize("name", ["torchtitan", "megatron-te"])
def test_frameworks_without_block_parallelism_refuse_bp_plans_in_one_line(name):
    w = Workload(seq_len=16384)
    for plan in (Plan(cp=4, bp=4), Plan(bp=8)):
        with pytest.raises(InputError) as err:
            plan.check_against(M8, w, implementation=name)
        assert str(err.value).startswith(f"implementation '{name}' cannot run") and "\n" not in str(err.value)
    Plan(dp=2, cp=4).check_against(M8, w, implementation=name)  # CP runs
    Plan(dp=2, cp=4, transport="ring").check_against(M8, w, implementation=name)


# ---- FSDP2 over dp x cp (frameworks.md A3) ---------------------------------------------------

@pytest.mark.parametrize("plan", [Plan(dp=8), Plan(dp=2, cp=4), Plan(cp=8), Plan(dp=4, cp=2)])
def test_fsdp2_divides_parameters_gradients_and_optimizer_states_by_dp_cp(plan):
    """fp32 shards (4 B), fp32 gradients (4 B) and AdamW's two fp32 moments (8 B) per parameter,
    each over dp x cp; no master copy; beside the shards two gathered layers in bf16."""
    opt = TITAN.optimizer.path("bd3lm")
    d = plan.dp * plan.cp
    n = M8.dense_params()
    state = weight_state(M8, opt.stage(2), 2, plan, False, False, opt)
    layer = M8.mixer_params(M8.layers[0]) + M8.dense_ffn_params() + 2 * M8.hidden
    assert opt.stage(2) == 3  # FSDP2 whatever the workload's --zero
    assert state.optimizer == pytest.approx(8 * n / d, rel=EXACT)
    assert state.grads == pytest.approx(4 * n / d, rel=EXACT)
    assert state.params == pytest.approx(4 * n / d + 2 * 2 * layer, rel=EXACT)
    assert state.master == 0
    # the root (embedding, final norm, LM head) whole in bf16 from the forward to its backward
    assert state.root_gathered == 2 * M8.embedding_params()


def test_fsdp2_step_gathers_each_block_twice_but_the_last_and_the_root_once():
    w, plan = Workload(seq_len=16384), Plan(dp=2, cp=4)
    g = graph(M8, w, plan, TITAN)
    gathers = [op for op in g.ops if op.name.startswith("zero3.params")]
    forward = {op.layer for op in gathers if op.phase == "forward"}
    backward = {op.layer for op in gathers if op.phase == "backward"}
    assert forward == set(range(M8.n_layers))
    assert backward == set(range(M8.n_layers - 1))  # the last block kept from its forward
    roots = [op for op in g.ops if op.name.startswith("zero3.root")]
    assert len(roots) == 1 and roots[0].phase == "forward"
    embed = next(op for op in g.ops if op.name == "embed")
    assert roots[0].index in embed.deps  # gathered before the embedding runs
    # bf16 all-gathers, fp32 reduce-scatters, both over the dp x cp ranks
    layer = M8.mixer_params(M8.layers[0]) + M8.dense_ffn_params() + 2 * M8.hidden
    share = 7 / 8
    assert gathers[0].work.group.size == 8
    assert max(gathers[0].work.bytes) == pytest.approx(layer * 2 * share, rel=EXACT)
    rs = [op.work for op in g.ops if op.name.startswith("grads.dense")]
    assert {c.collective for c in rs} == {"reduce-scatter"} and {c.group.size for c in rs} == {8}
    assert sum(c.bytes[0] for c in rs) == pytest.approx(M8.dense_params() * 4 * share, rel=EXACT)
    assert not any(op.name.startswith("updated-params") for op in g.ops)


def test_torchtitan_fp32_logits_are_in_the_memory_peak(h200):
    """TorchTitan's loss: cross_entropy(pred.float()) over every local token's logits; at 32K
    tokens on one rank the loss buffers (forward: bf16 logits, their fp32 copy and the fp32
    log-probs; backward: three fp32 [rows, V] buffers) set the step's peak, which holds at
    least one fp32 L_local x vocabulary buffer."""
    m = llama()
    w, plan = Workload(seq_len=32768, objective="ar"), Plan(dp=8)
    est = estimate(m, w, plan, TITAN, h200)
    rows = 32768  # every token carries a label (AR)
    fp32 = rows * m.vocab * 4
    assert est.peak_at["phase"] == "loss"
    assert est.breakdown["loss"] * 2 ** 30 >= fp32
    tl = est.timeline
    forward = next(k for k, mo in enumerate(tl.moments) if mo.op == "cross-entropy")
    assert tl.breakdown(forward, 0)["loss"] == pytest.approx(rows * m.vocab * (2 + 4 + 4), rel=EXACT)
    # a chunked loss holds far less: the peak moves off the loss
    chunked = TITAN.model_copy(update={"loss": TITAN.loss.model_copy(update={"kernel": "chunked-ce"})})
    assert estimate(m, w, plan, chunked, h200).peak_gib < est.peak_gib - fp32 / 2 ** 30


# ---- Megatron's distributed optimizer (frameworks.md B4) ------------------------------------

@pytest.mark.parametrize("plan", [Plan(dp=8), Plan(dp=2, cp=4), Plan(dp=4, cp=2)])
def test_distributed_optimizer_holds_6_plus_12_over_d_bytes_per_parameter(plan, h200):
    """bf16 parameters and the fp32 gradient buffer whole, fp32 master and Adam m, v sharded over
    DP x CP; the gradient buffer is alive from the step's first moment."""
    opt = MEGATRON.optimizer.path("bd3lm")
    d = plan.dp * plan.cp
    n = M8.dense_params()
    state = weight_state(M8, opt.stage(2), 2, plan, False, False, opt)
    total = state.params + state.persistent_grads + state.master + state.optimizer
    assert total == pytest.approx(n * (6 + 12 / d), rel=EXACT)
    tl = timeline(M8, Workload(seq_len=16384), plan, MEGATRON, h200)
    first = tl.breakdown(0, 0)
    assert first["grads"] == pytest.approx(4 * n, rel=EXACT)  # before any backward


def test_megatron_reduces_every_gradient_once_after_the_backward_in_fp32():
    """overlap_grad_reduce off (Megatron's default): one reduce-scatter of the whole fp32 buffer
    after the backward, then the updated bf16 parameters all-gathered after the optimizer."""
    g = graph(M8, Workload(seq_len=16384), Plan(dp=2, cp=4), MEGATRON)
    rs = [op for op in g.ops if op.name.startswith("grads.dense")]
    assert len(rs) == 1 and rs[0].work.collective == "reduce-scatter"
    assert rs[0].work.bytes[0] == pytest.approx(M8.dense_params() * 4 * 7 / 8, rel=EXACT)
    last_backward = max(op.index for op in g.ops if op.phase == "backward")
    assert rs[0].index > last_backward
    assert any(op.name.startswith("updated-params") and op.phase == "param-sync" for op in g.ops)


# ---- FP8 linears: Transformer Engine's cache, the casts ---------------------------------------

def test_te_cached_fp8_weights_add_two_bytes_per_linear_parameter(h200):
    m = llama()
    plan = Plan(dp=2, cp=4)
    w = Workload(seq_len=65536, objective="ar")
    bf16 = timeline(m, w.model_copy(update={"linear_dtype": "bf16"}), plan, MEGATRON, h200)
    fp8 = timeline(m, w.model_copy(update={"linear_dtype": "fp8"}), plan, MEGATRON, h200)
    linears = m.n_layers * (m.mixer_params(m.layers[0]) + m.dense_ffn_params())
    for k in range(len(fp8.moments)):
        assert fp8.breakdown(k, 0).get("fp8") == pytest.approx(2 * linears, rel=EXACT)
        assert "fp8" not in bf16.breakdown(k, 0)
    adamw = [k for k, mo in enumerate(fp8.moments) if mo.phase == "optimizer"][0]
    assert fp8.totals()[adamw] - bf16.totals()[adamw] == pytest.approx(np.full(4, 2 * linears), rel=EXACT)


@pytest.mark.parametrize("impl", [TITAN, MEGATRON])
def test_fp8_casts_are_memory_bound_passes_over_each_linear(impl):
    """Forward: each linear's input and (unless cached) its weight; recompute: the weight again
    only without a cache (TE casts it once per step); backward: output gradients, recast inputs
    and weights as the profile says. Nothing with bf16 linears."""
    m = llama()
    plan = Plan(dp=2, cp=4)
    w = Workload(seq_len=65536, objective="ar", checkpointing="full")
    f = impl.fp8
    casts = {(op.phase, op.name): op.work for op in graph(m, w.model_copy(update={"linear_dtype": "fp8"}),
                                                              plan, impl).ops if op.name.startswith("fp8.")}
    assert not any(op.name.startswith("fp8.") for op in graph(m, w, plan, impl).ops)
    a, h, ffn = m.layers[0], m.hidden, m.ffn
    q = a.n_heads * a.head_dim
    tokens = 65536 / 4
    inputs = tokens * (h + q + h + ffn)
    outputs = tokens * ((m.mixer_params(a) - q * h) / h + h + 2 * ffn + h)
    weights = m.mixer_params(a) + 3 * h * ffn
    cached = f.weight_cache_bytes > 0
    fwd = casts[("forward", "fp8.cast")]
    assert isinstance(fwd, Compute) and fwd.kind == "elementwise" and not any(fwd.flops)
    assert fwd.bytes[0] == pytest.approx(inputs * f.activation_cast_bytes + weights * f.weight_cast_bytes, rel=EXACT)
    rec = casts[("recompute", "fp8.cast")]
    assert rec.bytes[0] == pytest.approx(inputs * f.activation_cast_bytes
                                         + (0 if cached else weights * f.weight_cast_bytes), rel=EXACT)
    bwd = casts[("backward", "fp8.cast-bwd")]
    assert bwd.bytes[0] == pytest.approx(outputs * f.gradient_cast_bytes + inputs * f.backward_input_cast_bytes
                                         + (0 if cached else weights * f.backward_weight_cast_bytes), rel=EXACT)


# ---- TP waits per phase (frameworks.md B2) ------------------------------------------------------

def test_megatron_tp_exposed_in_forward_overlapped_in_backward():
    g = graph(M8, Workload(seq_len=16384), Plan(dp=4, tp=2), MEGATRON)
    by_layer = [op for op in g.ops if op.layer == 3]
    idx = {(op.phase, op.name): op for op in by_layer}
    fwd_gather = idx[("forward", "attn-in.ag")]
    assert fwd_gather.index in idx[("forward", "norm-rope")].deps  # waited on
    bwd_gather = idx[("backward", "attn-out.ag-bwd")]
    assert bwd_gather.index not in idx[("backward", "out-proj-bwd")].deps  # beside dgrad


# ---- interop: an AR job's configuration and back -----------------------------------------------

@pytest.mark.parametrize("fmt", ["torchtitan", "megatron"])
@pytest.mark.parametrize("linear", [None, "fp8"])
@pytest.mark.parametrize("plan", [Plan(dp=8), Plan(cp=8), Plan(dp=2, cp=4, transport="ring"), Plan(dp=4, tp=2)])
def test_ar_job_round_trips_through_the_framework_config(fmt, linear, plan):
    zero = 3 if fmt == "torchtitan" else 1
    w = Workload(seq_len=131072, objective="ar", linear_dtype=linear, zero_stage=zero)
    text = emit(fmt, "llama3.1-8b", w, plan, 1, 8)
    assert "block_diffusion" not in text and "--diffusion-objective" not in text
    if linear == "fp8":
        assert ("enable_float8_linear = true" in text) if fmt == "torchtitan" else ("--fp8-format hybrid" in text)
    run = read(fmt, text)
    assert run.workload == w
    assert run.plan_on(8) == plan
    assert run.unknown_keys == () and run.warnings == ()


def test_emitted_keys_are_the_frameworks_own():
    w = Workload(seq_len=65536, objective="ar", linear_dtype="fp8", zero_stage=3)
    toml = emit("torchtitan", "llama3.1-8b", w, Plan(dp=2, cp=4), 1, 8)
    for key in ("data_parallel_shard_degree = 2", "context_parallel_degree = 4", "tensor_parallel_degree = 1",
                'mode = "full"', "seq_len = 65536", "[float8]", 'fsdp_reshard_after_forward = "default"'):
        assert key in toml
    flags = emit("megatron", "llama3.1-8b", w.model_copy(update={"zero_stage": 1}),
                 Plan(dp=2, cp=4, transport="ring"), 1, 8)
    for flag in ("--context-parallel-size 4", "--cp-comm-type p2p", "--tensor-model-parallel-size 1",
                 "--use-distributed-optimizer", "--fp8-format hybrid"):
        assert flag in flags


def test_te_gathers_the_fp8_norm_output_under_tp():
    """frameworks.md B2: under FP8 the sequence-parallel all-gather into the linears moves the FP8
    copy (1 B per element); the backward's gathers and every bf16 step keep the step dtype."""
    m, plan = llama(), Plan(dp=4, tp=2)
    w = Workload(seq_len=32768, objective="ar")
    def gathers(g):
        return {(op.phase, op.name): op.work for op in g.ops if op.layer == 1 and op.name.endswith(".ag")}
    bf16, fp8 = gathers(graph(m, w, plan, MEGATRON)), gathers(graph(m, w.model_copy(update={"linear_dtype": "fp8"}),
                                                                      plan, MEGATRON))
    for key in (("forward", "attn-in.ag"), ("forward", "mlp-in.ag")):
        assert fp8[key].bytes[0] == pytest.approx(bf16[key].bytes[0] / 2, rel=EXACT)
        assert bf16[key].bytes[0] == pytest.approx(32768 * m.hidden * 2 / 2, rel=EXACT)  # half received
    titan = gathers(graph(m, w.model_copy(update={"linear_dtype": "fp8"}), plan, TITAN))
    assert titan[("forward", "attn-in.ag")].bytes == bf16[("forward", "attn-in.ag")].bytes


@pytest.mark.parametrize("name", ["torchtitan", "megatron-te"])
@pytest.mark.parametrize("transport", ["collective", "ring"])
def test_both_profiles_price_block_diffusion_on_dp_and_cp(name, transport, h200):
    """BD3-LM's 2L step under the frameworks' mechanisms (no BP): the graph builds, the step
    has attention calls on the profile's kernel family and a finite peak."""
    w = Workload(seq_len=16384)
    kernel = {"torchtitan": "fa2", "megatron-te": "cudnn"}[name]
    for plan in (Plan(dp=2, cp=4, transport=transport), Plan(dp=8)):
        g = graph(M8, w, plan, name)
        calls = [op.work for op in g.ops if isinstance(op.work, Compute) and op.work.kind.startswith("attention")]
        assert calls and {c.kernel for c in calls} == {kernel}
        assert np.isfinite(estimate(M8, w, plan, name, h200).peak_gib)


def test_torchtitan_loss_buffers_are_what_cross_entropy_keeps_alive():
    """The profile's [rows, V] loss buffers (frameworks.md A3 plus our inference about
    F.cross_entropy) against live tensor bytes counted on CPU by the runtime's tracker (the
    quantity max_memory_allocated gives; the autograd graph of these ops is the device's):
    forward: the bf16 logits (alive before) + the fp32 copy + log_softmax's output; backward:
    three fp32 buffers at once. Tolerance: the scalar loss and labels add bytes that do not
    grow with the logits (< 1e-4 B per logit here)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from csbp.runtime.memory.memory_tracker import AllocatedBytes

    rows, vocab = 512, 8192
    torch.manual_seed(0)
    pred = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,))
    mode = AllocatedBytes()
    with mode:
        base = mode.now
        loss = F.cross_entropy(pred.float(), labels)
        forward = (mode.peak - base) / (rows * vocab) + 2  # + the bf16 logits themselves
        mode.peak = mode.now
        loss.backward()
        backward = (mode.peak - base) / (rows * vocab)
    assert forward == pytest.approx(sum(TITAN.loss.logits_buffers), abs=1e-4)
    assert backward == pytest.approx(sum(TITAN.loss.backward_tile_bytes), abs=1e-4)


@pytest.mark.parametrize("implementation, transport", [("megatron-te", "ring"), ("torchtitan", "collective"),
                                                       ("turbo-dllm", "collective")])
def test_a_plan_without_transport_runs_the_frameworks_default(implementation, transport):
    """Megatron's cp_comm_type defaults to p2p (a ring), TorchTitan's rotate method to allgather
    (frameworks.md A, B1): `csbp simulate` without --transport runs that; --transport wins."""
    from csbp.simulator.commands.cli import build_parser
    from csbp.simulator.commands.cli_args import plan_from_args

    base = ["simulate", "--model", "llama3.1-8b", "--plan", "cp=8", "--implementation", implementation]
    parser = build_parser(base)
    assert plan_from_args(parser.parse_args(base)).transport == transport
    assert plan_from_args(parser.parse_args(base + ["--transport", "collective"])).transport == "collective"
