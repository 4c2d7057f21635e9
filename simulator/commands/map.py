"""`csbp map`: the decision map of one model on one hardware profile, context x GPU count."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
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

DEFAULT_SEQ_LENS = "64k,128k,256k,512k,1m"
DEFAULT_GPUS = "8,16,32,64,128,256,512,1024"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("map", help="decision map: the winning plan family and BP's speedup per context x GPUs",
                       description="Run `csbp plan` at every context length x GPU count for one model "
                                   "and hardware profile (the same cell search as `csbp sweep`) and "
                                   "save the map: CSV (and Parquet when pyarrow is installed), a "
                                   "heatmap PNG (colour = recommended family, label = speedup of the "
                                   "best BP plan over the best plan without BP, hatched = nothing "
                                   "fits) and a paragraph on where the crossovers are.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or path to a Hugging Face config.json")
    add_grid_args(p, seq_lens=DEFAULT_SEQ_LENS, gpus=DEFAULT_GPUS, out_dir="map",
                  out_help="where the table, heatmap and reading go", unit="cell",
                  json_help="print one JSON object (cells, reading, files)")
    p.add_argument("--objectives", default=None, metavar="A,B,...",
                   help="compare objectives on this cluster instead (e.g. ar,bd3lm): each cell "
                        "planned once per objective; a table of each one's best plan and tokens/s "
                        "and its ratio to the first objective's (CSV, no heatmap)")
    p.set_defaults(func=run)


def slug(text: str) -> str:
    """A file-name-safe form of a model or profile name."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def run(args: argparse.Namespace) -> int:
    from csbp.simulator.grids.decision_map import map_table  # pandas: slow import
    from csbp.simulator.workload.presets import load_model
    from csbp.simulator.grids.sweep import save_table

    model_name = load_model(args.model).name
    if args.objectives:
        return run_objectives(args, model_name)
    start = time.perf_counter()
    found = search_grid(args, [args.model], f"mapping {model_name} on " + "{profile}",
                        lambda cell: cell_text(cell, with_model=False))
    answers, what_if, out_dir, jobs = found.answers, found.what_if, found.out_dir, found.jobs
    profile, log = what_if.profile, console(stderr=True)
    seconds = time.perf_counter() - start
    df = map_table(answers, profile.name)
    stem = f"map-{slug(model_name)}-{slug(profile.name)}"
    files = save_table(df, out_dir, stem)
    command = command_line(args.model, args.hardware, what_if.spec, args.seq_lens, args.gpus, args.engine)
    reading, views = write_views(df, out_dir, stem, command, what_if.lines())
    files += views
    log.print(f"mapped {found.cells} cells in {seconds:.1f} s ({jobs} jobs)", highlight=False)
    if args.json:
        print_json({"model": model_name, "hardware": profile.name, "engine": args.engine,
                    "what_if": what_if.to_json(), "implementation": what_if.profile.implementation,
                    "reading": reading,
                    "cells": df.astype(object).where(df.notna(), None).to_dict("records"),
                    "files": [str(f) for f in files]})
        return 0
    out = console()
    out.print(_grid_table(df, model_name, profile.name))
    for line in what_if.lines():
        out.print(line, highlight=False)
    out.print(reading, highlight=False)
    for f in files:
        out.print(f"wrote {f}", highlight=False)
    return 0


def run_objectives(args: argparse.Namespace, model_name: str) -> int:
    """`csbp map --objectives`: the same cell search once per objective, side by side."""
    from csbp.simulator.grids.decision_map import objective_cell_text, objective_table
    from csbp.simulator.grids.grid import split_list
    from csbp.simulator.grids.sweep import save_table

    objectives = split_list(args.objectives, "objectives")
    start = time.perf_counter()
    found = search_grid(args, [args.model], f"mapping {model_name} ({', '.join(objectives)}) on " + "{profile}",
                        lambda cell: cell_text(cell, with_model=False), objectives=objectives)
    profile = found.what_if.profile
    df = objective_table(found.answers, profile.name)
    files = save_table(df, found.out_dir, f"map-{slug(model_name)}-{slug(profile.name)}-objectives")
    console(stderr=True).print(f"mapped {found.cells} cells in {time.perf_counter() - start:.1f} s "
                               f"({found.jobs} jobs)", highlight=False)
    if args.json:
        print_json({"model": model_name, "hardware": profile.name, "engine": args.engine,
                    "objectives": objectives, "what_if": found.what_if.to_json(),
                    "implementation": profile.implementation,
                    "cells": df.astype(object).where(df.notna(), None).to_dict("records"),
                    "files": [str(f) for f in files]})
        return 0
    out = console()
    lengths, counts = sorted(df.seq_len.unique()), sorted(df.gpus.unique())
    table = Table(title=f"Objectives on {profile.name}: {model_name}, best plan's tokens/s "
                        f"(ratio to {objectives[0]})", box=box.SIMPLE_HEAD)
    table.add_column("GPUs", justify="right")
    for L in lengths:
        table.add_column(fmt_tokens(int(L)), justify="left")
    for g in reversed(counts):
        table.add_row(str(g), *(objective_cell_text(df[(df.gpus == g) & (df.seq_len == L)]) for L in lengths))
    out.print(table)
    for f in files:
        out.print(f"wrote {f}", highlight=False)
    return 0


def command_line(model: str, hardware: str, what_if: str, seq_lens: str, gpus: str, engine: str) -> str:
    return (f"csbp map --model {model} --hardware {hardware}" + (f" --what-if {what_if}" if what_if else "")
            + f" --seq-lens {seq_lens} --gpus {gpus} --engine {engine}")


def write_views(df: pd.DataFrame, out_dir: Path, stem: str, command: str,
                what_if_lines: list[str]) -> tuple[str, list[Path]]:
    """The heatmap and the reading (markdown) of a map table: what `csbp map` writes after its
    search, and what `experiments/maps.py --redraw` writes again from a saved CSV."""
    from csbp.simulator.grids.map_plot import draw_map
    from csbp.simulator.grids.map_reading import read_map

    model, hardware = df.model.iloc[0], df.hardware.iloc[0]
    png = draw_map(df, out_dir / f"{stem}.png", f" on {hardware}")
    reading = read_map(df)
    lines = [f"# Decision map: {model} on {hardware}", "", f"`{command}`", ""]
    lines += [f"- {line}" for line in what_if_lines] + ([""] if what_if_lines else [])
    md = out_dir / f"{stem}.md"
    md.write_text("\n".join(lines + [reading, "", f"![map]({png.name})"]) + "\n")
    return reading, [png, md]


def _grid_table(df: pd.DataFrame, model: str, hardware: str) -> Table:
    from csbp.simulator.grids.decision_map import cell_text

    lengths, counts = sorted(df.seq_len.unique()), sorted(df.gpus.unique())
    table = Table(title=f"Decision map: {model} on {hardware} (recommended family; best BP / best no-BP)",
                  box=box.SIMPLE_HEAD)
    table.add_column("GPUs", justify="right")
    for L in lengths:
        table.add_column(fmt_tokens(int(L)), justify="left")
    cellsby = df.set_index(["gpus", "seq_len"])
    for g in reversed(counts):
        row = []
        for L in lengths:
            r = cellsby.loc[(g, L)]
            row.append(f"{r.family_label} {cell_text(r)}" if r.feasible else "[dim]none fits[/]")
        table.add_row(str(g), *row)
    return table
