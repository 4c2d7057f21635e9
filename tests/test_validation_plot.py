"""The validation chart shows every plan's point (drawn above the band and the y = x line, inside
the axes, in the saved PNG's pixels) and its tick labels do not run into each other."""

import itertools

import matplotlib.image
import numpy as np
import pytest
from matplotlib.collections import PathCollection
from matplotlib.colors import to_rgb

from csbp.runtime.validation.validation_plot import COLORS, figure, log_ticks, plot


def _rows() -> list[dict]:
    """16 plans, every error inside the ±15 % band (where the points used to vanish)."""
    rows = []
    kinds, worlds, lengths = ("dp", "cp", "bp", "csbp"), (2, 4), (512, 1024)
    for n, (world, L, kind) in enumerate(itertools.product(worlds, lengths, kinds)):
        measured = 0.15 * 1.25**n  # 150 ms ... 4.3 s
        rows.append({"plan": f"{kind}={world}", "kind": kind, "world": world, "seq_len": L,
                     "measured_step_s": measured, "predicted_step_s": measured * (1 + 0.012 * (n - 8)),
                     "normalised_step_s": measured * 0.95})
    return rows


def _scatter_points(ax) -> set[tuple[float, float]]:
    return {(round(x, 9), round(y, 9)) for c in ax.collections if isinstance(c, PathCollection)
            for x, y in c.get_offsets()}


def test_every_point_is_drawn_inside_the_axes_above_the_band(tmp_path):
    rows = _rows()
    path = tmp_path / "validation.png"
    fig = plot(rows, path, "test")
    axes = fig.get_axes()
    assert len(axes) == 2  # raw, and normalised by the reference probe
    image = matplotlib.image.imread(path)[..., :3]
    height = image.shape[0]
    markers = [np.array(to_rgb(c)) for c in COLORS.values()]
    for ax, key in zip(axes, ("measured_step_s", "normalised_step_s")):
        expected = {(round(r[key], 9), round(r["predicted_step_s"], 9)) for r in rows}
        assert _scatter_points(ax) == expected
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        assert all(x0 < x < x1 and y0 < y < y1 for x, y in expected)
        top = max(a.get_zorder() for a in ax.get_children() if not isinstance(a, PathCollection)
                  and a in ax.lines + ax.collections)
        assert all(c.get_zorder() > top for c in ax.collections if isinstance(c, PathCollection))
        for point in expected:  # the saved PNG: a marker's colour at the centre of every point
            px, py = ax.transData.transform(point)
            pixel = image[int(round(height - py)), int(round(px))]
            assert min(np.abs(pixel - m).max() for m in markers) < 0.05, (point, pixel)


def test_one_panel_without_the_probe():
    rows = [r | {"normalised_step_s": None} for r in _rows()]
    assert len(figure(rows, "test").get_axes()) == 1


def test_tick_labels_are_few_plain_and_apart():
    fig = figure(_rows(), "test")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.get_axes():
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t for t in axis.get_ticklabels(which="both") if t.get_visible() and t.get_text()]
            assert 2 <= len(labels) <= 6
            assert all(t.get_text().replace(".", "").isdigit() for t in labels)  # plain ms
            boxes = [t.get_window_extent(renderer) for t in labels]
            assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))


@pytest.mark.parametrize("lo, hi", [(0.1, 6.0), (0.15, 0.3), (0.001, 100.0), (2.0, 4.5)])
def test_log_ticks_are_round_and_within_range(lo, hi):
    ticks = log_ticks(lo, hi)
    assert 1 <= len(ticks) <= 6 and all(lo <= t <= hi for t in ticks) and ticks == sorted(ticks)


def test_every_world_size_has_its_own_colour():
    from csbp.runtime.validation.validation_plot import world_color

    assert world_color(2) == COLORS[2] and world_color(4) == COLORS[4]
    colours = [world_color(w) for w in (1, 2, 3, 4, 8)]
    assert len(set(colours[:4])) == 4  # a world the suite adds later is not drawn in another's colour
