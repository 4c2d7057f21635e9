"""`csbp plan`: which topology to launch on this cluster, why, and the file that launches it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

from csbp.simulator.commands.cli_args import (DEFAULT_HARDWARE, DEFAULT_MODEL, DEFAULT_NODES, DEFAULT_SEQ_LEN,
                                add_cluster_args, add_from_arg, add_linear_dtype_arg, add_workload_args,
                                imported_inputs, inputs_from_args, profile_from_args)
from csbp.simulator.errors import InputError
from csbp.simulator.workload.objectives import recipe_checkpointing
from csbp.simulator.plan.plan import AXES, DEFAULT_PLACEMENT
from csbp.simulator.planner.planner import (STRIPED_PLACEMENT, Search, cluster_gpus, fmt_tokens, label_of, placements,
                                    plan_of, search)
from csbp.simulator.report.report import fmt_time, print_json
from csbp.simulator.workload.presets import PRESET_NAMES, load_model
from csbp.simulator.report.result import Result
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.workload.workload import Workload

if TYPE_CHECKING:
    from csbp.simulator.grids.sensitivity import Sensitivity
    from csbp.simulator.grids.what_if import WhatIf

DEFAULT_JOB = "Nemotron-Labs-Diffusion 8B at 256K on 2 x 8 H200"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search every topology and recommend the fastest that fits",
                       description="Enumerate every valid dp/tp/ep/cp/bp topology x transport x "
                                   "checkpointing x block schedule for the cluster, screen them with "
                                   "the closed form, re-simulate the best with the event engine and "
                                   f"rank by tokens/s. With no flags: {DEFAULT_JOB}.")
    add_workload_args(p)
    add_linear_dtype_arg(p)
    add_cluster_args(p)
    p.set_defaults(checkpointing=None)  # searched unless given
    p.add_argument("--axes", default=",".join(AXES),
                   help="axes the search may use, others stay 1 (default: all; e.g. dp,cp,bp)")
    p.add_argument("--top", type=int, default=10, help="candidates to list (default 10)")
    p.add_argument("--engine", default="des", choices=["des", "closed-form"],
                   help="engine of the final ranking (closed-form: screen only, fastest)")
    p.add_argument("--jobs", type=int, default=None, help="processes for the search (default: all cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", metavar="PLAN_JSON", help="write the recommended plan file for "
                   "`csbp run --plan` and `torchrun -m csbp.runtime.training.torchrun --plan`")
    p.add_argument("--emit", action="append", default=[], metavar="FORMAT",
                   help="also print the plan as turbo-dllm | megatron | torchtitan config "
                        "(repeatable; frameworks without BP get the best plan they can express)")
    p.add_argument("--sensitivity", action="store_true",
                   help="also report how the recommendation and its speedup move when link "
                        "bandwidths, attention efficiency and the memory reserve vary by +-20%% "
                        "(closed-form re-ranking of the best candidates), and flag flips")
    add_from_arg(p)
    p.set_defaults(func=run)


def console(stderr: bool = False) -> Console:
    """A rich console; a file or a pipe has no width, so tables get 140 columns, not 80."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=140)


def parse_axes(text: str) -> tuple[str, ...]:
    axes = tuple(a.strip().lower() for a in text.split(",") if a.strip())
    unknown = [a for a in axes if a not in AXES]
    if unknown or not axes:
        raise InputError(f"--axes {text!r}: use a comma-separated subset of {', '.join(AXES)}")
    return axes


def is_default_job(args: argparse.Namespace) -> bool:
    return (args.model, args.seq_len, args.hardware, args.nodes) == (
        DEFAULT_MODEL, DEFAULT_SEQ_LEN, DEFAULT_HARDWARE, DEFAULT_NODES)


def torchrun_command(nodes: int, gpus_per_node: int, plan_file: str) -> str:
    """How to launch the plan file on every node of the cluster."""
    rendezvous = ("--standalone" if nodes == 1 else
                  f"--nnodes {nodes} --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500")
    return f"torchrun {rendezvous} --nproc-per-node {gpus_per_node} -m csbp.runtime.training.torchrun --plan {plan_file}"


