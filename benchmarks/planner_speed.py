"""Wall time of `csbp.plan` for every study workload at 16, 128 and 1,024 GPUs (issue 25's table).

The goals (issue 25) apply to the whole `csbp.plan(...)` call, in process, imports excluded: the
main search plus what the answer adds (the recommendation's speedup under the `ideal`
implementation, a second search, run in a forked process beside the main one when a core is
idle: `workers.core_free`, so what else runs at that moment decides whether the two searches
overlap; that process then takes the main search's memory checks from the other end of its
list, `planner.shared_checks`). On this 2-core host, quiet: every study workload <= 1 s at 16
GPUs (nemotron-diffusion-8b <= 0.5 s), <= 2 s at 128 GPUs, <= 5 s at 1,024 GPUs. The main
search alone (`found.seconds`) is printed beside it, since it is what `csbp plan` waits for
before it can print the ranking.

Rows: dense (nemotron-diffusion-8b), MoE with sliding windows and self-conditioning
(diffusiongemma-26b-a4b), hybrid linear attention (qwen3.5-27b), a drafter (dflash2-qwen3.8-27b),
each at 256K with its preset's default objective, as `csbp plan` runs them. Each run is a fresh
process (a cold start, as a fresh `csbp plan` has: no layout, split or price cached), with the
modules it needs imported before the clock starts; min / median / max over `--repeat` runs, and
the median CPU-seconds (the forked baseline search's included: steadier on a shared host). Per
row also: candidates, those that fit in memory, pruned, screened by the closed form, re-scored
by the event engine, and the lower bounds computed by kind (floors, floors with EP waits, quick, ring chains, tight) where the
planner reports them. The load average is printed before, per row and after: other work on the
host shows up directly in the times. Not a timed test; run:

    python benchmarks/planner_speed.py [--repeat 3] [--gpus 16,128] [--all] [--model qwen3.5-27b]
    python benchmarks/planner_speed.py --check [--gpus 16]   # pruned == exhaustive (slow)
    python benchmarks/planner_speed.py --before /path/to/pkg  # before/after, runs interleaved

`--before PATH` runs every row's processes in pairs, one with PYTHONPATH=PATH (a package
directory holding another `csbp`, e.g. a `git archive` of the commit before a change) and one
with this checkout, one after the other, so both see the same load on a shared host.

`--all` adds the 1,024-GPU rows (DiffusionGemma's take minutes). `--check` runs, per job, the
exhaustive search (`keep=None`) and the pruned one (`keep=10`) and asserts the same first 10,
baseline and family bests: run it before merging a change to the bounds or the screen.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

WORKLOADS = {  # model -> what it stands for in the studies
    "nemotron-diffusion-8b": "dense",
    "diffusiongemma-26b-a4b": "MoE, sliding windows",
    "qwen3.5-27b": "hybrid linear attention",
    "dflash2-qwen3.8-27b": "drafter",
}


def goal(model: str, gpus: int) -> float | None:
    """Seconds the whole `csbp.plan` may take (issue 25)."""
    if gpus <= 16:
        return 0.5 if model == "nemotron-diffusion-8b" else 1.0
    return {128: 2.0, 1024: 5.0}.get(gpus)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _flags(args: argparse.Namespace, model: str, gpus: int) -> dict:
    from csbp.simulator.system.hardware import load_profile

    per_node = load_profile(args.hardware).node.gpus_per_node
    if gpus % per_node:
        raise SystemExit(f"--gpus {gpus}: not a whole number of {per_node}-GPU nodes")
    flags = {"model": model, "seq_len": args.seq_len, "nodes": gpus // per_node,
             "hardware": args.hardware, "top": args.top}
    if args.jobs:
        flags["jobs"] = args.jobs
    return flags


def _cpu() -> float:
    """CPU-seconds of this process and of its children that ended (the forked baseline search
    and search workers): steadier than wall time on a shared host, where other work takes
    turns on the same cores (it does not count the time waited for them)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def one_run(args: argparse.Namespace, model: str, gpus: int) -> dict:
    """One cold `csbp.plan` in this process, its modules imported first: every module of the
    simulator, those csbp.plan imports on first use included (the engines, what-ifs, interop).
    A module first imported inside the clock would be timed compiling where no bytecode is
    cached (PYTHONDONTWRITEBYTECODE, an editable checkout) but not where it is (an installed
    `--before` package): 60-80 ms of a 0.9 s row, against the checkout."""
    import importlib
    import pkgutil

    import csbp
    import csbp.simulator

    for module in pkgutil.walk_packages(csbp.simulator.__path__, "csbp.simulator."):
        importlib.import_module(module.name)

    flags = _flags(args, model, gpus)
    cpu0 = _cpu()
    start = time.perf_counter()
    planned = csbp.plan(**flags)
    wall = time.perf_counter() - start
    cpu = _cpu() - cpu0
    found = planned.found
    return {"plan_s": wall, "cpu_s": cpu, "search_s": found.seconds, "candidates": found.candidates,
            "feasible": found.feasible, "pruned": found.pruned, "screened": found.screened,
            "rescored": found.rescored, "bounds": getattr(found, "bounds", None),
            "recommended": found.recommended.label if hasattr(found.recommended, "label")
            else found.recommended.plan["label"]}


