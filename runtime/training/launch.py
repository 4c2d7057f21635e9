"""`csbp run`: start a plan's world size on this host, train a few steps, report what was measured.

    csbp run --model tiny --seq-len 1024 --block-size 64 --plan cp=2,bp=2 --steps 3 --json
    csbp run --model tiny --seq-len 1024 --objective ar --plan cp=2 --json
    csbp run --plan plan.json --steps 10 --out result.json
    csbp run --model nemotron-diffusion-8b --seq-len 64k --plan cp=8,bp=8 --emulate-rank 3 --layers 2

One process per rank: gloo on CPU, NCCL when there is a GPU per rank. Processes are spawned here
and joined with a timeout, so a stuck collective fails the run instead of hanging it. World sizes
above the core count are allowed (ranks then share cores; the result says so). When a rank fails
or dies, every rank is stopped and the run ends with one line naming the rank and the step.
`--emulate-rank R` runs rank R of the plan alone on this device instead, its collectives
answered locally, each op timed beside the step graph's prediction (`runtime.emulate`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from csbp.simulator.commands.cli_args import add_plan_args, add_workload_args, inputs_from_args, plan_from_args
from csbp.simulator.errors import InputError
from csbp.simulator.layout.layout import Layout
from csbp.simulator.report.report import dumps, print_json


def add_run_args(p: argparse.ArgumentParser) -> None:
    add_workload_args(p)
    add_plan_args(p)
    p.set_defaults(model="tiny", seq_len="1024", dtype="fp32")  # block: RUN_BLOCK_SIZE
    p.add_argument("--steps", type=int, default=3, help="measured steps after warm-up (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (default 1)")
    p.add_argument("--seed", type=int, default=0, help="weights, data and noise seed")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when there is a GPU per rank, else CPU")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds a collective waits for a peer, and that the run may go without "
                        "any rank beginning a step, before it is abandoned (default 900)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", metavar="RESULT_JSON", help="also write the JSON result here")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="write checkpoints (torch.distributed.checkpoint) to DIR/step-N")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="checkpoint every K steps (default: only after the last step)")
    p.add_argument("--resume", metavar="DIR", help="continue from the newest checkpoint in DIR "
                   "(same model and seed; plan and world size may differ)")
    p.add_argument("--emulate-rank", type=int, default=None, metavar="R",
                   help="run only rank R of the plan, alone on this device, with its collectives "
                        "answered by local buffers of the received size; report per-op times, "
                        "peak memory and the step graph's prediction for that rank")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="keep only the model's first N layers")
    p.add_argument("--hardware", default=None,
                   help="profile the emulated rank's prediction is priced on (default: h200 on "
                        "a GPU, cpu-measured on CPU)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="run a plan for real on this host and measure it",
        description="Start the plan's world size on this host (gloo on CPU, NCCL on GPUs), train "
                    "--steps steps after warm-up and report median step time, loss, peak memory "
                    "and bytes per category, with attention bytes next to the layout's prediction. "
                    "--plan takes a plan file (from `csbp plan --out`) or degrees like cp=2,bp=2; "
                    "without a file the model defaults to tiny, seq-len 1024, block 64, fp32. "
                    "--objective ar trains plain next-token prediction on one causal sequence "
                    "(dp, cp, tp; no blocks, so no bp).")
    add_run_args(p)
    p.set_defaults(func=run)


RUN_BLOCK_SIZE = 64  # without a plan file or --block-size (objective ar has no blocks)
RUNTIME_OBJECTIVES = ("bd3lm", "ar")  # what plans.Work.loss trains
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week; torch's timeouts overflow far beyond
MAX_RANKS_PER_CORE = 8  # beyond this, ranks sharing a core only thrash
SCORE_COPIES = 4  # scores, probabilities and their gradients alive at once in one layer
RANK_OVERHEAD_BYTES = 400 * 2**20  # torch and gloo in each process


class RunFailed(RuntimeError):
    """The run ended early: a rank failed, died or timed out. The message is one line."""


def is_plan_file(text: str | None) -> bool:
    return bool(text) and (text.endswith(".json") or Path(text).is_file())


def job_from_args(args: argparse.Namespace):
    """The job the flags (or the plan file) describe, checked before any process starts."""
    from csbp.runtime.training import checkpoint
    from csbp.runtime.emulation.emulate import cut_layers
    from csbp.simulator.planner import planfile
    from csbp.runtime.models.model import check_supported
    from csbp.runtime.distributed.plans import check_supported as check_plan_supported
    from csbp.runtime.training.train import RUNTIME_IMPLEMENTATION, Job

    if is_plan_file(args.plan):
        pf = planfile.load(args.plan)
        model, workload, plan = pf.model_spec(), pf.workload, pf.plan
    else:
        if args.block_size is None and args.objective != "ar":  # ar has no blocks
            args.block_size = RUN_BLOCK_SIZE
        inputs = inputs_from_args(args)
        model, workload, plan = inputs.model, inputs.workload, plan_from_args(args)
    plan.check_against(model, workload, implementation=RUNTIME_IMPLEMENTATION)  # plan_rules.py
    check_supported(model)
    check_plan_supported(model, workload, plan)
    if workload.objective not in RUNTIME_OBJECTIVES:
        raise InputError(f"objective {workload.objective} is not supported by the runtime yet "
                         f"(use --objective {' or '.join(RUNTIME_OBJECTIVES)})")
    if args.steps < 1 or args.warmup < 0:
        raise InputError("--steps must be at least 1 and --warmup at least 0")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        raise InputError(f"--timeout {args.timeout}: use more than 0 and at most "
                         f"{MAX_TIMEOUT_S:.0f} seconds")
    if args.checkpoint_every < 0 or (args.checkpoint_every and not args.checkpoint_dir):
        raise InputError("--checkpoint-every K needs K >= 1 and a --checkpoint-dir")
    if (args.checkpoint_dir or args.resume) and (plan.tp > 1 or plan.ep > 1):
        raise InputError(f"checkpoints of sliced weights (tp={plan.tp}, ep={plan.ep}) are not "
                         "supported by the runtime yet: checkpoint a plan without TP and EP")
    model = cut_layers(model, getattr(args, "layers", None))
    job = Job(model, workload, plan, steps=args.steps, warmup=args.warmup, seed=args.seed,
              checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every)
    if args.resume:
        path, info = checkpoint.latest(args.resume)
        checkpoint.check_resumable(info, path, model, args.seed, job.end_step)
        job = replace(job, resume_from=str(path), start_step=info.step)
    return job


def check_host(job, device: str) -> None:
    """A run that cannot fit this host is bad input, not a run killed by the kernel later.

    Counts what every rank holds for sure: the weights and gradients plus AdamW's two moments
    (fp32, replicated) and its largest attention score block (the CPU runtime scores its
    queries against every key of the 2L sequence, several such blocks alive at once).
    """
    world = job.plan.world
    cores = os.cpu_count() or 1
    if device == "cpu" and world > MAX_RANKS_PER_CORE * cores:
        raise InputError(f"world size {world}: at most {MAX_RANKS_PER_CORE} ranks per core "
                         f"({MAX_RANKS_PER_CORE * cores} on this host's {cores} cores)")
    available = _available_memory()
    if device != "cpu" or available is None:
        return
    w, spec = job.workload, job.model
    layout = Layout.build(w, job.plan)
    queries = max(share.n_positions for share in layout.shares)
    heads = max(a.n_heads for a in spec.layers)
    scores = SCORE_COPIES * 4 * w.micro_batch * heads * queries * 2 * w.seq_len
    per_rank = 16 * spec.total_params() + scores + RANK_OVERHEAD_BYTES
    if world * per_rank > available:
        raise InputError(f"the run needs about {world * per_rank / 2**30:.1f} GiB over {world} "
                         f"ranks (weights, AdamW state, attention scores) and this host has "
                         f"{available / 2**30:.1f} GiB available: use a smaller model or "
                         "context")


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is none."""
    from csbp.runtime.memory.allocator import proc_bytes

    return proc_bytes("/proc/meminfo", "MemAvailable")


