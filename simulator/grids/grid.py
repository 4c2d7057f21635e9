"""The planner over a grid of cells (model x context x GPU count): the one search behind
`csbp sweep` and `csbp map`.

Both commands ask the same question at every cell — what does `csbp plan` answer here? — and
differ only in how they show it (the best plan of every family per cell, or the winner and its
speedup per cell). So the cells are validated, searched and, with `jobs > 1`, spread over
processes here once; the views read the resulting `Search` objects.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial

from csbp.simulator.commands.cli_args import add_workload_args, inputs_from_args
from csbp.simulator.errors import InputError
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.plan.plan import AXES
from csbp.simulator.planner.planner import Search, search
from csbp.simulator.workload.objectives import default_objective
from csbp.simulator.workload.presets import load_model
from csbp.simulator.workload.workload import parse_tokens


@dataclass(frozen=True)
class Cell:
    """One planner run of a grid: a model at one context length on one cluster size."""

    model: str
    seq_len: int
    gpus: int
    objective: str | None = None  # None: the model's own (`objectives.default_objective`)


@dataclass
class CellSearch:
    """What the planner answered at a cell: its search, or why nothing fits there."""

    cell: Cell
    nodes: int
    found: Search | None
    reason: str = ""  # when found is None: the planner's 'nothing feasible' line


def split_list(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"--{what}: give a comma-separated list")
    return items


def gpu_counts(gpus: Iterable[str], profile: HardwareProfile) -> list[int]:
    per_node = profile.node.gpus_per_node
    counts = []
    for g in gpus:
        try:
            n = int(g)
        except ValueError:
            raise InputError(f"--gpus: {g!r} is not a number") from None
        if n < 1 or n % per_node:
            raise InputError(f"impossible cluster: {n} GPUs is not a whole number of "
                             f"{per_node}-GPU {profile.name} nodes")
        counts.append(n)
    return counts


def cells(models: Iterable[str], seq_lens: Iterable[str], gpus: Iterable[str],
          profile: HardwareProfile, block_size: int = 256,
          objectives: Iterable[str | None] = (None,), linear_dtype: str | None = None) -> list[Cell]:
    """The grid, validated before any work starts: a bad name fails now, not an hour in.
    `objectives`: each cell planned once per objective (None: the model's own)."""
    objectives = list(objectives)
    models = list(models)
    counts = gpu_counts(gpus, profile)
    lengths = []
    for s in seq_lens:
        try:
            lengths.append(parse_tokens(s))
        except ValueError as err:
            raise InputError(str(err)) from None
    flags = workload_defaults(block_size, linear_dtype)
    for m in models:  # unknown model or seq-len / block-size mismatch: one line, exit 2
        for L in lengths:
            for o in objectives:
                workload_inputs(m, L, flags, o)
    return [Cell(m, L, n, o) for m in models for o in objectives for L in lengths for n in counts]


def workload_defaults(block_size: int = 256, linear_dtype: str | None = None) -> argparse.Namespace:
    """The shared workload flags' defaults, so a cell means what `csbp plan` means."""
    parser = argparse.ArgumentParser(add_help=False)
    add_workload_args(parser)
    flags = parser.parse_args([])
    flags.block_size = block_size
    flags.linear_dtype = linear_dtype  # --linear-dtype (None: the implementation's)
    return flags


def workload_inputs(model: str, seq_len: int, flags: argparse.Namespace, objective: str | None = None):
    over: dict = {"model": model, "seq_len": seq_len}
    if objective is not None:
        over["objective"] = objective
    if (objective or default_objective(load_model(model))) == "ar":
        over["block_size"] = None  # a causal sequence has no blocks: the grid's block size is not its
    return inputs_from_args(argparse.Namespace(**vars(flags) | over))


def search_cell(cell: Cell, profile: HardwareProfile, flags: argparse.Namespace, engine: str,
                axes: tuple[str, ...], workers: int | None) -> CellSearch:
    """`csbp plan` at one cell (same workload defaults, same search); nothing fitting is data."""
    inputs = workload_inputs(cell.model, cell.seq_len, flags, cell.objective)
    nodes = cell.gpus // profile.node.gpus_per_node
    try:
        # keep=1: the winner, the baseline and each family's best are exact, the rest may be
        # pruned; a cell reports no count of what does not fit (misfits=False: memory checked only
        # where the screen looks)
        found = search(inputs.model, inputs.workload, profile, nodes, engine=engine, axes=axes,
                       workers=workers, keep=1, misfits=False)
    except InputError as err:  # nothing feasible at this cell
        return CellSearch(cell, nodes, None, str(err))
    return CellSearch(cell, nodes, found)


def search_cells(grid: list[Cell], profile: HardwareProfile, *, block_size: int = 256,
                 engine: str = "des", axes: tuple[str, ...] = AXES, jobs: int = 1,
                 on_done: Callable[[Cell], None] = lambda c: None,
                 linear_dtype: str | None = None) -> list[CellSearch]:
    """The planner at every cell, in grid order.

    With `jobs > 1` the cells run in that many processes, each search on one core (cells are
    independent and many; one search's own pool would only add start-up per cell). The biggest
    cells start first so a long one does not begin last. Results do not depend on `jobs`.
    """
    job = partial(search_cell, profile=profile, flags=workload_defaults(block_size, linear_dtype), engine=engine,
                  axes=axes)
    if jobs < 2 or len(grid) < 2 or "fork" not in mp.get_all_start_methods():
        out = []
        for c in grid:  # one cell at a time: its own search may use the jobs
            out.append(job(c, workers=max(jobs, 1)))
            on_done(c)
        return out
    order = sorted(range(len(grid)), key=lambda i: -grid[i].gpus * grid[i].seq_len)
    found: dict[int, CellSearch] = {}
    with ProcessPoolExecutor(min(jobs, len(grid)), mp_context=mp.get_context("fork")) as pool:
        futures = {pool.submit(job, grid[i], workers=1): i for i in order}
        for fut in as_completed(futures):
            i = futures[fut]
            found[i] = fut.result()
            on_done(grid[i])
    return [found[i] for i in range(len(grid))]
