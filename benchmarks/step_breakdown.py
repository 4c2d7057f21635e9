"""Where a CPU step's time goes, measured in the runtime and predicted by the simulator.

    python benchmarks/step_breakdown.py cp=2,bp=2 1024 [--profile cpu-measured]

Runs the validation model (`csbp validate`'s) on this host with the plan, times every rank's
attention (forward, recompute and backward, less the collectives inside), its collectives and
the rest of the step, and prints them beside the simulated step's ops of the same kinds on the
measured profile. A gap in one row names the mechanism to look at; the validation error alone
does not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KINDS = ("attention", "collectives", "rest", "step")


def _rank(rank: int, world: int, plan_text: str, seq_len: int, steps: int, init: str, queue) -> None:
    from csbp.runtime.memory.allocator import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(1)
    import csbp.runtime.models.attention as attention
    import csbp.runtime.distributed.comm as comm

    spent: dict[str, float] = defaultdict(float)
    inside = {"attention": 0}  # > 0 while an attention forward or backward is running
    clock = {}

    def timed_comm(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - start
                spent["collectives"] += took
                if inside["attention"]:
                    spent["attention"] -= took
        return call

    for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"):
        setattr(comm.Comm, op, timed_comm(getattr(comm.Comm, op)))

    class Boundary(torch.autograd.Function):
        """Identity; its backward marks where attention's backward starts (on the output) or
        ends (on the input)."""

        @staticmethod
        def forward(ctx, x, starts_backward):
            ctx.starts = starts_backward
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if ctx.starts:
                clock["backward"] = time.perf_counter()
                inside["attention"] += 1
            else:
                spent["attention"] += time.perf_counter() - clock["backward"]
                inside["attention"] -= 1
            return grad, None

    call = attention.Attention.__call__

    def timed_attention(self, layer, q, k, v):
        q = Boundary.apply(q, False) if q.requires_grad else q
        inside["attention"] += 1
        start = time.perf_counter()
        out = call(self, layer, q, k, v)
        spent["attention"] += time.perf_counter() - start
        inside["attention"] -= 1
        return Boundary.apply(out, True) if out.requires_grad else out

    attention.Attention.__call__ = timed_attention

    from csbp.runtime.training.train import Job, Trainer
    from csbp.runtime.validation.validation_suite import BLOCK, VALIDATION_MODEL
    from csbp.simulator.plan.plan import parse_plan
    from csbp.simulator.workload.workload import Workload

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    job = Job(VALIDATION_MODEL, Workload(seq_len=seq_len, block_size=BLOCK, dtype="fp32", zero_stage=0),
              parse_plan(plan_text), steps=steps, warmup=2)
    trainer = Trainer(job, rank, torch.device("cpu"))
    for s in range(job.warmup):
        trainer.step(s)
    rows = []
    for s in range(steps):
        spent.clear()
        dist.barrier()
        start = time.perf_counter()
        trainer.step(job.warmup + s)
        step = time.perf_counter() - start
        rows.append({"step": step, "attention": spent["attention"], "collectives": spent["collectives"],
                     "rest": step - spent["attention"] - spent["collectives"]})
    queue.put((rank, rows))
    dist.destroy_process_group()


def measure(plan_text: str, seq_len: int, steps: int) -> dict[int, dict[str, float]]:
    """Per rank, the median over steps of each kind's seconds."""
    from csbp.simulator.plan.plan import parse_plan

    world = parse_plan(plan_text).world
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_rank, args=(r, world, plan_text, seq_len, steps, init, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = dict(queue.get() for _ in procs)
        for p in procs:
            p.join(timeout=30)
    return {r: {k: statistics.median(row[k] for row in rows) for k in KINDS} for r, rows in got.items()}


def predict(plan_text: str, seq_len: int, profile_name: str) -> dict[int, dict[str, float]]:
    """Per representative rank, the simulated seconds of the same kinds (validation settings)."""
    from csbp.runtime.validation.validate import predict as simulate_case
    from csbp.runtime.validation.validation_suite import BLOCK, Case
    from csbp.simulator.system.hardware import load_profile
    from csbp.simulator.plan.plan import parse_plan
    from csbp.simulator.workload.workload import Workload

    case = Case(parse_plan(plan_text), Workload(seq_len=seq_len, block_size=BLOCK, dtype="fp32", zero_stage=0))
    result = simulate_case(case, load_profile(profile_name))
    out: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(KINDS, 0.0))
    for e in result.trace:
        kind = "collectives" if e.stream == "comm" else "attention" if ".attn" in e.name else "rest"
        out[e.rank][kind] += e.duration_s
    for r in out:
        out[r]["step"] = result.step_time_s
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("plan")
    parser.add_argument("seq_len", type=int)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile", default="cpu-measured")
    args = parser.parse_args()
    measured = measure(args.plan, args.seq_len, args.steps)
    predicted = predict(args.plan, args.seq_len, args.profile)
    print(f"{args.plan} L={args.seq_len}: ms per step, measured / predicted (error)")
    for rank in sorted(measured):
        p = predicted.get(rank) or predicted[min(predicted)]  # ranks the graph does not represent
        cells = [f"{k} {measured[rank][k] * 1e3:7.1f} / {p[k] * 1e3:7.1f} ({p[k] / measured[rank][k] - 1:+4.0%})"
                 for k in KINDS]
        print(f"  rank {rank}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
