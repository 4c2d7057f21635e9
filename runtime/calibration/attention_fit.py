"""The CPU runtime's explicit attention, fitted: visible and masked scores at their own prices.

The runtime scores every query against every key of the 2L sequence and masks the rest, and a
masked score costs a different time than a visible one (exp of -inf leaves its vectorised fast
path), so calls of one size with different masks separate the two prices.
"""

from __future__ import annotations

import statistics

from csbp.runtime.calibration.calibration_measurements import Measurements
from csbp.runtime.calibration.fit_figures import figure, rounded
from csbp.runtime.validation.validation_suite import BLOCK, VALIDATION_MODEL
from csbp.simulator.system.hardware import HardwareProfile


def dense_curves(m: Measurements, peak: float) -> dict:
    """Visible and masked score efficiencies of the runtime's explicit attention, by call GFLOP.

    Calls of one size (queries x keys) differ only in their mask: time = visible dense FLOP /
    (peak x e_visible) + masked dense FLOP / (peak x e_masked), solved by least squares over
    the query sets of each size.
    """
    if not m.dense_attention:
        return {}
    import numpy as np

    a = VALIDATION_MODEL.layers[0]
    sizes = sorted({(q, k) for q, k, *_ in m.dense_attention}, key=lambda s: s[0] * s[1])
    curves: dict[tuple[str, str], list] = {}
    for backward, direction in ((False, "forward"), (True, "backward")):
        for q, k in sizes:
            rows = [r for r in m.dense_attention if (r[0], r[1]) == (q, k)]
            dense = 4.0 * q * k * a.head_dim * a.n_heads * (2.5 if backward else 1.0)
            A = np.array([[frac * dense, (1 - frac) * dense] for *_, frac in rows])
            t = np.array([r[4] if backward else r[3] for r in rows])
            (cv, cm), *_ = np.linalg.lstsq(A, t, rcond=None)
            if cv <= 0 or cm <= 0:  # masks too alike to separate: one price for both
                cv = cm = float(t.sum() / A.sum())
            curves.setdefault(("visible", direction), []).append((dense / 1e9, 1 / (cv * peak)))
            curves.setdefault(("masked", direction), []).append((dense / 1e9, 1 / (cm * peak)))
    shapes = ", ".join(f"{q}x{k}" for q, k in sizes)
    out = {}
    for (kind, direction), pts in curves.items():
        by_x: dict[float, list[float]] = {}
        for x, y in pts:  # shapes of one size (512 x 2048, 1024 x 1024): one point
            by_x.setdefault(rounded(x), []).append(y)
        out[f"dense_{kind}_{direction}_efficiency"] = figure(
            [[x, rounded(min(1.0, max(1e-4, statistics.mean(ys))))] for x, ys in sorted(by_x.items())], (
                f"measured: the runtime's attention_with_lse {direction} "
                f"({'autograd, as a training step runs it' if direction == 'backward' else 'recording autograd'}) "
                f"on BD3-LM-masked calls of queries x keys {shapes} (L = keys / 2, block {BLOCK}), three "
                "query sets per size (spread, early blocks, late blocks: different visible shares); per "
                "size, least squares of time = visible / (peak x e_visible) + masked / (peak x "
                "e_masked) over dense FLOP (4 x q x k x head_dim x heads"
                f"{', x 2.5 backward' if direction == 'backward' else ''}); {kind} scores"
                f"{' (-inf: exp leaves its vectorised fast path)' if kind == 'masked' else ''}"))
    return out


def dense_attention_check(profile: HardwareProfile, m: Measurements) -> list[dict]:
    """Every measured attention call vs the visible/masked pricing (the mechanism's check)."""
    a = VALIDATION_MODEL.layers[0]
    rows = []
    for queries, keys, where, tf, tb, frac in m.dense_attention:
        dense = 4.0 * queries * keys * a.head_dim * a.n_heads
        for backward, measured in ((False, tf), (True, tb)):
            x = dense * (2.5 if backward else 1.0)
            predicted = profile.dense_attention_seconds(frac * x, x, 1, backward)
            if predicted is None:
                continue
            rows.append({"queries": queries, "keys": keys, "queries_from": where, "visible": frac,
                         "backward": backward, "measured_s": measured, "predicted_s": predicted,
                         "error": predicted / measured - 1})
    return rows