def write_plan_file(found, path: str, hardware: str) -> None:
    """The recommendation as a runtime plan file, with its prediction for later comparison."""
    from csbp.simulator.planner import planfile

    rec, model = found.recommended, found.model
    # A preset travels by name (readable, and the runtime rebuilds the same spec); anything else
    # (a config.json) travels as the full spec, so the file does not depend on a local path.
    by_name = model.name in PRESET_NAMES and load_model(model.name) == model
    planfile.dump(planfile.PlanFile(
        model=model.name if by_name else model, workload=Workload(**rec.workload), plan=plan_of(rec),
        hardware=hardware, nodes=found.nodes, prediction=rec.to_json()), path)


@dataclass
class Planned:
    """One `csbp plan` answered: the search, the user's own run if given, and what was written.

    `to_json()` is the command's `--json` object; `csbp.plan(...)` returns this."""

    found: Search
    args: argparse.Namespace
    your_run: Result | None
    command: str | None  # the torchrun line for the written plan file
    emitted: dict[str, str]
    what_if: WhatIf | None = None  # the --what-if changes the search ran on
    sensitivity: Sensitivity | None = None  # --sensitivity
    # the recommendation's speedup over the best plan without BP under ideal and turbo-dllm
    by_implementation: dict[str, float | None] = field(default_factory=dict)

    @property
    def recommended(self) -> Result:
        return self.found.recommended

    @property
    def baseline(self) -> Result | None:
        return self.found.baseline

    @property
    def speedup(self) -> float | None:
        return self.found.speedup

    def to_json(self) -> dict:
        return _json(self.found, self.args, self.command) | {
            "your_run": _your_run_json(self.your_run, self.found.recommended),
            "emitted": self.emitted, "what_if": self.what_if.to_json() if self.what_if else [],
            "sensitivity": self.sensitivity.to_json() if self.sensitivity else None,
            "implementation": self.found.profile.implementation,
            "speedup_by_implementation": self.by_implementation}


def answer(args: argparse.Namespace, announce=None) -> Planned:
    """Search for the job the flags describe; `announce(text)` hears what is being planned."""
    if args.top < 1:
        raise InputError(f"--top {args.top}: must be at least 1")
    searched = {"axes": parse_axes(args.axes), "workers": args.jobs}
    if args.checkpointing:
        searched["checkpointing"] = (args.checkpointing,)
    what_if = profile_from_args(args)
    profile = what_if.profile
    world = cluster_gpus(profile, args.nodes)
    imported = imported_inputs(args, world)
    if imported:
        inputs, yours = imported
    else:
        flags = vars(args) | {"checkpointing": args.checkpointing or "full"}
        inputs, yours = inputs_from_args(argparse.Namespace(**flags)), None
    if not args.checkpointing and recipe_checkpointing(inputs.workload.objective):
        # an objective whose recipe fixes it (DFlash2: none, implementation.md 14) is not searched
        searched["checkpointing"] = (recipe_checkpointing(inputs.workload.objective),)
        inputs = replace(inputs, workload=inputs.workload.model_copy(
            update={"checkpointing": searched["checkpointing"][0]}))
    job = (f"{inputs.model.name} at {fmt_tokens(inputs.workload.seq_len)} on {args.nodes} x "
           f"{profile.node.gpus_per_node} {profile.gpu.name}")
    if is_default_job(args) and not imported:
        job = f"the built-in default job, {DEFAULT_JOB} ({job}); see csbp plan --help for other jobs"
    if what_if.changes:
        job += f", what-if {what_if.spec}"
    if announce:
        announce(f"Planning {job}")
    from csbp.simulator.planner.method_vs_implementation import baselines_ahead

    # the other implementation's baseline search needs nothing from this one: it runs beside it
    with baselines_ahead(inputs.model, inputs.workload, profile, args.nodes, args.engine, **searched) as ahead:
        found = search(inputs.model, inputs.workload, profile, args.nodes, engine=args.engine,
                       keep=args.top, prune_placements=not args.sensitivity, checks=ahead.checks, **searched)
        return _answered(args, searched, inputs, yours, profile, what_if, found, ahead)


