"""Wall time of a cold planner search at three cluster sizes, with what the search did.

Goals on a 2-core host, for nemotron-diffusion-8b at 256K on H200 (the README's main job):
16 GPUs <= 0.5 s, 128 GPUs <= 2 s, 1,024 GPUs <= 10 s. Each search runs in a fresh process (a
cold start, as a fresh `csbp plan` has: no layout, split or price is cached) the way `csbp plan`
runs it (top 10 reported, so candidates that cannot reach it are pruned; the process's cores as
workers); the time is the search's own (imports and printing excluded). Printed per size: the
enumerated candidates, those that fit in memory, how many the bounds pruned, how many the closed
form screened and the event engine re-scored, and min / median / max seconds over `--repeat`
fresh processes. The host's load average is printed before and after: other work on the host
shows up directly in the times. Not a timed test; run:

    python benchmarks/planner_speed.py [--repeat 3] [--nodes 2,16,128] [--model qwen3.5-27b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from csbp.simulator.commands.cli_args import add_workload_args, inputs_from_args

GOALS = {16: 0.5, 128: 2.0, 1024: 10.0}  # GPUs -> seconds


def one_search(args: argparse.Namespace) -> dict:
    """One cold search in this process, as `csbp plan` runs it (checkpointing searched)."""
    from csbp.simulator.system.hardware import load_profile
    from csbp.simulator.planner.planner import search

    inputs = inputs_from_args(args)
    found = search(inputs.model, inputs.workload, load_profile(args.hardware), args.nodes,
                   keep=args.top, workers=args.workers)
    return {"gpus": found.gpus, "candidates": found.candidates, "feasible": found.feasible,
            "pruned": found.pruned, "screened": found.screened, "rescored": found.rescored,
            "evaluations": found.evaluations, "seconds": found.seconds,
            "recommended": found.recommended.plan["label"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--nodes", default="2,16,128", help="cluster sizes in nodes, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per size")
    parser.add_argument("--top", type=int, default=10, help="ranks reported, as csbp plan --top")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: the usable cores)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one:
        args.nodes = int(args.nodes)
        print(json.dumps(one_search(args)))
        return
    inputs = inputs_from_args(args)
    print(f"{inputs.model.name} at seq-len {inputs.workload.seq_len} on {args.hardware}, top {args.top}, "
          f"{len(os.sched_getaffinity(0))} usable cores; load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'GPUs':>6} {'cands':>6} {'fit':>5} {'pruned':>6} {'screened':>8} {'rescored':>8} "
          f"{'evals':>6}   {'min s':>7} {'median s':>8} {'max s':>7}   goal")
    for nodes in (int(n) for n in args.nodes.split(",")):
        runs = []
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, __file__, "--one", "--nodes", str(nodes),
                                  *_passed(args)], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout))
        r, walls = runs[0], sorted(x["seconds"] for x in runs)
        goal = GOALS.get(r["gpus"])
        verdict = "-" if goal is None else f"<= {goal:g} s: {'met' if walls[len(walls) // 2] <= goal else 'MISSED'}"
        print(f"{r['gpus']:>6} {r['candidates']:>6} {r['feasible']:>5} {r['pruned']:>6} {r['screened']:>8} "
              f"{r['rescored']:>8} {r['evaluations']:>6}   {walls[0]:7.2f} {statistics.median(walls):8.2f} "
              f"{walls[-1]:7.2f}   {verdict}  ({r['recommended']})", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _passed(args: argparse.Namespace) -> list[str]:
    """The job's flags, for the child processes."""
    out = ["--model", args.model, "--seq-len", str(args.seq_len), "--block-size", str(args.block_size),
           "--micro-batch", str(args.micro_batch), "--dtype", args.dtype, "--zero", str(args.zero),
           "--hardware", args.hardware, "--top", str(args.top)]
    if args.objective:
        out += ["--objective", args.objective]
    if args.workers:
        out += ["--workers", str(args.workers)]
    return out


if __name__ == "__main__":
    main()
