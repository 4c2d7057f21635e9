"""Instructions one planner search executes (callgrind): a count this host's clock cannot blur.

The 2-core host's wall and CPU times move 10-30 % between runs of the same code minutes apart
(benchmarks/README.md), more than most single changes to the search. Valgrind's callgrind counts
the instructions a process executes: runs of the same code and inputs agree within about 1 %
(string hashes fixed here; object addresses still order some caches: Nemotron-8B at 16 GPUs read
2.640, 2.661 and 2.669 G), so a change's effect on the search's work above that reads directly. What runs: the main search of `csbp plan`
for one job, in one process (`search(keep=top, misfits=False, workers=1)`: no forked baseline
search, memory checked where the screen looks), with every simulator module imported first; a
second run that only imports is subtracted. `--before PKG` counts a package directory holding
another `csbp` too (a `git archive` of the commit before a change, as `planner_speed.py
--before` takes). Under callgrind a search runs ~30x slower: DiffusionGemma at 16 GPUs takes
about a minute per count. Not a test; run:

    python benchmarks/search_instructions.py --model diffusiongemma-26b-a4b --gpus 16 [--before PKG]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys


def _job(args: argparse.Namespace, search: bool) -> None:
    """The counted process: imports, inputs, and (`search`) the main search."""
    import importlib
    import pkgutil

    import csbp.simulator
    from csbp.api import _args
    from csbp.simulator.commands.cli_args import inputs_from_args
    from csbp.simulator.planner.planner import search as planner_search
    from csbp.simulator.system.hardware import load_profile

    for module in pkgutil.walk_packages(csbp.simulator.__path__, "csbp.simulator."):
        importlib.import_module(module.name)
    profile = load_profile(args.hardware)
    per_node = profile.node.gpus_per_node
    flags = {"model": args.model, "seq_len": args.seq_len, "nodes": args.gpus // per_node,
             "hardware": args.hardware}
    inputs = inputs_from_args(argparse.Namespace(**(vars(_args("plan", flags)) | {"checkpointing": "full"})))
    if search:
        planner_search(inputs.model, inputs.workload, profile, args.gpus // per_node, keep=args.top,
                       misfits=False, workers=1)


def _count(args: argparse.Namespace, package: str | None, search: bool) -> int:
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONHASHSEED="0")  # string hashes fixed: the same dict probes
    if package:
        env["PYTHONPATH"] = package
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
           "--model", args.model, "--gpus", str(args.gpus), "--hardware", args.hardware,
           "--seq-len", args.seq_len, "--top", str(args.top), "--one", "search" if search else "imports"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
    if out.returncode or not found:
        raise SystemExit(f"callgrind failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diffusiongemma-26b-a4b")
    parser.add_argument("--gpus", type=int, default=16)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--seq-len", default="256k")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--before", default=None, metavar="PKG", help="also count the csbp found on PYTHONPATH=PKG")
    parser.add_argument("--one", choices=("imports", "search"), help=argparse.SUPPRESS)  # the counted process
    args = parser.parse_args()
    if args.one:
        _job(args, args.one == "search")
        return
    if shutil.which("valgrind") is None:
        print("valgrind not found: install it (apt install valgrind) to count instructions", file=sys.stderr)
        sys.exit(2)
    for name, package in (("before", args.before),) * bool(args.before) + (("this checkout", None),):
        total = _count(args, package, True) - _count(args, package, False)
        print(f"{args.model} at {args.seq_len} on {args.gpus} GPUs, {name}: {total / 1e9:.3f} G instructions "
              f"(the main search, one process)", flush=True)


if __name__ == "__main__":
    main()
