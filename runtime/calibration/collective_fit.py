"""The collective model of a CPU host, fitted from the runtime's measured gloo calls.

Two things come out of the calls `csbp calibrate` times: a table of every measured call (what
the cost model prices group sizes it has seen with) and an alpha-beta fit per op (call and
ring-step latency, bus bandwidth, a size-efficiency curve, the wake-up delay once ranks
outnumber cores) for group sizes without a table. The ring formulas here are the ones the step
graph counts bytes with, so the fit inverts the model that will price the plans.
"""

from __future__ import annotations

import statistics

from csbp.runtime.calibration.calibration_measurements import Measurements
from csbp.runtime.calibration.fit_figures import KIB, MIB, efficiency_curve, figure, rounded
from csbp.simulator.system.hardware import HardwareProfile

GROUP_OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def wire_bytes(op: str, n_bytes: int, world: int) -> float:
    """Bytes one rank sends, and receives, for a buffer of `n_bytes` (ring algorithms; send/recv:
    the message): what the step graph counts as a member's received bytes."""
    if op == "send_recv":
        return n_bytes
    share = (world - 1) / world * n_bytes
    return 2 * share if op == "all_reduce" else share


def ring_steps(op: str, world: int) -> int:
    """Sequential hops of a ring algorithm, each paying a step's latency (all-reduce: two rings)."""
    if op == "send_recv":
        return 1
    return 2 * (world - 1) if op == "all_reduce" else world - 1


def per_rank_bytes(op: str, n_bytes: int, world: int) -> float:
    """x of the size-efficiency curve: bytes each rank moves in one call."""
    return n_bytes if op == "send_recv" else n_bytes / world


def collective_seconds(profile: HardwareProfile, op: str, n_bytes: int, world: int,
                       measured: bool = True) -> float:
    """The simulator's price of one call over a buffer of `n_bytes` by `world` ranks of one host:
    the measured table where the profile has one (`measured`), else the alpha-beta model with the
    wake-up delay once ranks outnumber cores."""
    from csbp.simulator.cost.cost import collective_seconds as price
    from csbp.simulator.cost.graph import Comm, Group

    if not measured:
        profile = profile.model_copy(update={"links": profile.links.model_copy(update={
            "nvlink": profile.links.nvlink.model_copy(update={"call_seconds": None})})})
    collective = "p2p" if op == "send_recv" else op.replace("_", "-")
    group = Group(size=world, per_node=world, sync=((0,),))
    return price(Comm(collective, (wire_bytes(op, n_bytes, world),), group, "other"),
                 wire_bytes(op, n_bytes, world), profile.on_one_host(world))


