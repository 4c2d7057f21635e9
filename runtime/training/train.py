"""Training one plan: a rank's loop and the run's JSON result.

`csbp run` (runtime.launch) runs this loop in processes it starts on this host; on a cluster,
torchrun starts it through `csbp.runtime.training.torchrun`.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import numpy as np
import torch

from csbp.runtime.training import checkpoint, faults
from csbp.runtime.memory.allocator import resident_high_water, start_peak
from csbp.runtime.distributed.comm import CATEGORIES, PHASES, CollectiveError, Comm
from csbp.runtime.models.model import BlockDiffusionLM
from csbp.runtime.distributed.plans import dp, parallelize, rank_work
from csbp.runtime.distributed.sharded_optimizer import ShardedAdamW
from csbp.simulator.cost.graph import StepGraph
from csbp.simulator.layout.layout import Layout, attention_bytes_received, kv_row_bytes
from csbp.simulator.plan.plan import Plan
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

GIB = 1024**3
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
LEARNING_RATE = 1e-3
# what this runtime executes, as an implementation profile (implementations/csbp-runtime.yaml):
# the step graph it holds its byte counts to is the one of its own calls
RUNTIME_IMPLEMENTATION = "csbp-runtime"


@dataclass(frozen=True)
class Job:
    """What to run: the model, one step's workload, the plan, and how many steps.

    Steps are numbered from 0 over warm-up and measured steps alike; a resumed job starts at
    `start_step` (the checkpoint's) and still ends at step warmup + steps.
    """

    model: ModelSpec
    workload: Workload
    plan: Plan
    steps: int = 3
    warmup: int = 1
    seed: int = 0
    capture_gradients: bool = False  # tests: one step, no update, return every gradient
    capture_parameters: bool = False  # tests: return every weight after the steps
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # steps between checkpoints; 0: only after the last step
    resume_from: str | None = None  # a checkpoint's step directory
    start_step: int = 0

    @property
    def end_step(self) -> int:
        return self.warmup + self.steps


class RankFailure(RuntimeError):
    """What ended a rank, naming the rank and the step. `secondary` when the rank only saw
    another rank fail (a broken or timed-out collective, a peer's non-finite loss), so the launcher
    can name the rank where the failure began."""

    def __init__(self, rank: int, step: int | None, error: BaseException):
        self.rank, self.step = rank, step
        self.secondary = isinstance(error, (CollectiveError, PeerLossNotFinite))
        where = "during setup" if step is None else f"at step {step}"
        text = (str(error).splitlines() or [""])[0]
        super().__init__(f"rank {rank} failed {where}: {type(error).__name__}: {text}")


class LossNotFinite(ArithmeticError):
    """This rank's part of the loss is NaN or inf: training would only spread it."""


class PeerLossNotFinite(LossNotFinite):
    """The summed loss is not finite though this rank's part is: another rank's part is."""


@dataclass
class RankReport:
    rank: int
    ctx_rank: int
    losses: list[float]  # global loss of each measured step (the same on every rank)
    step_times_s: list[float]
    peak_memory_bytes: int  # CUDA allocator peak after warm-up, or runtime.memory_tracker's on CPU
    bytes_sent: dict[str, int]  # per category, last step
    bytes_received: dict[str, int]
    attention_received_by_phase: dict[str, int]
    attention_bytes_predicted: int  # the layout's prediction for this rank, one step
    attention_predicted_by_phase: dict[str, int]
    bytes_predicted: dict[str, int]  # the step graph's, per category, received in one step
    gradients: dict[str, np.ndarray] | None = field(default=None, repr=False)
    # tensor parallelism: (dim, start, stop) in the whole weight of each gradient that is a slice
    gradient_slices: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    parameters: dict[str, np.ndarray] | None = field(default=None, repr=False)  # after the steps
    rss_peak_bytes: int = field(default_factory=lambda: _rss_peak())  # the report is made last


def device_for(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def _peak_memory(device: torch.device) -> int:
    """Allocated bytes at their peak, the quantity the memory model predicts: CUDA's allocator
    peak, or on CPU the live tensor bytes `memory_tracker` counted (0 where it did not run)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    from csbp.runtime.memory import memory_tracker

    return memory_tracker.peak_bytes() or 0


def _rss_peak() -> int:
    """The process's resident high-water mark (VmHWM), the torch/gloo baseline included. Not
    ru_maxrss where /proc exists: Linux carries that over from the parent through fork + exec,
    so a spawned rank would report its launcher's peak when that is larger."""
    high_water = resident_high_water()
    if high_water is not None:
        return high_water
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def predicted_by_phase(job: Job, ctx_rank: int, layout: Layout) -> dict[str, int]:
    """The layout's attention K/V + dK/dV bytes received by a rank in one step, by phase.

    The layout describes one sequence; a micro-batch moves its rows once per sequence; a TP rank
    moves the K/V heads it holds.
    """
    w, tp = job.workload, job.plan.tp
    return {ph: w.micro_batch * sum(layout.exchange(a, ph).rows_received(ctx_rank)
                                    * kv_row_bytes(a, w.dtype_bytes, tp) for a in job.model.layers)
            for ph in PHASES}


def zero_stage(job: Job) -> int:
    """The ZeRO stage the runtime runs: the workload's, except replicated AdamW (0) where the
    whole state must be on every rank: a gradient capture (each rank returns the whole summed
    gradient) and checkpoints (`runtime.checkpoint` stores replicated state)."""
    if job.capture_gradients or job.checkpoint_dir or job.resume_from:
        return 0
    return job.workload.zero_stage


def predicted_bytes(job: Job) -> list[dict[str, int]]:
    """The step graph's bytes received in one step per category, for each context rank (its TP,
    EP and DP copies receive the same), for the plan as the runtime runs it (`zero_stage`)."""
    w = job.workload.model_copy(update={"zero_stage": zero_stage(job)})
    layout = Layout.build(w, job.plan)
    graph = StepGraph.build(job.model, w, job.plan, layout, gpus_per_node=job.plan.world,
                            implementation=RUNTIME_IMPLEMENTATION)
    received = graph.received_bytes()
    return [{c: round(float(received[c][r])) if c in received else 0 for c in CATEGORIES}
            for r in range(layout.size)]


class Trainer:
    """One rank: model, optimizer, its share of the plan, and the step.

    `on_step(step)` is called as each step begins (the launcher names the step a killed rank
    died in); `timeout` bounds every collective of the groups the plan makes.
    """

    def __init__(self, job: Job, rank: int, device: torch.device,
                 on_step: Callable[[int], None] | None = None, timeout: timedelta | None = None):
        self.job, self.rank, self.device = job, rank, device
        self.on_step = on_step or (lambda step: None)
        self.fault = faults.from_env()
        self.comm = Comm(timeout)
        self.work = rank_work(job.model, job.workload, job.plan, rank, self.comm)
        self.model = BlockDiffusionLM(job.model, job.seed, job.workload.checkpointing == "full")
        self.slices = parallelize(self.model, self.work)  # this rank's experts, TP slices
        self.model.to(device)
        self.wire = AUTOCAST.get(job.workload.dtype, torch.float32)  # gradients travel in it
        if zero_stage(job):  # weights in the compute dtype, fp32 master + moments sharded
            # [U] fp16 weights train without a loss scaler (none exists in the runtime): bf16 is
            # the mixed-precision path this is built and tested for
            self.model.to(self.wire)
            self.optimizer = ShardedAdamW(self.model, self.work.mesh, self.comm, self.wire,
                                          lr=LEARNING_RATE)
        else:  # replicated fp32 weights and AdamW (autocast computes in the dtype)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)

    def forward_backward(self, step: int) -> float:
        """Loss and summed gradients of one step; returns the global loss.

        Raises LossNotFinite (PeerLossNotFinite when only another rank's part is bad) before
        the optimizer could spread NaN or inf into the weights.
        """
        self.comm.reset()
        dtype = AUTOCAST.get(self.job.workload.dtype)
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            loss = self.work.loss(self.model, step, self.job.seed)
        if self.fault:
            loss = self.fault.strike(self.rank, step, loss)
        if isinstance(self.optimizer, ShardedAdamW):
            self.optimizer.prepare_gradients()
        with self.comm.backward():
            loss.backward()
        if isinstance(self.optimizer, ShardedAdamW):
            self.optimizer.reduce_gradients()
        else:
            dp.all_reduce_gradients(self.model, self.comm, self.work.mesh, self.wire)
        part = loss.detach().float().reshape(1)
        total = part.clone()
        if self.work.mesh.dense.size > 1:  # one TP rank's peers hold the parts of the loss
            self.comm.all_reduce(total, "other", self.work.mesh.dense.group)
        total = total.item()
        if not math.isfinite(part.item()):
            raise LossNotFinite(f"this rank's part of the loss is {part.item()}")
        if not math.isfinite(total):
            raise PeerLossNotFinite(f"the loss is {total} from another rank's part")
        return total

    def step(self, step: int) -> float:
        loss = self.forward_backward(step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def run(self) -> RankReport:
        """The job's steps (or one gradient capture); any failure becomes a RankFailure."""
        job, step = self.job, None
        try:
            if job.capture_gradients:
                step = 0
                losses, times = [self.forward_backward(0)], []
            else:
                if job.resume_from:
                    checkpoint.load(job.resume_from, self.model, self.optimizer)
                if self.device.type == "cpu":
                    start_peak()
                losses, times = [], []
                for step in range(job.start_step, job.end_step):
                    self.on_step(step)
                    if step == job.warmup and self.device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(self.device)
                    self._sync()
                    start = time.perf_counter()
                    loss = self.step(step)
                    self._sync()
                    if step >= job.warmup:
                        losses.append(loss)
                        times.append(time.perf_counter() - start)
                    self._maybe_save(step + 1)
        except Exception as err:  # noqa: BLE001 - every failure names its rank and step
            raise RankFailure(self.rank, step, err) from err
        finally:  # a job of fewer optimizer steps than it tracks must not leave it running
            from csbp.runtime.memory import memory_tracker

            memory_tracker.stop()
        return self._report(losses, times)

    def _maybe_save(self, done: int) -> None:
        """Checkpoint after `done` steps when due (every K steps, and after the last one)."""
        job = self.job
        every = job.checkpoint_every
        if job.checkpoint_dir and (done == job.end_step or (every and done % every == 0)):
            info = checkpoint.CheckpointInfo(step=done, seed=job.seed, world=job.plan.world,
                                             model=job.model, workload=job.workload, plan=job.plan)
            checkpoint.save(job.checkpoint_dir, done, info, self.model, self.optimizer, self.rank)

    def _report(self, losses: list[float], times: list[float]) -> RankReport:
        job = self.job
        lay, w, ctx = self.work.layout, job.workload, self.work.ctx_rank
        predicted = attention_bytes_received(lay, job.model.layers, w.dtype_bytes, job.plan.tp)[ctx]
        grads = ({name: p.grad.detach().double().cpu().numpy()
                  for name, p in self.model.named_parameters() if p.grad is not None}
                 if job.capture_gradients else None)
        params = ({name: p.detach().double().cpu().numpy()
                   for name, p in self.model.named_parameters()}
                  if job.capture_parameters else None)
        return RankReport(self.rank, ctx, losses, times, _peak_memory(self.device),
                          dict(self.comm.sent), dict(self.comm.received),
                          dict(self.comm.attention_received), predicted * w.micro_batch,
                          predicted_by_phase(job, ctx, lay), predicted_bytes(job)[ctx], grads,
                          self.slices, params)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def run_jobs(jobs: list[Job], rank: int, device: torch.device,
             on_step: Callable[[int, int], None] | None = None,
             timeout: timedelta | None = None) -> list[RankReport]:
    """Every job in turn on this rank (the process group is already up); `on_step(job, step)`."""
    return [Trainer(job, rank, device, on_step and (lambda s, j=j: on_step(j, s)), timeout).run()
            for j, job in enumerate(jobs)]


def summarize(job: Job, reports: list[RankReport], device: str, notes: list[str]) -> dict:
    """The run's JSON result from every rank's report."""
    per_step = [max(r.step_times_s[i] for r in reports) for i in range(len(reports[0].step_times_s))]
    return {
        "model": job.model.name,
        "plan": job.plan.model_dump() | {"kind": job.plan.kind, "label": job.plan.label()},
        "workload": job.workload.model_dump(),
        "world": job.plan.world,
        "device": device,
        "backend": "nccl" if device == "cuda" else "gloo",
        "zero_stage": zero_stage(job),  # what ran (0 where checkpoints need replicated state)
        "steps": len(per_step),
        "warmup": job.warmup,
        "first_step": max(job.start_step, job.warmup),  # the step of losses[0]
        "resumed_from": job.resume_from,
        "step_time_s": statistics.median(per_step) if per_step else None,
        "step_times_s": per_step,
        "loss": reports[0].losses[-1],
        "losses": reports[0].losses,
        "tokens_per_s": (job.plan.sequences * job.workload.micro_batch * job.workload.seq_len
                         / statistics.median(per_step)) if per_step else None,
        "peak_memory_gib": max(r.peak_memory_bytes for r in reports) / GIB,
        "peak_memory_gib_per_rank": [r.peak_memory_bytes / GIB for r in reports],
        "rss_peak_gib": max(r.rss_peak_bytes for r in reports) / GIB,
        "attention_bytes_counted": max(r.bytes_received["attention-kv"] for r in reports),
        "attention_bytes_predicted": max(r.attention_bytes_predicted for r in reports),
        "attention_bytes_match": all(r.bytes_received["attention-kv"] == r.attention_bytes_predicted
                                     for r in reports),
        "bytes_per_rank": [{c: {"sent": r.bytes_sent[c], "received": r.bytes_received[c]}
                            for c in CATEGORIES} for r in reports],
        "attention_bytes_by_phase_per_rank": [
            {ph: {"counted": r.attention_received_by_phase[ph],
                  "predicted": r.attention_predicted_by_phase[ph]}
             for ph in r.attention_received_by_phase} for r in reports],
        "bytes_by_category": {c: {"counted": max(r.bytes_received[c] for r in reports),
                                  "predicted": max(r.bytes_predicted[c] for r in reports)}
                              for c in CATEGORIES},
        "bytes_by_category_match": {c: all(r.bytes_received[c] == r.bytes_predicted[c]
                                           for r in reports) for c in CATEGORIES},
        "bytes_by_category_per_rank": [{c: {"counted": r.bytes_received[c],
                                            "predicted": r.bytes_predicted[c]} for c in CATEGORIES}
                                       for r in reports],
        "notes": notes,
    }


def optimizer_note(job: Job) -> str:
    stage = zero_stage(job)
    if stage:
        return (f"optimizer: ZeRO-{stage} AdamW (runtime.sharded_optimizer): gradients "
                "reduce-scattered and updated weights all-gathered over each data-parallel "
                f"group, fp32 master weights and moments sharded, weights in {job.workload.dtype}"
                + ("; ZeRO-1 runs as ZeRO-2" if stage == 1 else ""))
    why = ("" if not job.workload.zero_stage else
           f" (zero_stage={job.workload.zero_stage} not used: checkpoints hold replicated state; "
           "also in the prediction)")
    return "optimizer: replicated AdamW, fp32 weights" + why


def notes_for(job: Job, device: str, world: int) -> list[str]:
    notes = ["bytes are per step: each rank's logical traffic (gloo's reduce-scatter moves more "
             "on the wire); all-reduces count a ring's 2(P-1)/P of the buffer each way; "
             "predicted: the step graph's bytes for each rank",
             optimizer_note(job)]
    if job.plan.ep > 1:
        notes.append("ep bytes follow this step's routing; the prediction assumes balanced "
                     "routing (each rank sending each peer top_k x tokens / ep rows), so they "
                     "differ by the routing's imbalance")
    if device == "cpu" and world > (os.cpu_count() or 1):
        notes.append(f"world size {world} exceeds the {os.cpu_count()} CPU cores: ranks share "
                     "cores, so step times are inflated")
    if device == "cpu" and job.workload.dtype != "fp32":
        notes.append(f"{job.workload.dtype} on CPU runs under autocast and is slow; fp32 is the "
                     "CPU reference")
    return notes
