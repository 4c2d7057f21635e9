"""`csbp experiments run [NAME|all]` and `csbp experiments list`: regenerate the CSBP studies."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from csbp.experiments import STUDIES, load
from csbp.experiments.report import section, write_csv, write_summary

RESULTS = Path(__file__).resolve().parent / "results"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiments", help="regenerate the CSBP studies (tables and plots)",
                       description="Run the studies of the CSBP paper from the planner's own choices: "
                                   "CSV per study, summary.md and PNG plots under experiments/results/.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    runp = actions.add_parser("run", help="run one study (name or letter) or all")
    runp.add_argument("name", nargs="?", default="all", help=f"all | {' | '.join(STUDIES)}")
    runp.add_argument("--out", default=str(RESULTS), help="results folder (default experiments/results)")
    runp.add_argument("--jobs", type=int, default=None, help="processes per search (default: all cores)")
    from csbp.simulator.commands.cli_args import add_implementation_arg

    add_implementation_arg(runp)
    actions.add_parser("list", help="list the studies")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "list":
        for name in STUDIES:
            print(f"{name:12s} {load(name).TITLE}")
        return 0
    from csbp.experiments.runner import Runner

    studies = [load(n) for n in (STUDIES if args.name == "all" else [args.name])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from csbp.simulator.system.implementation import DEFAULT_IMPLEMENTATION, load_implementation

    implementation = getattr(args, "implementation", DEFAULT_IMPLEMENTATION)
    load_implementation(implementation)  # bad input: one line before any study runs
    runner = Runner(workers=args.jobs, implementation=implementation)
    sections, begin = [], time.perf_counter()
    for study in studies:
        start = time.perf_counter()
        result = study.run(runner, out)
        write_csv(out / f"{study.NAME}.csv", result.rows)
        seconds = time.perf_counter() - start
        sections.append(section(study, result, seconds))
        print(f"{study.NAME}: {len(result.rows)} rows in {seconds:.0f} s", flush=True)
    total = time.perf_counter() - begin
    write_summary(out / "summary.md", sections, total)
    print(f"wrote {out / 'summary.md'} in {total:.0f} s")
    return 0
