"""Wall time of one full planner search and evaluations per second.

Goal: a full search for 16 GPUs (2 x 8) and one workload in <= 2 s on 2 CPU cores. The default
job is the README's main command (nemotron-diffusion-8b, 256K, 2 x 8 H200); every workload flag
of `csbp plan` works here too. Each search starts cold (the simulator's caches of layouts,
attention splits and placements are cleared first), as a fresh `csbp plan` does. Not a timed
test; run:

    python benchmarks/planner_speed.py [--model qwen3.5-27b] [--repeat 3] [--workers 1]
"""

from __future__ import annotations

import argparse
import time

from csbp.simulator.cli_args import add_cluster_args, add_workload_args, inputs_from_args
from csbp.simulator.graph import clear_caches
from csbp.simulator.hardware import load_profile
from csbp.simulator.planner import available_cores, search


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    add_cluster_args(parser)
    parser.add_argument("--repeat", type=int, default=3, help="searches per engine (best is reported)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: the usable cores)")
    args = parser.parse_args()
    inputs = inputs_from_args(args)
    profile = load_profile(args.hardware)
    gpus = args.nodes * profile.node.gpus_per_node
    cores = available_cores()
    workers = args.workers or cores
    print(f"{inputs.model.name} at seq-len {inputs.workload.seq_len} on {gpus} GPUs "
          f"({profile.name}), {cores} CPU cores, {workers} worker processes")
    for engine, what in (("closed-form", "screen only"), ("des", "full search: screen + event engine")):
        walls = []
        for _ in range(args.repeat):
            clear_caches()  # each search pays what a fresh process does
            start = time.perf_counter()
            found = search(inputs.model, inputs.workload, profile, args.nodes, engine=engine,
                           workers=workers)
            walls.append(time.perf_counter() - start)
        best = min(walls)
        print(f"{what:38s} {best:6.2f} s (best of {args.repeat}), {found.candidates} candidates, "
              f"{found.evaluations} evaluations, {found.evaluations / best:,.0f} evaluations/s")
    verdict = "meets" if best <= 2.0 else "misses"
    print(f"full search {verdict} the 2 s goal")


if __name__ == "__main__":
    main()
