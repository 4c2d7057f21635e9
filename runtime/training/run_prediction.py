"""A cluster run's measured figures beside the simulator's prediction on a profile.

The prediction is `simulate()` of the job as the runtime runs it (the `csbp-runtime`
implementation, the ZeRO stage it really uses) on the profile with the run's real node shape
(ranks per node as torchrun started them): step time, tokens/s, and each rank's live-tensor peak
(`estimate_memory`, the quantity `max_memory_allocated` or the CPU tracker measures, for the
rank's place in its context group). Errors are predicted / measured - 1, as `csbp validate`
reports them. Gloo blocks the training thread on every exchange, so CPU runs are priced without
overlap (as `csbp validate` does); NCCL runs with it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProfileChoice:
    """The profile a run is priced on and why that one (flag, plan file or default)."""

    name_or_path: str
    why: str


def choose_profile(flag: str | None, plan_file_hardware: str | None, device: str) -> ProfileChoice:
    if flag:
        return ProfileChoice(flag, "--hardware")
    if plan_file_hardware:
        return ProfileChoice(plan_file_hardware, "the plan file's hardware")
    default = "h200" if device == "cuda" else "cpu-measured"
    return ProfileChoice(default, f"default for {device} (no --hardware, no hardware in the plan)")


def predict(job, profile, world: int, ranks_per_node: int, device: str):
    """(Result, live-tensor peak GiB per context rank) of the job on `profile`."""
    from csbp.simulator.cost.memory import estimate_memory
    from csbp.simulator.engine.simulate import simulate
    from csbp.simulator.layout.layout import Layout
    from csbp.runtime.training.train import RUNTIME_IMPLEMENTATION, zero_stage

    host = profile.on_one_host(ranks_per_node).model_copy(update={"implementation": RUNTIME_IMPLEMENTATION})
    workload = job.workload.model_copy(update={"zero_stage": zero_stage(job)})
    result = simulate(job.model, workload, job.plan, host, nodes=world // ranks_per_node,
                      engine="des", overlap=device == "cuda")
    memory = estimate_memory(job.model, workload, job.plan, Layout.build(workload, job.plan), host)
    return result, [float(g) for g in memory.allocated]


def _error(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured - 1 if predicted is not None and measured else None


def compare(measured: dict, ctx_ranks: list[int], result, allocated_gib: list[float],
            choice: ProfileChoice) -> dict:
    """The fields a run's JSON gets beside its measured ones."""
    per_rank = [allocated_gib[min(c, len(allocated_gib) - 1)] for c in ctx_ranks]
    measured_mem = measured["peak_memory_gib_per_rank"]
    return {
        "hardware": result.hardware, "hardware_from": choice.why, "hardware_ref": choice.name_or_path,
        "predicted_feasible": result.feasible,
        "predicted_step_s": result.step_time_s,
        "step_time_error": _error(result.step_time_s, measured["step_time_s"]),
        "predicted_tokens_per_s": result.tokens_per_s,
        "tokens_per_s_error": _error(result.tokens_per_s, measured["tokens_per_s"]),
        "predicted_peak_memory_gib": max(per_rank),
        "peak_memory_error": _error(max(per_rank), measured["peak_memory_gib"]),
        "predicted_peak_memory_gib_per_rank": per_rank,
        "peak_memory_error_per_rank": [_error(p, m) for p, m in zip(per_rank, measured_mem)],
        "predicted_exposed_comm_s": result.exposed_comm_s,
        "predicted_phases_s": result.phases_s,
    }


def print_comparison(r: dict) -> None:
    def pct(e):
        return "-" if e is None else f"{e:+.1%}"

    print(f"  predicted on {r['hardware']} ({r['hardware_from']}): step "
          f"{r['predicted_step_s']:.4f} s ({pct(r['step_time_error'])}), "
          + (f"{r['predicted_tokens_per_s']:,.0f} tokens/s ({pct(r['tokens_per_s_error'])}), "
             if r["predicted_tokens_per_s"] else "does not fit the profile's memory, ")
          + f"peak {r['predicted_peak_memory_gib']:.3f} GiB ({pct(r['peak_memory_error'])})")
    for rank, (p, e) in enumerate(zip(r["predicted_peak_memory_gib_per_rank"], r["peak_memory_error_per_rank"])):
        print(f"  rank {rank} peak allocated predicted {p:.3f} GiB ({pct(e)})")
    phases = r.get("phase_split")
    if r.get("phase_split_note"):
        print(f"  note: {r['phase_split_note']}")
    if phases:
        print("  phase                   measured   predicted  error   (kernel times of one profiled step)")
        for k, v in phases.items():
            print(f"  {k:<22} {v['measured_s'] * 1e3:9.2f} ms {v['predicted_s'] * 1e3:9.2f} ms  {pct(v['error'])}")

