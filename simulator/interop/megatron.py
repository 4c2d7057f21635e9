"""Megatron-LM command-line flags for the best plan without block parallelism (CP baseline).

Choices that Megatron-LM leaves open, stated once:
- `--seq-length` is the context L: the sample length the data loader reads and the range of
  positions (noisy and clean copies share positions 0..L-1). The block-diffusion script builds
  the 2L [noisy; clean] input that CP shards, so Megatron's "sequence divisible by 2*cp" applies
  to 2L, which is csbp's "L divisible by cp".
- Megatron has no block-diffusion flags; `--block-size` and `--diffusion-objective` are the
  flags a block-diffusion pretrain script adds through Megatron's `extra_args_provider`. A line
  with neither is plain Megatron pretraining: objective ar (an AR workload is written so).
- FP8 linears: `--fp8-format hybrid` (Transformer Engine, E4M3 forward / E5M2 gradients,
  frameworks.md B3; `e4m3` read as fp8 too). Megatron has no flag for bf16 linears: no
  `--fp8-format` reads back as the implementation profile's linear dtype (bf16 for megatron-te).
- The model is named by `--tokenizer-model` (a Hugging Face checkpoint id or directory); the
  shape flags are written too and, on reading, checked against that model, or used to find the
  preset when the tokenizer names none.
- ZeRO: 1 = `--use-distributed-optimizer`; 2 and 3 add Megatron FSDP with
  `--data-parallel-sharding-strategy optim_grads` / `optim_grads_params`.
- Megatron derives DP from the world size; csbp reads it from `--global-batch-size` /
  `--micro-batch-size`, i.e. assumes no gradient accumulation. EP ranks are part of that DP.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from csbp.simulator.errors import InputError
from csbp.simulator.interop.common import (ImportedRun, as_int, check_emittable, checkpoint_id, choice,
                                      key_for, make_plan, make_workload, objective_of,
                                      require_default_placement, resolve_model,
                                      unknown_key_warnings)
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.presets import PRESET_NAMES, load_model
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

FMT = "megatron"
RANK_ORDER = "tp-cp-ep-dp"
CP_COMM = {"all_gather": "collective", "p2p": "ring"}
SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
FSDP_FLAGS = ("--use-megatron-fsdp", "--use-custom-fsdp")  # the latter: its older name

SWITCHES = {"--sequence-parallel", "--use-distributed-optimizer", "--bf16", "--fp16",
            "--group-query-attention", *FSDP_FLAGS}
VALUED = {"--tokenizer-type", "--tokenizer-model", "--seq-length", "--micro-batch-size",
          "--global-batch-size", "--tensor-model-parallel-size", "--context-parallel-size",
          "--cp-comm-type", "--expert-model-parallel-size", "--pipeline-model-parallel-size",
          "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
          "--data-parallel-sharding-strategy", "--block-size", "--diffusion-objective", "--fp8-format"}
FP8_FORMATS = {"hybrid": "fp8", "e4m3": "fp8"}
SHAPES = ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
          "--num-query-groups", "--kv-channels", "--num-experts", "--moe-router-topk",
          "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size")
VALUED |= set(SHAPES)


def shape_flags(model: ModelSpec) -> dict[str, int]:
    """The architecture flags that pin a model's shapes (attention of its first softmax layer)."""
    attn = next(layer for layer in model.layers if layer.kind != "linear")
    flags = {"--num-layers": model.n_layers, "--hidden-size": model.hidden,
             "--num-attention-heads": attn.n_heads, "--num-query-groups": attn.n_kv_heads,
             "--kv-channels": attn.head_dim}
    if model.ffn:
        flags["--ffn-hidden-size"] = model.ffn
    if model.moe:
        flags |= {"--num-experts": model.moe.n_experts, "--moe-router-topk": model.moe.top_k,
                  "--moe-ffn-hidden-size": model.moe.expert_ffn}
        if model.moe.dense_ffn:
            flags["--moe-shared-expert-intermediate-size"] = model.moe.dense_ffn
    return flags


