"""TorchTitan job TOML (the JobConfig-era format) for the best plan without block parallelism.

Mapping choices, stated once:
- ZeRO is FSDP2: `data_parallel_shard_degree` with `fsdp_reshard_after_forward = "never"` is
  ZeRO-2 and `"always"` or `"default"` ZeRO-3 (TorchTitan's "default" reshards every block but
  the last, which the torchtitan implementation profile prices: ZeRO-3 is written so); ZeRO-0 is pure replication
  (`data_parallel_replicate_degree`), possible only without CP and EP since TorchTitan applies FSDP
  whenever either is on. ZeRO-1 has no TorchTitan form; HSDP (replicate x shard) is not modelled.
- EP ranks are borrowed from the FSDP shard group, as TorchTitan does: shard degree = dp * ep.
- TP always runs with sequence parallelism in TorchTitan; CP's `context_parallel_rotate_method`
  "allgather" is csbp's collective transport, "alltoall" (K/V shards passed around) its ring.
- TorchTitan has no block-diffusion settings: `[block_diffusion] block_size, objective` is the
  custom JobConfig section a block-diffusion trainer adds; a file without it is a plain
  TorchTitan job: objective ar (written so for an AR workload). `[model] name` holds the csbp
  model (a preset, checkpoint id or config.json path) the trainer registers.
- FP8 linears: `[float8] enable_float8_linear` (torchao Float8, frameworks.md A2); true = linear
  dtype fp8, false = bf16, absent = the implementation profile's default.
- `data_parallel_shard_degree = -1` (fill the rest) leaves the world size to the launcher: the
  read-back plan then has dp = 1 until `ImportedRun.plan_on(world)`.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from csbp.simulator.errors import InputError
from csbp.simulator.interop.common import (ImportedRun, as_bool, as_int, check_emittable, choice, flatten,
                                      key_for, make_plan, make_workload, objective_of,
                                      require_default_placement, resolve_model, settings,
                                      unknown_key_warnings)
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.workload import Workload

FMT = "torchtitan"
RANK_ORDER = "tp-cp-dp_shard-dp_replicate"
ROTATE = {"allgather": "collective", "alltoall": "ring"}
PRECISION = {"bfloat16": "bf16", "float32": "fp32"}
CHECKPOINTING = {"full": "full", "none": "none"}
RESHARD = {"never": 2, "always": 3}

# The keys csbp reads, with TorchTitan's defaults for those a file leaves out.
DEFAULTS: dict[str, object] = {
    "model.name": "llama3",
    "training.seq_len": 2048,
    "training.local_batch_size": 8,
    "training.mixed_precision_param": "bfloat16",
    "parallelism.data_parallel_replicate_degree": 1,
    "parallelism.data_parallel_shard_degree": -1,
    "parallelism.fsdp_reshard_after_forward": "default",
    "parallelism.tensor_parallel_degree": 1,
    "parallelism.context_parallel_degree": 1,
    "parallelism.context_parallel_rotate_method": "allgather",
    "parallelism.expert_parallel_degree": 1,
    "parallelism.pipeline_parallel_degree": 1,
    "activation_checkpoint.mode": "selective",
    "block_diffusion.block_size": 256,
    "block_diffusion.objective": None,  # the model's own objective (no section at all: ar)
    "float8.enable_float8_linear": None,  # absent: the implementation profile's linear dtype
}
FLOAT8 = {True: "fp8", False: "bf16"}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a TOML basic string


def _toml(sections: dict[str, dict[str, object]]) -> str:
    return "\n".join(f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in body.items())
                     for name, body in sections.items())


def emit(model_name: str, workload: Workload, plan: Plan, nodes: int, gpus_per_node: int) -> str:
    check_emittable(FMT, model_name, workload, plan, nodes * gpus_per_node, block_parallel=False)
    require_default_placement(FMT, plan, RANK_ORDER)
    if workload.dtype not in PRECISION.values():
        raise InputError(f"{FMT}: training.mixed_precision_param has no {workload.dtype} (bfloat16, float32)")
    if workload.zero_stage == 1:
        raise InputError(f"{FMT} has no ZeRO-1: FSDP shards gradients too (use zero 2)")
    if workload.zero_stage == 0 and (plan.cp > 1 or plan.ep > 1):
        raise InputError(f"{FMT} applies FSDP whenever CP or EP is on: ZeRO-0 cannot be expressed")
    parallelism: dict[str, object] = {}
    if workload.zero_stage == 0:
        parallelism |= {"data_parallel_replicate_degree": plan.dp, "data_parallel_shard_degree": 1}
    else:
        parallelism |= {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": plan.dp * plan.ep,
                        # ZeRO-3 under FSDP: TorchTitan's own "default" (every block but the last
                        # resharded, frameworks.md A3: what the torchtitan profile prices)
                        "fsdp_reshard_after_forward": "default" if workload.zero_stage == 3 and (
                            plan.dp * plan.ep > 1 or plan.cp > 1) else key_for(RESHARD, workload.zero_stage)}
    parallelism |= {"tensor_parallel_degree": plan.tp, "context_parallel_degree": plan.cp,
                    "context_parallel_rotate_method": key_for(ROTATE, plan.transport),
                    "expert_parallel_degree": plan.ep,
                    "pipeline_parallel_degree": 1}
    header = (f"# csbp plan {plan.label()} on {nodes} x {gpus_per_node} GPUs "
              f"(torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node})\n")
    sections: dict[str, dict[str, object]] = {
        "model": {"name": model_name},
        "training": {"seq_len": workload.seq_len, "local_batch_size": workload.micro_batch,
                     "mixed_precision_param": key_for(PRECISION, workload.dtype)},
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": workload.checkpointing},
    }
    if workload.linear_dtype is not None:
        sections["float8"] = {"enable_float8_linear": key_for(FLOAT8, workload.linear_dtype)}
    if workload.objective != "ar":  # a plain TorchTitan job is autoregressive
        sections["block_diffusion"] = {"block_size": workload.block_size, "objective": workload.objective}
    return header + _toml(sections)


def read(text: str, *, base_dir: Path | None = None) -> ImportedRun:
    try:
        flat = flatten(tomllib.loads(text))
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"{FMT}: malformed TOML: {str(err).splitlines()[0]}") from None
    get, unknown = settings(flat, DEFAULTS)

    def degree(key: str) -> int:
        value = as_int(FMT, f"parallelism.{key}", get(f"parallelism.{key}"))
        if value < 1 and not (key == "data_parallel_shard_degree" and value == -1):
            raise InputError(f"{FMT}: parallelism.{key} must be >= 1, got {value}")
        return value

    model_name, model = resolve_model(FMT, "model.name", get("model.name"), base_dir)
    replicate, shard = degree("data_parallel_replicate_degree"), degree("data_parallel_shard_degree")
    tp, cp = degree("tensor_parallel_degree"), degree("context_parallel_degree")
    ep, pp = degree("expert_parallel_degree"), degree("pipeline_parallel_degree")
    if pp > 1:
        raise InputError(f"{FMT}: parallelism.pipeline_parallel_degree {pp}: block-diffusion CP/BP does "
                         "not use pipeline parallelism and csbp does not model it")
    fsdp = shard != 1 or cp > 1
    if fsdp and replicate > 1:
        raise InputError(f"{FMT}: HSDP (data_parallel_replicate_degree {replicate} with sharding) is not "
                         "modelled: csbp's ZeRO shards over the whole data-parallel group")
    reshard = get("parallelism.fsdp_reshard_after_forward")
    zero = choice(FMT, "parallelism.fsdp_reshard_after_forward", reshard,
                  {**RESHARD, "default": 3 if fsdp else 0})
    if ep > 1 and not model.is_moe:
        raise InputError(f"{FMT}: parallelism.expert_parallel_degree {ep} needs a MoE model; "
                         f"{model.name} is dense")
    if ep > 1 and shard != -1 and shard % ep:
        raise InputError(f"{FMT}: parallelism.expert_parallel_degree {ep} must divide "
                         f"data_parallel_shard_degree {shard}: csbp models EP over data-parallel ranks")
    diffusion = any(k.startswith("block_diffusion.") for k in flat)
    float8 = get("float8.enable_float8_linear")
    workload = make_workload(
        FMT, seq_len=as_int(FMT, "training.seq_len", get("training.seq_len")),
        block_size=as_int(FMT, "block_diffusion.block_size", get("block_diffusion.block_size")),
        objective=objective_of(model, get("block_diffusion.objective")) if diffusion else "ar",
        linear_dtype=None if float8 is None else FLOAT8[as_bool(FMT, "float8.enable_float8_linear", float8)],
        micro_batch=as_int(FMT, "training.local_batch_size", get("training.local_batch_size")),
        dtype=choice(FMT, "training.mixed_precision_param", get("training.mixed_precision_param"), PRECISION),
        checkpointing=choice(FMT, "activation_checkpoint.mode", get("activation_checkpoint.mode"),
                             CHECKPOINTING),
        zero_stage=zero)
    transport = choice(FMT, "parallelism.context_parallel_rotate_method",
                       get("parallelism.context_parallel_rotate_method"), ROTATE)
    dp, gpus = (1, None) if shard == -1 else (replicate * shard // ep, replicate * shard * cp * tp)
    plan = make_plan(FMT, model, workload, dp=dp, tp=tp, ep=ep, cp=cp, transport=transport)
    return ImportedRun(model=model_name, workload=workload, plan=plan, nodes=None, gpus=gpus,
                       unknown_keys=tuple(unknown),
                       warnings=unknown_key_warnings(FMT, unknown, list(DEFAULTS)))
