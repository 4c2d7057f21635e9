"""What a training framework can run of a plan, for reasons of shape: one rule set.

A plan can keep every rule of the method (plan.py: world size, fused CP/BP degrees, zigzag
chunks) and still be one nobody can launch: tensor parallelism 16 over a model with 8 K/V heads.
Megatron-Core requires the query groups to divide by the TP size, TorchTitan shards K/V heads the
same way, and csbp's runtime (runtime/distributed/tensor_parallel.py, runtime/distributed/expert_parallel.py) cuts every
head, the FFN width and the vocabulary over TP, each context rank's noisy and clean positions
evenly over its TP ranks (sequence parallelism), and the experts over EP.

`violation()` is the one place these rules live. `Plan.check_against` calls it, so the planner's
plan space, `csbp simulate`, the interop readers and `csbp run` refuse the same plans, and the
runtime's `check_supported` calls it with the runtime's own implementation profile: none of them
can disagree. Each rule gives one line, which the planner groups ("infeasible, grouped by
reason") and `csbp simulate` / `csbp run` print (exit 2).

Where a framework can do more than a rule, its implementation profile says so (`Implementation`
in implementation.py), not the planner's default: `tp_replicates_kv_heads: true` lets TP exceed
the K/V heads when it is a multiple of them (each K/V head copied on tp / kv ranks, as vLLM does
for inference). The shipped profiles keep the strict rules. Such a plan is priced as far as the
cost model goes today: a K/V row on the wire holds whole heads (`layout.kv_row_bytes`), but the
memory model and the step graph still count kv / tp heads of K/V per rank, so they under-count
the copies' memory and projection work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from csbp.simulator.errors import InputError
from csbp.simulator.layout.spans import intersect, size
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

if TYPE_CHECKING:
    from csbp.simulator.system.implementation import Implementation
    from csbp.simulator.plan.plan import Plan

KV_HINT = ("Megatron-Core and TorchTitan shard K/V heads over TP; an implementation profile that "
           "replicates them says tp_replicates_kv_heads: true")


# objective ar has no noisy blocks: block parallelism has nothing to deal out (one line, refused
# by `Plan.check_against` first and left out of the planner's space by `applicable_axes`)
AR_NO_BLOCKS = "bp/csbp need block diffusion's noisy blocks: objective ar runs dp/cp/tp/ep"


def objective_violation(workload: Workload, plan: "Plan") -> str | None:
    """The rule an objective puts on the plan's axes, as one line (ar: no bp)."""
    if workload.objective == "ar" and plan.bp > 1:
        return AR_NO_BLOCKS
    return None


def check_objective(workload: Workload, plan: "Plan") -> None:
    reason = objective_violation(workload, plan)
    if reason:
        raise InputError(reason)


