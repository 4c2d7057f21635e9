"""Every stage of a calibration read at one host speed: the reference probe's.

Why: a shared VM's speed moves by several percent within minutes, and a calibration's stages
run minutes apart. The reference probe (the validation model's one-process step,
`microbench.probe_step_seconds`) is timed before each stage and at the end; on this 2-core host
one calibration read 169.5, 184.3, 186.7, 186.1, 194.8, 195.9 and 162.6 ms, so the GEMMs were
timed on a host 5 % faster than the median and the collectives on one 5 % slower. Each op
class's figure then carries its own stage's speed, a per-class bias that `csbp validate`'s
normalisation (one probe ratio for the whole step) cannot take out. Here every timing is
scaled to the speed of the recorded probe (`node.probe_step_s`, the median): by the median
over the mean of the two probes around its stage, the host's speed taken as moving linearly
within a stage [U], and every op class as slowing by the probe's ratio (a whole training
step's mix of GEMMs, memory-bound ops and host overhead) [U]. Sizes and memory are not
timings and stay as measured. The profile's notes give each stage's factor.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from csbp.runtime.calibration.calibration_measurements import Measurements

# The stages in the order `calibration_measurements.measure` runs them, a probe before each.
STAGES = ("GEMMs", "attention tiles", "memory-bound ops", "core sharing",
          "collectives, world size 2", "collectives, world size 4")


def stage_factors(probes: tuple[float, ...]) -> dict[str, float]:
    """Per stage: the reference probe (the median of all) over the mean of its stage's two."""
    reference = statistics.median(probes)
    return {stage: reference / ((probes[i] + probes[i + 1]) / 2) for i, stage in enumerate(STAGES)}


def at_reference_speed(m: Measurements) -> Measurements:
    """`m` with every timing scaled to the reference probe's host speed (seconds times the
    stage's factor, rates divided by it); unchanged without a probe around every stage."""
    if m.probe is None or len(m.probe) != len(STAGES) + 1:
        return m
    f = stage_factors(m.probe)
    g, a, mem, share = f["GEMMs"], f["attention tiles"], f["memory-bound ops"], f["core sharing"]
    full_s, masked_s = m.masked_attention
    collectives = {w: {k: s * f[f"collectives, world size {w}"] for k, s in calls.items()}
                   for w, calls in m.collectives.items() if f"collectives, world size {w}" in f}
    if len(collectives) != len(m.collectives):  # a world size this module has no stage for
        return m
    note = ("Timings read at the reference probe's host speed (median of the probes around each "
            "stage): " + ", ".join(f"{stage} x{factor:.3f}" for stage, factor in f.items()) + ".")
    return replace(
        m,
        gemm=[(mm, k, n, s * g) for mm, k, n, s in m.gemm],
        linear=[(mm, k, n, tf * g, tb * g) for mm, k, n, tf, tb in m.linear],
        attention=[(t, hd, b, flop, s * a) for t, hd, b, flop, s in m.attention],
        masked_attention=(full_s * a, masked_s * a),
        dense_attention=[(q, k, where, tf * a, tb * a, frac) for q, k, where, tf, tb, frac in m.dense_attention],
        copy=(m.copy[0], m.copy[1] * mem),
        layer_elementwise=[(n, s * mem) for n, s in m.layer_elementwise],
        op_overhead_s=m.op_overhead_s * mem,
        tiny_step=(m.tiny_step[0] * mem, m.tiny_step[1]) if m.tiny_step else None,
        optimizer=(m.optimizer[0], m.optimizer[1] * mem) if m.optimizer else None,
        gemm_load={p: [r / share for r in rates] for p, rates in m.gemm_load.items()},
        rank_rates={r: {c: [x / share for x in xs] for c, xs in classes.items()}
                    for r, classes in m.rank_rates.items()},
        step_load={p: s * share for p, s in m.step_load.items()},
        pair_calls={w: s * share for w, s in m.pair_calls.items()},
        collectives=collectives,
        notes=[*m.notes, note],
    )
