"""The one-GPU check: kernels at the study's shapes, a measured profile, and one CP rank and one
CSBP rank of Nemotron-8B-shaped layers emulated at 64K, 128K and 256K, measured vs predicted.

Why: GPUs are lent rarely and briefly (one H200, ~15 minutes a task), so the check that runs then
must be prepared, short, and aimed at what the product predicts: the compute side of CP against
CSBP (kernels, copies, memory) at real shapes. Steps, in order, each timed and each skipped with
the reason recorded when the budget (`--budget-s`) could not take it:

1. environment: device, torch, CUDA, memory;
2. microbenchmarks (`kernel_bench`): GEMMs over the model's projections, HBM copy / elementwise /
   launch, MoE grouped GEMM (F.grouped_mm at DiffusionGemma's expert shapes), the Gated-DeltaNet
   chunked delta rule (flash-linear-attention, if importable), attention per kernel family (SDPA
   flash, cuDNN, efficient; FlexAttention compiled; FA3 / FA4 if importable), forward and
   backward, head dim 128 and 256;
3. the measured profile (`measured_profile`), checked with the simulator's loader;
4. emulations: `csbp run --emulate-rank` of the heaviest rank of a CP plan and of a CSBP plan at
   each context length (subprocesses with a timeout each), priced on the measured profile;
   the datasheet profile's prediction is added beside it;
5. the report: JSON (every figure) and markdown (tables), written with the profile to
   `--out-dir` ($OUT on the device machine: it comes back from there).

`--dry-run` runs the same steps on CPU with tiny shapes and a tiny model (CI runs it). Run it
through benchmarks/gpu_check.sh, which sets up the device machine first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the kit's own modules

import kernel_bench as kb  # noqa: E402
import measured_profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


@dataclass
class Settings:
    """What one run measures: the GPU check, or its CPU dry run."""

    device: str
    shapes: kb.Shapes
    model: str
    layers: int
    seq_lens: tuple[str, ...]
    block_size: int
    plans: tuple[tuple[str, str], ...]  # (family label, plan)
    dtype: str
    steps: int
    warmup: int
    budget_s: float
    emulation_reserve_s: float  # kernels stop this long before the budget ends
    emulation_timeout_s: float
    flex_cap_s: float  # most a kernel family may spend
    profile_name: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Settings":
        if args.dry_run:
            return cls(device="cpu", shapes=kb.Shapes.tiny(), model="tiny", layers=1,
                       seq_lens=("128", "256", "512"), block_size=16,
                       plans=(("cp", "cp=2"), ("csbp", "cp=2,bp=2")), dtype="fp32", steps=1,
                       warmup=0, budget_s=args.budget_s or 55, emulation_reserve_s=30,
                       emulation_timeout_s=40, flex_cap_s=6, profile_name="h200-dry-run")
        return cls(device="cuda", shapes=kb.Shapes.study(), model=args.model, layers=args.layers,
                   seq_lens=tuple(args.seq_lens.split(",")), block_size=args.block_size,
                   plans=(("cp", args.cp_plan), ("csbp", args.csbp_plan)), dtype="bf16",
                   steps=2, warmup=1, budget_s=args.budget_s or 440, emulation_reserve_s=300,
                   emulation_timeout_s=args.emulation_timeout_s, flex_cap_s=60,
                   profile_name="h200-measured")


@dataclass
class Step:
    name: str
    seconds: float = 0.0
    status: str = "ok"
    detail: dict = field(default_factory=dict)


def environment(device: torch.device) -> dict:
    env = {"torch": str(torch.__version__), "python": platform.python_version(),
           "cuda": torch.version.cuda, "host": platform.node()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info(device)
        env.update(device_name=props.name, multiprocessors=props.multi_processor_count,
                   memory_total_bytes=total, context_bytes=total - free,
                   where=f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        env.update(device_name=f"CPU ({platform.processor() or platform.machine()})",
                   where=f"CPU dry run, torch {torch.__version__}",
                   caveat="DRY RUN on CPU with tiny shapes: this is a check of the kit, not a "
                          "measurement of any GPU.")
    return env


# ---- emulations -----------------------------------------------------------------------------------
def run_args(s: Settings, seq_len: str, plan: str) -> list[str]:
    return ["--model", s.model, "--layers", str(s.layers), "--seq-len", seq_len,
            "--block-size", str(s.block_size), "--plan", plan, "--dtype", s.dtype,
            "--steps", str(s.steps), "--warmup", str(s.warmup), "--device", s.device]


def job_of(flags: list[str]):
    """The job `csbp run` makes of these flags (the same parser, the same checks)."""
    from csbp.runtime.training.launch import add_run_args, job_from_args

    parser = argparse.ArgumentParser()
    add_run_args(parser)
    return job_from_args(parser.parse_args(flags))


def heaviest_rank(job, profile) -> tuple[int, list[float]]:
    """The global rank of the context rank with the most predicted compute (its dp/tp/ep
    coordinates 0), and every context rank's predicted compute seconds."""
    from csbp.runtime.emulation.emulate import predict
    from csbp.runtime.distributed.mesh import global_rank

    totals = [sum(predict(job, c, profile).ops.values()) for c in range(job.plan.ctx)]
    ctx = max(range(len(totals)), key=totals.__getitem__)
    return global_rank(job.plan, ctx=ctx), totals


