"""`csbp plan --sensitivity` as text: one row per input, one column per scaled value, flips named."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from csbp.simulator.grids.decision_map import FAMILY_NAMES
from csbp.simulator.grids.sensitivity import FACTORS, NOT_MODELLED, Outcome, Sensitivity


def _cell(o: Outcome | None) -> str:
    if o is None:
        return "-"
    if o.winner is None:
        return "[red]nothing fits[/]"
    speed = f"{o.speedup:.2f}x" if o.speedup is not None else "BP only"
    text = f"{FAMILY_NAMES[o.family]} {speed}"
    if o.family_flipped:
        return f"[bold red]{text} family flip[/]"
    return f"[bold red]{text} flip[/]" if o.flipped else text


def print_sensitivity(out: Console, s: Sensitivity) -> None:
    nom = s.nominal
    speed = f"{nom.speedup:.2f}x" if nom.speedup is not None else "no baseline"
    table = Table(title="Sensitivity: recommendation and its speedup over the best no-BP plan, "
                        "each input scaled", box=box.SIMPLE_HEAD,
                  caption=f"closed-form re-ranking of the search's best {s.pool} candidates "
                          "(memory reserve: closed-form re-screen of every candidate at ±20 %); "
                          "flip = another plan wins; family flip = a plan of another family", caption_justify="left")
    table.add_column("input")
    for f in FACTORS:
        table.add_column(f"{(f - 1) * 100:+.0f} %", justify="right")
    for entry in s.inputs:
        if entry.skipped:
            table.add_row(entry.label, f"[dim]not varied: {entry.skipped}[/]", *[""] * (len(FACTORS) - 1))
            continue
        by = {o.factor: o for o in entry.outcomes}
        table.add_row(entry.label, *[_cell(by.get(f)) for f in FACTORS])
    out.print(f"\n[bold]Sensitivity[/] (nominal, closed form: {nom.winner}, "
              f"{FAMILY_NAMES.get(nom.family or '', '-')} {speed})", highlight=False)
    if nom.winner != s.engine_pick:
        out.print(f"  the closed form ranks {nom.winner} first at the nominal figures; the search's "
                  f"engine picked {s.engine_pick} (flips below are against the closed form)",
                  highlight=False)
    out.print(table)
    for entry in s.inputs:
        for o in entry.outcomes:
            if o.flipped:
                how = f"{(o.factor - 1) * 100:+.0f} %"
                family = (f"family {FAMILY_NAMES[nom.family]} -> {FAMILY_NAMES[o.family]}"
                          if o.family_flipped and o.family and nom.family else "same family")
                out.print(f"  [bold red]flip[/]: {entry.label} {how}: "
                          + (f"{o.winner} wins ({family})" if o.winner else "nothing fits")
                          + (f", {o.speedup:.2f}x over {o.baseline}" if o.speedup is not None else ""),
                          highlight=False)
    if not s.flips:
        out.print("  no flip inside ±20 % of any input varied", highlight=False)
    for name, why in NOT_MODELLED.items():
        out.print(f"  [dim]{name}: not varied: {why}[/]", highlight=False)
