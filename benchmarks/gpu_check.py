"""One GPU, a few minutes: measured step time and peak memory next to the simulator's prediction.

Two runs of a realistic layer size (Nemotron-Diffusion 8B layers, cut to a few layers) in bf16:

- reference: the single-process model in this process, no activation checkpointing;
- plan: the one-GPU plan (dp=1) through the runtime's launcher (NCCL process group, counted
  comm), with full activation checkpointing as long-context plans use.

Each line shows the measurement and `simulator.simulate.simulate` for the same model, workload
and plan on the GPU's profile (h200 unless --hardware says otherwise), if the simulator is
importable; otherwise the prediction column says why not. Run through benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from csbp.runtime.launch import spawn  # noqa: E402
from csbp.runtime.train import GIB, Job, Trainer  # noqa: E402
from csbp.simulator.plan import Plan  # noqa: E402
from csbp.simulator.presets import load_model  # noqa: E402
from csbp.simulator.workload import Workload  # noqa: E402


def realistic_model(name: str, layers: int):
    base = load_model(name)
    return base.model_copy(update={"name": f"{base.name}-{layers}-layers",
                                   "layers": base.layers[:layers]})


def predict(model, workload: Workload, plan: Plan, hardware: str) -> dict:
    try:
        from csbp.simulator.hardware import load_profile
        from csbp.simulator.simulate import simulate

        result = simulate(model, workload, plan, load_profile(hardware).on_one_host(1), nodes=1)
    except Exception as err:  # noqa: BLE001 - the check still reports what it measured
        return {"unavailable": f"{type(err).__name__}: {err}".splitlines()[0]}
    return {"step_time_s": result.step_time_s, "peak_memory_gib": result.peak_memory_gib,
            "feasible": result.feasible, "reason": result.reason}


def measure_reference(job: Job, device: str) -> dict:
    """The model in this process (no process group: a one-rank plan needs none)."""
    trainer = Trainer(job, rank=0, device=torch.device(device))
    report = trainer.run()
    return {"step_time_s": statistics.median(report.step_times_s),
            "peak_memory_gib": report.peak_memory_bytes / GIB, "loss": report.losses[-1]}


def measure_plan(job: Job, device: str, timeout_s: float) -> dict:
    (reports,) = spawn([job], 1, device, timeout_s)
    report = reports[0]
    return {"step_time_s": statistics.median(report.step_times_s),
            "peak_memory_gib": report.peak_memory_bytes / GIB, "loss": report.losses[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="nemotron-diffusion-8b", help="preset whose layers to use")
    p.add_argument("--layers", type=int, default=4, help="how many of its layers (default 4)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hardware", default="h200")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of this script (with --model tiny) before spending GPU time")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    model = realistic_model(args.model, args.layers)
    runs = {"reference (no checkpointing)": "none", "plan dp=1 (full checkpointing)": "full"}
    print(f"{device_name}  torch {torch.__version__}  {model.name}  "
          f"{model.total_params() / 1e9:.2f} B params  L={args.seq_len} b={args.block_size} bf16")
    figures = {}
    for name, checkpointing in runs.items():
        workload = Workload(seq_len=args.seq_len, block_size=args.block_size, dtype="bf16",
                            checkpointing=checkpointing, zero_stage=0)
        job = Job(model, workload, Plan(), steps=args.steps, warmup=args.warmup)
        start = time.perf_counter()
        measured = (measure_reference(job, args.device) if checkpointing == "none"
                    else measure_plan(job, args.device, timeout_s=480))
        predicted = predict(model, workload, Plan(), args.hardware)
        figures[name] = {"measured": measured, "predicted": predicted,
                         "wall_s": time.perf_counter() - start}
        if args.device == "cuda":
            torch.cuda.empty_cache()
        pred = ("prediction unavailable: " + predicted["unavailable"] if "unavailable" in predicted
                else f"predicted {predicted['step_time_s']:.3f} s, {predicted['peak_memory_gib']:.1f} GiB")
        print(f"{name:32s} measured {measured['step_time_s']:.3f} s, "
              f"{measured['peak_memory_gib']:.1f} GiB peak (loss {measured['loss']:.3f})  |  {pred}",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device_name,
                                              "torch": torch.__version__, "model": model.name,
                                              "args": vars(args), "runs": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
