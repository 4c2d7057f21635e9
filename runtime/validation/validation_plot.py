"""The predicted-vs-measured chart of `csbp validate`: one point per plan, raw and normalised.

Drawn so that every point shows: points above the ±15 % band and the y = x line (the band once
hid every point inside it, which on a good run is all of them), axis limits from the data, and
few plain millisecond ticks on the log axes (matplotlib's own labels every minor tick of a
range under a decade, and the labels ran into each other).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

MARKERS = {"dp": "o", "cp": "s", "bp": "^", "csbp": "D"}
COLORS = {2: "tab:blue", 4: "tab:orange"}
BAND = 0.15  # the shaded band: a guide for the eye, not a pass mark
MAX_TICKS = 6


def figure(rows: list[dict], title: str):
    """The chart as a matplotlib Figure: raw errors, and beside them (when the suite timed the
    reference probe) the same plans with the host's drift taken out."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    panels = [("measured_step_s", "as measured")]
    if rows and all(r.get("normalised_step_s") for r in rows):
        panels.append(("normalised_step_s", "normalised by the reference probe"))
    values = [v for r in rows for key, _ in panels for v in (r[key], r["predicted_step_s"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    fig = Figure(figsize=(6 * len(panels), 6), dpi=120)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, what) in zip(axes, panels):
        errors = [abs(r["predicted_step_s"] / r[key] - 1) for r in rows]
        _panel(ax, rows, key, lo, hi)
        by_world = ", ".join(  # a bias of one world size shows as its mean, signed
            f"world {w} {statistics.fmean(r['predicted_step_s'] / r[key] - 1 for r in rows if r['world'] == w):+.0%}"
            for w in sorted({r["world"] for r in rows}))
        ax.set_title(f"{what}: median |error| {statistics.median(errors):.1%}, max {max(errors):.1%}\n"
                     f"mean error by world size: {by_world}", fontsize=10)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(rows: list[dict], path: Path, title: str):
    """Save the chart as a PNG; returns the Figure (its transforms place each point's pixel)."""
    fig = figure(rows, title)
    fig.savefig(path, dpi=fig.dpi)
    return fig


def _panel(ax, rows: list[dict], key: str, lo: float, hi: float) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ax.fill_between([lo, hi], [lo / (1 + BAND), hi / (1 + BAND)], [lo * (1 + BAND), hi * (1 + BAND)],
                    color="0.9", zorder=1, label=f"±{BAND:.0%}")
    ax.plot([lo, hi], [lo, hi], "k-", lw=1, zorder=2, label="y = x")
    for world in sorted({r["world"] for r in rows}):
        color = world_color(world)
        for kind, marker in MARKERS.items():
            pts = [(r[key], r["predicted_step_s"]) for r in rows if r["world"] == world and r["kind"] == kind]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, color=color, edgecolors="black", linewidths=0.5,
                           zorder=3, label=f"{kind}, world {world}")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured step time (ms)",
           ylabel="predicted step time (ms)")
    ticks = log_ticks(lo, hi)
    for axis in (ax.xaxis, ax.yaxis):  # after the scale, which brings its own locators
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1e3:g}"))
        axis.set_minor_formatter(NullFormatter())


def world_color(world: int) -> str:
    """Each world size its own colour (the errors split by world size when the host model of
    how ranks share it is off): the fixed ones for the suite's 2 and 4, then the cycle."""
    spare = [c for c in ("tab:green", "tab:red", "tab:purple", "tab:brown") if c not in COLORS.values()]
    return COLORS.get(world) or spare[world % len(spare)]


def log_ticks(lo: float, hi: float, most: int = MAX_TICKS) -> list[float]:
    """Round values (1-2-5 and sparser series per decade) between `lo` and `hi`, at most `most`."""
    ticks: list[float] = []
    for mantissas in ((1, 1.5, 2, 3, 5, 7), (1, 2, 5), (1, 3), (1,)):
        ticks = [m * 10.0**e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                 for m in mantissas if lo <= m * 10.0**e <= hi]
        if len(ticks) <= most:
            return ticks
    return ticks[:: math.ceil(len(ticks) / most)]
