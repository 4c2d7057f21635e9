"""A calibration's one-process timings read at one host speed: the reference probe's.

Why: on this 2-core VM a single process's speed moves by 10-30 % within minutes to hours, and a
calibration's stages run minutes apart. The reference probe (the validation model's one-process
step, `microbench.probe_step_seconds`) is timed before each stage and at the end: one
calibration read 169.5, 184.3, 186.7, 186.1, 194.8, 195.9 and 162.6 ms, so its GEMMs were timed
on a host 5 % faster than the median and its sharing curves' one-rank rates on one 2 % slower.

What moves is the speed of one process alone, not the host's throughput with every core busy:
four calibrations (2026-12-01 16:15 to 23:35) read the one-process probe at 144.7, 178.8, 181.0
and 186.1 ms, but the same step run by 4 processes at once at 348.1, 326.0, 346.4 and 342.0 ms
(`step_load`, 6 % range against 29 %). The validation's plans all run 2 or 4 ranks on the 2
cores. So only what one process measured alone is scaled here (GEMMs, attention, memory-bound
ops, host overhead, the one-rank rates of the sharing curves): seconds by the median probe over
the mean of the two probes around its stage (speed taken as moving linearly within a stage
[U], every op class as moving with the probe, a training step's mix [U]); what ranks measured
at once (the sharing curves' rates with 2-4 ranks busy, steps under load, collectives) stays as
measured. A rank's price, alone-speed times curve, then reads the many-rank rate as measured,
whatever speed one process had at either moment, where before it carried the ratio of the two
moments' one-process speeds. Sizes and memory are not timings. The profile's notes give each
stage's factor.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from csbp.runtime.calibration.calibration_measurements import STAGES, Measurements


def stage_factors(probes: tuple[float, ...]) -> dict[str, float]:
    """Per stage: the reference probe (the median of all) over the mean of its stage's two."""
    reference = statistics.median(probes)
    return {stage: reference / ((probes[i] + probes[i + 1]) / 2) for i, stage in enumerate(STAGES)}


def at_reference_speed(m: Measurements) -> Measurements:
    """`m` with every one-process timing scaled to the reference probe's host speed (seconds
    times its stage's factor, rates divided by it); unchanged without a probe around every
    stage."""
    if m.probe is None or len(m.probe) != len(STAGES) + 1:
        return m
    f = stage_factors(m.probe)
    g, a, mem, share = f["GEMMs"], f["attention tiles"], f["memory-bound ops"], f["core sharing"]
    full_s, masked_s = m.masked_attention
    alone = {k: v for k, v in f.items() if k in STAGES[:4]}
    note = ("One-process timings read at the reference probe's host speed (its median over the "
            "mean of the probes around each stage): " + ", ".join(
                f"{stage} x{factor:.3f}" for stage, factor in alone.items())
            + "; what ranks measured at once (2-4 busy, collectives) as measured.")
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
        # the one-rank rates only: with more ranks busy the host's throughput is what it was
        gemm_load={p: [r / share for r in rates] if p == 1 else rates for p, rates in m.gemm_load.items()},
        rank_rates={r: {c: [x / share for x in xs] for c, xs in classes.items()} if r == 1 else classes
                    for r, classes in m.rank_rates.items()},
        notes=[*m.notes, note],
    )