def applicable_axes(workload: Workload, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The plan axes the planner enumerates for this objective: ar drops bp (no blocks)."""
    return tuple(a for a in axes if not (a == "bp" and workload.objective == "ar"))


def _ulysses(implementation: "str | Implementation | None", plan: "Plan") -> bool:
    """Whether the profile runs this CP plan's attention as Ulysses (heads over cp)."""
    if implementation is None or plan.cp == 1 or plan.bp > 1:
        return False
    from csbp.simulator.system.implementation import load_implementation

    fam = load_implementation(implementation).family("cp", plan.transport)
    return any(p is not None and p.context_exchange == "heads"
               for p in (fam.forward, fam.recompute, fam.backward))


def _replicates_kv_heads(implementation: "str | Implementation | None") -> bool:
    if implementation is None:
        return False
    from csbp.simulator.system.implementation import load_implementation

    return load_implementation(implementation).tp_replicates_kv_heads


_VIOLATIONS: dict[tuple, tuple[ModelSpec, str | None]] = {}


def violation(model: ModelSpec, workload: Workload, plan: "Plan",
              implementation: "str | Implementation | None" = None) -> str | None:
    """The first shape rule `plan` breaks for (model, workload), as one line; None if it keeps
    them all.

    `implementation` (a profile's name, path or the profile) may relax a rule it says it goes
    beyond; None keeps every rule strict. The plan must already keep the method's rules
    (`Plan.check_against` checks them first): the positions rule reads its layout.

    Kept per (model, workload, plan, profile name): the planner enumerates a plan, then each
    simulation checks it again.
    """
    if implementation is not None and not isinstance(implementation, str):
        return _violation(model, workload, plan, implementation)
    key = (id(model), workload, plan, implementation)
    hit = _VIOLATIONS.get(key)
    if hit is not None and hit[0] is model:
        return hit[1]
    if len(_VIOLATIONS) > 4096:
        _VIOLATIONS.clear()
    reason = _violation(model, workload, plan, implementation)
    _VIOLATIONS[key] = (model, reason)
    return reason


def _violation(model: ModelSpec, workload: Workload, plan: "Plan",
               implementation: "str | Implementation | None" = None) -> str | None:
    ep, tp = plan.ep, plan.tp
    objective = objective_violation(workload, plan)
    if objective:
        return objective
    if implementation is not None:  # a framework without the plan's family (implementation.plan_families)
        from csbp.simulator.system.implementation import load_implementation

        refused = load_implementation(implementation).refusal(plan.kind, plan.transport)
        if refused:
            return refused
    if _ulysses(implementation, plan):  # all-to-all from sequence to head shards (frameworks.md B1)
        for i, layer in enumerate(model.layers):
            if layer.kind == "linear":
                continue
            for what, heads in (("attention", layer.n_heads), ("K/V", layer.n_kv_heads)):
                if heads % (tp * plan.cp):
                    return (f"Ulysses CP (context_exchange: heads) needs tp*cp = {tp * plan.cp} to "
                            f"divide the {heads} {what} heads of layer {i}")
    if ep > 1 and not model.is_moe:
        return f"ep={ep} needs a MoE model; {model.name} is dense"
    if model.moe and model.moe.n_experts % ep:
        return f"ep={ep} does not divide the {model.moe.n_experts} experts"
    if tp == 1:
        return None
    replicate = None  # read the profile only when a rule needs it
    for i, layer in enumerate(model.layers):
        if layer.kind == "linear":  # n_heads are value heads, n_kv_heads key heads
            if layer.n_kv_heads % tp:
                return f"tp={tp} does not divide {layer.n_kv_heads} linear-attention key heads"
            if layer.n_heads % tp:
                return f"tp={tp} does not divide {layer.n_heads} linear-attention value heads"
            continue
        if layer.n_heads % tp:
            return f"tp={tp} does not divide {layer.n_heads} attention heads"
        kv = layer.n_kv_heads
        if kv % tp:
            if replicate is None:
                replicate = _replicates_kv_heads(implementation)
            if not (replicate and tp % kv == 0):
                hint = ("TP over more ranks than K/V heads must be a multiple of them" if replicate
                        else KV_HINT)
                return f"tp={tp} does not divide the {kv} K/V heads of layer {i}: {hint}"
    widths = {"the vocabulary": model.vocab,
              "the FFN width": model.moe.dense_ffn if model.moe else model.ffn}
    for what, width in widths.items():
        if width % tp:
            return f"tp={tp} does not divide {what} ({width})"
    from csbp.simulator.layout.layout import Layout  # layout imports plan, which imports this module

    from csbp.simulator.workload.objectives import as_executed

    layout = Layout.build(as_executed(workload, model), plan)
    for rank, noisy, clean in _noisy_and_clean(layout):
        if noisy % tp or clean % tp:
            return (f"tp={tp} does not divide context rank {rank}'s {noisy} noisy and "
                    f"{clean} clean positions (sequence parallelism splits each evenly): use a "
                    "block size and seq-len with more factors of 2")
    return None


def _noisy_and_clean(layout) -> list[tuple[int, int, int]]:
    """(rank, noisy positions, clean positions) of every share: once per layout ownership (the
    planner asks for every candidate, and candidates differing in dp, tp or ep share it)."""
    key = ("noisy-and-clean-positions",)
    if key not in layout.derived:
        L = layout.seq_len
        out = []
        for share in layout.shares:
            noisy = size(intersect(share.positions, ((0, L),)))
            out.append((share.rank, noisy, share.n_positions - noisy))
        layout.derived[key] = out
    return layout.derived[key]


def check(model: ModelSpec, workload: Workload, plan: "Plan",
          implementation: "str | Implementation | None" = None) -> None:
    """`violation()` as an InputError (one line), for callers that refuse rather than group."""
    reason = violation(model, workload, plan, implementation)
    if reason:
        raise InputError(reason)
