"""A search's memory checks shared with a helper process on the other core.

`csbp plan` runs two searches side by side on two cores: the main one and the other
implementation's baseline (`method_vs_implementation`), which ends first (it wants the baseline
alone: DiffusionGemma 256K on 128 GPUs, 1.5-1.8 s of CPU against the main search's 2.5-3.1 s).
Most of the main search's memory checks decide nothing it ranks: the pruned screen reads a
candidate's fit only when it takes the candidate up (`search`'s `misfits=False`), and the others
are checked only to report why they are missing (the "memory" group, the count that fits):
0.5-0.6 s of that search, while the helper's core has nothing left to do (not quite free: on the
2-core host the two cores slow each other by up to a quarter while both run, benchmarks/README).
So the main search reads fits lazily, the helper checks candidates from the back of the list
once its own search is done (first simulating, under its own implementation, the best candidate
the main screen has scored so far: the likeliest recommendation, whose speedup under that
implementation the answer reads, `method_vs_implementation`), the main one from the front once
its screen is done, and they meet; each writes what it found into one shared byte per candidate
(the screen's own checks too, so neither repeats them).

Both processes run the same `candidate_memory` on the same objects (forked: the same code on the
same CPU, so the same floats), so the report equals the one-process search's. Where the helper
dies or is never started, the main process checks what is left itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

UNKNOWN, FITS, MISFIT = 0, 1, 2
CHUNK = 16  # candidates taken at once (~0.3 ms each): ~100 lock round trips for 1,500 candidates


class SharedChecks:
    """One byte per candidate of `space` (UNKNOWN / FITS / MISFIT) in memory shared across a
    fork, and the two ends of the part nobody has taken yet. Made before the fork (`ctx`: a fork
    context) for the search whose inputs are `key` (`matches`), with the space that search
    enumerates (`planner.enumerate_space`), which it then takes as its own."""

    def __init__(self, ctx, space, key: tuple) -> None:
        self.space, self.key = space, key
        n = len(space.candidates)
        self._state = ctx.RawArray("b", n)
        self._ends = ctx.RawArray("i", [0, n])  # next from the front, end of the back's part
        self._lock = ctx.Lock()
        self._leader = ctx.RawValue("i", -1)  # the main search's best screened candidate so far
        self.helper = None  # the helper's Process, once started (is it still alive?)

    def matches(self, *key) -> bool:
        return len(key) == len(self.key) and all(a is b or a == b for a, b in zip(key, self.key))

    @property
    def state(self) -> np.ndarray:
        return np.frombuffer(self._state, dtype=np.int8)

    def abandon(self) -> None:
        """The search will not read the split (it checks what it needs itself): nothing is left
        to take, so the helper ends at once."""
        with self._lock:
            self._ends[0] = self._ends[1]

    def lead(self, i: int) -> None:
        """The main side: candidate i is the best its screen has scored so far (the likeliest
        recommendation, which the helper may simulate under its own implementation ahead)."""
        self._leader.value = i

    @property
    def leader(self) -> int | None:
        return None if self._leader.value < 0 else self._leader.value

    def record(self, i: int, fits: bool) -> None:
        """A check made outside the split (the screen's own), so that neither side repeats it."""
        self._state[i] = FITS if fits else MISFIT

    def _take(self, front: bool) -> range | None:
        with self._lock:
            lo, hi = self._ends[0], self._ends[1]
            if lo >= hi:
                return None
            if front:
                self._ends[0] = min(lo + CHUNK, hi)
                return range(lo, self._ends[0])
            self._ends[1] = max(hi - CHUNK, lo)
            return range(self._ends[1], hi)

    def _work(self, front: bool, fits: Callable[[int], bool]) -> None:
        state = self._state
        while (part := self._take(front)) is not None:
            for i in (part if front else reversed(part)):
                if state[i] == UNKNOWN:
                    state[i] = FITS if fits(i) else MISFIT

    def help(self, fits: Callable[[int], bool]) -> None:
        """The helper's side: check candidates from the back until the two sides meet."""
        self._work(False, fits)

    def finish(self, fits: Callable[[int], bool]) -> list[bool]:
        """The main side: check from the front until the sides meet, wait for the helper's
        last chunk (or check it here, if the helper is gone), and return every fit in order."""
        self._work(True, fits)
        state = self.state
        while (left := np.flatnonzero(state == UNKNOWN)).size:
            if self.helper is not None and self.helper.is_alive():
                time.sleep(0.0005)  # its chunk in hand: a few milliseconds at most
                continue
            for i in left.tolist():  # the helper died mid-chunk: those are checked here
                state[i] = FITS if fits(i) else MISFIT
        return (state == FITS).tolist()


def for_search(ctx, model, workload, profile, nodes: int, checkpointing: tuple[str, ...] | None = None,
               axes: tuple[str, ...] | None = None) -> SharedChecks:
    """The shared checks of `planner.search(model, workload, profile, nodes, ...)` with these
    `checkpointing` and `axes` (None: the search's defaults), its space enumerated here."""
    from typing import get_args

    from csbp.simulator.plan.plan import AXES
    from csbp.simulator.planner.planner import cluster_gpus, enumerate_space
    from csbp.simulator.workload.workload import Checkpointing

    checkpointing = get_args(Checkpointing) if checkpointing is None else checkpointing
    axes = AXES if axes is None else axes
    gpus = cluster_gpus(profile, nodes)
    space = enumerate_space(model, workload, gpus, checkpointing, axes, implementation=profile.implementation)
    return SharedChecks(ctx, space, (model, workload, profile, gpus, checkpointing, axes))


def fits_of(checks: SharedChecks) -> Callable[[int], bool]:
    """What either side checks: the fit of the search's candidate i under the search's profile."""
    from csbp.simulator.planner.planner import candidate_memory

    model, _, profile = checks.key[:3]
    return lambda i: candidate_memory(model, checks.space.candidates[i], profile).feasible
