"""The few chart shapes the studies draw, as PNG files (matplotlib, Agg backend: no display)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def lines(path: Path, title: str, panels: list[tuple[str, list[str], dict[str, list]]],
          xlabel: str) -> str:
    """One panel per (y label, x tick labels, {series: values}); missing values (None) are gaps."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, (ylabel, xs, series) in zip(axes[0], panels):
        for name, ys in series.items():
            ax.plot(range(len(xs)), [float("nan") if y is None else y for y in ys], marker="o", label=name)
        ax.set_xticks(range(len(xs)), xs)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, title, path)


def bars(path: Path, title: str, panels: list[tuple[str, list[str], dict[str, list]]]) -> str:
    """Grouped bars, one panel per (y label, categories, {series: values}); None draws nothing."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.6 * len(panels), 4.2), squeeze=False)
    for ax, (ylabel, cats, series) in zip(axes[0], panels):
        width = 0.8 / max(1, len(series))
        for i, (name, ys) in enumerate(series.items()):
            xs = [c + (i - (len(series) - 1) / 2) * width for c in range(len(cats))]
            ax.bar(xs, [0 if y is None else y for y in ys], width, label=name)
        ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, title, path)


def _save(fig, title: str, path: Path) -> str:
    """Title, layout, write and free one figure: every chart ends the same way."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
