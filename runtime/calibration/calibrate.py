"""`csbp calibrate`: measure this host and write a `kind: measured` hardware profile.

The command only: what is measured is `calibration_measurements`, how figures are fitted is
`profile_fit` (with `collective_fit` and `attention_fit`), and where the profile came from
(host, CPU, cores, torch, date: `host_identity`) is written into it, so that `csbp validate`
can tell when a profile describes another host.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml

from csbp.runtime.calibration.attention_fit import dense_attention_check
from csbp.runtime.calibration.calibration_measurements import STAGES, Measurements, measure
from csbp.runtime.calibration.collective_fit import residuals
from csbp.runtime.calibration.fit_figures import KIB
from csbp.runtime.calibration.profile_fit import fit_profile
from csbp.runtime.calibration.reference_speed import at_reference_speed
from csbp.runtime.calibration.sharing_fit import step_check
from csbp.simulator.errors import InputError
from csbp.simulator.system.hardware import PROFILE_DIR, HardwareProfile, load_profile
from csbp.simulator.report.report import print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this host into a hardware profile",
                       description="Run GEMM, attention, memory, core-sharing and gloo collective "
                                   "microbenchmarks on this host and write a measured profile.")
    p.add_argument("--out", default=None, help="profile path (default: hardware_profiles/NAME.yaml)")
    p.add_argument("--name", default="cpu-measured", help="profile name (default: cpu-measured)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (about 2 minutes on 2 cores; the full run about 6, more on a busy host)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    if not args.name.replace("-", "").replace("_", "").isalnum():
        raise InputError(f"bad profile name {args.name!r}: use letters, digits, '-' and '_'")
    out = Path(args.out) if args.out else PROFILE_DIR / f"{args.name}.yaml"
    if out.suffix not in (".yaml", ".yml"):
        raise InputError(f"{out}: the profile path must end in .yaml")
    if not out.parent.is_dir():
        raise InputError(f"{out.parent}: no such directory")
    console = Console(stderr=True)
    labels = list(STAGES)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("calibrating", total=len(labels))

        def step(label: str) -> None:
            progress.update(task, description=label, completed=labels.index(label))

        m = at_reference_speed(measure(args.quick, step))  # one-process timings at the probe's median speed
    raw = fit_profile(m, args.name)
    out.write_text(_header(m) + yaml.safe_dump(raw, sort_keys=False, width=100,
                                                default_flow_style=None))
    profile = load_profile(str(out))
    rows = residuals(profile, m)
    errors = sorted(abs(r["alpha_beta_error"]) for r in rows)
    check = dense_attention_check(profile, m)
    sharing = step_check(profile, m)
    summary = {"profile": str(out), "name": args.name, "host": m.identity.host,
               "date": m.identity.date, "load": m.load, "measured_on": m.identity.as_profile_fields(),
               "attention_fit_median_abs_error": statistics.median(abs(r["error"]) for r in check)
               if check else None,
               "attention_fit_max_abs_error": max(abs(r["error"]) for r in check) if check else None,
               "attention_fit": check,
               # the one-process step with R processes at once, priced by the sharing figures
               "sharing_check": sharing,
               "peak_tflops": profile.gpu.peak_tflops, "cores": profile.node.cores,
               # the table reproduces its own points; the alpha-beta fit is what the check is of
               "collective_fit_median_abs_error": statistics.median(errors),
               "collective_fit_max_abs_error": errors[-1], "collective_fit": rows}
    if args.json:
        print_json(summary)
    else:
        _print_summary(console, profile, summary)
    return 0


def _header(m: Measurements) -> str:
    who = m.identity
    return (f"# csbp hardware profile measured by `csbp calibrate` on {who.host} ({who.cpu_model}, "
            f"{who.cpus} CPUs, torch {who.torch}), {who.date}.\n"
            "# Every figure's source names the measurement it came from; rerun the command to refresh.\n"
            "# Field meanings and units: hardware_profiles/README.md.\n\n")


def _print_summary(console, profile: HardwareProfile, summary: dict) -> None:
    from rich.table import Table

    out = console.__class__()  # stdout
    out.print(f"wrote {summary['profile']} (host {summary['host']}, load {summary['load']})")
    out.print(f"peak {profile.gpu.peak_tflops * 1e3:.1f} GFLOP/s per rank, copy "
              f"{profile.gpu.hbm_gbs:.1f} GB/s, {profile.node.cores:.2f} cores shared by the ranks")
    table = Table(title="gloo collectives: measured calls (the profile's table) vs the alpha-beta fit")
    for col in ("world", "op", "bytes", "measured", "table", "alpha-beta", "error"):
        table.add_column(col, justify="right")
    for r in summary["collective_fit"]:
        table.add_row(str(r["world"]), r["op"], f"{r['bytes'] // KIB} KiB", f"{r['measured_s'] * 1e3:.2f} ms",
                      f"{r['predicted_s'] * 1e3:.2f} ms", f"{r['alpha_beta_s'] * 1e3:.2f} ms",
                      f"{r['alpha_beta_error']:+.0%}")
    out.print(table)
    out.print(f"alpha-beta fit (group sizes without a table): median |error| "
              f"{summary['collective_fit_median_abs_error']:.0%}, max "
              f"{summary['collective_fit_max_abs_error']:.0%}")
    if summary["sharing_check"]:
        out.print("ranks sharing the host, the one-process step (L = 256) with R processes at once, "
                  "measured vs priced by node.rank_speed: " + ", ".join(
                      f"R = {r['ranks']} {r['measured_s'] * 1e3:.0f} / {r['predicted_s'] * 1e3:.0f} ms "
                      f"({r['error']:+.0%})" for r in summary["sharing_check"]))
