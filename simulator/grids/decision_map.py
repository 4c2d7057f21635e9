"""A decision map: per cell of context x GPU count, the plan `csbp plan` recommends and what BP buys.

The map is the second view of the grid search that `csbp sweep` tabulates by family
(`grid.search_cells`): the same `Search` per cell, read as the winner, its family (DP / CP / BP /
CSBP, with TP/EP when they are used), its tokens/s, and the speedup of the best plan with block
parallelism over the best plan without it — below 1 where BP loses, empty where one side has no
plan that fits. A cell where nothing fits keeps the planner's reasons.

With several objectives (`csbp map --objectives ar,bd3lm`) every cell is planned once per
objective and `objective_table` sets their best plans side by side: tokens/s (context tokens of
one sequence per step, L for every objective) and each one's ratio to the first objective's.
"""

from __future__ import annotations

import re

import pandas as pd

from csbp.simulator.grids.grid import CellSearch
from csbp.simulator.planner.planner import Search, family, fmt_tokens, label_of
from csbp.simulator.report.result import Result

FAMILY_NAMES = {"dp": "DP", "cp": "CP", "bp": "BP", "csbp": "CSBP"}
TIE = 1.005  # speedups within 0.5 % are ties, as `csbp plan` words them

COLUMNS = ("model", "hardware", "context", "seq_len", "gpus", "nodes", "feasible", "plan", "family",
           "family_label", "tokens_per_s", "step_time_s", "peak_memory_gib", "engine",
           "best_bp_plan", "best_bp_tokens_per_s", "best_no_bp_plan", "best_no_bp_tokens_per_s",
           "bp_speedup", "speedup", "reason")


def family_label(r: Result) -> str:
    """'CSBP+TP', 'CP+TP+EP', 'DP': the family with the model-parallel axes it adds."""
    extra = [a.upper() for a in ("tp", "ep") if r.plan.get(a, 1) > 1]
    return "+".join([FAMILY_NAMES[family(r.plan)], *extra])


def best_with_bp(found: Search) -> Result | None:
    """The best plan with bp > 1, scored by the same engine as the recommendation."""
    return next((r for r in found.ranked if r.plan["bp"] > 1 and r.engine == found.engine), None)


def short_reason(message: str) -> str:
    """'memory (200); rule: ... (12)' from the planner's 'nothing feasible ... candidates): ...' line."""
    text = message.split("candidates): ", 1)[-1]
    return re.split(r"; e\.g\. ", text, maxsplit=1)[0]


def cell_row(answer: CellSearch, hardware: str) -> dict:
    c, found = answer.cell, answer.found
    row = dict.fromkeys(COLUMNS)
    row |= {"model": c.model, "hardware": hardware, "context": fmt_tokens(c.seq_len),
            "seq_len": c.seq_len, "gpus": c.gpus, "nodes": answer.nodes, "feasible": found is not None}
    if found is None:
        return row | {"reason": short_reason(answer.reason)}
    rec, base, bp = found.recommended, found.baseline, best_with_bp(found)
    row |= {"plan": label_of(rec), "family": family(rec.plan), "family_label": family_label(rec),
            "tokens_per_s": rec.tokens_per_s, "step_time_s": rec.step_time_s,
            "peak_memory_gib": rec.peak_memory_gib, "engine": rec.engine, "speedup": found.speedup}
    if bp is not None:
        row |= {"best_bp_plan": label_of(bp), "best_bp_tokens_per_s": bp.tokens_per_s}
    if base is not None:
        row |= {"best_no_bp_plan": label_of(base), "best_no_bp_tokens_per_s": base.tokens_per_s}
    if bp is not None and base is not None:
        row["bp_speedup"] = bp.tokens_per_s / base.tokens_per_s
    return row


def map_table(answers: list[CellSearch], hardware: str) -> pd.DataFrame:
    """One row per cell, in grid order (the CSV of `csbp map`)."""
    return pd.DataFrame([cell_row(a, hardware) for a in answers], columns=list(COLUMNS))


def is_tie(row) -> bool:
    """The winner beats the best plan on the other side of BP by less than TIE (a coin toss the
    planner settles by memory, then traffic)."""
    if not row.feasible or pd.isna(row.bp_speedup):
        return False
    return 1 / TIE < row.bp_speedup < TIE


def cell_text(row) -> str:
    """The label a cell carries on the heatmap: BP's speedup, or why there is none."""
    if not row.feasible:
        return "none fits"
    if pd.isna(row.best_bp_tokens_per_s):
        return "no BP fits"
    if pd.isna(row.best_no_bp_tokens_per_s):
        return "BP only"
    return f"{row.bp_speedup:.2f}x"


def objective_table(answers: list[CellSearch], hardware: str) -> pd.DataFrame:
    """One row per cell and objective (the CSV of `csbp map --objectives`): the map's row, its
    objective, and `vs_first`, its best tokens/s over the first objective's at the same cell."""
    df = pd.DataFrame([cell_row(a, hardware) | {"objective": a.cell.objective} for a in answers],
                      columns=["objective", *COLUMNS])
    first = answers[0].cell.objective if answers else None
    base = {(r.seq_len, r.gpus): r.tokens_per_s for r in df.itertuples() if r.objective == first}
    df["vs_first"] = [t / base[(L, g)] if pd.notna(t) and pd.notna(base.get((L, g))) else None
                      for t, L, g in zip(df.tokens_per_s, df.seq_len, df.gpus)]
    return df


def objective_cell_text(rows: pd.DataFrame) -> str:
    """One cell of the objective comparison: each objective's best tokens/s (and vs the first)."""
    out = []
    for r in rows.itertuples():
        if not r.feasible:
            out.append(f"{r.objective} none fits")
            continue
        ratio = f" ({r.vs_first:.2f}x)" if pd.notna(r.vs_first) and out else ""
        out.append(f"{r.objective} {r.tokens_per_s / 1e3:,.1f}k{ratio}")
    return " / ".join(out)
