"""The course's plots: formula beside measurement, one function per picture, each returning a Figure.

Every figure has a title and labelled axes with units, and tells its series apart by hatches,
markers and text as well as colour, so it reads in greyscale and for colour-blind readers.
Figures are built with ``matplotlib.figure.Figure`` on an Agg canvas, never through pyplot:
nothing global is switched (a notebook keeps its backend), nothing piles up in pyplot's
figure list, and a returned figure displays once in Jupyter (via ``_repr_png_``).

Input formats of the two measured plots, which ``shardlab.trace`` and ``shardlab.track_memory``
produce:

* ``timeline(events)``: a list of dicts, one per interval, with ``rank`` (int), ``lane``
  (``"compute"`` or ``"comm"``), ``start`` and ``end`` (seconds on one clock for all ranks, such
  as ``time.perf_counter()`` on one machine), and optionally ``kind`` (``"forward"``,
  ``"backward"``, ``"step"``, ``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"``,
  ``"broadcast"``), ``unit`` (e.g. ``"blocks.0"``) and ``name`` (the bar's text; defaults to
  ``kind unit``).
* ``memory_over_time(samples)``: a list of dicts ``{"rank": int, "time": seconds, "bytes":
  {category: bytes}}`` (categories such as ``params``, ``grads``, ``optimizer``, ``gathered``,
  ``activations``), or a mapping ``rank -> [(time, {category: bytes}), ...]``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from shardlab.instruments import memory_math as mm
from shardlab.instruments.measured import require_measured

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
HATCHES = ["//", "..", "xx", "\\\\", "oo", "--", "++", "**"]
MARKERS = ["o", "s", "^", "D", "v", "P"]
LINESTYLES = ["-", "--", "-.", ":"]
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
KIND_STYLE = {  # timeline bars: hatch per kind, so lanes read without colour
    "forward": ("#4C72B0", ""), "backward": ("#55A868", ""), "step": ("#8172B3", ""),
    "all_gather": ("#DD8452", "//"), "reduce_scatter": ("#C44E52", "\\\\"),
    "all_reduce": ("#937860", "xx"), "broadcast": ("#8C8C8C", ".."),
}


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


def _scale(unit: str) -> float:
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}; choose one of {list(UNITS)}")
    return UNITS[unit]


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
    _stacked_bars(ax, formula, measured, _scale(unit), "{:.3g}")
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


def _label(e: Mapping) -> str:
    """A bar's text: its ``name``, else its unit (the kind is in the legend), else its kind."""
    return str(e.get("name") or e.get("unit") or e.get("kind") or "")


def _pack(intervals: list) -> list[list]:
    """Sub-rows in which no two intervals overlap (greedy, by start): a unit that contains
    others, like the root around the blocks, or async collectives in flight together, each
    get their own row instead of hiding one another."""
    rows: list[list] = []
    for e in sorted(intervals, key=lambda e: (e["start"], -e["end"])):
        row = next((r for r in rows if r[-1]["end"] <= e["start"]), None)
        rows.append([e]) if row is None else row.append(e)
    return rows or [[]]


INSTANT_MARKERS = {"free": ("v", "black"), "backward_done": ("|", "#55A868")}


