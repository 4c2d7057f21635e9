"""`csbp simulate`: predict one plan's step time and memory on a cluster."""

from __future__ import annotations

import argparse

from csbp.simulator.commands.cli_args import (add_cluster_args, add_from_arg, add_linear_dtype_arg, add_plan_args,
                                add_workload_args, imported_inputs, inputs_from_args, plan_from_args,
                                profile_from_args)
from csbp.simulator.report.report import print_json, print_result


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="predict step time, tokens/s and memory of one plan",
                       description="Simulate one training step of a plan. Defaults: "
                                   "nemotron-diffusion-8b, 256K context, 2 x 8 H200, dp=2,cp=8,bp=8.")
    add_workload_args(p)
    add_linear_dtype_arg(p)
    add_cluster_args(p)
    add_plan_args(p)
    p.set_defaults(plan="dp=2,cp=8,bp=8")
    add_from_arg(p)
    p.add_argument("--engine", default="des", choices=["des", "closed-form"],
                   help="discrete-event simulation (overlap) or the closed-form screen")
    p.add_argument("--no-overlap", action="store_true", help="serialise communication and compute")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of the step")
    p.set_defaults(func=run)


def result_of(args: argparse.Namespace):
    """The simulated step the flags describe (`csbp.simulate(...)` returns it); a --what-if's
    scaled figures are in its notes (and its hardware name), so text and JSON both state them."""
    from csbp.simulator.engine.simulate import simulate

    what_if = profile_from_args(args)
    profile = what_if.profile
    imported = imported_inputs(args, args.nodes * profile.node.gpus_per_node)
    inputs, plan = imported or (inputs_from_args(args), plan_from_args(args))
    result = simulate(inputs.model, inputs.workload, plan, profile, args.nodes,
                      engine=args.engine, overlap=not args.no_overlap)
    result.notes.extend(what_if.lines())
    return result


def run(args: argparse.Namespace) -> int:
    result = result_of(args)
    if args.trace:
        from csbp.simulator.report.trace import write_trace

        write_trace(result, args.trace)
    if args.json:
        print_json(result.to_json())
    else:
        print_result(result)
        if args.trace:
            print(f"trace written to {args.trace} (open in ui.perfetto.dev)")
    return 0
