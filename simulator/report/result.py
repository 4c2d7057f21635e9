"""What a simulation returns: one record per (model, workload, plan, cluster).

An infeasible plan is a normal result (`feasible=False`, `reason` says why, with numbers);
bad input never gets this far (it is an InputError). `to_json()` is the object every command's
`--json` prints, so its keys are a public contract.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 1024**3


@dataclass(frozen=True)
class TraceEvent:
    """One op on one stream of one (representative) rank, for Perfetto/Chrome traces."""

    rank: int
    stream: str  # "compute" | "comm" | ...
    name: str
    start_s: float
    duration_s: float
    phase: str = ""  # forward | recompute | backward | grad-sync | optimizer
    category: str = ""  # attention-kv | gradients | tp | ep | other | compute


@dataclass
class Result:
    feasible: bool
    reason: str | None
    model: str
    hardware: str
    nodes: int
    gpus: int
    plan: dict[str, Any]  # axes + transport + schedule + placement + kind
    workload: dict[str, Any]
    engine: str  # "des" | "closed-form"
    step_time_s: float | None = None
    tokens_per_s: float | None = None  # context tokens L x sequences per step / step time
    tokens_per_s_per_gpu: float | None = None  # tokens_per_s / every GPU of the job
    # Megatron-LM's num_floating_point_operations per step / step time / GPUs, in TFLOP/s (causal
    # attention counted as half the score matrix; what it counts per objective: model_flops.py)
    model_tflops_per_gpu: float | None = None
    # the objective's own count where it differs from context tokens (implementation.md 15):
    # "supervised" (DFlash2: anchors x (block - 1) per example) or "valid" (Fast-dLLM v2: L - 1);
    # to_json() also emits it as `<name>_tokens_per_s`. tokens_per_s stays the ranking figure.
    objective_tokens_name: str | None = None
    objective_tokens_per_s: float | None = None
    peak_memory_gib: float | None = None  # max over ranks
    memory_gib: dict[str, float] = field(default_factory=dict)  # breakdown on the peak rank
    memory_per_rank_gib: list[float] = field(default_factory=list)  # context-group ranks
    # the live-tensor peak (max over ranks): what max_memory_allocated measures, no allocator
    # overhead or reserved memory; where the peak rank peaks and what is alive there
    peak_allocated_gib: float | None = None
    # buffers outside the caching allocator (DeepEP's, implementation.md 11): not in
    # peak_allocated_gib, but in peak_memory_gib and the fit verdict; None (and left out of
    # to_json()) where there are none
    outside_allocator_gib: float | None = None
    peak_memory_at: dict[str, Any] = field(default_factory=dict)  # rank, phase, op, layer
    peak_breakdown_gib: dict[str, float] = field(default_factory=dict)  # by category, then
    attention_traffic_gib_per_gpu: float = 0.0  # K/V + dK/dV received per step, max over ranks
    comm_gib_per_gpu: dict[str, float] = field(default_factory=dict)  # by category, received
    exposed_comm_s: float | None = None  # communication not overlapped by any compute (as profilers count it)
    stretched_compute_s: float = 0.0  # compute time added by collectives running beside it (interference)
    implementation: str = "turbo-dllm"  # what the cluster's framework executes (implementation profile)
    phases_s: dict[str, float] = field(default_factory=dict)  # time by phase on the critical rank
    flops_per_gpu: float = 0.0
    mfu: float | None = None
    notes: list[str] = field(default_factory=list)  # assumptions that shaped this result
    trace: list[TraceEvent] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("trace")
        if self.outside_allocator_gib is None:
            out.pop("outside_allocator_gib")
        if self.objective_tokens_name:
            out[f"{self.objective_tokens_name}_tokens_per_s"] = self.objective_tokens_per_s
        return out

    @property
    def objective_label(self) -> str | None:
        """'supervised tokens/s' etc., for tables; None where tokens/s is the objective's own."""
        return f"{self.objective_tokens_name} tokens/s" if self.objective_tokens_name else None

    def __str__(self) -> str:
        """One line for a notebook's print(); `to_json()` has everything."""
        head = f"{self.plan.get('label', '?')} ({self.plan.get('kind', '?')}) on {self.gpus} GPUs"
        if not self.feasible:
            return f"{head}: infeasible: {self.reason}"
        own = (f" ({self.objective_tokens_per_s:,.0f} {self.objective_label})"
               if self.objective_tokens_per_s else "")
        return (f"{head}: {self.tokens_per_s:,.0f} tokens/s{own}, step {self.step_time_s:.3g} s, "
                f"peak {self.peak_memory_gib:.1f} GiB ({self.engine})")