@dataclass
class Emulation:
    """One rank to emulate: its flags, rank and where its JSON goes."""

    kind: str
    plan: str
    seq_len: str
    argv: list[str] = field(default_factory=list)
    out: str = ""
    rank: int | None = None
    job: object = None
    step: Step | None = None


def prepare(s: Settings, out_dir: Path, measured: Path | None, datasheet) -> list[Emulation]:
    """Every emulation of the check, its heaviest rank chosen from the datasheet prediction."""
    todo = []
    for seq_len in s.seq_lens:
        for kind, plan in s.plans:
            e = Emulation(kind, plan, seq_len)
            e.step = Step(f"emulate {kind} {plan} L={seq_len}",
                          detail={"kind": kind, "plan": plan, "seq_len": seq_len})
            flags = run_args(s, seq_len, plan)
            try:
                e.job = job_of(flags)
                e.rank, totals = heaviest_rank(e.job, datasheet)
            except Exception as err:  # noqa: BLE001 - bad inputs are a finding of the check
                e.step.status = "failed"
                e.step.detail["error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
                todo.append(e)
                continue
            e.out = str(out_dir / f".emulate-{kind}-{seq_len}.json")
            e.argv = ["run", *flags, "--emulate-rank", str(e.rank), "--out", e.out]
            if measured is not None:
                e.argv += ["--hardware", str(measured)]
            e.step.detail.update(rank=e.rank, predicted_compute_per_ctx_rank_s=totals)
            e.step.status = "pending"
            todo.append(e)
    return todo


def run_emulations(todo: list[Emulation], s: Settings, budget: kb.Budget, out_dir: Path,
                   datasheet, on_done) -> None:
    """Run the pending emulations in one worker process (torch, CUDA and compiled kernels
    loaded once), each with its own deadline; a worker past one is killed and a fresh one takes
    the rest, while the budget lasts."""
    pending = [e for e in todo if e.step.status == "pending"]
    log_path = out_dir / "gpu_check_emulations.log"
    while pending:
        if budget.left() < 15:
            for e in pending:
                e.step.status = "skipped: budget"
                on_done(e)
            return
        items = out_dir / ".emulations.json"
        items.write_text(json.dumps([e.argv for e in pending]))
        with open(log_path, "a") as log_file:
            worker = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                                       str(items)], stdout=subprocess.PIPE, stderr=log_file,
                                      text=True, cwd=out_dir)  # not the checkout: its csbp/
            try:                                               # would shadow the shim
                pending = _watch(worker, pending, s, budget, datasheet, on_done)
            finally:
                if worker.poll() is None:
                    worker.kill()
                worker.wait()


class _Lines:
    """Lines of a pipe read with a deadline (no buffered reader hiding a line from select)."""

    def __init__(self, pipe) -> None:
        self.fd, self.buffer = pipe.fileno(), b""

    def next(self, deadline: float) -> str | None:
        """The next line; "" when the deadline passed first; None when the pipe closed."""
        import select

        while b"\n" not in self.buffer:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([self.fd], [], [], wait)[0]:
                return ""
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode(errors="replace")


