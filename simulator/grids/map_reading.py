"""The one-paragraph reading of a decision map, written from the map's own cells.

A user looking at a map wants the borders in words: which family wins where, between which
contexts the winner changes at each cluster size, where BP gains enough to matter, where it only
ties, where it is the only thing that fits and where nothing does. Every figure comes from the
table, so the text stays true when the model, the hardware or the planner changes.
"""

from __future__ import annotations

import pandas as pd

from csbp.simulator.grids.decision_map import FAMILY_NAMES, TIE
from csbp.simulator.planner.planner import FAMILIES, fmt_tokens

NOTABLE = 1.05  # a gain worth naming [U: a presentation threshold above run-to-run noise, not fitted]


def _ranges(values: list[int], universe: list[int]) -> str:
    """'8-32, 128' for GPU counts: runs of consecutive entries of `universe` joined."""
    idx = sorted(universe.index(v) for v in values)
    runs, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            runs.append(str(universe[start]) if start == a else f"{universe[start]}-{universe[a]}")
            start = b
    return ", ".join(runs)


def where(cells: pd.DataFrame, counts: list[int], lengths: list[int]) -> str:
    """'64K-256K on 8-32 GPUs and 1M on 8 GPUs': a set of cells, consecutive contexts with the
    same GPU counts merged."""
    gpus_at = {int(L): _ranges(sorted(int(g) for g in sub.gpus), counts)
               for L, sub in cells.groupby("seq_len")}
    runs: list[list[int]] = []
    for L in lengths:
        if L not in gpus_at:
            continue
        prev = runs[-1][-1] if runs else None
        if prev is not None and lengths.index(prev) == lengths.index(L) - 1 and gpus_at[prev] == gpus_at[L]:
            runs[-1].append(L)
        else:
            runs.append([L])
    parts = [(fmt_tokens(r[0]) if len(r) == 1 else f"{fmt_tokens(r[0])}-{fmt_tokens(r[-1])}")
             + f" on {gpus_at[r[0]]} GPUs" for r in runs]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _name(row) -> str:
    return FAMILY_NAMES[row.family] if row.feasible else "nothing"


def _transitions(sub: pd.DataFrame) -> str:
    """The winner along context at one GPU count, e.g. 'DP gives way to CSBP between 64K and 128K'."""
    sub = sub.sort_values("seq_len")
    steps, prev = [], None
    for row in sub.itertuples():
        if prev is not None and _name(row) != _name(prev):
            a, b = fmt_tokens(int(prev.seq_len)), fmt_tokens(int(row.seq_len))
            if _name(prev) == "nothing":
                steps.append(f"nothing fits up to {a}, {_name(row)} wins from {b}")
            elif _name(row) == "nothing":
                steps.append(f"{_name(prev)} wins up to {a}, nothing fits from {b}")
            else:
                steps.append(f"{_name(prev)} gives way to {_name(row)} between {a} and {b}")
        prev = row
    if steps:
        return ", then ".join(steps)
    first = _name(sub.iloc[0])
    return "nothing fits at any context" if first == "nothing" else f"{first} wins at every context"


def _crossovers(df: pd.DataFrame, counts: list[int]) -> str:
    if len(df.seq_len.unique()) < 2:
        return ""
    by_text: dict[str, list[int]] = {}
    for g, sub in df.groupby("gpus"):
        by_text.setdefault(_transitions(sub), []).append(int(g))
    parts = [f"at {_ranges(gs, counts)} GPUs {text}" for text, gs in by_text.items()]
    return "Along context, " + "; ".join(parts) + "."


def _cells(n: int) -> str:
    return f"{n} cell" if n == 1 else f"{n} cells"


def _counts(df: pd.DataFrame) -> str:
    ok = df[df.feasible]
    parts = []
    for fam in FAMILIES:
        mine = ok[ok.family == fam]
        if len(mine):
            extra = mine[mine.family_label.str.contains(r"\+")]
            with_mp = f" (with TP/EP in {len(extra)})" if len(extra) else ""
            parts.append(f"{FAMILY_NAMES[fam]} in {len(mine)}{with_mp}")
    text = f"the planner recommends {', '.join(parts) or 'nothing'} of {len(df)} cells"
    if len(ok) < len(df):
        text += f"; nothing fits in {len(df) - len(ok)}"
    return text


