"""`csbp validate`: run a suite of plans for real on this host and compare with the simulator.

For DP, CP, pure BP and CSBP at world sizes 2 and 4 and two context lengths of a small model, the
runtime (`runtime.launch.spawn`, all plans of one world size in one process group) measures step
time, attention bytes and peak memory, and `simulate()` predicts them on a measured profile of
this host. The report: per-plan error, median and max error, run-to-run noise beside them,
whether the predicted order of plans matches the measured one wherever two plans differ by more
than the noise, exact byte equality, and a predicted-vs-measured plot.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from csbp.simulator.errors import InputError
from csbp.simulator.plan import Plan, parse_plan
from csbp.simulator.spec import AttentionSpec, ModelSpec
from csbp.simulator.workload import Workload

VALIDATION_MODEL = ModelSpec(
    name="validate-small", hidden=256, ffn=768, vocab=512,
    layers=(AttentionSpec(n_heads=4, n_kv_heads=2, head_dim=64),) * 2,
    source="csbp validate: a small dense GQA model whose CPU step (0.2-4 s at L = 512-1024) is "
           "dominated by arithmetic and collectives, not by per-op overhead or timer noise, yet "
           "the whole suite runs in minutes on 2 cores")
PLANS = {2: ("dp=2", "cp=2", "bp=2", "cp=2,bp=2"), 4: ("dp=4", "cp=4", "bp=4", "cp=4,bp=4")}
QUICK_PLANS = {2: ("cp=2", "cp=2,bp=2"), 4: ("cp=4", "cp=4,bp=4")}
SEQ_LENS, QUICK_SEQ_LENS = (512, 1024), (128,)
BLOCK = 32
DEFAULT_PROFILE = "cpu-measured"
GIB = 1024**3


@dataclass(frozen=True)
class Case:
    """One plan at one context length: what is run and what is predicted."""

    plan: Plan
    workload: Workload

    @property
    def label(self) -> str:
        return f"{self.plan.label()} L={self.workload.seq_len}"


def suite(quick: bool) -> list[Case]:
    plans, lengths = (QUICK_PLANS, QUICK_SEQ_LENS) if quick else (PLANS, SEQ_LENS)
    # fp32 is the CPU runtime's reference; zero_stage 0: the runtime replicates AdamW
    return [Case(parse_plan(p), Workload(seq_len=L, block_size=BLOCK, dtype="fp32", zero_stage=0))
            for world in sorted(plans) for L in lengths for p in plans[world]]


def measure(cases: list[Case], repeats: int, steps: int, warmup: int, timeout_s: float,
            progress) -> list[list[dict]]:
    """Run every case `repeats` times (interleaved, so drift hits all plans alike)."""
    from csbp.runtime.launch import spawn
    from csbp.runtime.train import Job, notes_for, summarize

    out: list[list[dict]] = [[] for _ in cases]
    worlds = sorted({c.plan.world for c in cases})
    for world in worlds:
        idx = [i for i, c in enumerate(cases) if c.plan.world == world]
        jobs = [Job(VALIDATION_MODEL, cases[i].workload, cases[i].plan, steps=steps, warmup=warmup)
                for _ in range(repeats) for i in idx]
        progress(f"world size {world}: {len(idx)} plans x {repeats} runs")
        reports = spawn(jobs, world, "cpu", timeout_s)
        for job, i, rep in zip(jobs, [i for _ in range(repeats) for i in idx], reports):
            out[i].append(summarize(job, rep, "cpu", notes_for(job, "cpu", world)))
    return out


def predict(case: Case, profile) -> object:
    from csbp.simulator.simulate import simulate

    # overlap off: the runtime calls gloo in the training thread, so every exchange blocks the
    # rank (nothing computes while K/V or gradients move), which is what overlap=False prices
    return simulate(VALIDATION_MODEL, case.workload, case.plan, profile.on_one_host(case.plan.world),
                    nodes=1, engine="des", overlap=False)


def relative_spread(values: list[float]) -> float:
    """Half the range over the median: how far one measurement may sit from another."""
    return (max(values) - min(values)) / 2 / statistics.median(values) if len(values) > 1 else 0.0


def compare(cases: list[Case], runs: list[list[dict]], predictions: list) -> dict:
    """Rows and summary figures of the report (errors are fractions of measured step time)."""
    rows = []
    for case, measured, pred in zip(cases, runs, predictions):
        medians = [r["step_time_s"] for r in measured]
        steps = [t for r in measured for t in r["step_times_s"]]
        step = statistics.median(medians)
        counted = [r["attention_bytes_counted"] for r in measured]
        layout = measured[0]["attention_bytes_predicted"]
        simulated = round(pred.attention_traffic_gib_per_gpu * GIB)
        mem = max(r["peak_memory_gib"] for r in measured)
        rows.append({
            "plan": case.plan.label(), "kind": case.plan.kind, "world": case.plan.world,
            "seq_len": case.workload.seq_len, "block_size": case.workload.block_size,
            "measured_step_s": step, "predicted_step_s": pred.step_time_s,
            "error": pred.step_time_s / step - 1,
            "noise": relative_spread(medians if len(medians) > 1 else steps),
            "runs_step_s": medians,
            "attention_bytes_counted": max(counted), "attention_bytes_layout": layout,
            "attention_bytes_simulated": simulated,
            "bytes_equal": all(c == layout == simulated for c in counted)
            and all(r["attention_bytes_match"] for r in measured),
            "measured_peak_memory_gib": mem, "predicted_peak_memory_gib": pred.peak_memory_gib,
            "memory_error": pred.peak_memory_gib / mem - 1 if pred.peak_memory_gib else None,
            "loss": measured[0]["loss"],
        })
    errors = sorted(abs(r["error"]) for r in rows)
    pairs = ranking_pairs(rows)
    return {
        "median_abs_error": statistics.median(errors), "max_abs_error": errors[-1],
        "noise": statistics.median(r["noise"] for r in rows),
        "bytes_equal": all(r["bytes_equal"] for r in rows),
        "ranking_matches": all(p["agrees"] for p in pairs if p["decided"]),
        "ranking_pairs": pairs, "rows": rows,
    }


def ranking_pairs(rows: list[dict]) -> list[dict]:
    """Plans of the same world size and context, pairwise: does the predicted order agree?

    A pair is `decided` when the measured times differ by more than both plans' noise.
    """
    out = []
    for a, b in combinations(rows, 2):
        if (a["world"], a["seq_len"]) != (b["world"], b["seq_len"]):
            continue
        ma, mb = a["measured_step_s"], b["measured_step_s"]
        gap = abs(ma - mb) / min(ma, mb)
        out.append({"faster_measured": a["plan"] if ma < mb else b["plan"],
                    "slower_measured": b["plan"] if ma < mb else a["plan"],
                    "world": a["world"], "seq_len": a["seq_len"], "gap": gap,
                    "decided": gap > a["noise"] + b["noise"],
                    "agrees": (ma < mb) == (a["predicted_step_s"] < b["predicted_step_s"])})
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Predicted vs measured step time, log-log, with the y = x line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    markers = {"dp": "o", "cp": "s", "bp": "^", "csbp": "D"}
    for world, color in ((2, "tab:blue"), (4, "tab:orange")):
        for kind, marker in markers.items():
            pts = [(r["measured_step_s"], r["predicted_step_s"]) for r in rows
                   if r["world"] == world and r["kind"] == kind]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, color=color, label=f"{kind}, world {world}")
    values = [v for r in rows for v in (r["measured_step_s"], r["predicted_step_s"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, label="y = x")
    ax.fill_between([lo, hi], [lo / 1.15, hi / 1.15], [lo * 1.15, hi * 1.15], color="0.9",
                    label="±15 %")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time (s)",
           ylabel="predicted step time (s)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- CLI ----------------------------------------------------------------------------------------

def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="run plans on this host and compare with predictions",
                       description="Run DP, CP, pure BP and CSBP at world sizes 2 and 4 and two "
                                   "context lengths, and compare measured step time, attention "
                                   "bytes and peak memory with the simulator's predictions.")
    p.add_argument("--quick", action="store_true",
                   help="4 plans, one short context, one step: checks bytes and the report (CI)")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help=f"hardware profile of this host (default {DEFAULT_PROFILE}; `csbp calibrate` writes it)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per run (default 3, quick 1)")
    p.add_argument("--repeats", type=int, default=None,
                   help="independent runs per plan, for the noise (default 3, quick 1)")
    p.add_argument("--plot", default="validation.png", help="PNG path (default validation.png)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per world size (default 1800)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from csbp.runtime.launch import RunFailed
    from csbp.runtime.microbench import probe_step_seconds
    from csbp.simulator.hardware import load_profile
    from csbp.simulator.report import print_json

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
    cases = suite(args.quick)
    load_before = _loadavg()
    probe_before = None if args.quick else probe_step_seconds()
    with console.status("running") as status:
        try:
            runs = measure(cases, repeats, steps, 0 if args.quick else 2, args.timeout,
                           lambda text: status.update(f"running: {text}"))
        except RunFailed as err:  # a rank failed: one line, like `csbp run`
            console.print(f"csbp: error: {err}", highlight=False, markup=False)
            return 1
        status.update("simulating")
        predictions = [predict(c, profile) for c in cases]
    report = compare(cases, runs, predictions)
    probe_after = None if args.quick else probe_step_seconds()
    report |= {"host_drift": _drift(profile, probe_before, probe_after),
               "profile": profile.name, "load": f"{load_before} -> {_loadavg()}", "plot": str(plot_path),
               "model": VALIDATION_MODEL.name, "steps": steps, "repeats": repeats, "quick": args.quick}
    plot(report["rows"], plot_path, f"csbp validate on {profile.name}: step time")
    if args.json:
        print_json(report)
    else:
        _print_report(report)
    return 0


def _drift(profile, before: float | None, after: float | None) -> dict | None:
    """The reference step now against its time when the profile was measured: how much slower
    (> 0) the host runs than it did then, before and after the suite. Predictions are not
    corrected by it; it says how much of the error the host's drift can explain."""
    then = profile.node.probe_step_s
    if then is None or before is None or after is None:
        return None
    return {"probe_step_s_at_calibration": then, "probe_step_s_before": before,
            "probe_step_s_after": after, "before": before / then - 1, "after": after / then - 1}


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"csbp validate: {report['model']} on profile {report['profile']}")
    for col in ("plan", "world", "L", "measured", "predicted", "error", "noise", "attention bytes",
                "peak memory meas / pred"):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        table.add_row(r["plan"], str(r["world"]), str(r["seq_len"]), f"{r['measured_step_s'] * 1e3:.0f} ms",
                      f"{r['predicted_step_s'] * 1e3:.0f} ms", f"{r['error']:+.1%}", f"±{r['noise']:.1%}",
                      f"{r['attention_bytes_counted']:,} {'=' if r['bytes_equal'] else '≠'}",
                      f"{r['measured_peak_memory_gib']:.2f} / {r['predicted_peak_memory_gib']:.2f} GiB")
    console = Console()
    console.print(table)
    decided = [p for p in report["ranking_pairs"] if p["decided"]]
    console.print(f"step time error: median {report['median_abs_error']:.1%}, max "
                  f"{report['max_abs_error']:.1%}; run-to-run noise (median) ±{report['noise']:.1%}")
    console.print(f"ranking: {sum(p['agrees'] for p in decided)}/{len(decided)} pairs that differ by "
                  f"more than the noise in the measured order -> "
                  f"{'matches' if report['ranking_matches'] else 'does NOT match'}")
    console.print(f"attention bytes counted = predicted for every plan: {report['bytes_equal']}")
    drift = report.get("host_drift")
    if drift:
        console.print(f"host speed since calibration: reference step {drift['before']:+.1%} before the "
                      f"suite, {drift['after']:+.1%} after (> 0: slower now; not corrected for)")
    console.print(f"load average {report['load']}; plot: {report['plot']}")
