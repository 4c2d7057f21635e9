"""Ranks that share a host's cores: each op priced at the number of ranks busy while it runs.

Why: a measured sharing curve (`Node.rank_speed`, from `csbp calibrate`) says how fast each
rank runs while R ranks are busy at once. Pricing every op at R = all the host's ranks takes
them as busy the whole step, but they are not: a rank that arrived at a collective before its
peers waits (gloo blocks the rank's thread on a condition, leaving its core to the others),
and under block parallelism the ranks with less attention work wait for the one with the
most at every exchange. While fewer ranks run, each runs faster, so the static price is too
slow for plans whose ranks wait for each other, and exactly right for plans whose ranks never
do (DP copies in step).

The mechanism is processor sharing, solved as a fixed point of the engine's own timeline:
price every op at the static count; run the engine; for every op, read the mean number of the
host's ranks busy over its interval (each representative rank standing for its DP/TP/EP copies,
which run the same ops at the same times); re-price each op at that count; run again, until the
step time moves by less than `TOLERANCE`. A rank is busy while it computes and while a transfer
it takes part in runs (gloo moves the bytes with the rank's own thread through the loopback
[U]); waiting for a peer to arrive is not busy. Only a one-node plan on a profile with measured
curves is crowded this way: across nodes each node's ranks would need their own count [U: not
modelled, the static price is kept].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from csbp.simulator.cost.cost import HostShare, host_share
from csbp.simulator.cost.graph import Comm, StepGraph
from csbp.simulator.system.hardware import HardwareProfile

# the fixed point stops when the step moves by less than this fraction (far below the 5-10 %
# run-to-run noise of the measurements it is compared with) or after MAX_ROUNDS re-pricings
TOLERANCE = 1e-4
MAX_ROUNDS = 12


def applies(profile: HardwareProfile, copies: int | None) -> bool:
    """Crowding is priced: the profile has measured curves and the plan's ranks are one host's."""
    return copies is not None and bool(profile.node.rank_speed) and profile.node.gpus_per_node > 1


def busy_ranks(start: np.ndarray, finish: np.ndarray, busy: np.ndarray, copies: int) -> np.ndarray:
    """[op, rank]: the mean number of the host's ranks busy over each op's interval (the op's own
    rank included). `busy` [op, rank] marks the intervals that keep a rank busy."""
    s, f = start[busy], finish[busy]
    times = np.concatenate([s, f])
    steps = np.concatenate([np.full(s.size, float(copies)), np.full(f.size, -float(copies))])
    order = np.argsort(times, kind="stable")
    times, level = times[order], np.cumsum(steps[order])  # ranks busy from times[k] on
    area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])  # busy-rank-seconds by times[k]

    def integral(t: np.ndarray) -> np.ndarray:
        k = np.maximum(np.searchsorted(times, t, side="right") - 1, 0)
        return area[k] + level[k] * (t - times[k])

    span = finish - start
    out = np.full(start.shape, float(copies))
    inside = span > 0
    out[inside] = (integral(finish[inside]) - integral(start[inside])) / span[inside]
    return np.maximum(out, float(copies))  # never fewer than the op's own rank and its copies


def crowded(graph: StepGraph, profile: HardwareProfile, d: np.ndarray, copies: int, overlap: bool,
            run: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, finish, durations) at the fixed point; `run(d)` is the engine's (start, finish).

    Each round moves every op's busy count halfway to what the last timeline read (damping: a
    rank that speeds up can make another wait longer, which can swing a count back and forth)."""
    works, which = graph.works()
    shares = [None if isinstance(w, Comm) else host_share(w, profile) for w in works]
    repriced = [i for i, w in enumerate(which.tolist()) if isinstance(shares[w], HostShare)]
    keeps_busy = d > 0
    if overlap:  # transfers on their own stream: the rank's compute stream says whether it is busy
        keeps_busy &= np.array([not isinstance(works[w], Comm) for w in which.tolist()])[:, None]
    idle = np.array([getattr(works[w], "kind", "") == "host-sync" for w in which.tolist()])
    keeps_busy &= ~idle[:, None]
    counts = np.full(d.shape, float(profile.node.gpus_per_node))
    start, finish = run(d)
    step = float(finish.max()) if finish.size else 0.0
    for _ in range(MAX_ROUNDS):
        counts = (counts + busy_ranks(start, finish, keeps_busy, copies)) / 2
        d = d.copy()
        for i in repriced:
            d[i] = shares[which[i]].at(profile.node, counts[i])
        start, finish = run(d)
        now = float(finish.max()) if finish.size else 0.0
        if abs(now - step) <= TOLERANCE * max(step, 1e-12):
            break
        step = now
    return start, finish, d


def fastest(profile: HardwareProfile) -> HardwareProfile:
    """The profile with every op class at the best share any busy count on the host could give
    it (1 to all its ranks): no crowded price is below this one's, so bounds priced on it stay
    below the engines (`planner/bounds.py`). The profile itself where there is nothing to crowd."""
    node = profile.node
    if not node.rank_speed or node.gpus_per_node <= 1:
        return profile
    hit = _FASTEST.get(id(profile))
    if hit is not None and hit[0] is profile:  # one copy per profile: op prices are cached by it
        return hit[1]
    ranks = node.gpus_per_node
    best = {}
    sized = node.rank_speed_by_size or {}
    for op_class, curve in node.rank_speed.items():
        curves = [curve, *sized.get(op_class, {}).values()]  # every call size's curve too
        top = max([y for c in curves for x, y in c if x <= ranks] +
                  [node.rank_share(op_class, ranks, size) for size in [None, *sized.get(op_class, {})]])
        best[op_class] = [[1, top], [ranks, top]]  # flat: read as `top` at every count up to ranks
    out = profile.model_copy(update={"node": node.model_copy(update={"rank_speed": best,
                                                                     "rank_speed_by_size": None})})
    if len(_FASTEST) > 16:
        _FASTEST.clear()
    _FASTEST[id(profile)] = (profile, out)
    return out


_FASTEST: dict[int, tuple[HardwareProfile, HardwareProfile]] = {}
