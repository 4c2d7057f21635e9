"""The torchrun entry for clusters: the same flags as `csbp run`, ranks from the environment.

    torchrun --standalone --nproc-per-node 8 -m csbp.runtime.training.torchrun --plan plan.json --steps 10
    torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 \\
             --nproc-per-node 8 -m csbp.runtime.training.torchrun --plan plan.json

Multi-node flags belong to torchrun; this module reads RANK, WORLD_SIZE and LOCAL_RANK from the
environment, uses NCCL when CUDA is present (gloo otherwise) and prints the result on rank 0.
It sits above both `launch` (the flags) and `train` (the loop), so neither imports the other back.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from csbp.runtime.memory.allocator import keep_freed_memory
from csbp.runtime.training.launch import add_run_args, job_from_args, print_result
from csbp.runtime.training.train import RankFailure, device_for, notes_for, run_jobs, summarize
from csbp.simulator.commands.cli import _Parser
from csbp.simulator.errors import InputError


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: the same flags as `csbp run`, ranks from the environment."""
    parser = _Parser(prog="python -m csbp.runtime.training.torchrun", description=__doc__.split("\n")[0])
    add_run_args(parser)
    try:
        args = parser.parse_args(argv)
        job = job_from_args(args)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != job.plan.world:
            raise InputError(f"the plan needs {job.plan.world} ranks, torchrun started {world}")
    except InputError as err:
        print(f"runtime.torchrun: error: {err}", file=sys.stderr)
        return 2
    device = device_for(int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    try:
        (report,) = run_jobs([job], rank, device, timeout=timeout)
        reports = [None] * world
        dist.all_gather_object(reports, report)
        dist.barrier()  # every rank is past its last transfer before any tears gloo down
    except RankFailure as err:  # torchrun stops the other ranks and reports the exit codes
        print(f"runtime.torchrun: error: {err}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print_result(summarize(job, reports, device.type, notes_for(job, device.type, world)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
