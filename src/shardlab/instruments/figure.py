"""The course's figures: one canvas and one palette, so every plot reads the same way.

Figures are built with ``matplotlib.figure.Figure`` on an Agg canvas, never through pyplot:
nothing global is switched (a notebook keeps its backend), nothing piles up in pyplot's figure
list, and a returned figure displays once in Jupyter (via ``_repr_png_``). Series are told apart
by hatches, markers and line styles as well as colour, so a figure reads in greyscale and for
colour-blind readers.
"""

from __future__ import annotations

import io

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
HATCHES = ["//", "..", "xx", "\\\\", "oo", "--", "++", "**"]
MARKERS = ["o", "s", "^", "D", "v", "P"]
LINESTYLES = ["-", "--", "-.", ":"]
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


class _Figure(Figure):
    """A Figure that shows itself in Jupyter without pyplot (and only once)."""

    def _repr_png_(self):
        buf = io.BytesIO()
        self.savefig(buf, format="png")
        return buf.getvalue()


def new_figure(width=7.0, height=4.0, **kwargs) -> Figure:
    fig = _Figure(figsize=(width, height), layout="constrained", **kwargs)
    FigureCanvasAgg(fig)
    return fig


def scale(unit: str) -> float:
    """Bytes per ``unit`` (``"MB"``: 1e6), or a clear error naming the units there are."""
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}; choose one of {list(UNITS)}")
    return UNITS[unit]
