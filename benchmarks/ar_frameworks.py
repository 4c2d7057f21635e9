"""The README's AR table (issue 24): Llama-3.1-8B on one h100-96gb node under the torchtitan and
megatron-te profiles, one `csbp simulate` per row (about 20 s). Predictions, not measurements.

    python benchmarks/ar_frameworks.py
"""

from __future__ import annotations

import json
import subprocess

HEADER = ("| implementation | context | plan | linears | step | tokens/s per GPU | model TFLOP/s per GPU "
          "| peak allocated GiB |\n|---|---|---|---|---|---|---|---|")


def row(impl: str, seq_len: str, plan: str, dtype: str) -> str:
    cmd = ["csbp", "simulate", "--model", "llama3.1-8b", "--objective", "ar", "--implementation", impl,
           "--hardware", "h100-96gb", "--nodes", "1", "--seq-len", seq_len, "--plan", plan,
           "--linear-dtype", dtype, "--checkpointing", "full", "--json"]  # each profile's default transport
    out = subprocess.run(cmd, capture_output=True, text=True)
    cells = f"| {impl} | {seq_len} | {plan} | {dtype} |"
    if out.returncode:
        return f"{cells} error: {out.stderr.strip()[:80]} |"
    d = json.loads(out.stdout)
    if not d.get("feasible", True):
        return f"{cells} {d.get('reason', '')[:90]} |"
    return (f"{cells} {d['step_time_s']:.2f} s | {d['tokens_per_s_per_gpu']:,.0f} | "
            f"{d['model_tflops_per_gpu']:.0f} | {d['peak_allocated_gib']:.1f} |")


def jobs() -> list[tuple[str, str, str, str]]:
    out = [(impl, "32k", "dp=8", dtype) for impl in ("torchtitan", "megatron-te") for dtype in ("bf16", "fp8")]
    for seq_len, plans in (("64k", ("dp=4,cp=2", "cp=8")), ("128k", ("dp=2,cp=4", "cp=8")), ("256k", ("cp=8",))):
        out += [(impl, seq_len, p, "fp8") for impl in ("torchtitan", "megatron-te") for p in plans]
    return out


if __name__ == "__main__":
    print(HEADER)
    for job in jobs():
        print(row(*job), flush=True)
