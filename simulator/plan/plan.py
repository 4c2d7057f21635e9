"""How a step is split over GPUs: the dp, tp, ep, cp, bp axes, transport, schedule, placement.

The rules are those of the reference implementation (shared/reference/workloads.md):
world = dp * tp * ep * max(cp, bp); fused CP/BP needs bp >= cp and bp % cp == 0; cp alone is the
CP baseline over the 2L sequence; cp = 1, bp > 1 is pure BP with a replicated clean prefix.
Each violated rule is reported by name, in one line. What frameworks need of the model's shapes
beyond the method (TP divides the heads, EP the experts, ...) is plan_rules.py's, checked last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from csbp.simulator.plan import rules as plan_rules
from csbp.simulator.errors import InputError, one_line
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.workload.workload import Workload

if TYPE_CHECKING:
    from csbp.simulator.system.implementation import Implementation

Transport = Literal["collective", "ring"]
Schedule = Literal["dual-end", "contiguous"]
PlanKind = Literal["single", "dp", "cp", "bp", "csbp"]

AXES = ("dp", "tp", "ep", "cp", "bp")
# Order of axes from innermost (consecutive global ranks) to outermost; "ctx" is the context
# group of size max(cp, bp). TP innermost keeps its many small collectives on NVLink.
DEFAULT_PLACEMENT = "tp,ctx,ep,dp"
# The largest inputs the simulator models in seconds: layouts and step graphs grow with the
# blocks of a sequence and, for ring and all-to-all exchanges, with the square of the context
# group. Larger values are refused with these numbers rather than left to run for hours.
MAX_SEQ_LEN = 4 * 1024**2
MAX_BLOCKS = 2**18
MAX_CONTEXT_GROUP = 256


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: PositiveInt = 1
    tp: PositiveInt = 1
    ep: PositiveInt = 1
    cp: PositiveInt = 1
    bp: PositiveInt = 1
    transport: Transport = "collective"
    schedule: Schedule = "dual-end"
    placement: str = Field(DEFAULT_PLACEMENT, description="axes innermost first, e.g. tp,ctx,ep,dp")

    @model_validator(mode="after")
    def _rules(self) -> "Plan":
        if self.cp > 1 and self.bp > 1:
            if self.bp < self.cp:
                raise ValueError(f"fused CP/BP needs bp >= cp (got cp={self.cp}, bp={self.bp})")
            if self.bp % self.cp:
                raise ValueError(f"fused CP/BP needs bp % cp == 0 (got cp={self.cp}, bp={self.bp})")
        order = self.placement.split(",")
        if sorted(order) != sorted(["tp", "ctx", "ep", "dp"]):
            raise ValueError(f"placement {self.placement!r} must order exactly tp, ctx, ep, dp")
        return self

    @property
    def ctx(self) -> int:
        """Size of one context group: the ranks that share one sequence."""
        return max(self.cp, self.bp)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.ep * self.ctx

    @property
    def replicas(self) -> int:
        """Copies of the clean sequence inside a context group (bp / cp; pure BP: bp)."""
        return self.bp // self.cp if self.bp > 1 else 1

    @property
    def kind(self) -> PlanKind:
        if self.cp > 1 and self.bp > 1:
            return "csbp"
        if self.cp > 1:
            return "cp"
        if self.bp > 1:
            return "bp"
        return "dp" if self.world > 1 else "single"

    @property
    def sequences(self) -> int:
        """Sequences processed at once: one per (dp, ep) replica of the context group."""
        return self.dp * self.ep

    def axes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def label(self) -> str:
        """Short text like 'dp=2,cp=8,bp=8' (axes of degree 1 left out)."""
        parts = [f"{a}={v}" for a, v in self.axes().items() if v > 1]
        return ",".join(parts) or "dp=1"

    def check_against(self, model: ModelSpec, workload: Workload, world: int | None = None,
                      implementation: "str | Implementation | None" = None) -> None:
        """Rules that need the model and workload; raises InputError naming the rule.

        The method's rules here, then the shape rules every framework needs (plan_rules.py: TP
        divides the heads, EP the experts, ...), which `implementation` may relax where its
        profile says it goes beyond them; None keeps them strict."""
        plan_rules.check_objective(workload, self)
        check_size(workload, self.ctx)
        if world is not None and self.world != world:
            raise InputError(
                f"world = dp*tp*ep*max(cp,bp) = {self.dp}*{self.tp}*{self.ep}*{self.ctx} = "
                f"{self.world}, but the cluster has {world} GPUs")
        L, b = workload.seq_len, workload.block_size
        if self.kind == "cp" and workload.objective == "ar" and L % (2 * self.cp):
            raise InputError(f"head-tail CP needs seq-len divisible by 2*cp (L into 2*cp chunks): "
                             f"{L} % {2 * self.cp} != 0")
        if self.kind == "cp" and L % self.cp:
            raise InputError(f"CP zigzag needs seq-len divisible by cp (2L into 2*cp chunks): "
                             f"{L} % {self.cp} != 0")
        if self.kind == "csbp" and L % (2 * self.cp):
            raise InputError(f"clean zigzag needs seq-len divisible by 2*cp: {L} % {2 * self.cp} != 0")
        if self.bp > workload.n_blocks:
            raise InputError(f"bp={self.bp} exceeds the {workload.n_blocks} blocks of seq-len {L} / "
                             f"block-size {b}: some ranks would own no block")
        plan_rules.check(model, workload, self, implementation)


def check_size(workload: Workload, ctx: int = 1) -> None:
    """Refuse inputs beyond what the simulator models (MAX_* above), naming the bound."""
    if workload.seq_len > MAX_SEQ_LEN:
        raise InputError(f"seq-len {workload.seq_len} exceeds {MAX_SEQ_LEN} (4M), the longest "
                         "context the simulator models")
    if workload.n_blocks > MAX_BLOCKS and workload.objective != "ar":  # ar: no blocks (block 1)
        raise InputError(f"{workload.n_blocks} blocks of {workload.block_size} tokens exceed "
                         f"{MAX_BLOCKS}, the most the simulator models: use a larger block size")
    if ctx > MAX_CONTEXT_GROUP:
        raise InputError(f"context group max(cp,bp) = {ctx} exceeds {MAX_CONTEXT_GROUP}, the "
                         "largest the simulator models")


def parse_plan(text: str, **options: object) -> Plan:
    """'dp=2,cp=8,bp=8' -> Plan. Unknown axes and bad numbers are InputErrors."""
    degrees: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in AXES:
            raise InputError(f"bad plan term {part!r}: use axis=degree with axes {', '.join(AXES)}")
        try:
            degrees[key] = int(value)
        except ValueError:
            raise InputError(f"bad degree in {part!r}: not an integer") from None
        if degrees[key] < 1:
            raise InputError(f"bad degree in {part!r}: must be >= 1")
    try:
        return Plan(**degrees, **options)
    except ValueError as err:
        raise InputError(one_line(err)) from None
