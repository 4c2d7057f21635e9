"""Turbo-dLLM RunSpec YAML: the reference implementation of CSBP, so every plan fits it.

Key names, defaults and rules follow the RunSpec of `turbo-dllm` 0.1.6 (PyPI). The RunSpec
names no data-parallel degree and no world size (the launcher decides both), so a read-back
plan has dp = 1 until `ImportedRun.plan_on(world)`; the emitted YAML says the intended world in
a comment. Optimizer backends: replicated AdamW = ZeRO-0, `deepspeed_zero2` = ZeRO-2, `fsdp2`
(full_shard) = ZeRO-3; Turbo-dLLM has no ZeRO-1 backend.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from csbp.simulator.errors import InputError
from csbp.simulator.interop.common import (ImportedRun, as_bool, as_int, check_emittable, checkpoint_id,
                                      choice, flatten, key_for, make_plan, make_workload,
                                      resolve_model, settings, unknown_key_warnings)
from csbp.simulator.plan.plan import DEFAULT_PLACEMENT, Plan
from csbp.simulator.workload.workload import Workload

FMT = "turbo-dllm"
# Turbo-dLLM's `inter_node_cp` keeps TP node-local and stripes each CP/BP group over all nodes:
# in csbp's terms the context axis is outermost.
STRIPED_PLACEMENT = "tp,ep,dp,ctx"

OBJECTIVES = {"standard_block_diffusion": "bd3lm", "fast_dllm_v2": "fast-dllm-v2",
              "diffusiongemma_native_sft": "diffusiongemma", "dflash_distillation": "dflash2"}
TRANSPORTS = {"collective": "collective", "streaming": "ring"}
DTYPES = {"bf16": "bf16", "fp16": "fp16"}
PLACEMENTS = {"auto": DEFAULT_PLACEMENT, "inter_node_cp": STRIPED_PLACEMENT}
# backend -> ZeRO stage; "auto" resolves to deepspeed_zero2 on a multi-rank launch
BACKENDS = {"auto": 2, "deepspeed_zero2": 2, "torch_adamw": 0, "torch_fused_adamw": 0,
            "torch_distributed_adamw": 0, "fsdp": None, "fsdp2": None}
FSDP2_SHARDING = {"full_shard": 3, "shard_grad_op": 2}
FSDP_SHARDING = {**FSDP2_SHARDING, "no_shard": 0}
BACKEND_FOR_ZERO = {0: "torch_fused_adamw", 2: "deepspeed_zero2", 3: "fsdp2"}

# The keys csbp reads, with Turbo-dLLM's defaults for those a file leaves out.
DEFAULTS = {
    "model.id": "nvidia/Nemotron-Labs-Diffusion-3B",
    "model.seq_len": 1024,
    "model.dtype": "bf16",
    "objective.name": "standard_block_diffusion",
    "objective.block_size": None,  # Turbo-dLLM: the model family's; csbp: its own default (256)
    "training.batch_size": 1,
    "training.activation_checkpointing": True,
    "training.activation_checkpointing_scope": "full",
    "topology.tensor_parallel_size": 1,
    "topology.sequence_parallel": False,
    "topology.expert_parallel_size": 1,
    "topology.context_parallel_size": 4,
    "topology.block_parallel_size": 4,
    "topology.replicate_clean_prefix": False,
    "topology.placement_policy": "auto",
    "topology.pipeline_parallel_size": 1,  # not a RunSpec key: read only to name the rule
    "kernel.cp_bp_clean_kv_transport": "collective",
    "kernel.cp_bp_clean_kv_layout": "zigzag",
    "optimizer.backend": "auto",
    "optimizer.fsdp_sharding_strategy": "full_shard",
}


def _rule(message: str) -> InputError:
    return InputError(f"{FMT}: {message} (Turbo-dLLM rule)")


def _context_group_spans_nodes(plan: Plan, placement: str, gpus_per_node: int) -> bool:
    """Whether one CP/BP group reaches past a node under an axis order (innermost first)."""
    sizes = {"tp": plan.tp, "ctx": plan.ctx, "ep": plan.ep, "dp": plan.dp}
    order = placement.split(",")
    stride = math.prod(sizes[axis] for axis in order[:order.index("ctx")])
    return (plan.ctx - 1) * stride >= gpus_per_node


def _placement_policy(plan: Plan, nodes: int, gpus_per_node: int) -> str:
    if not _context_group_spans_nodes(plan, plan.placement, gpus_per_node):
        return "auto"
    if plan.cp > 1 and plan.bp in (1, plan.cp) and nodes > 1 and plan.ctx % nodes == 0:
        return "inter_node_cp"
    if _context_group_spans_nodes(plan, DEFAULT_PLACEMENT, gpus_per_node):
        return "auto"  # the group outgrows a node anyway; auto packs it over contiguous nodes
    raise _rule(f"placement {plan.placement} stripes the CP/BP group over nodes, which "
                "placement_policy inter_node_cp allows only for CP-only or matched CP/BP")


def emit(model_name: str, workload: Workload, plan: Plan, nodes: int, gpus_per_node: int) -> str:
    check_emittable(FMT, model_name, workload, plan, nodes * gpus_per_node, block_parallel=True)
    if workload.dtype not in DTYPES:
        raise _rule(f"model.dtype must be bf16 or fp16, not {workload.dtype}")
    if workload.zero_stage not in BACKEND_FOR_ZERO:
        raise _rule(f"no optimizer.backend shards like ZeRO-{workload.zero_stage} "
                    "(deepspeed_zero2 = 2, fsdp2 = 3, torch_fused_adamw = 0)")
    if plan.bp > 1 and plan.schedule != "dual-end":
        raise _rule(f"block parallelism schedules blocks dual-end only, not {plan.schedule}")
    training: dict[str, object] = {"batch_size": workload.micro_batch,
                                   "activation_checkpointing": workload.checkpointing == "full"}
    if workload.checkpointing == "full":
        training["activation_checkpointing_scope"] = "full"
    spec = {
        "model": {"id": checkpoint_id(model_name), "seq_len": workload.seq_len, "dtype": workload.dtype},
        "objective": {"name": key_for(OBJECTIVES, workload.objective), "block_size": workload.block_size},
        "training": training,
        "topology": {
            "tensor_parallel_size": plan.tp,
            "sequence_parallel": plan.tp > 1,
            "expert_parallel_size": plan.ep,
            "context_parallel_size": plan.cp,
            "block_parallel_size": plan.bp,
            "replicate_clean_prefix": plan.kind == "bp",
            "placement_policy": _placement_policy(plan, nodes, gpus_per_node),
        },
        "kernel": {"cp_bp_clean_kv_transport": key_for(TRANSPORTS, plan.transport)},
        "optimizer": {"backend": BACKEND_FOR_ZERO[workload.zero_stage]},
    }
    header = (f"# csbp plan {plan.label()} on {nodes} x {gpus_per_node} GPUs: data parallelism "
              f"{plan.dp} follows from launching {plan.world} ranks\n")
    return header + yaml.safe_dump(spec, sort_keys=False)


def _load(text: str) -> dict[str, object]:
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise InputError(f"{FMT}: malformed YAML{where}: {problem}") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise InputError(f"{FMT}: a RunSpec is a mapping of sections, got {type(tree).__name__}")
    return flatten(tree)


def read(text: str, *, base_dir: Path | None = None) -> ImportedRun:
    flat = _load(text)
    get, unknown = settings(flat, DEFAULTS)

    model_name, model = resolve_model(FMT, "model.id", get("model.id"), base_dir)
    key = "training.activation_checkpointing"
    checkpointing = as_bool(FMT, key, get(key))
    scope = get("training.activation_checkpointing_scope")
    if checkpointing and scope != "full":
        raise InputError(f"{FMT}: training.activation_checkpointing_scope {scope!r}: csbp models "
                         "full activation checkpointing only")
    backend = get("optimizer.backend")
    zero = choice(FMT, "optimizer.backend", backend, BACKENDS)
    if zero is None:  # fsdp / fsdp2: the sharding strategy says which ZeRO stage
        key = "optimizer.fsdp_sharding_strategy"
        zero = choice(FMT, key, get(key), FSDP_SHARDING if backend == "fsdp" else FSDP2_SHARDING)
    block = get("objective.block_size")
    workload = make_workload(
        FMT, seq_len=as_int(FMT, "model.seq_len", get("model.seq_len")),
        **({} if block is None else {"block_size": as_int(FMT, "objective.block_size", block)}),
        objective=choice(FMT, "objective.name", get("objective.name"), OBJECTIVES),
        micro_batch=as_int(FMT, "training.batch_size", get("training.batch_size")),
        dtype=choice(FMT, "model.dtype", get("model.dtype"), DTYPES),
        checkpointing="full" if checkpointing else "none", zero_stage=zero)

    degree = {axis: as_int(FMT, f"topology.{key}", get(f"topology.{key}")) for axis, key in (
        ("tp", "tensor_parallel_size"), ("ep", "expert_parallel_size"),
        ("cp", "context_parallel_size"), ("bp", "block_parallel_size"), ("pp", "pipeline_parallel_size"))}
    for axis, value in degree.items():
        if value < 1:
            raise _rule(f"topology: every parallel size must be >= 1 (got {axis}={value})")
    tp, ep, cp, bp = degree["tp"], degree["ep"], degree["cp"], degree["bp"]
    if degree["pp"] > 1:
        raise _rule(f"topology: pipeline parallelism is not used (pipeline_parallel_size={degree['pp']})")
    if cp > 1 and bp > 1 and bp < cp:
        raise _rule(f"topology: fused CP/BP needs block_parallel_size >= context_parallel_size "
                    f"(got context_parallel_size={cp}, block_parallel_size={bp})")
    if cp > 1 and bp > 1 and bp % cp:
        raise _rule(f"topology: fused CP/BP needs block_parallel_size divisible by "
                    f"context_parallel_size (got context_parallel_size={cp}, block_parallel_size={bp})")
    replicate = as_bool(FMT, "topology.replicate_clean_prefix", get("topology.replicate_clean_prefix"))
    if cp == 1 and bp > 1 and not replicate:
        raise _rule("topology: block parallelism without context parallelism replicates the clean "
                    "prefix: set replicate_clean_prefix: true")
    if replicate and not (cp == 1 and bp > 1):
        raise _rule("topology: replicate_clean_prefix needs context_parallel_size=1 and "
                    "block_parallel_size>1")
    sequence_parallel = as_bool(FMT, "topology.sequence_parallel", get("topology.sequence_parallel"))
    if sequence_parallel and tp == 1:
        raise _rule("topology: sequence_parallel needs tensor_parallel_size > 1")
    if tp > 1 and not sequence_parallel:
        raise InputError(f"{FMT}: topology: tensor_parallel_size={tp} without sequence_parallel: "
                         "csbp models tensor parallelism with sequence parallelism only")
    if ep > 1 and not model.is_moe:
        raise _rule(f"topology: expert_parallel_size={ep} needs a MoE model; {model.name} is dense")
    policy = get("topology.placement_policy")
    placement = choice(FMT, "topology.placement_policy", policy, PLACEMENTS)
    if policy == "inter_node_cp" and not (cp > 1 and bp in (1, cp)):
        raise _rule("topology: placement_policy inter_node_cp needs CP-only or matched CP/BP "
                    f"(got context_parallel_size={cp}, block_parallel_size={bp})")
    choice(FMT, "kernel.cp_bp_clean_kv_layout", get("kernel.cp_bp_clean_kv_layout"), {"zigzag": None})
    transport = choice(FMT, "kernel.cp_bp_clean_kv_transport", get("kernel.cp_bp_clean_kv_transport"),
                       TRANSPORTS)
    plan = make_plan(FMT, model, workload, tp=tp, ep=ep, cp=cp, bp=bp, transport=transport,
                     placement=placement)
    return ImportedRun(model=model_name, workload=workload, plan=plan, nodes=None, gpus=None,
                       unknown_keys=tuple(unknown),
                       warnings=unknown_key_warnings(FMT, unknown, list(DEFAULTS)))