def _answered(args, searched, inputs, yours, profile, what_if, found, ahead) -> Planned:
    command = None
    if args.out:
        write_plan_file(found, args.out, args.hardware)
        command = torchrun_command(args.nodes, profile.node.gpus_per_node, args.out)
    your_run = simulate(inputs.model, inputs.workload, yours, profile, args.nodes,
                        engine=args.engine, with_trace=False) if yours else None
    emitted = emit_all(found, args.emit, args.nodes, profile.node.gpus_per_node)
    sens = None
    if args.sensitivity:
        from csbp.simulator.grids.sensitivity import sensitivity

        sens = sensitivity(found, axes=searched["axes"], checkpointing=searched.get("checkpointing"),
                           workers=args.jobs)
    from csbp.simulator.planner.method_vs_implementation import speedup_by_implementation

    return Planned(found, args, your_run, command, emitted, what_if, sens,
                   speedup_by_implementation(found, ahead, **searched))


def run(args: argparse.Namespace) -> int:
    # --json: stdout is JSON only, so the announcement goes to stderr
    planned = answer(args, lambda text: console(stderr=args.json).print(text, highlight=False))
    found = planned.found
    if args.json:
        console(stderr=True).print(f"searched {found.candidates} candidates in {found.seconds:.2f} s",
                                   highlight=False)
        print_json(planned.to_json())
    else:
        _print(found, args, planned.command)
        from csbp.simulator.planner.method_vs_implementation import reading

        console().print(f"\n{reading(planned.by_implementation)} ({found.profile.implementation} "
                        "priced the ranking; --implementation NAME|FILE to change it)", highlight=False)
        if planned.your_run:
            _print_your_run(planned.your_run, found, args.from_run)
        for fmt, text in planned.emitted.items():
            console().print(f"\n[bold]{fmt}[/]:", highlight=False)
            print(text.rstrip())
        for line in planned.what_if.lines():
            console().print(line, highlight=False)
        if planned.sensitivity:
            from csbp.simulator.grids.sensitivity_table import print_sensitivity

            print_sensitivity(console(), planned.sensitivity)
    return 0


def emit_all(found, formats: list[str], nodes: int, gpus_per_node: int) -> dict[str, str]:
    """Each requested format: the recommendation, or the best plan that framework can express."""
    from csbp.simulator.interop import FORMATS, emit
    from csbp.simulator.system.implementation import load_implementation

    out = {}
    for fmt in formats:
        if fmt not in FORMATS:
            raise InputError(f"--emit {fmt!r}: use one of {', '.join(FORMATS)}")
        best = found.recommended if fmt == "turbo-dllm" else found.baseline
        if best is None:
            out[fmt] = f"# {fmt} cannot express any feasible plan here: every plan without BP is infeasible"
            continue
        workload = Workload(**best.workload)
        # the sharding the implementation priced (FSDP2: ZeRO-3 whatever --zero said)
        opt = load_implementation(found.profile.implementation).optimizer.path(workload.objective)
        workload = workload.model_copy(update={"zero_stage": opt.stage(workload.zero_stage)})
        try:
            out[fmt] = emit(fmt, found.model.name, workload, plan_of(best), nodes, gpus_per_node)
        except InputError as err:  # e.g. a ZeRO stage or dtype the framework has no name for
            out[fmt] = f"# {fmt} cannot express {label_of(best)}: {err}"
    return out


def _your_run_json(yours: Result | None, rec: Result) -> dict | None:
    if yours is None:
        return None
    out = yours.to_json()
    out["recommendation_speedup"] = rec.tokens_per_s / yours.tokens_per_s if yours.tokens_per_s else None
    return out


def _print_your_run(yours: Result, found, source: list[str]) -> None:
    out = console()
    out.print(f"\n[bold]Your run[/] ({source[0]} {source[1]}): {label_of(yours)} ({yours.plan['kind']})",
              highlight=False)
    if not yours.feasible:
        out.print(f"  {yours.reason}", highlight=False)
        return
    out.print(f"  {_summary(yours)}", highlight=False)
    rec = found.recommended
    out.print(f"  the recommendation {label_of(rec)} is [bold]{rec.tokens_per_s / yours.tokens_per_s:.2f}x[/] "
              "your run's tokens/s", highlight=False)


def _with_speedup(r: Result, base: Result | None) -> dict:
    out = r.to_json()
    out["speedup_over_baseline"] = r.tokens_per_s / base.tokens_per_s if base else None
    return out


