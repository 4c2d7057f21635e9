"""How much of a plan's gain is the method's and how much the implementation's.

The recommended plan's speedup over the best plan without BP, once under `ideal` (every family on
the fastest kernel with its collectives hidden: what is left is the method's traffic and balance)
and once under `turbo-dllm` (what the reference framework executes: kernels, waits, copies). The
best plan without BP is searched again under each profile, since the baseline a user would pick
changes with what the framework runs; that search wants the baseline alone
(`search(baseline_only=True)`: the full search's baseline, for fewer simulations).
"""

from __future__ import annotations

from csbp.simulator.planner.planner import Search, plan_of, search
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.workload.workload import Workload

PROFILES = ("ideal", "turbo-dllm")


def speedup_by_implementation(found: Search, **searched) -> dict[str, float | None]:
    """{profile: recommended plan's tokens/s over the best no-BP plan's}, None where either does
    not fit or no plan without BP fits."""
    rec = found.recommended
    out: dict[str, float | None] = {}
    for name in PROFILES:
        if name == found.profile.implementation:
            out[name] = found.speedup
            continue
        profile = found.profile.model_copy(update={"implementation": name})
        other = search(found.model, found.workload, profile, found.nodes, engine=found.engine, keep=1,
                       baseline_only=True, **searched)
        mine = simulate(found.model, Workload(**rec.workload), plan_of(rec), profile, found.nodes,
                        engine=found.engine, with_trace=False)
        base = other.baseline
        out[name] = (mine.tokens_per_s / base.tokens_per_s
                     if base is not None and mine.tokens_per_s and base.tokens_per_s else None)
    return out


def reading(speedups: dict[str, float | None]) -> str:
    """One line: the two speedups and what the difference means."""
    ideal, real = speedups.get("ideal"), speedups.get("turbo-dllm")
    shown = ", ".join(f"{k} {v:.2f}x" if v else f"{k} n/a" for k, v in speedups.items())
    if not ideal or not real:
        return f"speedup over the best plan without BP by implementation: {shown}"
    return (f"speedup over the best plan without BP by implementation: {shown} — the method "
            f"(traffic, balance) gives {ideal:.2f}x, the implementation (kernels, waits, copies) "
            f"the remaining {real / ideal:.2f}x")
