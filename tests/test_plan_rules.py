"""The shape rules (simulator/plan/rules.py): the planner proposes only plans frameworks can run,
and `csbp simulate`, `csbp run` and the runtime refuse the others with the same line (issue 27).

`runnable()` below is an independent statement of the rules the issue names (TP divides every
attention layer's query and K/V heads and a linear-attention layer's key and value heads, EP
divides the experts, TP divides the vocabulary and FFN width), so a rule dropped from
`plan_rules.violation` fails here rather than agreeing with itself.
"""

from __future__ import annotations

import json

import pytest

import csbp
from csbp.simulator.plan import rules as plan_rules
from csbp.simulator.commands.cli import main as csbp_main
from csbp.simulator.errors import InputError
from csbp.simulator.workload.hf_config import model_from_hf_config
from csbp.simulator.workload.objectives import default_objective
from csbp.simulator.plan.plan import Plan
from csbp.simulator.planner.planner import enumerate_space, family, plan_of
from csbp.simulator.workload.presets import PRESET_NAMES, load_model
from csbp.simulator.workload.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload.workload import Workload

K = 1024
QWEN3 = load_model("qwen3-8b")  # 32 query heads, 8 K/V heads
KV_LINE = "tp=16 does not divide the 8 K/V heads of layer 0"

# the Hugging Face configs the other tests read (test_spec.py, test_fuzz.py, test_interop.py)
HF_CONFIGS = {
    "qwen3-dense": {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False},
    "qwen3-next-hybrid-moe": {
        "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "intermediate_size": 5120, "vocab_size": 151936, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 64,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512},
    "gemma3-sliding": {"text_config": {
        "model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 12,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "intermediate_size": 6912, "vocab_size": 262144, "sliding_window": 512,
        "sliding_window_pattern": 6}},
    "llama-small": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 256,
                    "tie_word_embeddings": False},
}


def runnable(model: ModelSpec, plan: Plan | dict) -> bool:
    """The issue's rules, written apart from plan_rules.py."""
    tp, ep = (plan.tp, plan.ep) if isinstance(plan, Plan) else (plan["tp"], plan["ep"])
    heads = all(layer.n_heads % tp == 0 and layer.n_kv_heads % tp == 0 for layer in model.layers)
    experts = model.moe.n_experts % ep == 0 if model.moe else ep == 1
    ffn = model.moe.dense_ffn if model.moe else model.ffn
    return heads and experts and model.vocab % tp == 0 and ffn % tp == 0


def hf_model(tmp_path, name: str) -> ModelSpec:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(HF_CONFIGS[name]))
    return model_from_hf_config(path)


def workload(model: ModelSpec, seq_len: int = 64 * K, block: int = 256) -> Workload:
    return Workload(seq_len=seq_len, block_size=block, objective=default_objective(model))


def assert_space_runnable(model: ModelSpec, w: Workload, gpus: int) -> None:
    space = enumerate_space(model, w, gpus)
    assert space.candidates, f"{model.name} on {gpus} GPUs: nothing left"
    for cand in space.candidates:
        assert runnable(model, cand.plan), f"{model.name}: {cand.label}"
        assert plan_rules.violation(model, cand.workload, cand.plan) is None, cand.label


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_plan_space_keeps_the_rules(name):
    model = load_model(name)
    for seq_len, block in ((256 * K, 256), (1024 * K, 256), (16 * K, 16)):  # study, small blocks
        for gpus in (8, 16, 32, 64):
            assert_space_runnable(model, workload(model, seq_len, block), gpus)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_every_hf_config_plan_space_keeps_the_rules(name, tmp_path):
    model = hf_model(tmp_path, name)
    for gpus in (8, 32):
        assert_space_runnable(model, workload(model), gpus)


def test_qwen3_8b_space_has_every_tp_the_rules_allow():
    """Not over-strict: TP 1-8 stay (they divide 8 K/V heads), 16 and 32 go with the rule's line."""
    space = enumerate_space(QWEN3, workload(QWEN3, 1024 * K), 32)
    assert {c.plan.tp for c in space.candidates} == {1, 2, 4, 8}
    groups = {g.reason: g for g in space.groups()}
    kv = groups["rule: tp does not divide the N K/V heads of layer N"]
    assert set(kv.plans) == {"dp=2,tp=16", "tp=32", "tp=16,cp=2", "tp=16,bp=2", "tp=16,cp=2,bp=2"}
    assert kv.example.startswith(KV_LINE)


def assert_planned_runnable(model: ModelSpec, planned) -> None:
    found = planned.found
    shown = [found.recommended, found.baseline, *found.best_per_family().values(), *found.ranked]
    for r in shown:
        assert r is not None and runnable(model, plan_of(r)), r.plan["label"]
    out = planned.to_json()
    for r in (out["recommended"], out["baseline"], *out["candidates"]):
        assert runnable(model, r["plan"]), r["plan"]["label"]
    assert {family(r.plan) for r in found.ranked} >= {"cp", "csbp"}


def test_qwen3_8b_on_32_h100_at_1m_is_compared_with_a_runnable_baseline():
    """The issue's job: its baseline was dp=2,tp=16 (TP 16 over 8 K/V heads)."""
    planned = csbp.plan(model="qwen3-8b", hardware="h100", nodes=4, seq_len="1m", jobs=1)
    assert_planned_runnable(QWEN3, planned)
    assert planned.baseline.plan["tp"] <= 8