def timeline(events, *, title="Per-rank timeline: compute and communication", time_unit="ms",
             note: str | None = None) -> Figure:
    """A Gantt chart: for each rank, a compute lane and a communication lane (format in module doc).

    Intervals that overlap within a lane go to sub-rows; instants (``start == end``, e.g.
    ``free``) are drawn as markers. Bars are labelled with their unit when they are wide enough.
    ``note`` (how to read the chart) goes under the legend, so the title stays one line.
    """
    events = list(events)
    if not events:
        raise ValueError("timeline needs at least one event")
    for e in events:
        missing = {"rank", "lane", "start", "end"} - set(e)
        if missing or e["lane"] not in ("compute", "comm"):
            raise ValueError(f"timeline event {e!r} needs rank, start, end and lane 'compute' or 'comm'")
    scale = {"s": 1, "ms": 1e3, "us": 1e6}[time_unit]
    t0 = min(e["start"] for e in events)
    span = max(max(e["end"] for e in events) - t0, 1e-12) * scale
    ranks = sorted({e["rank"] for e in events})
    lanes = {(r, lane): _pack([e for e in events if e["rank"] == r and e["lane"] == lane and e["end"] > e["start"]])
             for r in ranks for lane in ("compute", "comm")}
    fig = new_figure(10.0, 1.4 + 0.3 * sum(map(len, lanes.values())) + 0.3 * len(ranks))
    ax = fig.add_subplot()
    yticks, ylabels, seen, y = [], [], {}, 0.0
    for rank in ranks:
        for lane in ("compute", "comm"):
            rows = lanes[(rank, lane)]
            yticks.append(y - (len(rows) - 1) / 2)
            ylabels.append(f"rank {rank} {lane}")
            for k, row in enumerate(rows):
                for e in row:
                    kind = e.get("kind") or lane
                    color, hatch = KIND_STYLE.get(kind, ("#BBBBBB", "" if lane == "compute" else "++"))
                    x, w = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
                    ax.barh(y - k, w, left=x, height=0.8, color=color, hatch=hatch, edgecolor="black", linewidth=0.5)
                    seen.setdefault(kind, Patch(facecolor=color, hatch=hatch, edgecolor="black", label=kind))
                    text = _label(e)
                    if text and w / span > 0.009 * (len(text) + 1):  # only where it fits (~6 px a character)
                        ax.text(x + w / 2, y - k, text, ha="center", va="center", fontsize=8, clip_on=True,
                                bbox=dict(facecolor="white", alpha=0.75, linewidth=0, pad=0.6))
            for e in (e for e in events if e["rank"] == rank and e["lane"] == lane and e["end"] <= e["start"]):
                kind = e.get("kind") or "instant"
                marker, color = INSTANT_MARKERS.get(kind, ("d", "black"))
                ax.plot([(e["start"] - t0) * scale], [y + 0.5], marker=marker, color=color, markersize=5,
                        linestyle="none", label=kind)
                seen.setdefault(kind, ax.lines[-1])
            y -= len(rows) + 0.4
        ax.axhline(y + 0.6, color="grey", linewidth=0.6)
        y -= 0.4
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(y + 0.6, 1.0)
    ax.set_xlim(left=0)
    ax.set_xlabel(f"time since first event ({time_unit})")
    ax.set_ylabel("rank and lane")
    ax.set_title(title)
    legend = ax.legend(handles=list(seen.values()), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if note:
        ax.add_artist(legend)
        ax.annotate(note, xy=(1.01, 0.0), xycoords="axes fraction", ha="left", va="bottom", fontsize=7.5,
                    wrap=False)
    return fig


def _samples_by_rank(samples) -> dict:
    out: dict[int, list] = {}
    if isinstance(samples, Mapping):
        for rank, rows in samples.items():
            out[rank] = [(t, dict(b)) for t, b in rows]
    else:
        for s in samples:
            if not {"rank", "time", "bytes"} <= set(s):
                raise ValueError(f"memory sample {s!r} needs rank, time and bytes ({{category: bytes}})")
            out.setdefault(s["rank"], []).append((s["time"], dict(s["bytes"])))
    if not out or not any(out.values()):
        raise ValueError("memory_over_time needs at least one sample")
    return {r: sorted(rows, key=lambda row: row[0]) for r, rows in sorted(out.items())}


def memory_over_time(samples, *, unit="MB", title="Memory over time, by category", marks=()) -> Figure:
    """Stacked memory per category over time, one panel per rank (format in module doc).

    Each sample holds until the next one (a step plot), as memory changes at events.

    ``marks`` is an optional list of ``(time, label)`` drawn as dotted vertical lines, e.g.
    the start of backward or the optimizer step.
    """
    by_rank = _samples_by_rank(samples)
    divisor = _scale(unit)
    t0 = min(rows[0][0] for rows in by_rank.values())
    cats = list(dict.fromkeys(c for rows in by_rank.values() for _, b in rows for c in b))
    fig = new_figure(8.0, 1.2 + 2.2 * len(by_rank))
    axes = fig.subplots(len(by_rank), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (rank, rows) in zip(axes, by_rank.items()):
        ts = [(t - t0) * 1e3 for t, _ in rows]
        ys = [[b.get(c, 0) / divisor for _, b in rows] for c in cats]
        polys = ax.stackplot(ts, ys, labels=cats, colors=[COLORS[i % 8] for i in range(len(cats))],
                             edgecolor="black", linewidth=0.4, step="post")
        for i, p in enumerate(polys):
            p.set_hatch(HATCHES[i % 8])
        for t, text in marks:
            ax.axvline((t - t0) * 1e3, color="black", linestyle=":", linewidth=1)
            ax.annotate(text, ((t - t0) * 1e3, 1), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=7)
        ax.set_ylabel(f"rank {rank} ({unit})")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes[-1].set_xlabel("time since first sample (ms)")
    fig.suptitle(title)
    return fig