def emit(model_name: str, workload: Workload, plan: Plan, nodes: int, gpus_per_node: int) -> str:
    model = check_emittable(FMT, model_name, workload, plan, nodes * gpus_per_node, block_parallel=False)
    require_default_placement(FMT, plan, RANK_ORDER)
    flags: list[str] = ["--tokenizer-type HuggingFaceTokenizer",
                        f"--tokenizer-model {shlex.quote(checkpoint_id(model_name))}"]
    flags += [f"{flag} {value}" for flag, value in shape_flags(model).items()]
    attn = next(layer for layer in model.layers if layer.kind != "linear")
    if attn.n_kv_heads < attn.n_heads:
        flags.insert(flags.index(f"--num-query-groups {attn.n_kv_heads}"), "--group-query-attention")
    flags += [f"--seq-length {workload.seq_len}", f"--micro-batch-size {workload.micro_batch}",
              f"--global-batch-size {workload.micro_batch * plan.dp * plan.ep}"]
    flags += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[workload.dtype]
    flags.append(f"--tensor-model-parallel-size {plan.tp}")
    if plan.tp > 1:
        flags.append("--sequence-parallel")
    flags += [f"--context-parallel-size {plan.cp}", f"--cp-comm-type {key_for(CP_COMM, plan.transport)}",
              f"--expert-model-parallel-size {plan.ep}"]
    if workload.checkpointing == "full":
        flags += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    if workload.zero_stage >= 1:
        flags.append("--use-distributed-optimizer")
    if workload.zero_stage >= 2:
        sharding = key_for(SHARDING, workload.zero_stage)
        flags += [FSDP_FLAGS[0], f"--data-parallel-sharding-strategy {sharding}"]
    if workload.linear_dtype == "fp8":
        flags.append("--fp8-format hybrid")
    if workload.objective != "ar":  # plain Megatron pretraining is autoregressive
        flags += [f"--block-size {workload.block_size}", f"--diffusion-objective {workload.objective}"]
    header = (f"# csbp plan {plan.label()} on {nodes} x {gpus_per_node} GPUs "
              f"(torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node}); add your data, "
              "optimizer and remaining model flags\n")
    return header + " \\\n".join(flags) + "\n"


def parse_flags(fmt: str, text: str) -> tuple[dict[str, str | bool], list[str]]:
    """Shell text -> {flag: value or True} (last one wins, as in argparse) and the unknown flags.

    Words before the first flag (a launcher, a script path) are not settings and are skipped.
    """
    try:
        words = shlex.split(re.sub(r"\\\r?\n", " ", text), comments=True)
    except ValueError as err:
        raise InputError(f"{fmt}: malformed command line: {err}") from None
    flags: dict[str, str | bool] = {}
    unknown: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        flag, eq, value = word.partition("=")
        if flag in SWITCHES:
            flags[flag] = True
            continue
        if not eq and i < len(words) and not words[i].startswith("--"):
            value, i = words[i], i + 1
        if flag in VALUED:
            if not eq and not value:
                raise InputError(f"{fmt}: {flag} needs a value")
            flags[flag] = value
        elif flag not in unknown:
            unknown.append(flag)
    return flags, unknown


def _model(flags: dict[str, str | bool], base_dir: Path | None) -> tuple[str, ModelSpec]:
    stated = {f: as_int(FMT, f, flags[f]) for f in SHAPES if f in flags}
    if "--tokenizer-model" in flags:
        try:
            name, model = resolve_model(FMT, "--tokenizer-model", flags["--tokenizer-model"], base_dir)
        except InputError:
            if not stated:
                raise
        else:
            expected = shape_flags(model)
            for flag, value in stated.items():
                if expected.get(flag, value) != value:
                    raise InputError(f"{FMT}: {flag} {value} disagrees with {name} ({expected[flag]})")
            return name, model
    if not stated:
        raise InputError(f"{FMT}: name the model with --tokenizer-model (a checkpoint id, csbp preset or "
                         "Hugging Face directory) or give its shape flags (--num-layers, --hidden-size, ...)")
    for name in PRESET_NAMES:
        model = load_model(name)
        if all(shape_flags(model).get(f) == v for f, v in stated.items()):
            return name, model
    shapes = ", ".join(f"{f} {v}" for f, v in stated.items())
    raise InputError(f"{FMT}: no csbp preset has {shapes}: point --tokenizer-model at the "
                     "model's Hugging Face directory (with config.json)")


