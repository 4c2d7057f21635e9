"""`csbp sweep`: the planner over lists of models, context lengths and GPU counts."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING
from rich import box
from rich.table import Table

from csbp.simulator.commands.cli_args import DEFAULT_MODEL
from csbp.simulator.commands.grid_args import add_grid_args, cell_text, search_grid
from csbp.simulator.commands.plan import console
from csbp.simulator.planner.planner import fmt_tokens
from csbp.simulator.report.report import print_json

if TYPE_CHECKING:
    import pandas as pd


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="plan every model x context x GPU count; table and plots",
                       description="Run the planner at every point of models x context lengths x GPU "
                                   "counts; save the best plan of each family (dp, cp, bp, csbp) per "
                                   "point as CSV (and Parquet when available) and plot tokens/s, "
                                   "speedup over the no-BP baseline, peak memory and a crossover map.")
    p.add_argument("--models", default=DEFAULT_MODEL, help="comma-separated presets or config.json paths")
    add_grid_args(p, seq_lens="64k,128k,256k,512k", gpus="8,16", out_dir="sweep",
                  out_help="where the table and plots go", unit="point",
                  json_help="print one JSON object (the rows and files)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from csbp.simulator.grids.decision_map import map_table  # pandas: slow import
    from csbp.simulator.grids.grid import split_list
    from csbp.simulator.grids.sweep import plot_sweep, save_table, sweep_table

    found = search_grid(args, split_list(args.models, "models"), "planning",
                        lambda cell: cell_text(cell, with_model=True))
    answers, what_if, out_dir = found.answers, found.what_if, found.out_dir
    profile = what_if.profile
    df = sweep_table(answers)
    files = save_table(df, out_dir) + plot_sweep(df, out_dir, profile.gpu.memory_gib,
                                                 map_table(answers, profile.name))
    if args.json:
        print_json({"rows": df.astype(object).where(df.notna(), None).to_dict("records"),
                    "files": [str(f) for f in files], "what_if": what_if.to_json(),
                    "implementation": what_if.profile.implementation})
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
