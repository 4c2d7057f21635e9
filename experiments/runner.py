"""Runs the planner for the rows of a study and turns each search into one table row.

For every row the planner itself chooses the best plan without block parallelism (the baseline)
and the best plan overall; nothing here picks plans by hand. Searches are cached per
(model, workload, cluster) for the whole run, so studies that share a row pay for it once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from csbp.simulator.errors import InputError
from csbp.simulator.system.hardware import HardwareProfile, load_profile
from csbp.simulator.system.implementation import DEFAULT_IMPLEMENTATION, check_kernels, load_implementation
from csbp.simulator.planner.method_vs_implementation import speedup_by_implementation
from csbp.simulator.planner.planner import Search, describe, family, fmt_tokens, plan_of, search
from csbp.simulator.report.result import Result
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

FAMILIES = ("dp", "cp", "bp", "csbp")


@dataclass(frozen=True)
class Cluster:
    hardware: str
    nodes: int

    def label(self, profile: HardwareProfile) -> str:
        return f"{self.nodes}x{profile.node.gpus_per_node} {self.hardware.upper()}"


H200_2x8 = Cluster("h200", 2)
H100_1x8 = Cluster("h100", 1)


def label(r: Result) -> str:
    """Every choice the planner made for a result, e.g. 'dp=2,cp=8,bp=8 collective dual-end ckpt=full'."""
    return describe(plan_of(r), r.workload["checkpointing"])


@dataclass
class Runner:
    """Planner searches for a run of studies, cached; `workers` processes per search."""

    workers: int | None = None
    implementation: str = DEFAULT_IMPLEMENTATION  # what the clusters' framework executes
    _searches: dict = field(default_factory=dict)
    _profiles: dict = field(default_factory=dict)

    def profile(self, cluster: Cluster) -> HardwareProfile:
        if cluster.hardware not in self._profiles:
            profile = load_profile(cluster.hardware)
            check_kernels(load_implementation(self.implementation), profile.gpu)
            self._profiles[cluster.hardware] = profile.model_copy(update={"implementation": self.implementation})
        return self._profiles[cluster.hardware]

    def search(self, model: ModelSpec, workload: Workload, cluster: Cluster,
               checkpointing: tuple[str, ...] = ("full", "none")) -> Search | str:
        """The planner's search, or why nothing fits (a normal outcome at long context).

        `checkpointing` is what the search may choose; a recipe that fixes it passes one value.
        """
        key = (model, workload, cluster, checkpointing)
        if key not in self._searches:
            try:
                self._searches[key] = search(model, workload, self.profile(cluster), cluster.nodes,
                                             checkpointing=checkpointing, workers=self.workers)
            except InputError as err:  # nothing feasible: the row says so
                self._searches[key] = str(err)
        return self._searches[key]

    def row(self, model: ModelSpec, workload: Workload, cluster: Cluster,
            checkpointing: tuple[str, ...] = ("full", "none"), **extra) -> dict:
        """One table row: both topologies the planner chose, tokens/s, speedup, peak memory, and
        the best of each plan family (for crossovers and ablations)."""
        profile = self.profile(cluster)
        row = {**extra, "model": model.name, "objective": workload.objective,
               "context": fmt_tokens(workload.seq_len), "seq_len": workload.seq_len,
               "block": workload.block_size, "cluster": cluster.label(profile)}
        found = self.search(model, workload, cluster, checkpointing)
        if isinstance(found, str):
            return row | {"best_plan": "none fits", "note": found.split(": ", 1)[-1]}
        best, base = found.recommended, found.baseline
        row |= _result_fields("best", best)
        row |= _result_fields("baseline", base) if base else {"baseline_plan": "none fits"}
        row["speedup"] = found.speedup
        # the same speedup under `ideal`: how much of it is the method's (implementation.py)
        by_impl = speedup_by_implementation(found, checkpointing=checkpointing, workers=self.workers)
        row["speedup_ideal"] = by_impl.get("ideal")
        row["implementation"] = profile.implementation
        families = found.best_per_family()
        for fam in FAMILIES:
            r = families.get(fam)
            row[f"{fam}_tokens_s"] = r.tokens_per_s if r else None
            row[f"{fam}_plan"] = label(r) if r else "none fits"
        row["infeasible"] = "; ".join(f"{g.reason}: {len(g.plans)}" for g in found.infeasible)
        row["note"] = _why(found)
        return row

    def best_of_family(self, model: ModelSpec, workload: Workload, cluster: Cluster, fam: str,
                       checkpointing: tuple[str, ...] = ("full", "none")) -> Result | None:
        found = self.search(model, workload, cluster, checkpointing)
        return None if isinstance(found, str) else found.best_per_family().get(fam)


def _result_fields(prefix: str, r: Result) -> dict:
    return {f"{prefix}_plan": label(r), f"{prefix}_kind": family(r.plan),
            f"{prefix}_tokens_s": r.tokens_per_s, f"{prefix}_step_s": r.step_time_s,
            f"{prefix}_peak_gib": r.peak_memory_gib,
            f"{prefix}_attn_gib": r.attention_traffic_gib_per_gpu,
            f"{prefix}_exposed_s": r.exposed_comm_s, f"{prefix}_mfu": r.mfu}


def _why(found: Search) -> str:
    """The simulator's own reasons for the ranking, in its figures."""
    best, base = found.recommended, found.baseline
    if base is None:
        return "no plan without BP fits"
    if base is best:
        return "no block-parallel plan beats the baseline"
    parts = []
    if best.attention_traffic_gib_per_gpu < base.attention_traffic_gib_per_gpu:
        parts.append(f"attention traffic {best.attention_traffic_gib_per_gpu:.0f} vs "
                     f"{base.attention_traffic_gib_per_gpu:.0f} GiB/GPU")
    if (best.exposed_comm_s or 0) < (base.exposed_comm_s or 0):
        parts.append(f"exposed comm {best.exposed_comm_s:.2f} vs {base.exposed_comm_s:.2f} s")
    if (best.mfu or 0) > (base.mfu or 0):
        parts.append(f"MFU {best.mfu:.2f} vs {base.mfu:.2f}")
    parts.append(f"peak {best.peak_memory_gib:.0f} vs {base.peak_memory_gib:.0f} GiB")
    return "; ".join(parts)
