"""The decision map as a heatmap: colour = the winning family, label = BP's speedup, hatched = nothing fits.

One panel per model of the table, GPU count up, context across, so the crossovers read as the
borders between colours; the label says what BP is worth in each cell (below 1: BP loses), and
'+TP'/'+EP' under it when the winner uses them. A pale cell is a tie (BP and no BP within 0.5 %):
the colour there says which side the planner's tie-break chose, not that it wins.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from csbp.simulator.grids.decision_map import FAMILY_NAMES, TIE, cell_text, is_tie
from csbp.simulator.planner.planner import FAMILIES, fmt_tokens
from csbp.simulator.grids.sweep import FAMILY_COLORS, save_figure


SOLID, PALE = 0.8, 0.3


def draw_map(df: pd.DataFrame, path: Path, subtitle: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    models = list(dict.fromkeys(df.model))
    lengths, counts = sorted(df.seq_len.unique()), sorted(df.gpus.unique())
    width = max(4.5, 1.0 * len(lengths) + 2.0)
    fig, axes = plt.subplots(1, len(models), figsize=(width * len(models), 0.55 * len(counts) + 2.4),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        cells = df[df.model == model].set_index(["gpus", "seq_len"])
        for i, g in enumerate(counts):
            for j, L in enumerate(lengths):
                if (g, L) not in cells.index:
                    continue
                row = cells.loc[(g, L)]
                if row.feasible:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=FAMILY_COLORS[row.family],
                                           alpha=PALE if is_tie(row) else SOLID, edgecolor="white", lw=1.5))
                else:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white",
                                           edgecolor="gray", hatch="////", lw=0))
                text = cell_text(row)
                extra = row.family_label.split("+", 1)[1] if row.feasible and "+" in row.family_label else ""
                ax.text(j, i, text + (f"\n+{extra}" if extra else ""), ha="center", va="center",
                        fontsize=7 if extra else 8)
        ax.set_xlim(-0.5, len(lengths) - 0.5)
        ax.set_ylim(-0.5, len(counts) - 0.5)
        ax.set_xticks(range(len(lengths)), [fmt_tokens(int(L)) for L in lengths])
        ax.set_yticks(range(len(counts)), [str(g) for g in counts])
        ax.set_xlabel("context length")
        ax.set_ylabel("GPUs")
        ax.set_title(f"{model}{subtitle}\ncolour: recommended family; label: best BP / best no-BP",
                     fontsize=9)
    handles = [Patch(color=FAMILY_COLORS[f], alpha=SOLID, label=FAMILY_NAMES[f]) for f in FAMILIES]
    handles.append(Patch(color="gray", alpha=PALE, label=f"pale: tie (within {(TIE - 1) * 100:.1f} %)"))
    handles.append(Patch(facecolor="white", edgecolor="gray", hatch="////", label="nothing fits"))
    axes[0][-1].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return save_figure(fig, path)
