"""How ranks share a CPU host, fitted from `rank_sharing`'s measurements, and checked.

The speed each rank gets while R ranks are busy at once, per op class, is the measured ratio
to one rank alone, kept as a curve over R (`node.rank_speed`): no cores / R, no efficiency
factor, so a host whose two ranks each lose 10 % on two cores, or whose four lose 70 %, is
priced as measured. The wake-up figure (`node.rank_wakeup_us`) is what a pair's small
collective call adds to a loop of compute with R ranks on the host. The check prices the
validation model's one-process step with R processes at once (`step_load`, a measurement the
fit does not use) and sets it beside the measured one.
"""

from __future__ import annotations

import statistics

from csbp.runtime.calibration.calibration_measurements import TINY_SPEC_TEXT, Measurements
from csbp.runtime.calibration.fit_figures import figure, rounded
from csbp.runtime.calibration.rank_sharing import (ATTENTION_CALL, ATTENTION_LARGE_CALL, LARGE_WINDOW, SIZED,
                                                   call_elements)

WHAT = {
    "gemm": "nn.Linear(256, 768) forward + backward on 1024 tokens",
    "memory": "one layer's eager memory-bound ops (2 RMSNorms, RoPE, residual adds, SwiGLU "
              "product; forward, recompute, backward) at 1024 tokens",
    "attention": "the runtime's attention_with_lse forward + backward, 256 queries x 1024 keys "
                 "under the BD3-LM mask",
    "host": f"a whole runtime step at negligible arithmetic ({TINY_SPEC_TEXT}): host time",
    "attention-large": "the same attention at 1024 queries x 2048 keys (a 32 MiB fp32 score matrix)",
}


def rank_speed_curves(rank_rates: dict[int, dict[str, list[float]]]) -> dict[str, list[list]]:
    """Per op class, [[R, speed of a rank with R busy / speed alone], ...]: the summed rate of
    the R ranks over R (the host's throughput shared; the scheduler evens ranks out over a step)
    against one rank's."""
    alone = {c: statistics.fmean(rates) for c, rates in rank_rates[1].items()}
    return {c: [[ranks, rounded(statistics.fmean(rates[c]) / alone[c])]
                for ranks, rates in sorted(rank_rates.items())] for c in alone}


HOST_CLASSES = ("gemm", "memory", "attention", "host")


def sized_curves(curves: dict[str, list[list]]) -> dict[str, dict[float, list[list]]]:
    """Per class measured at more than one call size (`rank_sharing.SIZED`), its curves keyed
    by the call's size (`rank_sharing.call_elements`)."""
    sizes = {"attention": call_elements(ATTENTION_CALL), "attention-large": call_elements(ATTENTION_LARGE_CALL)}
    return {cls: {sizes[c]: [list(point) for point in curves[c]] for c in measured}  # copies: no YAML aliases
            for cls, measured in SIZED.items() if all(c in curves for c in measured)}


def sharing_figures(m: Measurements) -> dict:
    """`rank_speed` and `rank_wakeup_us` in their YAML form (empty where not measured)."""
    out = {}
    if m.rank_rates and 1 in m.rank_rates:
        curves = rank_speed_curves(m.rank_rates)
        detail = "; ".join(f"{c} ({WHAT.get(c, c)}): " + ", ".join(
            f"{r} at once {sum(rates[c]):.1f}/s summed" for r, rates in sorted(m.rank_rates.items()))
            for c in curves)
        sized = sized_curves(curves)
        curves = {c: curve for c, curve in curves.items() if c in HOST_CLASSES}
        out["rank_speed"] = figure(curves, (
            f"measured: R processes (one thread each, as ranks) running one op class at once, "
            f"started together behind a gloo barrier, each calling it for a {m.rank_window_s:g} s "
            "window (calls that end inside it counted; cold caches, as the alone figures, except "
            "host), R = 1..4 forward then back in alternating rounds, each rank's median rate over "
            "the rounds: summed calls per second / R over one process alone, R = "
            f"{', '.join(map(str, sorted(m.rank_rates)))}; {detail}; under load {m.load}"))
        if sized:
            out["rank_speed_by_size"] = figure(sized, (
                "measured as rank_speed, each class at two call sizes (attention: score-matrix "
                "elements per call, queries x 2L keys x 4 heads: 256 x 1024 and 1024 x 2048, the "
                f"larger with a {LARGE_WINDOW:g} x longer window); a call is read between them in "
                "log size"))
    if m.pair_calls:
        from csbp.runtime.calibration.microbench import GAP_S
        from csbp.runtime.calibration.rank_sharing import WAKEUP_BYTES

        out["rank_wakeup_us"] = figure(
            {w: rounded(max(0.0, s) * 1e6) for w, s in sorted(m.pair_calls.items())}, (
                f"measured: the wall time a {WAKEUP_BYTES // 1024} KiB gloo all_reduce over a pair "
                f"of ranks adds to a loop of {GAP_S * 1e3:.0f} ms of compute per call, with R ranks "
                "on the host (every pair a group, the others computing), median of interleaved "
                "loops with and without the call; by R (a call priced from a table measured with "
                "fewer ranks on the host adds the difference)"))
    return out


def step_check(profile, m: Measurements) -> list[dict]:
    """The validation model's one-process step (L = 256) with R processes at once, measured
    (`step_load`; alone: the reference probe) against its price on the profile with R ranks
    on the host: the check of the sharing figures on a whole step."""
    from csbp.runtime.calibration.microbench import PROBE_SEQ_LEN
    from csbp.runtime.calibration.one_process_graph import one_process_graph
    from csbp.runtime.validation.validation_suite import BLOCK, VALIDATION_MODEL
    from csbp.simulator.cost.cost import seconds as price
    from csbp.simulator.cost.graph import Compute

    measured = dict(m.step_load)
    if m.probe is not None:
        measured.setdefault(1, statistics.median(m.probe))  # the speed the alone figures are read at
    # one process, no collectives: its step is its compute ops one after the other
    ops = [op.work for op in one_process_graph(VALIDATION_MODEL, PROBE_SEQ_LEN, BLOCK).ops
           if isinstance(op.work, Compute)]
    rows = []
    for ranks, seconds in sorted(measured.items()):
        host = profile.on_one_host(ranks)
        predicted = sum(float(price(work, host)[0]) for work in ops)
        rows.append({"ranks": ranks, "measured_s": seconds, "predicted_s": predicted,
                     "error": predicted / seconds - 1})
    return rows