def _watch(worker, pending: list[Emulation], s: Settings, budget: kb.Budget, datasheet,
           on_done) -> list[Emulation]:
    """Follow the worker through `pending`; returns what is left when it had to be stopped."""
    lines = _Lines(worker.stdout)
    index, began = 0, time.monotonic()
    while index < len(pending):
        e = pending[index]
        deadline = began + min(s.emulation_timeout_s, max(0.0, budget.left() - 3))
        line = lines.next(deadline)
        while line and not line.startswith("end "):
            line = lines.next(deadline)
        e.step.seconds = time.monotonic() - began
        if line is None:  # the worker died, and this item with it
            e.step.status = f"failed: worker exited with code {worker.wait()}"
        elif not line:
            e.step.status = (f"stopped: over its {e.step.seconds:.0f} s"
                             if budget.left() > 15 else "stopped: budget")
        else:
            _collect(e, int(line.split()[2]), datasheet)
        on_done(e)
        if not line:
            return pending[index + 1:]
        index, began = index + 1, time.monotonic()
        if index < len(pending) and budget.left() < 15:
            return pending[index:]
    return []


def _collect(e: Emulation, rc: int, datasheet) -> None:
    out = Path(e.out)
    if rc != 0 and out.is_file():
        out.unlink()
    if rc != 0 or not out.is_file():
        e.step.status = "failed"
        e.step.detail["error"] = f"csbp run exited with {rc} (gpu_check_emulations.log)"
        return
    result = json.loads(out.read_text())
    out.unlink()
    result["predicted_datasheet"] = _datasheet(e.job, result["ctx_rank"], datasheet)
    e.step.status = "ok"
    e.step.detail["result"] = result


def worker(items: str) -> int:
    """Run each `csbp run ... --emulate-rank` of the list in this process, in order; one line
    `end <i> <exit code>` after each (the parent's progress and deadlines)."""
    import contextlib
    import gc

    from csbp.simulator.commands import cli

    for i, argv in enumerate(json.loads(Path(items).read_text())):
        print(f"start {i}", flush=True)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout carries only these lines
                rc = cli.main(argv)
        except Exception as err:  # noqa: BLE001 - the next item still runs
            print(f"item {i}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            rc = 1
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"end {i} {rc}", flush=True)
    return 0


def _datasheet(job, ctx: int, profile) -> dict:
    """The same rank's ops priced on the datasheet profile, summed per phase and name."""
    from csbp.runtime.emulation.emulate import predict

    pred = predict(job, ctx, profile)
    rows: dict[str, float] = {}
    for (phase, _, name), seconds in pred.ops.items():
        rows[f"{phase}/{name}"] = rows.get(f"{phase}/{name}", 0.0) + seconds
    return {"hardware": profile.name, "compute_s": sum(pred.ops.values()), "by_phase": rows,
            "peak_memory_gib": pred.allocated_gib}


