"""Flags and the searching step shared by `csbp sweep` and `csbp map`: one cell search, two views.

Both commands plan every (model, context, GPU count) cell the same way, so they take the same
grid flags and run the same progress-barred search; only what they draw from it differs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from csbp.simulator.commands.cli_args import DEFAULT_HARDWARE, add_linear_dtype_arg, add_what_if_arg, profile_from_args
from csbp.simulator.commands.plan import console, parse_axes
from csbp.simulator.errors import InputError
from csbp.simulator.plan.plan import AXES
from csbp.simulator.planner.planner import available_cores, fmt_tokens


def add_grid_args(p: argparse.ArgumentParser, *, seq_lens: str, gpus: str, out_dir: str,
                  out_help: str, unit: str, json_help: str) -> None:
    """The grid's flags after the model flag(s); `unit` names a cell in the help texts."""
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help="profile name or YAML path")
    add_what_if_arg(p)
    p.add_argument("--seq-lens", default=seq_lens, help="comma-separated context lengths")
    p.add_argument("--gpus", default=gpus, help="comma-separated GPU counts (whole nodes)")
    p.add_argument("--block-size", type=int, default=256, help="diffusion block size b")
    add_linear_dtype_arg(p)
    p.add_argument("--axes", default=",".join(AXES), help="axes the search may use (default: all)")
    p.add_argument("--engine", default="des", choices=["des", "closed-form"],
                   help=f"engine of the final ranking in each {unit}, as in csbp plan (closed-form: fastest)")
    p.add_argument("--jobs", type=int, default=None, help=f"{unit}s planned in parallel (default: all cores)")
    p.add_argument("--out-dir", default=out_dir, help=out_help)
    p.add_argument("--json", action="store_true", help=json_help)


@dataclass
class Searched:
    """What both views start from: the cells' answers and the (possibly scaled) profile."""

    answers: list
    what_if: object  # cli_args' what-if result: .profile, .lines(), .to_json(), .spec
    out_dir: Path
    cells: int
    jobs: int


def search_grid(args: argparse.Namespace, models: list[str], title: str, describe,
                objectives: list[str | None] | None = None) -> Searched:
    """Check the flags, then plan every cell with a progress bar on stderr. `title` may name the
    profile as `{profile}` (it is known only once the what-if is applied); `describe(cell)` is
    the bar's text once a cell is done."""
    from csbp.simulator.grids.grid import cells, search_cells, split_list

    jobs = available_cores() if args.jobs is None else args.jobs
    if jobs < 1:
        raise InputError(f"--jobs {jobs}: must be at least 1")
    axes = parse_axes(args.axes)
    what_if = profile_from_args(args)
    profile = what_if.profile
    if args.linear_dtype == "fp8":  # refused once, in one line, not per cell
        profile.gpu.gemm_rate(fp8=True)
    grid = cells(models, split_list(args.seq_lens, "seq-lens"), split_list(args.gpus, "gpus"),
                 profile, args.block_size, objectives or (None,), linear_dtype=args.linear_dtype)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console(stderr=True), transient=args.json) as bar:
        task = bar.add_task(title.replace("{profile}", profile.name), total=len(grid))

        def done(cell) -> None:
            bar.update(task, advance=1, description=describe(cell))

        answers = search_cells(grid, profile, block_size=args.block_size, engine=args.engine,
                               axes=axes, jobs=jobs, on_done=done, linear_dtype=args.linear_dtype)
    return Searched(answers, what_if, out_dir, len(grid), jobs)


def cell_text(cell, with_model: bool) -> str:
    where = f"{fmt_tokens(cell.seq_len)} on {cell.gpus} GPUs"
    if getattr(cell, "objective", None):
        where = f"{cell.objective} {where}"
    return f"{cell.model} {where}" if with_model else where