def _zero_stage(flags: dict[str, str | bool]) -> int:
    if any(f in flags for f in FSDP_FLAGS):
        return choice(FMT, "--data-parallel-sharding-strategy",
                      flags.get("--data-parallel-sharding-strategy", "no_shard"), SHARDING)
    return 1 if "--use-distributed-optimizer" in flags else 0


def _checkpointing(flags: dict[str, str | bool]) -> str:
    granularity = flags.get("--recompute-granularity")
    if granularity is None:
        return "none"
    if granularity != "full":
        raise InputError(f"{FMT}: --recompute-granularity {granularity}: csbp models full recompute only")
    method = flags.get("--recompute-method")
    if method != "uniform":
        raise InputError(f"{FMT}: --recompute-granularity full needs --recompute-method uniform in csbp "
                         f"(got {method or 'none'})")
    return "full"


def read(text: str, *, base_dir: Path | None = None) -> ImportedRun:
    flags, unknown = parse_flags(FMT, text)
    model_name, model = _model(flags, base_dir)

    def number(flag: str, default: int) -> int:
        value = as_int(FMT, flag, flags.get(flag, default))
        if value < 1:
            raise InputError(f"{FMT}: {flag} must be >= 1, got {value}")
        return value

    if "--seq-length" not in flags:
        raise InputError(f"{FMT}: --seq-length is missing")
    if "--bf16" in flags and "--fp16" in flags:
        raise InputError(f"{FMT}: --bf16 and --fp16 are mutually exclusive (Megatron rule)")
    micro = number("--micro-batch-size", 1)
    diffusion = "--block-size" in flags or "--diffusion-objective" in flags
    fp8 = flags.get("--fp8-format")
    workload = make_workload(
        FMT, seq_len=number("--seq-length", 1), block_size=number("--block-size", 256),
        objective=objective_of(model, flags.get("--diffusion-objective")) if diffusion else "ar",
        linear_dtype=None if fp8 is None else choice(FMT, "--fp8-format", fp8, FP8_FORMATS), micro_batch=micro,
        dtype="bf16" if "--bf16" in flags else "fp16" if "--fp16" in flags else "fp32",
        checkpointing=_checkpointing(flags), zero_stage=_zero_stage(flags))

    tp, cp = number("--tensor-model-parallel-size", 1), number("--context-parallel-size", 1)
    ep, pp = number("--expert-model-parallel-size", 1), number("--pipeline-model-parallel-size", 1)
    if pp > 1:
        raise InputError(f"{FMT}: --pipeline-model-parallel-size {pp}: block-diffusion CP/BP does not "
                         "use pipeline parallelism and csbp does not model it")
    if tp > 1 and "--sequence-parallel" not in flags:
        raise InputError(f"{FMT}: --tensor-model-parallel-size {tp} without --sequence-parallel: csbp "
                         "models tensor parallelism with sequence parallelism only")
    if ep > 1 and not model.is_moe:
        raise InputError(f"{FMT}: --expert-model-parallel-size {ep} needs a MoE model (--num-experts); "
                         f"{model.name} is dense (Megatron rule)")
    transport = choice(FMT, "--cp-comm-type", flags.get("--cp-comm-type", "p2p"), CP_COMM)
    dp, gpus = 1, None
    if "--global-batch-size" in flags:
        batch = number("--global-batch-size", 1)
        if batch % micro:
            raise InputError(f"{FMT}: --global-batch-size {batch} is not a multiple of "
                             f"--micro-batch-size {micro} (Megatron rule)")
        data_parallel = batch // micro
        if data_parallel % ep:
            raise InputError(f"{FMT}: --expert-model-parallel-size {ep} must divide the data-parallel "
                             f"size {data_parallel} (global batch / micro batch)")
        dp, gpus = data_parallel // ep, data_parallel * tp * cp
    plan = make_plan(FMT, model, workload, dp=dp, tp=tp, ep=ep, cp=cp, transport=transport)
    known = sorted(SWITCHES | VALUED)
    return ImportedRun(model=model_name, workload=workload, plan=plan, nodes=None, gpus=gpus,
                       unknown_keys=tuple(unknown), warnings=unknown_key_warnings(FMT, unknown, known))