# ---- the run --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="the same steps on CPU, tiny shapes")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or str(ROOT / "gpu_check_out"))
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds the whole check may take (default 440; dry run 55)")
    p.add_argument("--base-profile", default=str(ROOT / "hardware_profiles" / "h200.yaml"))
    p.add_argument("--model", default="nemotron-diffusion-8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-lens", default="64k,128k,256k")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--cp-plan", default="cp=8")
    p.add_argument("--csbp-plan", default="cp=8,bp=8")
    p.add_argument("--emulation-timeout-s", type=float, default=110)
    p.add_argument("--worker", metavar="ITEMS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    s = Settings.from_args(args)
    budget = kb.Budget(s.budget_s)
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if s.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    device = torch.device(s.device)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
    if s.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    steps: list[Step] = []

    def timed(name: str, fn):
        began = time.monotonic()
        step = Step(name)
        try:
            step.detail = fn() or {}
        except Exception as err:  # noqa: BLE001 - one step's failure must not lose the others
            step.status = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        step.seconds = time.monotonic() - began
        steps.append(step)
        log(f"[{budget.elapsed():6.1f} s] {name}: {step.status} ({step.seconds:.1f} s)")
        return step

    env = timed("environment", lambda: environment(device)).detail
    points: list[kb.Point] = []
    peak = 989.4
    try:
        import yaml

        peak = float(yaml.safe_load(Path(args.base_profile).read_text())["gpu"]["peak_tflops"]["value"])
    except Exception:  # noqa: BLE001 - the profile step reports a bad base
        pass
    reserve = s.emulation_reserve_s
    timed("gemm", lambda: {"points": len(_extend(points, kb.gemm_points(s.shapes, device, budget,
                                                                         peak)))})
    timed("memory", lambda: {"points": len(_extend(points, kb.memory_points(s.shapes, device)))})
    # issue 23's kernel families: MoE grouped GEMM at DiffusionGemma's expert shapes, the
    # Gated-DeltaNet chunked delta rule (flash-linear-attention, if importable); head dim 256
    # of every attention family is in the attention step
    timed("grouped-gemm", lambda: {"points": len(_extend(points, kb.grouped_mm_points(
        s.shapes, device, budget)))})
    timed("linear-attention", lambda: {"points": len(_extend(points, kb.linear_points(
        s.shapes, device, budget)))})
    timed("attention", lambda: {"points": len(_extend(points, kb.attention_points(
        s.shapes, device, budget, reserve, s.flex_cap_s)))})
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the emulations' worker gets the GPU's memory
    profile_path = out_dir / f"{s.profile_name}.yaml"

    def profile_step() -> dict:
        from csbp.simulator.system.hardware import load_profile

        profile = measured_profile.build(Path(args.base_profile), points,
                                         {**env, "dtype": str(s.shapes.dtype).split(".")[-1]},
                                         s.profile_name)
        measured_profile.write(profile_path, profile)
        loaded = load_profile(str(profile_path))
        return {"path": str(profile_path), "loads": True, "name": loaded.name,
                "measured_sources": sorted(k for k, v in loaded.sources.items()
                                           if v.startswith("measured"))}

    prof = timed("profile", profile_step)
    measured = profile_path if prof.status == "ok" else None
    from csbp.simulator.system.hardware import load_profile

    datasheet = load_profile(args.base_profile)
    todo = prepare(s, out_dir, measured, datasheet)

    def done(e: Emulation) -> None:
        steps.append(e.step)
        log(f"[{budget.elapsed():6.1f} s] {e.step.name}: {e.step.status} ({e.step.seconds:.1f} s)")

    for e in todo:
        if e.step.status != "pending":
            done(e)
    run_emulations(todo, s, budget, out_dir, datasheet, done)
    for leftover in out_dir.glob(".emulat*.json"):  # $OUT brings back 8 files at most
        leftover.unlink()
    report = {"settings": {k: (v if not isinstance(v, kb.Shapes) else str(v))
                           for k, v in vars(s).items()},
              "environment": env, "budget_s": s.budget_s, "elapsed_s": budget.elapsed(),
              "within_budget": budget.elapsed() <= s.budget_s,
              "profile": str(profile_path) if measured else None,
              "steps": [vars(x) for x in steps], "kernels": [pt.to_json() for pt in points],
              "emulations": [_summary(x) for x in steps if x.name.startswith("emulate")]}
    (out_dir / "gpu_check_report.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "gpu_check_report.md").write_text(markdown(report))
    print(markdown_summary(report))
    return 0


def _extend(points: list, more: list) -> list:
    points.extend(more)
    return more


def _summary(step: Step) -> dict:
    """The emulation's headline figures: the rank's step and memory, measured vs predicted."""
    d = step.detail
    r = d.get("result")
    row = {"kind": d.get("kind"), "plan": d.get("plan"), "seq_len": d.get("seq_len"),
           "rank": d.get("rank"), "status": step.status, "wall_s": step.seconds,
           "error": d.get("error")}
    if r:
        row.update(step_time_s=r["step_time_s"], measured_ops_s=r["measured_ops_s"],
                   predicted_compute_s=r["predicted_compute_s"],
                   predicted_compute_datasheet_s=r["predicted_datasheet"]["compute_s"],
                   measured_peak_memory_gib=r["measured_peak_memory_gib"],
                   predicted_peak_memory_gib=r["predicted_peak_memory_gib"],
                   predicted_peak_memory_datasheet_gib=r["predicted_datasheet"]["peak_memory_gib"],
                   collective_bytes_match=r["collective_bytes_match"],
                   positions=r["positions"], noisy_blocks=r["noisy_blocks"],
                   by_phase=r["by_phase"], collectives=r["collectives"])
    return row


def _f(x, digits: int = 4) -> str:
    """Four significant digits (seconds span microseconds to seconds); `digits` decimals for
    memory."""
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if digits != 4 else f"{x:.4g}"


def markdown_summary(report: dict) -> str:
    lines = [f"gpu_check on {report['environment'].get('device_name')}: "
             f"{report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s budget",
             f"{'kind':<5} {'L':>5} {'rank':>4} {'status':<22} {'step s':>8} {'pred s':>8} "
             f"{'peak GiB':>9} {'pred GiB':>9}"]
    for e in report["emulations"]:
        lines.append(f"{e['kind']:<5} {e['seq_len']:>5} {str(e['rank']):>4} {e['status'][:22]:<22} "
                     f"{_f(e.get('step_time_s')):>8} {_f(e.get('predicted_compute_s')):>8} "
                     f"{_f(e.get('measured_peak_memory_gib'), 2):>9} "
                     f"{_f(e.get('predicted_peak_memory_gib'), 2):>9}")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    env = report["environment"]
    out = [f"# gpu_check report: {env.get('device_name')}", "",
           f"{env.get('where')}; {report['elapsed_s']:.0f} s of a {report['budget_s']:.0f} s "
           f"budget ({'within' if report['within_budget'] else 'OVER'}). Profile: "
           f"`{report['profile']}`.", "", "## Steps", "", "| step | status | seconds |",
           "|---|---|---|"]
    out += [f"| {st['name']} | {st['status']} | {st['seconds']:.1f} |" for st in report["steps"]]
    out += ["", "## Kernels", "", "| what | family | pass | shape | seconds | TFLOP/s | note |",
            "|---|---|---|---|---|---|---|"]
    out += [f"| {k['what']} | {k['family']} | {k['direction']} | {k['shape']} | "
            f"{_f(k['seconds'], 6)} | {_f(k['tflops'], 1)} | {k['note']} |"
            for k in report["kernels"]]
    out += ["", "## Emulated ranks: measured vs predicted", "",
            "Predicted: the step graph's compute ops for the rank (csbp-runtime implementation) "
            "on the measured profile, the datasheet profile beside it, priced one by one. Peak "
            "memory: the allocator's peak after warm-up against the memory model's live tensors "
            "at the rank's peak (allocator overhead and reserved memory apart).", "",
            "| kind | plan | L | rank | status | step s | ops s | predicted s | datasheet s | "
            "peak GiB | predicted GiB | datasheet GiB | bytes match |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in report["emulations"]:
        out.append(f"| {e['kind']} | {e['plan']} | {e['seq_len']} | {e['rank']} | "
                   f"{e['status']}{': ' + e['error'] if e.get('error') else ''} | "
                   f"{_f(e.get('step_time_s'))} | {_f(e.get('measured_ops_s'))} | "
                   f"{_f(e.get('predicted_compute_s'))} | "
                   f"{_f(e.get('predicted_compute_datasheet_s'))} | "
                   f"{_f(e.get('measured_peak_memory_gib'), 2)} | "
                   f"{_f(e.get('predicted_peak_memory_gib'), 2)} | "
                   f"{_f(e.get('predicted_peak_memory_datasheet_gib'), 2)} | "
                   f"{e.get('collective_bytes_match', '-')} |")
    for e in report["emulations"]:
        if not e.get("by_phase"):
            continue
        out += ["", f"### {e['kind']} {e['plan']} L={e['seq_len']} rank {e['rank']} "
                f"({e['positions']:,} positions, {e['noisy_blocks']} noisy blocks)", "",
                "| phase | op | measured s | predicted s | measured / predicted |",
                "|---|---|---|---|---|"]
        for row in e["by_phase"]:
            m, pr = row["measured_s"], row["predicted_s"]
            ratio = f"{m / pr:.2f}" if m is not None and pr else "-"
            out.append(f"| {row['phase']} | {row['name']} | {_f(m, 5)} | {_f(pr, 5)} | {ratio} |")
    return "\n".join(out) + "\n"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
