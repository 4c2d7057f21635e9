"""`csbp validate`: run a suite of plans for real on this host and compare with the simulator.

For DP, CP, pure BP and CSBP at world sizes 2 and 4 and two context lengths of a small model
(`validation_suite`), the runtime measures step time, attention bytes and peak memory
(`validation_runs`, with the calibration's reference probe timed between rounds; both
activation-checkpointing settings, peak memory as allocated bytes) and
`simulate()` predicts them on a measured profile of this host. The report
(`validation_report`): per-plan error raw and normalised by the probe (host drift taken out),
median and max of both, the mean error per world size and per plan family (a host model that
gets how ranks share the host wrong is off for every plan of one world size alike; the summary
names the worst group), run-to-run noise and host drift beside them, whether the predicted
order of plans matches the measured one wherever two plans differ by more than the noise, exact
byte equality, and a predicted-vs-measured plot (`validation_plot`). Before anything runs it
says when the profile was measured on another host, with another torch, or long ago
(`host_identity`): then the errors are the hosts' difference, and `csbp calibrate` comes first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from csbp.runtime.validation.validation_report import compare
from csbp.runtime.validation.validation_runs import steps_for
from csbp.runtime.validation.validation_suite import VALIDATION_MODEL, Case, suite
from csbp.simulator.errors import InputError

DEFAULT_PROFILE = "cpu-measured"


def predict(case: Case, profile) -> object:
    from csbp.simulator.engine.simulate import simulate

    # overlap off: the runtime calls gloo in the training thread, so every exchange blocks the
    # rank (nothing computes while K/V or gradients move), which is what overlap=False prices
    host = profile.on_one_host(case.plan.world).model_copy(update={"implementation": "csbp-runtime"})
    return simulate(VALIDATION_MODEL, case.workload, case.plan, host,
                    nodes=1, engine="des", overlap=False)


# ---- CLI ----------------------------------------------------------------------------------------

def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="run plans on this host and compare with predictions",
                       description="Run DP, CP, pure BP and CSBP at world sizes 2 and 4, two "
                                   "context lengths and both checkpointing settings, and compare "
                                   "measured step time, attention bytes and peak memory "
                                   "(allocated bytes on both sides) with the simulator's "
                                   "predictions. "
                                   "Errors are given raw and normalised by a reference step "
                                   "timed between rounds (the host's drift since calibration "
                                   "taken out); a profile from another host, torch or more than "
                                   "a week ago is warned about.")
    p.add_argument("--quick", action="store_true",
                   help="4 plans, one short context, one warm-up and one measured step: checks bytes, "
                        "memory and the report (CI)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"hardware profile of this host (default {DEFAULT_PROFILE}; `csbp calibrate` writes it)")
    p.add_argument("--steps", type=int, default=None,
                   help="measured steps per run at least (default 3, quick 1); a plan with a short "
                        "step runs more, to measure 2.5 s (not under --quick)")
    p.add_argument("--repeats", type=int, default=None,
                   help="independent runs per plan, for the noise (default 3, quick 1)")
    p.add_argument("--plot", default="validation.png", help="PNG path (default validation.png)")
    p.add_argument("--timeout", type=float, default=1800,
                   help="seconds a collective may wait, and a round may go without progress (default 1800)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from csbp.runtime.calibration.host_identity import loadavg, profile_warnings, this_host
    from csbp.runtime.training.launch import RunFailed
    from csbp.simulator.system.hardware import load_profile
    from csbp.simulator.report.report import print_json

    steps = args.steps if args.steps is not None else (1 if args.quick else 3)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if steps < 1 or repeats < 1:
        raise InputError("--steps and --repeats must be at least 1")
    if args.timeout <= 0:
        raise InputError("--timeout must be positive")
    plot_path = Path(args.plot)
    if plot_path.suffix != ".png" or not plot_path.parent.is_dir():
        raise InputError(f"{plot_path}: the plot must be a .png in an existing directory")
    profile = load_profile(args.profile)
    console = Console(stderr=True)
    here = this_host()
    warnings = profile_warnings(profile, here)
    for line in warnings:  # one line each, however narrow the terminal (like `csbp: error:`)
        print(f"csbp: warning: {line}", file=sys.stderr, flush=True)
    cases = suite(args.quick)
    # predicted first: a short plan measures more steps (validation_runs.steps_for); --quick
    # keeps its one step (it checks bytes, memory and the report, not time)
    predictions = [predict(c, profile) for c in cases]
    per_case = steps if args.quick else steps_for([p.step_time_s for p in predictions], steps)
    load_before = loadavg()
    with console.status("running") as status:
        try:
            # warm-up: one at least, so the tracked memory peak (steps 0 and 1, memory_tracker)
            # includes a step with optimizer state, the steady state the model predicts
            runs = measure_suite(cases, repeats, per_case, 1 if args.quick else 2, args.timeout,
                                 lambda text: status.update(f"running: {text}"),
                                 profile.node.probe_step_s is not None)
        except RunFailed as err:  # a rank failed: one line, like `csbp run`
            console.print(f"csbp: error: {err}", highlight=False, markup=False)
            return 1
    report = compare(cases, runs, predictions, profile.node.probe_step_s)
    report |= {"profile_warnings": warnings, "this_host": here.as_profile_fields(),
               "profile": profile.name, "load": f"{load_before} -> {loadavg()}", "plot": str(plot_path),
               "model": VALIDATION_MODEL.name, "steps": steps, "steps_per_case": per_case, "repeats": repeats, "quick": args.quick}
    from csbp.runtime.validation.validation_plot import plot

    plot(report["rows"], plot_path, f"csbp validate on {profile.name}: step time")
    if args.json:
        print_json(report)
    else:
        _print_report(report)
    return 0


def measure_suite(cases: list[Case], repeats: int, steps: int, warmup: int, timeout_s: float,
                  progress, probing: bool):
    """The suite's runs, with the reference probe between rounds when the profile has one."""
    from csbp.runtime.calibration.microbench import probe_step_seconds
    from csbp.runtime.validation.validation_runs import measure

    return measure(cases, repeats, steps, warmup, timeout_s, progress,
                   probe_step_seconds if probing else None)


