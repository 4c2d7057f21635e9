"""A sweep: the planner over models x context lengths x GPU counts, as one table and four plots.

The question a sweep answers is where each plan family stops winning, so the table keeps the best
plan of every family (dp, cp, bp, csbp) per point, scored by one engine, and the plots read it:
tokens/s vs context per family, speedup over the no-BP baseline, peak memory, and a crossover map
of the winning family over context x GPU count.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import pandas as pd

from csbp.simulator.cli_args import add_workload_args, inputs_from_args
from csbp.simulator.errors import InputError
from csbp.simulator.hardware import HardwareProfile
from csbp.simulator.planner import FAMILIES, Search, fmt_tokens, label_of, search
from csbp.simulator.workload import parse_tokens

COLUMNS = ("model", "seq_len", "gpus", "nodes", "family", "feasible", "plan", "tokens_per_s",
           "step_time_s", "peak_memory_gib", "attention_traffic_gib_per_gpu", "exposed_comm_s",
           "engine", "winner", "speedup_over_baseline", "baseline_plan")


@dataclass(frozen=True)
class Point:
    """One planner run of the sweep."""

    model: str
    seq_len: int
    gpus: int


def split_list(text: str, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise InputError(f"--{what}: give a comma-separated list")
    return items


def points(models: Iterable[str], seq_lens: Iterable[str], gpus: Iterable[str],
           profile: HardwareProfile) -> list[Point]:
    """The grid, validated before any work starts: a bad name fails now, not an hour in."""
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
    lengths = []
    for s in seq_lens:
        try:
            lengths.append(parse_tokens(s))
        except ValueError as err:
            raise InputError(str(err)) from None
    grid = [Point(m, L, n) for m in models for L in lengths for n in counts]
    for m in models:  # unknown model or seq-len / block-size mismatch: one line, exit 2
        for L in lengths:
            workload_inputs(m, L, _workload_defaults())
    return grid


def _workload_defaults() -> argparse.Namespace:
    """The shared workload flags' defaults, so a sweep point means what `csbp plan` means."""
    parser = argparse.ArgumentParser(add_help=False)
    add_workload_args(parser)
    return parser.parse_args([])


def workload_inputs(model: str, seq_len: int, flags: argparse.Namespace):
    return inputs_from_args(argparse.Namespace(**vars(flags) | {"model": model, "seq_len": seq_len}))


def rows(point: Point, found: Search | None, reason: str = "") -> list[dict]:
    """One row per family: the family's best plan, or why it has none."""
    best = found.best_per_family() if found else {}
    base = found.baseline if found else None
    out = []
    for fam in FAMILIES:
        r = best.get(fam)
        row = {"model": point.model, "seq_len": point.seq_len, "gpus": point.gpus,
               "nodes": found.nodes if found else None, "family": fam, "feasible": r is not None,
               "plan": label_of(r) if r else reason or "no feasible plan",
               "engine": r.engine if r else None,
               "winner": bool(r is not None and r is found.recommended),
               "baseline_plan": label_of(base) if base else None,
               "speedup_over_baseline": r.tokens_per_s / base.tokens_per_s if r and base else None}
        for key in ("tokens_per_s", "step_time_s", "peak_memory_gib", "attention_traffic_gib_per_gpu",
                    "exposed_comm_s"):
            row[key] = getattr(r, key) if r else None
        out.append(row)
    return out


def run_sweep(grid: list[Point], profile: HardwareProfile, *, block_size: int, engine: str,
              on_point: Callable[[Point], None] = lambda p: None) -> pd.DataFrame:
    """The planner at every point; a point where nothing fits is data, not an error."""
    flags = _workload_defaults()
    flags.block_size = block_size
    table: list[dict] = []
    for point in grid:
        inputs = workload_inputs(point.model, point.seq_len, flags)
        nodes = point.gpus // profile.node.gpus_per_node
        try:
            found = search(inputs.model, inputs.workload, profile, nodes, engine=engine)
            table += rows(point, found)
        except InputError as err:  # nothing feasible at this point
            table += rows(point, None, reason=str(err))
        on_point(point)
    return pd.DataFrame(table, columns=list(COLUMNS))


