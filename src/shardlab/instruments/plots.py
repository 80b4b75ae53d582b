"""The course's plots: formula beside measurement, one function per picture, each returning a Figure.

Every figure has a title and labelled axes with units. Here: memory and communication per stage
as bars (the formula's bar beside the measured one) and the stage crossover against model size.
The canvas and palette are :mod:`shardlab.instruments.figure`'s; the plots over time, ``timeline``
and ``memory_over_time``, are :mod:`shardlab.instruments.time_plots`' and importable from here too.
"""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from shardlab.instruments import memory_math as mm
from shardlab.instruments.figure import (
    COLORS,
    HATCHES,
    LINESTYLES,
    MARKERS,
    UNITS,
    new_figure,
    scale,
)
from shardlab.instruments.measured import require_measured
from shardlab.instruments.time_plots import INSTANT_MARKERS, KIND_STYLE, memory_over_time, timeline

__all__ = ["COLORS", "HATCHES", "INSTANT_MARKERS", "KIND_STYLE", "LINESTYLES", "MARKERS", "UNITS", "comm_volume",
           "crossover", "memory_bars", "memory_over_time", "new_figure", "timeline"]


def _parts(value) -> dict:
    """A bar is a number, or a mapping category -> number (stacked)."""
    if isinstance(value, Mapping):
        return dict(value)
    return {"total": value}


def _stacked_bars(ax, formula: Mapping, measured: Mapping | None, divisor: float, fmt: str):
    """Grouped bars per stage (formula, then measured), each stacked by category."""
    if not formula:
        raise ValueError("nothing to plot: the formula dict is empty")
    for stage, value in (measured or {}).items():  # a measured bar must be a measurement
        for cat, v in _parts(value).items():
            require_measured(v, f"the measured bar of {stage!r} ({cat})")
    series = [("formula", formula)] + ([("measured", measured)] if measured else [])
    stages = list(formula) + [s for s in (measured or {}) if s not in formula]
    cats = list(dict.fromkeys(c for _, d in series for v in d.values() for c in _parts(v)))
    width = 0.8 / len(series)
    ticks, labels = [], []
    for j, (source, data) in enumerate(series):
        for i, stage in enumerate(stages):
            if stage not in data:
                continue
            x = i + (j - (len(series) - 1) / 2) * width
            bottom = 0.0
            for c, cat in enumerate(cats):
                v = _parts(data[stage]).get(cat, 0) / divisor
                ax.bar(x, v, width * 0.92, bottom=bottom, color=COLORS[c % 8], hatch=HATCHES[c % 8],
                       edgecolor="black", linewidth=0.6, alpha=1.0 if source == "formula" else 0.55)
                bottom += v
            ax.annotate(fmt.format(bottom), (x, bottom), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)
            ticks.append(x)
            name = mm.STAGE_LABELS.get(stage, str(stage))
            labels.append(f"{name}\n{source}" if len(series) > 1 else name)
    ax.set_xticks(ticks, labels, fontsize=8 if len(series) > 1 else 10)
    ax.margins(y=0.12)
    if cats != ["total"]:
        handles = [Patch(facecolor=COLORS[c % 8], hatch=HATCHES[c % 8], edgecolor="black", label=cat)
                   for c, cat in enumerate(cats)]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def memory_bars(formula: Mapping, measured: Mapping | None = None, *, unit="GB", title=None,
                subtitle="") -> Figure:
    """Per-device memory for each stage: the formula's bar beside the measured one.

    ``formula`` and ``measured`` map a stage (``"ddp"``, ``"zero1"``, ...) to bytes, or to
    ``{"params": b, "grads": b, "optimizer": b}`` for stacked bars (what
    :func:`shardlab.instruments.memory_math.model_state_breakdown` returns). Measured bars are paler.
    """
    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    _stacked_bars(ax, formula, measured, scale(unit), "{:.3g}")
    ax.set_title(title or "Model-state memory per device" + (f" ({subtitle})" if subtitle else ""))
    ax.set_xlabel("stage")
    ax.set_ylabel(f"memory per device ({unit})")
    return fig