def _worst(group: dict | None, field: str) -> str:
    return f"; worst group {group['label']}: mean {group[field]:+.1%}" if group else ""


def _print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    normal = report["median_abs_normalised_error"] is not None
    table = Table(title=f"csbp validate: {report['model']} on profile {report['profile']}")
    for col in ("plan", "world", "L", "ckpt", "measured", "predicted", "error",
                *(("normalised",) if normal else ()), "noise", "attention bytes",
                "allocated peak meas / pred (MiB)", "mem error", "RSS (MiB)"):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        pred_mem = r["predicted_peak_memory_gib"]
        table.add_row(r["plan"], str(r["world"]), str(r["seq_len"]), r.get("checkpointing", ""),
                      f"{r['measured_step_s'] * 1e3:.0f} ms",
                      f"{r['predicted_step_s'] * 1e3:.0f} ms", f"{r['error']:+.1%}",
                      *((f"{r['normalised_error']:+.1%}",) if normal else ()), f"±{r['noise']:.1%}",
                      f"{r['attention_bytes_counted']:,} {'=' if r['bytes_equal'] else '≠'}",
                      f"{r['measured_peak_memory_gib'] * 1024:.1f} / "
                      + (f"{pred_mem * 1024:.1f}" if pred_mem else "-"),
                      f"{r['memory_error']:+.1%}" if r["memory_error"] is not None else "-",
                      f"{r['rss_peak_gib'] * 1024:.0f}")
    console = Console()
    console.print(table)
    groups = Table(title="mean step time error by world size and plan family (signed: > 0 predicted slower)")
    for col in ("group", "plans", "mean error", "mean |error|", *(("mean normalised",) if normal else ())):
        groups.add_column(col, justify="right")
    for g in report["groups"]:
        groups.add_row(g["label"], str(g["plans"]), f"{g['mean_error']:+.1%}", f"{g['mean_abs_error']:.1%}",
                       *((f"{g['mean_normalised_error']:+.1%}",) if normal else ()))
    console.print(groups)
    decided = [p for p in report["ranking_pairs"] if p["decided"]]
    console.print(f"step time error, raw: median {report['median_abs_error']:.1%}, max "
                  f"{report['max_abs_error']:.1%}; run-to-run noise (median) ±{report['noise']:.1%}"
                  + _worst(report["worst_group"], "mean_error"))
    if normal:
        console.print(f"step time error, normalised by the reference probe (host drift taken out): "
                      f"median {report['median_abs_normalised_error']:.1%}, max "
                      f"{report['max_abs_normalised_error']:.1%}; noise ±{report['normalised_noise']:.1%}"
                      + _worst(report["worst_normalised_group"], "mean_normalised_error"))
    console.print(f"ranking: {sum(p['agrees'] for p in decided)}/{len(decided)} pairs that differ by "
                  f"more than the noise in the measured order -> "
                  f"{'matches' if report['ranking_matches'] else 'does NOT match'}")
    console.print(f"attention bytes counted = predicted for every plan: {report['bytes_equal']}")
    if report.get("median_abs_memory_error") is not None:
        console.print(f"peak memory (allocated bytes, measured vs the timeline's live-tensor peak): "
                      f"median error {report['median_abs_memory_error']:.1%}, max "
                      f"{report['max_abs_memory_error']:.1%}; RSS shown beside it includes the "
                      "process's torch/gloo baseline and the heap's free lists")
    d = report.get("host_drift")
    if d:
        console.print(f"host speed since calibration: reference step {d['before']:+.1%} before the "
                      f"suite, {d['after']:+.1%} after, {d['min']:+.1%} to {d['max']:+.1%} over "
                      f"{len(report['probes'])} probes (> 0: slower now)")
    for line in report["profile_warnings"]:
        console.print(f"warning: {line}", highlight=False, markup=False, soft_wrap=True)
    console.print(f"load average {report['load']}; plot: {report['plot']}")