def save_table(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    """CSV always; Parquet too when pyarrow (or fastparquet) is installed."""
    paths = [out_dir / "sweep.csv"]
    df.to_csv(paths[0], index=False)
    if importlib.util.find_spec("pyarrow") or importlib.util.find_spec("fastparquet"):
        paths.append(out_dir / "sweep.parquet")
        df.to_parquet(paths[-1], index=False)
    return paths


# ---- plots ---------------------------------------------------------------------------------------

FAMILY_COLORS = {"dp": "tab:gray", "cp": "tab:blue", "bp": "tab:orange", "csbp": "tab:green"}


def _context_axis(ax, seq_lens) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(seq_lens), [fmt_tokens(int(L)) for L in sorted(seq_lens)])
    ax.minorticks_off()
    ax.set_xlabel("context length")


def _per_family(df: pd.DataFrame, column: str, ylabel: str, path: Path, hline: float | None = None) -> Path:
    """A panel per model (rows) and GPU count (columns): `column` vs context, a line per family."""
    import matplotlib.pyplot as plt

    models, counts = list(dict.fromkeys(df.model)), sorted(df.gpus.unique())
    fig, axes = plt.subplots(len(models), len(counts), figsize=(4.5 * len(counts), 3.4 * len(models)),
                             squeeze=False)
    for (i, model), (j, gpus) in product(enumerate(models), enumerate(counts)):
        ax, sub = axes[i][j], df[(df.model == model) & (df.gpus == gpus)]
        for fam in FAMILIES:
            line = sub[(sub.family == fam) & sub.feasible].sort_values("seq_len")
            if not line.empty:
                ax.plot(line.seq_len, line[column], "o-", label=fam, color=FAMILY_COLORS[fam])
        if hline is not None:
            ax.axhline(hline, color="red", ls="--", lw=1, label="GPU memory")
        _context_axis(ax, df.seq_len.unique())
        ax.set_title(f"{model}, {gpus} GPUs", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _speedup(df: pd.DataFrame, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    winners = df[df.winner]
    for (model, gpus), sub in winners.groupby(["model", "gpus"], sort=False):
        sub = sub.sort_values("seq_len")
        ax.plot(sub.seq_len, sub.speedup_over_baseline, "o-", label=f"{model}, {gpus} GPUs")
    ax.axhline(1.0, color="gray", lw=1)
    _context_axis(ax, df.seq_len.unique())
    ax.set_ylabel("speedup of the recommended plan\nover the best plan without BP")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _crossover(df: pd.DataFrame, path: Path) -> Path:
    """Which family wins at each (context, GPU count), one panel per model."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    models = list(dict.fromkeys(df.model))
    lengths, counts = sorted(df.seq_len.unique()), sorted(df.gpus.unique())
    cmap = ListedColormap(["white"] + [FAMILY_COLORS[f] for f in FAMILIES])
    width = max(4.0, 1.1 * len(lengths) + 1.5)
    fig, axes = plt.subplots(1, len(models), figsize=(width * len(models), 0.6 * len(counts) + 2),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        winners = df[(df.model == model) & df.winner].set_index(["gpus", "seq_len"]).family
        grid = [[FAMILIES.index(winners[(g, L)]) + 1 if (g, L) in winners.index else 0
                 for L in lengths] for g in counts]
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=len(FAMILIES), aspect="auto", origin="lower")
        for i, g in enumerate(counts):
            for j, L in enumerate(lengths):
                ax.text(j, i, winners.get((g, L), "none"), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [fmt_tokens(int(L)) for L in lengths])
        ax.set_yticks(range(len(counts)), [str(g) for g in counts])
        ax.set_xlabel("context length")
        ax.set_ylabel("GPUs")
        ax.set_title(f"winning family: {model}", fontsize=9)
    return _save(fig, path)


def plot_sweep(df: pd.DataFrame, out_dir: Path, memory_gib: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    return [
        _per_family(df, "tokens_per_s", "tokens/s (best plan of the family)", out_dir / "tokens_per_s.png"),
        _speedup(df, out_dir / "speedup.png"),
        _per_family(df, "peak_memory_gib", "peak memory per GPU (GiB),\nfastest plan of the family",
                    out_dir / "peak_memory.png", hline=memory_gib),
        _crossover(df, out_dir / "crossover.png"),
    ]


def _save(fig, path: Path) -> Path:
    """Lay out, write and free one figure: every sweep chart ends the same way."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
