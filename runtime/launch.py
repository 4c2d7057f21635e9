"""`csbp run`: start a plan's world size on this host, train a few steps, report what was measured.

    csbp run --model tiny --seq-len 1024 --block-size 64 --plan cp=2,bp=2 --steps 3 --json
    csbp run --plan plan.json --steps 10 --out result.json

One process per rank: gloo on CPU, NCCL when there is a GPU per rank. Processes are spawned here
and joined with a timeout, so a stuck collective fails the run instead of hanging it. World sizes
above the core count are allowed (ranks then share cores; the result says so).
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

from simulator.cli_args import add_plan_args, add_workload_args, inputs_from_args, plan_from_args
from simulator.errors import InputError
from simulator.report import dumps, print_json


def add_run_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_plan_args(p)
    p.set_defaults(model="tiny", seq_len="1024", block_size=64, dtype="fp32")
    p.add_argument("--steps", type=int, default=3, help="measured steps after warm-up (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (default 1)")
    p.add_argument("--seed", type=int, default=0, help="weights, data and noise seed")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when there is a GPU per rank, else CPU")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds before the run is abandoned (default 900)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", metavar="RESULT_JSON", help="also write the JSON result here")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="run a plan for real on this host and measure it",
        description="Start the plan's world size on this host (gloo on CPU, NCCL on GPUs), train "
                    "--steps steps after warm-up and report median step time, loss, peak memory "
                    "and bytes per category, with attention bytes next to the layout's prediction. "
                    "--plan takes a plan file (from `csbp plan --out`) or degrees like cp=2,bp=2; "
                    "without a file the model defaults to tiny, seq-len 1024, block 64, fp32.")
    add_run_args(p)
    p.set_defaults(func=run)


def is_plan_file(text: str | None) -> bool:
    return bool(text) and (text.endswith(".json") or Path(text).is_file())


def job_from_args(args: argparse.Namespace):
    """The job the flags (or the plan file) describe, checked before any process starts."""
    from runtime import planfile
    from runtime.model import check_supported
    from runtime.plans.dp import check_supported as check_plan_supported
    from runtime.train import Job

    if is_plan_file(args.plan):
        pf = planfile.load(args.plan)
        model, workload, plan = pf.model_spec(), pf.workload, pf.plan
    else:
        inputs = inputs_from_args(args)
        model, workload, plan = inputs.model, inputs.workload, plan_from_args(args)
    plan.check_against(model, workload)
    check_supported(model)
    check_plan_supported(plan)
    if workload.objective != "bd3lm":
        raise InputError(f"objective {workload.objective} is not supported by the runtime yet "
                         "(use --objective bd3lm)")
    if args.steps < 1 or args.warmup < 0:
        raise InputError("--steps must be at least 1 and --warmup at least 0")
    return Job(model, workload, plan, steps=args.steps, warmup=args.warmup, seed=args.seed)


def pick_device(choice: str, world: int) -> str:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and gpus < world:
        raise InputError(f"--device cuda needs one GPU per rank: {world} ranks, {gpus} GPUs")
    return "cuda" if choice == "cuda" or (choice == "auto" and 0 < world <= gpus) else "cpu"


def run(args: argparse.Namespace) -> int:
    from runtime.train import notes_for, summarize

    job = job_from_args(args)
    device = pick_device(args.device, job.plan.world)
    (reports,) = spawn([job], job.plan.world, device, args.timeout)
    print_result(summarize(job, reports, device, notes_for(job, device, job.plan.world)), args)
    return 0


def print_result(result: dict, args: argparse.Namespace) -> None:
    if args.out:
        Path(args.out).write_text(dumps(result) + "\n")
    if args.json:
        print_json(result)
        return
    w, counted, predicted = result["workload"], result["attention_bytes_counted"], result["attention_bytes_predicted"]
    print(f"{result['model']}  L={w['seq_len']} b={w['block_size']} {w['dtype']}  plan "
          f"{result['plan']['label']} ({result['plan']['kind']}, {result['plan']['transport']})  "
          f"world {result['world']} on {result['device']} ({result['backend']})")
    print(f"  step time    {result['step_time_s']:.4f} s  (median of {result['steps']} after "
          f"{result['warmup']} warm-up)")
    print(f"  loss         {result['loss']:.4f}")
    print(f"  peak memory  {result['peak_memory_gib']:.3f} GiB  (max over ranks)")
    print(f"  attention    {counted:,} B counted, {predicted:,} B predicted per step (max over "
          f"ranks): {'match' if result['attention_bytes_match'] else 'MISMATCH'}")
    for rank, b in enumerate(result["bytes_per_rank"]):
        print(f"  rank {rank} received  " + "  ".join(f"{c} {v['received']:,} B" for c, v in b.items()))
    for note in result["notes"]:
        print(f"  note: {note}")


def spawn(jobs: list, world: int, device: str = "cpu", timeout_s: float = 600) -> list[list]:
    """Run `jobs` in `world` fresh processes of this host -> reports[job][rank].

    Raises TimeoutError after `timeout_s`, RuntimeError when a rank fails (with its traceback)
    and InputError when a rank rejects its input; every process is killed on the way out.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_rank_main, args=(r, world, init, jobs, device, timeout_s, results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        try:
            got = _collect(procs, results, timeout_s)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    return [[got[r][j] for r in range(world)] for j in range(len(jobs))]


def _collect(procs: list, results, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    got: dict[int, list] = {}
    while len(got) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                rank, code = dead[0]
                hint = " (killed: out of memory?)" if code == -9 else ""
                raise RuntimeError(f"rank {rank} died with exit code {code}{hint}") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not finish within {timeout_s:.0f} s") from None
            continue
        if not ok:
            kind, text = payload
            if kind == "input":
                raise InputError(text)
            raise RuntimeError(f"rank {rank} failed:\n{text}")
        got[rank] = payload
    return got


def _rank_main(rank: int, world: int, init: str, jobs: list, device: str, timeout_s: float,
               results) -> None:
    import torch
    import torch.distributed as dist

    from runtime.train import run_jobs

    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init,
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        reports = run_jobs(jobs, rank, torch.device(device, rank) if device == "cuda"
                           else torch.device("cpu"))
        results.put((rank, True, reports))
    except InputError as err:
        results.put((rank, False, ("input", str(err))))
    except BaseException:  # noqa: BLE001 - any failure must reach the parent, not hang it
        results.put((rank, False, ("crash", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

