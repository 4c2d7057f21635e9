"""The planner: every topology of a cluster, ranked by predicted tokens/s.

Three stages, cheapest first: the memory model (layout only) drops what cannot fit, the closed
form scores the candidates that fit, and the discrete-event engine, which models overlap and
queueing, re-scores only the few candidates that can still win. When the caller says how much of
the ranking it reports (`keep`), the closed form only scores candidates that can still reach it:
each candidate's lower bound on step time (`bounds.py`) caps its tokens/s, and a candidate whose
cap is below enough scored candidates in every group it could matter to is pruned unscored.
A recommendation is only meaningful next to what users would launch without block parallelism,
so the best plan with bp == 1 is kept as the *baseline*, scored by the same engine as the
recommendation.

Candidates that break a plan rule, or that the simulator finds infeasible (memory, ...), are kept
and grouped by a normalised reason, so the user sees why a topology is missing from the ranking.
"""

from __future__ import annotations

import heapq
import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import product
from typing import get_args

from csbp.simulator.plan import rules as plan_rules
from csbp.simulator.planner.collector import collection_paused
from csbp.simulator.planner.bounds import bound_key, keys_at_home_is_cheapest, lower_bounds, ring_chains
from csbp.simulator.planner.floor import floor_bounds
from csbp.simulator.planner.shared_checks import SharedChecks, fits_of
from csbp.simulator.errors import InputError
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.workload.objectives import as_executed, objective_shape
from csbp.simulator.layout.layout import Layout
from csbp.simulator.cost.memory import MemoryEstimate, estimate_memory
from csbp.simulator.plan.plan import AXES, Plan, Schedule, Transport, one_line
from csbp.simulator.report.result import Result
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.planner.workers import Workers, available_cores  # noqa: F401 (re-exported)
from csbp.simulator.workload.workload import Checkpointing, Workload

FAMILIES = ("dp", "cp", "bp", "csbp")  # how plots and tables group plans (single GPU counts as dp)
DES_TOP = 6  # best screened candidates re-simulated with the event engine ...
DES_PER_FAMILY = 2  # ... plus the best few of each family, so family comparisons are like for like
# Pruning keeps a candidate whose tokens/s cap is within this fraction below a threshold: far
# above the 9-digit rounding of tokens/s in rank_key, so no tie is ever pruned.
PRUNE_TOLERANCE = 1e-6


