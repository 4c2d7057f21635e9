"""The figures of `csbp validate`: errors, noise and drift side by side, and the ranking check.

Every error is a fraction of the measured step time, given twice: raw (prediction against the
step as measured) and normalised (against the step scaled by the reference probe: calibrated
probe time / probe time at the run, see `validation_runs`). Raw is what a user of this host
sees; normalised is the model's error with the host's drift since calibration taken out. The
noise (spread of a plan's repeats) and the host drift (the probe against its calibrated time)
sit next to them, because an error smaller than those says nothing about the model.

Memory is compared as one quantity on both sides: the runtime's allocated-bytes peak (CUDA's
max_memory_allocated, or `runtime.memory_tracker` on CPU; the median over repeats, with their
spread) against the timeline's live-tensor peak (`Result.peak_allocated_gib`: no allocator
overhead, no reserved memory). The resident set (`rss_peak_gib`) is shown beside it, not mixed in.

Errors are also averaged per world size and per plan family (`error_groups`), signed: a model
that gets how ranks share the host wrong is off for every plan of one world size in the same
direction, which a median over all plans hides; the worst group is named in the summary.
"""

from __future__ import annotations

import statistics
from itertools import combinations

from csbp.runtime.validation.validation_runs import SuiteRuns
from csbp.runtime.validation.validation_suite import Case

GIB = 1024**3


def relative_spread(values: list[float]) -> float:
    """Half the range over the median: how far one measurement may sit from another."""
    return (max(values) - min(values)) / 2 / statistics.median(values) if len(values) > 1 else 0.0


def compare(cases: list[Case], suite: SuiteRuns, predictions: list,
            probe_at_calibration: float | None) -> dict:
    """Rows and summary figures of the report."""
    rows = []
    for case, measured, probes, pred in zip(cases, suite.runs, suite.probe_at_run, predictions):
        medians = [r["step_time_s"] for r in measured]
        steps = [t for r in measured for t in r["step_times_s"]]
        step = statistics.median(medians)
        counted = [r["attention_bytes_counted"] for r in measured]
        layout = measured[0]["attention_bytes_predicted"]
        simulated = round(pred.attention_traffic_gib_per_gpu * GIB)
        mems = [r["peak_memory_gib"] for r in measured]  # allocated-bytes peak, max over ranks
        mem = statistics.median(mems)
        predicted_mem = getattr(pred, "peak_allocated_gib", None)
        row = {
            "plan": case.plan.label(), "kind": case.plan.kind, "world": case.plan.world,
            "seq_len": case.workload.seq_len, "block_size": case.workload.block_size,
            "checkpointing": case.workload.checkpointing,
            "measured_step_s": step, "predicted_step_s": pred.step_time_s,
            "error": pred.step_time_s / step - 1,
            "noise": relative_spread(medians if len(medians) > 1 else steps),
            "runs_step_s": medians,
            "attention_bytes_counted": max(counted), "attention_bytes_layout": layout,
            "attention_bytes_simulated": simulated,
            "bytes_equal": all(c == layout == simulated for c in counted)
            and all(r["attention_bytes_match"] for r in measured),
            # memory: the live-tensor peak on both sides (runtime: max_memory_allocated or the
            # CPU tracker; model: the timeline's peak without allocator overhead or reserve)
            "measured_peak_memory_gib": mem, "predicted_peak_memory_gib": predicted_mem,
            "memory_error": predicted_mem / mem - 1 if predicted_mem and mem else None,
            "memory_spread": relative_spread(mems) if all(mems) else None,
            "runs_peak_memory_gib": mems,
            "rss_peak_gib": max(r.get("rss_peak_gib") or 0.0 for r in measured),
            "predicted_peak_memory_at": getattr(pred, "peak_memory_at", None),
            "predicted_breakdown_gib": getattr(pred, "peak_breakdown_gib", None),
            "loss": measured[0]["loss"],
        }
        rows.append(row | normalised(row, medians, steps, probes, probe_at_calibration))
    errors = sorted(abs(r["error"]) for r in rows)
    normal = sorted(abs(r["normalised_error"]) for r in rows if r["normalised_error"] is not None)
    pairs = ranking_pairs(rows)
    mem_errors = sorted(abs(r["memory_error"]) for r in rows if r["memory_error"] is not None)
    groups = error_groups(rows)
    return {
        "groups": groups, "worst_group": worst_group(groups, "mean_error"),
        "worst_normalised_group": worst_group(groups, "mean_normalised_error"),
        "median_abs_memory_error": statistics.median(mem_errors) if mem_errors else None,
        "max_abs_memory_error": mem_errors[-1] if mem_errors else None,
        "median_abs_error": statistics.median(errors), "max_abs_error": errors[-1],
        "median_abs_normalised_error": statistics.median(normal) if normal else None,
        "max_abs_normalised_error": normal[-1] if normal else None,
        "noise": statistics.median(r["noise"] for r in rows),
        "normalised_noise": statistics.median(r["normalised_noise"] for r in rows) if normal else None,
        "host_drift": drift(probe_at_calibration, suite.probes),
        "probes": suite.probes,
        "bytes_equal": all(r["bytes_equal"] for r in rows),
        "ranking_matches": all(p["agrees"] for p in pairs if p["decided"]),
        "ranking_pairs": pairs, "rows": rows,
    }


