"""How the calibration writes a fitted figure: a value with the measurement it came from, rounded
to the digits a measurement supports, and efficiency curves as the profile reads them."""

from __future__ import annotations

import math
import statistics
from typing import Any

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def figure(value: Any, source: str) -> dict:
    """A profile figure in its YAML form: every number says where it came from."""
    return {"value": value, "source": source}


def rounded(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits: run-to-run noise is percents, not parts per billion."""
    return float(f"{x:.{digits}g}")


def efficiency_curve(points: list[tuple[float, float]], per_decade: int = 3) -> list[list[float]]:
    """Median y per log-spaced bin of x: a curve for `interpolate` (x increasing, 0 < y <= 1)."""
    bins: dict[int, list[tuple[float, float]]] = {}
    for x, y in points:
        bins.setdefault(math.floor(math.log10(x) * per_decade), []).append((x, y))
    curve = []
    for key in sorted(bins):
        xs, ys = zip(*bins[key])
        curve.append([rounded(statistics.median(xs)), rounded(min(1.0, max(1e-4, statistics.median(ys))))])
    return curve
