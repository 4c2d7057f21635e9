"""Link figures of a profile from timed collectives: alpha-beta per op and link level.

The cost model prices a call as latency + bytes received / (bus bandwidth x size efficiency)
(`simulator/cost/cost.py`, NCCL's ring model: hardware.md 3.4), with ring latency = call +
steps x step latency. This module inverts exactly that model, level by level:

- each op's alpha (latency) is the intercept of t = alpha + x / B fitted by least squares on
  relative residuals (x = bytes each member receives; relative so that 1 MB and 1 GB weigh
  alike), and the ring ops' alphas give `call_latency_us` and `step_latency_us` by least squares
  over their step counts (all-gather and reduce-scatter n-1 steps, all-reduce 2(n-1));
- each op's asymptotic bandwidth is the best x / (t - latency) over the bandwidth-bound sizes
  (where the latency is at most half the time), so exact alpha-beta timings give alpha and B
  back and the size curve (`size_efficiency`) is what the sizes fall short of it;
- across nodes only groups with one member per node are fitted (their rings cross the network
  at every step; the whole-world group is priced by the fitted profile as a check).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from csbp.runtime.calibration.collective_fit import ring_steps, wire_bytes
from csbp.runtime.calibration.fit_figures import MIB, efficiency_curve, figure, rounded

RING_OPS = ("all_gather", "reduce_scatter", "all_reduce")
OPS = (*RING_OPS, "all_to_all", "send_recv")
BANDWIDTH_FIELDS = {"all_gather": "collective_gbs", "reduce_scatter": "reduce_scatter_gbs",
                    "all_reduce": "all_reduce_gbs", "all_to_all": "alltoall_gbs",
                    "send_recv": "p2p_gbs"}
FLOOR_US = 0.01  # a latency the fit puts at or below zero is written as this (said in its source)


@dataclass(frozen=True)
class Sample:
    """One timed call: `group` (a kind of group, all its instances at once), its size and
    fewest members on a node, the op, the whole buffer in bytes, seconds (slowest rank)."""

    group: str
    level: str  # "nvlink", "infiniband" or "check" (priced against the fit, not fitted)
    size: int
    per_node: int
    op: str
    n_bytes: int
    seconds: float

    @property
    def received(self) -> float:
        return wire_bytes(self.op, self.n_bytes, self.size)

    @property
    def steps(self) -> int:
        return ring_steps(self.op, self.size)


def alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float | None]:
    """(alpha seconds, bandwidth bytes/s or None) of t = alpha + x / B over (x, t) points,
    least squares on relative residuals; None when the slope is not positive (no bandwidth)."""
    x = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    if len(points) == 1:
        return float(t[0]), None
    (alpha, slope), *_ = np.linalg.lstsq(np.column_stack([1 / t, x / t]), np.ones_like(t), rcond=None)
    return float(alpha), (1 / float(slope) if slope > 0 else None)


def ring_latency(alphas: list[tuple[int, float]]) -> tuple[float, float]:
    """(call, step) seconds from (ring steps, alpha) pairs: alpha = call + steps x step."""
    steps = np.array([s for s, _ in alphas], dtype=float)
    a = np.array([v for _, v in alphas], dtype=float)
    if len(set(steps.tolist())) < 2:  # one step count: no way to split call from step
        return float(a.mean()), 0.0
    (call, step), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(steps), steps]), a, rcond=None)
    return float(call), float(step)


def curve_x(s: Sample) -> float:
    """Where the cost model reads the size curve: a ring member's slice, an all-to-all peer's
    slice, a send/recv's message."""
    if s.op == "send_recv":
        return s.received
    return s.received / (s.size - 1 if s.op == "all_to_all" else s.steps)


@dataclass
class LevelFit:
    """What one link level's samples gave: figures with sources, and what they could not give."""

    figures: dict
    skipped: list[str]
    alphas: dict  # (group, op) -> (alpha s, bandwidth B/s or None), for the summary


