"""How much of a plan's gain is the method's and how much the implementation's.

The recommended plan's speedup over the best plan without BP, once under `ideal` (every family on
the fastest kernel with its collectives hidden: what is left is the method's traffic and balance)
and once under `turbo-dllm` (what the reference framework executes: kernels, waits, copies). The
best plan without BP is searched again under each profile, since the baseline a user would pick
changes with what the framework runs; that search wants the baseline alone
(`search(baseline_only=True)`: the full search's baseline, for fewer simulations).

That second search needs nothing from the first (only the recommendation's own re-simulation
does), so `csbp plan` starts it in a forked process before its main search (`baselines_ahead`)
when a core is idle: on two cores the two searches run side by side instead of one after the
other. The child runs
the same `search` call on the same inputs (the same code on the same CPU, so the same floats)
and sends back the baseline it found, or the error it raised, which is raised where the
inline search would have raised it. Its search wants less than the main one (DiffusionGemma 256K
on 128 GPUs: 1.5-1.8 s of CPU against 2.5-3.1 s), so the child then takes part of the main
search's memory checks (those only its report reads: `shared_checks`).
"""

from __future__ import annotations

import gc
import multiprocessing as mp

from csbp.simulator.errors import InputError
from csbp.simulator.planner.planner import Search, plan_of, search
from csbp.simulator.planner.shared_checks import SharedChecks, for_search, fits_of
from csbp.simulator.planner.workers import Workers, core_free
from csbp.simulator.engine.simulate import simulate
from csbp.simulator.report.result import Result
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.workload.spec import ModelSpec
from csbp.simulator.plan.rules import applicable_axes
from csbp.simulator.workload.workload import Workload

PROFILES = ("ideal", "turbo-dllm")


def _baseline(model: ModelSpec, workload: Workload, profile: HardwareProfile, nodes: int, engine: str,
              **searched) -> Result | None:
    """The best plan without BP under `profile` (the other implementation's search)."""
    return search(model, workload, profile, nodes, engine=engine, keep=1, baseline_only=True,
                  **searched).baseline


def bp_applies(workload: Workload) -> bool:
    """Whether the objective has noisy blocks for BP (objective ar has none): where it has not,
    every plan is a plan without BP and the speedup over one says nothing."""
    return "bp" in applicable_axes(workload, ("bp",))


class BaselinesAhead:
    """The other profiles' baseline searches, each in a forked process started at once; a
    context manager that ends whichever were not collected (the main search failed)."""

    def __init__(self, model: ModelSpec, workload: Workload, profile: HardwareProfile, nodes: int,
                 engine: str, **searched) -> None:
        self.inputs = (model, workload, profile)  # the very objects the search is given
        self.key = (nodes, engine)
        self.running: dict[str, tuple] = {}
        self.received: dict[str, tuple] = {}  # a child's baseline message, read ahead (`presimulated`)
        self.checks: SharedChecks | None = None  # the main search's memory checks, shared
        if not bp_applies(workload) or not Workers(searched.get("workers")).parallel or not core_free():
            return  # one core, no fork or no idle core: searched inline afterwards, as before
        ctx = mp.get_context("fork")
        try:  # the main search's space, enumerated here so that the child has it too
            self.checks = for_search(ctx, model, workload, profile, nodes, searched.get("checkpointing"),
                                     searched.get("axes"))
        except InputError:
            pass  # the main search says it
        gc.freeze()  # the collector then leaves the shared heap's pages alone in the child (no copies)
        try:
            self._start(ctx, model, workload, profile, nodes, engine, searched)
        finally:
            gc.unfreeze()

    def _start(self, ctx, model, workload, profile, nodes, engine, searched) -> None:
        for name in PROFILES:
            if name == profile.implementation:
                continue
            other = profile.model_copy(update={"implementation": name})
            receive, send = ctx.Pipe(duplex=False)
            # one process each; the main search keeps the other core (results do not depend on
            # the worker count: workers return in order, the same calls)
            helps = self.checks if not self.running else None  # the first child helps
            child = ctx.Process(target=_child, args=(send, model, workload, other, nodes, engine,
                                                     searched | {"workers": 1}, helps), daemon=True)
            child.start()
            send.close()
            if helps is not None:
                helps.helper = child
            self.running[name] = (child, receive)

    def baseline(self, name: str, model: ModelSpec, workload: Workload, profile: HardwareProfile,
                 nodes: int, engine: str) -> tuple[bool, Result | None]:
        """(found ahead?, the baseline) for `name`, if started for exactly these inputs."""
        if not self._started_for(name, model, workload, profile, nodes, engine):
            return False, None
        child, receive = self.running.pop(name)
        got = self.received.pop(name, None)
        if got is None:
            try:
                got = receive.recv()
            except EOFError:  # the child died without a word (killed): search here instead
                child.join()
                return False, None
        _drain_and_join(child, receive)
        ok, value = got
        if not ok:
            raise value
        return True, value

    def presimulated(self, name: str, found: Search) -> Result | None:
        """The recommendation of `found` simulated under `name` by that child, where the child
        has already sent it (its baseline first, then the main screen's best candidate it took
        for the likeliest recommendation: `shared_checks.SharedChecks.lead`) and it is the same
        plan and workload; else None (simulate it here). Never waits for the child."""
        if self.checks is None or not self._started_for(name, found.model, found.workload, found.profile,
                                                        found.nodes, found.engine):
            return None
        _, receive = self.running[name]
        try:
            if name not in self.received:
                if not receive.poll(0):
                    return None
                self.received[name] = receive.recv()
            if not self.received[name][0] or not receive.poll(0):
                return None
            lead, result = receive.recv()
        except (EOFError, OSError):
            return None
        cand, rec = self.checks.space.candidates[lead], found.recommended
        same = cand.plan == plan_of(rec) and cand.workload == Workload(**rec.workload)
        return result if same else None

    def _started_for(self, name: str, model, workload, profile, nodes: int, engine: str) -> bool:
        same = all(a is b for a, b in zip((model, workload, profile), self.inputs))
        return name in self.running and same and (nodes, engine) == self.key

    def close(self) -> None:
        for child, receive in self.running.values():
            child.terminate()
            child.join()
            receive.close()
        self.running.clear()
        self.received.clear()

    def __enter__(self) -> "BaselinesAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drain_and_join(child, receive) -> None:
    """Wait for the child to end, reading what else it sends (a presimulated recommendation not
    taken), so that it never waits on a full pipe while this process waits for it."""
    while child.is_alive():
        try:
            if receive.poll(0.005):
                receive.recv()
        except (EOFError, OSError):
            break
    child.join()