def _json(found, args: argparse.Namespace, command: str | None) -> dict:
    base = found.baseline
    return {
        "default_job": is_default_job(args),
        "recommended": _with_speedup(found.recommended, base),
        "baseline": _with_speedup(base, base) if base else None,
        "speedup": found.speedup,
        "candidates": [_with_speedup(r, base) for r in found.ranked[:args.top]],
        "infeasible": [g.to_json() for g in found.infeasible],
        "search": {"candidates": found.candidates, "evaluations": found.evaluations,
                   "engine": found.engine, "feasible": found.feasible, "pruned": found.pruned,
                   "screened": found.screened, "rescored": found.rescored},  # wall time goes to stderr: the JSON stays deterministic
        "plan_file": args.out,
        "torchrun": command,
    }


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} GiB" if x < 10 else f"{x:.1f} GiB"


def _summary(r: Result) -> str:
    own = f" ({r.objective_tokens_per_s:,.0f} {r.objective_label})" if r.objective_tokens_per_s else ""
    per_gpu = (f" ({r.tokens_per_s_per_gpu:,.0f} per GPU"
               + (f", {r.model_tflops_per_gpu:,.0f} model TFLOP/s per GPU" if r.model_tflops_per_gpu else "")
               + ")") if r.tokens_per_s_per_gpu else ""
    return (f"{r.tokens_per_s:,.0f} tokens/s{per_gpu}{own}, step {fmt_time(r.step_time_s)}, peak memory "
            f"{_gib(r.peak_memory_gib)}, attention traffic {r.attention_traffic_gib_per_gpu:.2f} GiB/GPU, "
            f"exposed communication {fmt_time(r.exposed_comm_s)}")


def _why(found) -> list[str]:
    """What makes the recommendation win, in the simulator's own figures."""
    rec, base = found.recommended, found.baseline
    if base is None:
        return ["no plan without block parallelism fits: BP is what makes this job possible"]
    if base is rec:
        from csbp.simulator.plan.rules import applicable_axes

        if "bp" not in applicable_axes(found.workload, ("bp",)):  # ar: nothing to deal out
            return [f"objective {found.workload.objective}: no noisy blocks, so no block parallelism; "
                    "the best of dp/tp/cp/ep"]
        return ["no block-parallel plan beats it on this cluster"]
    reasons = [f"{found.speedup:.2f}x the baseline's tokens/s" if found.speedup >= 1.005 else
               "ties the baseline on tokens/s (within 0.5 %)"]
    if rec.attention_traffic_gib_per_gpu < base.attention_traffic_gib_per_gpu:
        ratio = base.attention_traffic_gib_per_gpu / max(rec.attention_traffic_gib_per_gpu, 1e-9)
        reasons.append(f"{ratio:.1f}x less attention traffic per GPU" if rec.attention_traffic_gib_per_gpu
                       else "no attention traffic at all")
    if rec.exposed_comm_s is not None and base.exposed_comm_s is not None \
            and rec.exposed_comm_s < base.exposed_comm_s:
        reasons.append(f"exposed communication {fmt_time(rec.exposed_comm_s)} vs "
                       f"{fmt_time(base.exposed_comm_s)}")
    if rec.peak_memory_gib < base.peak_memory_gib:
        reasons.append(f"{base.peak_memory_gib - rec.peak_memory_gib:.1f} GiB less peak memory")
    reasons.append(_placement_reason(found))
    gpu = found.profile.gpu
    reasons.append(f"peak memory {_gib(rec.peak_memory_gib)} of {gpu.memory_gib:.0f} GiB "
                   f"({gpu.reserved_gib:.0f} GiB reserved included)")
    return reasons


def _placement_reason(found) -> str:
    """Which placement the recommendation uses and what the other one would give it."""
    rec = found.recommended
    plan = plan_of(rec)
    options = placements(plan.model_copy(update={"placement": DEFAULT_PLACEMENT}), rec.gpus,
                         found.profile.node.gpus_per_node)
    inside = plan.placement != STRIPED_PLACEMENT
    where = "context group inside a node" if inside else "context group striped across nodes"
    if len(options) == 1:
        return f"{where} (placement {plan.placement})"
    other = plan.model_copy(update={"placement": STRIPED_PLACEMENT if inside else DEFAULT_PLACEMENT})
    alt = simulate(found.model, Workload(**rec.workload), other, found.profile, found.nodes,
                   engine=found.engine, with_trace=False)
    if not alt.tokens_per_s:
        return f"{where} (placement {plan.placement}; the other placement does not fit)"
    kv = "K/V on NVLink, gradients across nodes" if inside else "gradients and EP on NVLink, K/V across nodes"
    return (f"{where} (placement {plan.placement}: {kv}), {rec.tokens_per_s / alt.tokens_per_s:.3f}x "
            f"the tokens/s of the {'striped' if inside else 'inside-a-node'} placement")


