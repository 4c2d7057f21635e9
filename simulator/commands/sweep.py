"""`csbp sweep`: the planner over lists of models, context lengths and GPU counts."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from csbp.simulator.cli_args import DEFAULT_HARDWARE, DEFAULT_MODEL, add_what_if_arg, profile_from_args
from csbp.simulator.commands.plan import console, parse_axes
from csbp.simulator.errors import InputError
from csbp.simulator.plan import AXES
from csbp.simulator.planner import available_cores, fmt_tokens
from csbp.simulator.report import print_json

if TYPE_CHECKING:
    import pandas as pd


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="plan every model x context x GPU count; table and plots",
                       description="Run the planner at every point of models x context lengths x GPU "
                                   "counts; save the best plan of each family (dp, cp, bp, csbp) per "
                                   "point as CSV (and Parquet when available) and plot tokens/s, "
                                   "speedup over the no-BP baseline, peak memory and a crossover map.")
    p.add_argument("--models", default=DEFAULT_MODEL, help="comma-separated presets or config.json paths")
    p.add_argument("--seq-lens", default="64k,128k,256k,512k", help="comma-separated context lengths")
    p.add_argument("--gpus", default="8,16", help="comma-separated GPU counts (whole nodes)")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help="profile name or YAML path")
    add_what_if_arg(p)
    p.add_argument("--block-size", type=int, default=256, help="diffusion block size b")
    p.add_argument("--axes", default=",".join(AXES), help="axes the search may use (default: all)")
    p.add_argument("--engine", default="des", choices=["des", "closed-form"],
                   help="engine of the final ranking at each point (closed-form: fastest)")
    p.add_argument("--jobs", type=int, default=None, help="points planned in parallel (default: all cores)")
    p.add_argument("--out-dir", default="sweep", help="where the table and plots go")
    p.add_argument("--json", action="store_true", help="print one JSON object (the rows and files)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from csbp.simulator.decision_map import map_table  # pandas: slow import
    from csbp.simulator.grid import cells, search_cells, split_list
    from csbp.simulator.sweep import plot_sweep, save_table, sweep_table

    jobs = available_cores() if args.jobs is None else args.jobs
    if jobs < 1:
        raise InputError(f"--jobs {jobs}: must be at least 1")
    axes = parse_axes(args.axes)
    what_if = profile_from_args(args)
    profile = what_if.profile
    grid = cells(split_list(args.models, "models"), split_list(args.seq_lens, "seq-lens"),
                 split_list(args.gpus, "gpus"), profile, args.block_size)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=log, transient=args.json) as bar:
        task = bar.add_task("planning", total=len(grid))
        def done(p) -> None:
            bar.update(task, advance=1, description=f"{p.model} {fmt_tokens(p.seq_len)} {p.gpus} GPUs")

        answers = search_cells(grid, profile, block_size=args.block_size, engine=args.engine,
                               axes=axes, jobs=jobs, on_done=done)
    df = sweep_table(answers)
    files = save_table(df, out_dir) + plot_sweep(df, out_dir, profile.gpu.memory_gib,
                                                 map_table(answers, profile.name))
    if args.json:
        print_json({"rows": df.astype(object).where(df.notna(), None).to_dict("records"),
                    "files": [str(f) for f in files], "what_if": what_if.to_json()})
        return 0
    out = console()
    out.print(_winners(df))
    for line in what_if.lines():
        out.print(line, highlight=False)
    for f in files:
        out.print(f"wrote {f}", highlight=False)
    return 0


def _winners(df: pd.DataFrame) -> Table:
    table = Table(title="Recommended plan per point", box=box.SIMPLE_HEAD)
    for col in ("model", "context", "GPUs", "plan", "family", "tokens/s", "vs baseline"):
        table.add_column(col, justify="right" if col in ("tokens/s", "vs baseline", "GPUs") else "left",
                         no_wrap=col in ("model", "plan"))
    for point, sub in df.groupby(["model", "seq_len", "gpus"], sort=False):
        win = sub[sub.winner]
        model, seq_len, gpus = point
        if win.empty:
            table.add_row(model, fmt_tokens(int(seq_len)), str(gpus), "[red]nothing feasible[/]", "", "", "")
            continue
        w = win.iloc[0]
        speedup = "no baseline" if math.isnan(w.speedup_over_baseline) else f"{w.speedup_over_baseline:.2f}x"
        table.add_row(model, fmt_tokens(int(seq_len)), str(gpus), w.plan, w.family,
                      f"{w.tokens_per_s:,.0f}", speedup)
    return table