@pytest.mark.parametrize("flags", [
    dict(model="diffusiongemma-26b-a4b", seq_len="64k", nodes=1, engine="closed-form"),  # 2 K/V heads
    dict(model="qwen3.5-27b", seq_len="64k", nodes=1, engine="closed-form"),  # 4 K/V heads, linear
], ids=["gemma", "qwen35"])
def test_study_models_are_planned_with_runnable_plans(flags):
    planned = csbp.plan(jobs=1, **flags)
    assert_planned_runnable(load_model(flags["model"]), planned)


def test_hf_config_is_planned_with_runnable_plans(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS["qwen3-next-hybrid-moe"]))
    planned = csbp.plan(model=str(path), seq_len="16k", nodes=1, engine="closed-form", jobs=1)
    assert_planned_runnable(model_from_hf_config(path), planned)


def error_line(argv: list[str], capsys) -> str:
    assert csbp_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_simulate_and_run_refuse_tp_over_kv_heads_with_the_rule_line(capsys):
    job = ["--model", "qwen3-8b", "--seq-len", "16k", "--plan", "tp=16"]
    simulated = error_line(["simulate", *job, "--hardware", "h100", "--nodes", "2"], capsys)
    ran = error_line(["run", *job], capsys)  # refused while reading the job: nothing is spawned
    with pytest.raises(InputError) as err:
        plan_rules.check(QWEN3, workload(QWEN3, 16 * K), Plan(tp=16))
    assert simulated == ran == f"csbp: error: {err.value}"
    assert str(err.value).startswith(KV_LINE)


def test_runtime_refuses_what_the_rules_refuse():
    from csbp.runtime.distributed.plans import check_supported

    w = Workload(seq_len=4 * K, block_size=256, objective="bd3lm")
    for plan, line in [(Plan(tp=16), KV_LINE), (Plan(tp=64), "tp=64 does not divide 32 attention heads")]:
        with pytest.raises(InputError, match=f"^{line}"):
            check_supported(QWEN3, w, plan)
    tiny, odd = load_model("tiny"), Workload(seq_len=9, block_size=3)  # 9 noisy, 9 clean rows
    with pytest.raises(InputError, match="sequence parallelism splits each evenly"):
        check_supported(tiny, odd, Plan(tp=2))
    with pytest.raises(InputError, match="sequence parallelism splits each evenly"):
        Plan(tp=2).check_against(tiny, odd)


def test_linear_attention_key_and_value_heads_and_experts():
    def linear(keys: int, values: int) -> ModelSpec:
        layer = AttentionSpec(kind="linear", n_heads=values, n_kv_heads=keys, head_dim=8)
        return ModelSpec(name="linear", hidden=64, ffn=128, vocab=256, layers=(layer,))

    w = Workload(seq_len=1 * K, block_size=64)
    assert plan_rules.violation(linear(2, 6), w, Plan(tp=2)) is None
    assert plan_rules.violation(linear(2, 6), w, Plan(tp=4)) == \
        "tp=4 does not divide 2 linear-attention key heads"
    assert plan_rules.violation(linear(2, 3), w, Plan(tp=2)) == \
        "tp=2 does not divide 3 linear-attention value heads"
    moe = load_model("tiny-moe")  # 8 experts
    assert plan_rules.violation(moe, w, Plan(ep=8)) is None
    assert plan_rules.violation(moe, w, Plan(ep=16)) == "ep=16 does not divide the 8 experts"
    assert plan_rules.violation(QWEN3, w, Plan(ep=2)) == "ep=2 needs a MoE model; qwen3-8b is dense"


def test_an_implementation_profile_may_replicate_kv_heads(tmp_path, capsys):
    profile = tmp_path / "replicating.yaml"
    profile.write_text("name: replicating\nnotes: replicates K/V heads over TP\n"
                       "tp_replicates_kv_heads: {value: true, source: \"vLLM-style replication\"}\n")
    w = workload(QWEN3, 16 * K)
    assert plan_rules.violation(QWEN3, w, Plan(tp=16), str(profile)) is None
    assert plan_rules.violation(QWEN3, w, Plan(tp=16)).startswith(KV_LINE)  # default: strict
    for shipped in ("turbo-dllm", "ideal", "csbp-runtime"):
        assert plan_rules.violation(QWEN3, w, Plan(tp=16), shipped).startswith(KV_LINE)
    six = ModelSpec(name="six", hidden=96, ffn=128, vocab=256,
                    layers=(AttentionSpec(n_heads=12, n_kv_heads=6, head_dim=8),))
    assert "must be a multiple" in plan_rules.violation(six, w, Plan(tp=4), str(profile))
    assert any(c.plan.tp == 16 for c in
               enumerate_space(QWEN3, w, 16, implementation=str(profile)).candidates)
    assert csbp_main(["simulate", "--model", "qwen3-8b", "--seq-len", "16k", "--plan", "tp=16",
                      "--hardware", "h100", "--nodes", "2", "--engine", "closed-form",
                      "--implementation", str(profile), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["tp"] == 16
