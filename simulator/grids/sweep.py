"""A sweep: the planner over models x context lengths x GPU counts, as one table and four plots.

The question a sweep answers is where each plan family stops winning, so the table keeps the best
plan of every family (dp, cp, bp, csbp) per point, scored by one engine, and the plots read it:
tokens/s vs context per family, speedup over the no-BP baseline, peak memory, and the decision
map (`map_plot`) of the same searches as the crossover chart. The searches themselves are
`grid.search_cells`, which `csbp map` shares.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from itertools import product
from pathlib import Path

import pandas as pd

from csbp.simulator.grids.grid import Cell, CellSearch, search_cells
from csbp.simulator.system.hardware import HardwareProfile
from csbp.simulator.plan.plan import AXES
from csbp.simulator.planner.planner import FAMILIES, fmt_tokens, label_of

COLUMNS = ("model", "seq_len", "gpus", "nodes", "family", "feasible", "plan", "tokens_per_s",
           "step_time_s", "peak_memory_gib", "attention_traffic_gib_per_gpu", "exposed_comm_s",
           "engine", "winner", "speedup_over_baseline", "baseline_plan")


def rows(answer: CellSearch) -> list[dict]:
    """One row per family: the family's best plan at the cell, or why it has none."""
    point, found = answer.cell, answer.found
    best = found.best_per_family() if found else {}
    base = found.baseline if found else None
    out = []
    for fam in FAMILIES:
        r = best.get(fam)
        row = {"model": point.model, "seq_len": point.seq_len, "gpus": point.gpus,
               "nodes": answer.nodes, "family": fam, "feasible": r is not None,
               "plan": label_of(r) if r else answer.reason or "no feasible plan",
               "engine": r.engine if r else None,
               "winner": bool(r is not None and r is found.recommended),
               "baseline_plan": label_of(base) if base else None,
               "speedup_over_baseline": r.tokens_per_s / base.tokens_per_s if r and base else None}
        for key in ("tokens_per_s", "step_time_s", "peak_memory_gib", "attention_traffic_gib_per_gpu",
                    "exposed_comm_s"):
            row[key] = getattr(r, key) if r else None
        out.append(row)
    return out


def sweep_table(answers: list[CellSearch]) -> pd.DataFrame:
    """The sweep's view of the grid search (`grid.search_cells`, shared with `csbp map`)."""
    return pd.DataFrame([row for a in answers for row in rows(a)], columns=list(COLUMNS))


def run_sweep(grid: list[Cell], profile: HardwareProfile, *, block_size: int, engine: str,
              axes: tuple[str, ...] = AXES, jobs: int = 1,
              on_point: Callable[[Cell], None] = lambda p: None) -> pd.DataFrame:
    """The planner at every cell, one row per family."""
    return sweep_table(search_cells(grid, profile, block_size=block_size, engine=engine, axes=axes,
                                    jobs=jobs, on_done=on_point))


def save_table(df: pd.DataFrame, out_dir: Path, stem: str = "sweep") -> list[Path]:
    """CSV always; Parquet too when pyarrow (or fastparquet) is installed (not a dependency)."""
    paths = [out_dir / f"{stem}.csv"]
    df.to_csv(paths[0], index=False)
    if importlib.util.find_spec("pyarrow") or importlib.util.find_spec("fastparquet"):
        paths.append(out_dir / f"{stem}.parquet")
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
    return save_figure(fig, path)


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
    return save_figure(fig, path)


def plot_sweep(df: pd.DataFrame, out_dir: Path, memory_gib: float, cells: pd.DataFrame) -> list[Path]:
    """The per-family charts of `df`, and the decision map of `cells` (`decision_map.map_table`
    of the same searches) as the crossover chart."""
    import matplotlib

    from csbp.simulator.grids.map_plot import draw_map

    matplotlib.use("Agg")
    return [
        _per_family(df, "tokens_per_s", "tokens/s (best plan of the family)", out_dir / "tokens_per_s.png"),
        _speedup(df, out_dir / "speedup.png"),
        _per_family(df, "peak_memory_gib", "peak memory per GPU (GiB),\nfastest plan of the family",
                    out_dir / "peak_memory.png", hline=memory_gib),
        draw_map(cells, out_dir / "crossover.png"),
    ]


def save_figure(fig, path: Path) -> Path:
    """Lay out, write and free one figure: every sweep chart ends the same way."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