def _child(send, model, workload, profile, nodes, engine, searched, checks: SharedChecks | None = None) -> None:
    try:
        out = (True, _baseline(model, workload, profile, nodes, engine, **searched))
    except Exception as err:  # noqa: BLE001 (raised in the parent, where the inline search would)
        out = (False, err)
    send.send(out)
    if checks is not None and out[0] and checks.leader is not None:
        # the main screen's best so far under this implementation: the answer's re-simulation of
        # the recommendation, where they are the same plan (`speedup_by_implementation`)
        lead = checks.leader
        cand = checks.space.candidates[lead]
        try:
            send.send((lead, simulate(model, cand.workload, cand.plan, profile, nodes, engine=engine,
                                      with_trace=False)))
        except Exception:  # noqa: BLE001 (the parent simulates it itself)
            pass
    send.close()
    if checks is not None:  # then the main search's memory checks, from the back (`shared_checks`)
        try:
            checks.help(fits_of(checks))
        except Exception:  # noqa: BLE001 (the main search checks what is left, and says what fails)
            pass


def baselines_ahead(model: ModelSpec, workload: Workload, profile: HardwareProfile, nodes: int,
                    engine: str = "des", **searched) -> BaselinesAhead:
    """Start the baseline searches `speedup_by_implementation` will need for a search of these
    inputs (with the same `searched` keywords), before that search runs."""
    return BaselinesAhead(model, workload, profile, nodes, engine, **searched)


def speedup_by_implementation(found: Search, ahead: BaselinesAhead | None = None,
                              **searched) -> dict[str, float | None]:
    """{profile: recommended plan's tokens/s over the best no-BP plan's}, None where either does
    not fit or no plan without BP fits. `ahead`: baselines already being searched."""
    rec = found.recommended
    out: dict[str, float | None] = {}
    if not bp_applies(found.workload):
        return out  # no BP for this objective: nothing to compare with
    for name in PROFILES:
        if name == found.profile.implementation:
            out[name] = found.speedup
            continue
        profile = found.profile.model_copy(update={"implementation": name})
        # the recommendation first, while the child may still be searching, unless the child
        # has simulated it already (the same call on the same inputs: the same result)
        mine = ahead.presimulated(name, found) if ahead else None
        if mine is None:
            mine = simulate(found.model, Workload(**rec.workload), plan_of(rec), profile, found.nodes,
                            engine=found.engine, with_trace=False)
        done, base = ahead.baseline(name, found.model, found.workload, found.profile, found.nodes,
                                    found.engine) if ahead else (False, None)
        if not done:
            base = _baseline(found.model, found.workload, profile, found.nodes, found.engine, **searched)
        out[name] = (mine.tokens_per_s / base.tokens_per_s
                     if base is not None and mine.tokens_per_s and base.tokens_per_s else None)
    return out


def reading(speedups: dict[str, float | None]) -> str:
    """One line: the two speedups and what the difference means."""
    if not speedups:
        return "BP does not apply to this objective: every plan ranked is a plan without BP"
    ideal, real = speedups.get("ideal"), speedups.get("turbo-dllm")
    shown = ", ".join(f"{k} {v:.2f}x" if v else f"{k} n/a" for k, v in speedups.items())
    if not ideal or not real:
        return f"speedup over the best plan without BP by implementation: {shown}"
    return (f"speedup over the best plan without BP by implementation: {shown} — the method "
            f"(traffic, balance) gives {ideal:.2f}x, the implementation (kernels, waits, copies) "
            f"the remaining {real / ideal:.2f}x")