def pick_device(choice: str, world: int) -> str:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "cuda" and gpus < world:
        raise InputError(f"--device cuda needs one GPU per rank: {world} ranks, {gpus} GPUs")
    return "cuda" if choice == "cuda" or (choice == "auto" and 0 < world <= gpus) else "cpu"


def run(args: argparse.Namespace) -> int:
    from csbp.runtime.training.train import notes_for, summarize

    if args.emulate_rank is not None:
        return emulate_rank(args)
    if args.hardware is not None:
        raise InputError("--hardware prices an emulated rank: use it with --emulate-rank")
    job = job_from_args(args)
    device = pick_device(args.device, job.plan.world)
    check_host(job, device)
    try:
        (reports,) = spawn([job], job.plan.world, device, args.timeout)
    except RunFailed as err:
        print(f"csbp: error: {err}", file=sys.stderr)
        return 1
    print_result(summarize(job, reports, device, notes_for(job, device, job.plan.world)), args)
    return 0


def emulate_rank(args: argparse.Namespace) -> int:
    """`--emulate-rank R`: rank R of the plan alone on this device (runtime.emulate)."""
    import torch

    from csbp.runtime.memory.allocator import keep_freed_memory
    from csbp.runtime.emulation.emulate import check_rank, emulate, print_emulation
    from csbp.runtime.training.train import RankFailure
    from csbp.simulator.system.hardware import load_profile

    if args.checkpoint_dir or args.resume:
        raise InputError("--emulate-rank runs one rank alone: it neither writes nor resumes "
                         "checkpoints")
    job = job_from_args(args)
    check_rank(job, args.emulate_rank)
    device = pick_device(args.device, 1)
    profile = load_profile(args.hardware or ("h200" if device == "cuda" else "cpu-measured"))
    if device == "cpu":
        keep_freed_memory()  # as a CPU rank of `csbp run` does
    try:
        result = emulate(job, args.emulate_rank, torch.device(device), profile).to_json()
    except RankFailure as err:
        print(f"csbp: error: {err}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).write_text(dumps(result) + "\n")
    if args.json:
        print_json(result)
    else:
        print_emulation(result)
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
    if result["resumed_from"]:
        print(f"  resumed      from {result['resumed_from']}, first measured step "
              f"{result['first_step']}")
    print(f"  peak memory  {result['peak_memory_gib']:.3f} GiB  (max over ranks)")
    print(f"  attention    {counted:,} B counted, {predicted:,} B predicted per step (max over "
          f"ranks): {'match' if result['attention_bytes_match'] else 'MISMATCH'}")
    for c, pair in result["bytes_by_category"].items():
        if c == "attention-kv":  # the line above
            continue
        verdict = "match" if result["bytes_by_category_match"][c] else "MISMATCH"
        print(f"  {c:<12} {pair['counted']:,} B counted, {pair['predicted']:,} B predicted "
              f"(max over ranks): {verdict}")
    for rank, b in enumerate(result["bytes_per_rank"]):
        print(f"  rank {rank} received  " + "  ".join(f"{c} {v['received']:,} B" for c, v in b.items()))
    for note in result["notes"]:
        print(f"  note: {note}")


GRACE_S = 3.0  # after a first failure, how long to wait for the report of the rank it began on


def spawn(jobs: list, world: int, device: str = "cpu", timeout_s: float = 600) -> list[list]:
    """Run `jobs` in `world` fresh processes of this host -> reports[job][rank].

    `timeout_s` bounds every collective (the process-group timeout) and, with a margin for the
    ranks to report it, the time the run may go without any rank beginning a step. Raises
    InputError when a rank rejects its input and RunFailed when a rank fails, dies or the run
    stalls; every process is killed on the way out.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, world, init, jobs, device, timeout_s, pipes[r][1]))
                 for r in range(world)]
        for p in procs:
            p.start()
        for _, sender in pipes:
            sender.close()  # the parent keeps only the reading ends: a dead rank reads as EOF
        try:
            got = _Watch(procs, [reader for reader, _ in pipes]).collect(timeout_s + 2 * GRACE_S)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
    return [[got[r][j] for r in range(world)] for j in range(len(jobs))]


class _Watch:
    """The parent's view of the ranks: what each reported, the step each began last."""

    def __init__(self, procs: list, readers: list):
        self.procs = procs
        self.open = dict(enumerate(readers))  # rank -> pipe, until the rank's end closes
        self.done: dict[int, list] = {}
        self.failed: dict[int, tuple[str, bool]] = {}  # rank -> (message, secondary)
        self.at: dict[int, tuple[int, int]] = {}  # rank -> (job, step) begun last
        self.jobs = 1

    def collect(self, timeout_s: float) -> dict[int, list]:
        from multiprocessing.connection import wait

        progress = time.monotonic()
        trouble_since = None
        while len(self.done) < len(self.procs):
            for reader in wait(list(self.open.values()), timeout=0.2):
                if self._read(next(r for r, c in self.open.items() if c is reader)):
                    progress = time.monotonic()
            now = time.monotonic()
            if trouble_since is None and (self.failed or self._dead()):
                trouble_since = now
            settled = all(r in self.done or r in self.failed or r in self._dead()
                          for r in range(len(self.procs)))
            if trouble_since is not None and (settled or now > trouble_since + GRACE_S):
                raise RunFailed(self._verdict())
            if now > progress + timeout_s:
                raise RunFailed(f"no rank made progress for {timeout_s:.0f} s ({self._where()})")
        return self.done

    def _read(self, rank: int) -> bool:
        """Take one message of `rank`; True when it is progress (a step begun, a job done)."""
        try:
            kind, payload = self.open[rank].recv()
        except (EOFError, OSError):  # the rank exited or died; its exit code tells which
            del self.open[rank]
            self.procs[rank].join(timeout=1)
            return False
        if kind == "step":
            self.at[rank] = payload
            self.jobs = max(self.jobs, payload[0] + 1)
        elif kind == "input":
            raise InputError(payload)
        elif kind == "failed":
            self.failed[rank] = payload
        else:
            self.done[rank] = payload
        return kind in ("step", "done")

    def _dead(self) -> list[int]:
        return [r for r, p in enumerate(self.procs)
                if p.exitcode not in (None, 0) and r not in self.failed and r not in self.done]

    def _step(self, rank: int) -> str:
        if rank not in self.at:
            return "during setup"
        job, step = self.at[rank]
        return f"at step {step}" + (f" of job {job}" if self.jobs > 1 else "")

    def _where(self) -> str:
        return ", ".join(f"rank {r} {self._step(r)}" for r in range(len(self.procs))
                         if r not in self.done)

    def _verdict(self) -> str:
        """The rank the failure began on: one that failed by itself, else one that died, else
        one that saw a peer fail (with the ranks still running, which may be stuck)."""
        primary = [r for r, (_, secondary) in sorted(self.failed.items()) if not secondary]
        if primary:
            return self.failed[primary[0]][0]
        dead = self._dead()
        if dead:
            rank, code = dead[0], self.procs[dead[0]].exitcode
            how = (f"was killed by signal {-code}" + (" (out of memory?)" if code == -9 else "")
                   if code < 0 else f"exited with code {code}")
            return f"rank {rank} {how} {self._step(rank)}"
        rank = min(self.failed)
        running = [r for r in range(len(self.procs)) if r not in self.failed and r not in self.done]
        stuck = f" (still running: rank {', '.join(map(str, running))})" if running else ""
        return self.failed[rank][0] + stuck


def _rank_main(rank: int, world: int, init: str, jobs: list, device: str, timeout_s: float,
               conn) -> None:
    import torch
    import torch.distributed as dist

    from csbp.runtime.memory.allocator import keep_freed_memory
    from csbp.runtime.training.train import RankFailure, run_jobs

    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            keep_freed_memory()
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init,
                                rank=rank, world_size=world, timeout=timeout)
        reports = run_jobs(jobs, rank, torch.device(device, rank) if device == "cuda"
                           else torch.device("cpu"), lambda j, s: conn.send(("step", (j, s))),
                           timeout)
        conn.send(("done", reports))
    except InputError as err:
        conn.send(("input", str(err)))
    except Exception as err:  # noqa: BLE001 - any failure must reach the parent, not hang it
        failure = err if isinstance(err, RankFailure) else RankFailure(rank, None, err)
        conn.send(("failed", (str(failure), failure.secondary)))
        # reported: leave without tearing the process group down. Its peers may still be inside
        # a collective, and destroying it (or the interpreter's exit) with their work pending
        # leaves a C++ thread joinable, whose std::terminate prints a line of its own on the
        # stderr the user reads ("terminate called without an active exception"; seen under load)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