def fmt_tokens(n: int) -> str:
    """262144 -> '256K', 1048576 -> '1M' (context lengths as people say them)."""
    for unit, size in (("M", 1024**2), ("K", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def family(plan: dict | Plan) -> str:
    kind = plan.kind if isinstance(plan, Plan) else plan["kind"]
    return "dp" if kind == "single" else kind


@dataclass(frozen=True)
class Candidate:
    """One point of the search space: a plan and the workload it runs (checkpointing varies)."""

    plan: Plan
    workload: Workload

    @property
    def label(self) -> str:
        return describe(self.plan, self.workload.checkpointing)


def plan_of(result: Result) -> Plan:
    """The Plan a result was simulated for (results carry it as a JSON-ready dict)."""
    return Plan(**{k: v for k, v in result.plan.items() if k in Plan.model_fields})


def label_of(result: Result) -> str:
    return describe(plan_of(result), result.workload["checkpointing"])


def describe(p: Plan, checkpointing: str) -> str:
    """'dp=2,cp=8,bp=8 collective dual-end ckpt=full': every choice the planner made, in one line."""
    parts = [p.label()]
    if p.cp > 1:
        parts.append(p.transport)
    if p.bp > 1:
        parts.append(p.schedule)
    parts.append(f"ckpt={checkpointing}")
    if p.placement == STRIPED_PLACEMENT:
        parts.append("ctx-striped")
    return " ".join(parts)


@dataclass
class InfeasibleGroup:
    """Candidates that fail for the same reason (numbers stripped), with one full example."""

    reason: str
    example: str  # the first full message, numbers included
    plans: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"reason": self.reason, "count": len(self.plans), "example": self.example,
                "plans": self.plans}


def reason_group(reason: str, rule: bool) -> str:
    """Normalise a reason so that candidates failing the same way share one group.

    Memory is one group whatever the numbers; other reasons keep their words but lose degrees,
    sizes and the detail after ':' or ';' (model names, arithmetic), e.g.
    'tp=16 does not divide 32 attention heads' -> 'rule: tp does not divide N attention heads'.
    """
    if re.search(r"memory|\bGiB\b|\boom\b", reason, re.IGNORECASE):
        return "memory"
    text = re.split(r"[:;]", re.sub(r"\([^)]*\)", "", reason))[0]
    text = re.sub(r"\b(dp|tp|ep|cp|bp)\s*=\s*\d+", r"\1", text)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    text = " ".join(text.split())
    return f"rule: {text}" if rule else text


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Space:
    """The enumerated search space: valid candidates, and every rejection grouped by reason."""

    candidates: list[Candidate]
    rejected: dict[str, InfeasibleGroup]

    def reject(self, label: str, reason: str, rule: bool) -> None:
        key = reason_group(reason, rule)
        self.rejected.setdefault(key, InfeasibleGroup(key, reason)).plans.append(label)

    def reject_memory(self, label: str, reason: Callable[[], str]) -> None:
        """`reject` of a plan the memory model found not to fit, its line (`reason()`, which
        names GiB: the group "memory") written only where it is that group's first, its example:
        a search rejects thousands, and each line reads the peak's breakdown."""
        group = self.rejected.get("memory")
        if group is None:
            self.reject(label, reason(), rule=False)
        else:
            group.plans.append(label)

    def groups(self) -> list[InfeasibleGroup]:
        return sorted(self.rejected.values(), key=lambda g: -len(g.plans))


STRIPED_PLACEMENT = "tp,ep,dp,ctx"  # the context group across nodes, DP/EP peers inside one


def placements(plan: Plan, gpus: int, gpus_per_node: int | None) -> tuple[str, ...]:
    """Where the context group may sit: inside a node (the default: its K/V on NVLink, gradients
    across nodes) or striped over the nodes with its DP/EP peers inside one (Turbo-dLLM's
    `inter_node_cp`: K/V across nodes, gradients and expert all-to-all on NVLink). Only a job
    over several nodes with both a context group and DP/EP peers has the choice."""
    if gpus_per_node is None or gpus <= gpus_per_node or plan.ctx == 1 or plan.dp * plan.ep == 1:
        return (plan.placement,)
    return (plan.placement, STRIPED_PLACEMENT)


def enumerate_space(model: ModelSpec, workload: Workload, gpus: int,
                    checkpointing: tuple[str, ...] = get_args(Checkpointing),
                    axes: tuple[str, ...] = AXES, gpus_per_node: int | None = None,
                    implementation: str | None = None) -> Space:
    """Every (dp, tp, ep, cp, bp) with dp*tp*ep*max(cp, bp) == gpus, times the choices that matter.

    Transport only changes plans that exchange clean K/V (cp > 1); the block schedule only changes
    plans that own noisy blocks (bp > 1); elsewhere the default stands in, so no two candidates
    are the same computation. Axes left out of `axes` stay at degree 1. With `gpus_per_node`
    the context group's placement is searched too (`placements`). A plan that breaks a rule of
    the method or a shape rule of `implementation` (plan_rules.py; None: the strict rules) is
    rejected with the rule's line, as `csbp simulate` and `csbp run` refuse it.
    """
    space = Space([], {})
    axes = plan_rules.applicable_axes(workload, axes)  # ar: no bp (nothing to deal out)
    divisors = _divisors(gpus)
    for tp, ep, cp, bp in product(*((divisors if a in axes else [1]) for a in AXES[1:])):
        inner = tp * ep * max(cp, bp)
        if gpus % inner or ("dp" not in axes and inner != gpus):
            continue
        degrees = {"dp": gpus // inner, "tp": tp, "ep": ep, "cp": cp, "bp": bp}
        label = ",".join(f"{a}={v}" for a, v in degrees.items() if v > 1) or "dp=1"
        try:
            plan = Plan(**degrees)
            plan.check_against(model, workload, gpus, implementation)
        except InputError as err:
            space.reject(label, str(err), rule=True)
            continue
        except ValueError as err:  # a Plan rule (pydantic ValidationError)
            space.reject(label, one_line(err), rule=True)
            continue
        transports = get_args(Transport) if plan.cp > 1 else (plan.transport,)
        schedules = get_args(Schedule) if plan.bp > 1 else (plan.schedule,)
        # the schedule moves noisy blocks between ranks: the positions rule is read again
        broken = {s: plan_rules.violation(model, workload, plan.model_copy(update={"schedule": s}),
                                          implementation)
                  for s in schedules if s != plan.schedule}
        for s, reason in broken.items():
            if reason:
                space.reject(f"{label} {s}", reason, rule=True)
        schedules = tuple(s for s in schedules if not broken.get(s))
        for transport, schedule, ckpt, where in product(transports, schedules, checkpointing,
                                                        placements(plan, gpus, gpus_per_node)):
            space.candidates.append(Candidate(
                plan.model_copy(update={"transport": transport, "schedule": schedule, "placement": where}),
                workload.model_copy(update={"checkpointing": ckpt})))
    return space


@dataclass
class Search:
    """What the planner found: feasible results best first, and the infeasible ones grouped."""

    model: ModelSpec
    workload: Workload
    profile: HardwareProfile
    nodes: int
    ranked: list[Result]  # event-engine results first (best first), then closed-form only ones
    infeasible: list[InfeasibleGroup]
    candidates: int  # size of the enumerated space (valid topologies x choices)
    evaluations: int  # simulations run: screened + rescored
    seconds: float
    engine: str
    feasible: int = 0  # candidates that fit in memory
    pruned: int = 0  # of those, dropped by their bound without a simulation
    screened: int = 0  # simulated with the closed form
    rescored: int = 0  # re-simulated with `engine`
    # lower bounds computed by the pruned screen, by rung: compute floors, quick and tight graphs
    bounds: dict[str, int] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.nodes * self.profile.node.gpus_per_node

    @property
    def recommended(self) -> Result:
        return self.ranked[0]

    @property
    def baseline(self) -> Result | None:
        """The best plan without block parallelism, scored like the recommendation."""
        return next((r for r in self.ranked if r.plan["bp"] == 1 and r.engine == self.engine), None)

    @property
    def speedup(self) -> float | None:
        base = self.baseline
        return self.recommended.tokens_per_s / base.tokens_per_s if base else None

    def best_per_family(self) -> dict[str, Result]:
        best: dict[str, Result] = {}
        for r in self.ranked:
            if r.engine == self.engine:
                best.setdefault(family(r.plan), r)
        return best


def rank_key(r: Result) -> tuple[float, float, float]:
    """Faster first; among equally fast plans (compute-bound ones tie exactly), the one with more
    memory headroom, then less attention traffic (less exposed to a busy network).

    Stable on every host: tokens/s is rounded to 9 significant digits, since it comes from
    durations read through log/exp, whose last bit may differ between CPUs (libm's variants,
    numpy's vector loops), and plans that tie in exact arithmetic must tie everywhere; memory
    and traffic are byte counts scaled by constants, the same everywhere. Full ties keep the
    order the candidates came in (every sort here is stable; the pruned screen sorts on this
    key, then the enumeration index), which the job alone decides."""
    return (-float(f"{r.tokens_per_s or 0.0:.9g}"), r.peak_memory_gib or 0.0,
            r.attention_traffic_gib_per_gpu)


def _to_rescore(screened: list[tuple[Candidate, Result]], top: int) -> list[int]:
    """Indices (into screened, best first) of the candidates worth the event engine."""
    chosen = list(range(min(top, len(screened))))
    seen: dict[str, int] = {}
    for i, (cand, _) in enumerate(screened):
        for key in (family(cand.plan), "no-bp" if cand.plan.bp == 1 else None):
            if key and seen.get(key, 0) < DES_PER_FAMILY:
                seen[key] = seen.get(key, 0) + 1
                if i not in chosen:
                    chosen.append(i)
    return chosen


def memory_misfit(model: ModelSpec, cand: Candidate, profile: HardwareProfile) -> str | None:
    """Why a candidate cannot fit in GPU memory, or None.

    Memory needs only the layout, not the step's timeline, so it costs milliseconds where a
    simulation costs far more; at long context most of the space does not fit, so it goes first.
    """
    return candidate_memory(model, cand, profile).reason


def candidate_memory(model: ModelSpec, cand: Candidate, profile: HardwareProfile) -> MemoryEstimate:
    """The memory model's estimate for a candidate (`memory_misfit` reads why it does not fit)."""
    layout = Layout.build(as_executed(cand.workload, model), cand.plan)
    return estimate_memory(model, cand.workload, cand.plan, layout, profile)


def _simulate_one(model: ModelSpec, profile: HardwareProfile, nodes: int, engine: str,
                  cand: Candidate) -> Result:
    # the planner ranks; timelines are for `csbp simulate --trace`
    return simulate(model, cand.workload, cand.plan, profile, nodes, engine=engine, with_trace=False)


def simulate_all(model: ModelSpec, cands: list[Candidate], profile: HardwareProfile, nodes: int,
                 engine: str, workers: int | Workers) -> list[Result]:
    """Every candidate simulated, in order; over `workers` processes where the OS can fork."""
    job = partial(_simulate_one, model, profile, nodes, engine)
    if isinstance(workers, Workers):
        return workers.map(job, cands)
    with Workers(workers) as pool:
        return pool.map(job, cands)


def _lower_bounds(model: ModelSpec, profile: HardwareProfile, key: tuple) -> dict[str, float]:
    plan, workload, keys_at_home = key
    return lower_bounds(model, workload, plan, profile, keys_at_home)


def _cap(tokens: int, bound: float) -> float:
    """Tokens/s a candidate cannot exceed: its tokens per step over its step's lower bound."""
    return tokens / bound if bound > 0 else math.inf


def cluster_gpus(profile: HardwareProfile, nodes: int) -> int:
    if nodes < 1:
        raise InputError(f"impossible cluster: {nodes} nodes (need at least 1)")
    return nodes * profile.node.gpus_per_node


def search(model: ModelSpec, workload: Workload, profile: HardwareProfile, nodes: int, *,
           engine: str = "des", checkpointing: tuple[str, ...] = get_args(Checkpointing),
           axes: tuple[str, ...] = AXES, des_top: int = DES_TOP, workers: int | None = None,
           keep: int | None = None, baseline_only: bool = False, prune_placements: bool = True,
           misfits: bool = True, checks: SharedChecks | None = None) -> Search:
    """Drop what does not fit, screen the rest with the closed form, re-score the best with
    `engine`, rank.

    `engine="closed-form"` skips the second stage (sweeps and tests). `workers` defaults to the
    cores this process may use. `keep`: the first `keep` entries of `ranked`, the baseline and
    the best of each family are what an exhaustive search gives, and candidates that cannot
    reach them are pruned (`ranked` then holds only the screened ones); None screens every
    candidate. Raises InputError for an impossible cluster or when nothing fits.

    `baseline_only` (with `keep`): only `baseline` is wanted (`method_vs_implementation`), so
    plans with BP matter only where they could push a plan without BP out of the overall picks,
    and the engine re-scores only the picks without BP (and their placements): the baseline is
    the one the full search reports, as the same bp == 1 plans are picked and re-scored the same
    way; `ranked` then need not start with an `engine` result (no InputError for that).

    `prune_placements` (with `keep`): a re-scored plan's other placement is re-scored only where
    its bounds say it could enter what is reported (`_variant_matters`); False re-scores every
    one (what `--sensitivity` re-ranks: all the engine's results).

    `misfits=False` (with `keep`): the caller reads the ranking, not why the rest is missing (a
    map's cells), so memory is checked only for the candidates the screen takes up, as for
    `baseline_only` (the same ranking: a candidate that does not fit never moves a group's bar);
    `infeasible` then lists only those found not to fit and `feasible` counts the unchecked ones
    too. Where nothing fits, every candidate is checked first, in order, so the InputError says
    what the full search says.

    `checks` (with `keep`, for the full report): memory checks shared with a helper process
    (`shared_checks`, made by `shared_checks.for_search` with these inputs, space included): the
    screen reads fits lazily as for `misfits=False`, and the rest are checked with the helper
    after it, so the report is the one of a search without it.
    """
    start = time.perf_counter()
    gpus = cluster_gpus(profile, nodes)
    if checks is not None and (keep is None or baseline_only or not misfits or not checks.matches(
            model, workload, profile, gpus, checkpointing, axes)):
        checks.abandon()  # made for other inputs, or for a search that reads no misfits anyway
        checks = None
    with collection_paused():
        space = checks.space if checks is not None else enumerate_space(
            model, workload, gpus, checkpointing, axes, implementation=profile.implementation)
        with Workers(workers) as pool:
            found = _search(model, workload, profile, nodes, space, engine, des_top, keep, pool,
                            baseline_only and keep is not None, prune_placements,
                            lazy=keep is not None and (baseline_only or not misfits or checks is not None),
                            checks=checks)
    found.seconds = time.perf_counter() - start
    return found


def _search(model: ModelSpec, workload: Workload, profile: HardwareProfile, nodes: int, space: Space,
            engine: str, des_top: int, keep: int | None, pool: Workers,
            baseline_only: bool = False, prune_placements: bool = True, lazy: bool = False,
            checks: SharedChecks | None = None) -> Search:
    counts = {"floor": 0, "quick": 0, "tight": 0}
    by_rule = {k: replace(g, plans=list(g.plans)) for k, g in space.rejected.items()}  # before memory
    ran_out: list[tuple[str, str]] = []  # simulated and found infeasible, in order

    misfits: set[int] = set()
    index = {id(c): i for i, c in enumerate(space.candidates)} if checks is not None else {}

    def fits(cand: Candidate) -> bool:
        memory = candidate_memory(model, cand, profile)
        if not memory.feasible:
            space.reject_memory(cand.label, lambda: memory.reason)
            misfits.add(id(cand))
        if checks is not None:
            checks.record(index[id(cand)], memory.feasible)
        return memory.feasible

    # the baseline alone (`method_vs_implementation`) or a map's cell (`misfits=False`) reads no
    # memory rejection and no count: memory is then checked only for the candidates the screen
    # takes up (`screen_pruned`), and `infeasible` holds only those found not to fit, `feasible`
    # and `pruned` count the others
    fitting = list(space.candidates) if lazy else [cand for cand in space.candidates if fits(cand)]

    leading = None  # (rank_key, index) of the best closed-form result so far (`checks.lead`)

    def evaluate(cands: list[Candidate], eng: str) -> Iterator[tuple[Candidate, Result]]:
        nonlocal leading
        for cand, result in zip(cands, simulate_all(model, cands, profile, nodes, eng, pool)):
            if result.feasible:
                if checks is not None and eng == "closed-form" and id(cand) in index:
                    mark = (rank_key(result), index[id(cand)])
                    if leading is None or mark < leading:
                        leading = mark
                        checks.lead(mark[1])
                yield cand, result
            else:
                ran_out.append((f"{cand.label} ({eng})", result.reason or "infeasible"))
                space.reject(*ran_out[-1], rule=False)

    if keep is None:
        screened = sorted(evaluate(fitting, "closed-form"), key=lambda cr: rank_key(cr[1]))
        scored = len(fitting)
    else:
        screened, scored = screen_pruned(model, fitting, profile, engine, keep, des_top,
                                         lambda cands: evaluate(cands, "closed-form"), pool, counts,
                                         baseline_only, fits if lazy else None)
        if lazy:  # those found not to fit were never candidates
            fitting = [c for c in fitting if id(c) not in misfits]
    evaluations = scored
    ranked = [r for _, r in screened]
    picks: list[int] = []
    if engine != "closed-form" and screened:
        picks = _to_rescore(screened, des_top)
        if baseline_only:  # the same bp == 1 picks as the full search, the others left out
            picks = [i for i in picks if screened[i][0].plan.bp == 1]
        # where the context group sits, tried for every plan the engine re-scores (the reported
        # ones: the top, the baseline, each family's best): striped over the nodes or not
        variants = [Candidate(c.plan.model_copy(update={"placement": where}), c.workload)
                    for c in (screened[i][0] for i in picks)
                    for where in placements(c.plan, cluster_gpus(profile, nodes), profile.node.gpus_per_node)[1:]]
        # fewer picks than the ranking reports: every variant enters it (`_variant_matters`), so
        # the picks and their variants are re-scored in one batch (split over an idle core)
        together = not baseline_only and (keep is None or not prune_placements or len(picks) < keep)
        both = [r for _, r in evaluate([screened[i][0] for i in picks] + (variants if together else []), engine)]
        rescored = sorted(both, key=rank_key)
        if not together:  # only the variants that could change the report
            variants = [v for v in variants if _variant_matters(model, profile, v, rescored, keep,
                                                                baseline_only, counts)]
            rescored = sorted(rescored + [r for _, r in evaluate(variants, engine)], key=rank_key)
        evaluations += len(picks) + len(variants)
        picked = set(picks)
        ranked = rescored + [r for i, (_, r) in enumerate(screened) if i not in picked]
    if checks is not None and ranked and ranked[0].engine == engine:
        # the full report: every candidate's fit, checked with the helper, then the rejections
        # in the order a search checking memory first makes them (memory, then simulations)
        ok = checks.finish(fits_of(checks))  # `space` is `checks.space`
        space.rejected = by_rule
        for cand, fit in zip(space.candidates, ok):
            if not fit:
                space.reject_memory(cand.label, partial(memory_misfit, model, cand, profile))
        for label, reason in ran_out:
            space.reject(label, reason, rule=False)
        fitting = [c for c, fit in zip(space.candidates, ok) if fit]
    elif lazy and (not ranked or (ranked[0].engine != engine and not baseline_only)):
        if checks is not None:
            checks.abandon()
        # nothing to rank: say why as the full search does (memory checked for all, in order,
        # then the simulations that found a plan infeasible: the same ones, screened alike)
        space.rejected = by_rule
        misfits.clear()
        for cand in space.candidates:
            fits(cand)
        for label, reason in ran_out:
            space.reject(label, reason, rule=False)
    infeasible = space.groups()
    if not ranked or (ranked[0].engine != engine and not baseline_only):
        summary = "; ".join(f"{g.reason} ({len(g.plans)})" for g in infeasible[:3])
        if infeasible:
            summary += f"; e.g. {infeasible[0].example}"
        gpus = nodes * profile.node.gpus_per_node
        raise InputError(f"nothing feasible for {model.name} at {fmt_tokens(workload.seq_len)} on "
                         f"{gpus} GPUs ({len(space.candidates)} candidates): {summary}")
    return Search(model, workload, profile, nodes, ranked, infeasible, len(space.candidates), evaluations,
                  0.0, engine, feasible=len(fitting),
                  pruned=len(fitting) - scored, screened=scored, rescored=len(picks),
                  bounds=counts if keep is not None else {})


def screen_pruned(model: ModelSpec, fitting: list[Candidate], profile: HardwareProfile, engine: str,
                  keep: int, des_top: int, evaluate, pool: Workers,
                  counts: dict[str, int] | None = None, baseline_only: bool = False,
                  fits=None) -> tuple[list[tuple[Candidate, Result]], int]:
    """(screened candidates with their closed-form results, best first; how many were simulated).

    What the reported ranking reads from the screen: the event engine's picks (the best
    `des_top`, the best DES_PER_FAMILY of each family and of the plans without BP), then the
    screen's other candidates in order until `keep` are listed (`_floors`). A candidate can
    change these only if its
    tokens/s cap (tokens per step over a lower bound on its step time, so at least its real
    tokens/s) reaches what the last of them in one of its groups has so far (as a screened
    candidate can only push that last one out, an unscreened one below it can never enter).
    Candidates are taken best cap first (those of a group with no bar yet before the others:
    the order only decides how much is computed, never what is reported, and a family's or the
    baseline's picks, once scored, shorten how deep the overall bar reaches, so filling those
    groups first raises it sooner), each climbing a ladder of bounds while it still
    matters: its compute floor (`floor.py`, no graph: every candidate starts there), with EP its
    floor with the all-to-all waits, the quick bound (one graph per bound key, keys at home),
    for a long ring its hops' chains (no graph), the tighter one (its own K/V calls and
    transfers) where its simulation is dear, then a simulation; the screen ends when no
    candidate left matters, the rest are pruned. A cap only ever tightens and never falls below
    the candidate's tokens/s, so the ladder reports what the exhaustive screen does (a rung
    left out only leaves a cap higher: a ring inside a node whose collective twin scored above
    its bar skips its tight bound, which then rarely prunes). Ties in
    rank_key keep the enumeration order, as the exhaustive sort does. `counts`: the bounds
    computed per rung, added to. `baseline_only`: see `search`. `fits` (candidate -> whether it
    fits in memory): `fitting` is not yet checked, and a candidate is checked when the screen
    first takes it up (or at once where it has no floor), those that do not fit dropped: the
    screen then meets the fitting ones as it would have, since a candidate that does not fit
    never scores and so never moves a group's bar.
    """
    # the quick bound is already the plan's own graph where no K/V moves (or where the profile
    # does not let keys stay home); and the tighter one pays only where a simulation is dear:
    # a ring (ops per step and layer) or a context group wider than a node (longer rows), or
    # where the quick bound leaves most out: pure CP over two trained streams, each unbalanced
    # over the zigzag (its ranks wait for each other at every layer's K/V exchange, `bounds.py`
    # reason 7; DiffusionGemma on 16 GPUs: 10 of 26 simulations replaced by 12 tight bounds,
    # callgrind 8.43 -> 7.92 G instructions; where one stream runs, the zigzag balances its ranks
    # and the bound rarely prunes: there Nemotron-8B +1.7 %, Qwen3.5 +2.0 %, so it is left out)
    home, node = keys_at_home_is_cheapest(profile), profile.node.gpus_per_node
    counts = {} if counts is None else counts
    tight = [not home or c.plan.cp == 1 or (c.plan.transport != "ring" and c.plan.ctx <= node and
                                            (c.plan.bp > 1 or len(_streams(model, c)) == 1))
             for c in fitting]
    # before the tight bound of a pure CP ring wider than a node (a call and a hop per ring step
    # and layer), its hops' chains (`bounds.ring_chains`: their prices alone), which rule out
    # most such rings; under BP/CSBP only the clean shards hop and their chains stay below the
    # quick bound (DiffusionGemma on 1,024 GPUs: 0.54 s against 0.57 s at cp = bp = 256), and a
    # ring inside a node has a cheap tight graph: they go straight to the tight one
    chained = [t or c.plan.transport != "ring" or c.plan.bp > 1 or c.plan.ctx <= node
               for t, c in zip(tight, fitting)]
    chains: dict[tuple, dict[str, float]] = {}
    tokens = [c.workload.seq_len * c.workload.micro_batch * c.plan.sequences for c in fitting]
    # rung 0: every candidate's compute floor (it depends on neither transport nor checkpointing)
    floors: dict[tuple, dict[str, float] | None] = {}
    cap, quick = [], []  # quick[i]: the candidate's quick bound is in its cap
    waited, floor_keys = [], []  # waited[i]: its EP waits are in its cap (or it has none)
    with_waits: dict[tuple, dict[str, float]] = {}
    unchecked = [fits is not None] * len(fitting)  # memory not checked yet (`fits`)
    dropped: set[int] = set()  # found not to fit
    for i, (cand, n) in enumerate(zip(fitting, tokens)):
        key = (cand.plan.model_copy(update={"transport": "collective"}),
               cand.workload.model_copy(update={"checkpointing": "full"}))
        if key not in floors:
            floors[key] = floor_bounds(model, key[1], key[0], profile,
                                       Layout.build(as_executed(key[1], model), key[0]))
            counts["floor"] = counts.get("floor", 0) + 1
        floor = floors[key]
        cap.append(_cap(n, floor[cand.workload.checkpointing]) if floor else math.inf)
        quick.append(floor is None)
        floor_keys.append(key)
        # the next rung of a MoE plan with EP: its floor with the all-to-all waits (floor.ep_waits)
        waited.append(floor is None or model.moe is None or cand.plan.ep == 1)
        if floor is None and unchecked[i]:  # its quick bound comes at once: check it first
            unchecked[i] = False
            if not fits(cand):
                dropped.add(i)
    # no floor (attention priced as dense math): the quick bound at once, over the workers
    keys = {i: bound_key(fitting[i].plan, fitting[i].workload, profile, keys_at_home=True)
            for i in range(len(fitting)) if quick[i] and i not in dropped}
    unique = sorted(set(keys.values()), key=lambda k: (k[0].cp, k[0].bp, k[0].schedule, repr(k)))  # by ownership
    bounds = dict(zip(unique, pool.chunks(partial(_lower_bounds, model, profile), unique)))
    counts["quick"] = counts.get("quick", 0) + len(unique)
    for i, key in keys.items():
        cap[i] = _cap(tokens[i], bounds[key][fitting[i].workload.checkpointing])
    # candidates in the same groups share their thresholds: one heap of caps per set of groups
    heaps: dict[tuple[str, ...], list[tuple[float, int]]] = {}
    for i, cand in enumerate(fitting):
        if i not in dropped:
            heaps.setdefault(_groups(cand.plan, baseline_only), []).append((-cap[i], i))
    for heap in heaps.values():
        heapq.heapify(heap)
    done: set[int] = set()
    scored: list[tuple[int, Candidate, Result]] = []

    def best(floors: dict[str, float]) -> int | None:
        """The candidate with the best cap known now among those that still matter, one of a
        group without a bar first (every member matters there until it has its picks)."""
        found = None
        for groups, heap in heaps.items():
            while heap and (heap[0][1] in done or heap[0][1] in dropped or -heap[0][0] != cap[heap[0][1]]):
                heapq.heappop(heap)  # simulated, or its cap has been tightened since
            if heap and -heap[0][0] >= min(floors.get(g, 0.0) for g in groups) * (1 - PRUNE_TOLERANCE):
                rank = (any(g not in floors for g in groups), -heap[0][0], -heap[0][1])
                if found is None or rank > found:
                    found = rank
        return None if found is None else -found[2]

    # a ring inside a node whose collective twin scored above the bar it must reach is
    # simulated without its tight bound: twins move the same K/V and score within a few percent
    # of each other (DiffusionGemma 16 GPUs: 9 of 20 tight bounds were followed by the
    # simulation anyway, each costing about what it does); the bound would only prune, never
    # change the answer, so skipping it only costs a simulation where the twins differ
    twin = {(c.plan, c.workload): i for i, c in enumerate(fitting) if c.plan.transport == "collective"}
    tokens_of: dict[int, float] = {}
    bars: dict[str, float] | None = None  # the groups' bars, found again only once `scored` grows
    while True:
        if bars is None:
            scored.sort(key=lambda icr: (rank_key(icr[2]), icr[0]))
            bars = _floors(scored, keep, des_top, engine, baseline_only)
        i = best(bars)
        if i is None:
            return [(c, r) for _, c, r in scored], len(done)
        cand = fitting[i]
        if unchecked[i]:  # taken up for the first time: does it fit at all?
            unchecked[i] = False
            if not fits(cand):
                dropped.add(i)
                continue
        if not waited[i]:  # the next rung up: the floor with EP waits, quick, a ring's chains, tight
            waited[i] = True
            key = floor_keys[i]
            if key not in with_waits:
                with_waits[key] = floor_bounds(model, key[1], key[0], profile,
                                               Layout.build(as_executed(key[1], model), key[0]), with_waits=True)
                counts["waits"] = counts.get("waits", 0) + 1
            cap[i] = min(cap[i], _cap(tokens[i], with_waits[key][cand.workload.checkpointing]))
            heapq.heappush(heaps[_groups(cand.plan, baseline_only)], (-cap[i], i))
            continue
        if quick[i] and chained[i] and not tight[i] and cand.plan.transport == "ring" \
                and cand.plan.ctx <= node:
            j = twin.get((cand.plan.model_copy(update={"transport": "collective"}), cand.workload))
            if j in tokens_of and tokens_of[j] >= min(bars.get(g, 0.0) for g in _groups(cand.plan, baseline_only)):
                tight[i] = True  # its twin made it: so will it, most likely (above)
        if not quick[i] or not tight[i]:
            rung = "quick" if not quick[i] else "chain" if not chained[i] else "tight"
            if rung == "quick":
                quick[i] = True
            elif rung == "chain":
                chained[i] = True
            else:
                tight[i] = True
            key = bound_key(cand.plan, cand.workload, profile, keys_at_home=rung == "quick")
            found = chains if rung == "chain" else bounds
            if key not in found:
                found[key] = ring_chains(model, key[1], key[0], profile) if rung == "chain" \
                    else _lower_bounds(model, profile, key)
                counts[rung] = counts.get(rung, 0) + 1
            cap[i] = min(cap[i], _cap(tokens[i], found[key][cand.workload.checkpointing]))
            heapq.heappush(heaps[_groups(cand.plan, baseline_only)], (-cap[i], i))
            continue
        done.add(i)
        got = [(i, c, r) for c, r in evaluate([cand])]  # nothing where it turned out infeasible
        scored += got
        bars = None
        tokens_of[i] = (got[0][2].tokens_per_s or 0.0) if got else 0.0


def _variant_matters(model: ModelSpec, profile: HardwareProfile, cand: Candidate,
                     rescored: list[Result], keep: int, baseline_only: bool,
                     counts: dict[str, int]) -> bool:
    """Whether a placement variant of a re-scored plan could change what the search reports: the
    first `keep` of the ranking, each family's best, the best without BP (the baseline), or for
    `baseline_only` the baseline alone. `rescored`: the engine's results of the picks, best first.

    The ranking starts with every re-scored plan, variants included, in rank_key order, so a
    variant enters the first `keep` only if it reaches the keep-th of the picks' results (more
    results only raise that bar), and a group's best only if it reaches that group's best pick
    (ties are kept: PRUNE_TOLERANCE, as in the screen). Its tokens/s is at most its cap over
    each lower bound (below both engines: `bounds.py`, `floor.py`): its compute floor, then its
    tight bound (its own K/V transfers, which the placement moves between links and the quick
    bound leaves out), the second only while the variant still could; a variant that loses
    cannot be reported and is not re-scored (issue 25: placement twins cost a graph and an
    event-engine run each)."""
    best: dict[str, float] = {}
    for r in rescored:
        for g in _groups(plan_of(r), baseline_only):
            best.setdefault(g, r.tokens_per_s or 0.0)
    need = dict(best)
    need.pop("all", None)
    if len(rescored) >= keep:
        need["all"] = rescored[keep - 1].tokens_per_s or 0.0
    groups = ("no-bp",) if baseline_only else _groups(cand.plan)
    bars = [need.get(g) for g in groups]
    if any(bar is None for bar in bars):  # a group with no re-scored member: anything enters it
        return True
    bar = min(bars) * (1 - PRUNE_TOLERANCE)
    tokens = cand.workload.seq_len * cand.workload.micro_batch * cand.plan.sequences
    ckpt = cand.workload.checkpointing
    floor = floor_bounds(model, cand.workload, cand.plan, profile,
                         Layout.build(as_executed(cand.workload, model), cand.plan), with_waits=True)
    counts["floor"] = counts.get("floor", 0) + 1
    if floor is not None and _cap(tokens, floor[ckpt]) < bar:
        return False
    # the quick bound leaves the K/V exchange out, which is what a placement changes: the tight one
    counts["tight"] = counts.get("tight", 0) + 1
    key = bound_key(cand.plan, cand.workload, profile, keys_at_home=False)
    return _cap(tokens, _lower_bounds(model, profile, key)[ckpt]) >= bar


def _streams(model: ModelSpec, cand: Candidate) -> tuple[str, ...]:
    """The trained streams of a candidate's objective (`objectives.ObjectiveShape.streams`)."""
    return objective_shape(cand.workload, model, cand.plan).streams


def _groups(plan: Plan, baseline_only: bool = False) -> tuple[str, ...]:
    """The parts of the reported ranking a candidate can enter; for the baseline alone, a plan
    with BP only the overall picks (where it can push a plan without BP out)."""
    if baseline_only and plan.bp > 1:
        return ("all",)
    return ("all", family(plan)) + (("no-bp",) if plan.bp == 1 else ())


def _floors(scored: list[tuple[int, Candidate, Result]], keep: int, des_top: int,
            engine: str, baseline_only: bool = False) -> dict[str, float]:
    """Per group, the tokens/s a candidate must reach to matter there (absent: everything
    matters until the group has enough scored members).

    Per family and without BP, the best DES_PER_FAMILY (picks of the event engine). Overall,
    the best `des_top` (its other picks) and as deep as the ranking's first `keep` reach: they
    are the picks, then the screened candidates that are not picks, in screen order, so the
    screen must be exact down to the (keep - picks)-th of those. The closed form alone ranks
    the screen as it is: its best `keep`."""
    best = [(c, r) for _, c, r in scored]
    if engine == "closed-form":
        need = keep
    else:
        picks = set(_to_rescore(best, des_top))
        rest = [i for i in range(len(best)) if i not in picks]  # positions of the non-picks
        wanted = keep - len(picks)
        need = des_top if wanted <= 0 else (
            max(des_top, rest[wanted - 1] + 1) if len(rest) >= wanted else len(best) + 1)
    members: dict[str, list[float]] = {}
    for c, r in best:
        for g in _groups(c.plan, baseline_only):
            members.setdefault(g, []).append(r.tokens_per_s or 0.0)
    floors = {}
    for g, speeds in members.items():
        n = need if g == "all" else DES_PER_FAMILY
        if len(speeds) >= n:
            floors[g] = speeds[n - 1]
    return floors
