"""How much to trust a recommendation: does it survive ±20 % on the inputs nobody measured?

Before booking a cluster a user wants to know whether the plan `csbp plan` picks, and its speedup
over the best plan without BP, hold when the uncertain figures of the hardware profile are off.
Each main input is scaled to 80, 90, 110 and 120 % of its value (through `what_if`, so it means
what `--what-if NAME=0.8x` means) and the candidates are ranked again.

Kept cheap on purpose: the pool is the search's best candidates (everything the event engine
re-scored, plus the top of the ranking, so every family and the best no-BP plan are in it), and
each scaled profile re-scores only the pool with the closed form. So the comparison is closed form
against closed form, and a plan outside the pool cannot overtake. The memory reserve is the
exception: it changes which plans exist, so it re-runs the closed-form screen over the whole space
at ±20 % (feasibility is monotone in the reserve, so the ends of the range decide a flip).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from csbp.simulator.errors import InputError
from csbp.simulator.planner.planner import Search, family, label_of, plan_of, rank_key, search
from csbp.simulator.report.result import Result
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.grids.what_if import Setting, apply_settings
from csbp.simulator.workload.workload import Workload

FACTORS = (0.8, 0.9, 1.1, 1.2)  # ±20 % in two steps, so a flip inside the range is seen
POOL = 12  # top of the ranking kept besides everything the event engine re-scored
INPUTS = {  # what-if short name -> what the report calls it
    "nvlink": "NVLink bandwidth",
    "ib": "InfiniBand bandwidth",
    "attention": "attention efficiency",
    "reserve": "memory reserve",
    "interference": "compute-communication interference",
}
NOT_MODELLED: dict[str, str] = {}


@dataclass
class Outcome:
    """The ranking under one scaled input: who wins, and by how much over the best no-BP plan."""

    factor: float
    winner: str | None  # plan label; None = nothing fits
    family: str | None
    tokens_per_s: float | None
    baseline: str | None
    speedup: float | None
    flipped: bool = False  # the winner differs from the nominal one
    family_flipped: bool = False

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class InputSensitivity:
    name: str
    label: str
    outcomes: list[Outcome] = field(default_factory=list)
    skipped: str | None = None  # why this input was not varied here

    @property
    def flips(self) -> bool:
        return any(o.flipped for o in self.outcomes)

    def to_json(self) -> dict:
        return {"input": self.name, "label": self.label, "flips": self.flips, "skipped": self.skipped,
                "outcomes": [o.to_json() for o in self.outcomes]}


@dataclass
class Sensitivity:
    nominal: Outcome  # the pool ranked by the closed form at the profile's own figures
    engine_pick: str  # the search's recommendation (its engine may rank the pool otherwise)
    inputs: list[InputSensitivity]
    pool: int
    evaluations: int

    @property
    def flips(self) -> list[str]:
        return [i.label for i in self.inputs if i.flips]

    def to_json(self) -> dict:
        return {"method": "closed-form re-ranking of the search's best candidates on each scaled "
                          "profile; memory reserve: closed-form re-screen of the whole space",
                "factors": list(FACTORS), "pool": self.pool, "evaluations": self.evaluations,
                "nominal": self.nominal.to_json(), "engine_pick": self.engine_pick,
                "flips": self.flips, "inputs": [i.to_json() for i in self.inputs],
                "not_modelled": NOT_MODELLED}


def pool_of(found: Search) -> list[Result]:
    """What the event engine re-scored, the top of the ranking, and the best of each family and
    without BP (so a family change can show); no repeats."""
    rescored = [r for r in found.ranked if r.engine == found.engine] if found.engine != "closed-form" else []
    extra = list(found.best_per_family().values()) + ([found.baseline] if found.baseline else [])
    chosen, seen = [], set()
    for r in rescored + found.ranked[:POOL] + extra:
        key = label_of(r)
        if key not in seen:
            seen.add(key)
            chosen.append(r)
    return chosen


def _outcome(factor: float, results: list[Result]) -> Outcome:
    ok = sorted((r for r in results if r.feasible), key=rank_key)
    if not ok:
        return Outcome(factor, None, None, None, None, None)
    best = ok[0]
    base = next((r for r in ok if r.plan["bp"] == 1), None)
    return Outcome(factor, label_of(best), family(best.plan), best.tokens_per_s,
                   label_of(base) if base else None,
                   best.tokens_per_s / base.tokens_per_s if base else None)


def _from_search(factor: float, found: Search) -> Outcome:
    base = found.baseline
    return Outcome(factor, label_of(found.recommended), family(found.recommended.plan),
                   found.recommended.tokens_per_s, label_of(base) if base else None, found.speedup)


def _rescore(found: Search, pool: list[Result], profile) -> list[Result]:
    return [simulate(found.model, Workload(**r.workload), plan_of(r), profile, found.nodes,
                     engine="closed-form", with_trace=False) for r in pool]


def sensitivity(found: Search, *, axes: tuple[str, ...] | None = None,
                checkpointing: tuple[str, ...] | None = None, workers: int | None = 1) -> Sensitivity:
    """Each input of INPUTS at FACTORS; `axes` and `checkpointing` are the search's own limits
    (the reserve's re-screen must search the same space), `workers` its processes."""
    pool = pool_of(found)
    nominal = _outcome(1.0, _rescore(found, pool, found.profile))
    evaluations = len(pool)
    limits = {k: v for k, v in (("axes", axes), ("checkpointing", checkpointing)) if v}
    inputs = []
    for name, label in INPUTS.items():
        entry = InputSensitivity(name, label)
        inputs.append(entry)
        if name == "ib" and (found.nodes == 1 or found.profile.links.infiniband is None):
            entry.skipped = "one node: nothing crosses InfiniBand"
            continue
        if name == "interference" and found.profile.gpu.comm_sm_share is None \
                and found.profile.gpu.comm_hbm_traffic_ratio is None:
            entry.skipped = "the profile has no interference figures"
            continue
        for factor in FACTORS:
            if name == "reserve" and factor not in (min(FACTORS), max(FACTORS)):
                continue
            profile = apply_settings(found.profile, [Setting(name, factor=factor, text=f"{factor:g}x")]).profile
            if name == "reserve":
                try:
                    again = search(found.model, found.workload, profile, found.nodes,  # reads no misfit
                                   engine="closed-form", workers=workers, keep=1, misfits=False, **limits)
                    outcome = _from_search(factor, again)
                    evaluations += again.evaluations
                except InputError:  # nothing fits any more
                    outcome = _outcome(factor, [])
            else:
                outcome = _outcome(factor, _rescore(found, pool, profile))
                evaluations += len(pool)
            outcome.flipped = outcome.winner != nominal.winner
            outcome.family_flipped = outcome.family != nominal.family
            entry.outcomes.append(outcome)
    return Sensitivity(nominal, label_of(found.recommended), inputs, len(pool), evaluations)