GROUPINGS = {"world": "world", "kind": "plans"}  # row key -> how a group is named


def error_groups(rows: list[dict]) -> list[dict]:
    """Mean signed and absolute step-time error of the plans of each world size and of each plan
    family (dp, cp, bp, csbp), raw and normalised (None where a row has no normalised error)."""
    out = []
    for key in GROUPINGS:
        for value in sorted({r[key] for r in rows}):
            members = [r for r in rows if r[key] == value]
            normal = [r.get("normalised_error") for r in members]
            out.append({"by": key, "group": value, "label": group_label(key, value),
                        "plans": len(members),
                        "mean_error": statistics.fmean(r["error"] for r in members),
                        "mean_abs_error": statistics.fmean(abs(r["error"]) for r in members),
                        "mean_normalised_error": None if None in normal else statistics.fmean(normal)})
    return out


def group_label(key: str, value) -> str:
    return f"world {value}" if key == "world" else f"{value} {GROUPINGS[key]}"


def worst_group(groups: list[dict], field: str) -> dict | None:
    """The group whose mean error (`field`, signed) is furthest from 0."""
    scored = [g for g in groups if g[field] is not None]
    return max(scored, key=lambda g: abs(g[field])) if scored else None


def normalised(row: dict, medians: list[float], steps: list[float], probes: list[float | None],
               at_calibration: float | None) -> dict:
    """A row's step, error and noise read against the probe at each run (None without probes)."""
    if at_calibration is None or not probes or any(p is None for p in probes):
        return {"runs_probe_step_s": probes, "normalised_step_s": None, "normalised_error": None,
                "normalised_noise": None}
    scaled = [t * at_calibration / p for t, p in zip(medians, probes)]
    step = statistics.median(scaled)
    spread = scaled if len(scaled) > 1 else [t * at_calibration / probes[0] for t in steps]
    return {"runs_probe_step_s": probes, "normalised_step_s": step,
            "normalised_error": row["predicted_step_s"] / step - 1,
            "normalised_noise": relative_spread(spread)}


def drift(at_calibration: float | None, probes: list[dict]) -> dict | None:
    """The reference step now against its time when the profile was measured: how much slower
    (> 0) the host runs than it did then, before and after the suite, and its range in between."""
    if at_calibration is None or not probes:
        return None
    times = [p["probe_step_s"] for p in probes]
    return {"probe_step_s_at_calibration": at_calibration, "probe_step_s_before": times[0],
            "probe_step_s_after": times[-1], "before": times[0] / at_calibration - 1,
            "after": times[-1] / at_calibration - 1, "min": min(times) / at_calibration - 1,
            "max": max(times) / at_calibration - 1}


def ranking_pairs(rows: list[dict]) -> list[dict]:
    """Plans of the same world size and context, pairwise: does the predicted order agree?

    A pair is `decided` when the measured times differ by more than both plans' noise.
    """
    out = []
    for a, b in combinations(rows, 2):
        if (a["world"], a["seq_len"], a.get("checkpointing")) != (b["world"], b["seq_len"],
                                                                 b.get("checkpointing")):
            continue
        ma, mb = a["measured_step_s"], b["measured_step_s"]
        gap = abs(ma - mb) / min(ma, mb)
        out.append({"faster_measured": a["plan"] if ma < mb else b["plan"],
                    "slower_measured": b["plan"] if ma < mb else a["plan"],
                    "world": a["world"], "seq_len": a["seq_len"],
                    "checkpointing": a.get("checkpointing"), "gap": gap,
                    "decided": gap > a["noise"] + b["noise"],
                    "agrees": (ma < mb) == (a["predicted_step_s"] < b["predicted_step_s"])})
    return out
