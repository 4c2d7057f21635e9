"""How long a decision map takes: the issue's yardstick is a 12 x 8 map of a study model in 60 s.

    python benchmarks/map_speed.py [--model nemotron-diffusion-8b] [--hardware h200]
                                  [--engine des] [--jobs N] [--seq-lens ...] [--gpus ...]

Runs the same cell search as `csbp map` (`grid.search_cells`), prints the wall time, the slowest
cells and what the planner did in them. No file is written; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from csbp.simulator.grids.grid import CellSearch, cells, search_cells, split_list
from csbp.simulator.system.hardware import load_profile
from csbp.simulator.planner.planner import available_cores, fmt_tokens

# 12 contexts x 8 cluster sizes: 64K-1M in steps a user would plan, 1 to 128 nodes of 8 GPUs
SEQ_LENS = "64k,96k,128k,192k,256k,320k,384k,512k,640k,768k,896k,1m"
GPUS = "8,16,32,64,128,256,512,1024"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nemotron-diffusion-8b")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--engine", default="des", choices=["des", "closed-form"])
    p.add_argument("--jobs", type=int, default=available_cores())
    p.add_argument("--seq-lens", default=SEQ_LENS)
    p.add_argument("--gpus", default=GPUS)
    args = p.parse_args()
    profile = load_profile(args.hardware)
    grid = cells([args.model], split_list(args.seq_lens, "seq-lens"), split_list(args.gpus, "gpus"), profile)
    start, cpu0 = time.perf_counter(), _cpu_seconds()
    answers = search_cells(grid, profile, engine=args.engine, jobs=args.jobs)
    wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu0
    n_l, n_g = len(split_list(args.seq_lens, "seq-lens")), len(split_list(args.gpus, "gpus"))
    print(f"{n_l} x {n_g} map of {args.model} on {args.hardware} ({args.engine}, {args.jobs} jobs, "
          f"{available_cores()} cores): {wall:.1f} s wall, {cpu:.1f} CPU s "
          f"(load average {os.getloadavg()[0]:.1f}: a shared host stretches the wall time)")
    print("slowest cells (search seconds, candidates, simulations):")
    for a in sorted(answers, key=_seconds, reverse=True)[:5]:
        f = a.found
        what = f"{f.candidates} candidates, {f.evaluations} simulations" if f else "nothing fits"
        print(f"  {fmt_tokens(a.cell.seq_len):>5} on {a.cell.gpus:>4} GPUs: {_seconds(a):6.1f} s, {what}")


def _cpu_seconds() -> float:
    """CPU time of this process and its finished workers: steadier than wall time on a shared host."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _seconds(a: CellSearch) -> float:
    return a.found.seconds if a.found else 0.0


if __name__ == "__main__":
    main()
