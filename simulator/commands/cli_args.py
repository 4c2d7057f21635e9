"""Workload and plan flags shared by `csbp simulate`, `csbp plan` and `csbp run`.

One parser for the same question asked three ways, so the flags mean the same everywhere.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pydantic import ValidationError

from csbp.simulator.errors import InputError, one_line
from csbp.simulator.workload.objectives import default_objective, preset_recipe, recipe_checkpointing
from csbp.simulator.plan.plan import Plan, check_size, parse_plan
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload, parse_tokens

DEFAULT_MODEL = "nemotron-diffusion-8b"
DEFAULT_HARDWARE = "h200"
DEFAULT_NODES = 2
DEFAULT_SEQ_LEN = "256k"
# Beyond this the planner's enumeration of every divisor of the GPU count stops being quick.
MAX_NODES = 4096


@dataclass(frozen=True)
class Inputs:
    model: ModelSpec
    workload: Workload


def add_workload_args(p: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """Model and workload flags. With `defaults`, they default to the built-in job."""
    p.add_argument("--model", default=DEFAULT_MODEL if defaults else None,
                   help="preset name or path to a Hugging Face config.json")
    p.add_argument("--seq-len", default=DEFAULT_SEQ_LEN if defaults else None,
                   help="context length L, e.g. 4096, 256k, 1m")
    p.add_argument("--block-size", type=int, default=None,
                   help="diffusion block size b (default: the preset's recipe, else 256)")
    p.add_argument("--objective", default=None,
                   help="bd3lm | fast-dllm-v2 | diffusiongemma | dflash2 | ar (plain autoregressive) "
                        "(default: the model's)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per replica")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp16 | fp32")
    p.add_argument("--checkpointing", default=None,
                   help="activation checkpointing: full | none (default: full; dflash2: none, its recipe)")
    p.add_argument("--zero", type=int, default=2, help="ZeRO stage 0-3")
    p.add_argument("--features", default="offline",
                   help="dflash2 target features: offline (read from storage and copied to the GPU "
                        "one batch ahead: a real training job, the default) | synthetic (resident on "
                        "the GPU, no I/O: the published benchmark runs)")
    p.add_argument("--max-anchors", type=int, default=None,
                   help="dflash2: draft blocks per example (default: the preset's recipe, else 2048)")
    p.add_argument("--vocab-block", type=int, default=None,
                   help="dflash2: the loss's vocabulary block, the frozen head's (default: the "
                        "preset's recipe, else 32768)")


def add_linear_dtype_arg(p: argparse.ArgumentParser) -> None:
    """`--linear-dtype` (simulate, plan, sweep, map): the dtype of the transformer blocks' linear
    GEMMs; not on `csbp run`, whose runtime trains in the step dtype only."""
    p.add_argument("--linear-dtype", default=None, choices=["bf16", "fp8"],
                   help="the transformer blocks' linear GEMMs (forward, dgrad, wgrad) in bf16 or FP8 "
                        "as torchao Float8 / Transformer Engine run them; the LM head and attention "
                        "stay bf16 (default: the implementation profile's, else bf16)")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help="profile name or YAML path")
    p.add_argument("--nodes", type=node_count, default=DEFAULT_NODES,
                   help=f"number of nodes (1 to {MAX_NODES})")
    add_what_if_arg(p)


def add_what_if_arg(p: argparse.ArgumentParser) -> None:
    from csbp.simulator.grids.what_if import help_text

    p.add_argument("--what-if", default=None, metavar="NAME=VALUE,...", help=help_text())
    add_implementation_arg(p)


def add_implementation_arg(p: argparse.ArgumentParser) -> None:
    from csbp.simulator.system.implementation import DEFAULT_IMPLEMENTATION, list_implementations

    p.add_argument("--implementation", default=DEFAULT_IMPLEMENTATION, metavar="NAME|FILE",
                   help="what the training framework executes per plan family (kernels, waits, "
                        f"copies): {' | '.join(list_implementations())} or a YAML path "
                        f"(default {DEFAULT_IMPLEMENTATION})")


def profile_from_args(args: argparse.Namespace):
    """The --hardware profile with --what-if applied (a `what_if.WhatIf`: profile + changes)."""
    from csbp.simulator.system.hardware import load_profile
    from csbp.simulator.grids.what_if import apply

    found = apply(load_profile(args.hardware), getattr(args, "what_if", None))
    return with_implementation(found, getattr(args, "implementation", None))


def with_implementation(found, name: str | None):
    """The what-if's profile running implementation `name` (checked: it loads, and the GPU lists
    every kernel family it names)."""
    from dataclasses import replace

    from csbp.simulator.system.implementation import check_kernels, load_implementation

    if not name:
        return found
    impl = load_implementation(name)
    check_kernels(impl, found.profile.gpu)
    return replace(found, profile=found.profile.model_copy(update={"implementation": name}))


def node_count(text: str) -> int:
    try:
        nodes = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if nodes > MAX_NODES:  # fewer than one is the planner's and simulate()'s to refuse
        raise argparse.ArgumentTypeError(f"{nodes}: at most {MAX_NODES} nodes (the most the "
                                         "simulator models)")
    return nodes


def add_plan_args(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument("--plan", required=required, default=None,
                   help="degrees, e.g. dp=2,cp=8,bp=8 (axes dp, tp, ep, cp, bp)")
    p.add_argument("--transport", default=None,
                   help="collective | ring (default: the implementation profile's, else collective)")
    p.add_argument("--schedule", default="dual-end", help="dual-end | contiguous")
    p.add_argument("--placement", default=None, help="axes innermost first, e.g. tp,ctx,ep,dp")


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    model = load_model(args.model)
    objective = args.objective or default_objective(model)
    if objective == "ar" and args.block_size not in (None, 1):
        raise InputError("objective ar has no blocks (a causal sequence): drop --block-size")
    recipe = {"block_size": 256, **preset_recipe(model)}
    flags = {k: v for k, v in (("block_size", args.block_size),
                               ("features", getattr(args, "features", None)),
                               ("max_anchors", getattr(args, "max_anchors", None)),
                               ("vocab_block", getattr(args, "vocab_block", None))) if v is not None}
    try:
        workload = Workload(
            seq_len=parse_tokens(args.seq_len),
            objective=objective, micro_batch=args.micro_batch, dtype=args.dtype,
            checkpointing=args.checkpointing or recipe_checkpointing(objective) or "full",
            zero_stage=args.zero, linear_dtype=getattr(args, "linear_dtype", None), **(recipe | flags))
    except (ValidationError, ValueError) as err:
        raise InputError(one_line(err)) from None
    check_size(workload)
    return Inputs(model, workload)


def plan_from_args(args: argparse.Namespace) -> Plan:
    transport = args.transport
    if transport is None:  # the framework's own default (Megatron: p2p, a ring)
        from csbp.simulator.system.implementation import load_implementation

        name = getattr(args, "implementation", None)
        transport = (load_implementation(name).transport if name else None) or "collective"
    options = {"transport": transport, "schedule": args.schedule}
    if args.placement:
        options["placement"] = args.placement
    return parse_plan(args.plan or "", **options)


def add_from_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="from_run", nargs=2, metavar=("FORMAT", "FILE"),
                   help="read an existing run instead of flags: turbo-dllm run.yaml | megatron "
                        "flags.txt | torchtitan job.toml (FILE '-' reads stdin)")


def imported_inputs(args: argparse.Namespace, world: int) -> tuple[Inputs, Plan] | None:
    """Model, workload and plan of the run named by --from, on a cluster of `world` GPUs."""
    if not getattr(args, "from_run", None):
        return None
    import sys
    from pathlib import Path

    from csbp.simulator.interop import read

    fmt, name = args.from_run
    if name == "-":
        text, base = sys.stdin.read(), Path.cwd()
    else:
        path = Path(name)
        try:
            text = path.read_text()
        except OSError as err:
            raise InputError(f"cannot read {name}: {err.strerror or err}") from None
        except UnicodeDecodeError:
            raise InputError(f"{name} is not a text file") from None
        base = path.resolve().parent
    run = read(fmt, text, base_dir=base)
    for line in run.warnings:
        print(f"csbp: warning: {line}", file=sys.stderr)
    return Inputs(load_model(run.model), run.workload), run.plan_on(world)