def _bp_worth(df: pd.DataFrame, counts: list[int], lengths: list[int]) -> list[str]:
    both = df[df.bp_speedup.notna()]
    out = []
    pays = both[both.bp_speedup >= NOTABLE]
    if len(pays) == 1:
        top = pays.iloc[0]
        out.append(f"BP gains at least {(NOTABLE - 1) * 100:.0f} % over the best plan without it only "
                   f"at {top.context} on {top.gpus} GPUs ({top.bp_speedup:.2f}x, {top.best_bp_plan})")
    elif len(pays):
        top = pays.loc[pays.bp_speedup.idxmax()]
        out.append(f"BP gains at least {(NOTABLE - 1) * 100:.0f} % over the best plan without it at "
                   f"{where(pays, counts, lengths)}, most at {top.context} on {top.gpus} GPUs "
                   f"({top.bp_speedup:.2f}x, {top.best_bp_plan})")
    else:
        best = both.bp_speedup.max() if len(both) else None
        out.append(f"BP never gains {(NOTABLE - 1) * 100:.0f} % or more" + (f" (at best {best:.3f}x)" if best is not None else ""))
    small = both[(both.bp_speedup >= TIE) & (both.bp_speedup < NOTABLE)]
    if len(small):
        out.append(f"it gains {(TIE - 1) * 100:.1f}-{(NOTABLE - 1) * 100:.0f} % at {where(small, counts, lengths)}")
    ties = both[(both.bp_speedup < TIE) & (both.bp_speedup > 1 / TIE)]
    if len(ties):
        picked = ties[ties.family.isin(["bp", "csbp"])]
        recommended = ("" if picked.empty else " (the planner still recommends BP there, by less than the tie)"
                       if len(picked) == len(ties) else
                       f" (the planner still recommends BP in {len(picked)} of them, by less than the tie)")
        out.append(f"it ties the best no-BP plan within {(TIE - 1) * 100:.1f} % at "
                   f"{where(ties, counts, lengths)}{recommended}")
    loses = both[both.bp_speedup <= 1 / TIE]
    if len(loses):
        worst = loses.loc[loses.bp_speedup.idxmin()]
        out.append(f"it loses at {where(loses, counts, lengths)} (down to {worst.bp_speedup:.2f}x at "
                   f"{worst.context} on {worst.gpus} GPUs)")
    only = df[df.feasible & df.best_no_bp_tokens_per_s.isna()]
    if len(only):
        out.append(f"only BP plans fit at {where(only, counts, lengths)}")
    no_bp = df[df.feasible & df.best_bp_tokens_per_s.isna()]
    if len(no_bp):
        out.append(f"no BP plan fits at {where(no_bp, counts, lengths)}")
    return out


def _per_gpu(cells: pd.DataFrame) -> pd.Series:
    return cells.seq_len / cells.gpus


def _border(df: pd.DataFrame) -> str:
    """When BP's gains and its ties (or losses) part along one line of context per GPU, say where:
    the quantity that decides whether attention hides the K/V traffic."""
    both = df[df.bp_speedup.notna()]
    gains = both[both.bp_speedup >= TIE]
    rest = both[both.bp_speedup < TIE]
    if gains.empty or rest.empty:
        return ""
    g, r = _per_gpu(gains), _per_gpu(rest)
    if g.max() < r.min():
        return (f"The border follows the context per GPU: BP gains where a GPU holds at most "
                f"{fmt_tokens(int(g.max()))} tokens of context and not from {fmt_tokens(int(r.min()))} on.")
    if r.max() < g.min():
        return (f"The border follows the context per GPU: BP gains where a GPU holds at least "
                f"{fmt_tokens(int(g.min()))} tokens of context and not below {fmt_tokens(int(r.max()))}.")
    return ""


def _nothing(df: pd.DataFrame, counts: list[int], lengths: list[int]) -> str:
    bad = df[~df.feasible]
    if bad.empty:
        return ""
    reasons = sorted({r.split(" (")[0] for r in bad.reason.dropna()})
    return f"Nothing fits at {where(bad, counts, lengths)} ({'; '.join(reasons)})."


def read_map(df: pd.DataFrame) -> str:
    """One paragraph per model of the table (a `csbp map` has one)."""
    out = []
    counts = sorted(int(g) for g in df.gpus.unique())
    lengths = sorted(int(L) for L in df.seq_len.unique())
    for model, sub in df.groupby("model", sort=False):
        head = f"{model} on {sub.hardware.iloc[0]}: {_counts(sub)}."
        worth = _bp_worth(sub, counts, lengths)
        text = [head, _crossovers(sub, counts)]
        if worth:
            text.append(worth[0][0].upper() + "; ".join(worth)[1:] + ".")
        text.append(_border(sub))
        text.append(_nothing(sub, counts, lengths))
        out.append(" ".join(t for t in text if t))
    return "\n\n".join(out)