def fit_level(samples: list[Sample], level: str, where: str) -> LevelFit:
    """The `Link` figures of `level` from its samples; `where` opens every source (command,
    date, hosts, backend). Fields its samples cannot give are listed in `skipped`."""
    mine = [s for s in samples if s.level == level and (level == "nvlink" or s.per_node == 1)]
    by: dict[tuple[str, str], list[Sample]] = {}
    for s in mine:
        by.setdefault((s.group, s.op), []).append(s)
    alphas = {key: alpha_beta([(s.received, s.seconds) for s in pts]) for key, pts in by.items()}
    figures: dict = {}
    skipped: list[str] = []
    ring = [(pts[0].steps, alphas[key][0]) for key, pts in by.items() if key[1] in RING_OPS]
    call = step = None
    if ring:
        call, step = ring_latency(ring)
        groups = sorted({f"{g} (n={by[(g, o)][0].size})" for (g, o) in by if o in RING_OPS})
        basis = (f"ring latency = call + steps x step, least squares over the intercepts of "
                 f"all_gather, reduce_scatter, all_reduce in {', '.join(groups)}")
        figures["call_latency_us"] = _latency(call, f"{where}: {basis}")
        figures["step_latency_us"] = _latency(step, f"{where}: {basis}")
    else:
        skipped += ["call_latency_us", "step_latency_us"]
    p2p = [key for key in by if key[1] == "send_recv"]
    p2p_latency = alphas[p2p[0]][0] if p2p else None
    if p2p:
        figures["p2p_latency_us"] = _latency(p2p_latency, f"{where}: send/recv intercept of t = "
                                             f"alpha + bytes / B, pairs ({p2p[0][0]})")
    else:
        skipped.append("p2p_latency_us")
    efficiency: list[tuple[float, float]] = []
    for op in OPS:
        keys = [k for k in by if k[1] == op]
        latency = {"send_recv": p2p_latency, "all_to_all": call}.get(op)
        if not keys or (op in RING_OPS and call is None) or (op == "all_to_all" and call is None):
            skipped.append(BANDWIDTH_FIELDS[op])
            continue
        key = max(keys, key=lambda k: by[k][0].size)  # the largest group: what TP/CP groups use
        pts = by[key]
        lat = latency if op in ("send_recv", "all_to_all") else call + pts[0].steps * max(step, 0.0)
        bound = [s.received / (s.seconds - lat) for s in pts if s.seconds - lat >= 0.5 * s.seconds]
        largest = max(pts, key=lambda s: s.n_bytes)
        fitted = alphas[key][1]
        if bound:
            bandwidth, how = max(bound), ("best bytes received / (time - latency) over the sizes "
                                          "where latency is at most half the time")
        elif fitted is not None:
            bandwidth, how = fitted, "the least-squares slope (no size was bandwidth-bound)"
        else:  # noise put the slope at or below zero: the largest call's average rate, a floor
            bandwidth, how = (largest.received / largest.seconds,
                              "bytes received / time of the largest size, latency not taken off "
                              "(the fit's slope was not positive: noisy timings)")
        per = pts[0].per_node if level == "infiniband" else 1  # a spanning ring: NICs of a node
        figures[BANDWIDTH_FIELDS[op]] = figure(rounded(bandwidth / per / 1e9), (
            f"{where}: {op} in {key[0]} (n={pts[0].size}, {pts[0].per_node} per node), "
            f"{largest.n_bytes / MIB:g} MiB in {largest.seconds * 1e6:.0f} us; {how}"))
        for s in pts:
            if s.seconds > lat:
                efficiency.append((curve_x(s), s.received / bandwidth / (s.seconds - lat)))
    if efficiency:
        figures["size_efficiency"] = figure(efficiency_curve(efficiency, per_decade=2), (
            f"{where}: per bytes-per-rank bin (half a decade), median over ops of (bytes received "
            "/ asymptotic bandwidth) / (time - latency), clamped to 1"))
    else:
        skipped.append("size_efficiency")
    return LevelFit(figures, skipped, alphas)


def _latency(seconds: float, source: str) -> dict:
    if seconds * 1e6 > FLOOR_US:
        return figure(rounded(seconds * 1e6), source)
    return figure(FLOOR_US, f"{source}; the fit gave {seconds * 1e6:.3g} us, written as "
                            f"{FLOOR_US} us (the profile needs a positive latency)")