def _print(found, args: argparse.Namespace, command: str | None) -> None:
    out = console()
    rec, base = found.recommended, found.baseline
    out.print(f"\n[bold green]Recommended[/]: [bold]{label_of(rec)}[/] ({rec.plan['kind']})",
                  highlight=False)
    out.print(f"  {_summary(rec)}", highlight=False)
    out.print(f"  why: {'; '.join(_why(found))}", highlight=False)
    if base is not None:
        out.print(f"[bold]Baseline[/] (best without BP): {label_of(base)} ({base.plan['kind']})",
                      highlight=False)
        out.print(f"  {_summary(base)}", highlight=False)
        out.print(f"  speedup of the recommendation: [bold]{found.speedup:.2f}x[/]", highlight=False)
    else:
        out.print("[bold]Baseline[/]: none — every plan without BP is infeasible")
    out.print(_ranking(found, args.top))
    if found.infeasible:
        out.print(_infeasible(found))
    out.print(f"[dim]searched {found.candidates} candidates ({found.evaluations} evaluations) "
                  f"in {found.seconds:.2f} s[/dim]")
    if command:
        out.print(f"\nplan file written to {args.out}; launch on each node with:\n  {command}",
                      highlight=False, soft_wrap=True)


def _ranking(found, top: int) -> Table:
    """Compact enough for a 100-column terminal; `--json` has every figure in full."""
    base = found.baseline
    table = Table(title=f"Top {min(top, len(found.ranked))} of {found.feasible} feasible candidates",
                  box=box.SIMPLE_HEAD, caption="K/V: clean K/V transport; blocks: noisy-block schedule; "
                  "ckpt: activation checkpointing; cf: closed-form screen only", caption_justify="left")
    # the objective's own count beside context tokens/s (implementation.md 15), e.g. supervised
    own = found.ranked[0].objective_tokens_name if found.ranked else None
    for col in ("#", "plan", "K/V", "blocks", "ckpt", "tokens/s", *([f"{own}/s"] if own else []),
                "vs base", "step", "peak mem", "attn/GPU", "exposed", "engine"):
        text = col in ("plan", "K/V", "blocks", "ckpt", "engine")
        table.add_column(col, justify="left" if text else "right", no_wrap=col == "plan")
    for i, r in enumerate(found.ranked[:top], 1):
        plan = plan_of(r)
        striped = " ctx-striped" if plan.placement == STRIPED_PLACEMENT else ""
        table.add_row(str(i), plan.label() + striped + (" (baseline)" if r is base else ""),
                      plan.transport if plan.cp > 1 else "-", plan.schedule if plan.bp > 1 else "-",
                      r.workload["checkpointing"], f"{r.tokens_per_s:,.0f}",
                      *([f"{r.objective_tokens_per_s:,.0f}" if r.objective_tokens_per_s else "-"] if own else []),
                      f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-",
                      fmt_time(r.step_time_s), _gib(r.peak_memory_gib),
                      _gib(r.attention_traffic_gib_per_gpu), fmt_time(r.exposed_comm_s),
                      "cf" if r.engine == "closed-form" else r.engine)
    return table


def _infeasible(found) -> Table:
    table = Table(title="Infeasible, grouped by reason", box=box.SIMPLE_HEAD)
    table.add_column("reason")
    table.add_column("count", justify="right")
    table.add_column("for example")
    for g in found.infeasible:
        more = f" (+{len(g.plans) - 2} more)" if len(g.plans) > 2 else ""
        examples = ", ".join(g.plans[:2]) + more
        table.add_row(g.reason, str(len(g.plans)), f"{examples}\n[dim]{g.example}[/dim]")
    return table