def fit_links(m: Measurements) -> tuple[dict, float, dict]:
    """Link figures from world size 2, the wake-up latency from world size 4."""
    from csbp.runtime.calibration.microbench import GAP_S

    two = m.collectives[2]
    sizes = sorted({s for _, s in two})
    small, large = sizes[0], sizes[-1]
    where = ("gloo over TCP loopback, world size 2, one thread per rank, the wall time each call "
             f"adds to a loop of {GAP_S * 1e3:.0f} ms of compute per call")
    # alpha-beta per op: latency from the smallest size, asymptote = the best bandwidth any
    # size reaches once latency is off (the size curve then says how far each size falls short)
    gbs, lat = {}, {}
    for op in (*GROUP_OPS, "send_recv"):
        latency = two[(op, small)]
        for _ in range(3):  # the smallest call's own wire time, refined with the bandwidth
            bandwidth = max(wire_bytes(op, s, 2) / (two[(op, s)] - latency) for s in sizes
                            if s != small and two[(op, s)] > latency)
            latency = max(1e-7, two[(op, small)] - wire_bytes(op, small, 2) / bandwidth)
        gbs[op], lat[op] = bandwidth / 1e9, latency
    # ring latency = call + steps x step: all-gather (1 step at n = 2) and all-reduce (2 steps)
    step = max(1e-7, (lat["all_reduce"] - lat["all_gather"])
               / (ring_steps("all_reduce", 2) - ring_steps("all_gather", 2)))
    call = max(1e-7, lat["all_gather"] - ring_steps("all_gather", 2) * step)
    p2p_latency = lat["send_recv"]
    # size efficiency: what fraction of its asymptote each op reaches per bytes-per-rank
    points = []
    for op in GROUP_OPS:
        latency = call + ring_steps(op, 2) * step
        for s in sizes:
            spent = max(1e-9, two[(op, s)] - latency)
            points.append((per_rank_bytes(op, s, 2), wire_bytes(op, s, 2) / (gbs[op] * 1e9) / spent))
    curve = efficiency_curve(points, per_decade=1)

    def t(op: str, s: int) -> str:
        return f"{two[(op, s)] * 1e6:.0f} us"

    link = {
        "call_seconds": call_tables(m, GAP_S),
        "collective_gbs": figure(rounded(gbs["all_gather"]), f"measured ({where}): the runtime's Comm.all_gather "
                                  f"(all_gather_single) of {large // MIB} MiB in {t('all_gather', large)}, ring wire bytes "
                                  "(n-1)/n x buffer, latency subtracted"),
        "p2p_gbs": figure(rounded(gbs["send_recv"]), f"measured ({where}): batch_isend_irecv of "
                           f"{large // MIB} MiB to the ring neighbour in {t('send_recv', large)}"),
        "alltoall_gbs": figure(rounded(gbs["all_to_all"]), f"measured ({where}): all_to_all_single of "
                                f"{large // MIB} MiB in {t('all_to_all', large)}, wire bytes (n-1)/n x buffer"),
        "call_latency_us": figure(rounded(call * 1e6), f"measured ({where}): all_gather latency "
                                   f"({t('all_gather', small)} at {small // KIB} KiB less its wire time) "
                                   "minus one step"),
        "step_latency_us": figure(rounded(step * 1e6), f"measured ({where}): all_reduce latency "
                                   f"(2 steps; {t('all_reduce', small)} at {small // KIB} KiB) minus "
                                   "all_gather latency (1 step)"),
        "p2p_latency_us": figure(rounded(p2p_latency * 1e6), f"measured ({where}): send/recv "
                                  f"latency (alpha; {t('send_recv', small)} at {small // KIB} KiB)"),
        "size_efficiency": figure(curve, f"measured ({where}): latency from the smallest size and "
                                   "the best bandwidth per op, then per bytes-per-rank bin, median over "
                                   "all_gather / reduce_scatter / all_reduce / all_to_all of (wire bytes / "
                                   "asymptotic bandwidth) / (time - latency), at "
                                   + ", ".join(f"{s // KIB} KiB" for s in sizes)),
        "all_reduce_gbs": figure(rounded(gbs["all_reduce"]), f"measured ({where}): all_reduce of "
                                  f"{large // MIB} MiB in {t('all_reduce', large)}, wire bytes 2(n-1)/n x buffer "
                                  "(includes the CPU reduction)"),
        "reduce_scatter_gbs": figure(rounded(gbs["reduce_scatter"]), f"measured ({where}): Comm.reduce_scatter "
                                      f"(reduce_scatter_single) of {large // MIB} MiB in {t('reduce_scatter', large)} against "
                                      f"{t('all_reduce', large)} for all_reduce: gloo has no native ring "
                                      "reduce-scatter (torch PR #118911 emulates it), so it is priced "
                                      "from its own measurement, with ring wire bytes (n-1)/n x buffer"),
    }
    # wake-up latency: world size 4 on fewer cores, small messages, minus the world-2 model
    wakeups, detail = [], []
    if 4 in m.collectives:
        four = m.collectives[4]
        small4 = min(s for _, s in four)
        for op in GROUP_OPS:
            base = call + ring_steps(op, 4) * step
            wakeups.append(four[(op, small4)] - base)
            detail.append(f"{op} {four[(op, small4)] * 1e6:.0f} us")
    wakeup = statistics.median(wakeups) if wakeups else None
    wake_fig = None
    if wakeup and wakeup > 0:
        wake_fig = figure(rounded(wakeup * 1e6), "measured (gloo, world size 4 on this host's cores, "
                           f"the wall time each call adds to a loop of {GAP_S * 1e3:.0f} ms of compute per call, "
                           f"{small4 // KIB} KiB): median over ops of time - world-2 latency model, per call; "
                           f"{', '.join(detail)}; send/recv shows no such delay")
    return link, wakeup or 0.0, {"wakeup_latency_us": wake_fig}


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators). A larger
    call never takes less time, so a dip is noise; pooling averages it with its neighbours
    instead of letting one slow small call set the floor for every size above it."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (a, n), (b, k) = blocks[-2], blocks.pop()
            blocks[-1] = [(a * n + b * k) / (n + k), n + k]
    return [mean for mean, count in blocks for _ in range(count)]


def call_tables(m: Measurements, gap_s: float) -> dict:
    """Every measured call as the cost model reads it: by group size and op, seconds against the
    bytes each member receives, made non-decreasing."""
    tables: dict[int, dict[str, list]] = {}
    for world, measured in sorted(m.collectives.items()):
        for op in sorted({op for op, _ in measured}):
            sizes = sorted(s for o, s in measured if o == op)
            seconds = non_decreasing([measured[(op, s)] for s in sizes])
            tables.setdefault(world, {})[op] = [[rounded(wire_bytes(op, s, world)), rounded(t)]
                                                for s, t in zip(sizes, seconds)]
    sizes = sorted({s for table in m.collectives.values() for _, s in table})
    return figure(tables, (
        f"measured: the runtime's Comm calls (gloo over TCP loopback, one thread per rank) at world "
        f"sizes {', '.join(map(str, sorted(m.collectives)))}, buffers "
        f"{', '.join(f'{s // KIB} KiB' for s in sizes)}: the wall time each call adds to a loop "
        f"of {gap_s * 1e3:.0f} ms of compute per call (as a training step calls them: wake-up, "
        "waiting for a core and for the slowest rank included), median of 3 x 8 calls; x = "
        "bytes each member receives; made non-decreasing over sizes (pool adjacent violators)"))


def residuals(profile: HardwareProfile, m: Measurements) -> list[dict]:
    """Every measured call against its price from the table and from the alpha-beta fit (what
    group sizes without a table get): the check of the fit's mechanisms."""
    rows = []
    for world, table in sorted(m.collectives.items()):
        for (op, n_bytes), seconds in sorted(table.items()):
            predicted = collective_seconds(profile, op, n_bytes, world)
            alpha_beta = collective_seconds(profile, op, n_bytes, world, measured=False)
            rows.append({"world": world, "op": op, "bytes": n_bytes, "measured_s": seconds,
                         "predicted_s": predicted, "error": predicted / seconds - 1,
                         "alpha_beta_s": alpha_beta, "alpha_beta_error": alpha_beta / seconds - 1})
    return rows