def check(args: argparse.Namespace, model: str, gpus: int) -> None:
    """The pruned search (keep=10) reports what the exhaustive one does (issue 25, item 5)."""
    from csbp.api import _args
    from csbp.simulator.commands.cli_args import inputs_from_args
    from csbp.simulator.planner.planner import search
    from csbp.simulator.system.hardware import load_profile

    flags = _flags(args, model, gpus)
    parsed = _args("plan", flags)
    inputs = inputs_from_args(argparse.Namespace(**(vars(parsed) | {"checkpointing": "full"})))
    profile = load_profile(args.hardware)
    t = time.perf_counter()
    full = search(inputs.model, inputs.workload, profile, flags["nodes"], keep=None, workers=args.jobs)
    t_full = time.perf_counter() - t
    pruned = search(inputs.model, inputs.workload, profile, flags["nodes"], keep=args.top, workers=args.jobs)
    j = lambda rs: [r.to_json() for r in rs]  # noqa: E731
    same = (j(full.ranked[:args.top]) == j(pruned.ranked[:args.top])
            and full.baseline.to_json() == pruned.baseline.to_json()
            and {f: r.to_json() for f, r in full.best_per_family().items()}
            == {f: r.to_json() for f, r in pruned.best_per_family().items()})
    print(f"{model:>24} {gpus:>5} GPUs: exhaustive {t_full:6.1f} s, pruned {pruned.seconds:5.1f} s; "
          f"same top {args.top}, baseline and family bests: {'yes' if same else 'NO'}", flush=True)
    if not same:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=",".join(WORKLOADS), help="models, comma-separated")
    parser.add_argument("--seq-len", default="256k")
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--gpus", default="16,128", help="cluster sizes in GPUs, comma-separated")
    parser.add_argument("--all", action="store_true", help="also the 1,024-GPU rows")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per row")
    parser.add_argument("--top", type=int, default=10, help="ranks reported, as csbp plan --top")
    parser.add_argument("--jobs", type=int, default=None, help="processes per search (default: the usable cores)")
    parser.add_argument("--check", action="store_true", help="pruned search == exhaustive search, per row")
    parser.add_argument("--before", default=None, metavar="PATH",
                        help="also time the csbp found on PYTHONPATH=PATH, interleaved")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "GPUS"), help=argparse.SUPPRESS)  # a child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args, args.one[0], int(args.one[1]))))
        return
    models = args.model.split(",")
    sizes = [int(g) for g in args.gpus.split(",")] + ([1024] if args.all and "1024" not in args.gpus else [])
    if args.check:
        for gpus in sizes:
            for model in models:
                check(args, model, gpus)
        return
    print(f"csbp.plan at {args.seq_len} on {args.hardware}, top {args.top}, {len(os.sched_getaffinity(0))} usable "
          f"cores, jobs {args.jobs or 'default'}, {args.repeat} fresh processes per row; load average before: {_load()}")
    print("goal: the whole csbp.plan (median); 'cpu s': its median CPU-seconds, the forked baseline search "
          "included; 'search' is the main search alone (found.seconds)")
    print(f"{'model':>24} {'GPUs':>5} {'cands':>6} {'fit':>5} {'pruned':>6} {'scrnd':>5} {'rescd':>5} "
          f"{'bounds f/w/q/c/t':>19}  {'plan min/med/max s':>20}  {'cpu s':>6}  {'search med s':>12}  goal")
    for gpus in sizes:
        for model in models:
            runs, before = [], []
            for _ in range(args.repeat):
                for env, into in (((_env(args.before), before),) if args.before else ()) + ((None, runs),):
                    out = subprocess.run([sys.executable, __file__, "--one", model, str(gpus), *_passed(args)],
                                         capture_output=True, text=True, env=env)
                    if out.returncode:
                        print(f"{model:>24} {gpus:>5} failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
                        break
                    into.append(json.loads(out.stdout))
            if not runs:
                continue
            if before:
                b = sorted(x["plan_s"] for x in before)
                print(f"{'(before)':>24} {gpus:>5} {before[0]['candidates']:>6} {before[0]['feasible']:>5} "
                      f"{before[0]['pruned']:>6} {before[0]['screened']:>5} {before[0]['rescored']:>5} {'-':>13}  "
                      f"{b[0]:6.2f} {statistics.median(b):6.2f} {b[-1]:6.2f}  {_cpu_median(before):>6}  "
                      f"{statistics.median(x['search_s'] for x in before):12.2f}", flush=True)
            r = runs[0]
            plans = sorted(x["plan_s"] for x in runs)
            med = statistics.median(plans)
            b = r["bounds"]
            bounds = "-" if not b else "/".join(str(b.get(k, 0)) for k in ("floor", "waits", "quick", "chain", "tight"))
            g = goal(model, r.get("gpus", gpus))
            verdict = "-" if g is None else f"<= {g:g} s {'met' if med <= g else 'MISSED'}"
            print(f"{model:>24} {gpus:>5} {r['candidates']:>6} {r['feasible']:>5} {r['pruned']:>6} "
                  f"{r['screened']:>5} {r['rescored']:>5} {bounds:>19}  "
                  f"{plans[0]:6.2f} {med:6.2f} {plans[-1]:6.2f}  {_cpu_median(runs):>6}  "
                  f"{statistics.median(x['search_s'] for x in runs):12.2f}  {verdict}  "
                  f"(load {_load()}; {r['recommended']})", flush=True)
    print(f"load average after: {_load()}")


def _cpu_median(runs: list[dict]) -> str:
    """Median CPU-seconds of the runs ('-' for a csbp whose benchmark did not report them)."""
    cpu = [x["cpu_s"] for x in runs if "cpu_s" in x]
    return f"{statistics.median(cpu):6.2f}" if cpu else "-"


def _env(path: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _passed(args: argparse.Namespace) -> list[str]:
    """The job's flags, for the child processes."""
    out = ["--seq-len", args.seq_len, "--hardware", args.hardware, "--top", str(args.top)]
    if args.jobs:
        out += ["--jobs", str(args.jobs)]
    return out


if __name__ == "__main__":
    main()
