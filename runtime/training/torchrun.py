"""The torchrun entry for clusters: the same flags as `csbp run`, ranks from the environment.

    torchrun --standalone --nproc-per-node 8 -m csbp.runtime.training.torchrun --plan plan.json --steps 10
    torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 \\
             --nproc-per-node 8 -m csbp.runtime.training.torchrun --plan plan.json --hardware my-cluster.yaml
    torchrun ... -m csbp.runtime.training.torchrun --calibrate --out my-cluster.yaml --hardware h200

Multi-node flags belong to torchrun; this module reads RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE from the environment, uses NCCL when CUDA is present (gloo otherwise) and prints
the result on rank 0: the measured step time, tokens/s and each rank's allocated peak beside the
simulator's prediction on a profile (`--hardware`, else the plan file's, else the device's
default) and the errors (`run_prediction`); on CUDA also one profiled step after warm-up split by
phase against the step graph's (`step_phases`). `--calibrate` measures the fabric into a profile
instead (`runtime/calibration/cluster_calibrate.py`).
It sits above both `launch` (the flags) and `train` (the loop), so neither imports the other back.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from csbp.runtime.calibration.cluster_calibrate import add_calibrate_args, calibrate, settings_from_args
from csbp.runtime.memory.allocator import keep_freed_memory
from csbp.runtime.training import run_prediction, step_phases
from csbp.runtime.training.launch import add_run_args, is_plan_file, job_from_args, print_result
from csbp.runtime.training.train import RankFailure, Trainer, device_for, notes_for, summarize
from csbp.simulator.commands.cli import _Parser
from csbp.simulator.errors import InputError

PROG = "python -m csbp.runtime.training.torchrun"


def _ranks() -> tuple[int, int, int]:
    """(rank, world, ranks on this node) from torchrun's environment."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise InputError("RANK and WORLD_SIZE are not set: start this module with torchrun") from None
    return rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: the same flags as `csbp run`, ranks from the environment."""
    parser = _Parser(prog=PROG, description=__doc__.split("\n")[0])
    add_run_args(parser)
    add_calibrate_args(parser)
    lead = os.environ.get("RANK", "0") == "0"
    device = device_for(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        args = parser.parse_args(argv)
        rank, world, per_node = _ranks()
        if args.calibrate:
            settings = settings_from_args(args, "h200" if device.type == "cuda" else "cpu-measured")
        else:
            job = job_from_args(args)
            if world != job.plan.world:
                raise InputError(f"the plan needs {job.plan.world} ranks, torchrun started {world}")
            if world % per_node:
                raise InputError(f"LOCAL_WORLD_SIZE {per_node} does not divide the world size {world}")
            choice = run_prediction.choose_profile(args.hardware, _plan_hardware(args), device.type)
            from csbp.simulator.system.hardware import load_profile

            prediction = run_prediction.predict(job, load_profile(choice.name_or_path), world,
                                                per_node, device.type)
    except InputError as err:
        if lead:
            print(f"runtime.torchrun: error: {err}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    try:
        if args.calibrate:
            command = f"torchrun (world {world}, {per_node} per node) -m csbp.runtime.training.torchrun " \
                      + " ".join(sys.argv[1:] if argv is None else argv)
            return calibrate(settings, rank, world, device, command, args.json)
        report, split = _run(job, rank, device, timeout)
        reports, splits = [None] * world, [None] * world
        dist.all_gather_object(reports, report)
        dist.all_gather_object(splits, split)
        dist.barrier()  # every rank is past its last transfer before any tears gloo down
    except RankFailure as err:  # torchrun stops the other ranks and reports the exit codes
        print(f"runtime.torchrun: error: {err}", file=sys.stderr)
        return 1
    except InputError as err:  # found only with the ranks up (a node layout the flags refuse)
        if lead:
            print(f"runtime.torchrun: error: {err}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    if rank == 0:
        result = summarize(job, reports, device.type, notes_for(job, device.type, world))
        predicted, allocated = prediction
        result.update(run_prediction.compare(result, [r.ctx_rank for r in reports], predicted,
                                             allocated, choice))
        result.update(_phase_fields(splits, predicted))
        print_result(result, args)
        if not args.json:
            run_prediction.print_comparison(result)
    return 0


def _plan_hardware(args) -> str | None:
    if not is_plan_file(args.plan):
        return None
    from csbp.simulator.planner import planfile

    return planfile.load(args.plan).hardware


def _run(job, rank: int, device: torch.device, timeout: timedelta):
    """(this rank's report, its profiled step split by phase or None). On CUDA the last measured
    step runs under torch.profiler (its kernels, with the blocks' recompute marked)."""
    if device.type != "cuda":
        return Trainer(job, rank, device, timeout=timeout).run(), None
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    last, started = job.end_step - 1, []

    def on_step(step: int) -> None:
        if step == last and step >= job.warmup and not started:
            prof.start()
            started.append(step)

    trainer = Trainer(job, rank, device, on_step, timeout)
    hooks = step_phases.mark_recompute(trainer.model)
    try:
        report = trainer.run()
    finally:
        for h in hooks:
            h.remove()
        if started:
            prof.stop()
    if not started:
        return report, None
    try:
        return report, step_phases.split(step_phases.kernel_events(prof))
    except Exception as err:  # noqa: BLE001 - the measured run stands without its split
        return report, {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def _phase_fields(splits: list, predicted) -> dict:
    """The run's phase split: the rank whose profiled compute is largest, against the step
    graph's; on CPU (no kernel times) a note instead."""
    if not any(s and "error" not in s for s in splits):
        why = next((s["error"] for s in splits if s and "error" in s), None)
        return {"phase_split": None, "phase_split_note": (
            f"per-phase split failed: {why}" if why else
            "per-phase split: CUDA only (torch.profiler kernel times); skipped on CPU")}
    valid = [r for r, s in enumerate(splits) if s and "error" not in s]
    rank = max(valid, key=lambda r: sum(splits[r][p] for p in step_phases.PHASES))
    return {"phase_split": step_phases.compare(splits[rank], step_phases.predicted_split(
                predicted.trace, predicted.exposed_comm_s)),
            "phase_split_rank": rank,
            "phase_split_note": "kernel times of the last measured step under torch.profiler "
                                "(its step time includes the profiler's overhead); predicted: "
                                "the step graph's compute per phase on its busiest rank"}


if __name__ == "__main__":
    sys.exit(main())