def comm_volume(volumes: Mapping | None = None, measured: Mapping | None = None, *, params=1.0,
                ylabel="elements sent+received per rank per step (× Ψ)", divisor=1.0, title=None) -> Figure:
    """Communication per step for each stage, stacked by collective.

    With no ``volumes``, draws the paper's counts from :data:`shardlab.instruments.memory_math.COMM_COLLECTIVES`
    for ``params`` (1.0 = in units of Ψ): 2Ψ, 2Ψ, 2Ψ, 3Ψ. Otherwise ``volumes`` (and
    ``measured``, e.g. from ``count_comm``) map stage -> number or {collective: number}.
    """
    if volumes is None:
        volumes = {s: {name: k * params for name, k in cols} for s, cols in mm.COMM_COLLECTIVES.items()}
    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    _stacked_bars(ax, volumes, measured, divisor, "{:.3g}")
    ax.set_title(title or "Communication per training step, by stage")
    ax.set_xlabel("stage")
    ax.set_ylabel(ylabel)
    return fig


def crossover(world_size=8, gpu_memory_gb=80.0, recipe="mixed-adam", sizes=None, title=None) -> Figure:
    """Per-device model-state memory against model size, for each stage, with a GPU's memory line.

    Where a stage's line crosses the GPU line is the largest model it can hold (before
    activations): DDP stops first, so below that size sharding only adds communication.
    """
    if not gpu_memory_gb > 0:
        raise ValueError(f"gpu_memory_gb must be positive, got {gpu_memory_gb!r}")
    r = mm.recipe(recipe)
    sizes = list(sizes) if sizes is not None else [10 ** (8 + i / 8) for i in range(33)]  # 100M..1T
    fig = new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    for i, stage in enumerate(mm.STAGES):
        ys = [mm.model_state_bytes(p, world_size, r)[stage] / mm.GB for p in sizes]
        label = f"{mm.STAGE_LABELS[stage]}: {mm.formula_text(stage, r)}"
        ax.loglog(sizes, ys, LINESTYLES[i], marker=MARKERS[i], markevery=4, color=COLORS[i], label=label)
        per_param = mm.model_state_bytes(1, world_size, r)[stage]
        fits = gpu_memory_gb * mm.GB / per_param
        if sizes[0] <= fits <= sizes[-1]:
            ax.plot([fits], [gpu_memory_gb], marker=MARKERS[i], color="black", markersize=8, fillstyle="none")
            # Beside its own marker: the limits of neighbouring stages lie close on a log axis,
            # so the first two go left of their marker and below the line, the others right.
            left, below = i < 2, i != 2
            ax.annotate(f"≤{fits / 1e9:.3g}B", (fits, gpu_memory_gb), xytext=(-7 if left else 7, -11 if below else 5),
                        textcoords="offset points", ha="right" if left else "left",
                        va="top" if below else "bottom", fontsize=8, color=COLORS[i],
                        bbox=dict(facecolor="white", alpha=0.85, linewidth=0, pad=0.5))
    ax.axhline(gpu_memory_gb, color="black", linewidth=1.2, linestyle=(0, (6, 2, 1, 2)))
    ax.annotate(f"GPU memory {gpu_memory_gb:g} GB", (sizes[0], gpu_memory_gb), xytext=(2, 4),
                textcoords="offset points", fontsize=8)
    ax.set_title(title or f"Which stage fits? {world_size} devices, {r.name} ({r.bytes_per_param} B/param)")
    ax.set_xlabel("model size Ψ (parameters)")
    ax.set_ylabel("model states per device (GB, 10^9 bytes)")
    ax.grid(True, which="major", linewidth=0.4, alpha=0.5)
    ax.legend(loc="upper left", fontsize=8)
    return fig
