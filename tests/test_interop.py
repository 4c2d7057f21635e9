"""Interop: emit -> read gives the same run back; golden files; bad input is one clear line.

Set CSBP_UPDATE_GOLDEN=1 to rewrite the golden files after an intended format change.
"""

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from csbp.simulator.workload.objectives import default_objective
from csbp.simulator.errors import InputError
from csbp.simulator.interop import FORMATS, emit, read
from csbp.simulator.interop.turbo_dllm import STRIPED_PLACEMENT
from csbp.simulator.plan.plan import DEFAULT_PLACEMENT, Plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import Workload

GOLDEN = Path(__file__).parent / "golden" / "interop"
MODELS = ("nemotron-diffusion-8b", "qwen3-8b", "diffusiongemma-26b-a4b", "tiny")
DTYPES = {"turbo-dllm": ("bf16", "fp16"), "megatron": ("bf16", "fp16", "fp32"),
          "torchtitan": ("bf16", "fp32")}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def runs(draw, fmt: str):
    """A valid (model, workload, plan, cluster) that `fmt` can express."""
    model_name = draw(st.sampled_from(MODELS))
    model = load_model(model_name)
    nodes, gpus_per_node = draw(st.integers(1, 2)), draw(st.sampled_from([4, 8]))
    world = nodes * gpus_per_node
    tp = draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([1, 2])) if model.is_moe else 1
    ctx = draw(st.sampled_from(divisors(world // (tp * ep))))
    kinds = ["cp", "bp", "csbp"] if fmt == "turbo-dllm" else ["cp"]
    kind = draw(st.sampled_from(kinds)) if ctx > 1 else "dp"
    cp = {"dp": 1, "cp": ctx, "bp": 1, "csbp": draw(st.sampled_from(divisors(ctx)))}[kind]
    bp = ctx if kind in ("bp", "csbp") else 1
    placements = [DEFAULT_PLACEMENT, STRIPED_PLACEMENT] if fmt == "turbo-dllm" else [DEFAULT_PLACEMENT]
    plan = Plan(dp=world // (tp * ep * ctx), tp=tp, ep=ep, cp=cp, bp=bp,
                transport=draw(st.sampled_from(["collective", "ring"])),
                placement=draw(st.sampled_from(placements)))
    zeros = {"turbo-dllm": [0, 2, 3], "megatron": [0, 1, 2, 3],
             "torchtitan": [2, 3] + ([0] if cp == 1 and ep == 1 else [])}[fmt]
    objectives = (["bd3lm", "fast-dllm-v2", "diffusiongemma", "dflash2"] if fmt == "turbo-dllm"
                  else [default_objective(model)])
    block = draw(st.sampled_from([32, 256]))
    workload = Workload(seq_len=block * draw(st.sampled_from([64, 1024])), block_size=block,
                        objective=draw(st.sampled_from(objectives)), micro_batch=draw(st.integers(1, 2)),
                        dtype=draw(st.sampled_from(DTYPES[fmt])),
                        checkpointing=draw(st.sampled_from(["full", "none"])),
                        zero_stage=draw(st.sampled_from(zeros)))
    try:
        plan.check_against(model, workload, world)
    except InputError:
        assume(False)
    return model_name, workload, plan, nodes, gpus_per_node


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_round_trip(fmt, data):
    model_name, workload, plan, nodes, gpus_per_node = data.draw(runs(fmt))
    try:
        text = emit(fmt, model_name, workload, plan, nodes, gpus_per_node)
    except InputError as err:  # Turbo-dLLM cannot stripe fused CP/BP groups over nodes
        assert fmt == "turbo-dllm" and "inter_node_cp" in str(err)
        assume(False)
    run = read(fmt, text)
    world = nodes * gpus_per_node
    back = run.plan_on(world)
    assert run.model == model_name
    assert run.workload == workload
    assert (back.axes(), back.transport, back.schedule) == (plan.axes(), plan.transport, plan.schedule)
    assert run.gpus == (None if fmt == "turbo-dllm" else world)
    assert run.unknown_keys == () and run.warnings == ()
    if fmt != "turbo-dllm":
        assert back == plan
    # Turbo-dLLM has two placements: the one read back must emit the same text again
    assert emit(fmt, run.model, run.workload, back, nodes, gpus_per_node) == text


GOLDEN_CASES = {
    "turbo-dllm.yaml": ("turbo-dllm", "nemotron-diffusion-8b", Plan(dp=2, cp=8, bp=8)),
    "megatron.txt": ("megatron", "nemotron-diffusion-8b", Plan(cp=16)),
    "torchtitan.toml": ("torchtitan", "nemotron-diffusion-8b", Plan(cp=16)),
    # the DiffusionGemma 256K recipe: EP 2 with the matched CP/BP group striped over both nodes
    "turbo-dllm-diffusiongemma.yaml": ("turbo-dllm", "diffusiongemma-26b-a4b",
                                       Plan(ep=2, cp=8, bp=8, placement=STRIPED_PLACEMENT)),
}


@pytest.mark.parametrize("name", GOLDEN_CASES)
def test_golden(name):
    fmt, model_name, plan = GOLDEN_CASES[name]
    objective = default_objective(load_model(model_name))
    text = emit(fmt, model_name, Workload(seq_len=262144, objective=objective), plan, 2, 8)
    path = GOLDEN / name
    if os.environ.get("CSBP_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()
    assert read(fmt, path.read_text()).plan_on(16) == plan


def one_line_error(fmt: str, text: str, **kwargs) -> str:
    with pytest.raises(InputError) as info:
        read(fmt, text, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{fmt}: ")
    return message


def golden_text(name: str) -> str:
    return (GOLDEN / name).read_text()


# ---- Turbo-dLLM ----

def test_turbo_typo_is_listed_with_a_suggestion():
    text = golden_text("turbo-dllm.yaml").replace("  context_parallel_size: 8\n", "") + \
        "topolgy:\n  context_parallel_size: 8\n"
    run = read("turbo-dllm", text)
    assert run.unknown_keys == ("topolgy.context_parallel_size",)
    assert run.warnings == ("turbo-dllm: unknown key topolgy.context_parallel_size ignored: "
                            "did you mean topology.context_parallel_size?",)
    assert run.plan.cp == 4  # Turbo-dLLM's default, as the framework itself would run it


def test_turbo_lists_keys_it_does_not_model():
    text = golden_text("turbo-dllm.yaml").replace(
        "  placement_policy: auto", "  placement_policy: auto\n  tensor_parallel_overlap: true")
    run = read("turbo-dllm", text + "scheduler:\n  type: cosine\n")
    assert run.unknown_keys == ("topology.tensor_parallel_overlap", "scheduler.type")
    # a real Turbo-dLLM key close to a known one is not taken for a typo
    assert run.warnings == ("turbo-dllm: csbp ignores 2 key(s) it does not model: "
                            "topology.tensor_parallel_overlap, scheduler.type",)


@pytest.mark.parametrize("change,expected", [
    (("block_parallel_size: 8", "block_parallel_size: 4"),
     "topology: fused CP/BP needs block_parallel_size >= context_parallel_size "
     "(got context_parallel_size=8, block_parallel_size=4) (Turbo-dLLM rule)"),
    (("block_parallel_size: 8", "block_parallel_size: 12"), "divisible by context_parallel_size"),
    (("context_parallel_size: 8", "context_parallel_size: 1"), "set replicate_clean_prefix: true"),
    (("expert_parallel_size: 1", "expert_parallel_size: 2"),
     "topology: expert_parallel_size=2 needs a MoE model; nemotron-diffusion-8b is dense (Turbo-dLLM rule)"),
    (("  placement_policy: auto", "  placement_policy: auto\n  pipeline_parallel_size: 2"),
     "pipeline parallelism is not used"),
    (("placement_policy: auto", "placement_policy: rack_local"), "topology.placement_policy 'rack_local'"),
    (("placement_policy: auto", "placement_policy: [auto]"), "topology.placement_policy ['auto']"),
    (("tensor_parallel_size: 1", "tensor_parallel_size: 2"), "without sequence_parallel"),
    (("backend: deepspeed_zero2", "backend: adafactor"), "optimizer.backend 'adafactor'"),
    (("dtype: bf16", "dtype: fp32"), "model.dtype 'fp32'"),
    (("seq_len: 262144", "seq_len: 262100"), "not a multiple of block-size"),
    (("seq_len: 262144", "seq_len: lots"), "model.seq_len must be an integer"),
    (("nvidia/Nemotron-Labs-Diffusion-8B", "acme/unknown-7b"), "model.id 'acme/unknown-7b' is neither"),
])
def test_turbo_impossible_runs_name_the_rule(change, expected):
    text = golden_text("turbo-dllm.yaml").replace(*change)
    assert expected in one_line_error("turbo-dllm", text)


def test_turbo_malformed_yaml():
    assert "malformed YAML at line" in one_line_error("turbo-dllm", "model:\n  id: [unclosed\n")
    assert "a RunSpec is a mapping" in one_line_error("turbo-dllm", "- just\n- a list\n")


def test_turbo_backends_and_pure_bp():
    text = golden_text("turbo-dllm.yaml")
    fsdp = read("turbo-dllm", text.replace("backend: deepspeed_zero2",
                                           "backend: fsdp\n  fsdp_sharding_strategy: shard_grad_op"))
    assert fsdp.workload.zero_stage == 2
    auto = read("turbo-dllm", text.replace("backend: deepspeed_zero2", "backend: auto"))
    assert auto.workload.zero_stage == 2
    pure = text.replace("context_parallel_size: 8", "context_parallel_size: 1").replace(
        "replicate_clean_prefix: false", "replicate_clean_prefix: true")
    assert read("turbo-dllm", pure).plan.kind == "bp"


def test_turbo_model_from_a_local_config(tmp_path):
    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 256, "intermediate_size": 128}
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    text = golden_text("turbo-dllm.yaml").replace("nvidia/Nemotron-Labs-Diffusion-8B", "ckpt").replace(
        "seq_len: 262144", "seq_len: 4096")
    run = read("turbo-dllm", text, base_dir=tmp_path)
    assert run.model == str(tmp_path / "ckpt")
    assert load_model(run.model).hidden == 64


# ---- Megatron-LM ----

def test_megatron_reads_a_launch_line():
    text = ("torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py \\\n"
            "  --num-layers 34 --hidden-size 4096 --num-attention-heads 32 \\\n"
            "  --seq-length=131072 --micro-batch-size 1 --global-batch-size 4 --bf16 \\\n"
            "  --tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 2 \\\n"
            "  --lr 1e-5  # the optimizer is not csbp's business\n")
    run = read("megatron", text)
    assert run.model == "nemotron-diffusion-8b"  # found by its shape flags
    assert (run.plan.dp, run.plan.tp, run.plan.cp, run.plan.transport) == (4, 2, 2, "ring")
    assert run.gpus == 16 and run.workload.seq_len == 131072
    assert run.workload.checkpointing == "none" and run.workload.zero_stage == 0
    assert run.unknown_keys == ("--nproc_per_node", "--nnodes", "--lr")


def test_megatron_typo_gets_a_suggestion():
    run = read("megatron", golden_text("megatron.txt") + "--context-paralel-size 4\n")
    assert run.unknown_keys == ("--context-paralel-size",)
    assert "did you mean --context-parallel-size?" in run.warnings[0]


@pytest.mark.parametrize("change,expected", [
    (("--context-parallel-size 16", "--context-parallel-size 16 --pipeline-model-parallel-size 2"),
     "pipeline parallelism"),
    (("--expert-model-parallel-size 1", "--expert-model-parallel-size 2"),
     "--expert-model-parallel-size 2 needs a MoE model (--num-experts); nemotron-diffusion-8b is dense"),
    (("--cp-comm-type all_gather", "--cp-comm-type a2a"), "--cp-comm-type 'a2a' is not one csbp models"),
    (("--recompute-method uniform", "--recompute-method block"), "--recompute-method uniform"),
    (("--num-layers 34", "--num-layers 32"), "--num-layers 32 disagrees with nemotron-diffusion-8b (34)"),
    (("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 2"), "without --sequence-parallel"),
    (("--global-batch-size 1", "--global-batch-size 3 --micro-batch-size 2"), "not a multiple"),
    (("--seq-length 262144", "--seq-length 262144 --fp16"), "mutually exclusive"),
    (("--cp-comm-type all_gather", "--cp-comm-type 'all_gather"), "malformed command line"),
])
def test_megatron_impossible_runs_name_the_rule(change, expected):
    text = golden_text("megatron.txt").replace(*change)
    assert expected in one_line_error("megatron", text)


def test_megatron_cannot_express_block_parallelism():
    with pytest.raises(InputError, match=r"^megatron cannot express block parallelism \(bp=8\): "
                                          r"emit the baseline plan$"):
        emit("megatron", "nemotron-diffusion-8b", Workload(seq_len=262144), Plan(dp=2, cp=8, bp=8), 2, 8)


def test_megatron_without_world_size_fills_dp_from_the_cluster():
    text = golden_text("megatron.txt").replace("--global-batch-size 1 \\\n", "").replace(
        "--context-parallel-size 16", "--context-parallel-size 8")
    run = read("megatron", text)
    assert run.gpus is None and run.plan.dp == 1
    assert run.plan_on(16).dp == 2


# ---- TorchTitan ----

@pytest.mark.parametrize("change,expected", [
    (("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 2"), "pipeline parallelism"),
    (("expert_parallel_degree = 1", "expert_parallel_degree = 2"), "needs a MoE model"),
    (('mode = "full"', 'mode = "selective"'),
     "activation_checkpoint.mode 'selective' is not one csbp models"),
    (("data_parallel_replicate_degree = 1", "data_parallel_replicate_degree = 2"), "HSDP"),
    (("context_parallel_degree = 16", "context_parallel_degree = 16\ncontext_parallel_degree = 8"),
     "malformed TOML"),
])
def test_torchtitan_impossible_runs_name_the_rule(change, expected):
    text = golden_text("torchtitan.toml").replace(*change)
    assert expected in one_line_error("torchtitan", text)


def test_torchtitan_typo_and_fill_degree():
    text = golden_text("torchtitan.toml").replace("data_parallel_shard_degree = 1",
                                                  "data_parallel_shard_degree = -1")
    text = text.replace("context_parallel_degree = 16",
                        "context_parallel_degree = 8\ncontext_paralel_degree = 4")
    run = read("torchtitan", text)
    assert run.unknown_keys == ("parallelism.context_paralel_degree",)
    assert "did you mean parallelism.context_parallel_degree?" in run.warnings[0]
    assert run.gpus is None and run.plan_on(16).dp == 2


def test_torchtitan_zero_stages_it_cannot_express():
    w = Workload(seq_len=262144, zero_stage=1)
    with pytest.raises(InputError, match="no ZeRO-1"):
        emit("torchtitan", "nemotron-diffusion-8b", w, Plan(cp=16), 2, 8)
    with pytest.raises(InputError, match="ZeRO-0 cannot be expressed"):
        emit("torchtitan", "nemotron-diffusion-8b", w.model_copy(update={"zero_stage": 0}), Plan(cp=16), 2, 8)


def test_unknown_format():
    with pytest.raises(InputError, match="unknown format 'deepspeed'"):
        read("deepspeed", "")
